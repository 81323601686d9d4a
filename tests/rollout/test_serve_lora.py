"""LoRA adapters over real HTTP: `python -m ptrain.serve --lora-paths ...` as a subprocess on
loopback, driven as SGLang's clients drive it. Adapters load at start and through
/load_lora_adapter, requests name them in `lora_path` (one, or one a prompt) or in the OpenAI
`model`, greedy tokens equal an in-process engine serving the same adapter folders, adapters
that do not fit are 400s naming the mismatch, and an unload waits for the requests using
the adapter. One server for the module; every body checked against SGLang's schema."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import httpx
import jax
import pytest
from flax import nnx

from ptrain.config.lora import LoRAConfig
from ptrain.models import Decoder, load_hf
from ptrain.models.lora import LoRASpec, init_adapters
from ptrain.models.peft_io import save_peft
from ptrain.rollout.local import LocalEngine
from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from ptrain.train.state import split_model
from tests.rollout import sglang_schema as schema
from tests.rollout.conftest import CONTEXT, MAX_RUNNING
from tests.rollout.test_serve_process import start_server

pytestmark = pytest.mark.slow
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 9, 2, 44, 17], [3, 3, 8, 1], [60, 12, 7, 7, 7, 30]]
# What the server is started with: the targets in SGLang's fused names (no down_proj), so an
# adapter of down_proj does not fit.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
FLAGS = ("--max-loras-per-batch", "2", "--max-lora-rank", "8", "--lora-target-modules", "qkv_proj", "o_proj",
         "gate_up_proj")  # fmt: skip


def _adapter_folder(model, path: str, rank: int, targets, seed: int) -> str:
    """A PEFT folder of random adapters with B moved off zero (fresh B is zero: no effect)."""
    _, params, _ = split_model(model)
    spec = LoRASpec.of(LoRAConfig(rank=rank, alpha=2.0 * rank, targets=list(targets)))
    ad = init_adapters(params, spec, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    ad = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    save_peft(ad, spec, model.cfg, path)
    return path


@pytest.fixture(scope="module")
def adapters(served_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model = load_hf(served_model_dir)
    other = Decoder(dataclasses.replace(model.cfg, d_model=48), rngs=nnx.Rngs(0))  # other shapes
    return {
        "math": _adapter_folder(model, str(root / "math"), 4, TARGETS, 1),
        "attn": _adapter_folder(model, str(root / "attn"), 2, ("q_proj", "v_proj"), 2),
        "down": _adapter_folder(model, str(root / "down"), 2, ("down_proj",), 3),
        "big": _adapter_folder(model, str(root / "big"), 16, ("q_proj",), 4),
        "other": _adapter_folder(other, str(root / "other"), 2, ("q_proj",), 5),
    }


@pytest.fixture(scope="module")
def served(served_model_dir, adapters, tmp_path_factory):
    """(the server, {adapter: greedy tokens a prompt} of an in-process engine serving the same
    folders); the in-process engine compiles while the server starts."""

    def reference() -> dict:
        eng = LocalEngine.from_hf(served_model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT,
                                  max_loras=2, max_lora_rank=8, lora_targets=TARGETS)  # fmt: skip
        try:
            eng.load_lora("math", adapters["math"])
            eng.load_lora("attn", adapters["attn"])
            reqs = [GenerateRequest(tuple(p), SamplingParams(**GREEDY), lora_path=lora)
                    for lora in (None, "math", "attn") for p in PROMPTS]  # fmt: skip
            out = [list(samples[0].output_ids) for samples in eng.generate_many(reqs)]
        finally:
            eng.close()
        k = len(PROMPTS)
        return {None: out[:k], "math": out[k : 2 * k], "attn": out[2 * k :]}

    log = str(tmp_path_factory.mktemp("serve_lora") / "server.log")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        want = pool.submit(reference)
        srv = start_server(served_model_dir, log, *FLAGS, "--lora-paths", f"math={adapters['math']}")
        try:
            yield srv, want.result()
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait(30)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def want(served):
    return served[1]


def post(http, path, body, status=200):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def generate(http, body, status=200):
    schema.check_generate_request(body)
    out = post(http, "/generate", body, status)
    if status == 200:
        schema.check_generate_response(out)
    return out


def lora_update(http, path, body, status=200) -> dict:
    """POST a load/unload body with LoadLoRAAdapterReqInput's / UnloadLoRAAdapterReqInput's
    fields; the answer has LoRAUpdateOutput's."""
    cls = "LoadLoRAAdapterReqInput" if path == "/load_lora_adapter" else "UnloadLoRAAdapterReqInput"
    theirs = schema.io_struct_fields(cls)
    assert set(body) <= set(theirs), f"{sorted(set(body) - set(theirs))} are not {cls} fields"
    assert not [k for k, v in theirs.items() if v is ... and k not in body], "a required field is missing"
    out = post(http, path, body, status)
    assert set(out) <= set(schema.io_struct_fields("LoRAUpdateOutput")), out
    assert out["success"] is (status == 200) and isinstance(out["error_message"], str), out
    return out


def test_adapters_load_generate_and_unload_over_http(http, adapters, want):
    base = generate(http, {"input_ids": PROMPTS, "sampling_params": GREEDY})
    math = generate(http, {"input_ids": PROMPTS, "sampling_params": GREEDY, "lora_path": "math"})
    assert [x["output_ids"] for x in base] == want[None]
    assert [x["output_ids"] for x in math] == want["math"]
    assert [x["output_ids"] for x in math] != [x["output_ids"] for x in base]  # the adapter changes the tokens

    out = lora_update(http, "/load_lora_adapter", {"lora_name": "attn", "lora_path": adapters["attn"]})
    assert out["loaded_adapters"] == {"math": adapters["math"], "attn": adapters["attn"]}
    mixed = generate(http, {"input_ids": PROMPTS, "sampling_params": GREEDY, "lora_path": [None, "math", "attn"]})
    assert [x["output_ids"] for x in mixed] == [want[None][0], want["math"][1], want["attn"][2]]  # one batch

    out = lora_update(http, "/unload_lora_adapter", {"lora_name": "attn"})
    assert out["loaded_adapters"] == {"math": adapters["math"]}
    r = generate(http, {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "attn"}, 400)
    assert "no LoRA adapter named 'attn' is loaded (loaded: ['math'])" in schema.check_error(r)


@pytest.mark.parametrize(
    "name, message",
    [
        ("big", "rank 16, above this engine's max_lora_rank 8; start the server with --max-lora-rank >= 16"),
        ("down", "adapts ['down_proj'], which this engine does not serve"),
        ("other", "this model needs"),
        ("missing", "no adapter_config.json; pass a PEFT adapter folder"),
        ("math", "an adapter named 'math' is already loaded"),
    ],
)
def test_adapters_that_do_not_fit_are_400s_naming_the_mismatch(http, adapters, name, message):
    path = adapters.get(name, adapters["math"] + "-missing")
    out = lora_update(http, "/load_lora_adapter", {"lora_name": name, "lora_path": path}, 400)
    assert message in out["error_message"] and out["loaded_adapters"] == {"math": adapters["math"]}, out
    if name == "down":
        assert "--lora-target-modules" in out["error_message"]


def test_bad_lora_requests_are_400s(http, adapters):
    lora_update(http, "/load_lora_adapter", {"lora_name": "attn", "lora_path": adapters["attn"]})
    try:
        out = lora_update(http, "/load_lora_adapter", {"lora_name": "third", "lora_path": adapters["attn"]}, 400)
        assert "all 2 adapter slots are in use" in out["error_message"], out
        assert "--max-loras-per-batch" in out["error_message"], out
    finally:
        lora_update(http, "/unload_lora_adapter", {"lora_name": "attn"})
    out = lora_update(http, "/unload_lora_adapter", {"lora_name": "nope"}, 400)
    assert "no LoRA adapter named 'nope' is loaded (loaded: ['math'])" in out["error_message"]
    r = post(http, "/load_lora_adapter", {"lora_path": adapters["attn"]}, 400)
    assert "lora_name: required" in schema.check_error(r)
    for body, message in (
        ({"input_ids": PROMPTS, "sampling_params": GREEDY, "lora_path": ["math"]}, "has 1 entries for 3 prompts"),
        ({"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_id": "x"}, "name the adapter in lora_path"),
        ({"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "nope"}, "(loaded: ['math'])"),
    ):
        assert message in schema.check_error(generate(http, body, 400))


def test_openai_model_names_an_adapter(http, adapters):
    want = generate(http, {"input_ids": PROMPTS[1], "sampling_params": GREEDY, "lora_path": "math"})["output_ids"]
    base = generate(http, {"input_ids": PROMPTS[1], "sampling_params": GREEDY})["output_ids"]
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for model, tokens in (("math", want), ("tiny:math", want), ("some-other-model", base), ("tiny", base)):
        out = post(http, "/v1/completions", {**body, "model": model})
        assert out["choices"][0]["token_ids"] == tokens and out["model"] == model, model
    assert post(http, "/v1/completions", {**body, "lora_path": "math"})["choices"][0]["token_ids"] == want
    out = post(http, "/v1/completions", {**body, "model": "tiny:nope"}, 400)
    assert out["object"] == "error" and "model: no LoRA adapter named 'nope' is loaded" in out["message"], out
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "model": "math"}
    assert post(http, "/v1/chat/completions", chat)["model"] == "math"

    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards["tiny"]["parent"] is None
    assert cards["math"] == {**cards["math"], "root": adapters["math"], "parent": "tiny", "max_model_len": None}
    info = http.get("/server_info").json()
    schema.check_server_info(info)
    assert info["enable_lora"] is True and info["max_loras_per_batch"] == 2 and info["max_lora_rank"] == 8
    assert info["lora_target_modules"] == list(TARGETS)
    assert [(r["lora_name"], r["lora_path"]) for r in info["lora_paths"]] == [("math", adapters["math"])]


def _in_flight(http) -> int:
    load = http.get("/v1/loads").json()["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def test_an_unload_waits_for_the_requests_using_the_adapter(http, adapters):
    lora_update(http, "/load_lora_adapter", {"lora_name": "attn", "lora_path": adapters["attn"]})
    long = {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "attn"}  # held by the pause
    answers: dict[str, httpx.Response] = {}
    running = threading.Thread(target=lambda: answers.update(gen=http.post("/generate", json=long)))
    unloading = threading.Thread(
        target=lambda: answers.update(unload=http.post("/unload_lora_adapter", json={"lora_name": "attn"}))
    )
    post(http, "/pause_generation", {"mode": "in_place"})  # the request holds its row until resumed
    try:
        running.start()
        while _in_flight(http) == 0:
            pass
        unloading.start()
        probe = None
        while probe is None:  # until the unload has begun: new requests for the adapter are refused
            try:
                probe = http.post("/generate", json=long, timeout=2)
            except httpx.TimeoutException:  # taken before the unload began (and aborted as we hang up)
                pass
        assert probe.status_code == 400, probe.text
        assert "LoRA adapter 'attn' is being unloaded" in schema.check_error(probe.json())
        assert "unload" not in answers  # it waits for the running request
    finally:
        post(http, "/continue_generation", {})
    running.join(120)
    unloading.join(120)
    assert answers["gen"].status_code == 200 and len(answers["gen"].json()["output_ids"]) == GREEDY["max_new_tokens"]
    assert answers["unload"].status_code == 200, answers["unload"].text
    assert answers["unload"].json()["loaded_adapters"] == {"math": adapters["math"]}
