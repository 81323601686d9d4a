"""terminal: every generated repository fails its tests and passes them once fixed; scripted
bash episodes are rewarded by the repository's own tests (which editing cannot fake); a
crash mid-episode resumes with the workspace as the recorded calls left it."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.config.env_multi_turn import TerminalOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.episode import EpisodeStore
from ptrain.envs.registry import make_env
from ptrain.envs.safety import RewardRunner
from ptrain.envs.terminal import FAMILIES, make_repository, parse_unittest, run_tests
from ptrain.envs.tools import Workspace, tool_sandbox
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine
from ptrain.sandbox import SandboxUnavailableError


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(workers=1, timeout_s=10.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def sandbox():
    try:
        return tool_sandbox(None, timeout_s=30.0, workspace_bytes=4 << 20, max_output_chars=2000)
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox backend isolates here: {e}")


def build(tok, runner, sandbox, **options):
    env = make_env(EnvConfig(kind="terminal", n_train=10, n_eval=5, options=options), tokenizer=tok, sandbox=sandbox)
    env._runner, env._owns_runner = runner, False
    return env


def bash(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}})}</tool_call>"


def heredoc(path: str, content: str) -> str:
    return f"cat > {path} <<'PTRAIN_EOF'\n{content}PTRAIN_EOF"


def play(env, task, script):
    engine = ReplayEngine(script, tokenizer=env.tokenizer)
    (traj,) = asyncio.run(env.rollout(task, engine, SamplingParams(max_new_tokens=1024)))
    return traj


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_fails_its_tests_and_passes_them_when_fixed(family, sandbox, tmp_path):
    opts = TerminalOptions()
    for seed in range(2):
        repo = make_repository(family, random.Random(seed))
        ws = Workspace(str(tmp_path / f"ws{seed}"))
        ws.populate(repo["files"])
        passed, ran, failed, out = asyncio.run(run_tests(sandbox, ws, repo["tests"], opts))
        assert not passed and ran >= 2 and failed >= 1, out
        ws.populate(repo["fixed"])
        passed, ran, failed, out = asyncio.run(run_tests(sandbox, ws, repo["tests"], opts))
        assert passed and failed == 0, out


def test_parse_unittest():
    assert parse_unittest("...\n----\nRan 3 tests in 0.001s\n\nOK\n") == (3, 0)
    assert parse_unittest("Ran 4 tests in 0.1s\n\nFAILED (failures=1, errors=2)\n") == (4, 3)
    assert parse_unittest("Ran 1 test in 0.1s\n\nFAILED (errors=1)") == (1, 1)
    assert parse_unittest("SyntaxError: bad") == (0, 0)


def test_tasks_are_deterministic_and_cycle_through_the_families(tok, runner, sandbox):
    env = build(tok, runner, sandbox)
    train = env.tasks("train", seed=0)
    assert [t.data["family"] for t in train[:5]] == list(TerminalOptions().families)
    assert [t.data for t in build(tok, runner, sandbox).tasks("train", seed=0)] == [t.data for t in train]
    t = train[0]
    assert t.data["module"] + ".py" in t.messages[1]["content"] and set(t.data["tests"]) < set(t.data["files"])


def test_fixing_the_bug_with_bash_passes_the_tests(tok, runner, sandbox):
    env = build(tok, runner, sandbox)
    t = env.tasks("train", seed=0)[2]
    ((module, fixed),) = t.data["fixed"].items()
    script = [
        bash("ls; python -m unittest -q 2>&1 | tail -3"),
        bash(heredoc(module, fixed)),
        bash("python -m unittest -q"),
        "Fixed the comparison in the upper bound.",
    ]
    traj = play(env, t, script)
    assert traj.finish_reason == "stop"
    assert traj.reward_components == {"tests_passed": 1.0, "format": 0.1} and traj.reward == pytest.approx(1.1)
    first, _, last = (u for u in traj.turns if u.role == "tool")
    assert "FAILED" in first.text and first.exit_code == 0 and module in first.text
    assert last.exit_code == 0 and "[exit code" not in last.text
    assert traj.metrics["tests_passed"] == 1.0 and traj.metrics["tests_failed"] == 0.0


def test_editing_the_tests_does_not_pass_them(tok, runner, sandbox):
    env = build(tok, runner, sandbox)
    t = env.tasks("train", seed=0)[0]
    (test_file,) = t.data["tests"]
    fake = "import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    traj = play(env, t, [bash(heredoc(test_file, fake) + "\npython -m unittest -q"), "All tests pass now."])
    assert "OK" in traj.turns[1].text  # the policy saw its fake test pass
    assert traj.reward_components == {"tests_passed": 0.0, "format": 0.1}
    assert traj.metrics["tests_failed"] >= 1


def test_an_episode_that_never_ends_itself_gets_no_format_reward(tok, runner, sandbox):
    env = build(tok, runner, sandbox, max_turns=2)
    t = env.tasks("train", seed=0)[1]
    traj = play(env, t, [bash("cat *.py"), bash("true")])
    assert traj.finish_reason == "turn_limit" and traj.reward == 0.0


def test_resume_keeps_the_workspace_the_recorded_calls_made(tok, runner, sandbox, tmp_path):
    folder = str(tmp_path / "episodes")
    env = build(tok, runner, sandbox, episode_dir=folder)
    t = env.tasks("train", seed=0)[3]
    ((module, fixed),) = t.data["fixed"].items()
    script = [bash(heredoc(module, fixed)), bash("python -m unittest -q"), "Done."]

    class Crash(ReplayEngine):
        def submit(self, request, on_update=None):
            if len(self.requests) == 1:
                raise RuntimeError("simulated crash")
            return super().submit(request, on_update)

    with pytest.raises(RuntimeError, match="simulated crash"):
        play_engine = Crash(script, tokenizer=tok)
        asyncio.run(env.rollout(t, play_engine, SamplingParams(max_new_tokens=1024)))
    saved = EpisodeStore(folder).load(env.name, t.id, 0)
    assert saved.tool_calls == 1 and not saved.done
    env = build(tok, runner, sandbox, episode_dir=folder)
    engine = ReplayEngine(script[1:], tokenizer=tok)  # the fix is not sent again
    (traj,) = asyncio.run(env.rollout(t, engine, SamplingParams(max_new_tokens=1024)))
    assert env.stats["resumed"] == 1 and traj.reward == pytest.approx(1.1)
    assert "OK" in traj.turns[3].text


def test_bad_options_name_the_key():
    for options, match in [
        ({"tools": ["python"]}, "needs bash"),
        ({"families": ["typo"]}, "options.families"),
        ({"test_timeout_s": 0}, "options.test_timeout_s"),
        ({"format_reward": -0.1}, "options.format_reward"),
    ]:
        with pytest.raises(EnvConfigError, match=match):
            validate_env_config(EnvConfig(kind="terminal", options=options))
