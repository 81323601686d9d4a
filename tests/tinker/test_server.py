"""ptrain/tinker/server.py driven by the real tinker SDK over HTTP.

The backend is `ArithmeticService`, a stand-in for `TinkerService` (our own interface, not
Tinker's protocol) whose answers are simple numpy functions of its inputs, so every number
that comes back through the SDK can be checked: a target token's log-prob is
-(token % 7 + 1) / (steps + 1), and a sample continues the prompt's last token by +1s.
"""

import threading
import time
import uuid

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from ptrain.client import Datum, ForwardOutput, OptimStepOutput  # noqa: E402
from ptrain.serve.in_process import serving  # noqa: E402
from ptrain.tinker import wire  # noqa: E402
from ptrain.tinker.server import make_app  # noqa: E402
from ptrain.tinker.service import TinkerError  # noqa: E402

BASE = "tiny-test-model"
KEY = "tml-test"
LOSSES = ("cross_entropy", "importance_sampling")


def expected_logprobs(targets, steps: int) -> np.ndarray:
    return (-(np.asarray(targets) % 7 + 1) / (steps + 1)).astype(np.float32)


class ArithmeticService:
    """TinkerService's methods, answered deterministically with numpy."""

    def __init__(self):
        self.lock = threading.Lock()
        self.models: dict[str, dict] = {}
        self.saved: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self.checkpoint_list: dict[str, list] = {}
        self.release = threading.Event()
        self.release.set()
        self.finished: dict[str, tuple] = {}

    def capabilities(self):
        return {"supported_models": [{"model_name": BASE}]}

    def create_session(self, tags=None, user_metadata=None):
        return f"session-{uuid.uuid4().hex[:6]}"

    def finish_session(self, session_id, reason, detail=None):
        self.finished[session_id] = (reason, detail)

    def create_model(self, session_id, base_model, lora_config, user_metadata=None):
        self.release.wait(10)  # a test holds this to see a pending future
        if base_model != BASE:
            raise TinkerError(f"base_model {base_model!r}: this server serves {BASE!r}", 400)
        model_id = f"model-{len(self.models)}"
        self.models[model_id] = {"rank": lora_config["rank"], "steps": 0, "pending": 0}
        self.checkpoint_list[model_id] = []
        return model_id

    def get_info(self, model_id):
        m = self.model(model_id)
        return {
            "model_id": model_id,
            "model_data": {"arch": "toy", "model_name": BASE, "tokenizer_id": None},
            "is_lora": True,
            "lora_rank": m["rank"],
            "model_name": BASE,
        }

    def model(self, model_id):
        if model_id not in self.models:
            raise TinkerError(f"unknown model {model_id!r}", 404)
        return self.models[model_id]

    def forward_backward(self, model_id, data, loss_fn, loss_fn_config, forward_only):
        m = self.model(model_id)
        if loss_fn not in LOSSES:
            raise ValueError(f"loss_fn {loss_fn!r} is not one of {', '.join(LOSSES)}")
        logprobs, loss = [], 0.0
        for d in data:
            lp = expected_logprobs(d.loss_fn_inputs["target_tokens"], m["steps"])
            logprobs.append(lp)
            if loss_fn == "cross_entropy":
                loss += float(-(d.loss_fn_inputs["weights"] * lp).sum())
            else:
                ratio = np.exp(lp - d.loss_fn_inputs["logprobs"])
                loss += float(-(ratio * d.loss_fn_inputs["advantages"]).sum())
        if not forward_only:
            m["pending"] += 1
        return ForwardOutput(logprobs=logprobs, loss=loss, metrics={"loss:sum": loss, "datums:sum": len(data)})

    def optim_step(self, model_id, adam_params):
        m = self.model(model_id)
        m["steps"] += 1
        m["pending"] = 0
        return OptimStepOutput(step=m["steps"], grad_norm=0.5, metrics={"lr": adam_params["learning_rate"]})

    def _checkpoint(self, model_id, kind, name):
        segment = "weights" if kind == "training" else "sampler_weights"
        name = name or f"auto-{len(self.checkpoint_list[model_id])}"
        path = f"tinker://{model_id}/{segment}/{name}"
        self.checkpoint_list[model_id].append(
            {"checkpoint_id": f"{segment}/{name}", "checkpoint_type": kind, "tinker_path": path, "time": time.time()}
        )
        return path

    def save_state(self, model_id, name):
        path = self._checkpoint(model_id, "training", name)
        self.saved[path] = dict(self.model(model_id))
        return path

    def load_state(self, model_id, path, optimizer):
        if path not in self.saved:
            raise TinkerError(f"no checkpoint at {path!r}", 404)
        self.models[model_id].update(steps=self.saved[path]["steps"])

    def create_model_from_state(self, session_id, path, optimizer):
        if path not in self.saved:
            raise TinkerError(f"no checkpoint at {path!r}", 404)
        model_id = f"model-{len(self.models)}"
        self.models[model_id] = dict(self.saved[path])
        self.checkpoint_list[model_id] = []
        return model_id

    def save_for_sampler(self, model_id, name):
        path = self._checkpoint(model_id, "sampler", name)
        self.saved[path] = dict(self.model(model_id))
        return path

    def create_sampling_session(self, session_id, model_path, base_model):
        if model_path is not None and model_path not in self.saved:
            raise TinkerError(f"no sampler weights at {model_path!r}", 404)
        sid = f"sampler-{len(self.samplers)}"
        self.samplers[sid] = {"sampler_id": sid, "base_model": BASE, "model_path": model_path}
        return sid

    def sampler_info(self, sampler_id):
        if sampler_id not in self.samplers:
            raise TinkerError(f"unknown sampler {sampler_id!r}", 404)
        return self.samplers[sampler_id]

    def sample(self, *, prompt, num_samples, sampling_params, sampling_session_id=None, model_path=None,
               base_model=None, prompt_logprobs=False, topk_prompt_logprobs=0):  # fmt: skip
        n = sampling_params.get("max_tokens") or 4
        sequences = [
            {
                "tokens": [prompt[-1] + i + 1 + j for j in range(n)],
                "logprobs": [-0.5 * (i + 1)] * n,
                "stop_reason": "length",
            }
            for i in range(num_samples)
        ]
        out = {"sequences": sequences, "prompt_logprobs": None, "topk_prompt_logprobs": None}
        if prompt_logprobs:
            out["prompt_logprobs"] = [None] + [-float(t % 5) for t in prompt[1:]]
        if topk_prompt_logprobs:
            out["topk_prompt_logprobs"] = [None] + [[(t, -0.1), (t + 1, -2.0)] for t in prompt[1:]]
        return out

    def checkpoints(self, model_id):
        self.model(model_id)
        return list(self.checkpoint_list[model_id])

    def unload_model(self, model_id):
        self.models.pop(model_id)

    def close(self):
        pass


@pytest.fixture(scope="module")
def server():
    """(base_url, service): the app under uvicorn on a free loopback port, in a thread."""
    service = ArithmeticService()
    with serving(make_app(service, api_key=KEY, poll_wait_s=0.5)) as url:
        yield url, service


@pytest.fixture(scope="module")
def client(server):
    service = tinker.ServiceClient(base_url=server[0], api_key=KEY)
    yield service
    service.close("success").result()  # ends its session and stops its heartbeat thread


def datum(tokens, **inputs):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={k: types.TensorData.from_numpy(np.asarray(v)) for k, v in inputs.items()},
    )


def sft_datum(tokens):
    return datum(
        tokens[:-1], target_tokens=np.array(tokens[1:], np.int64), weights=np.ones(len(tokens) - 1, np.float32)
    )


def test_training_steps_through_the_sdk(client):
    tc = client.create_lora_training_client(base_model=BASE, rank=8).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 8

    data = [sft_datum([3, 10, 11, 12]), sft_datum([5, 20, 21])]
    out = tc.forward_backward(data, "cross_entropy").result()
    assert isinstance(out, types.ForwardBackwardOutput) and len(out.loss_fn_outputs) == 2
    first = expected_logprobs([10, 11, 12], 0)
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), first)
    np.testing.assert_allclose(out.loss_fn_outputs[1]["logprobs"].to_numpy(), expected_logprobs([20, 21], 0))
    want_loss = -(first.sum() + expected_logprobs([20, 21], 0).sum())
    assert out.metrics["loss:sum"] == pytest.approx(want_loss) and out.metrics["datums:sum"] == 2

    step = tc.optim_step(types.AdamParams(learning_rate=2e-4)).result()
    assert isinstance(step, types.OptimStepResponse)
    assert step.metrics == {"lr": pytest.approx(2e-4), "step": 1.0, "grad_norm": 0.5}

    after = tc.forward(data[:1], "cross_entropy").result()  # forward_only: the weights after one step
    np.testing.assert_allclose(after.loss_fn_outputs[0]["logprobs"].to_numpy(), expected_logprobs([10, 11, 12], 1))

    sampled = np.array([-1.0, -2.0], np.float32)
    rl = datum([7, 8], target_tokens=np.array([8, 9], np.int64), logprobs=sampled, advantages=np.array([1.0, -0.5]))
    out = tc.forward_backward([rl], "importance_sampling").result()
    lp = expected_logprobs([8, 9], 1)
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp)
    ratio = np.exp(lp - sampled)
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio[0] * 1.0 - ratio[1] * 0.5), rel=1e-5)


def test_sampling_through_the_sdk(client):
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    saved = tc.save_weights_for_sampler("snap").result()
    assert saved.path.endswith("/sampler_weights/snap") and saved.path.startswith("tinker://")

    sc = client.create_sampling_client(model_path=saved.path).result()
    params = types.SamplingParams(max_tokens=3, temperature=1.0, stop=["\n"])
    res = sc.sample(types.ModelInput.from_ints([1, 2, 10]), num_samples=3, sampling_params=params).result()
    assert isinstance(res, types.SampleResponse) and len(res.sequences) == 3
    assert [s.tokens for s in res.sequences] == [[11, 12, 13], [12, 13, 14], [13, 14, 15]]
    assert res.sequences[2].logprobs == pytest.approx([-1.5] * 3)
    assert all(s.stop_reason == "length" for s in res.sequences)
    ids = [s.sequence_id for s in res.sequences]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 3

    res = sc.sample(
        types.ModelInput.from_ints([4, 6, 8]),
        num_samples=1,
        sampling_params=params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
    ).result()
    assert res.prompt_logprobs == [None, -1.0, -3.0]
    assert res.topk_prompt_logprobs == [
        None,
        [(6, pytest.approx(-0.1)), (7, -2.0)],
        [(8, pytest.approx(-0.1)), (9, -2.0)],
    ]
    assert sc.compute_logprobs(types.ModelInput.from_ints([4, 6])).result() == [None, -1.0]

    # save_weights_and_get_sampling_client: a save without a name comes back as a sampling session
    sc2 = tc.save_weights_and_get_sampling_client().result()
    res = sc2.sample(types.ModelInput.from_ints([30]), num_samples=1, sampling_params=params).result()
    assert res.sequences[0].tokens == [31, 32, 33]


def test_state_save_load_and_checkpoint_listing(client, server):
    tc = client.create_lora_training_client(base_model=BASE, rank=8).result()
    tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    path = tc.save_state("step1").result().path
    assert path == f"tinker://{tc.model_id}/weights/step1"

    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    with pytest.warns(FutureWarning):  # deprecated in the SDK, still what older cookbook code calls
        tc.load_state(path).result()
    out = tc.forward([sft_datum([1, 2, 3])], "cross_entropy").result()
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), expected_logprobs([2, 3], 1))

    # a new model from the checkpoint, under the id the SDK computes for it on its own
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    out = resumed.forward([sft_datum([1, 2, 3])], "cross_entropy").result()
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), expected_logprobs([2, 3], 1))

    rest = tinker.RestClient(base_url=server[0], api_key=KEY)
    listed = rest.list_checkpoints(tc.model_id).result()
    assert [c.tinker_path for c in listed.checkpoints] == [path]
    run = rest.get_training_run_by_tinker_path(path).result()
    assert run.training_run_id == tc.model_id and run.base_model == BASE and run.last_checkpoint.tinker_path == path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.base_model == BASE and info.lora_rank == 8


def test_bad_inputs_are_refused_and_the_server_keeps_serving(client, server):
    base_url, _ = server
    intruder = tinker.ServiceClient(base_url=base_url, api_key="tml-wrong")  # it connects on first use
    with pytest.raises(tinker.AuthenticationError, match="wrong API key"):
        intruder.create_lora_training_client(base_model=BASE, rank=8).result()
    intruder.close("errored")
    r = httpx.post(f"{base_url}/api/v1/create_session", json={})
    assert r.status_code == 401 and r.json()["category"] == "user"

    tc = client.create_lora_training_client(base_model=BASE, rank=8).result()
    with pytest.raises(tinker.RequestFailedError, match="no_such_loss"):
        tc.forward_backward([sft_datum([1, 2, 3])], "no_such_loss").result()
    with pytest.raises(tinker.RequestFailedError, match="base_model"):
        client.create_lora_training_client(base_model="other-model", rank=8).result()

    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]), loss_fn_inputs={}
    )
    with pytest.raises(tinker.BadRequestError, match="text only"):
        tc.forward_backward([image], "cross_entropy").result()

    headers = {"X-API-Key": KEY}
    r = httpx.post(f"{base_url}/api/v1/optim_step", headers=headers, json={"model_id": "nope", "adam_params": {}})
    assert r.status_code == 404 and "unknown model_id 'nope'" in r.json()["error"]
    r = httpx.post(
        f"{base_url}/api/v1/forward_backward",
        headers={**headers, "Content-Type": "application/x-protobuf"},
        content=b"\xff\xfe not a protobuf",
    )
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]
    r = httpx.post(f"{base_url}/api/v1/retrieve_future", headers=headers, json={"request_id": "req-missing"})
    assert r.status_code == 404 and r.json()["category"] == "user"
    assert httpx.get(f"{base_url}/api/v1/no_such_route", headers=headers).status_code == 404

    # still serving
    assert httpx.get(f"{base_url}/api/v1/healthz").json() == {"status": "ok"}
    out = tc.forward_backward([sft_datum([1, 2, 3])], "cross_entropy").result()
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), expected_logprobs([2, 3], 0))


def test_closing_the_sdks_client_finishes_its_session(server):
    base_url, service = server
    sdk = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    sdk.create_lora_training_client(base_model=BASE, rank=2).result()  # opens the session
    sdk.close("success", detail="done").result()
    assert ("success", "done") in service.finished.values(), service.finished
    r = httpx.post(f"{base_url}/api/v1/sessions/session-x/finish", headers={"X-API-Key": KEY}, json={"reason": {}})
    assert r.status_code == 400 and "reason.type" in r.text


def test_pending_future_answers_try_again_then_its_result(server):
    base_url, service = server
    headers = {"X-API-Key": KEY}
    session = httpx.post(f"{base_url}/api/v1/create_session", headers=headers, json={"tags": []}).json()["session_id"]
    service.release.clear()
    try:
        body = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2}}
        future = httpx.post(f"{base_url}/api/v1/create_model", headers=headers, json=body).json()
        poll = httpx.post(
            f"{base_url}/api/v1/retrieve_future", headers=headers, json={"request_id": future["request_id"]}
        )
        assert poll.status_code == 408
        assert poll.json() == {"type": "try_again", "request_id": future["request_id"], "queue_state": "active"}
    finally:
        service.release.set()
    done = httpx.post(f"{base_url}/api/v1/retrieve_future", headers=headers, json={"request_id": future["request_id"]})
    assert done.status_code == 200
    created = types.CreateModelResponse.model_validate(done.json())
    info = httpx.post(f"{base_url}/api/v1/get_info", headers=headers, json={"model_id": created.model_id}).json()
    assert types.GetInfoResponse.model_validate(info).lora_rank == 2
    # the id the SDK derives for (session, model_seq_id) names the same model
    alias = httpx.post(f"{base_url}/api/v1/get_info", headers=headers, json={"model_id": f"{session}:train:0"})
    assert alias.json()["model_id"] == created.model_id


def test_plumbing_routes_answer_in_the_sdks_shapes(server):
    base_url, _ = server
    headers = {"X-API-Key": KEY}

    def post(route, body=None, **kw):
        return httpx.post(f"{base_url}/api/v1/{route}", headers={**headers, **kw.pop("extra", {})}, json=body, **kw)

    config = types.ClientConfigResponse.model_validate(post("client/config", {"sdk_version": "0.38.0"}).json())
    assert config.pjwt_auth_enabled is False and config.proto_compress_fwdbwd is False
    types.ClientDynamicConfigResponse.model_validate(post("client/dynamic_config", {"sdk_version": "0.38.0"}).json())
    session = types.CreateSessionResponse.model_validate(post("create_session", {"tags": []}).json()).session_id
    types.SessionHeartbeatResponse.model_validate(post("session_heartbeat", {"session_id": session}).json())
    assert types.TelemetryResponse.model_validate(post("telemetry", {"events": []}).json()).status == "accepted"
    caps = httpx.get(f"{base_url}/api/v1/get_server_capabilities", headers=headers).json()
    assert types.GetServerCapabilitiesResponse.model_validate(caps).supported_models[0].model_name == BASE

    def result(future, accept=None):
        extra = {"Accept": accept} if accept else {}
        r = post("retrieve_future", {"request_id": future["request_id"]}, extra=extra)
        assert r.status_code == 200
        return r

    body = {"session_id": session, "model_seq_id": 5, "base_model": BASE, "lora_config": {"rank": 2}}
    model_id = result(post("create_model", body).json()).json()["model_id"]

    # a client that does not ask for protobuf gets the forward result as JSON
    proto = wire.encode_forward_backward_request(
        wire.ForwardBackwardCall(model_id, 1, [Datum([1, 2], {"target_tokens": np.array([2, 3])})], "cross_entropy")
    )
    r = httpx.post(
        f"{base_url}/api/v1/forward_backward",
        headers={**headers, "Content-Type": "application/x-protobuf"},
        content=proto,
    )
    future = r.json()
    assert types.UntypedAPIFuture.model_validate(future).model_id == model_id
    failed = result(future).json()  # cross_entropy without weights: the backend's KeyError, a server error
    assert types.RequestFailedResponse.model_validate(failed).category == "server" and "weights" in failed["error"]
    call = wire.ForwardBackwardCall(
        model_id,
        2,
        [Datum([1, 2], {"target_tokens": np.array([2, 3]), "weights": np.ones(2)})],
        "cross_entropy",
        forward_only=True,
    )
    r = httpx.post(
        f"{base_url}/api/v1/forward_backward",
        headers={**headers, "Content-Type": "application/x-protobuf"},
        content=wire.encode_forward_backward_request(call),
    )
    as_json = result(r.json()).json()
    assert as_json["loss_fn_outputs"][0]["logprobs"]["data"] == pytest.approx(expected_logprobs([2, 3], 0).tolist())
    as_proto = result(r.json(), accept="application/x-protobuf")
    assert as_proto.headers["content-type"] == "application/x-protobuf"

    unloaded = result(post("unload_model", {"model_id": model_id}).json()).json()
    assert types.UnloadModelResponse.model_validate(unloaded).model_id == model_id
    assert post("get_info", {"model_id": model_id}).status_code == 404


def test_command_line_errors_are_one_line(tmp_path, capsys):
    from ptrain.tinker.__main__ import main

    for argv, message in (
        (["--model-path", str(tmp_path)], "no config.json"),
        (["--model-path", str(tmp_path), "--api-key", "secret"], "must start with 'tml-'"),
        (["--model-path", str(tmp_path), "--no-auth", "--api-key", "tml-x"], "not allowed with"),
    ):
        (tmp_path / "config.json").unlink(missing_ok=True)
        if message != "no config.json":
            (tmp_path / "config.json").write_text("{}")
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1]
