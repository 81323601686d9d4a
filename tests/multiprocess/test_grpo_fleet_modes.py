"""GRPO from a fleet as 2 JAX processes x 4 CPU devices, in the modes beside full-weight sync
training: a LoRA stage, whose adapters every process gathers and process 0 alone writes and
pushes (the worker serves them over its base model), trains to the losses and held-out
evaluations (process 0 samples them, the others get its metrics) of 1 process x 8;
an async stage, whose collector runs ahead in process 0 alone and broadcasts each batch,
trains every step on groups within the staleness bound, pushes every adapter version, and
resumes from its checkpoint; a worker that refuses the adapters stops every process with the
reason (process 0 alone pushes, and tells the others), none left waiting.

Every run starts its GRPO stage from the same SFT export (the one-process run's stage folder,
copied), so the runs differ only in the stage under test."""

import dataclasses
import json
import math
import shutil
import time

import pytest
from flax import nnx

from ptrain.data.tokenizer import get_tokenizer
from ptrain.models import Decoder, save_hf
from tests.multiprocess.test_grpo_fleet import MODEL, STEPS, grpo_args
from tests.multiprocess.test_training import assert_same_run, cut, records, run
from tests.rollout.test_serve_process import start_server

pytestmark = pytest.mark.multiprocess

LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"]
STAGES = (
    "stages=[{name: sft, kind: sft, train: {steps: 30, global_batch_size: 16}}, "
    "{name: grpo, kind: grpo, lora: {rank: 4, alpha: 8}, train: {eval_generate: 2}}]"
)
MAX_STALENESS = 1


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A tiny model folder and one ptrain.serve worker on it with LoRA enabled."""
    tmp = tmp_path_factory.mktemp("fleet-lora")
    tok = get_tokenizer(None, str(tmp / "tokenizer"), vocab_size=300)
    folder = str(tmp / "model")
    save_hf(Decoder(dataclasses.replace(MODEL, vocab_size=len(tok)), rngs=nnx.Rngs(0)), folder, tokenizer=tok)
    srv = start_server(folder, str(tmp / "server.log"), *LORA_FLAGS)
    yield folder, srv
    srv.proc.terminate()
    srv.proc.wait(timeout=60)


def served_adapters(url: str) -> set[str]:
    """The LoRA adapters the worker has loaded (its /v1/models cards after the model's)."""
    import httpx

    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {c["id"] for c in cards[1:]}


def lora_args(folder: str, url: str, run_dir, *extra: str) -> list[str]:
    """test_grpo_fleet's SFT then GRPO, the GRPO stage with rank-4 adapters and held-out
    evaluations of 2 tasks, and no eval stage."""
    base = [a for a in grpo_args(folder, url, run_dir) if not a.startswith("stages=")]
    return [*base, STAGES, *extra]


def from_sft_of(done, run_dir) -> None:
    """A run dir whose SFT stage is `done`'s, finished (the GRPO stage starts from its export)."""
    shutil.copytree(done / "stages" / "sft", run_dir / "stages" / "sft")


@pytest.fixture(scope="module")
def one(worker, tmp_path_factory):
    folder, srv = worker
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run(1, lora_args(folder, srv.url, run_dir))
    return run_dir


def test_a_fleet_that_refuses_the_adapters_stops_every_process_with_the_reason(one, tmp_path):
    model = str(one / "stages" / "sft" / "export")
    plain = start_server(model, str(tmp_path / "server.log"))  # LoRA off: it refuses any adapter
    try:
        run_dir = tmp_path / "run"
        from_sft_of(one, run_dir)
        t0 = time.monotonic()
        out = run(2, lora_args(model, plain.url, run_dir), check=False)
        took = time.monotonic() - t0
    finally:
        plain.proc.terminate()
        plain.proc.wait(timeout=60)
    assert out.returncode != 0 and took < 300, (out.returncode, took)
    lines = (out.stdout + out.stderr).splitlines()
    for rank in (0, 1):
        said = [line for line in lines if line.startswith(f"[rank {rank}] ptrain: stopped") and "--enable-lora" in line]
        assert said, "\n".join(line for line in lines if "ptrain" in line)[-4000:]


def test_two_processes_train_a_lora_grpo_stage_to_the_losses_of_one(worker, one, tmp_path):
    folder, srv = worker
    two = tmp_path / "run"
    from_sft_of(one, two)
    out = run(2, lora_args(folder, srv.url, two))
    keys = ("train/loss", "train/grad_norm", "train/reward/mean", "eval/arithmetic/reward",
            "eval/arithmetic/sampled/reward", "eval/arithmetic/sampled/response_length")  # fmt: skip
    assert_same_run(two, one, stages=("grpo",), keys=keys)
    rewards = [r["train/reward/std"] for r in records(one / "stages" / "grpo") if "train/reward/std" in r]
    assert max(rewards) > 0, rewards  # some group had an advantage: the losses compared are not all zero
    assert "[rank 1] ptrain: stage 2/2 'grpo'" in out.stdout
    # process 0 wrote each adapter version once; the older ones pruned (rollout.keep_weight_versions 2)
    (versions,) = (two / "weights").glob("*-grpo-*")
    assert sorted(p.name for p in versions.glob("v*-lora")) == [f"v{STEPS - 1}-lora", f"v{STEPS}-lora"]
    assert (versions / f"v{STEPS}-lora" / "adapter_config.json").is_file()
    assert (two / "stages" / "grpo" / "adapter" / "adapter_config.json").is_file()
    assert served_adapters(srv.url) == {f"policy-v{STEPS}"}  # the last version, the ones before it unloaded


@pytest.fixture(scope="module")
def async_run(worker, one, tmp_path_factory):
    folder, srv = worker
    run_dir = tmp_path_factory.mktemp("async") / "run"
    from_sft_of(one, run_dir)
    args = lora_args(folder, srv.url, run_dir, "algo.grpo.mode=async", f"algo.grpo.max_staleness={MAX_STALENESS}")
    return run_dir, args, run(2, args)


def test_two_processes_train_an_async_grpo_stage_within_its_staleness_bound(worker, async_run):
    _, srv = worker
    run_dir, _, out = async_run
    steps = [r for r in records(run_dir / "stages" / "grpo") if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert math.isfinite(r["train/loss"]) and r["train/staleness/max"] <= MAX_STALENESS, r
    assert json.loads((run_dir / "stages" / "grpo" / "DONE.json").read_text())["steps"] == STEPS
    assert "[rank 1] ptrain: stage 2/2 'grpo'" in out.stdout
    assert f"policy-v{STEPS}" in served_adapters(srv.url)


def test_a_two_process_async_grpo_stage_resumes_from_its_checkpoint(worker, async_run, tmp_path):
    """Stopped after the step-2 checkpoint and launched again: both processes resume from it
    (process 0's collector with the groups it had finished or started) and train to the end."""
    run_dir, args, _ = async_run
    resumed = tmp_path / "run"
    cut(run_dir, resumed, "grpo", 2)
    out = run(2, [a if not a.startswith("run_dir=") else f"run_dir={resumed}" for a in args])
    assert "[rank 1] ptrain: resumed from checkpoint step 2" in out.stdout, out.stdout[-3000:]
    steps = [r["step"] for r in records(resumed / "stages" / "grpo") if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert json.loads((resumed / "stages" / "grpo" / "DONE.json").read_text())["steps"] == STEPS
