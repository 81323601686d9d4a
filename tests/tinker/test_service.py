"""The service behind `python -m ptrain.tinker`, called directly: LoRA models over one base,
checkpoints by tinker:// path, samplers pinned to saved weights, and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from ptrain.client import Datum
from ptrain.tinker.service import TinkerError, TinkerService


@pytest.fixture(scope="module")
def service(tinker_model_dir, tmp_path_factory):
    s = TinkerService(tinker_model_dir, base_model="tiny", root_dir=str(tmp_path_factory.mktemp("tinker_root")))
    yield s
    s.close()


def datum(service, text: str) -> Datum:
    ids = service.base.tokenizer.encode(text)
    return Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, np.float32)})


def test_models_train_their_own_adapters_and_samplers_serve_saved_weights(service):
    session = service.create_session()
    a = service.create_model(session, "tiny", {"rank": 8})
    b = service.create_model(session, "tiny", {"rank": 4, "train_unembed": False})
    info = service.get_info(a)
    assert info["is_lora"] and info["lora_rank"] == 8 and info["model_data"]["tokenizer_id"] == service.model_path
    data = [datum(service, "User: What is 2 + 3?\n\nAssistant: 5")]
    start = service.forward_backward(b, data, "cross_entropy", None, True).loss
    losses = []
    for _ in range(4):
        losses.append(service.forward_backward(a, data, "cross_entropy", None, False).loss)
        service.optim_step(a, {"learning_rate": 5e-3})
    assert losses[-1] < losses[0]
    assert service.forward_backward(b, data, "cross_entropy", None, True).loss == pytest.approx(start, rel=1e-6)

    prompt = data[0].tokens[:6]
    for model in (a, b):  # a adapts the output head (merged weights); b is an adapter of the shared engine
        path = service.save_for_sampler(model, None)
        sampler = service.create_sampling_session(session, path, None)
        assert service.sampler_info(sampler)["model_path"] == path
        out = service.sample(prompt=list(prompt), num_samples=2, sampling_params={"max_tokens": 6, "seed": 3},
                             sampling_session_id=sampler, prompt_logprobs=True)  # fmt: skip
        assert len(out["sequences"]) == 2 and out["prompt_logprobs"][0] is None
        seq = out["sequences"][0]
        full = list(prompt) + seq["tokens"]
        check = Datum(full[:-1], {"target_tokens": np.array(full[1:]), "weights": np.ones(len(full) - 1)})
        logp = service.forward_backward(model, [check], "cross_entropy", None, True).logprobs[0]
        np.testing.assert_allclose(logp[len(prompt) - 1 :], seq["logprobs"], atol=3e-5)
        np.testing.assert_allclose(logp[: len(prompt) - 1], out["prompt_logprobs"][1:], atol=3e-5)

    saved = service.save_state(a, "first")
    assert saved == f"tinker://{a}/weights/first"
    copy = service.create_model_from_state(session, saved, True)
    np.testing.assert_allclose(
        service.forward_backward(copy, data, "cross_entropy", None, True).loss,
        service.forward_backward(a, data, "cross_entropy", None, True).loss,
        rtol=1e-6,
    )
    kinds = {c["checkpoint_type"] for c in service.checkpoints(a)}
    assert kinds == {"training", "sampler"}


def test_stop_strings_cut_the_sample_after_the_stop(service):
    text = "ab ab ab ab ab ab ab ab"
    session = service.create_session()
    model = service.create_model(session, "tiny", {"rank": 4, "train_unembed": False})
    data = [datum(service, text)]
    for _ in range(30):
        service.forward_backward(model, data, "cross_entropy", None, False)
        service.optim_step(model, {"learning_rate": 2e-2})
    path = service.save_for_sampler(model, "memorised")
    prompt = service.base.tokenizer.encode("ab ab")
    out = service.sample(prompt=prompt, num_samples=1, model_path=path,
                         sampling_params={"max_tokens": 12, "temperature": 0.0, "stop": [" ab ab"]})  # fmt: skip
    (seq,) = out["sequences"]
    assert seq["stop_reason"] == "stop"
    assert service.detok.text(seq["tokens"]).endswith(" ab ab")
    before = service._shared.stats["output_tokens"]
    two = service.sample(prompt=prompt, num_samples=2, model_path=path,
                         sampling_params={"max_tokens": 200, "temperature": 0.0, "stop": " ab ab"})  # fmt: skip
    assert [s["tokens"] for s in two["sequences"]] == [seq["tokens"]] * 2
    assert service._shared.stats["output_tokens"] - before < 200  # stopped early, not run to max_tokens


def finished(service) -> str:
    """A session that the SDK's ServiceClient.close ended (its first reason stays)."""
    session = service.create_session()
    service.finish_session(session, "success", "done")
    service.finish_session(session, "errored")
    return session


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s, m: s.create_model("session-nope", "tiny", {"rank": 4}), "unknown session_id"),
        (
            lambda s, m: s.create_model(finished(s), "tiny", {"rank": 4}),
            r"was finished \(success\); a new ServiceClient",
        ),
        (lambda s, m: s.create_model(s.create_session(), "other-model", {"rank": 4}), "is not served here"),
        (lambda s, m: s.create_model(s.create_session(), "tiny", {"rank": 0}), r"rank must be an integer in \[1, 64\]"),
        (lambda s, m: s.create_model(s.create_session(), "tiny", {"rank": 4, "alpha": 2}), r"\['alpha'\] are unknown"),
        (
            lambda s, m: s.create_model(
                s.create_session(), "tiny", {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}
            ),
            "trains nothing",
        ),  # fmt: skip
        (lambda s, m: s.get_info("model-nope"), "unknown model_id 'model-nope'"),
        (lambda s, m: s.optim_step(m, {"learning_rate": 1e-3}), "no gradient accumulated"),
        (lambda s, m: s.load_state(m, "s3://bucket/x", True), "is not a tinker:// path"),
        (lambda s, m: s.load_state(m, f"tinker://{m}/weights/missing", True), "no checkpoint at"),
        (lambda s, m: s.load_state(m, f"tinker://{m}/sampler_weights/x", True), "is a sampler_weights path"),
        (lambda s, m: s.sample(prompt=[], num_samples=1, sampling_params={"max_tokens": 2}), "holds no tokens"),
        (lambda s, m: s.sample(prompt=[1], num_samples=1, sampling_params={}), "max_tokens is required"),
        (lambda s, m: s.sample(prompt=[10**6], num_samples=1, sampling_params={"max_tokens": 2}), "outside the vocab"),
        (
            lambda s, m: s.sample(prompt=[1], num_samples=1, sampling_params={"max_tokens": 2, "stop": ["a", 3]}),
            "strings or token ids",
        ),  # fmt: skip
        (lambda s, m: s.sampler_info("sampler-nope"), "unknown sampling session"),
        (lambda s, m: s.save_state(m, "../escape"), "checkpoint name"),
    ],
)
def test_bad_requests_are_refused_with_the_fix(service, call, message):
    model = service.create_model(service.create_session(), "tiny", {"rank": 4})
    with pytest.raises((TinkerError, ValueError), match=message):
        call(service, model)
