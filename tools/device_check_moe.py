"""One-shot accelerator check of ptrain's MoE kernels (GPU or TPU); under 5 minutes.

  python tools/device_check_moe.py            # prints the tables; exit code 1 on a mismatch
  python tools/device_check_moe.py --json out.json

1. Correctness: every native implementation of the backend (pallas_gpu on GPU,
   pallas_tpu on TPU, plus xla and ragged_dot) against kernels/moe/reference.py:
   grouped_matmul forward, d lhs and d rhs on ragged, empty and all-in-one group sizes,
   float32 and bfloat16; moe_ffn forward and gradients; the expert-parallel path with
   the real `ragged_all_to_all` on a mesh of all local devices.
2. Speed: grouped_matmul forward and forward+backward at T*k = 65536 rows, d_model 2048,
   expert FFN 1024 (bfloat16), 8 and 64 experts with random routing, against a dense
   bfloat16 matmul with the same FLOPs. A few tilings are tried; the best is reported.
   Target: >= 70% of the dense matmul's TFLOP/s with 8 experts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from ptrain.kernels import moe
from ptrain.kernels.moe import expert_parallel, reference

ROWS, D_MODEL, D_FF = 65536, 2048, 1024
TILINGS = {
    "pallas_gpu": [(128, 64, 128), (128, 32, 128), (64, 64, 128), (128, 64, 256)],
    "pallas_tpu": [(512, 1024, 1024), (512, 512, 1024), (256, 1024, 1024), (1024, 512, 512)],
}


def native_implementations(platform: str) -> list[str]:
    native = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(platform, [])
    return native + ["xla", "ragged_dot"]


def _bench(fn, *args, iters=20):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ----------------------------------------------------------------------------- correctness


def check_correctness(impls, failures):
    M, K, N, G = 1024, 256, 384, 8
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    cases = {
        "ragged": [300, 0, 5, 200, 0, 129, 250, 140],
        "one_group": [0, 0, 0, 1024, 0, 0, 0, 0],
        "short": [7, 0, 0, 33, 0, 0, 0, 1],
        "empty": [0] * 8,
    }
    for dtype in (jnp.float32, jnp.bfloat16):
        lhs = jax.random.normal(ks[0], (M, K)).astype(dtype)
        rhs = (jax.random.normal(ks[1], (G, K, N)) / 16).astype(dtype)
        cot = jax.random.normal(ks[2], (M, N))
        tol = 2e-2 if dtype == jnp.float32 else 8e-2  # TF32-class accumulation on GPU for float32

        def vg(fn):
            def f(lhs, rhs, gs):
                return jnp.sum(fn(lhs, rhs, gs).astype(jnp.float32) * cot)

            return jax.jit(lambda l, r, g: (fn(l, r, g), jax.grad(f, (0, 1))(l, r, g)))

        ref = vg(reference.grouped_matmul)
        for impl in impls:
            run = vg(lambda l, r, g, impl=impl: moe.grouped_matmul(l, r, g, implementation=impl))
            for name, sizes in cases.items():
                gs = jnp.asarray(sizes, jnp.int32)
                got, want = run(lhs, rhs, gs), ref(lhs, rhs, gs)
                errs = {}
                for part, a, b in zip(("fwd", "dlhs", "drhs"), (got[0], *got[1]), (want[0], *want[1])):
                    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                    finite = bool(np.all(np.isfinite(a)))
                    errs[part] = float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6)) if finite else float("inf")
                ok = max(errs.values()) < tol
                print(
                    f"  gmm {impl:12s} {jnp.dtype(dtype).name:8s} {name:9s} rel err "
                    + " ".join(f"{p} {e:.1e}" for p, e in errs.items())
                    + (" ok" if ok else " FAIL")
                )
                if not ok:
                    failures.append(f"gmm {impl} {jnp.dtype(dtype).name} {name} {errs}")
    # moe_ffn end to end, and the expert-parallel path with the real ragged_all_to_all.
    T, D, F, E, k = 512, 256, 128, 8, 2
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    x = jax.random.normal(ks[0], (T, D), jnp.bfloat16)
    r = moe.route(jax.random.normal(ks[1], (T, E)), top_k=k)
    wg, wu = (jax.random.normal(ks[i], (E, D, F)) / 16 for i in (2, 3))
    wd = jax.random.normal(ks[4], (E, F, D)) / 16

    def loss(fn, *w):
        return jnp.sum(fn(x, r.expert_ids_Txk, r.weights_Txk, *w).astype(jnp.float32) ** 2)

    want = jax.jit(jax.value_and_grad(lambda *w: loss(reference.moe_ffn, *w), argnums=(0, 1, 2)))(wg, wu, wd)
    variants = {impl: (lambda *a, impl=impl: moe.moe_ffn(*a, implementation=impl)) for impl in impls}
    mesh = jax.make_mesh((jax.device_count(),), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    # XLA:CPU has no ragged_all_to_all; on GPU/TPU this runs the real collective.
    if jax.default_backend() != "cpu" and E % jax.device_count() == 0 and T % jax.device_count() == 0:
        variants[f"ep{jax.device_count()}_ragged"] = lambda *a: expert_parallel.moe_ffn_ep(
            *a, mesh=mesh, expert_axis="expert", implementation=impls[0], exchange="ragged"
        )
    for name, fn in variants.items():
        try:
            got = jax.jit(jax.value_and_grad(lambda *w, fn=fn: loss(fn, *w), argnums=(0, 1, 2)))(wg, wu, wd)
            errs = [abs(float(got[0]) - float(want[0])) / abs(float(want[0]))]
            errs += [float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-6)) for a, b in zip(got[1], want[1])]
            ok = max(errs) < 5e-2
        except Exception as e:  # report and carry on: one broken path must not hide the others
            errs, ok = [float("nan")], False
            print(f"  moe_ffn {name}: {type(e).__name__}: {str(e)[:300]}")
        print(f"  moe_ffn {name:14s} bf16 loss+grads max rel err {max(errs):.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"moe_ffn {name} err {max(errs):.2e}")


# ----------------------------------------------------------------------------- speed


def group_sizes_for(E, rows, seed=0):
    """Random top-k style routing: multinomial counts with mild imbalance (Dirichlet(8))."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 8.0))
    return jnp.asarray(rng.multinomial(rows, p), jnp.int32)


def bench_speed(impl, results, rows=ROWS, d_model=D_MODEL, d_ff=D_FF, experts=(8, 64)):
    """Times grouped_matmul of `impl` (best tiling) at each number of experts against a dense
    bf16 matmul of the same FLOPs; appends one dict per number of experts to `results`."""
    lhs = jax.random.normal(jax.random.PRNGKey(0), (rows, d_model), jnp.bfloat16)
    dout = jax.random.normal(jax.random.PRNGKey(1), (rows, d_ff), jnp.bfloat16)
    flops = 2 * rows * d_model * d_ff
    w_dense = jax.random.normal(jax.random.PRNGKey(2), (d_model, d_ff), jnp.bfloat16)
    dense_f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    dense_fb = jax.jit(
        jax.value_and_grad(lambda a, b, d: jnp.sum((a @ b).astype(jnp.float32) * d.astype(jnp.float32)), argnums=(0, 1))
    )
    t_dense_f = _bench(dense_f, lhs, w_dense)
    t_dense_fb = _bench(dense_fb, lhs, w_dense, dout)
    print(
        f"  dense bf16 {rows}x{d_model}x{d_ff}: fwd {flops / t_dense_f / 1e12:.0f} TFLOP/s, "
        f"fwd+bwd {3 * flops / t_dense_fb / 1e12:.0f} TFLOP/s"
    )
    for E in experts:
        gs = group_sizes_for(E, rows)
        rhs = (jax.random.normal(jax.random.PRNGKey(3), (E, d_model, d_ff)) / 32).astype(jnp.bfloat16)
        best = None
        for tiling in TILINGS.get(impl, [None]):
            f = jax.jit(lambda a, b, g, t=tiling: moe.grouped_matmul(a, b, g, implementation=impl, tiling=t))
            fb = jax.jit(
                jax.value_and_grad(
                    lambda a, b, g, d, t=tiling: jnp.sum(
                        moe.grouped_matmul(a, b, g, implementation=impl, tiling=t).astype(jnp.float32)
                        * d.astype(jnp.float32)
                    ),
                    argnums=(0, 1),
                )
            )
            try:
                t_f, t_fb = _bench(f, lhs, rhs, gs), _bench(fb, lhs, rhs, gs, dout)
            except Exception as e:
                print(f"  {impl} E={E} tiling={tiling}: {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"  {impl} E={E} tiling={tiling}: fwd {t_f * 1e3:.2f} ms, fwd+bwd {t_fb * 1e3:.2f} ms")
            if best is None or t_fb < best[2]:
                best = (tiling, t_f, t_fb)
        if best is None:
            continue
        tiling, t_f, t_fb = best
        results.append(
            dict(
                impl=impl,
                experts=E,
                tiling=tiling,
                fwd_tflops=flops / t_f / 1e12,
                fwd_pct_dense=100 * t_dense_f / t_f,
                fwdbwd_tflops=3 * flops / t_fb / 1e12,
                fwdbwd_pct_dense=100 * t_dense_fb / t_fb,
            )
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    platform = jax.default_backend()
    print(f"jax {jax.__version__} on {platform}: {jax.devices()[0].device_kind} x{jax.device_count()}")
    if platform == "cpu":
        print("no GPU/TPU: this script checks accelerators (CPU is covered by tests/kernels in interpret mode)")
    impls = native_implementations(platform)
    failures: list[str] = []
    t0 = time.time()
    print("correctness vs reference:")
    check_correctness(impls, failures)
    results: list[dict] = []
    if not args.skip_speed and platform != "cpu":
        print(f"speed (bf16, rows={ROWS}, d_model={D_MODEL}, d_ff={D_FF}):")
        for impl in impls:
            if impl != "xla":  # the XLA loop is the CPU path; on accelerators it is a fallback only
                bench_speed(impl, results)
        print("\n| implementation | experts | tiling | fwd TFLOP/s | fwd % dense | fwd+bwd TFLOP/s | fwd+bwd % dense |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['impl']} | {r['experts']} | {r['tiling']} | {r['fwd_tflops']:.0f} | {r['fwd_pct_dense']:.0f}% "
                f"| {r['fwdbwd_tflops']:.0f} | {r['fwdbwd_pct_dense']:.0f}% |"
            )
    print(f"\n{len(failures)} failures; {time.time() - t0:.0f} s")
    for f in failures:
        print("  FAIL", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(platform=platform, failures=failures, results=results), fh, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
