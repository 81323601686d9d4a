"""terminal: fix a generated repository's bug with a bash tool; the repository's tests decide.

    env = make_env(EnvConfig(kind="terminal"), tokenizer=tok, sandbox=Sandbox(cfg))

Each task is a tiny Python project made when the task is made (nothing is downloaded):
`<module>.py` with one function that has a bug of the task's family, `test_<module>.py`
(unittest, stdlib only) whose tests the bug fails, and a README. The workspace is that
repository; the policy's `bash` tool runs commands on it in the sandbox (files persist
between calls, see ptrain.envs.tools). Families (options.families, drawn in turn):

  off_by_one      a sum over a range that stops one short
  wrong_operator  a formula with + where it needs -
  boundary        a clamp that returns the wrong bound above the range
  missing_case    a count that ignores upper-case letters
  wrong_default   a parser that ignores its default value

Names and constants vary between tasks. After the episode the original test files are put
back (so editing them does not help) and `python -m unittest -q` runs in the sandbox with
options.test_timeout_s: reward component `tests_passed` is options.tests_reward when every
test passes. Component `format` is options.format_reward when the policy ended the episode
itself (a final reply without a tool call) and made no invalid call. Metrics: tests_passed,
tests_failed (failures + errors as unittest counts them), tests_ran.
"""

from __future__ import annotations

import random
import re
import textwrap
from typing import Any

from ptrain.envs.multi_turn import MultiTurnEnv, Score
from ptrain.envs.tools import run_in_workspace

SYSTEM_PROMPT = (
    "You are a software engineer working in a terminal. Use the bash tool to inspect files, run the tests and "
    "edit code (for example with sed, or a heredoc: cat > file <<'EOF' ... EOF). When the tests pass, reply "
    "with a one-line summary of the fix and no tool call."
)
TEST_COMMAND = ["python", "-m", "unittest", "-q"]
_MODULES = ("mathkit", "textkit", "listkit", "netkit", "numutil", "strtools", "calc", "helpers")
_FAILED_RE = re.compile(r"FAILED \((?:failures=(\d+))?(?:, )?(?:errors=(\d+))?\)")


def _family_off_by_one(rng: random.Random) -> dict[str, str]:
    fn = rng.choice(("total_up_to", "sum_through", "cumulative_total"))
    step = rng.randint(1, 3)
    k = rng.randint(5, 30)
    good = f"return sum(range(0, n + 1, {step}))"
    bad = f"return sum(range(0, n, {step}))"
    body = f'''
        def {fn}(n):
            """Sum of 0, {step}, {2 * step}, ... up to and including n when n is reached."""
            {{body}}
        '''
    tests = f"""
        def test_small(self):
            self.assertEqual(M.{fn}(0), 0)
            self.assertEqual(M.{fn}({step}), {step})

        def test_larger(self):
            self.assertEqual(M.{fn}({k * step}), {sum(range(0, k * step + 1, step))})
        """
    return {"fn": fn, "body": body, "good": good, "bad": bad, "tests": tests}


def _family_wrong_operator(rng: random.Random) -> dict[str, str]:
    fn = rng.choice(("scaled_difference", "weighted_gap", "price_delta"))
    f = rng.randint(2, 9)
    a, b = rng.randint(20, 99), rng.randint(1, 19)
    good = f"return (a - b) * {f}"
    bad = f"return (a + b) * {f}"
    body = f'''
        def {fn}(a, b):
            """(a - b) times {f}."""
            {{body}}
        '''
    tests = f"""
        def test_difference(self):
            self.assertEqual(M.{fn}({a}, {b}), {(a - b) * f})

        def test_equal(self):
            self.assertEqual(M.{fn}({b}, {b}), 0)
        """
    return {"fn": fn, "body": body, "good": good, "bad": bad, "tests": tests}


def _family_boundary(rng: random.Random) -> dict[str, str]:
    fn = rng.choice(("clamp", "bounded", "limit_to"))
    lo, hi = rng.randint(0, 10), rng.randint(20, 60)
    good = "if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x"
    bad = "if x < lo:\n        return lo\n    if x > hi:\n        return lo\n    return x"
    body = f'''
        def {fn}(x, lo, hi):
            """x, moved into [lo, hi]."""
            {{body}}
        '''
    tests = f"""
        def test_inside(self):
            self.assertEqual(M.{fn}({lo + 1}, {lo}, {hi}), {lo + 1})

        def test_below(self):
            self.assertEqual(M.{fn}({lo - 5}, {lo}, {hi}), {lo})

        def test_above(self):
            self.assertEqual(M.{fn}({hi + 7}, {lo}, {hi}), {hi})
        """
    return {"fn": fn, "body": body, "good": good, "bad": bad, "tests": tests}


def _family_missing_case(rng: random.Random) -> dict[str, str]:
    fn = rng.choice(("count_vowels", "vowel_count", "num_vowels"))
    word = rng.choice(("Umbrella", "ORANGE", "Apple pie", "EchO", "Ice cream"))
    good = 'return sum(1 for c in text.lower() if c in "aeiou")'
    bad = 'return sum(1 for c in text if c in "aeiou")'
    body = f'''
        def {fn}(text):
            """How many vowels (a, e, i, o, u, either case) the text has."""
            {{body}}
        '''
    tests = f"""
        def test_lower(self):
            self.assertEqual(M.{fn}("banana"), 3)

        def test_mixed_case(self):
            self.assertEqual(M.{fn}({word!r}), {sum(1 for c in word.lower() if c in "aeiou")})
        """
    return {"fn": fn, "body": body, "good": good, "bad": bad, "tests": tests}


def _family_wrong_default(rng: random.Random) -> dict[str, str]:
    fn = rng.choice(("parse_port", "port_of", "read_port"))
    default, port = rng.choice((80, 443, 8080, 5432)), rng.randint(1024, 65535)
    good = 'host, _, port = text.partition(":")\n    return int(port) if port else default'
    bad = 'host, _, port = text.partition(":")\n    return int(port) if port else 0'
    body = f'''
        def {fn}(text, default={default}):
            """The port of 'host:port', or `default` when the text has none."""
            {{body}}
        '''
    tests = f"""
        def test_explicit(self):
            self.assertEqual(M.{fn}("example.org:{port}"), {port})

        def test_default(self):
            self.assertEqual(M.{fn}("example.org"), {default})
            self.assertEqual(M.{fn}("example.org", default=21), 21)
        """
    return {"fn": fn, "body": body, "good": good, "bad": bad, "tests": tests}


FAMILIES = {
    "off_by_one": _family_off_by_one,
    "wrong_operator": _family_wrong_operator,
    "boundary": _family_boundary,
    "missing_case": _family_missing_case,
    "wrong_default": _family_wrong_default,
}


def make_repository(family: str, rng: random.Random) -> dict[str, Any]:
    """One task's repository: {"module", "files" (buggy), "fixed" (the module without the bug),
    "tests" (the test files, put back before scoring)}."""
    spec = FAMILIES[family](rng)
    module = rng.choice(_MODULES)
    source = textwrap.dedent(spec["body"]).strip() + "\n"

    def render(body: str) -> str:
        return source.replace("{body}", body)

    test_name = f"test_{module}.py"
    test_source = (
        f"import unittest\n\nimport {module} as M\n\n\nclass Test{spec['fn'].title().replace('_', '')}(unittest.TestCase):\n"
        + textwrap.indent(textwrap.dedent(spec["tests"]).strip(), "    ")
        + '\n\n\nif __name__ == "__main__":\n    unittest.main()\n'
    )
    readme = (
        f"# {module}\n\nSmall helpers. `{spec['fn']}` lives in {module}.py.\n\n"
        "Run the tests with `python -m unittest -q`.\n"
    )
    return {
        "module": module,
        "function": spec["fn"],
        "files": {f"{module}.py": render(spec["bad"]), test_name: test_source, "README.md": readme},
        "fixed": {f"{module}.py": render(spec["good"])},
        "tests": {test_name: test_source},
    }


def parse_unittest(output: str) -> tuple[int, int]:
    """(tests run, tests failed or errored) from unittest's summary; (0, 0) when it has none."""
    ran = re.search(r"Ran (\d+) tests?", output)
    failed = _FAILED_RE.search(output)
    bad = sum(int(x) for x in failed.groups() if x) if failed else 0
    return (int(ran.group(1)) if ran else 0), bad


class TerminalEnv(MultiTurnEnv):
    """The terminal kind (module docstring)."""

    kind = "terminal"
    needs_sandbox = True
    component_names = ("tests_passed", "format")
    metric_names = ("tests_passed", "tests_failed", "tests_ran")

    def sandbox_timeout_s(self) -> float:
        return max(self.options.tool_timeout_s, self.options.test_timeout_s)

    def make_tasks(self, seed: int):
        out = []
        for split, n in (("train", self.cfg.n_train), ("eval", self.cfg.n_eval)):
            rng = random.Random(f"terminal/{split}/{seed}")
            tasks = []
            for i in range(n):
                family = self.options.families[i % len(self.options.families)]
                repo = make_repository(family, rng)
                question = (
                    f"The repository in the working folder has failing tests. Find and fix the bug in "
                    f"{repo['module']}.py so that `python -m unittest -q` passes. Do not change the tests."
                )
                messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
                data = {"family": family, **repo}
                tasks.append(self.task(split, i, messages, data))
            out.append(tasks)
        return out[0], out[1]

    async def score(self, task, state, workspace) -> Score:
        passed, ran, failed, _ = await run_tests(self.sandbox, workspace, task.data["tests"], self.options)
        ended_itself = state.finish_reason == "stop" and state.invalid_tool_calls == 0
        o = self.options
        components = {"tests_passed": o.tests_reward * float(passed), "format": o.format_reward * float(ended_itself)}
        metrics = {"tests_passed": float(passed), "tests_failed": float(failed), "tests_ran": float(ran)}
        return Score(components, metrics)


async def run_tests(sandbox, workspace, tests: dict[str, str], options) -> tuple[bool, int, int, str]:
    """Restore `tests` into the workspace and run unittest there in the sandbox:
    (every test passed, tests run, tests failed or errored, the output)."""
    workspace.populate(tests)
    result = await run_in_workspace(
        sandbox, workspace, TEST_COMMAND, timeout_s=options.test_timeout_s,
        max_output_chars=max(options.max_tool_output_chars, 8000),
    )  # fmt: skip
    ran, failed = parse_unittest(result.output)
    passed = result.exit_code == 0 and result.error is None and ran > 0 and failed == 0
    return passed, ran, failed, result.output


__all__ = ["FAMILIES", "TEST_COMMAND", "TerminalEnv", "make_repository", "parse_unittest", "run_tests"]
