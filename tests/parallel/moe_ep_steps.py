"""MoE SFT steps with expert parallelism on 8 host devices against one device (run in a subprocess).

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python moe_ep_steps.py OUT.json

For the tiny_moe (Qwen3-MoE: softmax top-2, list layout) and tiny_deepseek (sigmoid router,
groups, shared expert, first layer dense, router-bias update; scanned layers with remat)
model configs, from one saved Hugging Face folder each:
  - the real SFT step (objective, denominator, router-bias hook, ptrain.train.step) on
    one device, and on a data=2 x expert=4 mesh through the stage's own loading path
    (stages.setup.load_model -> load_hf(mesh=, rules=)), which wires expert parallelism;
  - the optimizer is SGD with learning rate 1 that keeps the gradient in its state, so
    every gradient leaf of the first step is compared exactly, and the second step's loss
    shows the updated, sharded state trains on;
  - the compiled HLO of the expert-parallel step, and of the same step on the same mesh
    from a model built without the mesh (automatic partitioning only): collectives, and
    all-gathers of whole expert-weight stacks;
  - for tiny_deepseek also a data=1 x tensor=2 x expert=4 mesh (expert weights split over
    tensor too, attention heads over tensor), whose compile must not fall back to
    replicating activations ("Involuntary full rematerialization" on stderr);
  - greedy generation from the expert-parallel model: prefill (16 tokens, expert-parallel)
    and decode steps (2 tokens, which do not split over 8 devices: the fallback path).
Writes the figures to OUT.json; tests/parallel/test_moe_expert_parallel.py asserts on them.
"""

import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from ptrain.config import MeshConfig, ModelConfig, RunConfig  # noqa: E402
from ptrain.models import Decoder, generate, load_hf, save_hf  # noqa: E402
from ptrain.parallel import batch_sharding, make_mesh  # noqa: E402
from ptrain.stages.setup import jit_step, load_model, place_state, router_bias_update  # noqa: E402
from ptrain.train.objectives import make_sft_objective, sft_denominator  # noqa: E402
from ptrain.train.step import make_train_step  # noqa: E402
from tests.train.helpers import random_batch  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
VOCAB = 64
PROMPTS = [[5, 9, 11, 3], [7, 3, 2, 8, 1, 4]]


def model_config(name: str, **overrides) -> ModelConfig:
    """A model config from conf/model/<name>.yaml (the Hydra group's file), with overrides."""
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "conf", "model", f"{name}.yaml")))
    fields.pop("defaults", None)
    return ModelConfig(**{**fields, "vocab_size": VOCAB, **overrides})


def sgd_keeping_gradients() -> optax.GradientTransformation:
    """SGD at learning rate 1 whose state is the last gradient (so the test reads every
    gradient leaf exactly; new - old params would lose digits on weights near 1)."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        del state, params
        return jax.tree.map(jnp.negative, grads), grads

    return optax.GradientTransformation(init, update)


def build_step(run: RunConfig, model, mesh):
    """The SFT stage's step (as stages/sft.py builds it) with `sgd_keeping_gradients`."""
    tx = sgd_keeping_gradients()
    placed = place_state(run, model, tx, mesh)
    objective = make_sft_objective(placed.model_def, run.algo.sft, aux_loss_coef=run.model.router_aux_loss_coef)
    step = make_train_step(
        objective,
        sft_denominator(run.algo.sft, 1.0),
        tx,
        optax.constant_schedule(1.0),
        grad_accum=run.train.grad_accum,
        post_update=router_bias_update(run, model),
    )
    return placed, jit_step(step, placed)


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def expert_stack_gathers(hlo: str, n_experts: int) -> int:
    """All-gathers in HLO text whose result is a whole [E, ., .] expert-weight stack."""
    shapes = re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)
    return sum(1 for s in shapes if len(s.split(",")) == 3 and int(s.split(",")[0]) == n_experts)


def collectives(hlo: str) -> dict:
    return {op: len(re.findall(rf"\b{op}\(", hlo)) for op in ("all-to-all", "all-gather", "all-reduce")}


def run_steps(run: RunConfig, model, mesh, batches):
    """Compiles the step once, runs it over `batches`; returns losses and metrics, the
    first step's gradients, the router-bias state after the steps, and the HLO text."""
    placed, step = build_step(run, model, mesh)
    state = placed.state
    compiled = step.lower(state, batches[0]).compile()
    out = {"loss": [], "grad_norm": [], "expert_load": []}
    for i, batch in enumerate(batches):
        state, m = compiled(state, batch)
        out["loss"].append(float(m["loss"]))
        out["grad_norm"].append(float(m["grad_norm"]))
        # Summed over micro-batches inside the step; finalize_metrics divides the same way.
        # (a dense model reports none)
        out["expert_load"].append((np.asarray(m.get("expert_load", [])) / run.train.grad_accum).tolist())
        if i == 0:
            out["grads"] = flat(host(state.opt_state))
    out["model_state"] = flat(host(state.model_state))
    return out, compiled.as_text(), placed


def compare(ref: dict, got: dict) -> dict:
    """Worst relative differences of the expert-parallel run against the one-device run."""

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0

    assert set(got["grads"]) == set(ref["grads"]), sorted(set(got["grads"]) ^ set(ref["grads"]))
    leaves = {k: rel(got["grads"][k], v) for k, v in ref["grads"].items()}
    bias = {k: rel(got["model_state"][k], v) for k, v in ref["model_state"].items()}
    return {
        "loss": rel(got["loss"], ref["loss"]),
        "grad_norm": rel(got["grad_norm"], ref["grad_norm"]),
        "expert_load": rel(got["expert_load"], ref["expert_load"]),
        "grad_leaves": len(leaves),
        "grad_worst": max(leaves.values()),
        "grad_worst_leaf": max(leaves, key=leaves.get),
        "router_bias_leaves": len(bias),
        "router_bias": max(bias.values(), default=0.0),
        "router_bias_moved": any(np.any(v != 0) for v in got["model_state"].values()),
    }


def check_config(
    name: str, cfg: ModelConfig, devices, folder: str, *, grad_accum: int, auto_hlo: bool, tensor_mesh: bool
) -> dict:
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), folder)
    batches = [random_batch(batch=8, length=16, vocab=VOCAB, seed=s) for s in (0, 1)]

    def run_config(mesh_cfg, accum):
        r = RunConfig(model=cfg, mesh=mesh_cfg)
        r.train.grad_accum, r.train.seed = accum, 0
        return r

    one_run = run_config(MeshConfig(data=1), 1)
    one_mesh = make_mesh(one_run.mesh, devices[:1])
    ref, ref_hlo, _ = run_steps(one_run, load_model(one_run, folder, one_mesh), one_mesh, batches)

    ep_run = run_config(MeshConfig(data=2, expert=4), grad_accum)
    ep_mesh = make_mesh(ep_run.mesh, devices)
    ep_model = load_model(ep_run, folder, ep_mesh)
    got, ep_hlo, ep_placed = run_steps(ep_run, ep_model, ep_mesh, batches)
    E = cfg.n_experts
    result = {"compare": compare(ref, got)}
    result["hlo"] = {"one_device": collectives(ref_hlo), "expert_parallel": collectives(ep_hlo)}
    result["expert_stack_gathers"] = {"expert_parallel": expert_stack_gathers(ep_hlo, E)}
    result["expert_weight_specs"] = sorted(
        {str(v.sharding.spec) for k, v in flat(ep_placed.state.params).items() if "w_gate" in k}
    )
    # Rows per device of a batch on the data=2 x expert=4 mesh: the expert axis splits the batch
    # too, so the attention around the MoE blocks is not computed 4 times over.
    placed_ids = jax.device_put(batches[0]["input_ids"], batch_sharding(ep_mesh))
    result["batch_rows_per_device"] = sorted({s.data.shape[0] for s in placed_ids.addressable_shards})
    result["ep_wired"] = sorted(
        {str(getattr(m.ep, "axis", None)) for _, m in nnx.iter_graph(ep_model) if type(m).__name__ == "MoE"}
    )
    if tensor_mesh:
        # Experts over 4 devices, their FFN dimension and the attention heads over 2 more.
        t_run = run_config(MeshConfig(data=1, tensor=2, expert=4), grad_accum)
        t_mesh = make_mesh(t_run.mesh, devices)
        got_t, t_hlo, _ = run_steps(t_run, load_model(t_run, folder, t_mesh), t_mesh, batches)
        result["compare_tensor2_expert4"] = compare(ref, got_t)
        result["hlo"]["tensor2_expert4"] = collectives(t_hlo)
    if auto_hlo:
        # The same mesh and placement, from a model built without the mesh: XLA partitions it.
        plain = load_hf(folder, scan_layers=cfg.scan_layers, remat=cfg.remat, moe_implementation=cfg.moe_implementation)
        placed, step = build_step(ep_run, plain, ep_mesh)
        auto_hlo = step.lower(placed.state, batches[0]).compile().as_text()
        result["hlo"]["automatic"] = collectives(auto_hlo)
        result["expert_stack_gathers"]["automatic"] = expert_stack_gathers(auto_hlo, E)

    # Generation (fresh models: the step donated the loaded arrays): the 16-token prefill
    # splits over the 8 devices, the 2-token decode steps fall back.
    g_ref = generate(load_model(one_run, folder, one_mesh), PROMPTS, max_new_tokens=3, prompt_bucket=8)
    g_ep = generate(load_model(ep_run, folder, ep_mesh), PROMPTS, max_new_tokens=3, prompt_bucket=8)
    result["generate_tokens_equal"] = bool(np.array_equal(g_ref.tokens_BxN, g_ep.tokens_BxN))
    result["generate_logprob_diff"] = float(np.max(np.abs(g_ref.logprobs_BxN - g_ep.logprobs_BxN)))
    print(name, json.dumps(result), flush=True)
    return result


def main(out_path: str) -> None:
    devices = jax.devices()
    assert len(devices) == 8, f"expected 8 host devices, got {len(devices)}"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["tiny_moe"] = check_config(
            "tiny_moe",
            model_config("tiny_moe"),
            devices,
            os.path.join(tmp, "moe"),
            grad_accum=1,
            auto_hlo=True,
            tensor_mesh=False,
        )
        deepseek = model_config("tiny_deepseek", scan_layers=True, remat="full")
        results["tiny_deepseek"] = check_config(
            "tiny_deepseek",
            deepseek,
            devices,
            os.path.join(tmp, "deepseek"),
            grad_accum=2,
            auto_hlo=False,
            tensor_mesh=True,
        )
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
