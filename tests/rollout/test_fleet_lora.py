"""LoRA over `rollout=sglang`: two `python -m ptrain.serve` workers started with LoRA enabled
(and one without), FleetEngine in this process pushing adapters alone. A request's lora_path
reaches the workers (greedy tokens equal an in-process engine serving the same adapters, and
differ from the base), an adapter push is a new weight version the samples report, the
previous version is unloaded from every worker, and a worker without LoRA refuses the push
with an error naming the flags to start it with."""

from __future__ import annotations

import concurrent.futures
import os

import jax
import pytest

from ptrain.config.lora import LoRAConfig
from ptrain.models import load_hf
from ptrain.models.lora import SERVABLE, LoRASpec, init_adapters
from ptrain.rollout.fleet import FleetEngine
from ptrain.rollout.local import LocalEngine, eos_ids_of
from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from ptrain.rollout.weight_sync import WeightSyncError
from ptrain.train.state import split_model
from tests.rollout.conftest import CONTEXT, MAX_RUNNING
from tests.rollout.test_fleet import FAST, get_json, settle, worker

pytestmark = pytest.mark.slow
RANK = 4
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"]
PROMPTS = [(5, 9, 2, 44, 17), (3, 3, 8, 1), (60, 12, 7, 7, 7, 30)]
GREEDY = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def adapters_of(params, spec, seed: int) -> dict:
    """Random adapters with B moved off zero (a fresh B is zero: no effect)."""
    ad = init_adapters(params, spec, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def tokens(engine, lora: str | None = None) -> list[list[int]]:
    reqs = [GenerateRequest(p, SamplingParams(**GREEDY), lora_path=lora) for p in PROMPTS]
    futures = [engine.submit(r) for r in reqs]
    return [list(f.result(timeout=300)[0].output_ids) for f in futures]


@pytest.fixture(scope="module")
def setup(served_model_dir, tmp_path_factory):
    """(LoRA workers, a worker without LoRA, model config, spec, two adapter sets, the
    in-process engine's greedy tokens for the base and each set); the in-process engine
    compiles while the workers start."""
    logs = tmp_path_factory.mktemp("fleet-lora-logs")
    procs = [worker(served_model_dir, logs) for _ in range(3)]
    for p in procs[:2]:
        p.cmd += LORA_FLAGS
    for p in procs:
        p.start()
    model = load_hf(served_model_dir)
    _, params, _ = split_model(model)
    spec = LoRASpec.of(LoRAConfig(rank=RANK, alpha=2.0 * RANK, targets=list(SERVABLE)))
    sets = [adapters_of(params, spec, 1), adapters_of(params, spec, 2)]

    def reference() -> dict:
        eng = LocalEngine.from_hf(served_model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT,
                                  max_loras=2, max_lora_rank=8, lora_targets=SERVABLE)  # fmt: skip
        try:
            eng.load_lora("one", adapters=sets[0], spec=spec)
            eng.load_lora("two", adapters=sets[1], spec=spec)
            return {name: tokens(eng, name) for name in (None, "one", "two")}
        finally:
            eng.close()

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            want = pool.submit(reference)
            for p in procs:
                p.wait_healthy()
            want = want.result()
        yield procs[:2], procs[2], model.cfg, spec, sets, want
    finally:
        for p in procs:
            p.stop()


def fleet(urls, cfg, weight_dir: str, served_model_dir: str) -> FleetEngine:
    return FleetEngine(urls=urls, model_cfg=cfg, weight_dir=weight_dir, eos_token_ids=eos_ids_of(served_model_dir),
                       request_timeout_s=120.0, unhealthy_timeout_s=60.0, **FAST)  # fmt: skip


def adapters_on(url: str) -> set[str]:
    return {m["id"] for m in get_json(url + "/v1/models")["data"] if m.get("parent")}


def test_adapter_pushes_reach_every_worker_and_requests_sample_the_current_version(setup, served_model_dir,
                                                                                  tmp_path):  # fmt: skip
    workers, _, cfg, spec, sets, want = setup
    assert want["one"] != want[None] and want["two"] != want["one"]  # the adapters change the tokens
    eng = fleet([w.url for w in workers], cfg, str(tmp_path / "weights"), served_model_dir)
    try:
        settle(eng)  # a worker still compiling its health probe's program would get the adapter later
        assert eng.update_lora("policy", sets[0], spec, weight_version="1") == "1"
        push = eng.last_push
        assert push["kind"] == "lora" and push["adapter"] == "policy-v1"
        assert 0 < push["bytes"] < 200_000 and push["push_s"] > 0 and all(w["ok"] for w in push["workers"].values())
        assert os.path.isfile(tmp_path / "weights" / "v1-lora" / "adapter_config.json")
        assert eng.weight_version == "1"
        for w in workers:
            assert "policy-v1" in adapters_on(w.url)

        # lora_path reaches the workers, both of them (the requests spread over the two)
        assert tokens(eng) == want[None]
        assert tokens(eng, "policy") == want["one"]
        samples = eng.submit(GenerateRequest(PROMPTS[0], SamplingParams(**GREEDY), lora_path="policy")).result(60)
        assert samples[0].weight_version == "1"

        # a new version: requests without lora_path use it once it is the default
        eng.set_default_lora("policy")
        assert eng.default_lora == "policy"
        assert eng.update_lora("policy", sets[1], spec, weight_version="2") == "2"
        assert tokens(eng) == want["two"]
        samples = eng.submit(GenerateRequest(PROMPTS[1], SamplingParams(**GREEDY))).result(60)
        assert samples[0].weight_version == "2"
        assert [w["version"] for w in eng.info()["workers"]] == ["2", "2"]
        for w in workers:  # the drain push returned after the old version was unloaded everywhere
            assert {a for a in adapters_on(w.url) if a.startswith("policy-")} == {"policy-v2"}
        assert eng.loras()["policy"]["served"] == "policy-v2"
    finally:
        eng.close()


def test_a_worker_without_lora_refuses_the_adapter_naming_the_flags(setup, served_model_dir, tmp_path):
    _, plain, cfg, spec, sets, _ = setup
    eng = fleet([plain.url], cfg, str(tmp_path / "weights"), served_model_dir)
    try:
        with pytest.raises(WeightSyncError) as e:
            eng.update_lora("policy", sets[0], spec, weight_version="1")
        msg = str(e.value)
        assert "LoRA is not enabled" in msg and plain.url in msg
        assert f"--enable-lora --max-lora-rank {RANK} --lora-target-modules q_proj" in msg
        assert eng.loras() == {}  # requests keep the base model
    finally:
        eng.close()
