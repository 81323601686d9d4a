"""tools/plan.py against what XLA compiles for ptrain's real SFT step on one CPU device.

Memory: XLA's buffer assignment of the compiled step (arguments + outputs + temporaries -
aliased, as tools/bench_train.py `step_memory` reads it) against the planner's total, within
20%. XLA:CPU does not lower the peak with rematerialisation (the recomputed activations stay
live as long as the saved ones would), so the remat=full shape is compared with the planner's
`remat_lowers_peak=False` figure, and the planner's GPU/TPU figure is checked to be lower.

FLOPs: XLA's cost analysis of the same step against the planner's training FLOPs. The
planner counts the full score matrix (PaLM's convention, ptrain.models.flops_per_token);
ptrain's blocked attention computes only the causal triangle and the diagonal blocks, so the
comparison takes that share off, and allows 10% for what XLA counts besides the matmuls
(softmax, norms, the optimizer's elementwise update: a few FLOPs per parameter or activation).
The MoE step's count needs two compiles (test_moe_flops_match_xla_cost_analysis says why).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import plan  # noqa: E402

from ptrain.config import ModelConfig  # noqa: E402

SHAPES = {
    "dense": (ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                          max_seq_len=512), 1, 512),
    "dense_remat_full": (ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                                     d_ff=384, max_seq_len=512, remat="full"), 1, 512),
    "moe": (ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                        max_seq_len=512, n_experts=8, top_k=2, d_ff_expert=128), 1, 512),
}  # fmt: skip


def compiled_step(cfg: ModelConfig, rows: int, seq_len: int):
    """The SFT train step as the stages build it (placement, jit, donation), compiled."""
    import jax
    from flax import nnx

    from ptrain.config import MeshConfig, OptimConfig, RunConfig, SFTAlgoConfig
    from ptrain.models import Decoder
    from ptrain.parallel import make_mesh
    from ptrain.stages.setup import jit_step, place_state
    from ptrain.train.objectives import make_sft_objective, sft_denominator
    from ptrain.train.optim import make_optimizer
    from ptrain.train.step import make_train_step

    run = RunConfig(model=cfg, mesh=MeshConfig(data=1))
    mesh = make_mesh(run.mesh, jax.devices()[:1])
    tx, lr = make_optimizer(OptimConfig(lr=1e-4, schedule="constant"), 1000)
    placed = place_state(run, Decoder(cfg, rngs=nnx.Rngs(0), mesh=mesh), tx, mesh)
    algo = SFTAlgoConfig()
    objective = make_sft_objective(placed.model_def, algo, vocab_chunk=run.train.vocab_chunk)
    step = jit_step(make_train_step(objective, sft_denominator(algo, 1.0), tx, lr), placed)
    ids = np.zeros((rows, seq_len), np.int32)
    batch = dict(input_ids=ids, target_ids=ids, loss_mask=np.ones((rows, seq_len), np.float32), segment_ids=ids + 1,
                 positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)))  # fmt: skip
    return step.lower(placed.state, batch).compile()


def measured_peak(c) -> int:
    m = c.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


MEASURE = """
import json
import tests.conftest  # the suite's JAX settings
from tests.tools.test_plan import SHAPES, compiled_step, measured_peak
out = {}
for name, shape in SHAPES.items():
    c = compiled_step(*shape)
    cost = c.cost_analysis()
    out[name] = {"peak": measured_peak(c), "flops": (cost[0] if isinstance(cost, list) else cost)["flops"]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def xla_measured() -> dict[str, dict[str, float]]:
    """Each shape's measured peak bytes and FLOPs, compiled in a fresh process without the
    CPU tuning flags: a stage run earlier in this process (tests/api) may have added them to
    XLA_FLAGS before the backend started, and they change the step's buffers."""
    import json
    import os

    from ptrain.runtime import CPU_FLAGS

    env = {**os.environ, "PTRAIN_XLA_CPU_TUNING": "0"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in CPU_FLAGS)
    out = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(SHAPES))
def test_memory_matches_xla_within_20_percent(xla_measured, name):
    cfg, rows, seq_len = SHAPES[name]
    cpu = plan.plan_memory(cfg, rows=rows, seq_len=seq_len, shards=plan.Shards(), remat_lowers_peak=False)
    peak = xla_measured[name]["peak"]
    print(f"{name}: measured {peak / 2**20:.2f} MiB, planned {cpu.total / 2**20:.2f} MiB "
          f"({cpu.total / peak - 1:+.1%}); {cpu}")  # fmt: skip
    assert abs(cpu.total / peak - 1) < 0.20
    if cfg.remat != "none":
        honoured = plan.plan_memory(cfg, rows=rows, seq_len=seq_len, shards=plan.Shards())
        assert honoured.activations < cpu.activations


def test_flops_match_xla_cost_analysis(xla_measured):
    cfg, rows, seq_len = SHAPES["dense"]
    xla = xla_measured["dense"]["flops"]
    planned = plan.training_flops(cfg, seq_len, rows * seq_len, "sft")
    full_scores = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len * rows * seq_len
    causal_share = (seq_len + 64) / (2 * seq_len)  # ptrain.models.layers.ATTN_QUERY_CHUNK = 64
    expected = planned - full_scores * (1 - causal_share)
    print(f"XLA {xla:.3e} FLOPs, planned {planned:.3e} ({planned / xla - 1:+.1%}), causal {expected:.3e} "
          f"({expected / xla - 1:+.1%})")  # fmt: skip
    assert abs(expected / xla - 1) < 0.10


def test_moe_flops_match_xla_cost_analysis():
    """The MoE step's count cannot be read off XLA directly: the "xla" grouped matmul loops over
    experts and row tiles, and XLA's cost analysis counts a loop's body once (1.07e9 against
    1.9e9 here), while lax.ragged_dot is counted as a dense product with every expert's
    weights. That overcount is linear in the number of experts, so two compiles that differ
    only in it give the real expert FLOPs: E = (X(8) - X(4)) / 4 (less the router's share),
    and the step's count is X(8) - 7 E, to compare with the planner as the dense step is."""
    import dataclasses

    cfg, rows, seq_len = SHAPES["moe"]
    counted = {}
    for experts in (8, 4):
        variant = dataclasses.replace(cfg, n_experts=experts, moe_implementation="ragged_dot")
        cost = compiled_step(variant, rows, seq_len).cost_analysis()
        counted[experts] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    router = 6 * cfg.n_layers * cfg.d_model * rows * seq_len  # one expert's router column, forward and backward
    per_expert_unit = (counted[8] - counted[4] - 4 * router) / 4
    xla = counted[8] - 7 * per_expert_unit
    planned = plan.training_flops(cfg, seq_len, rows * seq_len, "sft")
    full_scores = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len * rows * seq_len
    expected = planned - full_scores * (1 - (seq_len + 64) / (2 * seq_len))
    experts_planned = 6 * cfg.n_layers * cfg.top_k * 3 * cfg.d_model * cfg.d_ff_expert * rows * seq_len
    print(f"XLA (ragged_dot, unrolled) {xla:.3e} FLOPs, causal planned {expected:.3e} ({expected / xla - 1:+.1%}); "
          f"routed experts {per_expert_unit:.3e} against {experts_planned:.3e}")  # fmt: skip
    assert abs(per_expert_unit / experts_planned - 1) < 0.05
    assert abs(expected / xla - 1) < 0.10


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip


def test_cli_prints_every_stage_of_the_published_recipe():
    out = run_cli("recipe=nemotron_like", "scale=published", "--hardware", "h100x64", "--model",
                  "nemotron3-nano-30b-a3b")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [line.split()[0] for line in out.stdout.splitlines() if line.split()[:1] and line.split()[0] in
            ("sft", "rlvr", "dpo", "eval")]  # fmt: skip
    assert rows == ["sft", "rlvr", "dpo", "eval"]
    assert "FLAG" in out.stdout  # 262,144-token rows without remat do not fit an H100


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["recipe=nemotron_like", "--hardware", "a100x8"], ["h100", "h200", "b200", "v5p", "v6e"]),
        (["recipe=nemotron_like", "--hardware", "h100x8", "--model", "llama-7b"], ["qwen3-8b", "deepseek-v3"]),
        (["recipe=no_such_recipe", "--hardware", "h100x8"], ["nemotron_like", "sft_arithmetic"]),
    ],
)
def test_bad_input_exits_2_naming_the_choices(args, names):
    out = run_cli(*args)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert all(n in out.stderr for n in names)
