"""Start an SGLang fleet on this machine: N workers and an sglang-router in front of them.

    python tools/launch_fleet.py --model-path runs/x/base_model --workers 2
    ...
    fleet ready: rollout=sglang rollout.router_url=http://127.0.0.1:30000

Workers are `python -m sglang.launch_server` where SGLang runs (its GPU stack imports), else
`python -m ptrain.serve` (the JAX engine behind the same HTTP API; `--engine` forces one).
Worker i listens on --base-port + i; the router (`python -m sglang_router.launch_router`,
round_robin unless --policy says otherwise) on --router-port, started once every worker
answers /health and given them with --worker-urls. The launcher then prints the override to
pass to the trainer and waits; Ctrl-C or SIGTERM stops the router and the workers (SIGTERM,
so they finish the requests in flight; SIGKILL after --stop-timeout seconds) and exits 0. Each
process writes its log to --log-dir. A worker that exits while the fleet runs is reported on
stderr (the trainer takes it out of service); one that exits during start-up stops the launch
with its log's last lines (exit 1).

Trainer and workers must see the same weight folder (rollout.weight_dir): on one machine,
the stage folder, or /dev/shm/<name> for the fastest pushes. For a LoRA stage, which pushes
its adapters alone, start the workers on the stage's base model with
`--enable-lora --max-lora-rank R --lora-target-modules ...` (passed on to every worker).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sglang_runs() -> bool:
    """Whether SGLang's server imports here (installed with its GPU dependencies)."""
    if importlib.util.find_spec("sglang") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import sglang.launch_server"], capture_output=True, timeout=300)
    return probe.returncode == 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/launch_fleet.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="Hugging Face folder every worker serves")
    p.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="address the workers and the router listen on")
    p.add_argument("--base-port", type=int, default=30010, help="worker i listens on base-port + i (default 30010)")
    p.add_argument("--router-port", type=int, default=30000, help="the router's port (default 30000)")
    p.add_argument("--policy", default="round_robin", help="the router's policy (default round_robin)")
    p.add_argument("--engine", choices=("auto", "sglang", "ptrain"), default="auto",
                   help="auto: SGLang where it runs, else ptrain.serve")  # fmt: skip
    p.add_argument("--worker-args", default="", help="more flags for every worker, e.g. '--tp-size 2'")
    p.add_argument("--router-args", default="", help="more flags for the router")
    lora = p.add_argument_group("LoRA (passed on to every worker: a LoRA stage pushes its adapters alone)")
    lora.add_argument("--enable-lora", action="store_true", help="the workers serve LoRA adapters")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (the stage's lora.rank)")
    lora.add_argument("--lora-target-modules", nargs="+", default=None,
                      help="layers adapters may adapt (the stage's lora.targets, or all)")  # fmt: skip
    lora.add_argument("--max-loras-per-batch", type=int, default=None,
                      help="adapters loaded at once (a push holds two versions while the old one drains)")  # fmt: skip
    p.add_argument("--log-dir", default=None, help="where each process logs (default: a new temporary folder)")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for health (default 1800)")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL on stop")
    return p


def worker_lora_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The LoRA flags for every worker (SGLang's and ptrain.serve's names); a LoRA flag without
    --enable-lora is a mistake (the workers would ignore or refuse it)."""
    given = [f for f, v in (("--max-lora-rank", args.max_lora_rank), ("--lora-target-modules", args.lora_target_modules),
                            ("--max-loras-per-batch", args.max_loras_per_batch)) if v is not None]  # fmt: skip
    if not args.enable_lora:
        if given:
            p.error(f"{', '.join(given)} without --enable-lora: pass --enable-lora too")
        return []
    if args.max_lora_rank is None or args.lora_target_modules is None:
        p.error("--enable-lora needs --max-lora-rank and --lora-target-modules (the stage's lora.rank and "
                "lora.targets), which adapters loaded later must fit")  # fmt: skip
    out = ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank), "--lora-target-modules",
           *args.lora_target_modules]  # fmt: skip
    if args.max_loras_per_batch is not None:
        out += ["--max-loras-per-batch", str(args.max_loras_per_batch)]
    return out


def check_ports(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every port the fleet will take, free and distinct, before anything starts: a server left
    listening on a worker's port would answer /health in that worker's place."""
    import socket

    ports = {f"worker {i} (--base-port + {i})": args.base_port + i for i in range(args.workers)}
    ports["the router (--router-port)"] = args.router_port
    ports["the router's metrics (--router-port + 1)"] = args.router_port + 1
    seen: dict[int, str] = {}
    for who, port in ports.items():
        if not 1 <= port <= 65535:
            p.error(f"port {port} of {who} is not in [1, 65535]")
        if port in seen:
            p.error(f"port {port} is both {seen[port]}'s and {who}'s; move --router-port or --base-port")
        seen[port] = who
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((args.host, port))
            except socket.gaierror as e:
                p.error(f"--host {args.host}: not an address of this machine ({e.strerror})")
            except OSError as e:
                p.error(f"port {port} of {who} on {args.host}: {e.strerror}; stop what uses it or pick other ports")


class Fleet:
    """The child processes, each in its own session so that Ctrl-C reaches only the launcher,
    which then stops them in order."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        path = os.path.join(self.log_dir, f"{name}.log")
        with open(path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self.procs.append((name, proc, path))
        return proc

    def tail(self, path: str, lines: int = 30) -> str:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def dead(self) -> list[tuple[str, int, str]]:
        return [(name, p.returncode, path) for name, p, path in self.procs if p.poll() is not None]

    def stop(self, timeout: float) -> None:
        for _, proc, _ in reversed(self.procs):  # the router first, then the workers
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc, _ in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


class Stop(Exception):
    """Ctrl-C or SIGTERM arrived."""


def wait_healthy(fleet: Fleet, urls: list[str], timeout: float, stopping: list) -> None:
    """Until every URL answers GET /health with 200; SystemExit when a process dies first,
    Stop on Ctrl-C or SIGTERM."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        if stopping:
            raise Stop()
        for name, code, path in fleet.dead():
            raise SystemExit(f"launch_fleet: {name} exited with {code} during start-up:\n{fleet.tail(path)}")
        for url in list(pending):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    pending.remove(url)
                    print(f"  {url} is healthy", flush=True)
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise SystemExit(f"launch_fleet: {pending} not healthy after {timeout:.0f} s; see {fleet.log_dir}")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """Start the fleet, print the trainer's override, run until Ctrl-C or SIGTERM; the exit code."""
    p = build_parser()
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        p.error(f"--model-path {args.model_path}: no config.json; pass a Hugging Face model folder")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    lora_args = worker_lora_args(p, args)
    check_ports(p, args)
    for flag, text in (("--worker-args", args.worker_args), ("--router-args", args.router_args)):
        try:
            shlex.split(text)
        except ValueError as e:
            p.error(f"{flag} {text!r}: {e}; quote it as one shell word, e.g. --worker-args '--tp-size 2'")
    engine = args.engine
    if engine == "auto":
        engine = "sglang" if sglang_runs() else "ptrain"
    elif engine == "sglang" and not sglang_runs():
        p.error("--engine sglang: `import sglang.launch_server` fails here; install SGLang with its dependencies")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="ptrain-fleet-")
    os.makedirs(log_dir, exist_ok=True)
    module = "sglang.launch_server" if engine == "sglang" else "ptrain.serve"
    print(f"launch_fleet: {args.workers} x python -m {module}, logs in {log_dir}", flush=True)

    stopping = []

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fleet = Fleet(log_dir)
    try:
        urls = []
        for i in range(args.workers):
            port = args.base_port + i
            cmd = [sys.executable, "-m", module, "--model-path", args.model_path, "--host", args.host,
                   "--port", str(port), *lora_args, *shlex.split(args.worker_args)]  # fmt: skip
            fleet.start(f"worker-{i}", cmd)
            urls.append(f"http://{args.host}:{port}")
        wait_healthy(fleet, urls, args.startup_timeout, stopping)
        router_url = f"http://{args.host}:{args.router_port}"
        fleet.start(
            "router",
            [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.router_port),
             "--policy", args.policy, "--prometheus-host", args.host, "--prometheus-port", str(args.router_port + 1),
             "--worker-urls", *urls, *shlex.split(args.router_args)],
        )  # fmt: skip
        wait_healthy(fleet, [router_url], 120, stopping)
        deadline = time.monotonic() + 120
        while not stopping:
            listed = httpx.get(router_url + "/workers", timeout=5).json().get("workers", [])
            if sum(w.get("is_healthy", False) for w in listed) == len(urls):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"launch_fleet: the router lists {listed}, not the {len(urls)} workers")
            time.sleep(0.5)
        print(f"fleet ready: rollout=sglang rollout.router_url={router_url}", flush=True)
        print(f'  (or without the router: rollout=sglang "rollout.urls=[{",".join(urls)}]")', flush=True)
        reported: set[str] = set()
        while not stopping:
            for name, code, path in fleet.dead():
                if name not in reported:
                    reported.add(name)
                    print(f"launch_fleet: {name} exited with {code}; last lines:\n{fleet.tail(path, 10)}",
                          file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(0.5)
        print("launch_fleet: stopping", flush=True)
        return 0
    except Stop:
        print("launch_fleet: stopping", flush=True)
        return 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
            return 1
        raise
    finally:
        fleet.stop(args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
