"""Scoring text through the server, in process (Starlette's TestClient) over a real LocalEngine
on the tiny model: top log-probs of prompt and output positions (the engine's, checked against
a full forward pass of the model), `/v1/completions` with `echo`, `max_tokens: 0` and
`logprobs: N` as OpenAI's legacy API and lm-evaluation-harness use them, `/generate`'s
`top_logprobs_num`, and the tokenizer routes (/tokenize, /detokenize, /tokenizer_info)."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from starlette.testclient import TestClient

from ptrain.models import load_hf
from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import FinishReason, GenerateRequest, Sample, SamplingParams
from ptrain.serve.server import make_app
from tests.rollout import sglang_schema as schema
from tests.rollout.conftest import CONTEXT

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_logp(served_model_dir):
    """log softmax of the model's logits over a whole sequence, by a plain forward pass."""
    model = load_hf(served_model_dir)

    def logp(ids: list[int]) -> np.ndarray:
        return np.asarray(jax.nn.log_softmax(model(np.asarray([ids], np.int32))[0].astype(np.float32), axis=-1))

    return logp


def scored(engine, prompt, top: int, sampling: SamplingParams = GREEDY) -> Sample:
    (s,) = engine.generate_many(
        [GenerateRequest(tuple(prompt), sampling, return_prompt_logprobs_from=0, top_logprobs_num=top)]
    )[0]
    return s


def assert_top(alternatives, logp_V: np.ndarray, k: int) -> None:
    """The k alternatives are the distribution's k largest, each with its own log-prob (ties
    may order differently, so values are compared, and each id against its value)."""
    ids = [t for t, _ in alternatives]
    vals = [v for _, v in alternatives]
    assert len(alternatives) == k and vals == sorted(vals, reverse=True)
    np.testing.assert_allclose(vals, np.sort(logp_V)[::-1][:k], atol=1e-4)
    np.testing.assert_allclose(logp_V[ids], vals, atol=1e-4)


def test_the_engines_top_logprobs_are_the_models_top_k(engine, reference_logp):
    s = scored(engine, PROMPT, top=3)
    logp = reference_logp(PROMPT + list(s.output_ids))
    L = len(PROMPT)
    assert len(s.prompt_top_logprobs) == len(s.prompt_logprobs) == L - 1
    for i, alts in enumerate(s.prompt_top_logprobs):  # prompt token i + 1, predicted at position i
        assert_top(alts, logp[i], 3)
    assert len(s.top_logprobs) == len(s.output_ids) == 4
    for j, alts in enumerate(s.top_logprobs):
        assert_top(alts, logp[L - 1 + j], 3)
        # greedy: the drawn token is the first alternative, with the sample's own log-prob
        assert alts[0] == (s.output_ids[j], s.logprobs[j])
    plain = engine.generate_many([GenerateRequest(tuple(PROMPT), GREEDY, return_prompt_logprobs_from=0)])[0][0]
    assert plain.top_logprobs is None and plain.prompt_top_logprobs is None
    assert plain.output_ids == s.output_ids and plain.prompt_logprobs == pytest.approx(s.prompt_logprobs, abs=1e-6)


def test_a_sampled_token_outside_the_top_k_keeps_its_own_log_prob(engine):
    sampling = SamplingParams(max_new_tokens=12, temperature=1.5, sampling_seed=7, ignore_eos=True)
    s = scored(engine, PROMPT, top=1, sampling=sampling)
    assert all(len(alts) == 1 for alts in s.top_logprobs)
    assert any(alts[0][0] != t for alts, t in zip(s.top_logprobs, s.output_ids)), "every draw was the top token"
    for alts, lp in zip(s.top_logprobs, s.logprobs):
        assert alts[0][1] >= lp - 1e-6


def test_echo_with_max_tokens_0_scores_the_prompt_with_top_logprobs(client, engine, tokenizer):
    body = {"model": "tiny", "prompt": "1+2=3", "max_tokens": 0, "echo": True, "logprobs": 3}
    out = client.post("/v1/completions", json=body).json()
    (c,) = out["choices"]
    ids = tokenizer.encode("1+2=3")
    lp = c["logprobs"]
    assert c["text"] == "1+2=3" and c["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    s = scored(engine, ids, top=3, sampling=SamplingParams(max_new_tokens=0))
    assert lp["token_logprobs"][1:] == pytest.approx(list(s.prompt_logprobs), abs=1e-6)
    for token, value, top, alts in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                                       s.prompt_top_logprobs):  # fmt: skip
        # the 3 most likely, and the token itself when it is not among them (OpenAI's and vLLM's)
        assert 1 <= len(top) <= 4 and top[token] == value and max(top.values()) >= value
        assert max(top.values()) == pytest.approx(alts[0][1], abs=1e-6)


def test_lm_evals_loglikelihood_requests_read_back_as_lm_eval_reads_them(client, engine):
    """lm-eval's `local-completions` loglikelihood payload (token-id prompts, max_tokens 1,
    logprobs 1, echo), parsed by lm-eval's own parse_logprobs: the continuation's summed
    log-prob, and is_greedy true exactly for the greedy continuation."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    context = PROMPT[:4]
    greedy = list(scored(engine, context, top=0).output_ids[:3])
    other = [t + 1 for t in greedy]
    body = {"model": "tiny", "prompt": [context + greedy, context + other], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    out = client.post("/v1/completions", json=body).json()
    for choice in out["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(context) + 3 + 1
    (ll_greedy, is_greedy), (ll_other, other_greedy) = completions.LocalCompletionsAPI.parse_logprobs(
        out, ctxlens=[len(context)] * 2
    )
    assert is_greedy and not other_greedy and ll_greedy > ll_other
    s = scored(engine, context + greedy, top=0, sampling=SamplingParams(max_new_tokens=0))
    assert ll_greedy == pytest.approx(sum(s.prompt_logprobs[len(context) - 1 :]), abs=1e-5)


def test_streamed_top_logprobs_add_up_to_the_whole_answer(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    text = client.post("/v1/completions", json={**body, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    joined = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]] for k in whole}
    assert joined == whole and len(whole["top_logprobs"]) == len(PROMPT) + 6


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "a", "max_tokens": 0}, r"max_tokens must be positive, got 0 \(0 only with echo: true"),
        ({"prompt": "a", "max_tokens": -1, "echo": True}, "max_tokens must be positive, got -1"),
        ({"prompt": "a", "echo": True, "logprobs": 21}, r"logprobs: must be an integer in \[0, 20\].*at most 20"),
        ({"prompt": "a", "logprobs": "1"}, "logprobs: must be an integer"),
    ],
)
def test_bad_scoring_requests_are_openai_400s_naming_the_field(client, body, message):
    r = client.post("/v1/completions", json=body)
    err = r.json()
    assert r.status_code == 400 and err["object"] == "error" and err["code"] == 400, err
    assert re.search(message, err["message"]), err


def test_generate_answers_top_logprobs_num_in_sglangs_shape(client, engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2}  # fmt: skip
    schema.check_generate_request(body)
    out = client.post("/generate", json=body).json()
    schema.check_generate_response(out)
    meta = out["meta_info"]
    s = scored(engine, PROMPT, top=2, sampling=SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    got = meta["output_top_logprobs"]
    assert [[e[1] for e in pos] for pos in got] == [[t for t, _ in a] for a in s.top_logprobs]
    assert [e[0] for pos in got for e in pos] == pytest.approx([v for a in s.top_logprobs for _, v in a], abs=1e-5)
    inputs = meta["input_top_logprobs"]
    assert len(inputs) == len(PROMPT) - 2 and inputs[0] is None
    assert [[e[1] for e in pos] for pos in inputs[1:]] == [[t for t, _ in a] for a in s.prompt_top_logprobs[2:]]
    plain = client.post("/generate", json={**body, "return_logprob": False}).json()["meta_info"]
    assert "output_top_logprobs" not in plain and "input_top_logprobs" not in plain


def test_top_logprobs_cross_the_sglang_wire_both_ways():
    """What the fleet client reads back from a worker's answer is what the worker's engine gave."""
    top = (((5, -0.5), (6, -1.5)), ((7, -0.25), (5, -2.0)))
    sample = Sample(rid="r", index=0, prompt_ids=(1, 2, 3), output_ids=(5, 7), logprobs=(-0.5, -0.25),
                    sampling_logprobs=(-0.5, -0.25), finish_reason=FinishReason("length", length=2),
                    weight_version="v", prompt_logprobs=(-3.0, -4.0), top_logprobs=top,
                    prompt_top_logprobs=(((2, -3.0),), ((9, -1.0),)))  # fmt: skip
    item = wire.generate_item(sample, text=None, return_logprob=True, logprob_start_len=0)
    back = wire.sample_from_item(item, sample.prompt_ids)
    assert back.top_logprobs == top and back.prompt_top_logprobs == sample.prompt_top_logprobs
    assert (
        wire.parse_generate({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 3})
        .requests[0]
        .top_logprobs_num
        == 3
    )


def test_tokenize_and_detokenize_answer_as_sglang_and_vllm_do(client, tokenizer):
    for path in ("/tokenize", "/v1/tokenize"):
        out = client.post(path, json={"prompt": "12+34=46", "add_special_tokens": False}).json()
        ids = tokenizer.encode("12+34=46", add_special_tokens=False)
        assert out == {"tokens": ids, "count": len(ids), "max_model_len": CONTEXT}
    many = client.post("/tokenize", json={"prompt": ["1", "22"]}).json()
    assert many["tokens"] == [tokenizer.encode("1"), tokenizer.encode("22")] and many["count"] == [
        len(t) for t in many["tokens"]
    ]
    for path in ("/detokenize", "/v1/detokenize"):
        back = client.post(path, json={"tokens": ids}).json()
        assert back == {"text": "12+34=46", "prompt": "12+34=46"}
    batch = client.post("/detokenize", json={"tokens": [ids, ids[:2]], "skip_special_tokens": False}).json()
    assert batch["text"] == ["12+34=46", tokenizer.decode(ids[:2])]
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == CONTEXT
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"] == type(tokenizer).__name__
    json.dumps(info)


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/tokenize", {"prompt": 5}, "prompt: required, a string or a list of strings"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens: must be true or false"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages: tokenizing chat messages"),
        ("/detokenize", {"tokens": [1, 10**6]}, r"tokens: token id\(s\) \[1000000\] outside"),
        ("/detokenize", {"tokens": [[1], ["a"]]}, r"tokens\[1\]: must be a list of integer token ids"),
        ("/v1/detokenize", {"tokens": "12"}, "tokens: must be a list of integer token ids"),
    ],
)
def test_bad_tokenizer_requests_are_400_naming_the_field(client, path, body, message):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    text = r.json()["message"] if path.startswith("/v1/") else schema.check_error(r.json())
    assert re.search(message, text), text


def test_without_a_tokenizer_the_tokenizer_routes_say_so(engine):
    with TestClient(make_app(engine, None)) as bare:
        for r in (bare.get("/tokenizer_info"), bare.post("/tokenize", json={"prompt": "a"})):
            assert r.status_code == 400 and "--skip-tokenizer-init" in schema.check_error(r.json())
