"""SFT, then a GRPO stage sampling from a `python -m ptrain.serve` worker, then an eval stage
on it, as 2 JAX processes x 4 CPU devices against 1 process x 8: process 0 collects each
rollout batch from the fleet and every process trains on it, so the losses agree; the
2-process run pushes every weight version (each process writes its share of the export,
process 0 tells the worker); the eval stage samples once, from process 0; a 2-process GRPO
stage stopped after a checkpoint resumes to the same losses."""

import dataclasses
import json
import os

import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.data.tokenizer import get_tokenizer
from ptrain.models import Decoder, save_hf
from tests.multiprocess.test_training import assert_same_run, cut, records, run
from tests.rollout.test_serve_process import start_server

pytestmark = pytest.mark.multiprocess

STEPS = 4
"""GRPO steps, a checkpoint every 2: the resume test starts from the first."""
MODEL = ModelConfig(family="qwen3", vocab_size=0, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    d_ff=48, max_seq_len=256)  # fmt: skip


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """A tiny model folder, and one ptrain.serve worker started on it (the trainer starts
    from the same folder and pushes its own weights before the first rollout)."""
    tmp = tmp_path_factory.mktemp("fleet")
    tok = get_tokenizer(None, str(tmp / "tokenizer"), vocab_size=300)
    folder = str(tmp / "model")
    save_hf(Decoder(dataclasses.replace(MODEL, vocab_size=len(tok)), rngs=nnx.Rngs(0)), folder, tokenizer=tok)
    srv = start_server(folder, str(tmp / "server.log"))
    yield folder, srv
    srv.proc.terminate()
    srv.proc.wait(timeout=60)


def srv_model_info(url: str) -> dict:
    import httpx

    return httpx.get(url + "/model_info", timeout=10).json()


def grpo_args(folder: str, url: str, run_dir) -> list[str]:
    """A short SFT (its samples start to end before max_new_tokens), then GRPO from its export
    on the fleet, with DAPO's overlong penalty over most of the length, so that samples of other
    lengths get other rewards and groups have an advantage."""
    return [
        "recipe=sft_grpo_arithmetic", f"model.hf_path={folder}",
        "stages=[{name: sft, kind: sft, train: {steps: 30, global_batch_size: 16}}, {name: grpo, kind: grpo}, "
        "{name: eval, kind: eval}]",
        "envs.arithmetic.n_eval=4", "algo.eval.samples=2", "algo.eval.max_new_tokens=24", "algo.eval.pass_k=[1,2]",
        "optim.lr=3e-3", "optim.schedule=constant", "optim.warmup_steps=0", "envs.arithmetic.options.format_reward=0.5",
        "rollout=sglang", f"rollout.urls=[{url}]", f"rollout.weight_dir={run_dir}/weights",
        "algo.grpo.prompts_per_step=4", "algo.grpo.group_size=4", "algo.grpo.max_new_tokens=24",
        "algo.grpo.overlong_buffer=20", "algo.grpo.overlong_penalty=1.0",
        f"train.steps={STEPS}", "train.seq_len=96", "train.grad_accum=1", "train.eval_every=2", "train.eval_generate=0",
        "checkpoint.every_steps=2", "checkpoint.async_save=false", "data.generated.n_train=32",
        "data.generated.n_eval=4", "logging.console=false", "logging.tensorboard=false", f"run_dir={run_dir}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one(worker, tmp_path_factory):
    folder, srv = worker
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run(1, grpo_args(folder, srv.url, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def two(worker, tmp_path_factory):
    folder, srv = worker
    run_dir = tmp_path_factory.mktemp("two") / "run"
    out = run(2, grpo_args(folder, srv.url, run_dir))
    return run_dir, out


def test_two_processes_run_grpo_from_a_fleet_to_the_losses_of_one(worker, one, two):
    folder, srv = worker
    two, out = two
    assert_same_run(two, one, stages=("grpo",), keys=("train/loss", "train/grad_norm", "train/reward/mean"))
    rewards = [r["train/reward/std"] for r in records(one / "stages" / "grpo") if "train/reward/std" in r]
    assert max(rewards) > 0, rewards  # some group had an advantage: the losses compared are not all zero
    for rank in (0, 1):
        assert f"[rank {rank}] ptrain: stage 2/3 'grpo'" in out.stdout
    # the eval stage: process 0 samples from the fleet, every process ends with its metrics
    got, want = (json.loads((d / "stages" / "eval" / "DONE.json").read_text()) for d in (two, one))
    keys = [k for k in want if k.startswith("eval/")]
    assert keys and {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, abs=1e-6)
    done = json.loads((two / "stages" / "grpo" / "DONE.json").read_text())
    assert done["steps"] == STEPS
    (versions,) = (two / "weights").glob("*-grpo-*")  # <weight_dir>/<run>-<stage>-<hash>/v<step>
    # written by both processes, pushed by process 0; the older ones pruned (rollout.keep_weight_versions 2)
    assert sorted(os.listdir(versions)) == [f"v{STEPS - 1}", f"v{STEPS}"]
    assert (versions / f"v{STEPS}" / "manifest.json").is_file()


def test_a_two_process_grpo_stage_resumes_from_its_checkpoint(worker, one, two, tmp_path):
    """The 2-process run as if stopped right after the GRPO stage's step-2 checkpoint, launched
    again as 2 processes: both resume from it, process 0 pushes the restored weights to the
    worker before the next rollout, and the rest of the stage trains as the run that never
    stopped did (the fleet's sampling is seeded by the request, not by the worker's history)."""
    folder, srv = worker
    resumed = tmp_path / "run"
    cut(two[0], resumed, "grpo", 2, later=("eval",))
    out = run(2, grpo_args(folder, srv.url, resumed))
    assert "[rank 1] ptrain: resumed from checkpoint step 2" in out.stdout, out.stdout[-3000:]
    assert_same_run(resumed, one, stages=("grpo",), keys=("train/loss", "train/grad_norm", "train/reward/mean"))
    info = srv_model_info(srv.url)
    assert info["weight_version"] == "eval", info  # the worker serves what the 2-process eval stage pushed
