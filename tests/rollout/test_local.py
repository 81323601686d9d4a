"""LocalEngine: parity with the full forward and the trainer's log-probs, continuous batching,
prefix sharing, weight swaps, aborts, bad requests. One tiny model, one engine per module."""

import asyncio
import os
import pathlib
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.losses.logprobs import token_logprobs_from_hidden
from ptrain.models import Decoder, generate, save_hf
from ptrain.rollout.local import EngineClosed, LocalEngine, WeightsError
from ptrain.rollout.protocol import GenerateRequest, RequestError, SamplingParams

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=128)
CTX = 64
EOS = 63


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def engine(model):
    eng = LocalEngine(model, max_running_requests=8, context_length=CTX, eos_token_ids=[EOS], decode_steps=4)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def forward(model):
    """Trainer-side forward of one sequence (padded to CTX: causal, so padding after does not
    change earlier positions): (logits [L, V], the trainer's token log-probs [L-1] at T)."""
    graphdef, state = nnx.split(model)

    @jax.jit(static_argnums=2)
    def run(st, ids, temperature):
        m = nnx.merge(graphdef, st)
        h = m(ids, return_hidden=True)
        logits = m.logits_from_hidden(h)
        lp = token_logprobs_from_hidden(h[:, :-1], m.head_weight(), ids[:, 1:], chunk_size=16, temperature=temperature)
        return logits[0], lp[0]

    def call(seq, temperature=1.0):
        padded = np.zeros((1, CTX), np.int32)
        padded[0, : len(seq)] = seq
        logits, lp = run(state, jnp.asarray(padded), temperature)
        return np.asarray(logits)[: len(seq)], np.asarray(lp)[: len(seq) - 1]

    return call


def req(prompt, rid="", **sp):
    return GenerateRequest(tuple(prompt), SamplingParams(**sp), rid=rid)


def prompts(n, seed=0, lo=3, hi=20):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, EOS, rng.integers(lo, hi)).tolist() for _ in range(n)]


def count_compiles():
    """A list that grows by one per XLA compilation (jax.monitoring's public listener)."""
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_a, **_k: events.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    return events


COMPILES = count_compiles()


def test_greedy_is_the_full_forward_argmax_path(engine, forward):
    ps = prompts(5, seed=1)
    outs = engine.generate_many([req(p, max_new_tokens=8, temperature=0.0, ignore_eos=True) for p in ps])
    for p, (s,) in zip(ps, outs):
        seq = list(p)
        for _ in range(8):
            seq.append(int(np.argmax(forward(seq)[0][-1])))
        assert list(s.output_ids) == seq[len(p) :]
        assert s.finish_reason.type == "length" and s.finish_reason.length == 8
        _, lp = forward(seq)
        np.testing.assert_allclose(s.logprobs, lp[len(p) - 1 :], atol=1e-4)
        assert s.logprobs == s.sampling_logprobs  # greedy: one distribution


def test_a_long_prompt_prefilled_in_chunks_matches_the_full_forward(model, forward):
    """A 50-token prompt through 16-token prefill chunks (bounded activations): the prompt's
    log-probs and the greedy continuation are the full forward's."""
    prompt = prompts(1, seed=7, lo=50, hi=51)[0]
    with LocalEngine(model, max_running_requests=2, context_length=CTX, decode_steps=4, prefill_chunk=16) as eng:
        sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        ((s,),) = eng.generate_many([GenerateRequest(tuple(prompt), sampling, return_prompt_logprobs_from=0)])
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(np.argmax(forward(seq)[0][-1])))
    assert list(s.output_ids) == seq[len(prompt) :]
    np.testing.assert_allclose(s.prompt_logprobs, forward(prompt)[1], atol=1e-4)


def test_sampled_logprobs_equal_the_trainers_full_vocabulary_logprobs(engine, forward):
    """logprobs: the trainer's log softmax(logits / T) on the same tokens (within 1e-4 in
    float32); sampling_logprobs: the truncated distribution, which puts more mass on each
    kept token."""
    ps = prompts(4, seed=2)
    outs = engine.generate_many(
        [req(p, max_new_tokens=10, temperature=0.7, top_k=8, top_p=0.9, sampling_seed=i) for i, p in enumerate(ps)]
    )
    for p, (s,) in zip(ps, outs):
        _, lp = forward(list(p) + list(s.output_ids), temperature=0.7)
        np.testing.assert_allclose(s.logprobs, lp[len(p) - 1 :], atol=1e-4)
        assert all(a <= b + 1e-6 for a, b in zip(s.logprobs, s.sampling_logprobs))
        assert any(b - a > 1e-3 for a, b in zip(s.logprobs, s.sampling_logprobs))


def test_seeded_samples_do_not_depend_on_the_batch(engine, model):
    """20 requests on 8 rows (queued, admitted as rows free up, with different lengths) give
    each request the tokens it gets alone, and the tokens a static batch with the same seed
    draws; a second wave of the same shapes compiles nothing."""
    ps = prompts(20, seed=3)
    lengths = [3 + (i * 7) % 13 for i in range(20)]
    wave = [
        req(p, rid=f"w{i}", max_new_tokens=n, temperature=1.0, sampling_seed=100 + i, ignore_eos=True)
        for i, (p, n) in enumerate(zip(ps, lengths))
    ]
    together = engine.generate_many(wave)
    alone = [engine.generate_many([w])[0] for w in wave[:4]]
    for a, b in zip(together, alone):
        assert a[0].output_ids == b[0].output_ids
    static = generate(model, [ps[0]], max_new_tokens=lengths[0], temperature=1.0, rng=jax.random.key(100))
    assert list(together[0][0].output_ids) == static.tokens_BxN[0].tolist()
    before = len(COMPILES)
    again = engine.generate_many(wave)
    assert len(COMPILES) == before, "a wave of already-seen shapes recompiled"
    assert [o[0].output_ids for o in again] == [o[0].output_ids for o in together]


def test_group_shares_one_prefill_and_a_longer_turn_reuses_its_prefix(engine):
    engine.flush_cache()
    p = prompts(1, seed=4, lo=30, hi=31)[0]
    before = dict(engine.stats)
    group = engine.generate_many([req(p, max_new_tokens=6, temperature=1.0, n=4, sampling_seed=5, ignore_eos=True)])[0]
    assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == len(p) - 1  # one prefill for 4 samples
    assert [s.index for s in group] == [0, 1, 2, 3] and len({s.output_ids for s in group}) > 1
    assert [s.cached_tokens for s in group] == [0, len(p) - 1, len(p) - 1, len(p) - 1]
    # The next turn: the conversation so far plus a tool result.
    turn = list(p) + list(group[2].output_ids) + [7, 8, 9]
    second = engine.generate_many([req(turn, max_new_tokens=5, temperature=0.0, ignore_eos=True)])[0][0]
    assert second.cached_tokens == len(p) + len(group[2].output_ids) - 1
    engine.flush_cache()
    fresh = engine.generate_many([req(turn, max_new_tokens=5, temperature=0.0, ignore_eos=True)])[0][0]
    assert fresh.cached_tokens == 0 and fresh.output_ids == second.output_ids
    np.testing.assert_allclose(fresh.logprobs, second.logprobs, atol=1e-5)


def test_prefix_cache_evicts_the_least_recently_used_row(engine):
    engine.flush_cache()
    ps = prompts(9, seed=6, lo=12, hi=13)
    for p in ps[:8]:  # one idle row each
        engine.generate_many([req(p, max_new_tokens=1, temperature=0.0)])
    engine.generate_many([req(ps[8], max_new_tokens=1, temperature=0.0)])  # evicts ps[0]'s row
    assert engine.generate_many([req(ps[7], max_new_tokens=1, temperature=0.0)])[0][0].cached_tokens == 11
    assert engine.generate_many([req(ps[0], max_new_tokens=1, temperature=0.0)])[0][0].cached_tokens == 0


def test_stops_eos_context_and_zero_tokens(engine, forward):
    p = prompts(1, seed=7)[0]
    free = engine.generate_many([req(p, max_new_tokens=12, temperature=0.0, ignore_eos=True)])[0][0]
    stop = free.output_ids[3]
    first = free.output_ids.index(stop)
    s = engine.generate_many([req(p, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])])[0][0]
    assert s.finish_reason.type == "stop" and s.finish_reason.matched == stop
    assert s.output_ids == free.output_ids[: first + 1]
    # The context length caps prompt + output.
    long = engine.generate_many([req(list(range(1, 51)), max_new_tokens=100, temperature=0.0, ignore_eos=True)])[0][0]
    assert len(long.output_ids) == CTX - 50 and long.finish_reason.type == "length"
    # Zero new tokens with prompt log-probs (SGLang's logprob_start_len): tokens 1.. of the prompt.
    zero = engine.generate_many(
        [GenerateRequest(tuple(p), SamplingParams(max_new_tokens=0), return_prompt_logprobs_from=0)]
    )
    (z,) = zero[0]
    assert z.output_ids == () and z.finish_reason.type == "length"
    np.testing.assert_allclose(z.prompt_logprobs, forward(p)[1], atol=1e-4)


def test_eos_stops_unless_ignored(engine, model):
    """The engine's eos ids end a sample (finish stop, matched), unless ignore_eos."""
    p = [9, 8, 7]
    free = engine.generate_many([req(p, max_new_tokens=8, temperature=0.0, ignore_eos=True)])[0][0]
    eos = free.output_ids[2]
    first = free.output_ids.index(eos)
    with LocalEngine(model, max_running_requests=8, context_length=CTX, eos_token_ids=[eos], decode_steps=4) as eng:
        s = eng.generate_many([req(p, max_new_tokens=8, temperature=0.0)])[0][0]
        assert s.output_ids == free.output_ids[: first + 1] and s.finish_reason.matched == eos
        s = eng.generate_many([req(p, max_new_tokens=8, temperature=0.0, ignore_eos=True)])[0][0]
        assert s.output_ids == free.output_ids


def test_abort_one_request_one_sample_or_all(engine):
    started = threading.Event()

    def on_update(samples):
        if sum(len(s.output_ids) for s in samples) >= 4:
            started.set()

    long = dict(max_new_tokens=CTX - 10, temperature=1.0, ignore_eos=True)
    f = engine.submit(req([1, 2, 3], rid="long", n=2, **long), on_update=on_update)
    other = engine.submit(req([4, 5, 6], rid="other", **long))
    assert started.wait(60)
    assert engine.abort("long-1") == 1
    assert engine.abort("long") == 1
    s0, s1 = f.result(60)
    assert s0.finish_reason.type == "abort" and s1.finish_reason.type == "abort"
    assert 0 < len(s1.output_ids) < CTX - 10 and len(s1.logprobs) == len(s1.output_ids)
    assert engine.abort() >= 1 and other.result(60)[0].finish_reason.type == "abort"
    assert engine.abort("nothing-by-this-name") == 0


def test_bad_requests_name_the_problem(engine):
    cases = [
        (req([]), "empty"),
        (req([1, 64]), "outside the vocabulary"),
        (req([1] * CTX), "context length"),
        (req([1], n=9), "max_running_requests"),
        (req([1], top_p=0.0), "top_p"),
        (req([1], stop_token_ids=[99]), "stop_token_ids"),
        (req([1], sampling_seed=2**64), "sampling_seed: must fit in 64 bits"),  # it used to end the engine thread
        (GenerateRequest((1, 2), return_prompt_logprobs_from=2), "logprob_start_len"),
    ]
    for bad, words in cases:
        with pytest.raises(RequestError, match=words):
            engine.submit(bad)
    f = engine.submit(req([1, 2], rid="dup", max_new_tokens=CTX - 4, ignore_eos=True))
    with pytest.raises(RequestError, match="already in flight"):
        engine.submit(req([1, 2], rid="dup"))
    engine.abort("dup")
    f.result(60)
    for params, words in [
        ({"max_new_tokens": 4, "tempreature": 1.0}, "unknown key"),
        ({"frequency_penalty": 0.5}, "does not implement"),
        ({"n": "2"}, "integer"),
        ({"stop_token_ids": [1, "x"]}, "list of integers"),
        ({"n": 0}, "n: must be >= 1"),
    ]:
        with pytest.raises(RequestError, match=words):
            SamplingParams.from_dict(params)
    assert SamplingParams.from_dict({"max_new_tokens": 3, "stop_token_ids": [1], "frequency_penalty": 0.0}) == (
        SamplingParams(max_new_tokens=3, stop_token_ids=(1,))
    )
    assert engine.generate_many([req([1, 2], max_new_tokens=2)])[0][0].completion_tokens == 2  # still serving


def test_weight_swaps_drain_in_place_and_abort(model):
    eng = LocalEngine(model, max_running_requests=4, context_length=CTX, decode_steps=2, weight_version="v0")
    try:
        p = [3, 1, 4, 1, 5]
        before = eng.generate_many([req(p, max_new_tokens=6, temperature=0.0, ignore_eos=True)])[0][0]
        other = Decoder(CFG, rngs=nnx.Rngs(7))
        _, new_params, _ = nnx.split(other, nnx.Param, ...)
        new_params = nnx.to_pure_dict(new_params)
        # drain: the running request finishes on v0, then the swap.
        started = threading.Event()
        running = eng.submit(
            req(p, max_new_tokens=CTX - 8, temperature=0.0, ignore_eos=True), on_update=lambda s: started.set()
        )
        assert started.wait(60)  # admitted before the swap is asked for
        assert eng.update_weights(new_params, weight_version="v1") == "v1"
        old = running.result(60)[0]
        assert old.weight_version == "v0" and [w.version for w in old.weight_versions] == ["v0"]
        after = eng.generate_many([req(p, max_new_tokens=6, temperature=0.0, ignore_eos=True)])[0][0]
        ref = generate(other, [p], max_new_tokens=6)
        assert after.weight_version == "v1" and list(after.output_ids) == ref.tokens_BxN[0].tolist()
        assert not np.allclose(after.logprobs, before.logprobs, atol=1e-3)
        n_compiles = len(COMPILES)
        eng.update_weights(new_params, weight_version="v1")
        again = eng.generate_many([req(p, max_new_tokens=6, temperature=0.0, ignore_eos=True)])[0][0]
        assert again.output_ids == after.output_ids and len(COMPILES) == n_compiles, "a weight swap recompiled"
        # in place, from the engine's own callback after 3 tokens: the sample continues on v2.
        _, back, _ = nnx.split(model, nnx.Param, ...)
        back = nnx.to_pure_dict(back)

        def swap_midway(samples):
            if len(samples[0].output_ids) >= 3 and eng.weight_version == "v1":
                eng.update_weights(back, weight_version="v2", mode="in_place")

        mixed = eng.submit(req(p, max_new_tokens=12, temperature=0.0, ignore_eos=True), on_update=swap_midway)
        m = mixed.result(60)[0]
        assert [w.version for w in m.weight_versions] == ["v1", "v2"] and m.weight_version == "v2"
        assert m.weight_versions[0].end == m.weight_versions[1].start >= 3
        # abort: the running sample ends with abort and keeps its tokens.
        started = threading.Event()
        running = eng.submit(
            req(p, max_new_tokens=CTX - 8, temperature=1.0, ignore_eos=True),
            on_update=lambda s: started.set() if s[0].output_ids else None,
        )
        assert started.wait(60)
        eng.update_weights(new_params, weight_version="v3", mode="abort")
        cut = running.result(60)[0]
        assert cut.finish_reason.type == "abort" and cut.output_ids
        with pytest.raises(WeightsError, match="differ"):
            eng.update_weights(jax.tree.map(lambda x: x[..., :1], new_params))
        assert eng.weight_version == "v3"
    finally:
        eng.close()


def test_update_weights_from_disk_checks_the_folder(model, tmp_path):
    eng = LocalEngine(model, max_running_requests=2, context_length=32, decode_steps=2)
    try:
        p = [2, 7, 1, 8]
        served = eng.generate_many([req(p, max_new_tokens=4, temperature=0.0)])[0][0].output_ids
        other = Decoder(CFG, rngs=nnx.Rngs(11))
        save_hf(other, str(tmp_path / "good"))
        wrong = Decoder(ModelConfig(**{**CFG.__dict__, "d_model": 48}), rngs=nnx.Rngs(0))
        save_hf(wrong, str(tmp_path / "wrong_shape"))
        save_hf(other, str(tmp_path / "corrupt"))
        st = next((tmp_path / "corrupt").glob("*.safetensors"))
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
        for folder, words in [("missing", "no config.json"), ("wrong_shape", "architecture"), ("corrupt", "corrupt")]:
            with pytest.raises(WeightsError, match=words):
                eng.update_weights_from_disk(str(tmp_path / folder))
            assert eng.generate_many([req(p, max_new_tokens=4, temperature=0.0)])[0][0].output_ids == served
        assert eng.update_weights_from_disk(str(tmp_path / "good"), weight_version="step-5") == "step-5"
        got = eng.generate_many([req(p, max_new_tokens=4, temperature=0.0)])[0][0]
        assert list(got.output_ids) == generate(other, [p], max_new_tokens=4).tokens_BxN[0].tolist()
        assert got.weight_version == "step-5" and eng.info()["model_path"] == str(tmp_path / "good")
    finally:
        eng.close()


def test_asyncio_generate_flush_pause_and_close(model):
    eng = LocalEngine(model, max_running_requests=4, context_length=32, decode_steps=2)

    async def many():
        return await asyncio.gather(*(eng.generate(req([i + 1, 2], max_new_tokens=3)) for i in range(10)))

    outs = asyncio.run(many())
    assert [o[0].prompt_ids[0] for o in outs] == list(range(1, 11)) and all(len(o[0].output_ids) == 3 for o in outs)
    eng.pause("in_place")
    waiting = eng.submit(req([5, 6], max_new_tokens=3))
    assert eng.load()["queued"] == 1 and not eng.flush_cache()
    eng.resume()
    assert len(waiting.result(60)[0].output_ids) == 3 and eng.flush_cache()
    eng.pause("in_place")
    pending = eng.submit(req([5, 6], max_new_tokens=3))
    eng.close()
    assert pending.result(60)[0].finish_reason.type == "abort"
    with pytest.raises(EngineClosed):
        eng.submit(req([1]))


@pytest.mark.multidevice
def test_tensor_parallel_mesh_gives_the_single_device_tokens(tmp_path):
    """8 host devices, weights and cache split tensor-parallel over 2 of them (data 4): the
    same greedy tokens and log-probs as one device."""
    script = pathlib.Path(__file__).with_name("local_mesh_script.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok mesh" in proc.stdout
