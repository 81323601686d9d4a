"""HTTP serving benchmark: output tokens/s through `python -m ptrain.serve` against the
in-process LocalEngine on the same requests.

    python tools/bench_serve.py                  # the bench model of tools/bench_model.py
    python tools/bench_serve.py --small          # a 2-layer d128 model (smoke)
    python tools/bench_serve.py --rounds 5 --requests 128

The workload is an RL rollout batch: `--requests` prompts of `--prompt-len` random token ids,
each sampled once at temperature 1 for exactly `--new-tokens` tokens (ignore_eos), with a
per-request sampling_seed so both sides draw the same tokens, log-probs returned. The engine
has 16 rows (--max-running-requests) and a context of prompt + new tokens.

  in-process  engine.generate_many(all requests) in this process
  http        the same requests as concurrent `/generate` calls (input_ids, return_logprob)
              from one asyncio client here to the server, a subprocess on a loopback port,
              which also detokenises every answer (the model folder has the embedded tokenizer)

Both run one warm-up round (compiles) and then alternate rounds, so they see the same load
on the machine; the medians and their ratio (http / in-process) are printed. The server's
own overhead is what the ratio shows: JSON, HTTP, detokenisation, the event loop sharing the
GIL with the engine thread, and the client's share of the CPUs. On a machine shared with
other work the rounds scatter; the share of the client's wall time during which the
server's engine was generating (its requests' longest `e2e_latency`) is measured within one
round, so it separates the server's overhead from the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ptrain.config.model import ModelConfig  # noqa: E402
from ptrain.data.tokenizer import get_tokenizer  # noqa: E402
from ptrain.models import Decoder, count_params, save_hf  # noqa: E402
from ptrain.rollout.local import LocalEngine  # noqa: E402
from ptrain.rollout.protocol import GenerateRequest, SamplingParams  # noqa: E402
from tools.bench_model import DENSE  # noqa: E402

SMALL = ModelConfig(family="qwen3", vocab_size=4096, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                    d_ff=384, max_seq_len=1024, tie_embeddings=False)  # fmt: skip
ROWS = 16


def build_folder(cfg: ModelConfig, path: str) -> str:
    """The model saved in Hugging Face format with the embedded tokenizer (ids above its size decode to nothing)."""
    tokenizer = get_tokenizer(None, os.path.join(path, "tokenizer"), vocab_size=min(cfg.vocab_size, 4096))
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), path, tokenizer=tokenizer)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: str, context: int, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "ptrain.serve", "--model-path", path, "--port", str(port),
        "--max-running-requests", str(ROWS), "--context-length", str(context), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy in 15 minutes")


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    new_tokens: int

    def sampling(self, i: int) -> dict:
        return {"max_new_tokens": self.new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1000 + i}

    def requests(self, tag: str) -> list[GenerateRequest]:
        return [
            GenerateRequest(tuple(p), SamplingParams(**self.sampling(i)), rid=f"{tag}-{i}")
            for i, p in enumerate(self.prompts)
        ]

    def bodies(self, tag: str) -> list[dict]:
        return [
            {"input_ids": p, "sampling_params": self.sampling(i), "return_logprob": True, "rid": f"{tag}-{i}"}
            for i, p in enumerate(self.prompts)
        ]


def run_in_process(engine: LocalEngine, work: Workload, tag: str) -> tuple[float, int]:
    t = time.perf_counter()
    out = engine.generate_many(work.requests(tag))
    seconds = time.perf_counter() - t
    return seconds, sum(len(s.output_ids) for samples in out for s in samples)


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        answers = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    for r in answers:
        r.raise_for_status()
    return [r.json() for r in answers]


def run_http(url: str, work: Workload, tag: str) -> tuple[float, int, float]:
    """(wall seconds at the client, output tokens, seconds the server's engine spent: the
    longest submission-to-end time among the requests, all submitted at the start)."""
    t = time.perf_counter()
    answers = asyncio.run(_post_all(url, work.bodies(tag)))
    seconds = time.perf_counter() - t
    engine_seconds = max(a["meta_info"]["e2e_latency"] for a in answers)
    return seconds, sum(a["meta_info"]["completion_tokens"] for a in answers), engine_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a 2-layer d128 model instead of the bench model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    cfg = SMALL if args.small else DENSE
    context = args.prompt_len + args.new_tokens
    rng = np.random.default_rng(0)
    work = Workload(rng.integers(5, cfg.vocab_size, (args.requests, args.prompt_len)).tolist(), args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_folder(cfg, os.path.join(tmp, "model"))
        print(
            f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, "
            f"{count_params(cfg) / 1e6:.1f}M params, float32; {ROWS} rows, context {context}"
        )
        print(f"workload: {args.requests} requests x {args.new_tokens} new tokens, {args.prompt_len}-token prompts")
        engine = LocalEngine.from_hf(path, max_running_requests=ROWS, context_length=context)
        port = free_port()
        server = start_server(path, context, port)
        url = f"http://127.0.0.1:{port}"
        try:
            run_in_process(engine, work, "warm")
            run_http(url, work, "warm")
            local, remote, inside = [], [], []
            for r in range(args.rounds):
                s, n = run_in_process(engine, work, f"local{r}")
                local.append(n / s)
                s, n, engine_s = run_http(url, work, f"http{r}")
                remote.append(n / s)
                inside.append(engine_s / s)
                print(
                    f"round {r}: in-process {local[-1]:.0f} tok/s, http {remote[-1]:.0f} tok/s "
                    f"(the server's engine busy {inside[-1]:.1%} of the client's wall time)"
                )
        finally:
            engine.close()
            server.terminate()
            server.wait(120)
    a, b = statistics.median(local), statistics.median(remote)
    print(f"in-process: {a:.0f} output tok/s (median of {args.rounds})")
    print(f"http:       {b:.0f} output tok/s (median of {args.rounds})")
    print(f"ratio http / in-process: {b / a:.3f}")
    print(
        f"the server's engine ran for {statistics.median(inside):.1%} of the client's wall time (median): "
        "the rest is HTTP, JSON and detokenisation before the first and after the last token"
    )


if __name__ == "__main__":
    main()
