"""Losses on 8 simulated host devices: run by test_sharded_losses.py in a subprocess.

Shards batch rows over `data` and the vocabulary (logits' last axis, the head's columns) over
`tensor` on a 2 x 4 mesh, and checks values and gradients against the unsharded computation.
XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is imported, hence
the separate process. Prints one `ok ...` line per check; exits non-zero on the first mismatch.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from ptrain.losses import policy_loss, sft_loss, vocab_stats_from_hidden  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

B, L, D, V = 4, 6, 8, 64


def _close(name, got, want, tol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=name)
    print(f"ok {name}", flush=True)


def main():
    assert jax.device_count() == 8, f"expected 8 host devices, got {jax.device_count()}"
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    logits = 3.0 * jax.random.normal(ks[0], (B, L, V))
    targets = jax.random.randint(ks[1], (B, L), 0, V)
    mask = (jax.random.uniform(ks[2], (B, L)) > 0.3).astype(jnp.float32)
    hidden = jax.random.normal(ks[3], (B, L, D))
    head = jax.random.normal(ks[4], (D, V))

    def sft(z, t, m):
        return jax.value_and_grad(lambda z: sft_loss(z, t, m, label_smoothing=0.1, z_loss=1e-3, chunk_size=16)[0])(z)

    def hid(h, w, t, m):
        f = lambda h, w: jnp.sum(vocab_stats_from_hidden(h, w, t, chunk_size=16).logp * m)  # noqa: E731
        return jax.value_and_grad(f, argnums=(0, 1))(h, w)

    def pol(lp, old, adv, m):
        f = lambda lp: policy_loss(lp, old, adv, m, clip_high=0.28, aggregation="seq_mean_token_mean")[0]  # noqa: E731
        return jax.value_and_grad(f)(lp)

    rows, vocab = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None, "tensor"))
    _close(
        "sft vocab-sharded logits",
        jax.jit(sft, in_shardings=(vocab, rows, rows))(logits, targets, mask),
        jax.jit(sft)(logits, targets, mask),
    )
    head_cols = NamedSharding(mesh, P(None, "tensor"))
    _close(
        "hidden path, head sharded by vocab columns",
        jax.jit(hid, in_shardings=(rows, head_cols, rows, rows))(hidden, head, targets, mask),
        jax.jit(hid)(hidden, head, targets, mask),
    )
    logp = -jax.random.uniform(ks[5], (B, L))
    old = logp + 0.2
    adv = jnp.array([1.0, -1.0, 0.5, -0.5])
    _close(
        "policy loss, rows sharded",
        jax.jit(pol, in_shardings=(rows,) * 4)(logp, old, adv, mask),
        jax.jit(pol)(logp, old, adv, mask),
    )


if __name__ == "__main__":
    main()
