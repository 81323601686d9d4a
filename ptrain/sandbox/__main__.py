"""`python -m ptrain.sandbox [options] -- CMD ARGS...`: run one command in the code sandbox.

Prints the command's stdout and stderr and exits with its exit code (128 + N when signal N
ended it, as a shell reports it). When the sandbox killed it (timeout, output cap) or a
limit ended it, one line on stderr says why. A machine where nothing can isolate, or a bad
option, exits 125 with the reason; `--backend none` runs unisolated, with a warning.

    python -m ptrain.sandbox --timeout 5 --files ./task -- python test_solution.py
    python -m ptrain.sandbox --json -- sh -c 'echo hi'      # the whole result as JSON
"""

from __future__ import annotations

import argparse
import json
import sys

from ptrain.config.sandbox import BACKENDS, SandboxConfig
from ptrain.sandbox.isolation import Sandbox, SandboxUnavailableError

SANDBOX_ERROR_EXIT = 125
"""Exit code when the sandbox itself could not run the command (as `env` and docker use)."""


def _parser() -> argparse.ArgumentParser:
    defaults = SandboxConfig()
    p = argparse.ArgumentParser(
        prog="python -m ptrain.sandbox",
        description="Run CMD isolated: own PID/network/IPC/UTS/mount namespaces, read-only host "
        "folders, a capped scratch folder as working directory, rlimits, a wall timeout.",
        epilog="Exit code: the command's (128+N for signal N); 125 when the sandbox could not run it.",
    )
    p.add_argument("--timeout", type=float, default=defaults.timeout_s, help="wall-clock limit in seconds")
    p.add_argument("--memory-mb", type=int, default=defaults.memory_mb, help="address-space limit per process")
    p.add_argument("--cpu-time", type=float, default=None, help="CPU seconds per process (default: the timeout)")
    p.add_argument("--max-processes", type=int, default=defaults.max_processes, help="processes and threads")
    p.add_argument("--scratch-mb", type=int, default=defaults.scratch_mb, help="size cap of the scratch folder")
    p.add_argument("--max-output-bytes", type=int, default=defaults.max_output_bytes, help="per stream")
    p.add_argument("--files", default=None, help="folder (or file) copied into the scratch folder")
    p.add_argument("--backend", choices=BACKENDS, default=defaults.backend)
    p.add_argument("--stdin", action="store_true", help="pass this process's standard input to the command")
    p.add_argument("--json", action="store_true", help="print the result (exit code, output, times) as JSON")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print(
            "ptrain.sandbox: no command given; usage: python -m ptrain.sandbox [options] -- CMD ARGS...",
            file=sys.stderr,
        )
        return SANDBOX_ERROR_EXIT
    cfg = SandboxConfig(
        backend=args.backend,
        timeout_s=args.timeout,
        cpu_time_s=args.cpu_time,
        memory_mb=args.memory_mb,
        max_processes=args.max_processes,
        scratch_mb=args.scratch_mb,
        max_output_bytes=args.max_output_bytes,
    )
    try:
        sandbox = Sandbox(cfg)
        stdin = sys.stdin.buffer.read() if args.stdin else None
        result = sandbox.run(cmd, files=args.files, stdin=stdin)
    except (SandboxUnavailableError, ValueError) as e:
        print(f"ptrain.sandbox: {e}", file=sys.stderr)
        return SANDBOX_ERROR_EXIT
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return result.exit_code
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    if result.killed_by:
        cut = " (output cut)" if result.truncated else ""
        print(
            f"ptrain.sandbox: ended by {result.killed_by} after {result.wall_s:.2f} s wall, "
            f"{result.cpu_s:.2f} s CPU{cut}",
            file=sys.stderr,
        )
    sys.stderr.flush()
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
