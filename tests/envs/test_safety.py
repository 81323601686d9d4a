"""Reward code that raises, hangs, crashes or returns junk scores 0 with a reason; callers on
any thread carry on, and the pool recovers."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from ptrain.envs.safety import RewardRunner, run_reward_fn


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


def raises(_: str) -> float:
    raise ValueError("cannot parse the answer")


def hangs(_: str) -> float:
    while True:
        time.sleep(1)


def crashes(_: str) -> float:
    os._exit(3)


def returns_text(_: str):
    return "1.0?"


def returns_nan(_: str) -> float:
    return float("nan")


def returns_huge_int(_: str) -> int:
    return 10**400  # float() of it raised OverflowError in the caller, out of the environment


def uses_signal_alarm(x: float) -> float:
    """What math-verify does: a SIGALRM timeout, which only works on a main thread."""

    def on_alarm(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(5)
    try:
        return x * 2
    finally:
        signal.alarm(0)


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(workers=2, timeout_s=5.0) as r:
        yield r


def test_good_reward_comes_back(runner):
    out = runner.run(exact_match, " 42 ", "42")
    assert (out.reward, out.reason, out.kind, out.ok) == (1.0, None, "ok", True)


def test_failures_score_zero_with_a_reason(runner, caplog):
    cases = [
        (raises, "raised", "ValueError: cannot parse the answer"),
        (crashes, "crashed", "exit code 3"),
        (returns_text, "bad_value", "not a number"),
        (returns_nan, "bad_value", "nan"),
        (returns_huge_int, "bad_value", "an int of 1329 bits, past float's range"),
    ]
    with caplog.at_level(logging.WARNING, logger="ptrain.envs.safety"):
        for fn, kind, reason in cases:
            out = runner.run(fn, "x")
            assert out.reward == 0.0 and out.kind == kind and reason in out.reason, out
    assert sum("scored 0" in r.getMessage() for r in caplog.records) == len(cases)
    assert runner.run(exact_match, "a", "a").reward == 1.0  # the pool carries on


def test_a_hang_is_cut_at_the_timeout_from_a_worker_thread(runner):
    before = dict(runner.stats)
    results = {}

    def worker():
        results["hang"] = runner.run(hangs, "x", timeout_s=0.5)
        results["alarm"] = runner.run(uses_signal_alarm, 2.0)
        results["after"] = runner.run(exact_match, "b", "b")

    start = time.monotonic()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    hang = results["hang"]
    assert hang.reward == 0.0 and hang.kind == "timeout" and "timeout after 0.5 s" in hang.reason
    assert 0.5 <= hang.elapsed_s < 3.0 and time.monotonic() - start < 30
    assert results["alarm"].reward == 4.0, results["alarm"]  # signal.alarm works in the worker
    assert results["after"].reward == 1.0
    assert runner.stats["timeout"] == before["timeout"] + 1 and runner.stats["ok"] == before["ok"] + 2


def test_many_threads_share_the_pool(runner):
    outs = [None] * 8

    def call(i):
        outs[i] = runner.run(exact_match, str(i), str(i % 2))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [o.reward for o in outs] == [float(str(i) == str(i % 2)) for i in range(8)]


def test_an_unpicklable_function_is_a_clear_error(runner):
    with pytest.raises(TypeError, match="define the function at module level"):
        runner.run(lambda x: 1.0, "x")
    assert runner.run(exact_match, "c", "c").ok


def test_run_reward_fn_uses_a_shared_pool():
    assert run_reward_fn(exact_match, "1", "1", timeout_s=5).reward == 1.0
    assert run_reward_fn(raises, "1").reason.startswith("ValueError")
