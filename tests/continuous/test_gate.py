"""The promotion gate's statistics and rules on cases worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ptrain.config.continuous import TripwireConfig
from ptrain.continuous import gate


def scores(values) -> dict[str, float]:
    return {f"t{i}": float(v) for i, v in enumerate(values)}


def test_constant_differences_give_a_point_interval():
    # Every task moves by +0.25: every resample's mean is 0.25.
    c = gate.paired_bootstrap(scores([0, 0.5, 0.25, 0.75]), scores([0.25, 0.75, 0.5, 1.0]), env="e", samples=500)
    assert (c.champion, c.challenger, c.n) == (0.375, 0.625, 4)
    assert c.delta == pytest.approx(0.25) and c.ci_low == pytest.approx(0.25) and c.ci_high == pytest.approx(0.25)


def test_two_tasks_interval_is_the_resample_extremes():
    # d = [0, 1]: resample means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles are 0 and 1.
    c = gate.paired_bootstrap({"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 1.0}, samples=4000, seed=3)
    assert c.delta == 0.5 and c.ci_low == 0.0 and c.ci_high == 1.0


def test_pairing_by_task_id_not_order():
    champion = {"x": 1.0, "y": 0.0}
    challenger = {"y": 0.0, "x": 1.0}  # same scores, other insertion order
    c = gate.paired_bootstrap(champion, challenger, samples=200)
    assert c.delta == 0.0 and c.ci_low == 0.0 and c.ci_high == 0.0


def test_interval_matches_a_direct_percentile_bootstrap():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 50).astype(float)
    b = np.clip(a + rng.integers(0, 2, 50), 0, 1)
    c = gate.paired_bootstrap(scores(a), scores(b), samples=1000, seed=7, confidence=0.9)
    d = b - a
    order = sorted(range(50), key=lambda i: f"t{i}")  # the gate sorts task ids
    d = d[order]
    means = d[np.random.default_rng(7).integers(0, 50, size=(1000, 50))].mean(axis=1)
    assert c.ci_low == pytest.approx(np.quantile(means, 0.05))
    assert c.ci_high == pytest.approx(np.quantile(means, 0.95))


def test_different_task_sets_are_refused():
    with pytest.raises(ValueError, match="different held-out tasks"):
        gate.paired_bootstrap({"a": 1.0}, {"b": 1.0}, env="math")
    with pytest.raises(ValueError, match="no held-out tasks"):
        gate.paired_bootstrap({}, {}, env="math")


def comparison(env, delta, lo, hi):
    return gate.Comparison(env, 0.5, 0.5 + delta, delta, lo, hi, 64)


def test_promotes_an_improved_target_with_the_rest_non_inferior():
    comps = [comparison("new", 0.2, 0.1, 0.3), comparison("old", -0.02, -0.04, 0.0)]
    decision, reasons = gate.decide(comps, ["new"], [], margin=0.05)
    assert decision == "promoted" and reasons[0].startswith("new improved +0.200")


def test_rejects_a_regression_beyond_the_margin():
    comps = [comparison("new", 0.2, 0.1, 0.3), comparison("old", -0.05, -0.09, -0.01)]
    decision, reasons = gate.decide(comps, ["new"], [], margin=0.05)
    assert decision == "rejected" and len(reasons) == 1 and reasons[0].startswith("old regressed")


def test_rejects_when_no_target_improves_and_any_all_none_rules():
    comps = [comparison("a", 0.1, 0.02, 0.2), comparison("b", 0.05, -0.01, 0.1)]
    assert gate.decide(comps, ["a", "b"], [], margin=0.05, improve="any")[0] == "promoted"
    decision, reasons = gate.decide(comps, ["a", "b"], [], margin=0.05, improve="all")
    assert decision == "rejected" and "no improvement" in reasons[0]
    flat = [comparison("a", 0.0, -0.02, 0.02)]
    assert gate.decide(flat, ["a"], [], margin=0.05, improve="any")[0] == "rejected"
    assert gate.decide(flat, ["a"], [], margin=0.05, improve="none")[0] == "promoted"
    with pytest.raises(ValueError, match="not evaluated"):
        gate.decide(flat, ["b"], [], margin=0.05)


@pytest.mark.parametrize(
    ("name", "metric", "old", "new", "tripped"),
    [
        ("invalid_tool_calls", "invalid_tool_calls", 0.10, 0.20, True),
        ("invalid_tool_calls", "invalid_tool_calls", 0.10, 0.14, False),
        ("hallucinated_tool_calls", "hallucinated_tool_calls", 0.0, 0.06, True),
        ("abstentions", "abstained", 0.02, 0.10, True),
        ("abstentions", "abstained", 0.10, 0.02, False),
        ("format_errors", "formatted", 0.95, 0.85, True),  # 5% -> 15% unparsable
        ("format_errors", "formatted", 0.95, 0.99, False),
    ],
)
def test_each_rise_tripwire(name, metric, old, new, tripped):
    readings = gate.tripwires({"e": {metric: old}}, {"e": {metric: new}}, TripwireConfig())
    (reading,) = [r for r in readings if r.name == name]
    assert reading.tripped is tripped and reading.env == "e"
    assert reading.value == pytest.approx((new - old) * (-1 if metric == "formatted" else 1))
    decision, reasons = gate.decide([comparison("e", 0.2, 0.1, 0.3)], ["e"], readings, margin=0.05)
    assert decision == ("rejected" if tripped else "promoted")
    if tripped:
        assert reasons == [f"tripwire {name} on e: {reading.value:.4g} beyond the limit 0.05"]


def test_length_and_kl_tripwires_and_switching_off():
    limits = TripwireConfig(length_ratio=1.5, kl=0.1)
    readings = gate.tripwires({"e": {"response_length": 40.0}}, {"e": {"response_length": 70.0}}, limits, kl=0.2)
    by_name = {r.name: r for r in readings}
    assert by_name["length_ratio"].value == pytest.approx(1.75) and by_name["length_ratio"].tripped
    assert by_name["kl"].value == 0.2 and by_name["kl"].tripped and by_name["kl"].env is None
    off = TripwireConfig(length_ratio=None, kl=None)
    assert gate.tripwires({"e": {"response_length": 40.0}}, {"e": {"response_length": 70.0}}, off, kl=0.2) == []
    # KL not measured (anchor off): no reading.
    assert [r.name for r in gate.tripwires({}, {}, limits, kl=None)] == []


def test_live_drop_needs_a_full_window_below_the_band():
    held = {"math": 0.8}
    rows = [{"env": "math", "correct": 1}] * 5 + [{"env": "math", "correct": 0}] * 5
    assert gate.live_drop(rows[:9], held, window=10, drop=0.1) is None  # window not full
    reason = gate.live_drop(rows, held, window=10, drop=0.1)
    assert reason is not None and "0.500 over its last 10" in reason
    assert gate.live_drop(rows, held, window=10, drop=0.4) is None  # 0.5 > 0.8 - 0.4
    junk = [{"env": "other", "correct": 0}] * 20 + ["not a row", {"env": "math"}]
    assert gate.live_drop(junk, held, window=10, drop=0.1) is None


def test_machine_hour_prices_by_platform():
    from ptrain.config.cost import ACCELERATOR_HOUR_USD, CPU_CORE_HOUR_USD, CostConfig

    c = CostConfig()
    assert c.machine_hour_usd("cpu", devices=1, cpu_cores=2) == pytest.approx(2 * CPU_CORE_HOUR_USD)
    assert c.machine_hour_usd("gpu", devices=8, cpu_cores=64) == pytest.approx(8 * ACCELERATOR_HOUR_USD)
    assert CostConfig(cpu_core_hour_usd=0.0).machine_hour_usd("cpu", 1, 16) == 0.0
    assert CostConfig(output_per_mtok_usd=2.0).tokens_usd(0, 0, 500_000) == pytest.approx(1.0)


def test_a_judge_that_drifts_blocks_promotion():
    comps = [comparison("e", 0.2, 0.1, 0.3)]
    assert gate.decide(comps, ["e"], [], margin=0.05, judge_drop=0.04, judge_limit=0.05)[0] == "promoted"
    decision, reasons = gate.decide(comps, ["e"], [], margin=0.05, judge_drop=0.1, judge_limit=0.05)
    assert decision == "rejected" and reasons == ["the judge's calibration agreement fell by 0.100 (more than 0.05)"]
