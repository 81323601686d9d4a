"""On-policy preference pairs: grading and pairing rules, and the reuse of written pairs."""

import dataclasses
import json

import pytest

from ptrain.config import DataConfig, RunConfig
from ptrain.stages import policy_pairs
from ptrain.stages.policy_pairs import build_pairs, policy_pairs_data


def row(question="12 + 30 = ?", answer="42"):
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": f"worked ... Answer: {answer}"}],
        "rejected": [{"role": "assistant", "content": "worked ... Answer: 41"}],
    }


TASK = {"kind": "arithmetic", "answer": "42"}


def test_correct_and_incorrect_samples_are_zipped_into_pairs():
    samples = [("so Answer: 42", True), ("so Answer: 40", True), ("so Answer: 42", True), ("so Answer: 43", True)]
    pairs, counts = build_pairs([row()], [TASK], [samples])
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("so Answer: 42", "so Answer: 40"),
        ("so Answer: 42", "so Answer: 43"),
    ]
    assert pairs[0]["prompt"] == row()["prompt"] and pairs[0]["task"] == TASK
    assert counts == {
        "prompts": 1,
        "pairs_from_samples": 2,
        "pairs_with_data_chosen": 0,
        "prompts_all_correct": 0,
        "pairs": 2,
        "sample_accuracy": 0.5,
    }


def test_a_prompt_never_answered_right_pairs_the_data_answer_with_a_wrong_sample():
    pairs, counts = build_pairs([row()], [TASK], [[("Answer: 7", True), ("Answer: 8", True)]])
    assert len(pairs) == 1 and pairs[0]["chosen"][0]["content"] == "worked ... Answer: 42"
    assert pairs[0]["rejected"][0]["content"] == "Answer: 7"
    assert counts["pairs_with_data_chosen"] == 1 and counts["sample_accuracy"] == 0.0


def test_cut_samples_are_wrong_and_empty_or_all_correct_prompts_give_no_pair():
    # the right number, but cut by the length cap before the stop token: incorrect
    pairs, _ = build_pairs([row()], [TASK], [[("Answer: 42", True), ("Answer: 42 and on and on", False)]])
    assert [p["rejected"][0]["content"] for p in pairs] == ["Answer: 42 and on and on"]
    pairs, counts = build_pairs([row(), row()], [TASK, TASK], [[("Answer: 42", True)] * 2, [("", True), ("  ", False)]])
    assert pairs == [] and counts["prompts_all_correct"] == 1 and counts["pairs"] == 0


def _run(tmp_path, **dpo) -> RunConfig:
    run = RunConfig(run_dir=str(tmp_path))
    return dataclasses.replace(run, algo=dataclasses.replace(run.algo, dpo=dataclasses.replace(run.algo.dpo, **dpo)))


def test_written_pairs_are_reused_and_other_settings_are_refused(tmp_path):
    run = _run(tmp_path, policy_pairs=8)
    (tmp_path / policy_pairs.PAIRS_FILE).write_text(json.dumps(row()) + "\n")
    meta = {"settings": policy_pairs._settings(run), "counts": {"pairs": 1}}
    (tmp_path / policy_pairs.META_FILE).write_text(json.dumps(meta))
    data = DataConfig(format="preference")
    # reuse needs no model: placed and params are never touched
    got, held = policy_pairs_data(run, str(tmp_path), None, None, None, data, tokenizer=None)
    assert got.source == "jsonl" and got.train_path == str(tmp_path / policy_pairs.PAIRS_FILE)
    assert held is None  # no eval split: no held-out pairs
    # With an eval split, the held-out pairs are read back from their own file.
    data = DataConfig(format="preference", source="jsonl", train_path=str(tmp_path / "t.jsonl"),
                      eval_path=str(tmp_path / "e.jsonl"))  # fmt: skip
    (tmp_path / policy_pairs.EVAL_PAIRS_FILE).write_text(json.dumps(row()) + "\n")
    got, held = policy_pairs_data(run, str(tmp_path), None, None, None, data, tokenizer=None)
    assert held.eval_path == str(tmp_path / policy_pairs.EVAL_PAIRS_FILE) and got.eval_path == str(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="delete .* to sample again"):
        policy_pairs_data(_run(tmp_path, policy_pairs=16), str(tmp_path), None, None, None, data, tokenizer=None)


def test_step_level_pairs_stop_the_rejected_side_at_its_first_wrong_line():
    chosen = "1-0-0=1 b0 1\n14-6-0=8 b1 81\n9-0-1=8 b0 881\nAnswer: 881"
    wrong = "1-0-0=1 b0 1\n14-6-0=6 b1 61\n9-0-1=7 b0 761\nAnswer: 761"
    assert policy_pairs.first_wrong_step(chosen, wrong) == "1-0-0=1 b0 1\n14-6-0=6 b1 61"
    assert policy_pairs.first_wrong_step(chosen, chosen + "\nmore") == chosen + "\nmore"
    task = {"kind": "arithmetic", "answer": "881", "fault": "digit@0"}
    data_row = dict(row(answer="881"), chosen=[{"role": "assistant", "content": chosen}])
    pairs, _ = build_pairs([data_row], [task], [[(wrong, True)]], step_level=True)
    assert pairs[0]["rejected"][0]["content"] == "1-0-0=1 b0 1\n14-6-0=6 b1 61"
    assert pairs[0]["task"] == {"kind": "arithmetic", "answer": "881"}  # the data's own fault note is dropped
