"""What starts a round when nothing arrives: the timer and the live pass-rate trigger, read by the
loop from its state (no training: the loop is asked for its next plan only)."""

from __future__ import annotations

import json
import time

import ptrain
from ptrain.continuous import ledger
from ptrain.continuous.loop import ContinuousLoop


def loop_at(tmp_path, *overrides):
    inbox = tmp_path / "inbox"
    inbox.mkdir(exist_ok=True)
    cfg = ptrain.compose("continuous", ["scale=smoke", f"continuous.inbox={inbox}", f"run_dir={tmp_path / 'R'}",
                                        *overrides])  # fmt: skip
    scores = tmp_path / "eval"
    scores.mkdir(exist_ok=True)
    (scores / "scores.json").write_text(json.dumps({"sampled": {"arithmetic": {"eval-0": 1.0, "eval-1": 0.6}}}))
    (tmp_path / "R").mkdir(exist_ok=True)
    state = ledger.load_state(str(tmp_path / "R"))
    state.update(envs={"arithmetic": {"spec": {"name": "arithmetic"}, "sha256": "x", "round": 0, "file": None}},
                 champion=str(tmp_path / "champion"), champion_round=0, champion_evals=[str(scores)],
                 next_round=1, last_round_end=time.time())  # fmt: skip
    ledger.save_state(str(tmp_path / "R"), state)
    return ContinuousLoop(cfg, None)


def test_nothing_new_and_no_trigger_starts_nothing(tmp_path):
    assert loop_at(tmp_path)._next_plan() is None


def test_the_timer_starts_a_round_on_every_environment(tmp_path):
    loop = loop_at(tmp_path, "continuous.every_s=60")
    assert loop._next_plan() is None  # the last round ended just now
    loop.state["last_round_end"] = time.time() - 61
    plan = loop._next_plan()
    assert plan["trigger"] == "timer: every 60 s" and plan["round"] == 1
    assert plan["new"] == [] and plan["targets"] == ["arithmetic"]  # all environments are targets
    assert ledger.load_state(str(tmp_path / "R"))["current"] == plan  # recorded before any work


def test_a_live_drop_starts_a_round_once(tmp_path):
    live = tmp_path / "live.jsonl"
    loop = loop_at(tmp_path, f"continuous.trigger.path={live}", "continuous.trigger.window=4",
                   "continuous.trigger.drop=0.2")  # fmt: skip
    assert loop._next_plan() is None  # no file yet
    live.write_text("".join(json.dumps({"env": "arithmetic", "correct": c}) + "\n" for c in (1, 1, 1, 0)))
    assert loop._next_plan() is None  # 0.75 against a held-out 0.8: within the band
    with open(live, "a") as f:
        f.write("".join(json.dumps({"env": "arithmetic", "correct": 0}) + "\n" for _ in range(4)))
    plan = loop._next_plan()
    assert plan is not None and plan["trigger"].startswith("live pass rate of arithmetic: 0.000")
    # The lines that started it are spent: the next look needs new ones.
    loop.state["current"] = None
    assert loop._next_plan() is None and loop.state["trigger_lines"] == 8


def test_judge_agreement_before_and_now_is_read_from_the_eval_stages(tmp_path):
    loop = loop_at(tmp_path)
    key = "eval/judge_calibration/agreement"
    champion_eval = tmp_path / "eval"
    (champion_eval / "DONE.json").write_text(json.dumps({key: 0.9}))
    stages = tmp_path / "R" / "rounds" / "1" / "stages"
    (stages / "eval_challenger").mkdir(parents=True)
    assert loop._judge_agreements(str(stages)) == {}  # not measured yet
    (stages / "eval_challenger" / "DONE.json").write_text(json.dumps({key: 0.7}))
    got = loop._judge_agreements(str(stages))
    assert got["champion"] == 0.9 and got["challenger"] == 0.7 and abs(got["drop"] - 0.2) < 1e-12
