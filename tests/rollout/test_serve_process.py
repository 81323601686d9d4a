"""`python -m ptrain.serve` started as a user starts it, a subprocess on a loopback port, and
driven over real HTTP: 64 concurrent clients, streaming, weight updates from disk, pause,
abort, flush, bad input, and SIGTERM draining the requests in flight. One server for the
module (one set of compiles); every request and answer goes through SGLang's schema."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from ptrain.rollout.local import LocalEngine
from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from tests.rollout import sglang_schema as schema
from tests.rollout.conftest import CONTEXT, MAX_RUNNING

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = CONTEXT - 4  # output tokens that fill a row after a 3-token prompt


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, log_path: str, *extra: str, env: dict | None = None) -> Server:
    """`python -m ptrain.serve` on a free loopback port, once /health answers 200."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "ptrain.serve", "--model-path", model_dir, "--port", str(port),
        "--max-running-requests", str(MAX_RUNNING), "--context-length", str(CONTEXT),
        "--served-model-name", "tiny", "--graceful-shutdown-timeout", "30", *extra,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{srv.log()}")
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return srv
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not become healthy:\n{srv.log()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(served_model_dir, tmp_path_factory):
    srv = start_server(served_model_dir, str(tmp_path_factory.mktemp("serve") / "server.log"))
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(30)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(served_model_dir):
    """The in-process engine on the same folder, for what the server's answers must equal."""
    eng = LocalEngine.from_hf(served_model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT)
    yield eng
    eng.close()


def post_generate(http, body, status=200):
    schema.check_generate_request(body)
    r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    if status == 200:
        schema.check_generate_response(r.json())
    return r.json()


def test_the_server_answers_as_sglang_does(http, served_model_dir):
    info = http.get("/model_info").json()
    schema.check_model_info(info)
    assert info["model_path"] == served_model_dir and info["served_model_name"] == "tiny"
    server_info = http.get("/server_info").json()
    schema.check_server_info(server_info)
    assert server_info["port"] == int(http.base_url.port) and server_info["max_running_requests"] == MAX_RUNNING
    assert http.get("/health_generate").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_64_concurrent_clients_each_get_their_own_answer(server, reference):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 300, rng.integers(2, 24)).tolist() for _ in range(64)]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    bodies = [{"input_ids": p, "sampling_params": sp, "rid": f"client-{i}"} for i, p in enumerate(prompts)]
    for b in bodies:
        schema.check_generate_request(b)

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(c.post("/generate", json=b) for b in bodies))

    answers = asyncio.run(run())
    want = reference.generate_many([GenerateRequest(tuple(p), SamplingParams(**sp)) for p in prompts])
    for i, (r, (sample,)) in enumerate(zip(answers, want)):
        assert r.status_code == 200, r.text
        body = r.json()
        schema.check_generate_response(body)
        assert body["meta_info"]["id"] == f"client-{i}" and body["meta_info"]["prompt_tokens"] == len(prompts[i])
        assert body["output_ids"] == list(sample.output_ids), f"client {i} got another request's continuation"


def stream_lines(http, body, on_chunk=None) -> list[dict]:
    """POST a streaming /generate and collect its SSE objects (calling on_chunk on each)."""
    schema.check_generate_request(body)
    chunks = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        done = False
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            schema.check_stream_chunk(chunk)
            chunks.append(chunk)
            if on_chunk:
                on_chunk(chunk)
    assert done, "the stream did not end with data: [DONE]"
    return chunks


def test_streaming_over_http(http):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    chunks = stream_lines(http, {**body, "stream": True})
    assert len(chunks) > 1 and [len(c["output_ids"]) for c in chunks][-1] == 40
    assert chunks[-1]["output_ids"] == post_generate(http, body)["output_ids"]


def test_pause_holds_a_running_stream_and_abort_returns_its_partial_tokens(http, server):
    body = {
        "input_ids": [9, 10, 11],
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
        "stream": True,
        "rid": "victim",
    }
    paused = threading.Event()
    seen: list[int] = []

    def pause_on_first(chunk):
        seen.append(len(chunk["output_ids"]))
        if not paused.is_set():
            with httpx.Client(base_url=server.url, timeout=30) as c:
                assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            paused.set()

    def read():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            result["chunks"] = stream_lines(c, body, pause_on_first)

    result: dict = {}
    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert paused.wait(60)
        time.sleep(0.3)  # chunks sent before the pause took hold arrive meanwhile
        load = http.get("/v1/loads").json()["loads"][0]
        assert load["num_running_reqs"] == 1, "the request finished before the pause; the engine beat HTTP"
        count = len(seen)
        time.sleep(0.5)
        assert len(seen) == count, "tokens arrived while generation was paused"
        schema.check_abort_request({"rid": "victim"})
        assert http.post("/abort_request", json={"rid": "victim"}).status_code == 200
        reader.join(60)
    finally:
        assert http.post("/continue_generation", json={}).status_code == 200
        reader.join(60)
    final = result["chunks"][-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(final["output_ids"]) < LONG and final["meta_info"]["completion_tokens"] == len(final["output_ids"])
    again = post_generate(http, {**body, "stream": False, "rid": "after"})
    assert again["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}


def test_a_client_that_hangs_up_has_its_request_aborted(http, server):
    """Generation paused, so the requests wait in the engine's queue; a client that gives up
    (non-streaming or streaming) takes its request out of the queue with it."""
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    try:

        def waiting() -> int:
            return http.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"]

        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 8}}
        schema.check_generate_request(body)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/generate", json=body, timeout=httpx.Timeout(30, read=1.0))
        deadline = time.monotonic() + 10
        while waiting() != 0:
            assert time.monotonic() < deadline, "the abandoned request stayed queued"
            time.sleep(0.05)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                deadline = time.monotonic() + 10
                while waiting() != 1:
                    assert time.monotonic() < deadline, "the streamed request never queued"
                    time.sleep(0.05)
        deadline = time.monotonic() + 10
        while waiting() != 0:
            assert time.monotonic() < deadline, "the abandoned stream stayed queued"
            time.sleep(0.05)
    finally:
        assert http.post("/continue_generation").status_code == 200


def test_weight_update_from_disk_swaps_and_a_bad_folder_keeps_the_old_weights(
    http, served_model_dir, other_weights_dir, bad_weights_dir
):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": [20, 21, 22, 23], "sampling_params": sp, "return_logprob": True}

    def logprobs(answer):
        return [e[0] for e in answer["meta_info"]["output_token_logprobs"]]

    before = post_generate(http, body)
    r = http.post("/update_weights_from_disk", json={"model_path": other_weights_dir, "weight_version": "v2"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    info = http.get("/model_info").json()
    assert info["weight_version"] == "v2" and info["model_path"] == other_weights_dir
    after = post_generate(http, body)
    assert after["meta_info"]["weight_version"] == "v2"
    assert logprobs(after) != pytest.approx(logprobs(before), abs=1e-3), "the new weights give the same outputs"
    r = http.post("/update_weights_from_disk", json={"model_path": bad_weights_dir, "weight_version": "v3"})
    assert r.status_code == 400 and r.json()["success"] is False and "d_ff" in r.json()["message"]
    assert http.get("/model_info").json()["weight_version"] == "v2"
    still = post_generate(http, body)
    assert still["output_ids"] == after["output_ids"] and logprobs(still) == pytest.approx(logprobs(after), abs=1e-5)
    r = http.post("/update_weights_from_disk", json={"model_path": served_model_dir, "abort_all_requests": True})
    assert r.status_code == 200, r.text
    restored = post_generate(http, body)
    assert restored["meta_info"]["weight_version"] not in ("default", "v2")
    assert restored["output_ids"] == before["output_ids"]
    assert logprobs(restored) == pytest.approx(logprobs(before), abs=1e-5)


def test_bad_input_over_http_and_the_server_keeps_serving(http):
    assert (
        http.post("/generate", content=b'{"input_ids": [1,', headers={"content-type": "application/json"}).status_code
        == 400
    )
    big = b'{"input_ids": [' + b"1," * (5 << 20) + b"1]}"  # 10 MB, over the 8 MiB default
    r = http.post("/generate", content=big)
    assert r.status_code == 413 and "limit" in schema.check_error(r.json())
    r = http.post("/generate", json={"input_ids": [1], "sampling_params": {"n": 0}})
    assert r.status_code == 400 and "n: must be >= 1" in schema.check_error(r.json())
    assert http.post("/flush_cache").status_code == 200
    post_generate(http, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})


def test_the_thinking_budget_over_http(http, reference, served_model_dir):
    """`max_thinking_tokens` on /generate and `thinking_budget` on /v1/chat/completions: the
    server forces its tokenizer's `</think>` after 3 tokens, as the engine does with those ids."""
    from ptrain.serve.server import load_tokenizer

    tokenizer = load_tokenizer(served_model_dir)
    ends = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    messages = [{"role": "user", "content": "think"}]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    want = reference.generate_many(
        [GenerateRequest(tuple(prompt), SamplingParams(**greedy, thinking_budget=3, think_end_ids=ends))]
    )[0][0].output_ids
    # completed at token 3 + len(ends) at the latest (sooner where the model's own tokens began it)
    assert ends in [want[i : i + len(ends)] for i in range(max(0, 4 - len(ends)), 4)]
    out = post_generate(http, {"input_ids": prompt, "max_thinking_tokens": 3, "sampling_params": greedy})
    assert tuple(out["output_ids"]) == want
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    chat = http.post("/v1/chat/completions", json={**body, "thinking_budget": 3}).json()
    assert (
        tuple(chat["choices"][0]["response_token_ids"]) == want
        and "</think>" in chat["choices"][0]["message"]["content"]
    )
    r = http.post("/v1/chat/completions", json={**body, "thinking_budget": -1})
    assert r.status_code == 400 and "thinking_budget: must be >= 0" in r.json()["message"]


def test_tp_size_shards_the_model_over_the_mesh_tensor_axis(served_model_dir, http, tmp_path):
    """--tp-size 2 over two host devices: the same greedy tokens and log-probs as one device."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"))
    srv = start_server(served_model_dir, str(tmp_path / "tp.log"), "--tp-size", "2", env=env)
    try:
        body = {
            "input_ids": [[5, 6, 7], [20, 21, 22, 23]],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }
        schema.check_generate_request(body)
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            sharded = c.post("/generate", json=body).json()
            schema.check_generate_response(sharded, count=2)
            info = c.get("/server_info").json()
            assert info["tp_size"] == 2 and c.get("/v1/loads").json()["num_accelerators"] == 2
        single = post_generate(http, body)
        for a, b in zip(sharded, single):
            assert a["output_ids"] == b["output_ids"]
            lp = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
            assert lp == pytest.approx([e[0] for e in b["meta_info"]["output_token_logprobs"]], abs=1e-4)
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log()


def test_the_real_sglang_router_routes_to_the_server(server, http, tmp_path):
    """sglang-router 0.3.2 in front of the server: it reads /server_info and /model_info,
    health-checks /health, and forwards /generate and OpenAI requests."""
    pytest.importorskip("sglang_router", reason="pip install sglang-router==0.3.2")
    port, metrics = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server.url, "--port", str(port),
        "--prometheus-port", str(metrics), "--log-level", "warn",
    ]  # fmt: skip
    with open(tmp_path / "router.log", "w") as log:
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            try:
                workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
                if workers and workers[0]["is_healthy"]:
                    break
            except (httpx.TransportError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, "the router never saw a healthy worker"
            time.sleep(0.5)
        assert workers[0]["url"] == server.url and workers[0]["metadata"]["served_model_name"] == "tiny"
        body = {"input_ids": [[5, 6, 7], [8]], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        schema.check_generate_request(body)
        routed = httpx.post(url + "/generate", json=body, timeout=60)
        assert routed.status_code == 200, routed.text
        schema.check_generate_response(routed.json(), count=2)
        direct = post_generate(http, body)
        assert [x["output_ids"] for x in routed.json()] == [x["output_ids"] for x in direct]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        router.terminate()
        router.wait(30)


def test_sigterm_drains_requests_in_flight_then_exits(server):
    """Last in this module: it stops the server."""
    sp = {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}
    bodies = [{"input_ids": [30 + i, 31, 32], "sampling_params": sp} for i in range(4 * MAX_RUNNING)]
    for b in bodies:
        schema.check_generate_request(b)
    answers: list = []

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            answers.extend(await asyncio.gather(*(c.post("/generate", json=b) for b in bodies)))

    clients = threading.Thread(target=lambda: asyncio.run(run()))
    clients.start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        end = time.monotonic() + 60
        while c.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 0:
            assert time.monotonic() < end, "the requests never queued"
    server.proc.send_signal(signal.SIGTERM)
    clients.join(120)
    assert len(answers) == len(bodies)
    for r in answers:
        assert r.status_code == 200, r.text
        body = r.json()
        schema.check_generate_response(body)
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    assert server.proc.wait(60) == 0, server.log()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
