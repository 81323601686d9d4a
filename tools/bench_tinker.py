"""Tinker server benchmark: tokens/s through `python -m ptrain.tinker`, driven by the real
`tinker` SDK, against `ptrain.TrainingClient` in this process on the same model and batches.

    python tools/bench_tinker.py                 # the bench model of tools/bench_model.py
    python tools/bench_tinker.py --small         # a 2-layer d128 model (smoke)
    python tools/bench_tinker.py --rounds 5 --batch 8 --seq-len 512

One model folder (tools/bench_serve.build_folder: Hugging Face format, embedded tokenizer),
one LoRA adapter of rank --rank (alpha 32, on attention, MLP and the output head: what the
SDK's default LoraConfig asks the server for), seed 0 on both sides. Two paths:

  train   per round, --steps steps, each a cross_entropy `forward_backward` of --batch
          random sequences of --seq-len tokens (targets the next token, weights 1) and an
          Adam `optim_step` (lr 1e-4), each waited for before the next call. Tokens/s counts
          the trained tokens (batch x seq-len per step).
  sample  --requests random prompts of --prompt-len tokens, each sampled --num-samples times
          for at most --new-tokens tokens at temperature 1, from the trained adapter (merged
          into the weights, as an adapter on the output head is). In-process: one
          `TrainingClient.sample` over all prompts; server: `save_weights_for_sampler`, then
          every prompt's `sample` submitted at once from the SDK's sampling client. Tokens/s
          counts the sampled tokens either side returned. Both engines have 32 rows (the
          server's) and a context of --context-length.

  in-process  ptrain.client.TrainingClient(load_base(folder), lora=...) in this process
  server      `python -m ptrain.tinker` on a loopback port (a subprocess, its log in a file),
              through tinker.ServiceClient(base_url=..., api_key=...)

Both sides run one warm-up round (compiles) and then alternate rounds, so they see the same
load on the machine; the medians and their ratio (server / in-process) are printed. The
ratio is the server's overhead: protobuf and JSON encoding at the SDK and the server, HTTP
on loopback, the futures' polling (`retrieve_future`), the event loop sharing the GIL with
the work, and the SDK's threads taking a share of the CPUs. The target is a ratio of at
least 0.90 for training; sampling has none (its many small requests pay the per-request
cost many times), its ratio is printed for the record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ptrain.models import count_params  # noqa: E402
from tools.bench_model import DENSE  # noqa: E402
from tools.bench_serve import SMALL, build_folder, free_port  # noqa: E402

KEY = "tml-bench"
ROWS = 32  # the server's engines' rows (TinkerService's max_running_requests)
TARGETS = {"train": 0.90, "sample": None}  # the brief sets a target for training only


def start_server(path: str, root: str, port: int, context: int, log_path: str) -> subprocess.Popen:
    """`python -m ptrain.tinker` with its output in log_path; returns once it prints base_url."""
    cmd = [
        sys.executable, "-m", "ptrain.tinker", "--model-path", path, "--port", str(port), "--api-key", KEY,
        "--root-dir", root, "--context-length", str(context), "--log-level", "warning",
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 (the subprocess writes to it for its whole life)
    proc = subprocess.Popen(
        cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        with open(log_path) as f:
            if "base_url=" in f.read():
                return proc
        if proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise SystemExit(f"the server exited with {proc.returncode}:\n{tail}")
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server printed no base_url in 15 minutes")


def make_batches(rng: np.random.Generator, vocab: int, steps: int, batch: int, seq_len: int) -> list[list[list[int]]]:
    """steps x batch sequences of seq_len + 1 token ids (inputs and their next-token targets)."""
    return [rng.integers(5, vocab, (batch, seq_len + 1)).tolist() for _ in range(steps)]


def local_datums(batch: list[list[int]]):
    from ptrain.client import Datum

    return [
        Datum(s[:-1], {"target_tokens": np.asarray(s[1:], np.int64), "weights": np.ones(len(s) - 1, np.float32)})
        for s in batch
    ]


def sdk_datums(batch: list[list[int]]):
    import tinker

    return [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={
                "target_tokens": tinker.TensorData.from_numpy(np.asarray(s[1:], np.int64)),
                "weights": tinker.TensorData.from_numpy(np.ones(len(s) - 1, np.float32)),
            },
        )
        for s in batch
    ]


def train_local(client, batches: list) -> float:
    """Trained tokens/s of forward_backward + optim_step in this process."""
    from ptrain.client import AdamParams

    data = [local_datums(b) for b in batches]  # built before the clock, as the SDK's are
    tokens = sum(len(d.tokens) for step in data for d in step)
    t = time.perf_counter()
    for step in data:
        client.forward_backward(step, "cross_entropy")
        client.optim_step(AdamParams(learning_rate=1e-4))
    return tokens / (time.perf_counter() - t)


def train_server(tc, batches: list) -> float:
    import tinker

    data = [sdk_datums(b) for b in batches]
    tokens = sum(d.model_input.length for step in data for d in step)
    t = time.perf_counter()
    for step in data:
        tc.forward_backward(step, "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=1e-4)).result()
    return tokens / (time.perf_counter() - t)


def sample_local(client, prompts: list[list[int]], n: int, new_tokens: int) -> float:
    """Sampled tokens/s of TrainingClient.sample over every prompt at once."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0}
    t = time.perf_counter()
    out = client.sample(prompts, n=n, sampling_params=params)
    seconds = time.perf_counter() - t
    return sum(len(s.output_ids) for samples in out for s in samples) / seconds


def sample_server(sc, prompts: list[list[int]], n: int, new_tokens: int) -> float:
    """Sampled tokens/s of one SDK `sample` per prompt, all submitted before any is awaited."""
    import tinker

    params = tinker.SamplingParams(max_tokens=new_tokens, temperature=1.0)
    inputs = [tinker.ModelInput.from_ints(p) for p in prompts]
    t = time.perf_counter()
    futures = [sc.sample(p, num_samples=n, sampling_params=params) for p in inputs]
    answers = [f.result() for f in futures]
    seconds = time.perf_counter() - t
    return sum(len(s.tokens) for a in answers for s in a.sequences) / seconds


def machine_line() -> str:
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | head -1"], capture_output=True, text=True).stdout
    cpu = cpu.split(":", 1)[-1].strip() or "unknown CPU"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    import jax

    return (
        f"machine: {cpu}, {os.cpu_count()} CPUs; jax {jax.__version__} on {jax.default_backend()} "
        f"({jax.device_count()} device(s)); load average {load}"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a 2-layer d128 model and a small workload (smoke)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side after the warm-up (default 3)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per round (default 3; small 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; small 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; small 32)")
    ap.add_argument("--requests", type=int, default=None, help="sampled prompts per round (default 16; small 4)")
    ap.add_argument("--num-samples", type=int, default=2, help="samples per prompt (default 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; small 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="sampled tokens at most (default 64; small 16)")
    args = ap.parse_args(argv)
    small = args.small
    pick = lambda value, big, little: value if value is not None else (little if small else big)  # noqa: E731
    steps, batch, seq_len = pick(args.steps, 3, 2), pick(args.batch, 4, 2), pick(args.seq_len, 256, 32)
    requests, prompt_len = pick(args.requests, 16, 4), pick(args.prompt_len, 64, 16)
    new_tokens, n = pick(args.new_tokens, 64, 16), args.num_samples
    cfg = SMALL if small else DENSE
    context = max(seq_len, prompt_len + new_tokens)

    import tinker

    from ptrain.client import TrainingClient, load_base
    from ptrain.config.lora import LoRAConfig

    print(machine_line(), flush=True)
    print(
        f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, "
        f"{count_params(cfg) / 1e6:.1f}M params, float32; LoRA rank {args.rank} (alpha 32) on attention, mlp, lm_head"
    )
    print(
        f"workload: train {steps} steps x {batch} x {seq_len} tokens per round; sample {requests} prompts x "
        f"{n} samples x {new_tokens} tokens ({prompt_len}-token prompts), {ROWS} rows, context {context}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    rounds = [make_batches(rng, cfg.vocab_size, steps, batch, seq_len) for _ in range(args.rounds + 1)]
    prompts = rng.integers(5, cfg.vocab_size, (requests, prompt_len)).tolist()
    results: dict[str, tuple[list[float], list[float]]] = {"train": ([], []), "sample": ([], [])}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_folder(cfg, os.path.join(tmp, "model"))
        log_path = os.path.join(tmp, "server.log")
        port = free_port()
        server = start_server(path, os.path.join(tmp, "runs"), port, context, log_path)
        try:
            lora = LoRAConfig(rank=args.rank, alpha=32, targets=["attention", "mlp", "lm_head"])
            local = TrainingClient(
                load_base(path), lora=lora, seed=0, max_running_requests=ROWS, context_length=context
            )
            service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
            tc = service.create_lora_training_client(base_model=os.path.abspath(path), rank=args.rank).result()
            # train: a warm-up round each (compiles), then alternate
            train_local(local, rounds[0])
            train_server(tc, rounds[0])
            for r in range(args.rounds):
                a, b = train_local(local, rounds[r + 1]), train_server(tc, rounds[r + 1])
                results["train"][0].append(a)
                results["train"][1].append(b)
                print(f"train round {r}: in-process {a:.0f} tok/s, server {b:.0f} tok/s ({b / a:.3f})", flush=True)
            saved = tc.save_weights_for_sampler("bench").result()
            sc = service.create_sampling_client(model_path=saved.path).result()
            sample_local(local, prompts, n, new_tokens)
            sample_server(sc, prompts, n, new_tokens)
            for r in range(args.rounds):
                a, b = sample_local(local, prompts, n, new_tokens), sample_server(sc, prompts, n, new_tokens)
                results["sample"][0].append(a)
                results["sample"][1].append(b)
                print(f"sample round {r}: in-process {a:.0f} tok/s, server {b:.0f} tok/s ({b / a:.3f})", flush=True)
            local.close()
            service.close("success").result()
        finally:
            server.terminate()
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    summary = {}
    print(f"\n{'path':<8} {'in-process tok/s':>17} {'server tok/s':>13} {'ratio':>7} {'target':>7}")
    for name, (a_list, b_list) in results.items():
        a, b = statistics.median(a_list), statistics.median(b_list)
        target = TARGETS[name]
        mark = "" if target is None else (" ok" if b / a >= target else " BELOW")
        shown = "-" if target is None else f">= {target:.2f}"
        print(f"{name:<8} {a:>17.0f} {b:>13.0f} {b / a:>7.3f} {shown:>7}{mark}")
        summary[name] = {"in_process": a, "server": b, "ratio": b / a}
    print(f"(medians of {args.rounds} round(s); ratio = server / in-process)")
    return summary


if __name__ == "__main__":
    main()
