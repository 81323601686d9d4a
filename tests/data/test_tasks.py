"""The generated arithmetic task: determinism, disjoint splits, worked solutions that verify, pairs."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptrain.data import tasks
from ptrain.data.tasks import Problem, check_answer, extract_answer, worked_solution


def test_generation_is_deterministic_and_splits_are_disjoint():
    a = tasks.generate_records(300, 50, ops=("+", "-", "*"), seed=3)
    b = tasks.generate_records(300, 50, ops=("+", "-", "*"), seed=3)
    assert a == b
    c = tasks.generate_records(300, 50, ops=("+", "-", "*"), seed=4)
    assert a != c
    train, held = a
    key = lambda r: json.dumps(r["task"], sort_keys=True)
    assert len({key(r) for r in train}) == 300 and len({key(r) for r in held}) == 50
    assert not {key(r) for r in train} & {key(r) for r in held}


def test_eval_split_does_not_depend_on_n_train():
    _, held_small = tasks.generate_records(10, 40, seed=1)
    _, held_big = tasks.generate_records(500, 40, seed=1)
    assert held_small == held_big


def test_knobs_are_respected():
    train, _ = tasks.generate_records(400, 10, ops=("*",), min_digits=3, max_digits=3, seed=0)
    for r in train:
        t = r["task"]
        assert t["op"] == "*" and 100 <= t["a"] <= 999 and 2 <= t["b"] <= 9


def test_impossible_request_is_refused():
    with pytest.raises(ValueError, match="n_train"):
        tasks.generate_problems(1000, 10, ops=("+",), min_digits=1, max_digits=1)


def test_worked_solution_examples():
    """Hand-checked solutions: carries, a carry out of the top column, borrows, leading zeros."""
    assert worked_solution(Problem("+", 347, 589)) == "7+9+0=16 c1 6\n4+8+1=13 c1 36\n3+5+1=9 c0 936\nAnswer: 936"
    assert worked_solution(Problem("+", 95, 7)).endswith("9+0+1=10 c1 02\nAnswer: 102")
    assert worked_solution(Problem("-", 503, 78)) == "13-8-0=5 b1 5\n10-7-1=2 b1 25\n5-0-1=4 b0 425\nAnswer: 425"
    assert worked_solution(Problem("-", 100, 99)).endswith("1-0-1=0 b0 001\nAnswer: 1")
    assert worked_solution(Problem("*", 47, 6)) == "7*6+0=42 c4 2\n4*6+4=28 c2 82\nAnswer: 282"


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(["+", "-", "*"]), a=st.integers(0, 99999), b=st.integers(0, 99999))
def test_every_worked_solution_verifies(op, a, b):
    if op == "-" and b > a:
        a, b = b, a
    if op == "*":
        b = b % 8 + 2
    p = Problem(op, a, b)
    text = worked_solution(p)
    assert extract_answer(text) == str(p.answer)
    assert check_answer(p.metadata(), text)


def test_preference_pairs_are_wrong_plausible_and_share_the_prompt():
    train, held = tasks.generate_records(200, 20, kind="preference", ops=("+", "-", "*"), seed=5)
    assert train == tasks.generate_records(200, 20, kind="preference", ops=("+", "-", "*"), seed=5)[0]
    kinds = set()
    for r in train + held:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert check_answer(r["task"], chosen)
        assert not check_answer(r["task"], rejected)
        # Same number of lines and the same layout: a slip, not garbage.
        assert len(chosen.splitlines()) == len(rejected.splitlines())
        assert r["prompt"][0]["content"] == Problem(r["task"]["op"], r["task"]["a"], r["task"]["b"]).question()
        kinds.add(r["task"]["fault"].split("@")[0])
    assert kinds == {"carry", "digit"}


def test_write_jsonl_round_trip(tmp_path):
    train, _ = tasks.generate_records(20, 5, seed=0)
    path = tasks.write_jsonl(train, str(tmp_path / "sub" / "train.jsonl"))
    with open(path) as f:
        assert [json.loads(line) for line in f] == train


def test_examples_are_short_enough_for_the_tiny_model(tokenizer):
    """Design budget: ~64-128 tokens per 3-digit example, so 5-10M tokens is ~100k examples."""
    from ptrain.data.chat import tokenize_conversation

    train, _ = tasks.generate_records(
        200, 5, ops=("+", "-", "*"), min_digits=2, max_digits=3, seed=random.Random(0).randrange(100)
    )
    lengths = [len(tokenize_conversation(tokenizer, r["messages"])[0]) for r in train]
    assert 40 <= min(lengths) and max(lengths) <= 96, (min(lengths), max(lengths))


def test_write_jsonl_if_changed_keeps_an_identical_file(tmp_path):
    import os

    train, _ = tasks.generate_records(20, 5, seed=0)
    path = tasks.write_jsonl(train, str(tmp_path / "t.jsonl"))
    os.utime(path, ns=(1, 1))
    tasks.write_jsonl(train, path, if_changed=True)
    assert os.stat(path).st_mtime_ns == 1
    tasks.write_jsonl(train[:5], path, if_changed=True)
    assert os.stat(path).st_mtime_ns != 1 and len(open(path).readlines()) == 5


def test_noise_gives_that_share_of_wrong_demonstrations_and_clean_held_out_rows():
    from ptrain.data.tasks import check_answer

    train, held = tasks.generate_records(2000, 50, noise=0.25, seed=3)
    wrong = [r for r in train if not check_answer(r["task"], r["messages"][1]["content"])]
    assert 0.2 < len(wrong) / len(train) < 0.3
    assert all("fault" in r["task"] for r in wrong) and sum("fault" in r["task"] for r in train) == len(wrong)
    assert all(check_answer(r["task"], r["messages"][1]["content"]) for r in held)
    clean, _ = tasks.generate_records(2000, 50, seed=3)
    assert [r["messages"][0] for r in clean] == [r["messages"][0] for r in train]  # the same problems
