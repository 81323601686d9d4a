"""The `code` environment: write a Python function; hidden unit tests run in the sandbox.

The completion's code (its last ```python block) and the task's hidden tests run in one
`ptrain.sandbox` run per sample: a harness executes the code once, then each test
(usually one assert) in a fresh copy of the code's namespace with its own time limit
(options.test_timeout_s), and writes one result line per test. reward = correct_reward x
(tests passed / tests), as the component `tests`; metrics tests_passed, tests_total,
pass_all, and why tests failed (timeouts, a load error, the sandbox killing the run).

The solution's own output goes to /dev/null, and result lines carry a random nonce made
for that run, so printing "passed" does not pass a test. (Code that reads the harness from
its own process could still forge results: the harness shares the solution's process by
design, one process per sample; the sandbox keeps that process away from the host.)

The stage's sandbox is `make_env(..., sandbox=)`: a Sandbox, or a SandboxConfig to build
one from (None: the default config). A machine where it cannot isolate anything is an error
when the environment is built (SandboxUnavailableError says what to install), never a run
of silent zeros.

Tasks: a bundled family of generated problems (FAMILIES: list and string functions with
reference implementations that produce the hidden tests, each with a parameter that varies
between tasks), or JSONL rows {"prompt", "tests"} (options.path), optionally with "solution"
(a reference implementation's source) and "approach" (its idea in a line).

A generated family's reference is written as source: the hidden tests' expected values are
what that source returns, and `demonstration(task)` answers with the same source in a
```python block, after the approach as reasoning, so a demonstration passes its task's tests
by construction. A JSONL row can be demonstrated only when it has a "solution".
"""

from __future__ import annotations

import ast
import asyncio
import json
import random
import re
import secrets
import string
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ptrain.envs.base import Task
from ptrain.envs.single_turn import Score, SingleTurnEnv

INSTRUCTION = "Answer with the complete function in a ```python code block."

HARNESS = r"""
import json, os, signal, sys


class TestTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise TestTimeout()


def describe(e):
    try:
        return f"{type(e).__name__}: {e}"[:300]
    except BaseException:
        return type(e).__name__


def main():
    nonce, per_test = sys.argv[1], float(sys.argv[2])
    with open("tests.json") as f:
        spec = json.load(f)
    with open("solution.py") as f:
        source = f.read()
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)

    def report(**fields):
        fields["nonce"] = nonce
        out.write(json.dumps(fields) + "\n")
        out.flush()

    def run(src, ns, name):
        signal.setitimer(signal.ITIMER_REAL, per_test)
        try:
            exec(compile(src, name, "exec"), ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    signal.signal(signal.SIGALRM, on_alarm)
    report(load="start")
    namespace = {"__name__": "__solution__"}
    try:
        run(source, namespace, "solution.py")
    except TestTimeout:
        report(load="timeout")
        os._exit(0)
    except BaseException as e:
        report(load="error", detail=describe(e))
        os._exit(0)
    report(load="ok")
    for i, test in enumerate(spec["tests"]):
        ns = dict(namespace)
        try:
            for k, setup in enumerate(spec.get("setup", [])):
                run(setup, ns, f"setup_{k}")
            run(test, ns, f"test_{i}")
            report(test=i, status="pass")
        except AssertionError as e:
            report(test=i, status="fail", detail=describe(e))
        except TestTimeout:
            report(test=i, status="timeout")
        except BaseException as e:
            report(test=i, status="error", detail=describe(e))
    out.flush()
    os._exit(0)


main()
"""
"""The test runner copied into the sandbox with solution.py and tests.json."""

_BLOCK_RE = re.compile(r"```[ \t]*(?:python3|python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str, require_block: bool = True) -> str | None:
    """The last fenced code block of text (```python ... ```), or with require_block=False
    the whole text when there is none; None when there is no code."""
    blocks = _BLOCK_RE.findall(text)
    if blocks:
        return blocks[-1]
    if not require_block and text.strip():
        return text
    return None


def split_tests(source: str) -> tuple[list[str], list[str]]:
    """(setup, tests) of a test file: each top-level assert is one test; other statements
    (imports, helpers) are setup, run before every test."""
    tree = ast.parse(source)
    setup, tests = [], []
    for node in tree.body:
        segment = ast.get_source_segment(source, node)
        (tests if isinstance(node, ast.Assert) else setup).append(segment)
    return setup, tests


def check_row(row: dict[str, Any]) -> str | None:
    """What is wrong with a JSONL row's prompt or tests, or None. A test that does not parse
    would fail for every completion, so the task could never be solved."""
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        return f"prompt must be a non-empty string, got {row['prompt']!r}"
    tests = row["tests"]
    if isinstance(tests, str):
        try:
            _, asserts = split_tests(tests)
        except SyntaxError as e:
            return f"its tests do not parse as Python ({e})"
        return None if asserts else "its tests hold no top-level assert"
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        return "tests must be a non-empty list of Python sources, or a string with top-level asserts"
    for i, test in enumerate(tests):
        try:
            ast.parse(test)
        except SyntaxError as e:
            return f"tests[{i}] does not parse as Python ({e})"
    for key in ("solution", "approach"):
        if key in row and not (isinstance(row[key], str) and row[key].strip()):
            return f"{key} (optional, for demonstrations) must be a non-empty string, got {row[key]!r:.80}"
    if "solution" in row:
        try:
            ast.parse(row["solution"])
        except SyntaxError as e:
            return f"its solution does not parse as Python ({e})"
    return None


def parse_results(stdout: str, nonce: str, n_tests: int) -> dict[str, Any]:
    """The harness's result lines with this run's nonce: statuses per test and how loading
    the solution went: None (the harness never started), "start" (the solution ended the
    process while loading), "ok", "error" or "timeout"."""
    statuses: dict[int, str] = {}
    details: dict[int, str] = {}
    load = None
    load_detail = ""
    for line in stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("nonce") != nonce:
            continue
        if "load" in rec and (load is None or load == "start"):
            load, load_detail = rec["load"], str(rec.get("detail", ""))
        i = rec.get("test")
        if isinstance(i, int) and 0 <= i < n_tests and i not in statuses:
            statuses[i] = str(rec.get("status"))
            if rec.get("detail"):
                details[i] = str(rec["detail"])
    return {"statuses": statuses, "details": details, "load": load, "load_detail": load_detail}


# ----------------------------------------------------------------------------- generated families


@dataclass(frozen=True)
class Drawn:
    """One drawn problem of a family: what the function does, how, and the code that does it."""

    description: str
    """The statement's "... that <description>."."""
    approach: str
    """The idea of the solution in a line (a demonstration's reasoning)."""
    solution: str
    """Source of the reference function; the hidden tests' expected values are its results."""
    inputs: Callable[[random.Random], tuple]
    """A draw of one call's arguments."""


@dataclass(frozen=True)
class Family:
    """A function-writing problem: `draw(rng)` gives a Drawn problem with its parameter set."""

    name: str
    signature: str
    draw: Callable[[random.Random], Drawn]

    @property
    def function(self) -> str:
        """The function's name."""
        return self.signature.split("(")[0]


def _ints(rng: random.Random, lo: int = -30, hi: int = 30, max_len: int = 10) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, max_len))]


def _text(rng: random.Random, alphabet: str = string.ascii_letters + "  ", max_len: int = 20) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def _filter_divisible(rng):
    k = rng.randint(2, 12)
    keep = rng.random() < 0.5
    test = "==" if keep else "!="
    what = "divisible" if keep else "not divisible"
    return Drawn(
        f"returns the elements of the list of integers xs that are {what} by {k}, in their order",
        f"Keep each x with x % {k} {test} 0, in order, with a list comprehension.",
        f"def filter_divisible(xs):\n    return [x for x in xs if x % {k} {test} 0]\n",
        lambda r: (_ints(r),),
    )


def _count_char(rng):
    c = rng.choice(string.ascii_lowercase)
    return Drawn(
        f"returns how many times the letter '{c}' occurs in the string s, upper or lower case",
        f"Lower-case s so that '{c.upper()}' counts too, then count '{c}'.",
        f"def count_char(s):\n    return s.lower().count('{c}')\n",
        lambda r: (_text(r, c * 4 + c.upper() * 2 + string.ascii_lowercase + " "),),
    )


def _rotate_list(rng):
    left = rng.random() < 0.5
    side = "left" if left else "right"
    cut = "k" if left else "len(xs) - k"
    return Drawn(
        f"returns the list xs rotated {side} by k positions (k >= 0 may exceed len(xs); [] stays [])",
        f"Return [] for an empty list; else take k modulo len(xs) and join the two slices cut at {cut}.",
        "def rotate_list(xs, k):\n"
        "    if not xs:\n"
        "        return []\n"
        "    k %= len(xs)\n"
        f"    return xs[{cut}:] + xs[:{cut}]\n",
        lambda r: (_ints(r, 0, 9, 8), r.randint(0, 12)),
    )


def _running(rng):
    op = rng.choice(["sum", "product", "maximum"])
    step = {"sum": "out[-1] + x", "product": "out[-1] * x", "maximum": "max(out[-1], x)"}[op]
    return Drawn(
        f"returns the running {op} of the list of integers xs: element i is the {op} of xs[0..i]",
        f"Walk xs once; each new element is {step} (the first is x itself).",
        f"def running(xs):\n    out = []\n    for x in xs:\n        out.append({step} if out else x)\n    return out\n",
        lambda r: (_ints(r, -5, 9, 8),),
    )


def _dedupe(rng):
    first = rng.random() < 0.5
    if first:
        approach = "Walk xs with a set of values seen; keep a value the first time it comes."
        solution = (
            "def dedupe(xs):\n"
            "    seen, out = set(), []\n"
            "    for x in xs:\n"
            "        if x not in seen:\n"
            "            seen.add(x)\n"
            "            out.append(x)\n"
            "    return out\n"
        )
    else:
        approach = "Map each value to its last index; keep the elements at those indexes, in order."
        solution = (
            "def dedupe(xs):\n"
            "    last = {x: i for i, x in enumerate(xs)}\n"
            "    return [x for i, x in enumerate(xs) if last[x] == i]\n"
        )
    which = "first" if first else "last"
    return Drawn(
        f"returns xs without repeated values, keeping the {which} occurrence of each, in list order",
        approach,
        solution,
        lambda r: (_ints(r, 0, 6, 12),),
    )


def _kth_largest(rng):
    k = rng.randint(2, 4)
    return Drawn(
        f"returns the {k}-th largest distinct value of the list xs, or None when it has fewer than {k} distinct values",
        f"Sort the distinct values in descending order; the answer is at index {k - 1} if there are {k}.",
        "def kth_largest(xs):\n"
        "    distinct = sorted(set(xs), reverse=True)\n"
        f"    return distinct[{k - 1}] if len(distinct) >= {k} else None\n",
        lambda r: (_ints(r, -9, 9, 9),),
    )


def _run_length(rng):
    count_first = rng.random() < 0.5
    piece = "str(j - i) + s[i]" if count_first else "s[i] + str(j - i)"
    example = "'3a1b'" if count_first else "'a3b1'"
    return Drawn(
        f"returns the run-length encoding of the string s, e.g. 'aaab' -> {example} ('' -> '')",
        f"Find each run s[i:j] of one character and write {piece}.",
        "def run_length(s):\n"
        "    out, i = [], 0\n"
        "    while i < len(s):\n"
        "        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n"
        "            j += 1\n"
        f"        out.append({piece})\n"
        "        i = j\n"
        "    return ''.join(out)\n",
        lambda r: ("".join(r.choice("aab") * r.randint(1, 4) for _ in range(r.randint(0, 5))),),
    )


def _digit_sum(rng):
    root = rng.random() < 0.5
    solution = "def digit_sum(n):\n    s = sum(int(d) for d in str(abs(n)))\n"
    if root:
        solution += "    while s >= 10:\n        s = sum(int(d) for d in str(s))\n"
    solution += "    return s\n"
    what = "repeats the digit sum until one digit is left (the digital root)" if root else "sums the digits"
    return Drawn(
        f"takes an integer n and {what} of abs(n)",
        "Sum the digits of str(abs(n))" + (", again while the sum has two digits or more." if root else "."),
        solution,
        lambda r: (r.randint(-(10**6), 10**6),),
    )


def _caesar(rng):
    k = rng.randint(1, 25)
    return Drawn(
        f"shifts every lowercase letter of the string s {k} places forward in the alphabet, wrapping from "
        "'z' to 'a', and leaves every other character as it is",
        f"Map each character in 'a'..'z' to chr((ord(c) - 97 + {k}) % 26 + 97); keep the others.",
        "def caesar(s):\n"
        f"    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n",
        lambda r: (_text(r, string.ascii_lowercase + "XY .!"),),
    )


def _merge_sorted(rng):
    desc = rng.random() < 0.5
    order = "descending" if desc else "ascending"
    return Drawn(
        f"merges the lists a and b, each sorted in {order} order, into one list sorted in {order} order",
        f"Concatenate a and b and sort the result in {order} order.",
        f"def merge_sorted(a, b):\n    return sorted(a + b{', reverse=True' if desc else ''})\n",
        lambda r: (sorted(_ints(r, 0, 20, 6), reverse=desc), sorted(_ints(r, 0, 20, 6), reverse=desc)),
    )


def _max_window_sum(rng):
    w = rng.randint(2, 5)
    return Drawn(
        f"returns the largest sum of {w} consecutive elements of the list xs, or None when xs has fewer than "
        f"{w} elements",
        f"Return None for fewer than {w} elements; else the max of sum(xs[i:i + {w}]) over every start i.",
        "def max_window_sum(xs):\n"
        f"    if len(xs) < {w}:\n"
        "        return None\n"
        f"    return max(sum(xs[i : i + {w}]) for i in range(len(xs) - {w} + 1))\n",
        lambda r: (_ints(r, -9, 9, 10),),
    )


def _fizzbuzz(rng):
    a, b = sorted(rng.sample(range(2, 8), 2))
    return Drawn(
        f"returns a list of strings for i = 1..n: 'Fizz' when i is divisible by {a}, 'Buzz' when by {b}, "
        f"'FizzBuzz' when by both, else str(i)",
        f"For each i join 'Fizz' if i % {a} == 0 and 'Buzz' if i % {b} == 0; an empty word becomes str(i).",
        "def fizzbuzz(n):\n"
        "    out = []\n"
        "    for i in range(1, n + 1):\n"
        f"        word = ('Fizz' if i % {a} == 0 else '') + ('Buzz' if i % {b} == 0 else '')\n"
        "        out.append(word or str(i))\n"
        "    return out\n",
        lambda r: (r.randint(0, 30),),
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("filter_divisible", "filter_divisible(xs)", _filter_divisible),
        Family("count_char", "count_char(s)", _count_char),
        Family("rotate_list", "rotate_list(xs, k)", _rotate_list),
        Family("running", "running(xs)", _running),
        Family("dedupe", "dedupe(xs)", _dedupe),
        Family("kth_largest", "kth_largest(xs)", _kth_largest),
        Family("run_length", "run_length(s)", _run_length),
        Family("digit_sum", "digit_sum(n)", _digit_sum),
        Family("caesar", "caesar(s)", _caesar),
        Family("merge_sorted", "merge_sorted(a, b)", _merge_sorted),
        Family("max_window_sum", "max_window_sum(xs)", _max_window_sum),
        Family("fizzbuzz", "fizzbuzz(n)", _fizzbuzz),
    )
}
"""Bundled families, by the names CodeOptions.families takes (ptrain.config.env.CODE_FAMILIES)."""


def _call(signature: str, args: tuple) -> str:
    return f"{signature.split('(')[0]}({', '.join(repr(a) for a in args)})"


def reference(family: Family, solution: str) -> Callable[..., Any]:
    """The function a family's solution source defines (our own code, run in this process)."""
    namespace: dict[str, Any] = {}
    exec(compile(solution, f"<{family.name} reference>", "exec"), namespace)  # noqa: S102 - the module's own source
    return namespace[family.function]


def draw_task(rng: random.Random, family: Family, n_tests: int) -> dict[str, Any]:
    """One generated task: statement, hidden asserts (the expected values are what the
    reference solution returns), the solution source and its approach in a line."""
    drawn = family.draw(rng)
    ref = reference(family, drawn.solution)
    example = drawn.inputs(rng)
    tests, seen = [], {repr(example)}
    for _ in range(50 * n_tests):
        if len(tests) == n_tests:
            break
        args = drawn.inputs(rng)
        if repr(args) in seen:
            continue
        seen.add(repr(args))
        tests.append(f"assert {_call(family.signature, args)} == {ref(*args)!r}")
    statement = (
        f"Write a Python function `{family.signature}` that {drawn.description}.\n"
        f"For example, {_call(family.signature, example)} returns {ref(*example)!r}."
    )
    return {"statement": statement, "tests": tests, "solution": drawn.solution, "approach": drawn.approach}


def generate_task(rng: random.Random, family: Family, n_tests: int) -> tuple[str, list[str]]:
    """(problem statement, hidden asserts) of one generated task (`draw_task` without the solution)."""
    task = draw_task(rng, family, n_tests)
    return task["statement"], task["tests"]


class CodeEnv(SingleTurnEnv):
    """Function-writing tasks with hidden tests (options: CodeOptions)."""

    kind = "code"
    component_names = ("format", "tests")
    extra_metrics = ("tests_passed", "tests_total", "pass_all", "test_timeouts", "load_error", "sandbox_killed")

    def __init__(self, cfg: Any, options: Any, *, tokenizer: Any, sandbox: Any = None, runner: Any = None):
        super().__init__(cfg, options, tokenizer=tokenizer, sandbox=sandbox, runner=runner)
        from ptrain.config.sandbox import SandboxConfig
        from ptrain.sandbox import Sandbox

        if sandbox is None or isinstance(sandbox, SandboxConfig):
            # Probes the backend now: SandboxUnavailableError says what to install.
            sandbox = Sandbox(sandbox or SandboxConfig())
        self.sandbox = sandbox
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        if o.path is not None:
            train_rows, held_rows = self.row_splits(o.path, o.eval_path, ("prompt", "tests"), check_row)
            specs = [[self._row_spec(r) for r in rows] for rows in (train_rows, held_rows)]
            train_specs, held_specs = specs
        else:
            rng = random.Random(seed)
            need = self.cfg.n_train + self.cfg.n_eval
            seen: set[str] = set()
            drawn = []
            misses = 0
            while len(drawn) < need:
                family = FAMILIES[o.families[rng.randrange(len(o.families))]]
                spec = draw_task(rng, family, o.tests_per_task)
                statement, tests = spec["statement"], spec["tests"]
                if statement in seen or not tests:
                    misses += 1
                    if misses > 100 * need + 10000:
                        raise ValueError(
                            f"envs.{self.name}: found only {len(drawn)} of {need} distinct generated code tasks in "
                            f"families {o.families}; lower n_train / n_eval or add families"
                        )
                    continue
                seen.add(statement)
                drawn.append({**spec, "setup": [], "family": family.name})
            held_specs, train_specs = drawn[: self.cfg.n_eval], drawn[self.cfg.n_eval :]

        def make(split: str, specs) -> list[Task]:
            return [
                self.task(split, i, self.user(f"{s['statement']}\n\n{INSTRUCTION}"), s) for i, s in enumerate(specs)
            ]

        return make("train", train_specs), make("eval", held_specs)

    @staticmethod
    def _row_spec(row: dict[str, Any]) -> dict[str, Any]:
        tests = row["tests"]
        setup: list[str] = []
        if isinstance(tests, str):
            setup, tests = split_tests(tests)
        spec = {"statement": row["prompt"].rstrip(), "tests": tests, "setup": setup}
        if "id" in row:
            spec["row_id"] = row["id"]
        for key in ("solution", "approach"):
            if key in row:
                spec[key] = row[key]
        return spec

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the approach `</think>` the reference solution in a ```python block.
        ValueError for a JSONL row without a "solution"."""
        solution = task.data.get("solution")
        if not solution:
            raise ValueError(
                f"env {self.name} task {task.id}: the task has no reference solution, so no demonstration; give "
                'its JSONL row a "solution" field (the function\'s source, passing its tests)'
            )
        answer = f"```python\n{solution.rstrip()}\n```"
        if extract_code(answer) != solution.rstrip() + "\n":
            raise ValueError(
                f"env {self.name} task {task.id}: the reference solution holds ``` and cannot be put in one code "
                "block; rewrite it without"
            )
        approach = task.data.get("approach") or "Write the function as the statement describes it."
        return [{"role": "assistant", "content": f"<think>{approach}</think>{answer}"}]

    def extract(self, task: Task, text: str) -> str | None:
        return extract_code(text, self.options.require_code_block)

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._limits:
            self._limits[loop] = asyncio.Semaphore(self.options.max_concurrent_runs)
        return self._limits[loop]

    async def score(self, task: Task, text: str) -> Score:
        """Run the code and the hidden tests in the sandbox; score the fraction passed."""
        from ptrain.sandbox import SandboxUnavailableError

        code = self.extract(task, text)
        if code is None:
            return self.unscored()
        tests = list(task.data["tests"])
        nonce = secrets.token_hex(16)
        files = {
            "harness.py": HARNESS,
            "solution.py": code,
            "tests.json": json.dumps({"tests": tests, "setup": list(task.data.get("setup", []))}),
        }
        cmd = ["python", "-I", "harness.py", nonce, repr(float(self.options.test_timeout_s))]
        try:
            async with self._limit():
                result = await self.sandbox.run_async(cmd, files=files)
        except SandboxUnavailableError:
            raise
        except Exception as e:  # the sandbox failed to run at all: counted, this sample only
            return self.failed(task, f"sandbox run failed: {type(e).__name__}: {e}")
        found = parse_results(result.stdout_text, nonce, len(tests))
        if found["load"] is None and result.killed_by is None:
            # The harness itself never reported: not the solution's doing.
            return self.failed(
                task, f"test harness gave no result (exit code {result.exit_code}): {result.stderr_text[-300:]}"
            )
        statuses = found["statuses"]
        passed = sum(1 for s in statuses.values() if s == "pass")
        return self.scored(
            True,
            passed / len(tests),
            tests_passed=passed,
            tests_total=len(tests),
            pass_all=float(passed == len(tests)),
            test_timeouts=sum(1 for s in statuses.values() if s == "timeout"),
            load_error=float(found["load"] not in (None, "ok")),
            sandbox_killed=float(result.killed_by is not None),
        )
