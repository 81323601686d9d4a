"""Every local environment's `demonstration(task)`: the turns it writes earn the environment's
full reward through its own rollout (a replay engine emits them as the policy's completions),
also with the reasoning removed or cut as the SFT transforms do; reasoning and answer are
cleanly separated; the same task gives the same demonstration; and a task that cannot be
demonstrated is an error, not a wrong demonstration."""

from __future__ import annotations

import asyncio
import json

import pytest

from ptrain.config.env import EnvConfig
from ptrain.data import tasks as arithmetic_tasks
from ptrain.data.reasoning import reasoning_off, split_reasoning
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.base import Task
from ptrain.envs.instruction_following import constraint_results, final_response
from ptrain.envs.registry import make_env
from ptrain.envs.safety import RewardRunner
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine
from ptrain.sandbox import SandboxUnavailableError

N_TASKS = 20
MAX_NEW_TOKENS = 4096
"""Room for the longest demonstration (an instruction_following one of 300+ words)."""

SINGLE_TURN = {
    "arithmetic": ("arithmetic", {"ops": ["+", "-", "*"], "format_reward": 0.25}),
    "math": ("math", {}),
    "math_answer_tag": ("math", {"answer_format": "answer_tag"}),
    "math_think_answer": ("math", {"answer_format": "think_answer", "format_reward": 1.0}),
    "mcqa": ("mcqa", {"format_reward": 0.2, "correct_reward": 0.8}),
    "structured_output": ("structured_output", {"format_reward": 0.1}),
    "long_context": ("long_context", {"context_tokens": 1024, "format_reward": 0.1}),
    "instruction_following": ("instruction_following", {}),
    "instruction_following_many": ("instruction_following", {"min_constraints": 4, "max_constraints": 6}),
    "countdown": ("countdown", {}),
    "countdown_use_all": ("countdown", {"use_all_numbers": True}),
    "code": ("code", {}),
    "reverse_text": ("reverse_text", {"format_reward": 0.1}),
    "reverse_text_long": ("reverse_text", {"min_chars": 150, "max_chars": 300}),
}
"""Environment variants whose demonstrations are rolled out: name -> (kind, options)."""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(workers=1, timeout_s=30.0) as pool:
        yield pool


def build(tok, kind, options, runner=None, n_train=N_TASKS, n_eval=4):
    try:
        env = make_env(EnvConfig(kind=kind, n_train=n_train, n_eval=n_eval, options=options), tokenizer=tok)
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox backend isolates here: {e}")
    if runner is not None:
        env._runner, env._owns_runner = runner, False
    return env


def check_separated(turns):
    """Every assistant turn is `<think>reasoning</think>answer`: one closed block, first."""
    assert turns and all(m["role"] in ("assistant", "tool") for m in turns)
    assert turns[-1]["role"] == "assistant"
    for m in turns:
        if m["role"] != "assistant":
            continue
        content = m["content"]
        assert content.startswith("<think>") and content.count("<think>") == 1, content
        assert content.count("</think>") == 1, content
        _, reasoning, answer = split_reasoning(content)
        assert reasoning.strip() and answer.strip(), content


def variants(task, turns):
    """The demonstration, and its last turn with the reasoning removed (the SFT `off`
    transform) and cut to half its characters (as a thinking budget cuts it)."""
    conv = [dict(m) for m in task.messages] + [dict(m) for m in turns]
    off = reasoning_off(conv)[len(task.messages) :]
    head, reasoning, answer = split_reasoning(turns[-1]["content"])
    cut = [
        *turns[:-1],
        {"role": "assistant", "content": f"{head}<think>{reasoning[: len(reasoning) // 2]}</think>{answer}"},
    ]
    return [list(turns), off, cut]


def policy_texts(turns):
    return [m["content"] for m in turns if m["role"] == "assistant"]


def full_reward(env) -> float:
    o = env.options
    return float(getattr(o, "format_reward", 0.0)) + float(o.correct_reward)


@pytest.mark.parametrize("variant", sorted(SINGLE_TURN))
def test_single_turn_demonstrations_earn_full_reward(tok, runner, variant):
    kind, options = SINGLE_TURN[variant]
    env = build(tok, kind, options, runner)
    try:
        tasks = list(env.tasks("train", seed=0))[:N_TASKS]
        assert len(tasks) == N_TASKS
        demos = [env.demonstration(t) for t in tasks]
        script = {}
        for t, demo in zip(tasks, demos):
            assert len(demo) == 1 and demo[0]["role"] == "assistant"
            check_separated(demo)
            script[f"{env.name}/{t.id}"] = [v[-1]["content"] for v in variants(t, demo)]
        engine = ReplayEngine(script, tokenizer=tok)
        sampling = SamplingParams(n=3, max_new_tokens=MAX_NEW_TOKENS)

        async def main():
            return await asyncio.gather(*(env.rollout(t, engine, sampling) for t in tasks))

        want = full_reward(env)
        assert want > 0
        for t, demo, trajs in zip(tasks, demos, asyncio.run(main())):
            assert [tr.finish_reason for tr in trajs] == ["stop"] * 3, (t.id, trajs[0].error)
            assert [tr.reward for tr in trajs] == pytest.approx([want] * 3), (t.id, demo, trajs[0].metrics)
            assert all(tr.metrics["correct"] == 1.0 and tr.reward_error is None for tr in trajs)
            assert trajs[0].turns[0].text == demo[0]["content"]  # the env scored exactly the demonstration
        assert all(engine.remaining(key) == 0 for key in script)  # every sample was served
    finally:
        env.close()


@pytest.mark.parametrize("variant", sorted(SINGLE_TURN))
def test_demonstrations_are_deterministic(tok, variant):
    kind, options = SINGLE_TURN[variant]
    a, b = build(tok, kind, options), build(tok, kind, options)
    try:
        ta, tb = a.tasks("train", seed=3), b.tasks("train", seed=3)
        first = [a.demonstration(t) for t in ta]
        assert first == [a.demonstration(t) for t in ta]
        assert first == [b.demonstration(t) for t in tb]
        assert first != [a.demonstration(t) for t in a.tasks("train", seed=4)]
        held = a.tasks("eval", seed=3)
        assert [a.demonstration(t) for t in held] == [b.demonstration(t) for t in b.tasks("eval", seed=3)]
    finally:
        a.close()
        b.close()


def _reasoning(demo) -> str:
    return split_reasoning(demo[-1]["content"])[1]


def _answer(demo) -> str:
    return split_reasoning(demo[-1]["content"])[2]


def test_reasoning_works_the_task_out(tok):
    """The reasoning holds the task's steps: the columns, the solution's operations, the option."""
    env = build(tok, "arithmetic", {"ops": ["+", "-", "*"]})
    for t in env.tasks("train", seed=0):
        p = arithmetic_tasks.Problem(t.data["op"], t.data["a"], t.data["b"])
        columns, answer = arithmetic_tasks.worked_solution(p).rsplit("\n", 1)
        assert (_reasoning(env.demonstration(t)), _answer(env.demonstration(t))) == (columns, answer)

    env = build(tok, "countdown", {})
    for t in env.tasks("train", seed=0):
        demo = env.demonstration(t)
        lines = _reasoning(demo).split("\n")
        assert lines[-1].endswith(f"= {t.data['target']}") and len(lines) >= 2
        assert _answer(demo) == f"<answer>{t.data['solution']}</answer>"

    env = build(tok, "mcqa", {})
    for t in env.tasks("train", seed=0):
        demo = env.demonstration(t)
        right = t.data["options"]["ABCDEFGHIJ".index(t.data["answer"])]
        assert _reasoning(demo).endswith(f"That is option {t.data['answer']}) {right}.")
        assert _answer(demo) == f"\\boxed{{{t.data['answer']}}}"

    env = build(tok, "math", {})
    for t in env.tasks("train", seed=0):
        demo = env.demonstration(t)
        assert "=" in _reasoning(demo) and _answer(demo) == f"\\boxed{{{t.data['answer']}}}"
        assert "solution" not in t.messages[0]["content"] and _reasoning(demo) not in t.messages[0]["content"]

    env = build(tok, "code", {})
    for t in env.tasks("train", seed=0):
        demo = env.demonstration(t)
        assert _answer(demo) == f"```python\n{t.data['solution'].rstrip()}\n```"
        assert t.data["solution"] not in t.messages[0]["content"]

    env = build(tok, "reverse_text", {})
    for t in env.tasks("train", seed=0):
        demo = env.demonstration(t)
        assert str(len(t.data["text"])) in _reasoning(demo)
        assert _answer(demo) == f"<reversed_text>{t.data['text'][::-1]}</reversed_text>"


def test_instruction_following_demonstrations_meet_every_constraint_set(tok):
    """Checked without a rollout over many prompts, up to the largest conflict-free sets."""
    for k in (1, 3, 8):
        env = build(tok, "instruction_following", {"min_constraints": k, "max_constraints": k}, n_train=300)
        for t in env.tasks("train", seed=1):
            response = final_response(env.demonstration(t)[0]["content"])
            assert all(constraint_results(response, list(t.data["constraints"]))), (t.data["prompt"], response)


def test_a_tool_use_demonstration_is_the_episode_the_env_runs(tok, runner):
    env = build(tok, "tool_use", {}, runner)
    tasks = list(env.tasks("train", seed=0))
    assert {t.data["family"] for t in tasks} == {"calculator", "file", "search", "python"}
    demos = [env.demonstration(t) for t in tasks]
    script = {}
    for t, demo in zip(tasks, demos):
        check_separated(demo)
        assert [m["role"] for m in demo] == ["assistant", "tool", "assistant"]
        assert demo[1]["name"] == t.data["tool"] and "<tool_call>" in demo[0]["content"]
        for j, v in enumerate(variants(t, demo)[:2]):
            for turn, text in enumerate(policy_texts(v)):
                script[f"{env.name}/{t.id}/s{j}/t{turn}"] = [text]
    engine = ReplayEngine(script, tokenizer=tok)

    async def main():
        sampling = SamplingParams(n=2, max_new_tokens=1024)
        return await asyncio.gather(*(env.rollout(t, engine, sampling) for t in tasks))

    for t, demo, trajs in zip(tasks, demos, asyncio.run(main())):
        for tr in trajs:
            assert tr.finish_reason == "stop" and tr.reward == env.options.correct_reward, (t.id, tr.turns)
            assert tr.metrics["used_tool"] == 1.0 and tr.metrics["invalid_tool_calls"] == 0.0
        # The env's own episode: the demonstration's turns exactly, tool result included.
        ran = trajs[0].turns
        assert [(x.role, x.text) for x in ran] == [("policy", demo[0]["content"]), ("tool", demo[1]["content"]),
                                                    ("policy", demo[2]["content"])]  # fmt: skip
        assert ran[1].tool == demo[1]["name"] and ran[1].error is None
    assert demos == [env.demonstration(t) for t in tasks]  # deterministic, tools re-run


def test_a_demonstration_from_inside_an_event_loop(tok):
    """The tool_use demonstration runs its tool call on a loop of its own when called from one."""
    env = build(tok, "tool_use", {"families": ["calculator"], "tools": ["calculator"]}, n_train=2, n_eval=0)
    task = env.tasks("train", seed=0)[0]

    async def inside():
        return env.demonstration(task)

    assert asyncio.run(inside()) == env.demonstration(task)


def test_what_cannot_be_demonstrated_is_an_error(tok, tmp_path):
    # A code row without a reference solution; one with a solution is demonstrated and passes.
    path = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": "Write f(x) that returns x squared.", "tests": ["assert f(3) == 9"]},
        {"prompt": "Write g(x) that returns x + 1.", "tests": ["assert g(1) == 2", "assert g(-1) == 0"],
         "solution": "def g(x):\n    return x + 1\n", "approach": "Add one."},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = build(tok, "code", {"path": str(path)}, n_eval=0)
    no_solution, with_solution = env.tasks("train", seed=0)
    with pytest.raises(ValueError, match='"solution" field'):
        env.demonstration(no_solution)
    demo = env.demonstration(with_solution)
    assert demo == [
        {"role": "assistant", "content": "<think>Add one.</think>```python\ndef g(x):\n    return x + 1\n```"}
    ]
    (traj,) = asyncio.run(
        env.rollout(
            with_solution, ReplayEngine([demo[0]["content"]], tokenizer=tok), SamplingParams(max_new_tokens=512)
        )
    )
    assert traj.reward == 1.0 and traj.metrics["pass_all"] == 1.0

    # A countdown task whose stored solution misses its target.
    env = build(tok, "countdown", {})
    task = env.tasks("train", seed=0)[0]
    bad = Task(task.env, task.id, task.messages, {**task.data, "target": task.data["target"] + 1})
    with pytest.raises(ValueError, match="does not reach"):
        env.demonstration(bad)

    # A structured_output task with a required property that has no value.
    env = build(tok, "structured_output", {})
    task = next(t for t in env.tasks("train", seed=0) if t.data["schema"]["required"])
    required = task.data["schema"]["required"][0]
    expected = {k: v for k, v in task.data["expected"].items() if k != required}
    with pytest.raises(ValueError, match=f"required properties \\['{required}'\\] have no given value"):
        env.demonstration(Task(task.env, task.id, task.messages, {**task.data, "expected": expected}))

    # An instruction_following task whose word count does not fit its character limit.
    env = build(tok, "instruction_following", {})
    data = {
        "request": "Write about kites.",
        "constraints": [{"family": "word_count", "args": {"relation": "at_least", "n": 300}}],
        "max_answer_chars": 500,
    }
    with pytest.raises(ValueError, match="over 500"):
        env.demonstration(env.task("train", 0, env.user("Write about kites."), data))

    # A tool_use file whose read is cut before the rows that add up to the answer.
    env = build(tok, "tool_use", {"families": ["file"], "tools": ["read_file"], "max_tool_output_chars": 100},
                n_train=2, n_eval=0)  # fmt: skip
    with pytest.raises(ValueError, match="max_tool_output_chars=100"):
        env.demonstration(env.tasks("train", seed=0)[0])
