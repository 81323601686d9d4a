"""long_horizon: tasks whose totals follow their numbers, the rule stated at its turn, the
judges, and scripted episodes of tens of turns scored by what the final answer keeps."""

from __future__ import annotations

import asyncio

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.long_horizon import judge_final_rule, judge_final_total, judge_steps, keeps_rule, rule_text
from ptrain.envs.registry import make_env
from ptrain.envs.safety import RewardRunner
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(workers=1, timeout_s=10.0) as pool:
        yield pool


def build(tok, runner=None, **options):
    env = make_env(EnvConfig(kind="long_horizon", n_train=6, n_eval=3, options=options), tokenizer=tok)
    if runner is not None:
        env._runner, env._owns_runner = runner, False
    return env


def obey(rule, text: str) -> str:
    """A reply that keeps the rule (digits only where the rule bans a letter)."""
    if rule["kind"] == "end_word":
        return f"{text} {rule['word']}"
    if rule["kind"] == "brackets":
        return f"[{text}]"
    return "".join(c for c in text if c.lower() != rule["letter"])


def perfect(task, *, break_final=False, break_from=None) -> list[str]:
    rule = task.data["rule"]
    out = []
    for i, total in enumerate(task.data["totals"]):
        reply = f"Total: {total}"
        keep = i >= task.data["constraint_turn"] and not (break_final and i == len(task.data["totals"]) - 1)
        if break_from is not None and i >= break_from:
            keep = False
        out.append(obey(rule, reply) if keep else reply)
    return out


def play(env, task, replies, **sp):
    engine = ReplayEngine(replies, tokenizer=env.tokenizer)
    sp.setdefault("max_new_tokens", 64)
    (traj,) = asyncio.run(env.rollout(task, engine, SamplingParams(**sp)))
    return traj, engine


def test_tasks_follow_their_numbers_and_state_the_rule_once(tok):
    env = build(tok, steps=12, constraint_turn=5, max_turns=14)
    tasks = env.tasks("train", seed=0)
    assert [t.data["rule"]["kind"] for t in tasks[:3]] == ["end_word", "no_letter", "brackets"]
    for t in tasks + list(env.tasks("eval", seed=0)):
        totals, follow = t.data["totals"], t.data["follow_ups"]
        assert len(totals) == 12 + 2 and len(follow) == 12 + 1
        assert str(totals[0]) in t.messages[1]["content"]
        for i, msg in enumerate(follow[:-1]):
            k = int(msg.rstrip(".").split()[-1])
            assert totals[i + 1] == totals[i] + (k if "Add" in msg else -k) and totals[i + 1] >= 0
        text = rule_text(t.data["rule"])
        assert [i for i, m in enumerate(follow) if text in m] == [4]  # with the 5th number
        assert text not in t.messages[1]["content"]
    zero = build(tok).tasks("train", seed=0)[0]
    assert rule_text(zero.data["rule"]) in zero.messages[1]["content"]


def test_rules_and_judges():
    assert keeps_rule("The total is 5, banana.", {"kind": "end_word", "word": "banana"})
    assert not keeps_rule("banana: the total is 5", {"kind": "end_word", "word": "banana"})
    assert keeps_rule("Sum: 12", {"kind": "no_letter", "letter": "e"})
    assert not keeps_rule("The sum: 12", {"kind": "no_letter", "letter": "e"})
    assert not keeps_rule("SUM: 12 HERE", {"kind": "no_letter", "letter": "e"})
    assert keeps_rule("  [12]\n", {"kind": "brackets"}) and not keeps_rule("[12] ok", {"kind": "brackets"})
    data = {"totals": [3, 5, 2, 2], "rule": {"kind": "brackets"}, "constraint_turn": 1}
    good = ["3", "[5]", "[2]", "[it is 2]"]
    assert judge_final_total(good, data) == judge_final_rule(good, data) == judge_steps(good, data) == 1.0
    assert judge_final_total(good[:3], data) == 0.0  # never reached the final question
    assert judge_final_rule(good[:3] + ["2"], data) == 0.0
    assert judge_steps(["3", "5", "[2]", "[2]"], data) == pytest.approx(2 / 3)  # reply 1 broke the rule


def test_a_perfect_episode_of_tens_of_turns_scores_one(tok, runner):
    env = build(tok, runner, steps=30, constraint_turn=12, max_turns=32, max_episode_tokens=16384)
    for t in env.tasks("train", seed=1)[:3]:
        traj, engine = play(env, t, perfect(t))
        assert traj.finish_reason == "stop" and traj.reward == pytest.approx(1.0), traj.reward_components
        assert traj.metrics["turns"] == 32 and traj.metrics["env_turns"] == 31
        roles = [u.role for u in traj.turns]
        assert roles == ["policy", "env"] * 31 + ["policy"]
        env_turn = traj.turns[2 * 12 - 1]  # the 12th number carries the rule
        assert rule_text(t.data["rule"]) in env_turn.text
        assert len(engine.requests) == 32
        # Each turn extends the last: prompt + output of turn k is a prefix of turn k + 1's prompt.
        for a, b in zip(engine.requests, engine.requests[1:]):
            assert b.input_ids[: len(a.input_ids)] == a.input_ids
        assert traj.tokens.prompt_cached >= sum(len(r.input_ids) for r in engine.requests[:-1])


def test_forgetting_the_rule_at_the_end_costs_the_constraint_reward(tok, runner):
    env = build(tok, runner, steps=20, constraint_turn=3, max_turns=22)
    t = env.tasks("train", seed=2)[0]
    traj, _ = play(env, t, perfect(t, break_final=True))
    assert traj.reward_components == pytest.approx({"correct": 0.5, "constraint": 0.0, "steps": 0.2})
    drift, _ = play(env, t, perfect(t, break_from=15))
    assert drift.reward_components["constraint"] == 0.0
    assert drift.metrics["steps_right"] == pytest.approx(15 / 21)


def test_an_episode_cut_short_scores_no_final_answer(tok, runner):
    env = build(tok, runner, steps=4, max_turns=6)
    t = env.tasks("train", seed=0)[1]
    replies = perfect(t)
    replies.insert(2, "<tool_call>{}</tool_call>")  # a turn spent on a bad call: the final question is never reached
    traj, _ = play(env, t, replies[:6])
    assert traj.finish_reason == "turn_limit" and traj.reward_components["correct"] == 0.0
    assert traj.reward_components["constraint"] == 0.0
    assert traj.reward_components["steps"] == pytest.approx(0.2)  # every answer given was right

    env = build(tok, runner, steps=4, max_turns=6)
    replies = perfect(t)
    replies[-1] = Completion(text=replies[-1], finish="length")  # the final answer runs out of tokens
    traj, _ = play(env, t, replies)
    assert traj.finish_reason == "length" and traj.reward == 0.0 and traj.metrics["truncated"] == 1.0
    assert traj.reward_components == {"correct": 0.0, "constraint": 0.0, "steps": 0.0}
    scored = make_env(
        EnvConfig(kind="long_horizon", n_train=6, n_eval=3, score_truncated=True, options={"steps": 4, "max_turns": 6}),
        tokenizer=tok,
    )
    scored._runner, scored._owns_runner = runner, False
    traj, _ = play(scored, t, replies)
    assert traj.metrics["truncated"] == 1.0 and traj.reward == pytest.approx(1.0)


def test_tool_calls_are_not_answers(tok, runner):
    env = build(tok, runner, steps=2, max_turns=5)
    t = env.tasks("train", seed=0)[2]
    replies = perfect(t)
    replies.insert(1, '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    traj, _ = play(env, t, replies)
    assert traj.metrics["invalid_tool_calls"] == 1 and "unknown tool" in traj.turns[3].text
    assert traj.metrics["replies"] == 4 and traj.reward == pytest.approx(1.0)


def test_bad_options_name_the_key():
    for options, match in [
        ({"steps": 50}, "options.max_turns"),
        ({"constraint_turn": 30}, "options.constraint_turn"),
        ({"constraints": ["shout"]}, "options.constraints"),
        ({"steps": 0}, "options.steps"),
        ({"correct_reward": -1.0}, "options.correct_reward"),
    ]:
        with pytest.raises(EnvConfigError, match=match):
            validate_env_config(EnvConfig(kind="long_horizon", options=options))
