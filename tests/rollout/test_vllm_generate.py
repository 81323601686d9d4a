"""vLLM's `POST /inference/v1/generate` (`ptrain.serve.vllm_api`): in-process over a real
LocalEngine on the tiny model, and once through a `python -m ptrain.serve` subprocess.

Answers are checked two ways: against vLLM's response model, as a schema written from reading
`vllm/entrypoints/serve/disagg/protocol.py` (GenerateResponse, GenerateResponseChoice) and
`vllm/entrypoints/openai/chat_completion/protocol.py` (ChatCompletionLogProbs) at vllm-project/vllm
commit 06408932946d17ad6453126aca82ea96c4509605 (vLLM itself needs CUDA torch, so it is not
installed); and, where verifiers is installed, through its client's own strict log-prob parser
(`renderers.client._parse_completion_logprobs`, what `TrainClient` runs on every answer)."""

from __future__ import annotations

import math

import httpx
import pytest

from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from tests.rollout.conftest import CONTEXT

ROUTE = "/inference/v1/generate"
PROMPT = [5, 6, 7, 8]


def check_vllm_response(data: dict, n: int = 1) -> None:
    """vLLM's GenerateResponse, field by field (module docstring)."""
    assert isinstance(data["request_id"], str) and data["request_id"]
    assert isinstance(data["choices"], list) and len(data["choices"]) == n
    for choice in data["choices"]:
        assert set(choice) >= {"index", "token_ids", "finish_reason", "logprobs"}
        assert isinstance(choice["index"], int)
        assert all(isinstance(t, int) for t in choice["token_ids"])
        assert choice["finish_reason"] is None or isinstance(choice["finish_reason"], str)
        lp = choice["logprobs"]
        if lp is not None:
            assert isinstance(lp["content"], list) and len(lp["content"]) == len(choice["token_ids"])
            for entry in lp["content"]:
                assert isinstance(entry["token"], str) and isinstance(entry["logprob"], float)
                assert entry.get("bytes") is None or isinstance(entry["bytes"], list)
                for top in entry.get("top_logprobs", []):
                    assert isinstance(top["token"], str) and isinstance(top["logprob"], float)
    assert data.get("prompt_logprobs") is None or isinstance(data["prompt_logprobs"], list)
    assert data.get("kv_transfer_params") is None or isinstance(data["kv_transfer_params"], dict)


def client_logprobs(choice: dict) -> list[float]:
    """The log-probs as verifiers' train client reads them (it raises on anything malformed);
    without verifiers installed, the same checks as written in its parser."""
    try:
        from renderers.client import _parse_completion_logprobs
    except ImportError:
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"])
        for entry, tok in zip(content, choice["token_ids"]):
            assert entry["token"] == f"token_id:{tok}"
            assert math.isfinite(entry["logprob"]) and entry["logprob"] != -9999.0
        return [entry["logprob"] for entry in content]
    return _parse_completion_logprobs(choice, choice["token_ids"])


def engine_samples(engine, prompt, **sp):
    return engine.generate_many([GenerateRequest(tuple(prompt), SamplingParams(**sp))])[0]


def test_greedy_tokens_and_logprobs_equal_the_engine(client, engine):
    body = {
        "model": "tiny",
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 1},
    }
    r = client.post(ROUTE, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    check_vllm_response(data)
    (want,) = engine_samples(engine, PROMPT, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    choice = data["choices"][0]
    assert choice["token_ids"] == list(want.output_ids)
    assert choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in want.output_ids]
    assert client_logprobs(choice) == pytest.approx(list(want.logprobs), abs=1e-5)
    # logprobs: 1 lists the most likely token beside each sampled one; greedy: it is the sampled one
    for entry in choice["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 1 and entry["top_logprobs"][0]["token"] == entry["token"]
    assert data["prompt_token_ids"] == PROMPT and data["usage"]["completion_tokens"] == 8


def test_sampled_with_string_seed_and_n_equal_the_engine_under_the_tempered_softmax(client, engine):
    # what verifiers' TrainClient sends: --sampling.seed arrives as a string, plus its own keys
    sp = {
        "temperature": 0.7, "top_p": 0.9, "max_tokens": 6, "seed": "7", "n": 2, "stop_token_ids": [0],
        "logprobs": 1, "skip_special_tokens": False, "routed_experts_prompt_start": 3,
    }  # fmt: skip
    r = client.post(ROUTE, json={"model": "tiny", "token_ids": PROMPT, "sampling_params": sp, "priority": 0})
    assert r.status_code == 200, r.text
    data = r.json()
    check_vllm_response(data, n=2)
    want = engine_samples(
        engine, PROMPT, max_new_tokens=6, temperature=0.7, top_p=0.9, sampling_seed=7, n=2, stop_token_ids=(0,)
    )
    for choice, sample in zip(data["choices"], want):
        assert choice["index"] == sample.index and choice["token_ids"] == list(sample.output_ids)
        assert client_logprobs(choice) == pytest.approx(list(sample.logprobs), abs=1e-5)
        assert all(math.isfinite(x) for x in client_logprobs(choice))


def test_without_logprobs_and_max_tokens(client):
    r = client.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": {"temperature": 0}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None
    # no max_tokens: a sample may fill the context, as vLLM defaults it
    assert choice["finish_reason"] == "stop" or len(choice["token_ids"]) == CONTEXT - len(PROMPT)


@pytest.mark.parametrize(
    "body, status, words",
    [
        ([1, 2], 400, ["JSON object"]),
        ({"sampling_params": {}}, 400, ["token_ids", "required"]),
        ({"token_ids": [], "sampling_params": {}}, 400, ["token_ids", "empty"]),
        ({"token_ids": ["a"], "sampling_params": {}}, 400, ["token_ids", "integer"]),
        ({"token_ids": [10**6], "sampling_params": {}}, 400, ["token_ids", "vocabulary"]),
        ({"token_ids": PROMPT}, 400, ["sampling_params", "required"]),
        ({"token_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}, 400, ["unknown", "max_new_tokens"]),
        ({"token_ids": PROMPT, "sampling_params": {"seed": "seven"}}, 400, ["sampling_params.seed", "integer"]),
        ({"token_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, 400, ["temperature", "number"]),
        ({"token_ids": PROMPT, "sampling_params": {"temperature": -1}}, 400, ["temperature", ">= 0"]),
        ({"token_ids": PROMPT, "sampling_params": {"top_p": 0}}, 400, ["top_p", "(0, 1]"]),
        ({"token_ids": PROMPT, "sampling_params": {"top_k": -2}}, 400, ["top_k", "off"]),
        ({"token_ids": PROMPT, "sampling_params": {"n": 0}}, 400, ["sampling_params.n", ">= 1"]),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 0}}, 400, ["max_tokens", ">= 1"]),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 10**4}}, 400, ["max_tokens", "at most"]),
        ({"token_ids": PROMPT, "sampling_params": {"logprobs": 99}}, 400, ["logprobs", "[0, 20]"]),
        ({"token_ids": PROMPT, "sampling_params": {"stop": ["x"]}}, 400, ["stop", "stop_token_ids"]),
        ({"token_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.2}}, 400, ["repetition_penalty"]),
        ({"token_ids": PROMPT, "sampling_params": {"stop_token_ids": [10**6]}}, 400, ["stop_token_ids", "vocab"]),
        ({"token_ids": PROMPT, "sampling_params": {}, "stream": True}, 400, ["stream", "false"]),
        ({"token_ids": PROMPT, "sampling_params": {}, "priority": 3}, 400, ["priority", "0"]),
        ({"token_ids": PROMPT, "sampling_params": {}, "features": {"x": 1}}, 400, ["features", "multimodal"]),
        ({"token_ids": PROMPT, "sampling_params": {}, "model": "other"}, 404, ["other", "does not exist", "tiny"]),
        ({"token_ids": [1] * CONTEXT, "sampling_params": {}}, 400, ["token_ids", "context"]),
    ],
)
def test_bad_input_is_a_vllm_shaped_error_naming_the_field(client, body, status, words):
    r = client.post(ROUTE, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and isinstance(error["type"], str)
    for word in words:
        assert word in error["message"], error["message"]
    # the server keeps serving
    ok = client.post(ROUTE, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}})
    assert ok.status_code == 200


def test_malformed_json_and_wrong_method(client):
    r = client.post(ROUTE, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert client.get(ROUTE).status_code == 405


def test_through_a_server_process(served_model_dir, tmp_path, engine):
    from tests.rollout.test_serve_process import start_server

    srv = start_server(served_model_dir, str(tmp_path / "server.log"))
    try:
        sp = {"temperature": 1.0, "max_tokens": 5, "seed": 3, "logprobs": 1, "skip_special_tokens": False}
        r = httpx.post(srv.url + ROUTE, json={"model": "tiny", "token_ids": PROMPT, "sampling_params": sp}, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        check_vllm_response(data)
        (want,) = engine_samples(engine, PROMPT, max_new_tokens=5, temperature=1.0, sampling_seed=3)
        choice = data["choices"][0]
        assert choice["token_ids"] == list(want.output_ids)
        assert client_logprobs(choice) == pytest.approx(list(want.logprobs), abs=1e-5)
        bad = httpx.post(srv.url + ROUTE, json={"token_ids": PROMPT, "sampling_params": {"seed": 1.5}}, timeout=30)
        assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]
    finally:
        srv.proc.kill()
        srv.proc.wait(30)
