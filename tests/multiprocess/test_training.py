"""SFT then DPO as 2 JAX processes x 4 CPU devices (tools/launch_local.py, gloo collectives on
loopback) against 1 process x 8 devices: the same global batches, so the same losses; one set
of files, written by process 0; checkpoints that either process count resumes; a dead process
that ends the job, and a relaunch that resumes it.

Each 2-process run costs about 10 s of start-up and shutdown beside its steps; the runs are
shared through module fixtures."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ptrain.models import load_hf
from ptrain.stages.policy_pairs import EVAL_PAIRS_FILE, PAIRS_FILE
from ptrain.train.state import split_model

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "tools", "launch_local.py")
DEVICE_FLAG = "--xla_force_host_platform_device_count"

TINY = [
    "recipe=sft_arithmetic",
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.d_ff=48",
    "model.max_seq_len=128",
    "data.generated.n_train=64",
    "data.generated.n_eval=8",
    "train.global_batch_size=8",
    "train.seq_len=128",
    "train.eval_batches=1",
    "train.eval_generate=4",  # sampled by process 0, whose metrics every process gets
    "logging.console=false",
    "logging.tensorboard=false",
    "checkpoint.async_save=false",
]
STEPS = ["train.steps=4", "train.eval_every=2", "checkpoint.every_steps=2"]
# DPO on pairs of the SFT policy's own samples, graded by the verifier (sampled by process 0).
SFT_DPO = [
    "stages=[{name: sft, kind: sft}, {name: dpo, kind: dpo, data: {format: preference}, algo: {dpo: {policy_pairs: 8,"
    " policy_samples: 2, policy_temperature: 1.0, policy_max_new_tokens: 16, policy_eval_pairs: 4}}}]"
]


def env_with_devices(n: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for var in ("PTRAIN_COORDINATOR", "PTRAIN_NUM_PROCESSES", "PTRAIN_PROCESS_ID"):
        env.pop(var, None)
    flags = re.sub(rf"{DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_FLAG}={n}"])
    return env


def command(processes: int, args: list[str]) -> tuple[list[str], dict]:
    """`python -m ptrain args` as 1 process x 8 devices, or as `processes` x 8/processes."""
    ptrain = [sys.executable, "-m", "ptrain", *args]
    if processes == 1:
        return ptrain, env_with_devices(8)
    launch = [sys.executable, LAUNCH, "--processes", str(processes), "--devices-per-process", str(8 // processes)]
    return [*launch, "--", *ptrain], env_with_devices(8)


def run(processes: int, args: list[str], check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd, base = command(processes, args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**base, **(env or {})})
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def records(stage_dir) -> list[dict]:
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def metric(stage_dir, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(stage_dir) if key in r}


def assert_same_run(got_dir, want_dir, stages=("sft", "dpo"), keys=None):
    for stage in stages:
        got, want = got_dir / "stages" / stage, want_dir / "stages" / stage
        for key in keys or ("train/loss", "train/grad_norm", "eval/loss" if stage == "sft" else "eval/margin",
                            "eval/exact_match"):  # fmt: skip
            g, w = metric(got, key), metric(want, key)
            assert sorted(g) == sorted(w) and len(w) >= 2, (stage, key, g, w)
            assert [g[s] for s in sorted(g)] == pytest.approx([w[s] for s in sorted(w)], rel=1e-5, abs=1e-5), (
                stage,
                key,
            )


def cut(src, dst, stage: str, at: int, later: tuple[str, ...] = ()) -> None:
    """A copy of a finished run as if it had stopped right after the checkpoint of step `at` of
    `stage`: the stages named in `later` (those after it) never ran."""
    shutil.copytree(src, dst)
    for name in later:
        shutil.rmtree(dst / "stages" / name)
    sdir = dst / "stages" / stage
    for name in ("DONE.json", "export"):
        p = sdir / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    for ckpt in (sdir / "checkpoints").iterdir():
        if ckpt.name.isdigit() and int(ckpt.name) > at:
            shutil.rmtree(ckpt)
    kept = [line for line in (sdir / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= at]
    (sdir / "metrics.jsonl").write_text("\n".join(kept) + "\n")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run(1, [*TINY, *STEPS, *SFT_DPO, f"run_dir={run_dir}"])
    return run_dir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    out = run(2, [*TINY, *STEPS, *SFT_DPO, f"run_dir={run_dir}"])
    return run_dir, out


def test_two_processes_train_sft_and_dpo_to_the_losses_of_one(one_process, two_processes):
    run_dir, out = two_processes
    assert_same_run(run_dir, one_process)
    # both ranks ran every stage; process 0 alone wrote the files (one record per step, not two)
    for rank in (0, 1):
        assert f"[rank {rank}] ptrain: stage 2/2 'dpo'" in out.stdout
    for stage in ("sft", "dpo"):
        sdir = run_dir / "stages" / stage
        steps = [r["step"] for r in records(sdir) if "train/loss" in r]
        assert steps == [1, 2, 3, 4]
        assert (sdir / "DONE.json").is_file() and (sdir / "export" / "config.json").is_file()
        # every process saved its own shards of the train state
        assert {p.name for p in (sdir / "checkpoints" / "4" / "state").iterdir()} >= {
            "ocdbt.process_0",
            "ocdbt.process_1",
        }
    # process 0 sampled the on-policy pairs, which both processes trained on: those of one process
    for name in (PAIRS_FILE, EVAL_PAIRS_FILE):
        assert (run_dir / "stages" / "dpo" / name).read_text() == (one_process / "stages" / "dpo" / name).read_text()
    # the exports hold the same weights
    got = split_model(load_hf(str(run_dir / "stages" / "dpo" / "export")))[1]
    want = split_model(load_hf(str(one_process / "stages" / "dpo" / "export")))[1]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_a_one_process_checkpoint_resumes_in_two_processes(one_process, tmp_path):
    """DPO stopped at its step-2 checkpoint (written by 1 process), resumed by 2 processes."""
    resumed = tmp_path / "run"
    cut(one_process, resumed, "dpo", 2)
    out = run(2, [*TINY, *STEPS, *SFT_DPO, f"run_dir={resumed}"])
    assert "[rank 1] ptrain: resumed from checkpoint step 2" in out.stdout
    assert "already finished" in out.stdout  # the SFT stage is skipped
    assert_same_run(resumed, one_process)


def test_a_dead_process_ends_the_job_and_its_checkpoint_resumes_in_one_process(one_process, tmp_path):
    """Rank 1 killed after the SFT stage's step-2 checkpoint: the launcher stops rank 0 and exits
    non-zero at once (rank 0 alone would hang until the heartbeat timeout). Launched again, here
    as 1 process x 8 devices, the run resumes from the checkpoint the 2 processes wrote and
    trains as the uninterrupted run did. (A 2-process launch resuming is the test above.)"""
    run_dir = tmp_path / "run"
    args = [*TINY, *STEPS, *SFT_DPO, f"run_dir={run_dir}"]
    cmd, env = command(2, args)
    log, errlog = tmp_path / "out.log", tmp_path / "err.log"
    with open(log, "w") as stdout, open(errlog, "w") as stderr:  # files: a full pipe would stall the ranks
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env)
    sft = run_dir / "stages" / "sft"
    ckpt = sft / "checkpoints" / "2" / "commit_success.txt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    rank1 = re.search(r"launch_local: rank 1 is pid (\d+)", log.read_text())
    assert rank1 and ckpt.exists(), errlog.read_text()[-3000:]
    os.kill(int(rank1.group(1)), signal.SIGKILL)
    t_kill = time.time()
    proc.wait(timeout=120)
    err = errlog.read_text()
    # the killed rank's code, not that of rank 0, which fails a moment later in a broken collective
    assert proc.returncode == 128 + signal.SIGKILL, (proc.returncode, err[-1500:])
    assert time.time() - t_kill < 60  # not the coordination service's heartbeat timeout
    assert "launch_local: rank 1 exited with code 137" in err
    assert not (run_dir / "stages" / "dpo" / "DONE.json").exists(), "the run finished before it could be killed"
    sft_was_done = (sft / "DONE.json").exists()

    out = run(1, args)
    if not sft_was_done:  # killed within the SFT stage (the usual case): it resumes there
        assert "resumed from checkpoint step" in out.stdout
    assert_same_run(run_dir, one_process)  # every step once: the lost ones were dropped and redone
