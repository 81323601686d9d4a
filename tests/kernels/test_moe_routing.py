"""route(): selections and weights against a NumPy re-derivation, plus the loss terms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptrain.kernels.moe import route, update_router_bias

T, E = 24, 8


def _logits(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (T, E)) * 2.0


def _np_topk(scores, k):
    # np.argsort is ascending; negate for best-first; ties do not occur with random floats.
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_numpy(norm):
    logits = np.asarray(_logits())
    r = route(jnp.asarray(logits), top_k=3, norm_topk_prob=norm, routed_scaling_factor=1.5)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = _np_topk(p, 3)
    w = np.take_along_axis(p, ids, -1)
    if norm:
        w = w / w.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(r.expert_ids_Txk), ids)
    np.testing.assert_allclose(np.asarray(r.weights_Txk), 1.5 * w, rtol=1e-5)
    assert r.expert_ids_Txk.dtype == jnp.int32 and r.weights_Txk.dtype == jnp.float32


def test_sigmoid_bias_selects_but_does_not_weight():
    logits = np.asarray(_logits(1))
    s = 1.0 / (1.0 + np.exp(-logits))
    # A large bias on expert 0 forces it into every token's top-2.
    bias = np.zeros(E, np.float32)
    bias[0] = 10.0
    r = route(jnp.asarray(logits), top_k=2, kind="sigmoid", bias_E=jnp.asarray(bias), norm_topk_prob=True)
    ids = np.asarray(r.expert_ids_Txk)
    assert (ids[:, 0] == 0).all()
    np.testing.assert_array_equal(ids, _np_topk(s + bias, 2))
    w = np.take_along_axis(s, ids, -1)
    np.testing.assert_allclose(np.asarray(r.weights_Txk), w / w.sum(-1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_group_limited_routing(kind):
    logits = np.asarray(_logits(2))
    n_groups, topk_groups, k = 4, 2, 3
    r = route(jnp.asarray(logits), top_k=k, kind=kind, n_groups=n_groups, topk_groups=topk_groups)
    s = 1 / (1 + np.exp(-logits)) if kind == "sigmoid" else np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    grouped = s.reshape(T, n_groups, E // n_groups)
    gscore = np.sort(grouped, -1)[..., -2:].sum(-1) if kind == "sigmoid" else grouped.max(-1)
    keep = _np_topk(gscore, topk_groups)
    masked = np.full_like(s, -np.inf)
    for t in range(T):
        for g in keep[t]:
            sl = slice(g * E // n_groups, (g + 1) * E // n_groups)
            masked[t, sl] = s[t, sl]
    np.testing.assert_array_equal(np.asarray(r.expert_ids_Txk), _np_topk(masked, k))


def test_load_and_switch_loss():
    # Uniform router probabilities: E * sum_e f_e / E = sum_e f_e = 1 whatever the load.
    r = route(jnp.zeros((T, E)), top_k=2)
    np.testing.assert_allclose(float(r.lb_loss), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(r.load_E.sum()), 1.0, rtol=1e-6)
    r = route(_logits(3), top_k=2)
    counts = np.bincount(np.asarray(r.expert_ids_Txk).ravel(), minlength=E)
    np.testing.assert_allclose(np.asarray(r.load_E), counts / (T * 2), rtol=1e-6)
    P = np.asarray(r.router_probs_TxE).mean(0)
    np.testing.assert_allclose(float(r.lb_loss), E * np.sum(counts / (T * 2) * P), rtol=1e-5)


def test_padding_is_routed_but_left_out_of_the_load_and_the_loss():
    logits = _logits(5)
    mask = jnp.arange(T) < 10
    got = route(logits, top_k=2, token_mask_T=mask)
    real = route(logits[:10], top_k=2)
    np.testing.assert_array_equal(np.asarray(got.expert_ids_Txk[:10]), np.asarray(real.expert_ids_Txk))
    assert got.expert_ids_Txk.shape == (T, 2)  # padding still gets experts (and weights)
    np.testing.assert_allclose(np.asarray(got.load_E), np.asarray(real.load_E), rtol=1e-6)
    np.testing.assert_allclose(float(got.lb_loss), float(real.lb_loss), rtol=1e-6)
    g_pad = jax.grad(lambda x: route(x, top_k=2, token_mask_T=mask).lb_loss)(logits)
    assert not np.asarray(g_pad[10:]).any()  # nothing learns from padding
    empty = route(logits, top_k=2, token_mask_T=jnp.zeros(T, bool))
    assert float(empty.lb_loss) == 0.0 and not np.asarray(empty.load_E).any()
    with pytest.raises(ValueError, match=r"token_mask_T must be \[tokens\]"):
        route(logits, top_k=2, token_mask_T=mask[:5])


def test_weights_and_loss_are_differentiable():
    def f(logits):
        r = route(logits, top_k=2)
        return jnp.sum(r.weights_Txk * jnp.arange(2.0)[None, :]) + r.lb_loss

    g = jax.grad(f)(_logits(4))
    assert g.shape == (T, E) and bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0


def test_bias_update_moves_toward_balance():
    load = jnp.array([0.5, 0.25, 0.125, 0.125])
    b = update_router_bias(jnp.zeros(4), load, 0.01)
    np.testing.assert_allclose(np.asarray(b), [-0.01, 0.0, 0.01, 0.01])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=9), "top_k"),
        (dict(top_k=2, kind="relu"), "kind"),
        (dict(top_k=2, n_groups=3), "n_groups"),
        (dict(top_k=5, n_groups=4, topk_groups=2), "kept groups"),
        (dict(top_k=2, bias_E=jnp.zeros(3)), "bias_E"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        route(_logits(), **kwargs)
