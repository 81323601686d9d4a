"""Expert parallelism on 8 simulated host devices: run by test_moe_expert_parallel.py in a subprocess.

XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is imported, which
is why this is a separate process. Exits non-zero with a message on the first mismatch.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from ptrain.kernels import moe  # noqa: E402
from ptrain.kernels.moe import expert_parallel  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

T, D, F, E, K = 64, 16, 8, 8, 2


def main():
    assert jax.device_count() == 8, f"expected 8 host devices, got {jax.device_count()}"
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(ks[0], (T, D))
    # Skewed logits: some experts get many rows, some none, so chunks are ragged.
    logits = jax.random.normal(ks[1], (T, E)) * 3 + jnp.array([3.0, 2, 0, 0, -9, -9, 1, 0])[None, :]
    r = moe.route(logits, top_k=K)
    w_gate = jax.random.normal(ks[2], (E, D, F)) / 4
    w_up = jax.random.normal(ks[3], (E, D, F)) / 4
    w_down = jax.random.normal(ks[4], (E, F, D)) / 4
    args = (x, r.weights_Txk, w_gate, w_up, w_down)

    def value_and_grads(ffn):
        def loss(x, w, g, u, d):
            return jnp.sum(ffn(x, r.expert_ids_Txk, w, g, u, d) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)

    base_v, base_g = value_and_grads(lambda *a: moe.moe_ffn(*a, implementation="xla"))
    names = ["x", "weights", "w_gate", "w_up", "w_down"]
    for ep in (2, 4, 8):
        mesh = jax.make_mesh((8 // ep, ep), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
        for exchange in ("padded", "ragged_emulated"):

            def ffn(*a, mesh=mesh, exchange=exchange):
                return expert_parallel.moe_ffn_ep(
                    *a, mesh=mesh, expert_axis="expert", implementation="xla", exchange=exchange
                )

            v, g = value_and_grads(ffn)
            np.testing.assert_allclose(float(v), float(base_v), rtol=1e-5, err_msg=f"loss ep={ep} {exchange}")
            for n, a, b in zip(names, g, base_g):
                np.testing.assert_allclose(
                    np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=f"grad {n} ep={ep} {exchange}"
                )
            print(f"ok ep={ep} exchange={exchange}")

    # The public entry point picks the padded exchange on CPU.
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    y = jax.jit(lambda *a: moe.moe_ffn(*a, mesh=mesh, expert_axis="expert", implementation="xla"))(
        x, r.expert_ids_Txk, r.weights_Txk, w_gate, w_up, w_down
    )
    y_ref = moe.reference.moe_ffn(x, r.expert_ids_Txk, r.weights_Txk, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-5, atol=2e-5)
    print("ok moe_ffn(mesh=...) vs reference")

    for bad, match in (
        ((x[:60], r.expert_ids_Txk[:60], r.weights_Txk[:60], w_gate, w_up, w_down), "tokens"),
        ((x, r.expert_ids_Txk, r.weights_Txk, w_gate[:6], w_up[:6], w_down[:6]), "experts"),
    ):
        try:
            moe.moe_ffn(*bad, mesh=mesh, expert_axis="expert")
        except ValueError as e:
            assert match in str(e), e
        else:
            sys.exit(f"expected a ValueError about {match}")
    print("ok errors")


if __name__ == "__main__":
    main()
