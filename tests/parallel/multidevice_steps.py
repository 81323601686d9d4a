"""Run a few SFT steps on a given mesh and print the losses as JSON (run in a subprocess).

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python multidevice_steps.py
Prints {"one_device": [...], "data2_fsdp2_tensor2": [...], "placements": {...}}, and the same
with LoRA adapters training over the frozen base ("lora_..." keys).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from ptrain.config import MeshConfig, OptimConfig, RunConfig, SFTAlgoConfig  # noqa: E402
from ptrain.config.lora import LoRAConfig  # noqa: E402
from ptrain.parallel import make_mesh  # noqa: E402
from ptrain.stages.setup import jit_step, place_state  # noqa: E402
from ptrain.train.objectives import make_sft_objective, sft_denominator  # noqa: E402
from ptrain.train.optim import make_optimizer  # noqa: E402
from ptrain.train.step import make_train_step  # noqa: E402
from tests.train.helpers import random_batch, tiny_model  # noqa: E402


def losses_on(mesh_cfg: MeshConfig, devices, grad_accum: int, lora_rank: int = 0):
    run = RunConfig(mesh=mesh_cfg)
    run.model.lora = LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank or 16.0)
    mesh = make_mesh(mesh_cfg, devices)
    tx, lr = make_optimizer(OptimConfig(lr=1e-2, schedule="constant"), 10)
    placed = place_state(run, tiny_model(), tx, mesh)
    cfg = SFTAlgoConfig()
    step = jit_step(
        make_train_step(
            make_sft_objective(placed.model_def, cfg), sft_denominator(cfg, 1.0), tx, lr, grad_accum=grad_accum
        ),
        placed,
    )
    state, out = placed.state, []
    for i in range(3):
        state, m = step(state, random_batch(seed=i))
        out.append(float(m["loss"]))
    specs = {
        "/".join(str(getattr(k, "key", k)) for k in p): str(v.sharding.spec)
        for p, v in jax.tree_util.tree_flatten_with_path(state.params)[0]
    }
    return out, specs


if __name__ == "__main__":
    devices = jax.devices()
    assert len(devices) == 8, f"expected 8 host devices, got {len(devices)}"
    one, _ = losses_on(MeshConfig(data=1), devices[:1], grad_accum=1)
    many, specs = losses_on(MeshConfig(data=2, fsdp=2, tensor=2), devices, grad_accum=2)
    # LoRA: the adapters' shardings follow the weights they adapt, and the steps match too
    lora_one, _ = losses_on(MeshConfig(data=1), devices[:1], grad_accum=1, lora_rank=4)
    lora_many, lora_specs = losses_on(MeshConfig(data=2, fsdp=2, tensor=2), devices, grad_accum=2, lora_rank=4)
    print(json.dumps({"one_device": one, "data2_fsdp2_tensor2": many, "placements": specs, "lora_one_device": lora_one,
                      "lora_data2_fsdp2_tensor2": lora_many, "lora_placements": lora_specs}))  # fmt: skip
