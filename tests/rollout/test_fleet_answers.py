"""FleetEngine against a worker that answers 200 with bodies that are not SGLang's shape: the
request or weight push fails naming the worker and what was wrong, and the worker is taken
out of service."""

from __future__ import annotations

import pytest
from flax import nnx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder
from ptrain.rollout.fleet import FleetEngine, FleetUnavailable, RequestFailed, WeightSyncError
from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from ptrain.serve.in_process import serving
from ptrain.train.state import split_model

ANSWER: dict = {}


async def _ok(request):
    return JSONResponse({"weight_version": "default"})


async def _generate(request):
    return JSONResponse(ANSWER["body"])


async def _update(request):
    if ANSWER.get("update") == "refuse":
        path = (await request.json())["model_path"]
        return JSONResponse({"success": False, "message": f"{path}: no config.json"}, status_code=400)
    return JSONResponse(["ok"])


@pytest.fixture(scope="module")
def worker_url():
    app = Starlette(
        routes=[
            Route("/health_generate", _ok),
            Route("/health", _ok),
            Route("/model_info", _ok),
            Route("/generate", _generate, methods=["POST"]),
            Route("/update_weights_from_disk", _update, methods=["POST"]),
        ]
    )
    with serving(app) as url:
        yield url


@pytest.mark.parametrize(
    "body, why",
    [
        ({"meta_info": None, "output_ids": [5]}, "'NoneType' object has no attribute 'get'"),
        ({"meta_info": {"finish_reason": "stop", "output_token_logprobs": [[-1.0, 5, None]]}, "output_ids": [5]},
         "'str' object has no attribute 'get'"),
        ([{"meta_info": {}}, {"meta_info": {}}], "2 response objects for n=1"),
        ("ok", "string indices must be integers"),
    ],
)  # fmt: skip
def test_a_200_answer_not_in_sglangs_shape_fails_the_request_naming_the_worker(worker_url, body, why):
    ANSWER["body"] = body
    engine = FleetEngine(urls=[worker_url], max_retries=0, unhealthy_timeout_s=5, health_interval_s=60)
    try:
        future = engine.submit(GenerateRequest(input_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=4)))
        with pytest.raises(RequestFailed, match=rf"{worker_url}: POST /generate: a malformed answer \(.*{why}"):
            future.result(timeout=30)
        assert engine.stats["taken_out"] == 1
    finally:
        engine.close()


CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48)


def test_a_weight_update_answered_with_a_list_takes_the_worker_out_naming_the_answer(worker_url, tmp_path):
    cfg = CFG
    ANSWER["update"] = None
    _, params, model_state = split_model(Decoder(cfg, rngs=nnx.Rngs(0)))
    engine = FleetEngine(urls=[worker_url], model_cfg=cfg, weight_dir=str(tmp_path), unhealthy_timeout_s=2,
                         weight_push_retries=0, probe_backoff_s=0.2)  # fmt: skip
    try:
        with pytest.raises(FleetUnavailable, match=r"/update_weights_from_disk: answered list \['ok'\], not SGLang's"):
            engine.update_weights(params, model_state, weight_version="1")
    finally:
        engine.close()


def test_a_folder_a_worker_refuses_says_every_worker_must_read_the_weight_dir(worker_url, tmp_path):
    ANSWER["update"] = "refuse"
    _, params, model_state = split_model(Decoder(CFG, rngs=nnx.Rngs(0)))
    engine = FleetEngine(urls=[worker_url], model_cfg=CFG, weight_dir=str(tmp_path), weight_push_retries=0)
    try:
        with pytest.raises(
            WeightSyncError, match=r"no config.json; every worker must read that folder \(rollout.weight_dir"
        ):
            engine.update_weights(params, model_state, weight_version="1")
    finally:
        engine.close()
        ANSWER["update"] = None
