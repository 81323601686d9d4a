"""The HTTP app in-process (Starlette's TestClient) over a real LocalEngine on a tiny model:
every endpoint, every kind of bad input, and SGLang's schema on every request and answer.
The same app as a subprocess on loopback is `test_serve_process.py`."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
from starlette.testclient import TestClient

from ptrain.models.safetensors_io import SafetensorsFile, save_file
from ptrain.rollout.protocol import FinishReason, GenerateRequest, Sample, SamplingParams
from ptrain.serve.openai_api import parse_tool_calls
from ptrain.serve.server import LORA_NOT_ENABLED, Detokenizer, cut_at_stop, held_back, make_app
from tests.rollout import sglang_schema as schema
from tests.rollout.conftest import CONTEXT, MAX_RUNNING

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def generate(client, body, status=200):
    """POST /generate with a body SGLang's schema accepts; the answer checked against the schema."""
    schema.check_generate_request(body)
    r = client.post("/generate", json=body)
    assert r.status_code == status, r.text
    if status == 200 and not body.get("stream"):
        n = (body.get("sampling_params") or {}).get("n", 1) if isinstance(body.get("sampling_params"), dict) else 1
        ids = body.get("input_ids", body.get("text"))
        batch = isinstance(ids, list) and ids and isinstance(ids[0], (list, str))
        count = (len(ids) if batch else 1) * n
        schema.check_generate_response(r.json(), count=None if count == 1 and not batch else count)
    return r


def engine_outputs(engine, prompts, **sp):
    reqs = [GenerateRequest(tuple(p), SamplingParams(**sp)) for p in prompts]
    return [[s.output_ids for s in samples] for samples in engine.generate_many(reqs)]


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [100], [7, 7, 7, 8, 9, 10, 11]]


def test_generate_single_and_batch_equal_the_engine(client, engine):
    single = generate(client, {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "rid": "one"}).json()
    assert isinstance(single, dict) and single["meta_info"]["id"] == "one"
    batch = generate(client, {"input_ids": PROMPTS, "sampling_params": GREEDY}).json()
    want = engine_outputs(engine, PROMPTS, **GREEDY)
    assert single["output_ids"] == list(want[0][0])
    assert [x["output_ids"] for x in batch] == [list(w[0]) for w in want]
    assert [x["meta_info"]["prompt_tokens"] for x in batch] == [len(p) for p in PROMPTS]
    assert all(x["meta_info"]["finish_reason"] == {"type": "length", "length": 12} for x in batch)


def test_n_samples_are_prompt_major_and_seeded(client, engine):
    sp = {"max_new_tokens": 6, "n": 3, "sampling_seed": 11, "ignore_eos": True}
    body = {"input_ids": PROMPTS[:2], "sampling_params": sp, "rid": ["p", "q"]}
    out = generate(client, body).json()
    assert [x["meta_info"]["id"] for x in out] == ["p", "p-1", "p-2", "q", "q-1", "q-2"]
    want = engine_outputs(engine, PROMPTS[:2], **sp)
    assert [x["output_ids"] for x in out] == [list(ids) for group in want for ids in group]
    single = generate(client, {"input_ids": PROMPTS[0], "sampling_params": sp}).json()
    assert isinstance(single, list) and [x["output_ids"] for x in single] == [list(i) for i in want[0]]


def test_logprobs_are_the_engines_with_token_texts(client, engine, tokenizer):
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 3, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    meta = generate(client, body).json()["meta_info"]
    (want,) = engine.generate_many(
        [
            GenerateRequest(
                tuple(PROMPTS[1]),
                SamplingParams(max_new_tokens=5, temperature=0.7, sampling_seed=3, ignore_eos=True),
                return_prompt_logprobs_from=0,
            )
        ]
    )[0:1]
    (s,) = want
    assert [e[1] for e in meta["output_token_logprobs"]] == list(s.output_ids)
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(list(s.logprobs), abs=1e-5)
    assert [e[2] for e in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in s.output_ids]
    prompt = meta["input_token_logprobs"]
    assert [e[1] for e in prompt] == PROMPTS[1] and prompt[0][0] is None
    assert [e[0] for e in prompt[1:]] == pytest.approx(list(s.prompt_logprobs), abs=1e-5)
    later = generate(client, {**body, "logprob_start_len": 2}).json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in later] == PROMPTS[1][2:] and later[0][0] is None
    assert [e[0] for e in later[1:]] == pytest.approx([e[0] for e in prompt[3:]], abs=1e-5)


def test_text_prompts_use_the_folders_tokenizer(client, tokenizer):
    out = generate(client, {"text": "1+2=", "sampling_params": GREEDY, "return_prompt_token_ids": True}).json()
    assert out["prompt_token_ids"] == tokenizer.encode("1+2=")
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    batch = generate(client, {"text": ["a", "bb"], "sampling_params": GREEDY}).json()
    assert [x["meta_info"]["prompt_tokens"] for x in batch] == [len(tokenizer.encode(t)) for t in ("a", "bb")]


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body; the last must be [DONE]."""
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    return [json.loads(e) for e in events[:-1]]


def test_stream_is_sse_of_growing_objects_ending_in_done(client):
    body = {"input_ids": PROMPTS[3], "sampling_params": {**GREEDY, "max_new_tokens": 10}, "stream": True}
    r = generate(client, body)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    for c in chunks:
        schema.check_stream_chunk(c)
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 10 and "index" not in chunks[-1]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    final = generate(client, {**body, "stream": False}).json()
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["text"] == final["text"]
    batch = sse_events(generate(client, {**body, "input_ids": PROMPTS[:2], "sampling_params": {**GREEDY, "n": 2}}).text)
    finals = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]


def test_stop_strings_cut_after_the_token_that_completes_them(client, tokenizer):
    base = generate(client, {"input_ids": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": 20}}).json()
    ids = base["output_ids"]
    full = tokenizer.decode(ids)
    k = next(k for k in range(3, len(ids)) if tokenizer.decode(ids[:k]) != tokenizer.decode(ids[: k - 1]))
    stop = tokenizer.decode(ids[:k])[len(tokenizer.decode(ids[: k - 1])) :]
    first = full.find(stop)
    body = {"input_ids": PROMPTS[1], "sampling_params": {**GREEDY, "max_new_tokens": 20, "stop": [stop, "never"]}}
    out = generate(client, body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert ids[: len(out["output_ids"])] == out["output_ids"]
    assert out["text"] == full[:first] and tokenizer.decode(out["output_ids"]).endswith(stop)
    kept = generate(client, {**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}}).json()
    assert kept["text"] == full[:first] + stop
    streamed = sse_events(generate(client, {**body, "stream": True}).text)
    assert streamed[-1]["text"] == out["text"] and streamed[-1]["meta_info"]["finish_reason"]["matched"] == stop


BAD = [
    (b"{not json", "malformed JSON"),
    (b"", "body is empty"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "NaN is not valid JSON"),
    ({"input_ids": "1 2"}, "input_ids: must be a list"),
    ({"input_ids": [1, 2.5]}, "input_ids: must be a list of integer token ids"),
    ({"input_ids": [1, 300]}, r"outside the vocabulary \[0, 300\)"),
    ({"input_ids": [-1]}, "outside the vocabulary"),
    ({"input_ids": [1] * CONTEXT}, f"context length is {CONTEXT}"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "n: must be >= 1"),
    ({"input_ids": [1], "sampling_params": {"n": MAX_RUNNING + 1}}, "exceeds max_running_requests"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0}}, "unknown key"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, r"top_p: must be in \(0, 1\]"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}}, "outside the vocabulary"),
    ({"input_ids": [1], "sampling_params": {"stop": 5}}, "stop: must be a string"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "does not implement"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob: must be true or false"),
    ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
    ({"text": ""}, "tokenises to no tokens"),
]


def test_bad_input_is_400_naming_the_problem_and_the_server_keeps_serving(client):
    for body, message in BAD:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = client.post("/generate", **kw)
        assert r.status_code == 400, (body, r.text)
        text = schema.check_error(r.json())
        assert re.search(message, text), (message, text)
    generate(client, {"input_ids": PROMPTS[0], "sampling_params": GREEDY})


def test_a_body_over_the_limit_is_413(engine, tokenizer):
    with TestClient(make_app(engine, tokenizer, max_request_bytes=2048)) as small:
        r = small.post("/generate", json={"input_ids": list(range(1, 290)) * 3})
        assert r.status_code == 413 and "2048 bytes" in schema.check_error(r.json())
        assert small.post("/generate", json={"input_ids": [1], "sampling_params": GREEDY}).status_code == 200


def test_info_and_health_endpoints(client, served_model_dir, engine):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        schema.check_model_info(info)
        assert info["model_path"] == served_model_dir and info["weight_version"] == engine.weight_version
        assert info["is_generation"] and info["served_model_name"] == "tiny" and info["model_type"] == "qwen3"
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        schema.check_server_info(info)
        assert info["max_running_requests"] == MAX_RUNNING and info["context_length"] == CONTEXT
    loads = client.get("/v1/loads").json()
    assert loads["loads"][0]["max_running_requests"] == MAX_RUNNING and loads["loads"][0]["num_running_reqs"] == 0
    assert "sglang_num_running_reqs" in client.get("/v1/loads?format=prometheus").text
    assert client.get("/v1/loads?dp_rank=3").status_code == 400
    assert client.post("/flush_cache").status_code == 200


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn()), daemon=True)
    thread.start()
    return thread, box


def _wait(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_pause_holds_requests_flush_is_refused_and_abort_ends_them(client):
    body = {"input_ids": PROMPTS[2], "sampling_params": GREEDY, "rid": "held"}
    schema.check_generate_request(body)
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    assert client.get("/health_generate").status_code == 200  # paused on purpose, not stuck
    waiting, box = _in_thread(lambda: client.post("/generate", json=body))
    _wait(lambda: client.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 1)
    r = client.post("/flush_cache")
    assert r.status_code == 400 and "retry" in r.text
    schema.check_abort_request({"rid": "held"})
    assert client.post("/abort_request", json={"rid": "held"}).status_code == 200
    waiting.join(30)
    out = box["result"].json()
    schema.check_generate_response(out)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    # a second held request runs to the end once generation continues
    waiting, box = _in_thread(lambda: client.post("/generate", json={**body, "rid": "later"}))
    _wait(lambda: client.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 1)
    time.sleep(0.2)
    assert waiting.is_alive()
    assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    waiting.join(30)
    schema.check_generate_response(box["result"].json())
    assert box["result"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_abort_all_and_batch_prefix_abort(client):
    client.post("/pause_generation", json={"mode": "retract"})
    batch = {"input_ids": PROMPTS[:2], "sampling_params": GREEDY, "rid": "grp"}
    schema.check_generate_request(batch)
    first, box1 = _in_thread(lambda: client.post("/generate", json=batch))
    other, box2 = _in_thread(lambda: client.post("/generate", json={"input_ids": [9], "sampling_params": GREEDY}))
    _wait(lambda: client.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 3)
    client.post("/abort_request", json={"rid": "grp"})  # SGLang matches rids by prefix: grp_0, grp_1
    first.join(30)
    schema.check_generate_response(box1["result"].json(), count=2)
    assert [x["meta_info"]["finish_reason"]["type"] for x in box1["result"].json()] == ["abort", "abort"]
    assert other.is_alive()
    schema.check_abort_request({"abort_all": True})
    client.post("/abort_request", json={"abort_all": True})
    other.join(30)
    schema.check_generate_response(box2["result"].json())
    assert box2["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    client.post("/continue_generation")


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/update_weights_from_disk", {}, "model_path: required"),
        ("/update_weights_from_disk", {"model_path": "/x", "loadformat": "pt"}, "unknown field"),
        ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "yes"}, "must be true or false"),
        ("/update_weights_from_disk", {"model_path": "/x", "load_format": "pt"}, "safetensors"),
        ("/pause_generation", {"mode": "later"}, "mode: must be one of"),
        ("/abort_request", {"rid": 5}, "rid: must be a string"),
        ("/abort_request", [1], "must be a JSON object"),
    ],
)
def test_bad_control_bodies_are_400(client, path, body, message):
    r = client.post(path, json=body)
    assert r.status_code == 400 and message in schema.check_error(r.json())


def _edited_copy(src: str, dst: str, edit) -> str:
    """src's folder with its tensors edited by `edit(dict)` (config and tokenizer as they are)."""
    shutil.copytree(src, dst)
    tensors = {}
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            f = SafetensorsFile(os.path.join(dst, name))
            tensors.update({k: np.array(f.get(k)) for k in f.keys()})
            os.remove(os.path.join(dst, name))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_a_bad_weights_folder_is_400_and_the_old_weights_keep_serving(
    client, served_model_dir, bad_weights_dir, tmp_path, engine
):
    before = generate(client, {"input_ids": PROMPTS[0], "sampling_params": GREEDY}).json()
    version = engine.weight_version
    missing = _edited_copy(served_model_dir, str(tmp_path / "missing"), lambda t: t.pop("model.norm.weight"))
    ints = _edited_copy(
        served_model_dir, str(tmp_path / "ints"), lambda t: t.update({"model.norm.weight": np.zeros(64, np.int32)})
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, reason in (
        (bad_weights_dir, "d_ff: served 128, new 96"),
        (missing, "model.norm.weight"),
        (ints, "dtype I32"),
        (str(empty), "no config.json"),
    ):
        r = client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "never"})
        body = r.json()
        assert r.status_code == 400 and body["success"] is False and reason in body["message"], body
    assert client.get("/model_info").json()["weight_version"] == version
    after = generate(client, {"input_ids": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == version


# ---- OpenAI-compatible routes ----


def test_models(client):
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list" and listing["data"][0]["id"] == "tiny"
    assert listing["data"][0]["max_model_len"] == CONTEXT
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/other").status_code == 404


def test_completions_equal_generate(client, tokenizer):
    body = {"model": "tiny", "prompt": "1+2=", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = client.post("/v1/completions", json={**body, "n": 2, "logprobs": 0, "return_token_ids": True}).json()
    native = generate(client, {"text": "1+2=", "sampling_params": {**GREEDY, "max_new_tokens": 8}}).json()
    assert out["object"] == "text_completion" and [c["index"] for c in out["choices"]] == [0, 1]
    c = out["choices"][0]
    assert c["token_ids"] == native["output_ids"] and c["text"] == native["text"]
    assert c["prompt_token_ids"] == tokenizer.encode("1+2=") and c["finish_reason"] == "length"
    assert len(c["logprobs"]["token_logprobs"]) == 8 and len(c["logprobs"]["tokens"]) == 8
    assert out["usage"] == {
        "prompt_tokens": len(c["prompt_token_ids"]),
        "completion_tokens": 16,
        "total_tokens": len(c["prompt_token_ids"]) + 16,
        "prompt_tokens_details": {"cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"]},
        "reasoning_tokens": 0,
    }
    assert out["metadata"]["weight_version"] == "default"
    echo = client.post("/v1/completions", json={**body, "echo": True, "logprobs": 0}).json()["choices"][0]
    assert echo["text"] == "1+2=" + native["text"]
    assert echo["logprobs"]["token_logprobs"][0] is None and len(echo["logprobs"]["tokens"]) == 8 + len(
        tokenizer.encode("1+2=")
    )
    ids = client.post("/v1/completions", json={**body, "prompt": [[5, 6, 7], [9]]}).json()
    assert [c["index"] for c in ids["choices"]] == [0, 1]


def test_completions_stream(client):
    body = {"prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = sse_events(
        client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}).text
    )
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert text == whole["text"] and ids == whole["token_ids"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 9


def test_chat_completions(client, tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = client.post("/v1/chat/completions", json={**body, "logprobs": True, "return_token_ids": True}).json()
    choice = out["choices"][0]
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert choice["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert len(choice["response_token_ids"]) == 6 and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(choice["response_token_ids"], skip_special_tokens=True)
    entries = choice["logprobs"]["content"]
    assert len(entries) == 6 and all(isinstance(e["logprob"], float) and e["top_logprobs"] == [] for e in entries)
    assert out["object"] == "chat.completion" and out["usage"]["completion_tokens"] == 6
    chunks = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == choice["message"]["content"] and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_renders_tools_with_the_given_template(engine, tokenizer, tool_template_file):
    with open(tool_template_file) as f:
        template = f.read()
    with TestClient(make_app(engine, tokenizer, chat_template=template)) as c:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        messages = [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        body = {"messages": messages, "tools": tools, "max_tokens": 3, "return_prompt_token_ids": True}
        out = c.post("/v1/chat/completions", json=body).json()
        assert "choices" in out, out
        prompt = tokenizer.decode(out["choices"][0]["prompt_token_ids"])
        assert "<tools>get_weather" in prompt and '<tool_call>{"name": "get_weather"' in prompt and "sunny" in prompt
        assert c.get("/model_info").json()["tool_call_parser"] == "qwen25"
        named = {"type": "function", "function": {"name": "x"}}
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": named})
        assert r.status_code == 400 and "tool_choice.function.name: 'x' is not a declared tool" in r.json()["message"]


def test_tool_calls_are_parsed_from_qwen_blocks():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"prompt": ""}, "Prompt cannot be empty"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens must be positive"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs: must be an integer in [0, 20]"),
        ("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs: must be an integer in [0, 20]"),
        ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs: must be an integer"),
        ("/v1/completions", {"prompt": "a", "frequency_penalty": 1.0}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "a", "temperature": "warm"}, "temperature: must be a number"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt: must be"),
        ("/v1/chat/completions", {"messages": []}, "messages: required"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role: must be one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_openai_errors_use_sglangs_openai_shape(client, path, body, message):
    r = client.post(path, json=body)
    err = r.json()
    assert r.status_code == 400 and err["object"] == "error" and err["code"] == 400, err
    assert message in err["message"], err


def test_openai_routes_want_json_content_type(client):
    r = client.post("/v1/completions", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["message"]


# ---- thinking budget ----

BUDGET = 3
# Nemotron 3 Nano's switches, in miniature: the budget stated in the prompt, and reasoning off
# as a generation prompt that already closed it.
THINK_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if reasoning_budget is defined %}(budget {{ reasoning_budget }}) {% endif %}"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>\n{% endif %}"
    "{%- endif %}"
)


def budgeted(engine, tokenizer, prompt, budget=BUDGET):
    """(the greedy output without a budget, with one), from the engine itself."""
    ends = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    free, forced = (
        engine.generate_many([GenerateRequest(tuple(prompt), SamplingParams(**GREEDY, **kw))])[0][0].output_ids
        for kw in ({}, {"thinking_budget": budget, "think_end_ids": ends})
    )
    assert ends not in [free[i : i + len(ends)] for i in range(budget)], "the model closes its reasoning itself"
    at = [i for i in range(len(forced)) if forced[i : i + len(ends)] == ends]
    assert forced[:budget] == free[:budget] and at and budget - len(ends) < at[0] <= budget, (free, forced)
    return list(free), list(forced)


def test_generate_forces_the_end_of_thinking_after_the_budget(client, engine, tokenizer):
    """SGLang's two spellings; `</think>` is several tokens of the embedded BPE, forced after
    BUDGET tokens (or completed where the model's own tokens already started it)."""
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
    free, forced = budgeted(engine, tokenizer, PROMPTS[1])
    for body in (
        {"input_ids": PROMPTS[1], "sampling_params": {**GREEDY, "custom_params": {"thinking_budget": BUDGET}}},
        {"input_ids": PROMPTS[1], "max_thinking_tokens": BUDGET, "sampling_params": GREEDY},
    ):
        out = generate(client, body).json()
        assert out["output_ids"] == forced and "</think>" in out["text"]
    assert generate(client, {"input_ids": PROMPTS[1], "sampling_params": GREEDY}).json()["output_ids"] == free


def test_openai_routes_force_the_end_of_thinking_after_the_budget(client, engine, tokenizer):
    _, forced = budgeted(engine, tokenizer, PROMPTS[3])
    base = {"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for extra in ({"thinking_budget": BUDGET}, {"custom_params": {"thinking_budget": BUDGET}}):
        out = client.post("/v1/completions", json={**base, **extra}).json()
        assert out["choices"][0]["token_ids"] == forced, out
    messages = [{"role": "user", "content": "think"}]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    _, forced = budgeted(engine, tokenizer, prompt)
    chat = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for extra in (
        {"thinking_budget": BUDGET},
        {"chat_template_kwargs": {"reasoning_budget": BUDGET}},
        {"thinking_budget": BUDGET, "chat_template_kwargs": {"reasoning_budget": BUDGET}},
    ):
        out = client.post("/v1/chat/completions", json={**chat, **extra}).json()
        choice = out["choices"][0]
        assert choice["prompt_token_ids"] == prompt and choice["response_token_ids"] == forced, out
        assert "</think>" in choice["message"]["content"]


def test_chat_reasoning_budget_reaches_the_template_and_reasoning_off_forces_nothing(engine, tokenizer):
    with TestClient(make_app(engine, tokenizer, chat_template=THINK_TEMPLATE)) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        for thinking in (True, False):
            kwargs = {"reasoning_budget": BUDGET, "enable_thinking": thinking}
            choice = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs}).json()["choices"][0]
            prompt = choice["prompt_token_ids"]
            text = tokenizer.decode(prompt)
            assert f"(budget {BUDGET})" in text and text.endswith("<think></think>" if not thinking else "<think>\n")
            free, forced = budgeted(engine, tokenizer, prompt)
            assert choice["response_token_ids"] == (forced if thinking else free)


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", {"thinking_budget": -1}, "thinking_budget: must be >= 0, got -1"),
        ("/v1/completions", {"thinking_budget": "8"}, "thinking_budget: must be an integer, got a string"),
        ("/v1/completions", {"thinking_budget": 2.0}, "thinking_budget: must be an integer, got a number"),
        ("/v1/completions", {"custom_params": {"thinking_budget": -4}}, "custom_params.thinking_budget: must be"),
        ("/v1/completions", {"custom_params": {"other": 1}}, "custom_params: key(s) ['other'] are not implemented"),
        ("/v1/completions", {"custom_params": 5}, "custom_params: must be an object"),
        ("/v1/completions", {"custom_logit_processor": "x"}, "for a thinking budget send thinking_budget"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"reasoning_budget": -2}},
         "chat_template_kwargs.reasoning_budget: must be an integer >= 0"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"reasoning_budget": "low"}},
         "chat_template_kwargs.reasoning_budget: must be an integer >= 0"),
        ("/v1/chat/completions", {"thinking_budget": 3, "chat_template_kwargs": {"reasoning_budget": 4}},
         "thinking budgets disagree"),
        ("/generate", {"max_thinking_tokens": -1}, "max_thinking_tokens: must be an integer >= 0"),
        ("/generate", {"max_thinking_tokens": "many"}, "max_thinking_tokens: must be an integer >= 0"),
        ("/generate", {"sampling_params": {"custom_params": {"thinking_budget": 1.5}}},
         "sampling_params.custom_params.thinking_budget: must be an integer"),
        ("/generate", {"max_thinking_tokens": 2, "sampling_params": {"custom_params": {"thinking_budget": 1}}},
         "disagree"),
    ],
)  # fmt: skip
def test_bad_thinking_budgets_are_400_naming_the_field(client, path, body, message):
    if path == "/generate":
        body = {"input_ids": [5, 6], **body}
    elif path == "/v1/completions":
        body = {"prompt": [5, 6], "max_tokens": 2, **body}
    else:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body}
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    text = r.json()["message"] if path != "/generate" else schema.check_error(r.json())
    assert message in text, text


def test_without_a_tokenizer_a_budget_needs_its_end_ids(engine, tokenizer):
    ends = tokenizer.encode("</think>", add_special_tokens=False)
    _, forced = budgeted(engine, tokenizer, PROMPTS[1])
    with TestClient(make_app(engine, None)) as c:
        body = {"input_ids": PROMPTS[1], "max_thinking_tokens": BUDGET, "sampling_params": GREEDY}
        r = c.post("/generate", json=body)
        assert r.status_code == 400 and "__sglang_reasoning_end_token_ids" in r.json()["error"]["message"]
        sp = {**GREEDY, "custom_params": {"__sglang_reasoning_end_token_ids": ends}}
        assert generate(c, {**body, "sampling_params": sp}).json()["output_ids"] == forced


# ---- server-side helpers ----


def test_stop_cut_and_held_back_text(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tuple(tokenizer.encode("abc def ghi"))
    sample = Sample("r", 0, (1,), ids, (-1.0,) * len(ids), (-1.0,) * len(ids), FinishReason("abort"), "v")
    cut, stop = cut_at_stop(sample, ["def", "zzz"], detok)
    assert stop == "def" and tokenizer.decode(cut.output_ids).endswith("def")
    assert len(cut.logprobs) == len(cut.output_ids) and cut.finish_reason == FinishReason("stop")
    assert cut_at_stop(sample, ["zzz"], detok) is None
    assert held_back("hello </to", ["</tool>"]) == 4 and held_back("hello", ["xyz"]) == 0


def test_lora_on_a_server_without_it_says_how_to_turn_it_on(client):
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/no/such"})
    assert r.status_code == 400
    assert r.json() == {"success": False, "error_message": LORA_NOT_ENABLED, "loaded_adapters": None}
    assert client.post("/unload_lora_adapter", json={"lora_name": "a"}).json()["error_message"] == LORA_NOT_ENABLED
    r = generate(client, {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "a"}, 400)
    assert "lora_path: LoRA adapter 'a' was requested, but this server serves no LoRA adapters; start it with " \
        "--enable-lora" in schema.check_error(r.json())  # fmt: skip
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "lora_path": "a"}
    assert "--enable-lora" in client.post("/v1/completions", json=body).json()["message"]
    # without LoRA a model name is only a label, `<base>:<adapter>` included (as before)
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "model": "tiny:a"}
    assert client.post("/v1/completions", json=body).status_code == 200
    info = client.get("/server_info").json()
    assert info["enable_lora"] is False and info["lora_paths"] is None
