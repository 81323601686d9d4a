"""SFT, GRPO sampling with the embedded engine, then an eval stage, as 2 JAX processes x 4 CPU
devices against 1 process x 8. As several processes the engine runs in process 0 alone, on one
of its devices, with the weights every process gathers to it after each step
(ptrain.rollout.engines.PrimaryEngine): process 0 samples each rollout batch and every process
trains on it. The one-process run it is compared with has a single device, so that both engines
sample on one device with XLA's own path (the CPU decode kernels are off in both): an engine
split over 8 devices multiplies other block shapes, whose last bits differ, and samples other
tokens at temperature 1. Then the losses, rewards and held-out metrics agree; full weights
and LoRA adapters."""

import json

import pytest

from tests.multiprocess.test_training import assert_same_run, records, run

pytestmark = pytest.mark.multiprocess

NO_KERNELS = {"PTRAIN_CPU_KERNELS": "0"}
ONE_DEVICE = {**NO_KERNELS, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def local_args(run_dir, *extra: str) -> list[str]:
    """A short SFT, then GRPO from its export with DAPO's overlong penalty over most of the
    length (samples of other lengths get other rewards, so groups have an advantage), and the
    held-out evaluation during training and as a stage."""
    return [
        "recipe=sft_grpo_arithmetic", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.head_dim=16", "model.d_ff=48", "model.max_seq_len=256",
        "stages=[{name: sft, kind: sft, train: {steps: 20, global_batch_size: 16}, optim: {lr: 1e-3}}, "
        "{name: grpo, kind: grpo}, "
        "{name: eval, kind: eval}]",
        "envs.arithmetic.n_eval=4", "algo.eval.samples=2", "algo.eval.max_new_tokens=24", "algo.eval.pass_k=[1,2]",
        "optim.lr=3e-3", "optim.schedule=constant", "optim.warmup_steps=0", "envs.arithmetic.options.format_reward=0.5",
        "algo.grpo.prompts_per_step=4", "algo.grpo.group_size=4", "algo.grpo.max_new_tokens=24",
        "algo.grpo.overlong_buffer=20", "algo.grpo.overlong_penalty=1.0", "rollout.max_running_requests=16",
        "train.steps=4", "train.seq_len=96", "train.grad_accum=1", "train.eval_every=2", "train.eval_generate=4",
        "train.eval_max_new_tokens=24", "checkpoint.every_steps=2", "checkpoint.async_save=false",
        "data.generated.n_train=32", "data.generated.n_eval=4", "logging.console=false", "logging.tensorboard=false",
        f"run_dir={run_dir}", *extra,
    ]  # fmt: skip


KEYS = ("train/loss", "train/grad_norm", "train/reward/mean", "eval/arithmetic/sampled/accuracy")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_processes_run_grpo_on_the_embedded_engine_to_the_losses_of_one(tmp_path, lora):
    extra = ("model.lora.rank=4", "optim.lr=1e-2") if lora else ()
    one, two = tmp_path / "one", tmp_path / "two"
    run(1, local_args(one, *extra), env=NO_KERNELS)
    out = run(2, local_args(two, *extra), env=NO_KERNELS)
    for rank in (0, 1):
        assert f"[rank {rank}] ptrain: stage 2/3 'grpo'" in out.stdout
    assert_same_run(two, one, stages=("grpo",), keys=KEYS)
    rewards = [r["train/reward/std"] for r in records(one / "stages" / "grpo") if "train/reward/std" in r]
    assert max(rewards) > 0, rewards  # some group had an advantage: the losses compared are not all zero
    got, want = (json.loads((d / "stages" / "eval" / "DONE.json").read_text()) for d in (two, one))
    keys = [k for k in want if k.startswith("eval/")]
    assert keys and {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, abs=1e-6)
