"""The `judge` kind: a GenRM compares a group's responses circularly, with a scripted judge (a
ReplayEngine that answers the policy's prompt with chosen responses and each judge prompt, by
its rid, with chosen JSON) and with an OpenAI-compatible judge on loopback. Checked: exactly G
calls on the pairs (0,1) ... (G-1,0) and what each prompt shows; the aggregation and the
tie-break against numbers worked by hand; unparsable verdicts as counted ties; length control
zero-centred, favouring the shorter, the bonus only past the quality gate; the HTTP judge giving
the scripted judge's rewards; failed judge calls as env errors; options refused by key."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ptrain.config.env import KIND_OPTIONS, EnvConfig, EnvConfigError, register_env_configs, validate_env_config
from ptrain.config.env_judge import JudgeOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.judge import (
    JudgeEnv,
    circular_pairs,
    conciseness_bonus,
    length_penalties,
    parse_verdict,
    split_reasoning,
)
from ptrain.envs.registry import ENV_CLASSES, env_class, make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine
from ptrain.serve.in_process import serving
from tests.envs.reward_models import score_by_hand, tiny_reward_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLING = SamplingParams(max_new_tokens=512)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def judge_env(tok, **options) -> JudgeEnv:
    return make_env(EnvConfig(kind="judge", n_train=3, n_eval=1, options=options), tokenizer=tok)


def verdict(score_1: float, score_2: float, ranking: float) -> str:
    return json.dumps({"score_1": score_1, "score_2": score_2, "ranking": ranking})


def scripted(tok, env: JudgeEnv, task, responses: list, replies: dict[tuple[int, int], str]) -> ReplayEngine:
    """The policy answers `responses`; the judge call on pair (i, j) answers replies[(i, j)]."""
    queues = {f"{env.name}/{task.id}": responses}
    queues.update({f"{env.name}/{task.id}/judge-{i}-{j}": [reply] for (i, j), reply in replies.items()})
    return ReplayEngine(queues, tokenizer=tok, eos_token_ids=[tok.eos_token_id])


def rollout(env: JudgeEnv, task, engine, n: int):
    return asyncio.run(env.rollout(task, engine, SamplingParams(n=n, max_new_tokens=512)))


def judge_requests(engine: ReplayEngine) -> list:
    return [r for r in engine.requests if "/judge-" in r.rid]


# ----------------------------------------------------------------------------- circular comparison


def test_one_judge_call_per_response_on_the_circle(tok):
    env = judge_env(tok)
    task = env.tasks("train", seed=0)[0]
    answers = ["Paris is the capital.", "It is Paris.", "Lyon.", "The capital of France is Paris."]
    pairs = [(0, 1), (1, 2), (2, 3), (3, 0)]
    engine = scripted(tok, env, task, answers, {p: verdict(3, 4, 5) for p in pairs})
    out = rollout(env, task, engine, 4)

    calls = judge_requests(engine)
    assert [r.rid for r in calls] == [f"judge/{task.id}/judge-{i}-{j}" for i, j in pairs]
    assert engine.remaining(f"judge/{task.id}") == 0
    for (i, j), request in zip(pairs, calls):
        shown = tok.decode(list(request.input_ids), skip_special_tokens=True)
        assert f"<response_1>\n{answers[i]}\n</response_1>" in shown
        assert f"<response_2>\n{answers[j]}\n</response_2>" in shown
        assert task.messages[0]["content"] in shown and '{"score_1": <1-5>' in shown
        sp = request.sampling
        assert (sp.temperature, sp.top_p, sp.max_new_tokens, sp.n) == (0.6, 0.95, 512, 1)
    assert [t.metrics["judge_calls"] for t in out] == [1, 1, 1, 1]
    assert env.stats["judge_calls"] == 4 and env.stats["judge_parse_failures"] == 0
    # Each response was response 1 once (score 3) and response 2 once (score 4).
    assert [t.reward for t in out] == pytest.approx([(3.5 - 1) / 4] * 4)
    assert circular_pairs(2) == [(0, 1), (1, 0)] and circular_pairs(1) == [] and circular_pairs(0) == []


def test_two_responses_are_compared_both_ways(tok):
    env = judge_env(tok)
    task = env.tasks("train", seed=0)[0]
    engine = scripted(tok, env, task, ["short", "longer one"], {(0, 1): verdict(5, 1, 1), (1, 0): verdict(2, 4, 6)})
    out = rollout(env, task, engine, 2)
    assert [r.rid for r in judge_requests(engine)] == [f"judge/{task.id}/judge-0-1", f"judge/{task.id}/judge-1-0"]
    assert [t.reward_components["judge"] for t in out] == pytest.approx([(4.5 - 1) / 4, (1.5 - 1) / 4])


# ----------------------------------------------------------------------------- aggregation


THREE = ["first answer", "second answer", "third answer"]
THREE_REPLIES = {
    (0, 1): verdict(4, 2, 2),  # no tie: 4 and 2 stand
    (1, 2): verdict(3, 3, 1),  # tie, response 1 much better
    (2, 0): verdict(5, 5, 5),  # tie, response 2 better
}


@pytest.mark.parametrize(
    "options, expected",
    [
        # tie_break 0.5: (1,2) moves 0.5 * 2.5 / 2.5 = 0.5 -> 3.5 / 2.5; (2,0) moves 0.5 * -1.5 / 2.5 = -0.3 -> 4.7 / 5.3.
        # Means: r0 = (4 + 5.3) / 2, r1 = (2 + 3.5) / 2, r2 = (2.5 + 4.7) / 2; rescaled (s - 1) / 4.
        ({}, [(4.65 - 1) / 4, (2.75 - 1) / 4, (3.6 - 1) / 4]),
        ({"rescale": False}, [4.65, 2.75, 3.6]),
        # NeMo Gym's move, 3.5 - r: (1,2) -> 5.5 / 0.5; (2,0) -> 3.5 / 6.5.
        ({"rescale": False, "tie_break": 2.5}, [(4 + 6.5) / 2, (2 + 5.5) / 2, (0.5 + 3.5) / 2]),
        ({"rescale": False, "tie_break": 0.0}, [(4 + 5) / 2, (2 + 3) / 2, (3 + 5) / 2]),
    ],
)
def test_mean_score_with_ties_broken_by_the_ranking(tok, options, expected):
    env = judge_env(tok, **options)
    task = env.tasks("train", seed=0)[0]
    out = rollout(env, task, scripted(tok, env, task, THREE, THREE_REPLIES), 3)
    assert [t.reward for t in out] == pytest.approx(expected)
    for t in out:
        assert t.finish_reason == "stop" and t.error is None and sum(t.loss_mask) > 0
        assert set(t.reward_components) == {"judge", "length_penalty", "conciseness_bonus"}
        assert sum(t.reward_components.values()) == pytest.approx(t.reward)
        assert t.reward_components["judge"] == pytest.approx(t.reward)
    breaks = [0, 0, 0] if options.get("tie_break") == 0.0 else [0, 1, 1]
    assert [t.metrics["tie_breaks"] for t in out] == breaks


def test_unparsable_replies_are_ties_and_counted(tok):
    env = judge_env(tok, rescale=False)
    task = env.tasks("train", seed=0)[0]
    replies = {
        (0, 1): "I like the first one better.",  # no JSON
        (1, 2): verdict(7, 2, 1),  # a score off the scale
        # Reasoning that looks like a verdict, then the verdict: only the text after </think> counts.
        (2, 0): '<think>{"score_1": 5, "score_2": 1, "ranking": 1}</think> Verdict: ' + verdict(2, 4, 5),
    }
    out = rollout(env, task, scripted(tok, env, task, THREE, replies), 3)
    # Ties score 3 each: r0 = (3 + 4) / 2, r1 = (3 + 3) / 2, r2 = (3 + 2) / 2.
    assert [t.reward for t in out] == pytest.approx([3.5, 3.0, 2.5])
    assert [t.metrics["judge_parse_failures"] for t in out] == [1, 1, 0]
    assert [t.metrics["tie_breaks"] for t in out] == [0, 0, 0]
    assert env.stats["judge_parse_failures"] == 2 and env.stats["judge_calls"] == 3
    assert all(t.error is None for t in out)


def test_parse_verdict():
    assert parse_verdict(verdict(4, 2, 2)) == (v := parse_verdict('{"score_1": 4, "score_2": 2, "ranking": 2}'))
    assert (v.score_1, v.score_2, v.ranking) == (4.0, 2.0, 2.0)
    fenced = 'Here it is:\n```json\n{"score_1": 3, "score_2": 5, "ranking": 6}\n```\n'
    assert parse_verdict(fenced).ranking == 6.0
    # The last valid object counts; invalid ones after it are skipped.
    last = verdict(1, 2, 4) + " then " + verdict(5, 4, 2) + ' and {"score_1": 9}'
    assert parse_verdict(last).score_1 == 5.0
    for bad in (
        "",
        "score_1: 4, score_2: 2, ranking: 2",
        '{"score_1": 4, "score_2": 2}',  # a key missing
        '{"score_1": true, "score_2": 2, "ranking": 2}',  # not a number
        '{"score_1": "4", "score_2": 2, "ranking": 2}',
        verdict(0, 2, 2),
        verdict(4, 2, 7),
        verdict(float("nan"), 2, 2),
        '<think>{"score_1": 4, "score_2": 2, "ranking": 2}',  # cut off while reasoning
    ):
        assert parse_verdict(bad) is None, bad


def test_split_reasoning():
    assert split_reasoning("<think> why </think>\n\nthe answer ") == ("why", "the answer")
    assert split_reasoning("why</think>answer") == ("why", "answer")  # the template opened <think>
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert split_reasoning("  plain answer ") == ("", "plain answer")


# ----------------------------------------------------------------------------- length control


def think(reasoning: int, answer: int) -> str:
    return "<think>" + "r" * reasoning + "</think>" + "a" * answer


def test_length_penalties_are_zero_centred_and_favour_the_shorter(tok):
    env = judge_env(tok, reasoning_length_penalty=0.2, answer_length_penalty=0.1, tie_break=0.0)
    task = env.tasks("train", seed=0)[0]
    responses = [think(10, 40), think(30, 20), think(50, 10), think(20, 30)]
    replies = {p: verdict(4, 4, 3) for p in circular_pairs(4)}  # equal quality: 0.75 each
    out = rollout(env, task, scripted(tok, env, task, responses, replies), 4)
    assert [t.metrics["reasoning_chars"] for t in out] == [10, 30, 50, 20]
    assert [t.metrics["answer_chars"] for t in out] == [40, 20, 10, 30]
    # reasoning: x = [0, .5, 1, .25], mean .4375; answer: x = [1, 1/3, 0, 2/3], mean .5.
    reasoning = [-0.2 * (x - 0.4375) for x in (0, 0.5, 1, 0.25)]
    answer = [-0.1 * (x - 0.5) for x in (1, 1 / 3, 0, 2 / 3)]
    penalties = [t.reward_components["length_penalty"] for t in out]
    assert penalties == pytest.approx([r + a for r, a in zip(reasoning, answer)])
    assert sum(penalties) == pytest.approx(0.0, abs=1e-12)
    assert [t.reward for t in out] == pytest.approx([0.75 + p for p in penalties])
    assert all(t.reward_components["conciseness_bonus"] == 0 for t in out)

    # One knob at a time: the shorter part always gains.
    by_reasoning = length_penalties([10, 30, 50, 20], 0.2)
    assert sorted(range(4), key=lambda k: -by_reasoning[k]) == [0, 3, 1, 2]
    assert length_penalties([7, 7, 7], 1.0) == [0.0] * 3 and length_penalties([5, 9], 0.0) == [0.0, 0.0]


def test_the_bonus_goes_only_to_short_responses_past_the_quality_gate(tok):
    # Qualities 5 4 1 2 3 (tie_break 0: each response's mean is its own score); top_percentile 0.4
    # of 5 -> k = 2, the gate is the second-best score (4): responses 0 and 1 pass.
    quality = [5, 4, 1, 2, 3]
    responses = [think(10, 60), "a" * 20, think(3, 5), think(40, 30), think(40, 40)]
    replies = {(i, j): verdict(quality[i], quality[j], 3) for i, j in circular_pairs(5)}
    env = judge_env(tok, reasoning_bonus=0.2, answer_bonus=0.3, top_percentile=0.4, tie_break=0.0)
    task = env.tasks("train", seed=0)[0]
    out = rollout(env, task, scripted(tok, env, task, responses, replies), 5)
    # Reasoning: of 0 and 1 only 0 has any, so it gets 0.2; the answer: 1's (20) is shorter than 0's (60).
    # Response 2 is the shortest of all in both parts, but its quality is the lowest: nothing.
    assert [t.reward_components["conciseness_bonus"] for t in out] == pytest.approx([0.2, 0.3, 0, 0, 0])
    assert [t.reward_components["judge"] for t in out] == pytest.approx([(q - 1) / 4 for q in quality])
    assert [t.reward for t in out] == pytest.approx([1.2, 1.05, 0.0, 0.25, 0.5])

    # The gate with the default 0.2 of 5 (k = 1): only the best passes; equal shortest lengths share.
    assert conciseness_bonus([1.0, 0.9, 0.2], [50, 10, 5], 0.5, 0.2) == [0.5, 0.0, 0.0]
    assert conciseness_bonus([1.0, 1.0, 0.2], [10, 10, 5], 0.5, 0.2) == [0.5, 0.5, 0.0]
    assert conciseness_bonus([1.0, 1.0], [0, 0], 0.5, 0.5) == [0.0, 0.0]  # no non-empty part
    assert conciseness_bonus([1.0, 0.5], [3, 9], 0.0, 0.5) == [0.0, 0.0]


# ----------------------------------------------------------------------------- samples that are not judged


def test_truncated_and_aborted_samples_are_left_out_of_the_circle(tok):
    env = judge_env(tok, answer_length_penalty=0.5)
    task = env.tasks("train", seed=0)[0]
    responses = [
        "a good answer",
        Completion(text="cut off mid-sen", finish="length"),
        Completion(text="", finish="abort"),
        "a better answer",
    ]
    engine = scripted(tok, env, task, responses, {(0, 3): verdict(2, 4, 5), (3, 0): verdict(5, 3, 2)})
    out = rollout(env, task, engine, 4)
    assert [r.rid for r in judge_requests(engine)] == [f"judge/{task.id}/judge-0-3", f"judge/{task.id}/judge-3-0"]
    assert [t.finish_reason for t in out] == ["stop", "length", "abort", "stop"]
    assert [t.metrics["truncated"] for t in out] == [0, 1, 0, 0]
    assert [t.metrics["aborted"] for t in out] == [0, 0, 1, 0]
    assert out[1].reward == 0 and out[2].reward == 0
    # Length control runs over the two judged ones only (answers of 13 and 15 characters).
    assert out[0].reward_components["length_penalty"] == pytest.approx(0.25)
    assert out[3].reward_components["length_penalty"] == pytest.approx(-0.25)
    assert [out[0].reward_components["judge"], out[3].reward_components["judge"]] == pytest.approx([0.375, 0.875])


def test_a_lone_judgeable_response_gets_the_neutral_score(tok):
    env = judge_env(tok, answer_bonus=1.0)
    task = env.tasks("train", seed=0)[0]
    engine = scripted(tok, env, task, ["the only answer", Completion(text="cut", finish="length")], {})
    out = rollout(env, task, engine, 2)
    assert judge_requests(engine) == []
    assert out[0].reward == pytest.approx(0.5) and out[0].metrics["unjudged"] == 1
    assert out[1].reward == 0 and out[1].metrics["unjudged"] == 0


# ----------------------------------------------------------------------------- judge failures


def test_a_judge_request_the_engine_refuses_makes_its_pair_env_errors(tok):
    env = judge_env(tok)
    task = env.tasks("train", seed=0)[0]
    replies = {(0, 1): verdict(4, 2, 2), (2, 0): verdict(3, 5, 6)}  # nothing queued for (1, 2)
    out = rollout(env, task, scripted(tok, env, task, THREE, replies), 3)
    for t in out[1:]:
        assert t.finish_reason == "error" and t.reward == 0 and set(t.reward_components.values()) == {0.0}
        assert "comparison of samples 1 and 2 failed" in t.error and "no completion left" in t.error
        assert sum(t.loss_mask) == 0 and set(t.logprobs) == {0.0}
        assert len(t.token_ids) > t.prompt_length  # the response stays for the audit log
    # Response 0 keeps both its comparisons: 4 as response 1, 5 as response 2.
    assert out[0].error is None and out[0].reward == pytest.approx((4.5 - 1) / 4)
    assert env.stats["judge_errors"] == 1 and env.stats["errors"] == 2


# ----------------------------------------------------------------------------- an OpenAI-compatible judge


QUALITY = {"Paris.": 4, "The capital of France is Paris.": 4, "Lyon, I think.": 1, "Paris, on the Seine.": 5}


def quality_verdict(answer_1: str, answer_2: str) -> str:
    """The scripted GenRM: each answer's score from QUALITY; on a tie the shorter is ranked better."""
    q1, q2 = QUALITY[answer_1], QUALITY[answer_2]
    return verdict(q1, q2, 3 if q1 > q2 or (q1 == q2 and len(answer_1) <= len(answer_2)) else 5)


SERVER: dict = {"bodies": [], "headers": [], "fail": {}}


async def _chat(request: Request) -> JSONResponse:
    body = await request.json()
    SERVER["bodies"].append(body)
    SERVER["headers"].append(dict(request.headers))
    content = body["messages"][0]["content"]
    a = re.search(r"<response_1>\n(.*?)\n</response_1>", content, re.S).group(1)
    b = re.search(r"<response_2>\n(.*?)\n</response_2>", content, re.S).group(1)
    fail = SERVER["fail"].get((a, b), 0)
    if fail:  # fail this pair's next `fail` requests (-1: every one)
        SERVER["fail"][(a, b)] = fail - 1
        return JSONResponse({"object": "error", "message": "overloaded"}, status_code=503)
    if body.get("model") != "genrm":
        return JSONResponse({"object": "error", "message": f"model {body.get('model')!r} not found"}, 404)
    message = {"role": "assistant", "content": quality_verdict(a, b)}
    return JSONResponse({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})


@pytest.fixture(scope="module")
def judge_url():
    with serving(Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])) as url:
        yield url


@pytest.fixture
def server():
    SERVER.update(bodies=[], headers=[], fail={})
    return SERVER


RESPONSES = [
    "<think>short</think>Paris.",
    "<think>a much longer line of reasoning</think>The capital of France is Paris.",
    "Lyon, I think.",
    "<think>hmm, let me see</think>Paris, on the Seine.",
]
LENGTH_KNOBS = {"reasoning_length_penalty": 0.1, "answer_length_penalty": 0.2, "answer_bonus": 0.05}


def test_an_openai_judge_gives_the_scripted_judges_rewards(tok, judge_url, server, monkeypatch):
    answers = [split_reasoning(r)[1] for r in RESPONSES]
    env = judge_env(tok, **LENGTH_KNOBS)
    task = env.tasks("train", seed=0)[0]
    replies = {(i, j): quality_verdict(answers[i], answers[j]) for i, j in circular_pairs(4)}
    expected = rollout(env, task, scripted(tok, env, task, RESPONSES, replies), 4)

    monkeypatch.setenv("TEST_GENRM_KEY", "secret-123")
    remote = judge_env(tok, judge="openai", judge_url=judge_url, judge_model="genrm",
                       judge_api_key_env="TEST_GENRM_KEY", **LENGTH_KNOBS)  # fmt: skip
    engine = ReplayEngine({f"judge/{task.id}": RESPONSES}, tokenizer=tok, eos_token_ids=[tok.eos_token_id])
    out = rollout(remote, task, engine, 4)

    assert [t.reward for t in out] == pytest.approx([t.reward for t in expected])
    for got, want in zip(out, expected):
        assert got.reward_components == pytest.approx(want.reward_components)
        assert got.metrics == want.metrics
    assert len({t.reward for t in out}) > 1  # the test tells responses apart
    assert len(server["bodies"]) == 4 and judge_requests(engine) == []
    body = server["bodies"][0]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("genrm", 0.6, 0.95, 512)
    assert all(h["authorization"] == "Bearer secret-123" for h in server["headers"])
    shown = [
        (re.search(r"<response_1>\n(.*?)\n</", b["messages"][0]["content"], re.S).group(1)) for b in server["bodies"]
    ]
    assert sorted(shown) == sorted(answers)  # each answer was response 1 once


def test_a_failing_endpoint_is_retried_then_an_env_error(tok, judge_url, server):
    env = judge_env(tok, judge="openai", judge_url=judge_url + "/v1", judge_model="genrm", judge_retries=1)
    task = env.tasks("train", seed=0)[0]
    answers = [split_reasoning(r)[1] for r in RESPONSES]
    engine = ReplayEngine({f"judge/{task.id}": RESPONSES * 2}, tokenizer=tok, eos_token_ids=[tok.eos_token_id])
    server["fail"][(answers[1], answers[2])] = 1  # one 503, then an answer: the retry succeeds
    first = rollout(env, task, engine, 4)
    assert all(t.error is None for t in first) and len(server["bodies"]) == 5

    server["fail"][(answers[1], answers[2])] = -1  # every attempt fails
    out = rollout(env, task, engine, 4)
    assert [t.finish_reason for t in out] == ["stop", "error", "error", "stop"]
    assert "comparison of samples 1 and 2 failed" in out[1].error and "answered 503" in out[1].error
    assert "2 attempt(s)" in out[1].error and "judge_url" in out[1].error
    assert out[1].reward == 0 and sum(out[1].loss_mask) == 0
    assert out[0].reward == pytest.approx(first[0].reward) and out[3].reward == pytest.approx(first[3].reward)

    wrong_model = judge_env(tok, judge="openai", judge_url=judge_url, judge_model="other", judge_retries=0)
    engine.add({f"judge/{task.id}": RESPONSES[:2]})
    out = rollout(wrong_model, task, engine, 2)
    assert all(t.finish_reason == "error" and "answered 404" in t.error and "judge_model" in t.error for t in out)


def test_an_unreachable_endpoint_fails_the_group_with_the_url(tok):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = judge_env(tok, judge="openai", judge_url=f"http://127.0.0.1:{port}", judge_model="m", judge_retries=0)
    task = env.tasks("train", seed=0)[0]
    engine = ReplayEngine({f"judge/{task.id}": ["one", "two", "three"]}, tokenizer=tok, eos_token_ids=[2])
    out = rollout(env, task, engine, 3)
    assert all(t.finish_reason == "error" for t in out)
    assert f"POST http://127.0.0.1:{port}/v1/chat/completions" in out[0].error and "unreachable" in out[0].error


# ----------------------------------------------------------------------------- tasks


def test_generated_prompts_are_deterministic_and_disjoint(tok):
    env = make_env(EnvConfig(kind="judge", n_train=200, n_eval=20), tokenizer=tok)
    train, held = env.tasks("train", seed=3), env.tasks("eval", seed=3)
    again = make_env(EnvConfig(kind="judge", n_train=200, n_eval=20), tokenizer=tok)
    assert [t.messages for t in again.tasks("train", seed=3)] == [t.messages for t in train]
    assert [t.messages for t in again.tasks("train", seed=4)] != [t.messages for t in train]
    texts = [t.messages[0]["content"] for t in (*train, *held)]
    assert len(set(texts)) == 220 and len(train) == 200 and len(held) == 20
    assert {t.data["family"] for t in train} == set(JudgeOptions().families)
    assert all(t.messages[0]["role"] == "user" and t.env == "judge" for t in train)
    few = make_env(EnvConfig(kind="judge", n_train=200, options={"families": ["rewrite"]}), tokenizer=tok)
    with pytest.raises(ValueError, match=r"found only 60 of 300 distinct requests of families \['rewrite'\]"):
        few.tasks("train", seed=0)


def test_prompts_from_jsonl(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rows.write_text("\n".join(json.dumps(r) for r in ({"prompt": "Say hi."}, {"messages": chat}, {"prompt": "Count."})))
    env = make_env(EnvConfig(kind="judge", n_eval=1, options={"path": str(rows)}), tokenizer=tok)
    assert [list(t.messages) for t in env.tasks("eval", seed=0)] == [[{"role": "user", "content": "Say hi."}]]
    assert [list(t.messages) for t in env.tasks("train", seed=0)] == [chat, [{"role": "user", "content": "Count."}]]

    for row, why in (
        ({"prompt": "a", "messages": chat}, "exactly one of"),
        ({"messages": chat[:1]}, "must end with a user turn"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r'"messages"\[0\] must be'),
        ({"prompt": ""}, "must be a non-empty string"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n")
        env = make_env(EnvConfig(kind="judge", n_eval=0, options={"path": str(bad)}), tokenizer=tok)
        with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{why}"):
            env.tasks("train", seed=0)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "options, key, why",
    [
        ({"judge": "gpt"}, "judge", r"must be one of \['policy', 'openai', 'reward_model'\]"),
        ({"judge": "reward_model"}, "reward_model_path", "needs a reward-model folder"),
        ({"judge": "reward_model", "reward_model_path": "/m", "reward_model_max_tokens": 8},
         "reward_model_max_tokens", ">= 16"),
        ({"reward_model_path": "/m"}, "reward_model_path", "read only with judge reward_model"),
        ({"judge": "openai"}, "judge_url", "needs the endpoint's base URL"),
        ({"judge": "openai", "judge_url": "ftp://h", "judge_model": "m"}, "judge_url", "must be http"),
        ({"judge": "openai", "judge_url": "http://h:99999", "judge_model": "m"}, "judge_url", "port"),
        ({"judge": "openai", "judge_url": "http://h/v1/chat/completions", "judge_model": "m"}, "judge_url", "base"),
        ({"judge": "openai", "judge_url": "http://h:8000"}, "judge_model", "served model's name"),
        ({"judge": "openai", "judge_url": "http://h", "judge_model": "m", "judge_api_key_env": "sk-123"},
         "judge_api_key_env", "name of an environment variable"),
        ({"judge_url": "http://h:8000"}, "judge_url", "read only with judge openai"),
        ({"judge_model": "m"}, "judge_model", "read only with judge openai"),
        ({"judge_temperature": -1}, "judge_temperature", ">= 0"),
        ({"judge_temperature": "hot"}, "judge_temperature", "must be a number"),
        ({"judge_top_p": 0}, "judge_top_p", r"in \(0, 1\]"),
        ({"judge_max_new_tokens": 0}, "judge_max_new_tokens", ">= 1"),
        ({"judge_max_response_chars": 10}, "judge_max_response_chars", ">= 100"),
        ({"judge_timeout_s": 0}, "judge_timeout_s", "> 0"),
        ({"judge_connect_timeout_s": 1e9}, "judge_connect_timeout_s", "at most"),
        ({"judge_retries": 11}, "judge_retries", "between 0 and 10"),
        ({"judge_concurrency": 0}, "judge_concurrency", ">= 1"),
        ({"tie_break": -0.1}, "tie_break", ">= 0"),
        ({"reasoning_length_penalty": -1}, "reasoning_length_penalty", ">= 0"),
        ({"answer_bonus": -0.5}, "answer_bonus", ">= 0"),
        ({"top_percentile": 0}, "top_percentile", r"in \(0, 1\]"),
        ({"top_percentile": 1.5}, "top_percentile", r"in \(0, 1\]"),
        ({"families": ["poetry"]}, "families", r"unknown families \['poetry'\]"),
        ({"families": []}, "families", "pass at least one"),
        ({"families": ["explain", "explain"]}, "families", "repeat"),
        ({"path": "/no/such/file.jsonl"}, "path", "no file"),
        ({"judge_model_name": "m"}, "judge_model_name", "not an option of this kind; valid keys: families, path"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_the_key(options, key, why):
    with pytest.raises(EnvConfigError, match=rf"config key 'envs\.judge\.options\.{key}': .*{why}"):
        validate_env_config(EnvConfig(kind="judge", options=options))


def test_eval_path_needs_path_and_the_api_key_must_be_set(tok, tmp_path, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    with pytest.raises(EnvConfigError, match=r"'envs\.judge\.options\.eval_path': eval_path needs path"):
        validate_env_config(EnvConfig(kind="judge", options={"eval_path": str(rows)}))
    monkeypatch.delenv("TEST_GENRM_MISSING", raising=False)
    options = {
        "judge": "openai",
        "judge_url": "http://h",
        "judge_model": "m",
        "judge_api_key_env": "TEST_GENRM_MISSING",
    }
    with pytest.raises(EnvConfigError, match=r"'envs\.judge\.options\.judge_api_key_env': .*TEST_GENRM_MISSING is not"):
        make_env(EnvConfig(kind="judge", options=options), tokenizer=tok)


def test_the_kind_is_registered_and_its_hydra_file_composes(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    assert list(ENV_CLASSES) == list(KIND_OPTIONS) and env_class("judge") is JudgeEnv
    assert isinstance(validate_env_config(EnvConfig(kind="judge")), JudgeOptions)
    register_env_configs()
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: judge\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    with initialize_config_dir(str(tmp_path), version_base=None):
        node = OmegaConf.select(compose(config_name="main", overrides=["envs.judge.n_train=7"]), "envs.judge")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    opts = validate_env_config(cfg)
    assert cfg.kind == "judge" and cfg.n_train == 7
    assert opts == JudgeOptions()  # the file states every default


# ----------------------------------------------------------------------------- calibration


def test_calibration_agreement_counts_right_wrong_ties_and_unparsed(tok, tmp_path):
    """Four judged pairs: the judge (the policy engine, scripted by rid) gets the first right,
    the second wrong, calls the third a tie, and answers the fourth in prose."""
    env = judge_env(tok)
    rows = [
        {"messages": [{"role": "user", "content": f"q{k}"}], "response_1": "a", "response_2": "b", "better": better}
        for k, better in enumerate((1, 1, 2, 2))
    ]
    replies = [verdict(5, 2, 1), verdict(2, 5, 6), verdict(3, 3, 3.5), "no idea"]
    engine = ReplayEngine({f"{env.name}/calibration-{k}/judge-0-1": [r] for k, r in enumerate(replies)}, tokenizer=tok,
                          eos_token_ids=[tok.eos_token_id])  # fmt: skip
    out = asyncio.run(env.calibrate(rows, engine))
    assert out == {"agreement": 0.25, "rows": 4.0, "unparsed": 1.0}

    # The eval stage's reader: bad rows are refused naming the line, a stage without a judge too.
    from ptrain.config import ConfigError
    from ptrain.stages.eval import judge_agreement

    path = tmp_path / "calibration.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    engine = ReplayEngine({f"{env.name}/calibration-0/judge-0-1": [replies[0]]}, tokenizer=tok,
                          eos_token_ids=[tok.eos_token_id])  # fmt: skip
    assert judge_agreement({"judge": env}, engine, str(path), seed=0)["judge_calibration/agreement"] == 1.0
    path.write_text(json.dumps({"messages": [], "response_1": "a", "response_2": "b", "better": 3}) + "\n")
    with pytest.raises(ConfigError, match=r"calibration.jsonl:1 needs .*better=3"):
        judge_agreement({"judge": env}, engine, str(path), seed=0)
    with pytest.raises(ConfigError, match="no judge environment"):
        judge_agreement({}, engine, str(path), seed=0)


# ----------------------------------------------------------------------------- a Bradley-Terry reward model


@pytest.fixture(scope="module")
def reward_model_dir(tok, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rm") / "export")
    return path, tiny_reward_model(tok, path)


def by_hand(tok, rm, messages, response: str) -> float:
    return score_by_hand(tok, rm, [*messages, {"role": "assistant", "content": response}], len(messages))


def test_a_reward_model_scores_each_response_once_without_asking_the_engine(tok, reward_model_dir):
    """judge reward_model: one score per judgeable response, the exported model's score of
    prompt + response (reasoning included), through the logistic function; no comparison
    reaches the engine; length control acts on those scores; a truncated sample is unjudged."""
    import math

    path, rm = reward_model_dir
    env = judge_env(tok, judge="reward_model", reward_model_path=path, answer_length_penalty=0.1)
    task = env.tasks("train", seed=0)[0]
    responses = ["<think>short</think>Yes.", "<think>a longer thought</think>Certainly, here it is.",
                 "No idea at all, sorry.", Completion(text="cut off", finish="length")]  # fmt: skip
    engine = scripted(tok, env, task, responses, {})
    ts = rollout(env, task, engine, 4)
    assert judge_requests(engine) == []
    texts = [r if isinstance(r, str) else r.text for r in responses]
    raw = [by_hand(tok, rm, task.messages, t) for t in texts[:3]]
    assert len(set(round(x, 4) for x in raw)) == 3  # the model tells them apart
    answers = [len(split_reasoning(t)[1]) for t in texts[:3]]
    x = [(a - min(answers)) / (max(answers) - min(answers)) for a in answers]
    for k, t in enumerate(ts[:3]):
        assert t.error is None and t.metrics["judge_calls"] == 1 and t.metrics["tie_breaks"] == 0
        assert t.reward_components["judge"] == pytest.approx(1 / (1 + math.exp(-raw[k])), abs=2e-5)
        assert t.reward_components["length_penalty"] == pytest.approx(-0.1 * (x[k] - sum(x) / 3), abs=1e-6)
    assert ts[3].reward == 0.0 and ts[3].metrics["truncated"] == 1 and ts[3].metrics["judge_calls"] == 0
    assert env.stats["judge_calls"] == 3


def test_a_reward_model_raw_scores_and_calibration(tok, reward_model_dir):
    """rescale false gives the model's score itself; calibration counts the rows whose better
    response the model scores higher."""
    path, rm = reward_model_dir
    env = judge_env(tok, judge="reward_model", reward_model_path=path, rescale=False)
    task = env.tasks("train", seed=0)[0]
    responses = ["Alpha.", "Beta, gamma."]
    ts = rollout(env, task, scripted(tok, env, task, responses, {}), 2)
    for t, r in zip(ts, responses):
        assert t.reward == pytest.approx(by_hand(tok, rm, task.messages, r), abs=2e-5)
    msgs = ({"role": "user", "content": "Say something."},)
    a, b = by_hand(tok, rm, msgs, "Alpha."), by_hand(tok, rm, msgs, "Beta, gamma.")
    better = 1 if a > b else 2
    rows = [{"messages": list(msgs), "response_1": "Alpha.", "response_2": "Beta, gamma.", "better": better},
            {"messages": list(msgs), "response_1": "Alpha.", "response_2": "Beta, gamma.", "better": 3 - better}]  # fmt: skip
    out = asyncio.run(env.calibrate(rows, engine=None))
    assert out == {"agreement": 0.5, "rows": 2.0, "unparsed": 0.0}


def test_a_missing_reward_model_is_refused_when_the_environment_is_built(tok, tmp_path):
    with pytest.raises(EnvConfigError, match=r"envs\.judge\.options\.reward_model_path': no reward model at .*"
                       r"run a stage of kind rm before any stage that samples with it"):  # fmt: skip
        judge_env(tok, judge="reward_model", reward_model_path=str(tmp_path / "nothing"))
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(EnvConfigError, match="not a reward model"):
        judge_env(tok, judge="reward_model", reward_model_path=str(policy))
