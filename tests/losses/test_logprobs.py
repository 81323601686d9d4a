"""Chunked log-prob / entropy statistics: values against float64 numpy, gradients, extremes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ptrain.losses import (
    entropy_from_logits,
    sequence_logprobs,
    token_logprobs,
    token_logprobs_from_hidden,
    vocab_stats,
    vocab_stats_from_hidden,
)

B, L, V, D = 2, 3, 11, 5


def _np_stats(logits, targets, temperature=1.0):
    """float64 reference: log_softmax gather, entropy, logsumexp, mean logit."""
    z = np.asarray(logits, np.float64) / temperature
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    logsm = z - lse[..., None]
    p = np.exp(logsm)
    logp = np.take_along_axis(logsm, np.asarray(targets)[..., None], -1)[..., 0]
    ent = -(p * np.where(p > 0, logsm, 0.0)).sum(-1)
    return logp, ent, lse, z.mean(-1)


def _reference_objective(z, targets):
    """Plain-jnp weighted sum of all statistics, for gradient comparison."""
    logsm = jax.nn.log_softmax(z)
    logp = jnp.take_along_axis(logsm, targets[..., None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logsm) * logsm, -1)
    lse = jax.nn.logsumexp(z, -1)
    return jnp.sum(2.0 * logp + 0.3 * ent + 0.1 * lse**2 + z.mean(-1))


def _stats_objective(stats):
    return jnp.sum(2.0 * stats.logp + 0.3 * stats.entropy + 0.1 * stats.lse**2 + stats.mean_logit)


@pytest.fixture(scope="module")
def data():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    return dict(
        logits=3.0 * jax.random.normal(k1, (B, L, V)),
        targets=jax.random.randint(k2, (B, L), 0, V),
        hidden=jax.random.normal(k3, (B, L, D)),
        head=jax.random.normal(k4, (D, V)),
    )


@pytest.mark.parametrize("chunk_size", [4, 11, 64])  # partial last chunk, exact fit, chunk > V
def test_values_match_float64_reference(data, chunk_size):
    s = jax.jit(functools.partial(vocab_stats, chunk_size=chunk_size, temperature=0.7))(data["logits"], data["targets"])
    logp, ent, lse, mean = _np_stats(data["logits"], data["targets"], 0.7)
    np.testing.assert_allclose(s.logp, logp, atol=2e-6)
    np.testing.assert_allclose(s.entropy, ent, atol=2e-6)
    np.testing.assert_allclose(s.lse, lse, atol=2e-6)
    np.testing.assert_allclose(s.mean_logit, mean, atol=2e-6)
    argmax = np.asarray(data["logits"]).argmax(-1) == np.asarray(data["targets"])
    np.testing.assert_array_equal(s.is_argmax, argmax.astype(np.float32))


def test_uniform_logits_hand_values():
    """All V logits equal to c: p = 1/V, so log p(y) = -log V, H = log V, lse = c + log V, mean = c."""
    c = 2.5
    logits = jnp.full((1, 2, 7), c)
    s = jax.jit(functools.partial(vocab_stats, chunk_size=3))(logits, jnp.array([[0, 6]]))
    np.testing.assert_allclose(s.logp, -np.log(7.0), rtol=1e-6)
    np.testing.assert_allclose(s.entropy, np.log(7.0), rtol=1e-6)
    np.testing.assert_allclose(s.lse, c + np.log(7.0), rtol=1e-6)
    np.testing.assert_allclose(s.mean_logit, c, rtol=1e-6)


def test_gradients_match_autodiff_of_plain_softmax(data):
    t = data["targets"]
    got = jax.jit(jax.grad(lambda z: _stats_objective(vocab_stats(z, t, chunk_size=4, temperature=0.7))))(
        data["logits"]
    )
    want = jax.jit(jax.grad(lambda z: _reference_objective(z / 0.7, t)))(data["logits"])
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_check_grads_logits(data):
    f = functools.partial(vocab_stats, target_ids_BxL=data["targets"], chunk_size=4)
    check_grads(
        jax.jit(lambda z: _stats_objective(f(z))), (data["logits"],), order=1, modes=("rev",), atol=1e-2, rtol=1e-2
    )


def test_hidden_variant_matches_logits_values_and_grads(data):
    h, w, t = data["hidden"], data["head"], data["targets"]
    got = vocab_stats_from_hidden(h, w, t, chunk_size=4, temperature=0.7)
    want = vocab_stats(h @ w, t, temperature=0.7)
    for name in ("logp", "entropy", "lse", "mean_logit", "is_argmax"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=2e-5, err_msg=name)
    g_got = jax.jit(
        jax.grad(lambda h, w: _stats_objective(vocab_stats_from_hidden(h, w, t, chunk_size=4, temperature=0.7)), (0, 1))
    )(h, w)
    g_want = jax.jit(jax.grad(lambda h, w: _reference_objective((h @ w) / 0.7, t), (0, 1)))(h, w)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, atol=5e-5)
    np.testing.assert_allclose(token_logprobs_from_hidden(h, w, t, chunk_size=4), token_logprobs(h @ w, t), atol=2e-5)


def test_hidden_flat_token_list_and_bf16(data):
    """A flat [N, D] list of gathered tokens (e.g. completion tokens only) gives the same per-token values;
    bf16 activations and head get bf16 gradients of float32 math."""
    h, w, t = data["hidden"], data["head"], data["targets"]
    rows = jnp.array([0, 1, 1]), jnp.array([2, 0, 1])
    flat = jax.jit(functools.partial(vocab_stats_from_hidden, chunk_size=4))(h[rows], w, t[rows])
    full = vocab_stats(h @ w, t)
    np.testing.assert_allclose(flat.logp, full.logp[rows], atol=2e-5)
    g = jax.jit(jax.grad(lambda h, w: jnp.sum(vocab_stats_from_hidden(h, w, t, chunk_size=4).logp), (0, 1)))(
        h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    )
    assert g[0].dtype == jnp.bfloat16 and g[1].dtype == jnp.bfloat16
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in g)


def test_check_grads_hidden(data):
    t = data["targets"]
    f = lambda h, w: _stats_objective(vocab_stats_from_hidden(h, w, t, chunk_size=4))  # noqa: E731
    check_grads(jax.jit(f), (data["hidden"], data["head"]), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_extreme_logits_1e4():
    """Logits of magnitude 1e4 (exact float32 integers), hand-derived:

    row [1e4, 1e4 - 1, -1e4]: p(0) = 1 / (1 + e^-1) so log p(0) = -log(1 + e^-1) = -0.3132617,
    log p(1) = -1 - log(1 + e^-1) = -1.3132617, log p(2) = -2e4 - log(1 + e^-1) ~ -20000.313;
    H = log(1 + e^-1) + e^-1 / (1 + e^-1) = 0.3132617 + 0.2689414 = 0.5822031.
    A naive lse = m + log s rounded to float32 at 1e4 would lose ~1e-3 here.
    """
    logits = jnp.array([[[1e4, 1e4 - 1.0, -1e4]] * 3], jnp.float32)
    stats_and_grad = jax.jit(
        lambda z, t: (
            vocab_stats(z, t, chunk_size=2),
            jax.grad(lambda z: jnp.sum(vocab_stats(z, t, chunk_size=2).logp))(z),
        )
    )
    s, g = stats_and_grad(logits, jnp.array([[0, 1, 2]]))
    np.testing.assert_allclose(s.logp[0, :2], [-0.3132617, -1.3132617], atol=1e-6)
    np.testing.assert_allclose(s.logp[0, 2], -20000.3132617, rtol=1e-7)
    np.testing.assert_allclose(s.entropy[0], 0.5822031, atol=1e-6)
    assert np.all(np.isfinite(g))
    # d log p(y) / dz = onehot(y) - p; column sums over the three rows: 1 - 3 p_v.
    p0 = 1.0 / (1.0 + np.exp(-1.0))
    np.testing.assert_allclose(g[0].sum(0), [1 - 3 * p0, 1 - 3 * (1 - p0), 1.0], atol=1e-6)
    # The hidden-state path with huge activations stays finite too.
    h = jnp.full((1, 1, 2), 100.0)
    w = jnp.array([[50.0, -50.0, 0.0], [50.0, 0.0, 0.0]])  # logits [1e4, -5e3, 0]
    sh = vocab_stats_from_hidden(h, w, jnp.array([[1]]))
    np.testing.assert_allclose(sh.logp, [[-15000.0]], rtol=1e-7)


def test_masked_vocabulary_entries_neg_inf():
    """-inf logits (masked vocabulary) get probability 0; the rest renormalise: log p = -log 2."""
    logits = jnp.array([[[0.0, -jnp.inf, 0.0, -jnp.inf, -jnp.inf]]])
    f = lambda z: vocab_stats(z, jnp.array([[2]]), chunk_size=2)  # noqa: E731
    s, g = jax.jit(lambda z: (f(z), jax.grad(lambda z: jnp.sum(f(z).logp + f(z).entropy))(z)))(logits)
    np.testing.assert_allclose(s.logp, [[-np.log(2.0)]], rtol=1e-6)
    np.testing.assert_allclose(s.entropy, [[np.log(2.0)]], rtol=1e-6)
    assert np.all(np.isfinite(g))


def test_jit_equals_eager(data):
    f = lambda z, t: vocab_stats(z, t, chunk_size=4)  # noqa: E731
    eager, jitted = f(data["logits"], data["targets"]), jax.jit(f)(data["logits"], data["targets"])
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bf16_logits_promote_to_float32(data):
    lp = token_logprobs(data["logits"].astype(jnp.bfloat16), data["targets"])
    assert lp.dtype == jnp.float32
    want = _np_stats(np.asarray(data["logits"].astype(jnp.bfloat16).astype(jnp.float32)), data["targets"])[0]
    np.testing.assert_allclose(lp, want, atol=1e-5)


def test_entropy_and_sequence_logprobs(data):
    np.testing.assert_allclose(
        entropy_from_logits(data["logits"]), _np_stats(data["logits"], data["targets"])[1], atol=2e-6
    )
    logp = jnp.array([[-1.0, -2.0, -4.0]])
    total, count = sequence_logprobs(logp, jnp.array([[0.0, 1.0, 1.0]]))
    np.testing.assert_allclose(total, [-6.0])
    np.testing.assert_allclose(count, [2.0])


def test_bad_inputs_raise_clear_errors(data):
    with pytest.raises(ValueError, match="target_ids has shape"):
        vocab_stats(data["logits"], data["targets"][:, :2])
    with pytest.raises(TypeError, match="integer"):
        vocab_stats(data["logits"], data["targets"].astype(jnp.float32))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_stats(data["logits"], data["targets"], chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        vocab_stats(data["logits"], data["targets"], temperature=0.0)
    with pytest.raises(ValueError, match="transpose"):
        vocab_stats_from_hidden(data["hidden"], data["head"].T, data["targets"])
