"""Latency and throughput of a small sandboxed Python test, beside the same run unsandboxed.

    python tools/bench_sandbox.py                  # auto backend (bwrap here), 2 cores
    python tools/bench_sandbox.py --backend unshare --runs 40
    python tools/bench_sandbox.py --reward         # also the reward worker pool's overhead

The payload is what a code environment runs per sample: a solution file and a test file of
a few asserts, copied into a fresh working folder, then `python test_solution.py`. The
unsandboxed run writes the same two files into a fresh temporary folder and runs the same
interpreter there with the same environment, so the difference is the isolation alone.
Latency: p50/p95 over sequential runs. Throughput: executions per second with --concurrency
runs in flight (asyncio, no thread per run), pinned to --cores CPUs. Targets:
sandboxed p50 at most 1.5x the unsandboxed p50, and at least 20 executions/s on 2 cores.
`true` through each path is also timed, to show the fixed cost of the isolation itself.
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
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ptrain.config.sandbox import SandboxConfig  # noqa: E402
from ptrain.sandbox.isolation import Sandbox, _sandbox_env  # noqa: E402

SOLUTION = """
def longest_common_prefix(words):
    if not words:
        return ""
    prefix = words[0]
    for w in words[1:]:
        while not w.startswith(prefix):
            prefix = prefix[:-1]
    return prefix
"""
TEST = """
from solution import longest_common_prefix as f
assert f(["flower", "flow", "flight"]) == "fl"
assert f(["dog", "racecar", "car"]) == ""
assert f([]) == ""
assert f(["same", "same"]) == "same"
print("4 passed")
"""
FILES = {"solution.py": SOLUTION, "test_solution.py": TEST}
CMD = ["python", "test_solution.py"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class Unsandboxed:
    """The same run without isolation: fresh temp folder, same files, same interpreter and env."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def _prepare(self, files: dict[str, str]) -> str:
        work = tempfile.mkdtemp(prefix="bench-unsandboxed-")
        for name, text in files.items():
            with open(os.path.join(work, name), "w") as f:
                f.write(text)
        return work

    def run(self, cmd: list[str], files: dict[str, str]) -> bytes:
        work = self._prepare(files)
        try:
            exe = shutil.which(cmd[0], path=self.env["PATH"])
            p = subprocess.run([exe, *cmd[1:]], cwd=work, env={**self.env, "HOME": work}, capture_output=True)
            assert p.returncode == 0, p.stderr
            return p.stdout
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def run_async(self, cmd: list[str], files: dict[str, str]) -> bytes:
        work = self._prepare(files)
        try:
            exe = shutil.which(cmd[0], path=self.env["PATH"])
            p = await asyncio.create_subprocess_exec(
                exe,
                *cmd[1:],
                cwd=work,
                env={**self.env, "HOME": work},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await p.communicate()
            assert p.returncode == 0, err
            return out
        finally:
            shutil.rmtree(work, ignore_errors=True)


def latency(run, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def throughput(make_coro, runs: int, concurrency: int) -> float:
    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one():
            async with sem:
                await make_coro()

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(runs)))
        return runs / (time.perf_counter() - start)

    return asyncio.run(main())


def bench_sandbox(args) -> dict:
    sandbox = Sandbox(SandboxConfig(backend=args.backend))
    plain = Unsandboxed(_sandbox_env(SandboxConfig()))

    def sandboxed(cmd=CMD, files=FILES):
        r = sandbox.run(cmd, files=files)
        assert r.ok, (r.exit_code, r.killed_by, r.stderr_text)

    for _ in range(3):  # warm the page cache and the interpreter's imports
        sandboxed()
        plain.run(CMD, FILES)
    out: dict = {"backend": sandbox.backend, "runs": args.runs, "cores": args.cores, "concurrency": args.concurrency}
    # Alternate the two so that load from other processes hits both alike.
    sb_times, plain_times, sb_true, plain_true = [], [], [], []
    for _ in range(args.runs):
        sb_times += latency(sandboxed, 1)
        plain_times += latency(lambda: plain.run(CMD, FILES), 1)
        sb_true += latency(lambda: sandboxed(["true"], None), 1)
        plain_true += latency(lambda: plain.run(["true"], {}), 1)
    for name, xs in (("sandboxed", sb_times), ("unsandboxed", plain_times), ("sandboxed_true", sb_true),
                     ("unsandboxed_true", plain_true)):  # fmt: skip
        out[f"{name}_p50_ms"] = 1000 * statistics.median(xs)
        out[f"{name}_p95_ms"] = 1000 * percentile(xs, 0.95)
    out["latency_ratio_p50"] = out["sandboxed_p50_ms"] / out["unsandboxed_p50_ms"]

    async def sb_async():
        r = await sandbox.run_async(CMD, files=FILES)
        assert r.ok, r.stderr_text

    out["sandboxed_exec_per_s"] = throughput(sb_async, args.throughput_runs, args.concurrency)
    out["unsandboxed_exec_per_s"] = throughput(
        lambda: plain.run_async(CMD, FILES), args.throughput_runs, args.concurrency
    )
    out["meets_latency_target"] = out["latency_ratio_p50"] <= 1.5
    out["meets_throughput_target"] = out["sandboxed_exec_per_s"] >= 20
    return out


def trivial_reward(x: float) -> float:
    return x + 1.0


def bench_reward(runs: int) -> dict:
    from ptrain.envs.safety import RewardRunner

    with RewardRunner(workers=2) as runner:
        for _ in range(10):
            runner.run(trivial_reward, 1.0)
        pooled = latency(lambda: runner.run(trivial_reward, 1.0), runs)
    direct = latency(lambda: trivial_reward(1.0), runs)
    return {
        "reward_pool_p50_us": 1e6 * statistics.median(pooled),
        "reward_pool_p95_us": 1e6 * percentile(pooled, 0.95),
        "reward_direct_p50_us": 1e6 * statistics.median(direct),
    }


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="auto", choices=("auto", "bwrap", "unshare"))
    p.add_argument("--runs", type=int, default=60, help="sequential runs per latency figure")
    p.add_argument("--throughput-runs", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=8, help="runs in flight for the throughput figure")
    p.add_argument("--cores", type=int, default=2, help="CPUs to pin to (the first N this process may use)")
    p.add_argument("--reward", action="store_true", help="also time run_reward_fn's worker round trip")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    args = p.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < args.cores:
        print(f"note: only {len(allowed)} CPUs available, using them all", file=sys.stderr)
    os.sched_setaffinity(0, allowed[: args.cores])
    args.cores = len(os.sched_getaffinity(0))
    out = {"cpu": cpu_model(), **bench_sandbox(args)}
    if args.reward:
        out.update(bench_reward(args.runs * 5))
    if args.json:
        print(json.dumps(out))
        return
    print(f"CPU: {out['cpu']}; pinned to {out['cores']} cores; backend {out['backend']}")
    print(f"{'':28s}{'p50 ms':>10s}{'p95 ms':>10s}")
    for name in ("sandboxed", "unsandboxed", "sandboxed_true", "unsandboxed_true"):
        label = name.replace("_true", " `true`").replace("sandboxed", "sandboxed python test")
        print(f"{label:28s}{out[f'{name}_p50_ms']:10.1f}{out[f'{name}_p95_ms']:10.1f}")
    ok = lambda flag: "meets target" if flag else "MISSES target"
    print(f"latency ratio (p50): {out['latency_ratio_p50']:.2f}x  ({ok(out['meets_latency_target'])} <= 1.5x)")
    print(
        f"throughput, {out['concurrency']} in flight: sandboxed {out['sandboxed_exec_per_s']:.1f}/s, "
        f"unsandboxed {out['unsandboxed_exec_per_s']:.1f}/s  ({ok(out['meets_throughput_target'])} >= 20/s)"
    )
    if args.reward:
        print(
            f"reward worker round trip: p50 {out['reward_pool_p50_us']:.0f} us, p95 {out['reward_pool_p95_us']:.0f} us "
            f"(direct call {out['reward_direct_p50_us']:.1f} us)"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
