"""Context parallelism: with the sequence split over mesh.context=4 (or 2, beside the other
axes) of 8 host devices, a packed SFT step gives the one-device loss and gradients, dense
and MoE, ring and all-to-all attention, and so do the GRPO and DPO objectives; the ring
moves keys and values with collective-permutes and never gathers the sequence.

One subprocess (context_steps.py) runs every check, so that XLA sees 8 devices.
"""

import pytest

from ptrain.config import ModelConfig
from ptrain.models.context_parallel import context_parallel_plan
from tests.parallel.host_devices import run_on_eight_devices

ROWS_PER_DATA_SHARD, LENGTH, D_MODEL = 2, 32, 64  # context_steps.py: 4 rows over data=2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_eight_devices("context_steps.py", tmp_path_factory.mktemp("cp") / "results.json")[0]


@pytest.mark.multidevice
def test_split_attention_equals_whole_attention_with_windows_and_packing(results):
    for case, diffs in results["attention"].items():
        assert max(diffs) < 1e-5, (case, diffs)


CASES = [
    ("dense", "ring", "ring"),
    ("dense", "all_to_all", "all_to_all"),
    ("dense", "ring_scan_remat", "ring"),
    ("dense", "fsdp2_context2_tensor2", "ring"),
    ("moe", "ring", "ring"),
    ("moe", "context2_expert4", "ring"),
]


@pytest.mark.multidevice
@pytest.mark.parametrize("model,case,mode", CASES)
def test_context_parallel_step_equals_the_one_device_step(results, model, case, mode):
    r = results[model][case]
    c = r["compare"]
    assert r["plans"] == [mode], r["plans"]  # every attention layer got the plan from load_hf
    assert c["grad_leaves"] >= 14, c
    # Relative differences (max |split - one| / max |one|), float32: summation order only.
    assert c["loss"] < 1e-5 and c["grad_norm"] < 1e-5, c
    assert c["grad_worst"] < 1e-5, f"gradient {c['grad_worst_leaf']} differs by {c['grad_worst']:.3g} (relative)"


@pytest.mark.multidevice
@pytest.mark.parametrize(
    "model,case", [("dense", "ring"), ("dense", "ring_scan_remat"), ("moe", "ring"), ("moe", "context2_expert4")]
)
def test_the_ring_permutes_keys_and_never_gathers_the_sequence(results, model, case):
    hlo = results[model][case]["hlo"]
    assert hlo["collective-permute"] > 0, hlo
    # A gathered sequence would be at least one data shard's [rows, L, D] activation.
    assert hlo["largest_all_gather"] < ROWS_PER_DATA_SHARD * LENGTH * D_MODEL, hlo


@pytest.mark.multidevice
def test_all_to_all_attention_exchanges_heads_instead_of_passing_keys(results):
    hlo = results["dense"]["all_to_all"]["hlo"]
    assert hlo["all-to-all"] > 0 and hlo["collective-permute"] == 0, hlo
    assert hlo["largest_all_gather"] < ROWS_PER_DATA_SHARD * LENGTH * D_MODEL, hlo  # segment ids only


class FakeMesh:
    def __init__(self, **shape):
        self.shape = {"data": 1, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1, **shape}
        self.axis_names = tuple(self.shape)


def test_no_plan_without_a_split_sequence():
    cfg = ModelConfig(n_heads=4, n_kv_heads=2)
    assert context_parallel_plan(cfg, None) is None
    assert context_parallel_plan(cfg, FakeMesh(data=8)) is None
    plan = context_parallel_plan(cfg, FakeMesh(data=2, context=4))
    assert (plan.axis, plan.size, plan.batch_axes, plan.mode) == ("context", 4, ("data",), "ring")


def test_plan_errors_name_the_key_and_the_fix():
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, context_attention="all_to_all")
    with pytest.raises(ValueError, match=r"context_attention=all_to_all .* 2 kv heads; use context_attention=ring"):
        context_parallel_plan(cfg, FakeMesh(context=4))
    with pytest.raises(ValueError, match="map 'length' to one of them"):
        context_parallel_plan(cfg, FakeMesh(context=2, tensor=2), rules=[("length", ("context", "tensor"))])


@pytest.mark.multidevice
@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_rl_and_preference_objectives_on_a_split_sequence_equal_one_device(results, stage):
    r = results["objectives"][stage]
    assert r["grad_leaves"] >= 14, r
    assert r["loss"] < 1e-5 and r["grad_worst"] < 1e-5, r
