"""`rollout=sglang` against real parts: three `python -m ptrain.serve` workers started as a
user starts them, the real sglang-router (0.3.x, a Rust binary) in front of them, and
FleetEngine in this process. Registration, round robin, the same tokens and log-probs as the
in-process engine, weight pushes checked on every worker, an export killed halfway, a worker
SIGKILLed mid-rollout, one answering 503 and one hanging, a resumed run's re-push, and the
GRPO stage end to end through two workers behind the router.

Faults come from `FaultProxy`, an HTTP proxy in front of two of the workers (the third is
reached directly, so that its SIGKILL is a real dead socket): a test flips a proxy to answer
503 or to hold requests unanswered, which is what a client and the router see of an
overloaded or hung worker, without restarting a worker (40 s of compiles on 2 cores) and
without test-only options in the server. The proxies also record every /generate body and
answer, which are checked against SGLang's own schema."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
import uvicorn

from ptrain.models import load_hf
from ptrain.rollout.fleet import FleetEngine, FleetUnavailable
from ptrain.rollout.local import LocalEngine, eos_ids_of
from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from ptrain.rollout.weight_sync import WeightSyncError, list_versions, read_manifest, version_folder
from ptrain.train.state import split_model
from tests.rollout import sglang_schema as schema
from tests.rollout.conftest import CONTEXT, MAX_RUNNING, TINY
from tests.stages.test_grpo import SCRIPT as GRPO_SCRIPT
from tests.stages.test_grpo import TINY as GRPO_TINY

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUTER = [sys.executable, "-m", "sglang_router.launch_router"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def get_json(url: str, timeout: float = 10) -> dict:
    r = httpx.get(url, timeout=timeout)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:500]}"
    return r.json()


# ----------------------------------------------------------------------------- processes


@dataclass
class Proc:
    cmd: list[str]
    log_path: str
    url: str
    proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def wait_healthy(self, timeout: float = 600) -> None:
        def up():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.cmd[:4]} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout, f"{self.url} to answer /health")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def worker(model_dir: str, log_dir, port: int | None = None) -> Proc:
    port = port or free_port()
    cmd = [
        sys.executable, "-m", "ptrain.serve", "--model-path", model_dir, "--port", str(port),
        "--max-running-requests", str(MAX_RUNNING), "--context-length", str(CONTEXT), "--skip-tokenizer-init",
    ]  # fmt: skip
    return Proc(cmd, str(log_dir / f"worker-{port}.log"), f"http://127.0.0.1:{port}")


def router(log_dir) -> Proc:
    port = free_port()
    cmd = ROUTER + [
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--health-check-interval-secs", "2", "--request-timeout-secs", "120", "--log-level", "warn",
    ]  # fmt: skip
    return Proc(cmd, str(log_dir / f"router-{port}.log"), f"http://127.0.0.1:{port}")


# ----------------------------------------------------------------------------- fault proxy


@dataclass
class FaultProxy:
    """An HTTP proxy in front of one worker. mode "pass" forwards; "503" answers 503 Service
    Unavailable; "hang" holds each request unanswered until the mode changes back (then
    forwards it, as a worker that recovers finishes its work). `only` limits the fault to
    some paths. Every POST body is recorded by path, and every /generate with its answer."""

    upstream: str
    port: int = field(default_factory=free_port)
    mode: str = "pass"
    only: tuple[str, ...] = ()
    counts: collections.Counter = field(default_factory=collections.Counter)
    generate_log: list = field(default_factory=list)
    bodies: collections.defaultdict = field(default_factory=lambda: collections.defaultdict(list))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fault(self, path: str) -> str:
        return self.mode if not self.only or path in self.only else "pass"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if not path.startswith("/"):  # the router's HTTP/2 probe ("PRI *"): not for a worker
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        while self.fault(path) == "hang":
            await asyncio.sleep(0.05)
        if self.fault(path) == "503":
            self.counts[f"503 {path}"] += 1
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"injected fault: 503"})
            return
        self.counts[path] += 1
        if scope["method"] == "POST" and body:
            self.bodies[path].append(json.loads(body))
        url = self.upstream + path + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        try:
            async with httpx.AsyncClient(timeout=None) as c:
                r = await c.request(scope["method"], url, content=body, headers=headers)
        except httpx.TransportError:
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b"bad gateway"})
            return
        if path == "/generate" and r.status_code == 200:
            self.generate_log.append((json.loads(body), r.json()))
        ctype = r.headers.get("content-type", "application/json").encode()
        await send({"type": "http.response.start", "status": r.status_code, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": r.content})

    def start(self) -> FaultProxy:
        config = uvicorn.Config(self, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, 30, "the proxy to listen")
        return self

    def stop(self) -> None:
        self.mode = "pass"
        self._server.should_exit = True
        self._thread.join(10)


# ----------------------------------------------------------------------------- fixtures


@dataclass
class Fleet:
    workers: list[Proc]
    proxies: list[FaultProxy | None]
    router: Proc

    @property
    def urls(self) -> list[str]:
        """What the client and the router know the workers as (a proxy's URL where there is one)."""
        return [p.url if p else w.url for w, p in zip(self.workers, self.proxies)]


@pytest.fixture(scope="module")
def fleet(served_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-logs")
    workers = [worker(served_model_dir, logs).start() for _ in range(3)]
    rt = router(logs).start()
    proxies: list[FaultProxy | None] = [None] + [FaultProxy(w.url).start() for w in workers[1:]]
    try:
        for w in workers:
            w.wait_healthy()
        rt.wait_healthy(60)
        yield Fleet(workers, proxies, rt)
    finally:
        for p in proxies:
            if p:
                p.stop()
        rt.stop()
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def served(served_model_dir):
    model = load_hf(served_model_dir)
    model_def, params, model_state = split_model(model)
    return model.cfg, params, model_state


@pytest.fixture(scope="module")
def other_params(other_weights_dir):
    return split_model(load_hf(other_weights_dir))[1]


FAST = dict(health_interval_s=1.0, health_timeout_s=6.0, probe_backoff_s=0.5, probe_backoff_max_s=2.0,
            retry_backoff_s=0.1, weight_dtype="float32")  # fmt: skip


@pytest.fixture(scope="module")
def engine(fleet, served, served_model_dir, tmp_path_factory):
    """The client through the router, exporting float32 (so its log-probs equal the trainer's)."""
    eng = FleetEngine(
        urls=fleet.urls, router_url=fleet.router.url, model_cfg=served[0],
        weight_dir=str(tmp_path_factory.mktemp("weights")), eos_token_ids=eos_ids_of(served_model_dir),
        request_timeout_s=120.0, unhealthy_timeout_s=120.0, **FAST,
    )  # fmt: skip
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(served_model_dir):
    eng = LocalEngine.from_hf(served_model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT)
    yield eng
    eng.close()


def requests(count: int, *, max_new_tokens: int = 8, n: int = 1, temperature: float = 0.0, tag: str = "r"):
    rng = np.random.default_rng(count + max_new_tokens)
    return [
        GenerateRequest(
            tuple(int(t) for t in rng.integers(4, 290, rng.integers(2, 12))),
            SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, n=n, sampling_seed=100 + i, ignore_eos=True
            ),
            rid=f"{tag}/task-{i}",
        )  # fmt: skip
        for i in range(count)
    ]


def assert_same_samples(got, want, *, atol: float = 1e-4) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [s.index for s in g] == list(range(len(w)))
        for a, b in zip(g, w):
            assert a.output_ids == b.output_ids, f"{a.rid}[{a.index}]: different tokens"
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, err_msg=f"{a.rid}[{a.index}]")
            assert a.finish_reason == b.finish_reason


def router_lists_all(fleet) -> list[dict]:
    """The router's workers once it lists every one healthy (the client registers them; the
    router adds them in the background)."""

    def listed():
        workers = get_json(fleet.router.url + "/workers")["workers"]
        ok = sorted(w["url"] for w in workers if w["is_healthy"]) == sorted(fleet.urls)
        return workers if ok else None

    return wait_until(listed, 60, "the router to list every worker healthy")


def settle(engine) -> None:
    """Until every worker is in service: a worker compiling a new shape (the first time a test
    uses it) can miss two probes and sit out a few seconds; pushes skip such a worker."""
    wait_until(lambda: all(w["in_service"] for w in engine.info()["workers"]), 120, "every worker in service")


def model_version(url: str) -> str:
    info = get_json(url + "/model_info")
    schema.check_model_info(info)
    return info["weight_version"]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout=sglang"], "rollout.urls"),
        (["rollout=sglang", "rollout.urls=[http://a:1,ftp://b:2]"], "rollout.urls[1]"),
        (["rollout=sglang", "rollout.urls=[http://a:1,http://a:1]"], "rollout.urls"),
        (["rollout=sglang", "rollout.router_url=localhost:30000"], "rollout.router_url"),
        (
            ["rollout=sglang", "rollout.router_url=http://r:1", "rollout.weight_push_mode=fast"],
            "rollout.weight_push_mode",
        ),
        (
            ["rollout=sglang", "rollout.router_url=http://r:1", "rollout.health_interval_s=0"],
            "rollout.health_interval_s",
        ),
        (
            ["rollout=sglang", "rollout.router_url=http://r:1", "rollout.probe_backoff_max_s=0.1"],
            "rollout.probe_backoff_max_s",
        ),
    ],
)
def test_fleet_config_mistakes_name_the_key(overrides, key):
    from hydra import compose, initialize_config_module

    from ptrain.config import register_configs, to_run_config
    from ptrain.config.run import ConfigError

    register_configs()
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
            to_run_config(compose(config_name="config", overrides=overrides))


def test_no_healthy_worker_fails_with_every_url_and_its_answer():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    eng = FleetEngine(urls=dead, unhealthy_timeout_s=2.0, **FAST)
    try:
        future = eng.submit(requests(1)[0])
        with pytest.raises(FleetUnavailable) as e:
            future.result(30)
        for url in dead:
            assert url in str(e.value)
        assert "connection failed" in str(e.value) and set(e.value.answers) == set(dead)
        with pytest.raises(FleetUnavailable):
            eng.submit(requests(1)[0])
    finally:
        eng.close()


def test_the_router_registers_the_workers_and_round_robins(fleet, engine):
    for url in fleet.urls:  # compile these shapes everywhere first: a compiling worker stalls its probes
        body = {"input_ids": list(range(5, 15)), "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        assert httpx.post(url + "/generate", json=body, timeout=300).status_code == 200
    wait_until(lambda: all(w["in_service"] for w in engine.info()["workers"]), 60, "every worker in service")
    listed = router_lists_all(fleet)
    assert sorted(w["url"] for w in listed) == sorted(fleet.urls) and all(w["is_healthy"] for w in listed)
    before = [p.counts["/generate"] for p in fleet.proxies if p]
    logged = [len(p.generate_log) for p in fleet.proxies if p]
    for r in requests(9, tag="rr"):  # one at a time: round robin gives each worker every third
        engine.submit(r).result(120)
    after = [p.counts["/generate"] for p in fleet.proxies if p]
    assert [b - a for a, b in zip(before, after)] == [3, 3], "round robin over three workers"
    traffic = [x for p, k in zip([p for p in fleet.proxies if p], logged) for x in p.generate_log[k:]]
    assert traffic
    for body, answer in traffic:
        schema.check_generate_request(body)
        schema.check_generate_response(answer)
        assert body["return_logprob"] is True and "#" in body["rid"] and body["input_ids"]


def test_without_a_router_the_client_gives_each_request_to_the_least_busy_worker(fleet, served_model_dir):
    eng = FleetEngine(urls=fleet.urls, eos_token_ids=eos_ids_of(served_model_dir), **FAST)
    try:
        settle(eng)
        futures = [eng.submit(r) for r in requests(9, max_new_tokens=100, tag="spread")]
        for f in futures:
            f.result(300)
        # Dispatched at once, each went to a worker with the fewest outstanding, ties in turn.
        assert [w["served"] for w in eng.info()["workers"]] == [3, 3, 3]
    finally:
        eng.close()


def test_fleet_and_local_engine_sample_the_same_tokens_and_logprobs(engine, reference):
    cases = requests(4, max_new_tokens=12, tag="greedy") + requests(3, max_new_tokens=10, n=3, temperature=1.0,
                                                                    tag="seeded")  # fmt: skip
    got = engine.generate_many(cases)
    want = reference.generate_many(cases)
    assert_same_samples(got, want)
    assert all(s.weight_version == engine.weight_version and s.rid == r.rid for r, g in zip(cases, got) for s in g)
    assert len({s.output_ids for s in got[-1]}) > 1, "the n seeded samples of a prompt should differ"


def test_a_rid_may_be_sent_again_as_soon_as_its_request_has_finished(engine):
    """An environment reuses a task's rid once the task's earlier request has ended (a greedy
    evaluation, then the sampled one): the request leaves the in-flight set before its future
    resolves, so neither a done-callback nor the next awaiting round is refused."""
    (req,) = requests(1, max_new_tokens=2, tag="again")
    refused: list[str] = []

    def again(_):
        try:
            engine.submit(req).result(timeout=60)
        except Exception as e:  # a refusal shows up here
            refused.append(repr(e))

    first = engine.submit(req)
    done = threading.Event()
    first.add_done_callback(lambda f: threading.Thread(target=lambda: (again(f), done.set())).start())
    first.result(timeout=60)
    assert done.wait(60) and not refused, refused
    for _ in range(20):  # back to back, as evaluate_envs runs its rounds
        engine.submit(req).result(timeout=60)


def total_load(urls, key: str) -> int:
    return sum(get_json(u + "/v1/loads")["loads"][0][key] for u in urls)


def test_a_weight_push_reaches_every_worker_and_old_versions_are_pruned(fleet, engine, reference, served,
                                                                        other_params):  # fmt: skip
    _, params, model_state = served
    settle(engine)
    old = engine.weight_version
    cases = requests(3, max_new_tokens=10, tag="push")
    long = [GenerateRequest((40, 41, 42 + i), SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True),
                            rid=f"long-{i}") for i in range(24)]  # fmt: skip
    in_flight = [engine.submit(r) for r in long]
    assert engine.update_weights(other_params, model_state, weight_version="1", mode="drain") == "1"
    for url in fleet.urls:
        assert model_version(url) == "1", url
    drained = [f.result(120)[0] for f in in_flight]
    assert all(s.finish_reason.type == "length" and len(s.output_ids) == 120 for s in drained), "none lost"
    assert all(len(s.weight_versions) == 1 and s.weight_version in (old, "1") for s in drained), (
        "drain: a sample runs on one version, the old one if it started before the push"
    )
    folder = version_folder(engine.weight_dir, "1")
    assert engine.last_push["path"] == folder and read_manifest(folder, check_data=True)["dtype"] == "float32"
    assert all(w["ok"] for w in engine.last_push["workers"].values())
    reference.update_weights(other_params, model_state, weight_version="1")
    got = engine.generate_many(cases)
    assert_same_samples(got, reference.generate_many(cases))
    assert {s.weight_version for g in got for s in g} == {"1"}

    engine.update_weights(params, model_state, weight_version="2", mode="abort")
    for proxy in fleet.proxies[1:]:
        body = proxy.bodies["/update_weights_from_disk"][-1]
        assert body == {"model_path": version_folder(engine.weight_dir, "2"), "weight_version": "2",
                        "abort_all_requests": True}  # fmt: skip
    engine.update_weights(params, model_state, weight_version="3", mode="drain")
    assert [v for _, v, _ in list_versions(engine.weight_dir)] == ["2", "3"]
    reference.update_weights(params, model_state, weight_version="3")
    assert_same_samples(engine.generate_many(cases), reference.generate_many(cases))

    settle(engine)
    paused = [(p.counts["/pause_generation"], p.counts["/continue_generation"]) for p in fleet.proxies[1:]]
    engine.update_weights(params, model_state, weight_version="5", mode="in_place")  # pause, update, continue
    assert [(p.counts["/pause_generation"], p.counts["/continue_generation"]) for p in fleet.proxies[1:]] == [
        (a + 1, b + 1) for a, b in paused
    ]
    assert {model_version(u) for u in fleet.urls} == {"5"}
    assert_same_samples(engine.generate_many(cases), reference.generate_many(cases))


def test_abort_reaches_the_worker_behind_the_router(fleet, engine):
    """The router answers 404 to /abort_request, so the client sends it to every worker."""
    assert httpx.post(fleet.router.url + "/abort_request", json={"rid": "x"}).status_code == 404
    for url in fleet.urls:
        assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        request = GenerateRequest((7, 8, 9), SamplingParams(max_new_tokens=50, temperature=0), rid="to-abort")
        future = engine.submit(request)
        wait_until(lambda: total_load(fleet.urls, "num_waiting_reqs") == 1, 30, "the request to wait on a worker")
        assert engine.abort("to-abort") == 1
        (sample,) = future.result(30)
        assert sample.finish_reason.type == "abort" and sample.output_ids == () and sample.rid == "to-abort"
    finally:
        for url in fleet.urls:
            httpx.post(url + "/continue_generation", json={})


def test_a_folder_the_workers_refuse_is_an_error_and_they_keep_their_version(fleet, engine, bad_weights_dir,
                                                                             tmp_path):  # fmt: skip
    bad = load_hf(bad_weights_dir)
    _, bad_params, bad_state = split_model(bad)
    other = FleetEngine(urls=fleet.urls, model_cfg=bad.cfg, weight_dir=str(tmp_path), **FAST)
    try:
        with pytest.raises(WeightSyncError, match="d_ff") as e:
            other.update_weights(bad_params, bad_state, weight_version="bad")
        assert all(url in str(e.value) for url in fleet.urls)
    finally:
        other.close()
    for url in fleet.urls:
        assert model_version(url) == engine.weight_version


KILL_EXPORT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from ptrain.models import load_hf
from ptrain.rollout.weight_sync import export_weights
from ptrain.train.state import split_model
model = load_hf(sys.argv[1])
_, params, state = split_model(model)
count = [0]

def die_halfway(name):
    count[0] += 1
    if count[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)

export_weights(model.cfg, params, state, sys.argv[2], sys.argv[3], dtype="float32", on_tensor=die_halfway)
"""


def test_an_export_killed_halfway_never_reaches_the_fleet(fleet, engine, reference, served, other_weights_dir,
                                                          other_params):  # fmt: skip
    version = engine.weight_version
    proc = subprocess.run(
        [sys.executable, "-c", KILL_EXPORT.format(root=ROOT), other_weights_dir, engine.weight_dir, "9"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert os.path.isdir(os.path.join(engine.weight_dir, ".v9.partial"))
    assert not os.path.exists(version_folder(engine.weight_dir, "9"))
    cases = requests(2, tag="killed-export")
    got = engine.generate_many(cases)
    assert {s.weight_version for g in got for s in g} == {version}
    assert_same_samples(got, reference.generate_many(cases))
    _, _, model_state = served
    settle(engine)
    engine.update_weights(other_params, model_state, weight_version="9")
    assert {model_version(u) for u in fleet.urls} == {"9"}
    assert not os.path.exists(os.path.join(engine.weight_dir, ".v9.partial"))
    reference.update_weights(other_params, model_state, weight_version="9")


def test_a_worker_answering_503_and_one_hanging_are_routed_around(fleet, engine, reference, served_model_dir):
    """Each client on its own (direct) and through the router, with short request timeouts."""
    kw = dict(eos_token_ids=eos_ids_of(served_model_dir), request_timeout_s=10.0, unhealthy_timeout_s=60.0, **FAST)
    settle(engine)
    direct = FleetEngine(urls=fleet.urls, **kw)
    routed = FleetEngine(urls=fleet.urls, router_url=fleet.router.url, **kw)
    failing, hanging = fleet.proxies[1], fleet.proxies[2]
    try:
        failing.mode, hanging.mode = "503", "hang"
        for eng, tag in ((direct, "direct"), (routed, "router")):
            cases = requests(6, max_new_tokens=6, tag=f"faults-{tag}")
            futures = [eng.submit(r) for r in cases]
            got = [f.result(300) for f in futures]
            assert_same_samples(got, reference.generate_many(cases))
            assert sorted(g[0].rid for g in got) == sorted(r.rid for r in cases), "every request exactly once"
            wait_until(lambda: not any(w["in_service"] for w in eng.info()["workers"][1:]), 60,
                       f"{tag}: the faulty workers to be taken out")  # fmt: skip
            workers = {w["url"]: w for w in eng.info()["workers"]}
            assert "503" in workers[failing.url]["error"]
            assert "no answer within" in workers[hanging.url]["error"]
        assert direct.stats["retries"] >= 1

        def router_lists_them():
            return {failing.url, hanging.url} & {w["url"] for w in get_json(fleet.router.url + "/workers")["workers"]}

        wait_until(lambda: not router_lists_them(), 30, "the taken-out workers to leave the router")
    finally:
        failing.mode = hanging.mode = "pass"
    try:
        for eng in (direct, routed, engine):
            settle(eng)
        router_lists_all(fleet)
        cases = requests(3, tag="after-faults")
        assert_same_samples(routed.generate_many(cases), reference.generate_many(cases))
    finally:
        direct.close()
        routed.close()


def test_a_worker_sigkilled_mid_rollout_loses_no_sample_and_comes_back_on_the_current_version(
    fleet, engine, reference, served_model_dir, tmp_path
):
    victim = fleet.workers[0]
    cases = requests(12, max_new_tokens=60, tag="kill")
    # Paused (it still passes health checks), the victim holds its share of the batch while the
    # others generate theirs: the kill then surely lands on requests in flight.
    assert httpx.post(victim.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    futures = [engine.submit(r) for r in cases]
    wait_until(lambda: get_json(victim.url + "/v1/loads")["loads"][0]["num_waiting_reqs"] >= 3, 60,
               "the victim to hold requests")  # fmt: skip
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    got = [f.result(300) for f in futures]
    assert sorted(g[0].rid for g in got) == sorted(r.rid for r in cases), "every request exactly once"
    assert all(s.finish_reason.type == "length" and len(s.output_ids) == 60 for g in got for s in g)
    assert_same_samples(got, reference.generate_many(cases))
    wait_until(lambda: not engine.info()["workers"][0]["in_service"], 30, "the dead worker to be taken out")

    restarted = worker(served_model_dir, tmp_path, port=int(victim.url.rsplit(":", 1)[1])).start()
    fleet.workers[0] = restarted
    restarted.wait_healthy()
    wait_until(lambda: engine.info()["workers"][0]["in_service"], 120, "the restarted worker to be back")
    assert model_version(victim.url) == engine.weight_version, "brought to the current version before serving"
    wait_until(lambda: victim.url in {w["url"] for w in get_json(fleet.router.url + "/workers")["workers"]}, 30,
               "the router to list the restarted worker")  # fmt: skip


def test_a_resumed_run_repushes_the_version_it_resumes_from(fleet, served, served_model_dir, reference, engine):
    cfg, params, model_state = served
    settle(engine)
    version = engine.weight_version
    engine.close()  # the crashed run's client is gone; one trainer drives a fleet
    resumed = FleetEngine(urls=fleet.urls, router_url=fleet.router.url, model_cfg=cfg, weight_dir=engine.weight_dir,
                          eos_token_ids=eos_ids_of(served_model_dir), **FAST)  # fmt: skip
    try:
        assert resumed.weight_version == version
        resumed.update_weights(params, model_state, weight_version="4", mode="abort")  # what the stage's begin() does
        assert {model_version(u) for u in fleet.urls} == {"4"}
        reference.update_weights(params, model_state, weight_version="4")
        cases = requests(3, tag="resumed")
        assert_same_samples(resumed.generate_many(cases), reference.generate_many(cases))
    finally:
        resumed.close()


def test_a_push_that_times_out_is_retried_and_a_worker_that_died_meanwhile_catches_up_when_back(
    fleet, served, served_model_dir, tmp_path
):
    cfg, params, model_state = served
    proxy, index = fleet.proxies[2], 2
    eng = FleetEngine(urls=fleet.urls, router_url=fleet.router.url, model_cfg=cfg, weight_dir=str(tmp_path / "w"),
                      eos_token_ids=eos_ids_of(served_model_dir), weight_push_timeout_s=3.0, weight_push_retries=1,
                      **FAST)  # fmt: skip
    try:
        settle(eng)
        proxy.only, proxy.mode = ("/update_weights_from_disk",), "hang"
        assert eng.update_weights(params, model_state, weight_version="6") == "6"
        held = eng.last_push["workers"][proxy.url]
        assert not held["ok"] and held["attempts"] == 2 and "no answer within 3 s" in held["error"]
        assert {model_version(u) for u in fleet.urls[:2]} == {"6"}
        assert not {w["url"]: w for w in eng.info()["workers"]}[proxy.url]["in_service"]
        victim = fleet.workers[index]
        victim.proc.send_signal(signal.SIGKILL)  # it dies with its update still on the way
        victim.proc.wait(30)
        proxy.mode, proxy.only = "pass", ()
        restarted = worker(served_model_dir, tmp_path, port=int(victim.url.rsplit(":", 1)[1])).start()
        fleet.workers[index] = restarted
        restarted.wait_healthy()
        settle(eng)
        assert model_version(proxy.url) == "6", "brought to the current version before serving"
        got = eng.generate_many(requests(6, tag="after-push-fault"))
        assert {s.weight_version for g in got for s in g} == {"6"}
    finally:
        proxy.mode, proxy.only = "pass", ()
        eng.close()


def test_the_grpo_stage_runs_through_two_workers_behind_the_router(fleet, tmp_path):
    """The GRPO recipe with rollout=sglang: two ptrain.serve workers behind the real router (the
    third leaves the router for this run), float32 weight pushes each step, so the engine's
    log-probs equal the trainer's as with the local engine."""
    two, third = fleet.urls[:2], fleet.urls[2]
    ids = {w["url"]: w["id"] for w in router_lists_all(fleet)}
    assert httpx.delete(f"{fleet.router.url}/workers/{ids[third]}").status_code == 202
    wait_until(lambda: third not in {w["url"] for w in get_json(fleet.router.url + "/workers")["workers"]}, 30,
               "the third worker to leave the router")  # fmt: skip
    model = [f"model.{k}={getattr(TINY, k)}" for k in ("family", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                                          "head_dim", "d_ff", "max_seq_len", "qk_norm",
                                                          "tie_embeddings")]  # fmt: skip
    overrides = [o for o in GRPO_TINY if not o.startswith("model.")] + model + [
        "train.steps=3", "rollout=sglang", f"rollout.router_url={fleet.router.url}", f"rollout.urls=[{','.join(two)}]",
        "rollout.weight_dtype=float32", f"run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    before = fleet.proxies[1].counts["/generate"]
    try:
        proc = subprocess.run([sys.executable, GRPO_SCRIPT, *overrides], cwd=ROOT, capture_output=True, text=True,
                              timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    finally:
        httpx.post(fleet.router.url + "/workers", json={"url": third})
    stage = tmp_path / "run" / "stages" / "grpo"
    steps = [json.loads(line) for line in open(stage / "metrics.jsonl")]
    train = [m for m in steps if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3]
    for m in train:
        assert abs(m["train/mismatch_kl"]) < 1e-4, "the fleet's log-probs are the trainer's"
        assert m["train/tokens/output"] > 0 and m["train/env_errors"] == 0
    assert (stage / "DONE.json").is_file()
    assert {model_version(u) for u in two} == {"3"}, "the last step's weights are on both workers"
    assert [v for _, v, _ in list_versions(str(stage / "weights"))] == ["2", "3"]
    assert fleet.proxies[1].counts["/generate"] > before, "the router sent samples to both workers"


def free_port_pair() -> int:
    """A port p with p + 1 free too (the launcher puts worker 1, or the router's metrics, there)."""
    for _ in range(100):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def test_launch_fleet_starts_workers_and_a_router_and_stops_them_on_sigterm(served_model_dir, tmp_path):
    base, router_port = free_port_pair(), free_port_pair()
    cmd = [sys.executable, "tools/launch_fleet.py", "--model-path", served_model_dir, "--workers", "2",
           "--base-port", str(base), "--router-port", str(router_port), "--engine", "ptrain",
           "--log-dir", str(tmp_path), "--worker-args",
           f"--max-running-requests {MAX_RUNNING} --context-length {CONTEXT} --skip-tokenizer-init"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        ready = wait_until(lambda: next((x for x in lines if x.startswith("fleet ready")), None) or
                           (proc.poll() is not None and pytest.fail("".join(lines))), 600, "the fleet")  # fmt: skip
        router_url = f"http://127.0.0.1:{router_port}"
        assert ready.strip() == f"fleet ready: rollout=sglang rollout.router_url={router_url}"
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_logprob": True}  # fmt: skip
        schema.check_generate_request(body)
        r = httpx.post(router_url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        schema.check_generate_response(r.json())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(lines)[-3000:]
    reader.join(10)
    assert "launch_fleet: stopping" in "".join(lines)
    for port in (base, base + 1, router_port):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
