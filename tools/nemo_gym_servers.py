"""Serve one of NeMo Gym's own resources servers on a loopback port, from a venv of its own.

    python tools/nemo_gym_servers.py --list                      the servers in the nemo-gym wheel
    python tools/nemo_gym_servers.py --setup NAME [NAME ...]     build (or reuse) the venv for them
    python tools/nemo_gym_servers.py --where NAME                the server's folder (data/example.jsonl, ...)
    python tools/nemo_gym_servers.py NAME [--port 0] [--set should_use_judge=false ...]
        -> prints `http://127.0.0.1:PORT` on its own line once the server accepts requests

ptrain never depends on nemo-gym: the servers run in a separate virtualenv (default
~/.cache/ptrain/nemo_gym_venv, or --venv / $PTRAIN_NEMO_GYM_VENV) that this script creates
once and reuses (a stamp file records what is installed; a lock file serialises builders).
`ptrain.envs.nemo_gym` then talks to the served app over HTTP, as NeMo Gym's agents do.

How a server is served. NeMo Gym's launcher starts Ray and a head server; a resources server
does not need either. This script imports `resources_servers/<NAME>/app.py` from the wheel,
takes the server's own config block from `configs/<NAME>.yaml` (the block whose
`resources_servers` key is NAME, with --set overrides), builds the server class with
`model_construct(config=..., server_client=None)` (no head server to reach; only LLM-judge
paths use the client), and serves `setup_webserver()` with uvicorn, plus the liveness route
and the exception middleware that NeMo Gym's own `run_webserver` adds.

The minimum install (nemo-gym 0.4.0, Python 3.11; the wheel says >= 3.12 but runs on 3.11).
The full `pip install nemo-gym` pulls about 1.4 GB (Ray with its dashboard extras, MLflow,
W&B, datasets, MCP, Anthropic, ...). The resources servers only need the modules that
`nemo_gym.server_utils`, `nemo_gym.base_resources_server` and their imports load at import
time, so the wheel goes in with --no-deps and these follow, each with its own dependencies:

    omegaconf>=2.3 hydra-core>=1.3.2   (first: otherwise pip walks back through old omegaconf)
    fastapi uvicorn pydantic itsdangerous "openai<=2.7.2" orjson aiohttp requests rich
    ray (no extras)  wandb  pandas  yappi gprof2dot pydot

Ray (import ray in server_utils), W&B (global_config, reward_profile), pandas
(reward_profile) and yappi/gprof2dot/pydot (profiling) are imported at module level, so none
can be left out without editing NeMo Gym. Measured on this machine (2 shared cores, the
package mirror): 79 distributions, 657 MB for the base (ray 240 MB, pandas 84 MB, numpy
73 MB, wandb 62 MB, the wheel's own server folders 59 MB, openai 13 MB), 748 MB with
math_with_judge's extra, built in about 55 s; a server starts in about 2.5 s. Per server,
the packages of its requirements.txt are added, less the ones only its data-preparation
scripts import (SERVE_TIME_SKIP): math_with_judge adds math-verify==0.8.0 (with
latex2sympy2_extended and sympy, 91 MB) and skips `datasets`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

NEMO_GYM_VERSION = "0.4.0"
NEMO_GYM_REQUIREMENT = f"nemo-gym=={NEMO_GYM_VERSION}"
FIRST_PACKAGES = ("omegaconf>=2.3", "hydra-core>=1.3.2")
"""Installed first, alone: with them in place pip does not backtrack through old omegaconf."""
BASE_PACKAGES = (
    "fastapi",
    "uvicorn",
    "pydantic",
    "itsdangerous",
    "openai<=2.7.2",
    "orjson",
    "aiohttp",
    "requests",
    "rich",
    "ray",
    "wandb",
    "pandas",
    "yappi",
    "gprof2dot",
    "pydot",
)
"""What NeMo Gym's server modules import at load time (module docstring)."""
SERVE_TIME_SKIP = {"math_with_judge": ("datasets",)}
"""Requirements a server lists that only its data-preparation scripts import."""
DEFAULT_VENV = Path.home() / ".cache" / "ptrain" / "nemo_gym_venv"
STAMP = "ptrain_nemo_gym_stamp.json"
HOST = "127.0.0.1"


class SetupError(RuntimeError):
    """The venv could not be built (no registry access, a failed install); the message says
    which step failed and the command to retry it."""


def venv_dir(path: str | os.PathLike | None = None) -> Path:
    """The venv to use: `path`, else $PTRAIN_NEMO_GYM_VENV, else ~/.cache/ptrain/nemo_gym_venv."""
    return Path(path or os.environ.get("PTRAIN_NEMO_GYM_VENV") or DEFAULT_VENV).expanduser().resolve()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_command(servers: list[str], venv: Path | None = None) -> str:
    """The shell command that builds the venv for `servers` (for error and skip messages)."""
    here = Path(__file__).resolve()
    extra = f" --venv {venv}" if venv is not None and venv != venv_dir() else ""
    return f"python {here} --setup {' '.join(servers)}{extra}"


def _run(cmd: list[str], what: str, retry: str) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise SetupError(f"{what} failed (exit {proc.returncode}):\n{tail}\nretry with: {retry}")


def _read_stamp(venv: Path) -> dict:
    try:
        return json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(venv: Path, stamp: dict) -> None:
    tmp = venv / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True))
    tmp.replace(venv / STAMP)


def wheel_path(cache: Path, retry: str) -> Path:
    """The nemo-gym wheel in `cache`, downloaded (no dependencies) when missing."""
    wheels = cache / "wheels"
    found = sorted(wheels.glob(f"nemo_gym-{NEMO_GYM_VERSION}-*.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12", "--only-binary=:all:",
         NEMO_GYM_REQUIREMENT, "-d", str(wheels), "-q"],
        f"downloading {NEMO_GYM_REQUIREMENT}",
        retry,
    )  # fmt: skip
    found = sorted(wheels.glob(f"nemo_gym-{NEMO_GYM_VERSION}-*.whl"))
    if not found:
        raise SetupError(f"pip download left no nemo_gym-{NEMO_GYM_VERSION} wheel in {wheels}; retry with: {retry}")
    return found[0]


def _server_requirements(site: Path, name: str) -> list[str]:
    """The packages of resources_servers/<name>/requirements.txt that serving it needs."""
    req = site / "resources_servers" / name / "requirements.txt"
    if not req.exists():
        return []
    skip = set(SERVE_TIME_SKIP.get(name, ()))
    out = []
    for line in req.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-e") or line.startswith("-r") or "nemo-gym" in line:
            continue
        dist = re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]
        if dist not in skip:
            out.append(line)
    return out


def _site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise SetupError(f"{venv} has no lib/python3*/site-packages; delete it and run the setup again")
    return found[0]


def ensure_venv(servers: list[str], venv: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) the NeMo Gym venv with what `servers` need; returns its python.

    Idempotent: a stamp file in the venv records the nemo-gym version, the base packages and
    each server's extra packages; only what is missing is installed. A lock file next to the
    venv keeps two builders (two test sessions) from installing into it at once.
    """
    venv = venv_dir(venv)
    retry = setup_command(servers, venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = _read_stamp(venv)
        base_key = {"nemo_gym": NEMO_GYM_VERSION, "packages": list(FIRST_PACKAGES + BASE_PACKAGES)}
        python = venv_python(venv)
        if stamp.get("base") != base_key or not python.exists():
            if not python.exists():
                _run([sys.executable, "-m", "venv", str(venv)], f"creating the venv {venv}", retry)
            pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            wheel = wheel_path(venv.parent, retry)
            _run(pip + list(FIRST_PACKAGES), f"installing {' '.join(FIRST_PACKAGES)} into {venv}", retry)
            _run(pip + list(BASE_PACKAGES), f"installing NeMo Gym's server dependencies into {venv}", retry)
            _run(
                pip + ["--no-deps", "--ignore-requires-python", "--only-binary=:all:", str(wheel)],
                f"installing {wheel.name} into {venv}",
                retry,
            )
            stamp = {"base": base_key, "servers": {}}
            _write_stamp(venv, stamp)
        site = _site_packages(venv)
        for name in servers:
            _check_server_name(site, name)
            reqs = _server_requirements(site, name)
            if stamp.get("servers", {}).get(name) == reqs:
                continue
            if reqs:
                pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
                _run(pip + reqs, f"installing {name}'s requirements {reqs} into {venv}", retry)
            stamp.setdefault("servers", {})[name] = reqs
            _write_stamp(venv, stamp)
    return python


def server_dir(name: str, venv: str | os.PathLike | None = None) -> Path:
    """The folder of resources server `name` in the venv (app.py, configs/, data/)."""
    return _site_packages(venv_dir(venv)) / "resources_servers" / name


def available_servers(site: Path | None = None, wheel: Path | None = None) -> list[str]:
    """Names of the resources servers (folders with an app.py) in the venv or in the wheel."""
    if site is not None:
        return sorted(p.parent.name for p in (site / "resources_servers").glob("*/app.py"))
    with zipfile.ZipFile(wheel) as zf:
        names = {n.split("/")[1] for n in zf.namelist() if re.fullmatch(r"resources_servers/[^/]+/app\.py", n)}
    return sorted(names)


def _check_server_name(site: Path, name: str) -> None:
    if not (site / "resources_servers" / name / "app.py").exists():
        names = available_servers(site)
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise SetupError(
            f"no resources server {name!r} in nemo-gym {NEMO_GYM_VERSION}; {hint}"
            f"python {Path(__file__).resolve()} --list shows all {len(names)}"
        )


# ----------------------------------------------------------------------------- inside the NeMo Gym venv


def _parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise SystemExit(f"--set {text!r}: expected KEY=VALUE (VALUE as JSON or a plain string)")
    key, value = text.split("=", 1)
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def server_config_block(server_dir: Path, name: str) -> tuple[str, dict]:
    """(instance name, config dict) of resources server `name` from its configs/*.yaml:
    `configs/<name>.yaml` first, then any other file, the first block whose
    `resources_servers` key is `name`."""
    from omegaconf import OmegaConf

    files = sorted((server_dir / "configs").glob("*.yaml"), key=lambda p: (p.stem != name, p.name))
    for path in files:
        conf = OmegaConf.load(path)
        for instance, block in conf.items():
            servers = block.get("resources_servers") if hasattr(block, "get") else None
            if servers is not None and name in servers:
                return str(instance), OmegaConf.to_container(servers[name], resolve=False)
    raise SystemExit(f"no configs/*.yaml in {server_dir} declares resources_servers.{name}")


def serve_inside(name: str, port: int, overrides: list[str]) -> None:
    """Import resources_servers/<name>/app.py, build the server, serve it on 127.0.0.1:port."""
    import asyncio
    import importlib
    import socket

    import uvicorn
    from nemo_gym.base_resources_server import SimpleResourcesServer

    module = importlib.import_module(f"resources_servers.{name}.app")
    server_dir = Path(module.__file__).parent
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, SimpleResourcesServer) and c.__module__ == module.__name__
    ]
    if len(classes) != 1:
        raise SystemExit(
            f"{module.__file__}: expected one resources server class, found {[c.__name__ for c in classes]}"
        )
    server_cls = classes[0]
    instance, block = server_config_block(server_dir, name)
    block.update(dict(_parse_override(o) for o in overrides))
    config_cls = server_cls.model_fields["config"].annotation
    config = config_cls.model_validate({**block, "host": HOST, "port": port, "name": instance})
    # The server client reaches NeMo Gym's head server, which a lone resources server does not have.
    server = server_cls.model_construct(config=config, server_client=None)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {HOST}:{port} ({e}); pass another --port (0 picks a free one)") from None
    sock.listen(128)
    bound = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))

    async def run() -> None:
        task = asyncio.create_task(uv.serve(sockets=[sock]))
        while not uv.started and not task.done():
            await asyncio.sleep(0.02)
        if uv.started:
            print(f"http://{HOST}:{bound}", flush=True)
        await task

    os.chdir(server_dir)
    asyncio.run(run())


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("name", nargs="?", help="resources server to serve (a folder of resources_servers/)")
    p.add_argument("--port", type=int, default=0, help="loopback port (0: a free one; the URL is printed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the server's config block (VALUE parsed as JSON)")  # fmt: skip
    p.add_argument("--venv", default=None, help=f"NeMo Gym venv (default $PTRAIN_NEMO_GYM_VENV or {DEFAULT_VENV})")
    p.add_argument("--list", action="store_true", help="list the resources servers in the wheel")
    p.add_argument("--setup", nargs="+", metavar="NAME", help="build or reuse the venv for these servers, then exit")
    p.add_argument("--where", metavar="NAME", help="build or reuse the venv for NAME, print the server's folder")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.inside:
        serve_inside(args.name, args.port, args.overrides)
        return 0
    try:
        if args.list:
            venv = venv_dir(args.venv)
            if (venv / STAMP).exists():
                names = available_servers(site=_site_packages(venv))
            else:
                names = available_servers(wheel=wheel_path(venv.parent, setup_command(["NAME"], venv)))
            print("\n".join(names))
            return 0
        if args.setup:
            python = ensure_venv(args.setup, args.venv)
            print(python)
            return 0
        if args.where:
            python = ensure_venv([args.where], args.venv)
            print(server_dir(args.where, args.venv))
            return 0
        if not args.name:
            p.error("name a resources server (--list shows them), or pass --list / --setup")
        python = ensure_venv([args.name], args.venv)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cmd = [str(python), str(Path(__file__).resolve()), args.name, "--inside", "--port", str(args.port)]
    for o in args.overrides:
        cmd += ["--set", o]
    with contextlib.suppress(AttributeError):
        sys.stdout.flush()
    os.execv(str(python), cmd)
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
