"""SFT loss: hand-derived values, aggregation modes, masking, packing, micro-batch accumulation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ptrain.losses import sft_loss, sft_loss_from_stats, sft_token_losses, vocab_stats_from_hidden

B, L, V = 3, 4, 7


@pytest.fixture(scope="module")
def batch():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1]], jnp.float32)
    return dict(logits=2.0 * jax.random.normal(k1, (B, L, V)), targets=jax.random.randint(k2, (B, L), 0, V), mask=mask)


@functools.partial(jax.jit, static_argnames=("aggregation", "label_smoothing", "z_loss"))
def _jit_sft(
    logits,
    targets,
    mask,
    norm_constant=None,
    segment_ids=None,
    *,
    aggregation="token_mean",
    label_smoothing=0.0,
    z_loss=0.0,
):
    return sft_loss(
        logits,
        targets,
        mask,
        aggregation=aggregation,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        norm_constant=norm_constant,
        segment_ids_BxL=segment_ids,
    )


def test_hand_derived_two_class_values():
    """V = 2, logits (log 3, 0): p = (3/4, 1/4), lse = log 4.

    target 0:  NLL = log(4/3) = 0.2876821
    smoothing eps = 0.1: uniform term -(1/2)(log 3/4 + log 1/4) = log 4 - (log 3)/2 = 0.8369882
               loss = 0.9 * 0.2876821 + 0.1 * 0.8369882 = 0.3426127
    z-loss c = 0.01: + 0.01 * (log 4)^2 = 0.0192181 -> 0.3618308
    target 1 alone: NLL = log 4 = 1.3862944.
    """
    logits = jnp.array([[[np.log(3.0), 0.0], [np.log(3.0), 0.0]]], jnp.float32)
    mask = jnp.array([[1.0, 0.0]])
    plain, aux = sft_loss(logits, jnp.array([[0, 1]]), mask)
    np.testing.assert_allclose(plain, 0.2876821, rtol=1e-6)
    smoothed, _ = sft_loss(logits, jnp.array([[0, 1]]), mask, label_smoothing=0.1)
    np.testing.assert_allclose(smoothed, 0.3426127, rtol=1e-6)
    both, aux = sft_loss(logits, jnp.array([[0, 1]]), mask, label_smoothing=0.1, z_loss=0.01)
    np.testing.assert_allclose(both, 0.3618308, rtol=1e-6)
    np.testing.assert_allclose(aux.nll_sum, 0.2876821, rtol=1e-6)
    np.testing.assert_allclose(aux.z_loss_sum, np.log(4.0) ** 2, rtol=1e-6)
    assert float(aux.correct_count) == 1.0 and float(aux.token_count) == 1.0
    per_token = sft_token_losses(logits, jnp.array([[0, 1]]))
    np.testing.assert_allclose(per_token, [[0.2876821, 1.3862944]], rtol=1e-6)


def test_aggregation_hand_values(batch):
    """token_mean = sum(l m)/sum(m); sequence_mean = mean over rows of row means; sum = sum(l m)/C."""
    per_token = np.asarray(jax.jit(sft_token_losses)(batch["logits"], batch["targets"]))
    m = np.asarray(batch["mask"])
    token_mean, aux = _jit_sft(batch["logits"], batch["targets"], batch["mask"])
    np.testing.assert_allclose(token_mean, (per_token * m).sum() / m.sum(), rtol=1e-6)
    seq_mean, _ = _jit_sft(batch["logits"], batch["targets"], batch["mask"], aggregation="sequence_mean")
    np.testing.assert_allclose(seq_mean, np.mean((per_token * m).sum(1) / m.sum(1)), rtol=1e-6)
    summed, _ = _jit_sft(batch["logits"], batch["targets"], batch["mask"], 10.0, aggregation="sum")
    np.testing.assert_allclose(summed, (per_token * m).sum() / 10.0, rtol=1e-6)
    assert float(aux.token_count) == 8.0 and float(aux.seq_count) == 3.0


def test_aggregation_modes_coincide_on_equal_lengths(batch):
    mask = jnp.ones((B, L))
    tm, _ = _jit_sft(batch["logits"], batch["targets"], mask)
    sm, _ = _jit_sft(batch["logits"], batch["targets"], mask, aggregation="sequence_mean")
    su, _ = _jit_sft(batch["logits"], batch["targets"], mask, float(B * L), aggregation="sum")
    np.testing.assert_allclose(sm, tm, rtol=1e-6)
    np.testing.assert_allclose(su, tm, rtol=1e-6)


def test_masking_equals_slicing(batch):
    """Masking the last position of every row gives the loss of the batch with that column sliced off."""
    mask = jnp.ones((B, L)).at[:, -1].set(0.0)
    for agg in ("token_mean", "sequence_mean"):
        kw = dict(aggregation=agg, label_smoothing=0.1, z_loss=1e-3)
        masked, _ = _jit_sft(batch["logits"], batch["targets"], mask, **kw)
        sliced, _ = _jit_sft(batch["logits"][:, :-1], batch["targets"][:, :-1], mask[:, :-1], **kw)
        np.testing.assert_allclose(masked, sliced, rtol=1e-6)


def test_packed_sequence_mean_equals_unpacked(batch):
    """One packed row [a a b b] with segment ids [1 1 2 2] has the sequence mean of rows [a a], [b b]."""
    logits, targets = batch["logits"][:1], batch["targets"][:1]
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])  # segment 1 counts 2 tokens, segment 2 counts 1
    packed, aux = _jit_sft(logits, targets, mask, None, jnp.array([[1, 1, 2, 2]]), aggregation="sequence_mean")
    unpacked, _ = _jit_sft(
        logits.reshape(2, 2, V), targets.reshape(2, 2), mask.reshape(2, 2), aggregation="sequence_mean"
    )
    np.testing.assert_allclose(packed, unpacked, rtol=1e-6)
    assert float(aux.seq_count) == 2.0


def test_microbatch_accumulation_is_exact(batch):
    """Token mean of the full batch = sum over micro-batches of sum-loss / global token count."""
    full, _ = _jit_sft(batch["logits"], batch["targets"], batch["mask"])
    total = float(jnp.sum(batch["mask"]))
    parts = [
        _jit_sft(
            batch["logits"][i : i + 1], batch["targets"][i : i + 1], batch["mask"][i : i + 1], total, aggregation="sum"
        )[0]
        for i in range(B)
    ]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)
    auxes = [
        _jit_sft(batch["logits"][i : i + 1], batch["targets"][i : i + 1], batch["mask"][i : i + 1])[1] for i in range(B)
    ]
    np.testing.assert_allclose(sum(a.loss_sum for a in auxes) / sum(a.token_count for a in auxes), full, rtol=1e-6)
    seq, _ = _jit_sft(batch["logits"], batch["targets"], batch["mask"], aggregation="sequence_mean")
    np.testing.assert_allclose(sum(a.seq_loss_sum for a in auxes) / sum(a.seq_count for a in auxes), seq, rtol=1e-6)


def test_jit_equals_eager_and_empty_mask(batch):
    args = (batch["logits"], batch["targets"], batch["mask"])
    eager, _ = sft_loss(*args, label_smoothing=0.1, z_loss=1e-4)
    jitted, _ = _jit_sft(*args, label_smoothing=0.1, z_loss=1e-4)
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)
    empty, aux = _jit_sft(batch["logits"], batch["targets"], jnp.zeros((B, L)))
    assert float(empty) == 0.0 and float(aux.token_count) == 0.0


def test_check_grads(batch):
    f = jax.jit(lambda z: sft_loss(z, batch["targets"], batch["mask"], label_smoothing=0.1, z_loss=1e-2)[0])
    check_grads(f, (batch["logits"],), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_from_hidden_equals_from_logits(batch):
    """sft_loss_from_stats(vocab_stats_from_hidden(h, W, y)) = sft_loss(h @ W, y): value and gradients."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    h, w = jax.random.normal(k1, (B, L, 5)), jax.random.normal(k2, (5, V))
    kw = dict(aggregation="sequence_mean", label_smoothing=0.1, z_loss=1e-2)

    def both(h, w):
        via_logits = lambda h, w: sft_loss(h @ w, batch["targets"], batch["mask"], **kw)[0]  # noqa: E731
        via_hidden = lambda h, w: sft_loss_from_stats(  # noqa: E731
            vocab_stats_from_hidden(h, w, batch["targets"], chunk_size=3), batch["mask"], **kw
        )[0]
        return [jax.value_and_grad(f, argnums=(0, 1))(h, w) for f in (via_logits, via_hidden)]

    (l1, g1), (l2, g2) = jax.jit(both)(h, w)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_clear_errors(batch):
    args = (batch["logits"], batch["targets"], batch["mask"])
    with pytest.raises(ValueError, match="aggregation must be one of"):
        sft_loss(*args, aggregation="mean")
    with pytest.raises(ValueError, match="pass norm_constant"):
        sft_loss(*args, aggregation="sum")
    with pytest.raises(ValueError, match="norm_constant must be > 0"):
        sft_loss(*args, aggregation="sum", norm_constant=0.0)
    with pytest.raises(ValueError, match="only used with aggregation='sum'"):
        sft_loss(*args, norm_constant=3.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        sft_loss(*args, label_smoothing=1.0)
    with pytest.raises(ValueError, match="z_loss"):
        sft_loss(*args, z_loss=-1.0)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        sft_loss(batch["logits"], batch["targets"], batch["mask"][:, :2])
    with pytest.raises(ValueError, match="segment_ids has shape"):
        sft_loss(*args, aggregation="sequence_mean", segment_ids_BxL=jnp.ones((B, 2), jnp.int32))
