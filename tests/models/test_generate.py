"""KV-cache generation: cached logits equal the full forward; greedy, sampling, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, generate, init_cache
from ptrain.models.generate import decode_mask, draw_tokens, filter_logits, left_pad, sample_rows

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=64)
PROMPTS = [[5, 9, 11], [7, 3, 2, 8, 1, 4, 6]]


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(1))


_FWD = {}


def _forward(model, ids):
    """Full-forward logits of one sequence, padded to 16 tokens (causal: the padding after
    does not change them) so that a single compiled function serves every call."""
    if id(model) not in _FWD:
        graphdef, state = nnx.split(model)
        f = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
        _FWD[id(model)] = lambda x: f(state, x)
    padded = np.zeros((1, 16), np.int32)
    padded[0, : len(ids)] = ids
    return _FWD[id(model)](jnp.asarray(padded))[0, : len(ids)]


def test_prefill_and_decode_logits_equal_the_full_forward(model):
    """Left-padded batch, prefill then 3 single-token steps against the cache."""
    P, S = 8, 11
    ids, pads = left_pad(PROMPTS, 0, P)
    pads = jnp.asarray(pads)
    nxt = np.array([[12, 13, 14], [21, 22, 23]], np.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        caches = init_cache(CFG, 2, S)
        slots = jnp.arange(P)
        pos = jnp.maximum(slots[None] - pads[:, None], 0)
        logits, caches = m.decode_step(jnp.asarray(ids), pos, decode_mask(pads, slots, S, None), caches, jnp.int32(0))
        outs = [logits]
        for t in range(3):
            slot = jnp.int32(P + t)
            lg, caches = m.decode_step(
                jnp.asarray(nxt[:, t : t + 1]),
                (slot - pads)[:, None],
                decode_mask(pads, slot[None], S, None),
                caches,
                slot,
            )
            outs.append(lg)
        return outs

    outs = run(state)
    for b, prompt in enumerate(PROMPTS):
        seq = prompt + nxt[b].tolist()
        ref = _forward(model, seq)
        n = len(prompt)
        np.testing.assert_allclose(outs[0][b, P - n :], ref[:n], atol=2e-5)
        for t in range(3):
            np.testing.assert_allclose(outs[1 + t][b, 0], ref[n + t], atol=2e-5)


def test_greedy_matches_step_by_step_argmax_and_stops(model):
    out = generate(model, PROMPTS, max_new_tokens=6)
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(np.argmax(_forward(model, seq)[-1])))
        assert out.tokens_BxN[b].tolist() == seq[len(prompt) :]
        ref_lp = jax.nn.log_softmax(_forward(model, seq)[len(prompt) - 1 : -1], axis=-1)
        np.testing.assert_allclose(out.logprobs_BxN[b], ref_lp[np.arange(6), seq[len(prompt) :]], atol=1e-4)
    assert out.finish_reasons == ["length", "length"] and out.lengths_B.tolist() == [6, 6]
    stop = int(out.tokens_BxN[0, 2])
    n = out.tokens_BxN[0].tolist().index(stop) + 1  # the first occurrence ends the row
    out2 = generate(model, PROMPTS, max_new_tokens=6, stop_tokens=[stop], pad_id=63)
    assert out2.finish_reasons[0] == "stop" and out2.lengths_B[0] == n
    assert out2.tokens_BxN[0, :n].tolist() == out.tokens_BxN[0, :n].tolist()
    assert (out2.tokens_BxN[0, n:] == 63).all() and (out2.logprobs_BxN[0, n:] == 0).all()


def test_sampled_logprobs_full_vocabulary_and_filtered(model):
    """logprobs: the tempered full softmax (what the policy loss computes); sampling_logprobs:
    the top-k / top-p filtered distribution the tokens were drawn from."""
    out = generate(model, PROMPTS, max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9, rng=jax.random.key(3))
    one = lambda x: jnp.asarray([x])
    for b, prompt in enumerate(PROMPTS):
        seq = prompt + out.tokens_BxN[b].tolist()
        z = _forward(model, seq)[len(prompt) - 1 : -1] / 0.7
        filt = jax.vmap(lambda r: filter_logits(r[None], one(5), one(0.9), one(0.0))[0])(z)
        idx = np.arange(6), out.tokens_BxN[b]
        np.testing.assert_allclose(out.sampling_logprobs_BxN[b], jax.nn.log_softmax(filt, axis=-1)[idx], atol=1e-4)
        np.testing.assert_allclose(out.logprobs_BxN[b], jax.nn.log_softmax(z, axis=-1)[idx], atol=1e-4)
        assert np.isfinite(out.sampling_logprobs_BxN[b]).all()
        assert (out.logprobs_BxN[b] <= out.sampling_logprobs_BxN[b] + 1e-6).all()  # truncation only adds mass


def test_filter_logits_top_k_top_p_and_min_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))

    def keep(k, p, m=0.0):
        out = filter_logits(logits, jnp.asarray([k]), jnp.asarray([p], jnp.float32), jnp.asarray([m], jnp.float32))
        return np.isfinite(np.asarray(out))[0].tolist()

    assert keep(0, 1.0) == [True, True, True, True]
    assert keep(2, 1.0) == [True, True, False, False]
    assert keep(0, 0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert keep(0, 0.81) == [True, True, True, False]
    assert keep(3, 0.1) == [True, False, False, False]  # the top token always survives
    assert keep(0, 1.0, 0.3) == [True, True, True, False]  # p >= 0.3 * 0.5
    assert keep(0, 1.0, 1.0) == [True, False, False, False]


def _cutoff_by_sorting(z, top_k, top_p, min_p):
    """The nucleus / top-k / min-p cutoff written the obvious way, with a sort."""
    V = z.shape[-1]
    sorted_desc = -np.sort(-z, axis=-1)
    k = np.where((top_k > 0) & (top_k < V), top_k, V)[:, None]
    kth = np.take_along_axis(sorted_desc, k - 1, axis=-1)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(sorted_desc), axis=-1), np.float64)
    before = np.cumsum(probs, axis=-1) - probs
    n_keep = np.maximum(np.sum(before < top_p[:, None], axis=-1, keepdims=True), 1)
    pth = np.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    mth = np.where(min_p[:, None] > 0, sorted_desc[:, :1] + np.log(np.maximum(min_p[:, None], 1e-30)), -np.inf)
    return np.maximum(np.maximum(kth, pth), mth)


def test_filter_cutoff_by_bisection_keeps_what_sorting_keeps():
    r = np.random.default_rng(0)
    B, V = 64, 300
    z = (r.normal(size=(B, V)) * r.uniform(0.5, 4, (B, 1))).astype(np.float32)
    z[::5, :40] = -np.inf  # rows with excluded tokens
    z[1::7, 50:60] = z[1::7, 50:51]  # ties
    top_k = r.choice([0, 1, 5, 50, 299, 400], B).astype(np.int32)
    top_p = r.choice([1.0, 0.95, 0.5, 0.1], B).astype(np.float32)
    min_p = r.choice([0.0, 0.0, 0.05], B).astype(np.float32)
    got = np.asarray(filter_logits(jnp.asarray(z), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p)))
    want = z >= _cutoff_by_sorting(z, top_k, top_p, min_p)
    # float32 against float64 running sums may disagree on a token whose mass sits right at top_p
    differ = np.isfinite(got) != want
    assert differ.sum() <= 2, np.argwhere(differ)
    assert np.isfinite(got).sum(-1).min() >= 1  # the top token always survives


def test_draw_tokens_follows_the_softmax_and_never_draws_an_excluded_token():
    # 700 entries: three blocks of SAMPLE_BLOCK, a zero-mass block between drawable ones,
    # and -inf entries inside a drawable block.
    p = np.zeros(700)
    p[[3, 5, 300, 650, 699]] = [0.1, 0.2, 0.3, 0.15, 0.25]
    z = jnp.log(jnp.asarray(p, jnp.float32)) + 4.0  # a shift: only the softmax matters
    n = 40_000
    u = jax.random.uniform(jax.random.key(0), (n,))
    tok, lse = jax.jit(draw_tokens)(jnp.broadcast_to(z, (n, 700)), u)
    freq = np.bincount(np.asarray(tok), minlength=700) / n
    assert set(np.flatnonzero(freq)) <= {3, 5, 300, 650, 699}
    np.testing.assert_allclose(freq[[3, 5, 300, 650, 699]], p[[3, 5, 300, 650, 699]], atol=0.01)  # ~5 sigma
    np.testing.assert_allclose(np.asarray(lse), 4.0, atol=1e-5)
    # The ends of [0, 1): the first and the last drawable token, never an excluded one.
    edge, _ = draw_tokens(jnp.stack([z, z, z]), jnp.asarray([0.0, np.nextafter(np.float32(1), 0), 0.5]))
    assert edge.tolist() == [3, 699, 300]


def test_sampling_draws_each_row_from_its_tempered_distribution():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1, 0.0]], jnp.float32))
    n = 20_000
    keys = jax.random.split(jax.random.key(1), n)
    row = lambda x, dtype=jnp.float32: jnp.full((n,), x, dtype)
    tok, lp, slp = jax.jit(sample_rows)(
        jnp.broadcast_to(logits, (n, 4)), keys, row(2.0), row(0, jnp.int32), row(1.0), row(0.0)
    )
    want = np.asarray(jax.nn.softmax(logits[0, :3] / 2.0))
    np.testing.assert_allclose(np.bincount(np.asarray(tok), minlength=4)[:3] / n, want, atol=0.015)
    np.testing.assert_allclose(np.asarray(lp), np.log(want)[np.asarray(tok)], atol=1e-5)
    assert (np.asarray(tok) < 3).all() and np.allclose(lp, slp)


def test_bad_requests_are_rejected(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1]], max_new_tokens=100)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], max_new_tokens=2, top_p=0.0)


def test_a_request_that_fits_the_cache_is_served(model):
    """33 prompt tokens + 16 new fit max_seq_len=64 although the power-of-two bucket (64) would
    not: the bucket is capped at 48. A tuple of two 1-D prompts is two prompts, not (ids, lengths)."""
    from ptrain.models.generate import prompt_bucket_for

    assert prompt_bucket_for(33, 16, 64) == 48 and prompt_bucket_for(5, 16, 64) == 16
    out = generate(model, [list(range(1, 34))], max_new_tokens=16)
    assert out.tokens_BxN.shape == (1, 16)
    pair = generate(model, (np.array([5, 9, 11]), np.array([7, 3])), max_new_tokens=2)
    listed = generate(model, [[5, 9, 11], [7, 3]], max_new_tokens=2)
    np.testing.assert_array_equal(pair.tokens_BxN, listed.tokens_BxN)


def test_scanned_layers_generate_the_same_tokens(model, tmp_path):
    """The stacked-cache path (scan_layers) decodes exactly like the per-layer list."""
    from ptrain.models import load_hf, save_hf

    save_hf(model, str(tmp_path))
    scanned = load_hf(str(tmp_path), scan_layers=True)
    a = generate(model, PROMPTS, max_new_tokens=6)
    b = generate(scanned, PROMPTS, max_new_tokens=6)
    assert a.tokens_BxN.tolist() == b.tokens_BxN.tolist()
    np.testing.assert_allclose(a.logprobs_BxN, b.logprobs_BxN, atol=1e-5)
