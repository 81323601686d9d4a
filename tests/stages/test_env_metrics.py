"""Evaluation metrics that read the policy's text: Nano's verbosity split and hallucinated tool calls."""

import pytest

from ptrain.envs.base import Task, Trajectory, Turn
from ptrain.stages.env_metrics import calls_a_tool, is_correct, reasoning_and_answer_chars, summarize


def traj(*texts: str, reward: float = 1.0) -> Trajectory:
    turns = tuple(Turn(role="policy", start=i, end=i + 1, text=t) for i, t in enumerate(texts))
    n = len(texts)
    return Trajectory(
        task=Task(env="e", id="t", messages=()),
        sample_index=0,
        token_ids=tuple(range(n + 1)),
        prompt_length=1,
        loss_mask=(0,) + (1,) * n,
        logprobs=(0.0,) + (-0.5,) * n,
        reward=reward,
        turns=turns,
    )


@pytest.mark.parametrize(
    "text,reasoning,answer",
    [
        ("<think>abcd</think>xyz", 4, 3),
        ("<think></think>xyz", 0, 3),
        ("<think>never closed", 12, 0),
        ("ab</think>cd", 2, 2),  # the prompt opened the reasoning
        ("just an answer", 0, 14),
    ],
)
def test_reasoning_and_answer_are_counted_apart(text, reasoning, answer):
    assert reasoning_and_answer_chars(traj(text)) == (reasoning, answer)


def test_the_judged_value_decides_correctness_whatever_the_reward_scale():
    import dataclasses

    base = traj("<answer>1 + 2</answer>", reward=1.0)
    # countdown pays 0.1 format + 0.9 correct: a right answer is correct though no part reaches 1
    right = dataclasses.replace(base, reward_components={"format": 0.1, "correct": 0.9}, metrics={"correct": 1.0})
    wrong = dataclasses.replace(base, reward=0.1, reward_components={"format": 0.1, "correct": 0.0},
                                metrics={"correct": 0.0})  # fmt: skip
    partial = dataclasses.replace(base, reward=0.75, reward_components={"correct": 0.75}, metrics={"correct": 0.75})
    assert [is_correct(t) for t in (right, wrong, partial)] == [True, False, False]
    # without the metric: a `correct` component of at least 1, else any positive reward
    assert is_correct(dataclasses.replace(base, reward_components={"correct": 2.0}))
    assert not is_correct(dataclasses.replace(base, reward_components={"correct": 0.9}))
    assert is_correct(base) and not is_correct(traj("x", reward=0.0))


def test_turns_add_up_and_tool_calls_are_seen_in_any_turn():
    t = traj("<think>ab</think>c", '<tool_call>{"name": "x"}</tool_call>')
    assert reasoning_and_answer_chars(t)[0] == 2
    assert calls_a_tool(t) and not calls_a_tool(traj("<think>a</think>b"))


def test_summary_reports_hallucinated_calls_only_where_no_tools_are_declared():
    groups = [[traj("<think>ab</think>4"), traj('<tool_call>{"name": "calculator"}</tool_call>', reward=0.0)]]
    free = summarize(groups, [1], declares_tools=False)
    assert free["hallucinated_tool_calls"] == 0.5
    assert free["reasoning_chars"] == 1.0 and free["answer_chars"] == pytest.approx((1 + 45) / 2)
    assert "hallucinated_tool_calls" not in summarize(groups, [1], declares_tools=True)


def test_a_failed_sample_is_a_wrong_answer_and_not_a_short_one():
    import dataclasses

    ok = traj("<think>ab</think>cd")
    failed = dataclasses.replace(traj(), token_ids=(), prompt_length=0, loss_mask=(), logprobs=(), reward=0.0,
                                 finish_reason="error",
                                 error="the engine refused the request")  # fmt: skip
    out = summarize([[ok, failed]], [1, 2])
    assert out["reward"] == 0.5 and out["pass@2"] == 1.0 and out["pass@1"] == 0.5 and out["env_errors"] == 1
    assert out["response_length"] == ok.tokens.output and out["reasoning_chars"] == 2 and out["answer_chars"] == 2
    assert out["truncated_frac"] == 0 and out["abstained"] == 0
    every = summarize([[failed]], [1])
    assert every["response_length"] == 0 and every["env_errors"] == 1 and every["pass@1"] == 0


class RecordingEnv:
    """A single-turn-like environment that records each request and answers correctly only
    when the budget it was given is at least 8 (accuracy that rises with the budget)."""

    name = "rec"

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, []

    def tasks(self, split, *, seed):
        return [Task(env="rec", id=f"eval-{i}", messages=({"role": "user", "content": f"q{i}"},)) for i in range(3)]

    async def rollout(self, task, engine, sampling):
        self.seen.append((task.messages[-1]["content"], sampling))
        ok = sampling.thinking_budget is None or sampling.thinking_budget >= 8
        return [traj("<think>r</think>a", reward=float(ok))] * sampling.n


def test_a_budget_sweep_states_each_budget_and_forces_the_end_of_thinking():
    from ptrain.config.grpo import EvalAlgoConfig
    from ptrain.data.tokenizer import build_tokenizer
    from ptrain.stages.env_metrics import evaluate_envs

    tokenizer = build_tokenizer()
    env = RecordingEnv(tokenizer)
    out = evaluate_envs({"rec": env}, None, EvalAlgoConfig(thinking_budgets=[0, 8]))
    assert out["rec/pass@1"] == 1.0 and out["rec/budget_0/pass@1"] == 0.0 and out["rec/budget_8/pass@1"] == 1.0
    assert out["budget_0/pass@1"] == 0.0 and out["budget_8/pass@1"] == 1.0
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    budgeted = [(text, s) for text, s in env.seen if s.thinking_budget is not None]
    assert len(budgeted) == 6
    for text, s in budgeted:
        assert text.endswith(f"\n\n{{thinking token budget: {s.thinking_budget}}}")
        assert s.think_end_ids == end and s.temperature == 0.0
    assert all(s.think_end_ids == () for _, s in env.seen if s.thinking_budget is None)
