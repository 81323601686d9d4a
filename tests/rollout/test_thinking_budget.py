"""Thinking budget in LocalEngine: after B generated tokens of open reasoning the engine forces
the end-of-thinking ids, then samples on; a sample that closed its reasoning, or has no budget,
is untouched. Also the budget's SGLang spellings (`custom_params.thinking_budget`,
`max_thinking_tokens`) and their errors. One tiny model; the HTTP routes are in test_server.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, generate
from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.fleet_dispatch import Call, FleetDispatch
from ptrain.rollout.local import LocalEngine
from ptrain.rollout.protocol import GenerateRequest, RequestError, SamplingParams
from tests.rollout import sglang_schema as schema

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=128)
CTX = 64
N = 16
PROMPTS = [[3, 9, 27, 17], [5, 6, 7, 8, 9, 10, 11], [40, 2]]


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def engine(model):
    eng = LocalEngine(model, max_running_requests=4, context_length=CTX, eos_token_ids=[63], decode_steps=4)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def logprobs_of(model):
    """log softmax(logits / T) of each output token under the plain forward (the trainer's number)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits_of(st, ids):
        return nnx.merge(graphdef, st)(ids)

    def call(prompt, output, temperature):
        seq = list(prompt) + list(output)
        padded = np.zeros((1, CTX), np.int32)
        padded[0, : len(seq)] = seq
        z = np.asarray(logits_of(state, jnp.asarray(padded)))[0, : len(seq) - 1].astype(np.float64) / temperature
        lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
        return lp[np.arange(len(prompt) - 1, len(seq) - 1), np.asarray(output)]

    return call


def run(engine, requests):
    return [samples[0] for samples in engine.generate_many(requests)]


def run_together(engine, requests):
    """`run`, with every request admitted before the first decode call (paused while they are
    queued), so that the row and key-length buckets, and so the programs, are the same each time."""
    engine.pause("in_place")
    futures = [engine.submit(r) for r in requests]
    engine.resume()
    return [f.result(120)[0] for f in futures]


def req(prompt, rid="", **sp):
    sp.setdefault("max_new_tokens", N)
    sp.setdefault("ignore_eos", True)
    return GenerateRequest(tuple(prompt), SamplingParams(**sp), rid=rid)


def seeded(i, **sp):
    return dict(temperature=1.0, top_k=8, sampling_seed=700 + i, **sp)


def decode_traces():
    """A list that grows by one whenever `_decode` is traced for jit (a new program; counted
    whether or not the persistent compilation cache then has the executable)."""
    events = []

    def listen(event, _duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration" and kw.get("fun_name") == "_decode":
            events.append(1)

    jax.monitoring.register_event_duration_secs_listener(listen)
    return events


TRACES = decode_traces()


def unused_ids(outputs, k):
    seen = {t for out in outputs for t in out}
    return tuple(t for t in range(CFG.vocab_size - 1) if t not in seen)[:k]


def test_budget_forces_the_end_ids_after_b_tokens_then_sampling_goes_on(engine, logprobs_of):
    """B tokens as without a budget (same seed, same draws), then the three end ids, then
    sampled tokens to max_new_tokens; every log-prob, forced or drawn, is the plain forward's
    log softmax(logits / T), and a forced token's sampling log-prob is that same number."""
    base = run(engine, [req(p, **seeded(i)) for i, p in enumerate(PROMPTS)])
    budgets = [0, 3, 6]
    ends = unused_ids([b.output_ids[:6] for b in base], 3)
    outs = run(
        engine,
        [req(p, **seeded(i, thinking_budget=B, think_end_ids=ends)) for i, (p, B) in enumerate(zip(PROMPTS, budgets))],
    )
    for p, B, b, s in zip(PROMPTS, budgets, base, outs):
        assert s.output_ids[:B] == b.output_ids[:B]
        assert s.output_ids[B : B + 3] == ends
        assert len(s.output_ids) == N and s.finish_reason.type == "length"
        lp = np.asarray(s.logprobs)
        assert np.all(np.isfinite(lp)) and np.all(lp < 0)
        np.testing.assert_allclose(lp, logprobs_of(p, s.output_ids, 1.0), atol=1e-4)
        forced = slice(B, B + 3)
        assert s.sampling_logprobs[forced] == s.logprobs[forced]
        # drawn tokens come from the top 8, where the truncated log-prob is the larger one
        assert all(a < b for a, b in zip(s.logprobs[B + 3 :], s.sampling_logprobs[B + 3 :]))


def test_forcing_completes_the_models_own_partial_end_sequence(engine):
    """When the sample's last token already starts the end sequence, only the rest is forced
    (as SGLang's strict-thinking grammar does)."""
    (b,) = run(engine, [req(PROMPTS[0], temperature=0.0)])
    B = 5
    x = unused_ids([b.output_ids], 1)[0]
    (s,) = run(engine, [req(PROMPTS[0], temperature=0.0, thinking_budget=B, think_end_ids=(b.output_ids[B - 1], x))])
    assert s.output_ids[:B] == b.output_ids[:B]
    assert s.output_ids[B] == x and len(s.output_ids) == N


def test_a_sample_that_closes_its_reasoning_first_is_unchanged(engine):
    """The end ids generated by the sample itself, at or before the budget: the same tokens as
    without a budget (and the same log-probs, from the forcing program)."""
    base = run(engine, [req(p, **seeded(i)) for i, p in enumerate(PROMPTS)])
    requests = []
    for i, (p, b) in enumerate(zip(PROMPTS, base)):
        ends = tuple(b.output_ids[2:4])  # closed once token 3 is out
        requests.append(req(p, **seeded(i, thinking_budget=[4, 4, 10][i], think_end_ids=ends)))
    outs = run(engine, requests)
    for b, s in zip(base, outs):
        assert s.output_ids == b.output_ids
        np.testing.assert_allclose(s.logprobs, b.logprobs, rtol=0, atol=1e-6)


def test_without_a_budget_the_plain_program_runs_and_tokens_are_unchanged(model):
    """No budget: the tokens of the static generator with the same seed, and the same program
    as before (a repeat traces nothing). A budget in the batch runs another program, and the
    samples without one draw the same tokens in it; afterwards the plain program is back.
    Three rows: shapes no other test uses, so no earlier test has traced these programs (jit's
    trace cache is keyed on the function, shared by every engine)."""
    engine = LocalEngine(model, max_running_requests=3, context_length=CTX, eos_token_ids=[63], decode_steps=4)
    try:
        check_plain_and_forcing_programs(engine, model)
    finally:
        engine.close()


def check_plain_and_forcing_programs(engine, model):
    wave = [req(p, **seeded(i)) for i, p in enumerate(PROMPTS)]
    plain = run_together(engine, wave)
    static = generate(model, [PROMPTS[1]], max_new_tokens=N, temperature=1.0, top_k=8, rng=jax.random.key(701))
    assert list(plain[1].output_ids) == static.tokens_BxN[0].tolist()
    before = len(TRACES)
    again = run_together(engine, wave)
    assert len(TRACES) == before, "a repeat of a wave without budgets traced a new decode program"
    assert [s.output_ids for s in again] == [s.output_ids for s in plain]
    ends = unused_ids([s.output_ids for s in plain], 2)
    mixed = run_together(engine, [req(PROMPTS[0], **seeded(0, thinking_budget=2, think_end_ids=ends)), *wave[1:]])
    assert len(TRACES) > before, "a budget in the batch should run the forcing program"
    for s, p in zip(mixed[1:], plain[1:]):
        assert s.output_ids == p.output_ids
        # another program: equal here on XLA:CPU, but fusion may move the last bit elsewhere
        np.testing.assert_allclose(s.logprobs, p.logprobs, rtol=0, atol=1e-6)
    before = len(TRACES)
    last = run_together(engine, wave)
    assert len(TRACES) == before
    assert [s.output_ids for s in last] == [s.output_ids for s in plain]
    assert [s.logprobs for s in last] == [s.logprobs for s in plain]


def test_decode_steps_one_and_four_force_the_same_tokens(model, engine):
    """Forcing state carried inside the multi-step jitted loop (budgets that end mid-call and
    forced sequences that cross a call boundary) gives the one-step engine's tokens."""
    plain = run(engine, [req(p, **seeded(i)) for i, p in enumerate(PROMPTS)])
    ends = unused_ids([s.output_ids for s in plain], 3)
    requests = [
        req(p, **seeded(i, thinking_budget=B, think_end_ids=ends)) for i, (p, B) in enumerate(zip(PROMPTS, [1, 2, 7]))
    ]
    four = run(engine, requests)
    one_step = LocalEngine(model, max_running_requests=4, context_length=CTX, eos_token_ids=[63], decode_steps=1)
    try:
        one = run(one_step, requests)
    finally:
        one_step.close()
    for a, b, B in zip(four, one, [1, 2, 7]):
        assert a.output_ids == b.output_ids and a.output_ids[B : B + 3] == ends
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_budget_at_or_past_max_new_tokens_forces_nothing(engine):
    (b,) = run(engine, [req(PROMPTS[2], temperature=0.0, max_new_tokens=6)])
    ends = unused_ids([b.output_ids], 2)
    (s,) = run(engine, [req(PROMPTS[2], temperature=0.0, max_new_tokens=6, thinking_budget=6, think_end_ids=ends)])
    assert s.output_ids == b.output_ids
    (s,) = run(engine, [req(PROMPTS[2], temperature=0.0, max_new_tokens=6, thinking_budget=5, think_end_ids=ends)])
    assert s.output_ids == b.output_ids[:5] + ends[:1]  # forcing cut by max_new_tokens


# ---- the wire: SGLang's spellings and the errors ----


@pytest.mark.parametrize(
    "custom, words",
    [
        ({"thinking_budget": -1}, r"custom_params.thinking_budget: must be >= 0, got -1; leave it out"),
        ({"thinking_budget": "8"}, r"custom_params.thinking_budget: must be an integer"),
        ({"thinking_budget": 2.5}, r"custom_params.thinking_budget: must be an integer"),
        ({"thinking_budget": True}, r"custom_params.thinking_budget: must be an integer"),
        ({"thinking_budget": 4, "temperature_schedule": 1}, r"\['temperature_schedule'\] are not implemented"),
        ({"__sglang_reasoning_end_token_ids": []}, r"__sglang_reasoning_end_token_ids: must be a non-empty list"),
        ({"__sglang_reasoning_end_token_ids": [1, -2]}, r"__sglang_reasoning_end_token_ids: must be a non-empty list"),
        ([1], r"custom_params: must be an object"),
    ],
)
def test_from_dict_refuses_bad_budgets_naming_the_key(custom, words):
    with pytest.raises(RequestError, match=words):
        SamplingParams.from_dict({"max_new_tokens": 8, "custom_params": custom})


def test_the_budget_round_trips_through_sglangs_sampling_params():
    sp = SamplingParams(max_new_tokens=8, thinking_budget=5, think_end_ids=(7, 8))
    d = sp.to_dict()
    assert d == {
        "max_new_tokens": 8,
        "custom_params": {"thinking_budget": 5, "__sglang_reasoning_end_token_ids": [7, 8]},
    }
    assert SamplingParams.from_dict(d) == sp
    assert SamplingParams.from_dict({"custom_params": {"thinking_budget": None}}) == SamplingParams()
    schema.check_generate_request({"input_ids": [1, 2], "sampling_params": d})
    with pytest.raises(RequestError, match=r"thinking_budget\): must be an integer >= 0, got -3"):
        SamplingParams(thinking_budget=-3).validate()
    with pytest.raises(RequestError, match="at most 32 ids"):
        SamplingParams(thinking_budget=1, think_end_ids=tuple(range(33))).validate()


def test_the_engine_refuses_a_budget_it_cannot_force(engine):
    with pytest.raises(RequestError, match="needs the end-of-thinking token ids"):
        engine.submit(req([1, 2], thinking_budget=4))
    with pytest.raises(RequestError, match=r"think_end_ids\): \[64\] outside the vocabulary"):
        engine.submit(req([1, 2], thinking_budget=4, think_end_ids=(5, 64)))


def test_generate_takes_max_thinking_tokens_and_custom_params():
    body = {"input_ids": [1, 2, 3], "max_thinking_tokens": 6, "sampling_params": {"max_new_tokens": 8}}
    schema.check_generate_request(body)
    (r,) = wire.parse_generate(body).requests
    assert r.sampling.thinking_budget == 6 and r.sampling.think_end_ids == ()
    body = {"input_ids": [[1], [2]], "sampling_params": {"custom_params": {"thinking_budget": 3}}}
    schema.check_generate_request(body)
    assert [r.sampling.thinking_budget for r in wire.parse_generate(body).requests] == [3, 3]
    same = {**body, "max_thinking_tokens": 3}
    assert [r.sampling.thinking_budget for r in wire.parse_generate(same).requests] == [3, 3]
    with pytest.raises(RequestError, match="max_thinking_tokens=4 and sampling_params.custom_params.thinking_budget=3"):
        wire.parse_generate({**body, "max_thinking_tokens": 4})
    for bad in (-1, "4", 1.5):
        with pytest.raises(RequestError, match="max_thinking_tokens: must be an integer >= 0"):
            wire.parse_generate({"input_ids": [1], "max_thinking_tokens": bad})
    with pytest.raises(RequestError, match=r"sampling_params\[1\].custom_params.thinking_budget: must be >= 0"):
        wire.parse_generate(
            {"input_ids": [[1], [2]], "sampling_params": [{}, {"custom_params": {"thinking_budget": -5}}]}
        )
    with pytest.raises(RequestError, match="custom_logit_processor: .* max_thinking_tokens"):
        wire.parse_generate({"input_ids": [1], "custom_logit_processor": "{}"})


def test_the_fleet_sends_the_budget_as_max_thinking_tokens():
    """SGLang enforces max_thinking_tokens (with strict thinking) or refuses it; custom_params
    alone would be ignored there. Our server reads both, and they agree."""
    request = GenerateRequest((1, 2), SamplingParams(thinking_budget=9), rid="r")
    call = Call(request, request.sampling, future=None, on_update=None, submit_time=0.0, wire_rid="r#0")
    body = FleetDispatch(state=None, health=None)._body(call)
    assert body["max_thinking_tokens"] == 9 and body["sampling_params"]["custom_params"] == {"thinking_budget": 9}
    schema.check_generate_request(body)
    assert wire.parse_generate(body).requests[0].sampling.thinking_budget == 9
