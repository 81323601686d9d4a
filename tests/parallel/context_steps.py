"""SFT steps with the sequence split over a context axis on 8 host devices, against one
device (run in a subprocess).

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python context_steps.py OUT.json

A packed batch (several segments per row, of uneven lengths that cross the chunk
boundaries, and padding) goes through the real SFT step (stages.setup.load_model ->
load_hf(mesh=, rules=), which wires context parallelism) with an SGD that keeps the
gradient, so the first step's every gradient leaf is compared with the one-device step's.
Cases: the dense model on data=2 x context=4 with ring and with all-to-all attention, with
scanned layers and remat=attention, and on fsdp=2 x context=2 x tensor=2; the MoE model on
data=2 x context=4, and on context=2 x expert=4 (both splits of its tokens at once). For each,
the compiled step's collectives, and the largest all-gather result in elements (a gathered
sequence would show as [B, L, ...]). Writes the figures to OUT.json;
tests/parallel/test_context_parallel.py asserts on them.
"""

import dataclasses
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ptrain.config import MeshConfig, RunConfig  # noqa: E402
from ptrain.models import Decoder, save_hf  # noqa: E402
from ptrain.parallel import make_mesh  # noqa: E402
from ptrain.stages.setup import load_model, place_state  # noqa: E402
from tests.parallel.moe_ep_steps import compare, model_config, run_steps  # noqa: E402

VOCAB = 64
LENGTH = 32
SMALL = dict(d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, d_ff=128, max_seq_len=LENGTH)


def packed_batch(seed: int, rows: int = 4) -> dict:
    """Rows of 2-4 segments with random cut points, the last few slots of some rows padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (rows, LENGTH + 1)).astype(np.int32)
    seg = np.zeros((rows, LENGTH), np.int32)
    pos = np.zeros((rows, LENGTH), np.int32)
    for r in range(rows):
        cuts = sorted(rng.choice(np.arange(3, LENGTH - 3), size=rng.integers(1, 4), replace=False))
        end = LENGTH - int(rng.integers(0, 5))
        bounds = [0, *cuts, end]
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
            seg[r, a:b] = s
            pos[r, a:b] = np.arange(b - a)
    mask = ((seg > 0) & (rng.random((rows, LENGTH)) < 0.8)).astype(np.float32)
    return dict(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask, segment_ids=seg, positions=pos)


def collectives(hlo: str) -> dict:
    ops = ("collective-permute", "all-to-all", "all-gather", "all-reduce")
    out = {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in ops}
    sizes = [np.prod([int(d) for d in s.split(",") if d]) for s in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather", hlo)]
    out["largest_all_gather"] = int(max(sizes, default=0))
    return out


def check(name: str, cfg, folder: str, meshes: dict, devices) -> dict:
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), folder)
    batches = [packed_batch(s) for s in (0, 1)]

    def run_config(mesh_cfg, **model):
        r = RunConfig(model=dataclasses.replace(cfg, **model), mesh=mesh_cfg)
        r.train.seed = 0
        return r

    refs = {}
    result = {}
    for label, (mesh_cfg, model_opts) in meshes.items():
        key = json.dumps(model_opts, sort_keys=True)
        if key not in refs:  # the one-device step with the same model options
            one = run_config(MeshConfig(data=1), **model_opts)
            one_mesh = make_mesh(one.mesh, devices[:1])
            refs[key] = run_steps(one, load_model(one, folder, one_mesh), one_mesh, batches)[0]
        ref = refs[key]
        run = run_config(mesh_cfg, **model_opts)
        mesh = make_mesh(run.mesh, devices)
        model = load_model(run, folder, mesh)
        plans = {str(getattr(m.cp, "mode", None)) for _, m in nnx.iter_graph(model) if type(m).__name__ == "Attention"}
        got, hlo, _ = run_steps(run, model, mesh, batches)
        if os.environ.get("CONTEXT_STEPS_HLO"):
            with open(os.path.join(os.environ["CONTEXT_STEPS_HLO"], f"{name}_{label}.hlo"), "w") as f:
                f.write(hlo)
        result[label] = {"compare": compare(ref, got), "hlo": collectives(hlo), "plans": sorted(plans)}
        print(name, label, json.dumps(result[label]), flush=True)
    return result


def attention_alone(devices) -> dict:
    """ContextParallel.attend against causal_attend on one device: the outputs, and the
    gradients of q, k, v of sum(sin(out)), for both modes (the ring also with its chunks of 8
    queries in blocks of 4), with and without a sliding window (worst absolute differences)."""
    import jax.numpy as jnp

    from ptrain.models.context_parallel import ContextParallel
    from ptrain.models.layers import attention_mask, causal_attend

    mesh = make_mesh(MeshConfig(data=2, context=4), devices)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, LENGTH, h, 16)), jnp.float32) for h in (8, 4, 4))
    seg = jnp.asarray(packed_batch(3)["segment_ids"])
    out = {}
    for mode, query_block in (("ring", 512), ("ring", 4), ("all_to_all", 512)):
        for window in (None, 6):
            plan = ContextParallel(mesh, "context", ("data",), (), mode, query_block)

            def split(q, k, v, plan=plan, window=window):
                return jnp.sum(jnp.sin(plan.attend(q, k, v, seg, window)))

            def whole(q, k, v, window=window):
                return jnp.sum(jnp.sin(causal_attend(q, k, v, attention_mask(seg, window), window)))

            a = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))(q, k, v)
            b = jax.jit(jax.value_and_grad(whole, argnums=(0, 1, 2)))(q, k, v)
            outs = (
                jax.jit(plan.attend, static_argnums=4)(q, k, v, seg, window),
                causal_attend(q, k, v, attention_mask(seg, window), window),
            )
            diffs = [float(jnp.max(jnp.abs(outs[0] - outs[1])))]
            diffs += [float(jnp.max(jnp.abs(x - y))) for x, y in zip(a[1], b[1])]
            out[f"{mode}_q{query_block}_window{window}"] = diffs
    return out


def objective_grads(run, folder: str, mesh, make_objective, batch: dict, denom) -> tuple[float, dict]:
    """Loss and gradients of a stage objective with the model loaded onto `mesh`."""
    from tests.parallel.moe_ep_steps import flat, host, sgd_keeping_gradients

    model = load_model(run, folder, mesh)
    placed = place_state(run, model, sgd_keeping_gradients(), mesh, with_reference=True)
    objective = make_objective(placed.model_def)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, s, b: objective(p, s, b, denom)[0]))(
        placed.state.params, placed.state, batch
    )
    return float(loss), flat(host(grads))


def rl_and_preference(devices, tmp: str) -> dict:
    """The GRPO policy objective on packed trajectories and the DPO objective (reference in
    the step) on generated preference pairs: data=2 x context=4 against one device."""
    from ptrain.config import DataConfig, DPOAlgoConfig, GeneratedTaskConfig
    from ptrain.config.grpo import GRPOAlgoConfig
    from ptrain.data.preference import make_preference_pass
    from ptrain.data.tokenizer import build_tokenizer
    from ptrain.envs.base import Task, Trajectory
    from ptrain.stages.grpo.batch import policy_batch
    from ptrain.train.objectives import dpo_denominator, make_dpo_objective
    from ptrain.train.policy_objective import make_policy_objective, policy_denominator

    rng = np.random.default_rng(0)
    task = Task(env="t", id="0", messages=({"role": "user", "content": "x"},))
    trajs = []
    for i in range(4):  # one per row, of uneven lengths across the chunk boundaries
        n_prompt, n_resp = int(rng.integers(3, 10)), int(rng.integers(8, 22))
        ids = tuple(int(x) for x in rng.integers(1, VOCAB, n_prompt + n_resp))
        mask = (0,) * n_prompt + (1,) * n_resp
        logp = tuple(float(-rng.random()) if m else 0.0 for m in mask)
        trajs.append(Trajectory(task=task, sample_index=i, token_ids=ids, prompt_length=n_prompt, loss_mask=mask,
                                logprobs=logp, reward=1.0, finish_reason="stop"))  # fmt: skip
    grpo_batch, _ = policy_batch(trajs, list(rng.normal(size=4)), rows=4, seq_len=LENGTH)
    tok = build_tokenizer(os.path.join(tmp, "tok"))
    data = DataConfig(format="preference", generated=GeneratedTaskConfig(n_train=16, n_eval=4))
    dpo_batch = next(iter(make_preference_pass(data, tok, batch_size=4, seq_len=128)))
    grpo_cfg, dpo_cfg = GRPOAlgoConfig(), DPOAlgoConfig(kind="sigmoid", beta=0.1)
    cases = {
        "grpo": (dict(SMALL), grpo_batch, policy_denominator(grpo_cfg.aggregation)(grpo_batch),
                 lambda md: make_policy_objective(md, grpo_cfg, vocab_chunk=16)),
        "dpo": (dict(SMALL, vocab_size=len(tok), max_seq_len=128), dpo_batch, dpo_denominator(dpo_batch),
                lambda md: make_dpo_objective(md, dpo_cfg, vocab_chunk=16)),
    }  # fmt: skip
    out = {}
    for name, (shape, batch, denom, make) in cases.items():
        cfg = model_config("tiny", **shape, tie_embeddings=False)
        folder = os.path.join(tmp, name)
        save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), folder)
        one, split = (RunConfig(model=cfg, mesh=m) for m in (MeshConfig(data=1), MeshConfig(data=2, context=4)))
        ref = objective_grads(one, folder, make_mesh(one.mesh, devices[:1]), make, batch, denom)
        got = objective_grads(split, folder, make_mesh(split.mesh, devices), make, batch, denom)
        worst = max(float(np.max(np.abs(got[1][k] - v)) / max(np.max(np.abs(v)), 1e-30)) for k, v in ref[1].items())
        out[name] = {"loss": abs(got[0] - ref[0]) / abs(ref[0]), "grad_worst": worst, "grad_leaves": len(ref[1])}
        print(name, json.dumps(out[name]), flush=True)
    return out


def main(out_path: str) -> None:
    devices = jax.devices()
    assert len(devices) == 8, f"expected 8 host devices, got {len(devices)}"
    results = {"attention": attention_alone(devices)}
    with tempfile.TemporaryDirectory() as tmp:
        results["objectives"] = rl_and_preference(devices, tmp)
        results["dense"] = check(
            "dense",
            model_config("tiny", **SMALL, tie_embeddings=False),
            os.path.join(tmp, "dense"),
            {
                "ring": (MeshConfig(data=2, context=4), {}),
                "all_to_all": (MeshConfig(data=2, context=4), {"context_attention": "all_to_all"}),
                "ring_scan_remat": (MeshConfig(data=2, context=4), {"scan_layers": True, "remat": "attention"}),
                "fsdp2_context2_tensor2": (MeshConfig(data=1, fsdp=2, context=2, tensor=2), {}),
            },
            devices,
        )
        results["moe"] = check(
            "moe",
            model_config("tiny_moe", **SMALL, d_ff_expert=32),
            os.path.join(tmp, "moe"),
            {
                "ring": (MeshConfig(data=2, context=4), {}),
                "context2_expert4": (MeshConfig(data=1, context=2, expert=4), {}),
            },
            devices,
        )
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
