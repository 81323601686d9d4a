"""Weight sync to an SGLang fleet, timed: export, push, verify, beside the disk's bandwidth.

    python tools/bench_weight_sync.py                          # tiny and ~0.5B, one ptrain.serve worker
    python tools/bench_weight_sync.py --models 0.5b --weight-dir /dev/shm/wsync --workers 1

For each model (randomly initialised from a config: `tiny` is the embedded default's shape,
`0.5b` Qwen2.5-0.5B's, 0.49B parameters) and each of --repeat rounds:
  disk    write the export's byte count to --weight-dir in 64 MiB blocks, then fsync: GB/s;
  export  `weight_sync.export_weights` (cast, transpose, sha256, parallel shards, fsync,
          rename) from the trainer's pure-dict params: GB/s and its share of the disk figure;
  nohash  the same export without checksums (rollout.weight_checksums=false);
  nofsync the same export without fsync, and `ptrain.models.save_hf` of the same model into
          the same folder (which does not fsync either), for comparison;
  push    every worker's /update_weights_from_disk of the export at once (the worker reads
          the folder, checks it and swaps), and verify: each worker's /model_info version.
  lora    with --lora R: the adapter push of a LoRA stage on the same model (rank-R adapters of
          every layer a worker serves per request): `weight_sync.export_adapters` (a PEFT
          folder) and every worker's /load_lora_adapter of it, beside the full export and push
          above: bytes, seconds and their ratios.
Workers are `python -m ptrain.serve` subprocesses started on the first export (no tokenizer,
no warm-up: a push needs no compiled program; with --lora, LoRA enabled). The last lines project the same path to
Qwen3-30B-A3B (30.5B parameters, 61 GB in bf16) from the measured rates. --json writes every
figure, the CPU model and the weight folder's file system.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

MODELS = {
    "tiny": dict(family="qwen3", vocab_size=300, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                 d_ff=768, max_seq_len=512, qk_norm=True, tie_embeddings=True),
    "0.5b": dict(family="qwen2", vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                 d_ff=4864, max_seq_len=512, qk_norm=False, qkv_bias=True, tie_embeddings=True),
}  # fmt: skip
QWEN3_30B_A3B_PARAMS = 30.53e9


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def file_system(path: str) -> str:
    try:
        out = subprocess.run(["df", "-hT", path], capture_output=True, text=True).stdout.splitlines()[-1].split()
        return f"{out[0]} ({out[1]}, {out[2]})"
    except (OSError, IndexError):
        return "unknown"


def disk_gbps(folder: str, nbytes: int) -> float:
    """Write nbytes of random data in 64 MiB blocks, fsync, and return GB/s."""
    import numpy as np

    block = np.random.default_rng(0).integers(0, 255, min(nbytes, 64 << 20), dtype=np.uint8)
    path = os.path.join(folder, "bandwidth.bin")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, block.size)
            f.write(memoryview(block[:n]))
            left -= n
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.remove(path)
    return nbytes / 1e9 / seconds


def export_bytes(cfg, dtype: str) -> int:
    """The bytes an export of `cfg` in `dtype` writes (its tensors)."""
    import math

    from ptrain.models.hf import tensor_map

    return sum(math.prod(m.hf_shape) for m in tensor_map(cfg)) * (2 if dtype == "bfloat16" else 4)


def start_workers(
    folder: str, count: int, log_dir: str, lora_rank: int = 0
) -> tuple[list[subprocess.Popen], list[str]]:
    import socket

    procs, urls = [], []
    for i in range(count):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "ptrain.serve", "--model-path", folder, "--port", str(port),
               "--skip-tokenizer-init", "--skip-server-warmup", "--max-running-requests", "1",
               "--context-length", "64"]  # fmt: skip
        if lora_rank:
            cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules", "all"]
        with open(os.path.join(log_dir, f"worker-{i}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 900
    for proc, url in zip(procs, urls):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"a worker exited with {proc.returncode}; see {log_dir}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not start; see {log_dir}")
            time.sleep(0.5)
    return procs, urls


async def push(urls: list[str], folder: str, version: str):
    from ptrain.rollout.weight_sync import push_to_workers

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        outcomes = await push_to_workers(client, urls, folder, version, mode="drain", timeout_s=1800, retries=0)
        return time.perf_counter() - t0, outcomes


async def push_lora(urls: list[str], name: str, folder: str):
    """Every worker's /load_lora_adapter of `folder` at once (timed), then its unload (not timed)."""
    from ptrain.rollout.weight_sync import load_lora_on_worker, unload_lora_on_worker

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(load_lora_on_worker(client, u, name, folder, timeout_s=1800, retries=0)
                                          for u in urls))  # fmt: skip
        wall = time.perf_counter() - t0
        await asyncio.gather(*(unload_lora_on_worker(client, u, name) for u in urls))
        return wall, outcomes


def bench_lora(cfg, params, root: str, urls: list[str], args) -> list[dict]:
    """--repeat rounds of the adapter export and push (module docstring)."""
    import jax

    from ptrain.config.lora import LoRAConfig
    from ptrain.models.lora import SERVABLE, LoRASpec, init_adapters
    from ptrain.rollout.weight_sync import export_adapters

    spec = LoRASpec.of(LoRAConfig(rank=args.lora, alpha=2.0 * args.lora, targets=list(SERVABLE)))
    adapters = init_adapters(params, spec, jax.random.key(0))
    rows = []
    for k in range(1, args.repeat + 1):
        res = export_adapters(adapters, spec, cfg, root, str(k))
        row = {"lora_bytes": res.bytes, "lora_export_s": res.seconds}
        if urls:
            wall, outcomes = asyncio.run(push_lora(urls, f"bench-v{k}", res.path))
            bad = [o for o in outcomes if not o.ok]
            if bad:
                raise SystemExit(f"adapter push failed: {[(o.url, o.error) for o in bad]}")
            row["lora_push_wall_s"] = wall
        rows.append(row)
        print(f"  lora {k}: rank {args.lora}, {res.bytes / 1e6:.3f} MB  export {res.seconds:.3f} s"
              + (f"  push to {len(urls)} worker(s) {row['lora_push_wall_s']:.3f} s" if urls else ""),
              flush=True)  # fmt: skip
    return rows


def bench_model(name: str, args) -> dict:
    import jax
    from flax import nnx

    from ptrain.config.model import ModelConfig
    from ptrain.models import Decoder, save_hf
    from ptrain.rollout.weight_sync import export_weights, read_manifest
    from ptrain.train.state import split_model

    cfg = ModelConfig(**MODELS[name])
    t0 = time.perf_counter()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    model_def, params, model_state = split_model(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"\n{name}: {n_params / 1e9:.3f}B parameters, initialised in {time.perf_counter() - t0:.1f} s", flush=True)
    root = os.path.join(args.weight_dir, f"bench-{name}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rounds = []
    procs, urls = [], []
    try:
        # Exports first, with no worker alive (a worker holding its weights squeezes the page
        # cache the export writes through); then the workers start and every export is pushed.
        exports = []
        for k in range(1, args.repeat + 1):
            disk = disk_gbps(root, export_bytes(cfg, args.dtype))
            res = export_weights(cfg, params, model_state, root, str(k), dtype=args.dtype, writers=args.writers)
            t = time.perf_counter()
            read_manifest(res.path)
            manifest_s = time.perf_counter() - t
            nosync = export_weights(cfg, params, model_state, root, f"{k}n", dtype=args.dtype, writers=args.writers,
                                    fsync=False)  # fmt: skip
            shutil.rmtree(nosync.path)
            nohash = export_weights(cfg, params, model_state, root, f"{k}h", dtype=args.dtype, writers=args.writers,
                                    checksums=False)  # fmt: skip
            shutil.rmtree(nohash.path)
            hf_dir = os.path.join(root, "save_hf")
            t = time.perf_counter()
            save_hf(model, hf_dir, dtype=args.dtype)
            save_hf_s = time.perf_counter() - t
            shutil.rmtree(hf_dir)
            exports.append(res)
            rounds.append({
                "bytes": res.bytes, "disk_gbps": disk, "export_s": res.seconds, "export_gbps": res.gbps,
                "export_vs_disk": res.gbps / disk, "export_nofsync_s": nosync.seconds,
                "export_nohash_s": nohash.seconds, "export_nohash_vs_disk": nohash.gbps / disk, "save_hf_s": save_hf_s,
                "manifest_check_s": manifest_s, "files": len(res.files),
            })  # fmt: skip
            print(f"  export {k}: {res.bytes / 1e9:.3f} GB  disk {disk:.2f} GB/s  export {res.seconds:.2f} s = "
                  f"{res.gbps:.2f} GB/s ({100 * res.gbps / disk:.0f}% of disk)  without sha256 {nohash.seconds:.2f} s "
                  f"({100 * nohash.gbps / disk:.0f}%)  without fsync {nosync.seconds:.2f} s  "
                  f"save_hf {save_hf_s:.2f} s", flush=True)  # fmt: skip
        if args.workers:
            first = export_weights(cfg, params, model_state, root, "0", dtype=args.dtype, writers=args.writers)
            procs, urls = start_workers(first.path, args.workers, root, lora_rank=args.lora)
            for k, (res, row) in enumerate(zip(exports, rounds), 1):
                wall, outcomes = asyncio.run(push(urls, res.path, res.version))
                bad = [o for o in outcomes if not o.ok]
                if bad:
                    raise SystemExit(f"push failed: {[(o.url, o.error) for o in bad]}")
                row.update(push_wall_s=wall, update_s=max(o.update_s for o in outcomes),
                           verify_s=max(o.verify_s for o in outcomes))  # fmt: skip
                print(f"  push {k} to {len(urls)} worker(s): {wall:.2f} s (load {row['update_s']:.2f} s, "
                      f"verify {row['verify_s']:.3f} s)", flush=True)  # fmt: skip
        if args.lora:
            for row, lora_row in zip(rounds, bench_lora(cfg, params, root, urls, args)):
                row.update(lora_row)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        shutil.rmtree(root, ignore_errors=True)

    def med(key):
        vals = [r[key] for r in rounds if key in r]
        return statistics.median(vals) if vals else None

    summary = {k: med(k) for k in rounds[0]}
    summary.update(params=n_params, rounds=rounds, workers=len(urls))
    return summary


def lora_line(r: dict, rank: int) -> None:
    """Print the adapter push beside the full one and add the ratios to `r`: bytes, and
    seconds of export plus push (export alone without workers)."""
    full_s = r["export_s"] + (r.get("push_wall_s") or 0.0)
    lora_s = r["lora_export_s"] + (r.get("lora_push_wall_s") or 0.0)
    r["lora_bytes_ratio"] = r["lora_bytes"] / r["bytes"]
    r["lora_seconds_ratio"] = lora_s / full_s
    what = "export + push" if r.get("lora_push_wall_s") is not None else "export"
    print(f"        LoRA rank {rank} adapter push: {r['lora_bytes'] / 1e6:.3f} MB vs full {r['bytes'] / 1e6:.3f} MB "
          f"(ratio {r['lora_bytes_ratio']:.4f}); {what} {lora_s:.3f} s vs full {full_s:.3f} s "
          f"(ratio {r['lora_seconds_ratio']:.3f})")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/bench_weight_sync.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,0.5b", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--weight-dir", default="runs/bench_weight_sync", help="the export folder's parent (its disk)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--writers", type=int, default=2, help="shard files written at once (rollout.export_writers)")
    p.add_argument("--workers", type=int, default=1, help="ptrain.serve workers to push to at once (0: export only)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per model (median reported)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="also time the adapter push of rank-R adapters on the same model (0: none)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write every figure to this file")
    args = p.parse_args(argv)
    if args.lora < 0:
        p.error(f"--lora must be a rank >= 1 (or 0: no adapter push), got {args.lora}")
    os.makedirs(args.weight_dir, exist_ok=True)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; pass some of {sorted(MODELS)}")
    facts = {"cpu": cpu_model(), "cores": os.cpu_count(), "weight_dir": os.path.abspath(args.weight_dir),
             "file_system": file_system(args.weight_dir), "dtype": args.dtype, "writers": args.writers}  # fmt: skip
    print(f"CPU: {facts['cpu']} ({facts['cores']} cores); weights in {facts['weight_dir']} on {facts['file_system']}")
    results = {name: bench_model(name, args) for name in names}

    print("\nmedians:")
    for name, r in results.items():
        line = (f"  {name:5s} {r['bytes'] / 1e9:.3f} GB: export {r['export_s']:.2f} s = {r['export_gbps']:.2f} GB/s, "
                f"{100 * r['export_vs_disk']:.0f}% of the disk's {r['disk_gbps']:.2f} GB/s; without sha256 "
                f"{r['export_nohash_s']:.2f} s ({100 * r['export_nohash_vs_disk']:.0f}%); without fsync "
                f"{r['export_nofsync_s']:.2f} s, save_hf (no fsync) {r['save_hf_s']:.2f} s")  # fmt: skip
        if r.get("push_wall_s") is not None:
            line += f"; push to {r['workers']} {r['push_wall_s']:.2f} s (verify {r['verify_s']:.3f} s)"
        print(line)
        if r.get("lora_bytes"):
            lora_line(r, args.lora)
    big = results.get("0.5b") or next(iter(results.values()))
    nbytes = QWEN3_30B_A3B_PARAMS * (2 if args.dtype == "bfloat16" else 4)
    projection = {"bytes": nbytes, "export_s": nbytes / 1e9 / big["export_gbps"]}
    if big.get("update_s"):
        projection["load_s"] = nbytes / (big["bytes"] / big["update_s"])
    line = f"\nQwen3-30B-A3B on this path ({nbytes / 1e9:.0f} GB {args.dtype}): export {projection['export_s']:.0f} s"
    line += f" at {big['export_gbps']:.2f} GB/s"
    if "load_s" in projection:
        line += f", each worker's load {projection['load_s']:.0f} s at the measured "
        line += f"{big['bytes'] / big['update_s'] / 1e9:.2f} GB/s"
    print(line + "; anchors: Perplexity 1.3 s for a 1T model over RDMA, checkpoint-engine 14-16 s for Kimi-K2 on H20s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"facts": facts, "results": results, "qwen3_30b_a3b": projection}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
