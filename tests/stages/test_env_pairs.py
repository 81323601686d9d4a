"""Nano's three DPO pair categories from graded environment samples."""

from ptrain.envs.base import Task, Trajectory, Turn
from ptrain.stages.env_pairs import episode_messages, good_sample, task_pairs

TASK = Task(env="e", id="train-0", messages=({"role": "user", "content": "What is 2 + 2?"},))
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'


def sample(*turns: tuple[str, str], correct: bool, finish: str = "stop") -> Trajectory:
    n = len(turns)
    return Trajectory(
        task=TASK,
        sample_index=0,
        token_ids=tuple(range(n + 1)),
        prompt_length=1,
        loss_mask=(0,) + (1,) * n,
        logprobs=(0.0,) + (-0.5,) * n,
        reward=float(correct),
        reward_components={"correct": float(correct)},
        finish_reason=finish,
        turns=tuple(Turn(role=r, start=i, end=i + 1, text=t) for i, (r, t) in enumerate(turns)),
    )


class Env:
    name = "e"

    def demonstration(self, task):
        return [{"role": "assistant", "content": "<think>2 + 2 = 4</think>\\boxed{4}"}]


def test_without_declared_tools_a_tool_call_is_rejected_even_when_right():
    right = sample(("policy", "<think>ok</think>4"), correct=True)
    called = sample(("policy", CALL + "4"), correct=True)
    wrong = sample(("policy", "<think>hm</think>5"), correct=False)
    assert good_sample(right, tool_free=True) and not good_sample(called, tool_free=True)
    assert good_sample(called, tool_free=False)
    pairs, counts = task_pairs(Env(), TASK, [right, called, wrong, right], tool_free=True)
    assert [p["category"] for p in pairs] == ["hallucination", "no_tools"]
    assert pairs[0]["rejected"][0]["content"].startswith("<tool_call>")
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": "<think>ok</think>4"}]
    assert pairs[0]["prompt"] == [dict(TASK.messages[0])]
    assert counts["hallucination"] == 1 and counts["no_tools"] == 1 and counts["with_demonstration"] == 0


def test_a_tool_episode_keeps_its_turns_and_correctness_decides():
    good = sample(("policy", CALL), ("tool", "4"), ("policy", "<think></think>4"), correct=True)
    bad = sample(("policy", CALL), ("tool", "4"), ("policy", "5"), correct=False)
    pairs, counts = task_pairs(Env(), TASK, [good, bad], tool_free=False)
    assert counts["with_tools"] == 1 and pairs[0]["category"] == "with_tools"
    assert [m["role"] for m in pairs[0]["chosen"]] == ["assistant", "tool", "assistant"]
    assert episode_messages(bad)[-1] == {"role": "assistant", "content": "5"}


def test_no_good_sample_pairs_the_demonstration_and_cut_or_empty_samples_never_win():
    cut = sample(("policy", "<think>long"), correct=True, finish="length")
    empty = sample(("policy", "  "), correct=False)
    wrong = sample(("policy", "5"), correct=False)
    pairs, counts = task_pairs(Env(), TASK, [cut, empty, wrong], tool_free=True)
    assert counts["with_demonstration"] == 1
    assert pairs[0]["chosen"][0]["content"].endswith("\\boxed{4}")
    assert pairs[0]["rejected"][0]["content"] == "<think>long"  # the cut sample is rejected, the empty one dropped
    assert task_pairs(Env(), TASK, [sample(("policy", "4"), correct=True)] * 2, tool_free=True)[0] == []


def test_with_fewer_good_samples_than_bad_the_tool_calls_are_rejected_first():
    """A task the policy never gets right has one chosen side (the demonstration), so one pair:
    its rejected side is the hallucinating sample, not the first wrong one; without declared
    tools the order of the other bad samples is kept."""
    wrong = sample(("policy", "<think>hm</think>5"), correct=False)
    called = sample(("policy", CALL + "5"), correct=False)
    other = sample(("policy", "6"), correct=False)
    pairs, counts = task_pairs(Env(), TASK, [wrong, other, called], tool_free=True)
    assert [p["category"] for p in pairs] == ["hallucination"]
    assert pairs[0]["rejected"][0]["content"].startswith("<tool_call>")
    assert counts["with_demonstration"] == 1
    right = sample(("policy", "<think>ok</think>4"), correct=True)
    pairs, _ = task_pairs(Env(), TASK, [wrong, right, called, other, right], tool_free=True)
    assert [p["category"] for p in pairs] == ["hallucination", "no_tools"]
    assert pairs[1]["rejected"][0]["content"] == "<think>hm</think>5"
    # a tool environment's calls are no hallucination: its bad samples stay in order
    pairs, _ = task_pairs(Env(), TASK, [right, wrong, called], tool_free=False)
    assert pairs[0]["rejected"][0]["content"] == "<think>hm</think>5"
