"""Run one command as N JAX processes on this machine (a multi-process job on one node).

    python tools/launch_local.py --processes 2 --devices-per-process 4 -- \\
        python -m ptrain recipe=sft_arithmetic scale=smoke train.global_batch_size=8

Process i gets PTRAIN_COORDINATOR=127.0.0.1:<a free port>, PTRAIN_NUM_PROCESSES=N and
PTRAIN_PROCESS_ID=i, which ptrain reads as its `distributed` group (ptrain.config.distributed);
with --devices-per-process K also XLA_FLAGS=--xla_force_host_platform_device_count=K (K CPU
devices each, for tests), with --gpus-per-process G its own CUDA_VISIBLE_DEVICES slice (one
node with several GPUs). Every line a process prints comes out prefixed with `[rank i]`, on
the stream it was written to.

The launcher waits for all of them. If one exits non-zero (or is killed), it stops the
others (SIGTERM to each process group, SIGKILL after --stop-timeout seconds: jax.distributed
takes SIGTERM as a preemption notice, so a rank blocked in a collective outlives it) and exits
with that process's code (128 + signal number for a signal): a multi-process JAX job cannot go
on without one of its processes, and the survivors would only block until the coordination
service's heartbeat timeout. Re-running the same command resumes from the newest checkpoint.
Ctrl-C or SIGTERM to the launcher stops them all the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(
    base: dict[str, str],
    *,
    rank: int,
    processes: int,
    coordinator: str,
    devices_per_process: int | None = None,
    gpus_per_process: int | None = None,
) -> dict[str, str]:
    """The environment of process `rank`: the rank variables, and its device count or GPUs."""
    env = dict(base)
    env.update(
        PTRAIN_COORDINATOR=coordinator,
        PTRAIN_NUM_PROCESSES=str(processes),
        PTRAIN_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",  # lines reach the prefixer as they are printed
    )
    if devices_per_process is not None:
        flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
    if gpus_per_process is not None:
        first = rank * gpus_per_process
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + g) for g in range(gpus_per_process))
    return env


def _pump(stream, out, prefix: str, lock: threading.Lock) -> None:
    """Copy a child's stream line by line to `out`, each line prefixed."""
    for line in iter(stream.readline, b""):
        text = line.decode("utf-8", errors="replace")
        with lock:
            out.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM to every process group still running, SIGKILL to those left after `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + timeout
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        if all(p.poll() is not None for p in procs):
            return


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int]:
    """(rank, exit code) of the rank that most likely ended the job. A rank whose peer died
    fails within milliseconds (its collective breaks) and the two exits may show in either
    order, so look again a moment later and take a rank killed by a signal before one that
    exited non-zero, then the lowest rank."""
    time.sleep(0.5)
    failed = [(r, p.poll()) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
    rank, rc = min(failed, key=lambda f: (f[1] >= 0, f[0]))
    return rank, exit_code(rc)


def exit_code(returncode: int) -> int:
    """A shell's exit code for a child's return code (negative: killed by that signal)."""
    return 128 - returncode if returncode < 0 else returncode


def launch(
    command: list[str],
    processes: int,
    *,
    devices_per_process: int | None = None,
    gpus_per_process: int | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    stop_timeout: float = 3.0,
) -> int:
    """Run `command` as `processes` ranks; returns the job's exit code (module docstring)."""
    coordinator = f"{host}:{port or free_port(host)}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(processes):
            env = child_env(dict(os.environ), rank=rank, processes=processes, coordinator=coordinator,
                            devices_per_process=devices_per_process, gpus_per_process=gpus_per_process)  # fmt: skip
            # Its own process group, so that stopping it reaches everything it started.
            p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)  # fmt: skip
            procs.append(p)
            with lock:
                print(f"launch_local: rank {rank} is pid {p.pid} (coordinator {coordinator})", flush=True)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, f"[rank {rank}] ", lock), daemon=True)
                t.start()
                pumps.append(t)
        code = 0
        while None in [p.poll() for p in procs]:  # poll every one: any() would stop at the first running
            if stopping["signal"] is not None:
                code = 128 + stopping["signal"]
                with lock:
                    print(f"launch_local: got signal {stopping['signal']}; stopping every rank", file=sys.stderr)
                break
            if any(p.returncode not in (None, 0) for p in procs):
                rank, code = _first_failure(procs)
                with lock:
                    print(f"launch_local: rank {rank} exited with code {code}; stopping the others", file=sys.stderr)
                break
            time.sleep(0.1)
        if code == 0 and any(p.returncode != 0 for p in procs):  # they all ended between two looks
            rank, code = _first_failure(procs)
            with lock:
                print(f"launch_local: rank {rank} exited with code {code}", file=sys.stderr)
        _stop(procs, stop_timeout)
        for t in pumps:
            t.join(timeout=5)
        return code
    finally:
        _stop(procs, stop_timeout)
        for s, h in old.items():
            signal.signal(s, h)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/launch_local.py",
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --processes N [--devices-per-process K] -- COMMAND ...",
    )
    p.add_argument("--processes", type=int, required=True, help="number of processes (ranks), >= 1")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="CPU devices of each process (XLA_FLAGS host device count); default: as XLA_FLAGS says")  # fmt: skip
    p.add_argument("--gpus-per-process", type=int, default=None,
                   help="GPUs of each process: rank i sees GPUs i*G .. i*G+G-1 (CUDA_VISIBLE_DEVICES)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="the coordinator's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="the coordinator's port (default: a free one)")
    p.add_argument("--stop-timeout", type=float, default=3.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the ranks (default 3)")  # fmt: skip
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs, after --")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- python -m ptrain recipe=sft_arithmetic")
    if args.processes < 1:
        parser.error(f"--processes must be >= 1, got {args.processes}")
    for name in ("devices_per_process", "gpus_per_process"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return launch(
        command,
        args.processes,
        devices_per_process=args.devices_per_process,
        gpus_per_process=args.gpus_per_process,
        host=args.host,
        port=args.port,
        stop_timeout=args.stop_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
