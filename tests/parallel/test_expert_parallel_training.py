"""Expert parallelism in training: tiny_moe and tiny_deepseek SFT steps on a data=2 x expert=4
mesh of 8 host devices (the batch split over both) equal the one-device steps, and the
compiled step moves tokens (all-to-all) where automatic partitioning gathers whole
expert-weight stacks.

One subprocess (moe_ep_steps.py) runs every check, so that XLA sees 8 devices and each
step compiles once.
"""

import pytest

from tests.parallel.host_devices import run_on_eight_devices


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    got, stderr = run_on_eight_devices("moe_ep_steps.py", tmp_path_factory.mktemp("ep") / "results.json")
    return dict(got, stderr=stderr)


@pytest.mark.multidevice
@pytest.mark.parametrize("name", ["tiny_moe", "tiny_deepseek"])
def test_expert_parallel_step_equals_the_one_device_step(results, name):
    r = results[name]
    c = r["compare"]
    assert r["ep_wired"] == ["expert"], r["ep_wired"]  # every MoE block got the mesh from load_hf
    assert r["expert_weight_specs"] and all("expert" in s for s in r["expert_weight_specs"])
    assert r["batch_rows_per_device"] == [1], r["batch_rows_per_device"]  # 8 rows over data 2 x expert 4
    # Relative differences (max |ep - one| / max |one|): float32 summation order only.
    assert c["loss"] < 1e-5 and c["grad_norm"] < 1e-5, c
    assert c["expert_load"] < 1e-5, c
    assert c["grad_leaves"] >= 20, c
    assert c["grad_worst"] < 1e-4, f"gradient {c['grad_worst_leaf']} differs by {c['grad_worst']:.3g} (relative)"
    # Prefill through the expert-parallel path, 2-token decode steps through the fallback.
    assert r["generate_tokens_equal"] and r["generate_logprob_diff"] < 1e-4, r


@pytest.mark.multidevice
def test_deepseek_router_bias_update_matches(results):
    c = results["tiny_deepseek"]["compare"]
    assert c["router_bias_leaves"] == 1 and c["router_bias_moved"], c  # one stacked bias (scan layout), updated
    assert c["router_bias"] < 1e-6, c


@pytest.mark.multidevice
@pytest.mark.parametrize("name", ["tiny_moe", "tiny_deepseek"])
def test_expert_parallel_step_exchanges_tokens_instead_of_gathering_experts(results, name):
    r = results[name]
    assert r["hlo"]["one_device"]["all-to-all"] == 0
    assert r["hlo"]["expert_parallel"]["all-to-all"] > 0, r["hlo"]
    assert r["expert_stack_gathers"]["expert_parallel"] == 0, r["expert_stack_gathers"]
    if "automatic" in r["hlo"]:  # the same mesh and placement from a model built without the mesh
        assert r["hlo"]["automatic"]["all-to-all"] == 0, r["hlo"]
        assert r["expert_stack_gathers"]["automatic"] > 0, r["expert_stack_gathers"]


@pytest.mark.multidevice
def test_expert_parallel_with_a_tensor_axis_keeps_the_activation_layout(results):
    """Experts over expert x their FFN over tensor: same step, and XLA never has to replicate
    activations to move from the shard_map's all-token split to the attention's heads split."""
    c = results["tiny_deepseek"]["compare_tensor2_expert4"]
    assert c["loss"] < 1e-5 and c["grad_worst"] < 1e-4 and c["router_bias"] < 1e-6, c
    assert results["tiny_deepseek"]["hlo"]["tensor2_expert4"]["all-to-all"] > 0
    assert "Involuntary full rematerialization" not in results["stderr"], [
        line for line in results["stderr"].splitlines() if "Involuntary" in line
    ][:3]
