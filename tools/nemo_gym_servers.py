"""Serve one of NeMo Gym's own resources servers on a loopback port, from a venv of its own.

    python tools/nemo_gym_servers.py --list                      the servers in the nemo-gym wheel
    python tools/nemo_gym_servers.py --setup NAME [NAME ...]     build (or reuse) the venv for them
    python tools/nemo_gym_servers.py --where NAME                the server's folder (data/example.jsonl, ...)
    python tools/nemo_gym_servers.py NAME [--port 0] [--set should_use_judge=false ...]
        -> prints `http://127.0.0.1:PORT` on its own line once the server accepts requests
    python tools/nemo_gym_servers.py --nemo-gym-version 0.7.0 NAME     the same from nemo-gym 0.7.0
    python tools/nemo_gym_servers.py --agent-verify URL ROW.json RESPONSE.json
        -> what NeMo Gym's own simple agent sends to URL's /seed_session and /verify for this row
           and response, sent with NeMo Gym's own HTTP client; prints the verify answer

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

Two releases, each in a venv of its own: 0.4.0 (the default; ~/.cache/ptrain/nemo_gym_venv)
and 0.7.0 (--nemo-gym-version 0.7.0; the same path with "-0.7.0" appended, built from the
same base path when --venv or $PTRAIN_NEMO_GYM_VENV moves it). A venv's stamp names its
release, and a venv of one release is never rebuilt as the other.

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

nemo-gym 0.7.0 on Python 3.11. Its wheel declares Requires-Python >= 3.13.14, so pip on 3.11
never picks it by itself: `pip download --no-deps --ignore-requires-python nemo-gym==0.7.0`
gets it (43 MB) and it goes in with --no-deps --ignore-requires-python. Its code parses and
runs on 3.11 (checked here: seed_session in both bodies, the tool routes, verify,
close_session, reverify_mode and the judge failsafe answer as 0.7.0's own pydantic models
say). Its server modules import, at load time, what 0.4.0's do less gprof2dot, plus scipy
and httptools (uvicorn's httptools protocol is imported by name), and openai is pinned to
the 2.44.0 its metadata requires; ray is needed for its distribution metadata
(global_config reads ray's version at import) and is imported lazily. Measured here: 884 MB
for the base, about 2 minutes to build with the example servers and math_with_judge's extra;
a server starts in about 5 s. Its servers differ from 0.4.0's in places (shared/reference/
ecosystem_clients.md D.3): example_single_tool_call's verify returns 1.0 only for a
get_weather call, math_with_judge wants a complete \\boxed{} answer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
"""The default release (the one ptrain's NeMo Gym tests pin)."""
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
"""What NeMo Gym 0.4.0's server modules import at load time (module docstring)."""
BASE_PACKAGES_0_7 = (
    "fastapi",
    "uvicorn",
    "httptools",
    "pydantic",
    "itsdangerous",
    "openai==2.44.0",
    "orjson",
    "aiohttp",
    "requests",
    "rich",
    "ray",
    "wandb",
    "pandas",
    "scipy",
    "yappi",
    "pydot",
)
"""What NeMo Gym 0.7.0's server modules import at load time (module docstring)."""


@dataclasses.dataclass(frozen=True)
class Release:
    """How one nemo-gym release is fetched and what its servers need beside it."""

    version: str
    packages: tuple[str, ...]
    download_flags: tuple[str, ...]
    """pip download flags that make pip on this Python take the wheel."""


RELEASES = {
    "0.4.0": Release("0.4.0", BASE_PACKAGES, ("--python-version", "3.12")),
    "0.7.0": Release("0.7.0", BASE_PACKAGES_0_7, ("--ignore-requires-python",)),
}
SERVE_TIME_SKIP = {"math_with_judge": ("datasets",)}
"""Requirements a server lists that only its data-preparation scripts import."""
DEFAULT_VENV = Path.home() / ".cache" / "ptrain" / "nemo_gym_venv"
STAMP = "ptrain_nemo_gym_stamp.json"
HOST = "127.0.0.1"


class SetupError(RuntimeError):
    """The venv could not be built (no registry access, a failed install); the message says
    which step failed and the command to retry it."""


def release(version: str) -> Release:
    """The Release of `version`; SetupError naming the ones this tool knows."""
    if version not in RELEASES:
        raise SetupError(f"nemo-gym {version!r} is not one this tool sets up; pass --nemo-gym-version "
                         f"{' or '.join(RELEASES)}")  # fmt: skip
    return RELEASES[version]


def venv_dir(path: str | os.PathLike | None = None, version: str = NEMO_GYM_VERSION) -> Path:
    """The venv to use: `path`; else $PTRAIN_NEMO_GYM_VENV or ~/.cache/ptrain/nemo_gym_venv for
    the default release, with "-<version>" appended for another one."""
    if path:
        return Path(path).expanduser().resolve()
    base = Path(os.environ.get("PTRAIN_NEMO_GYM_VENV") or DEFAULT_VENV).expanduser().resolve()
    return base if version == NEMO_GYM_VERSION else base.with_name(f"{base.name}-{version}")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_command(servers: list[str], venv: Path | None = None, version: str = NEMO_GYM_VERSION) -> str:
    """The shell command that builds the venv for `servers` (for error and skip messages)."""
    here = Path(__file__).resolve()
    release_flag = f" --nemo-gym-version {version}" if version != NEMO_GYM_VERSION else ""
    extra = f" --venv {venv}" if venv is not None and venv != venv_dir(version=version) else ""
    return f"python {here}{release_flag} --setup {' '.join(servers)}{extra}"


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


def wheel_path(cache: Path, retry: str, version: str = NEMO_GYM_VERSION) -> Path:
    """The nemo-gym wheel of `version` in `cache`, downloaded (no dependencies) when missing."""
    wheels = cache / "wheels"
    found = sorted(wheels.glob(f"nemo_gym-{version}-*.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    requirement = f"nemo-gym=={version}"
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *release(version).download_flags, "--only-binary=:all:",
         requirement, "-d", str(wheels), "-q"],
        f"downloading {requirement}",
        retry,
    )  # fmt: skip
    found = sorted(wheels.glob(f"nemo_gym-{version}-*.whl"))
    if not found:
        raise SetupError(f"pip download left no nemo_gym-{version} wheel in {wheels}; retry with: {retry}")
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


def ensure_venv(servers: list[str], venv: str | os.PathLike | None = None, version: str = NEMO_GYM_VERSION) -> Path:
    """Build (or reuse) the venv of nemo-gym `version` with what `servers` need; returns its python.

    Idempotent: a stamp file in the venv records the nemo-gym version, the base packages and
    each server's extra packages; only what is missing is installed. A lock file next to the
    venv keeps two builders (two test sessions) from installing into it at once. A venv whose
    stamp names another release is refused, never rebuilt over.
    """
    rel = release(version)
    venv = venv_dir(venv, version)
    retry = setup_command(servers, venv, version)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = _read_stamp(venv)
        held = (stamp.get("base") or {}).get("nemo_gym")
        if held is not None and held != version:
            raise SetupError(
                f"the venv {venv} holds nemo-gym {held}, not {version}; each release needs a venv of its own: "
                f"drop --venv (nemo-gym {version}'s default is {venv_dir(version=version)}) or pass another path"
            )
        # 0.4.0's key is the one its venvs were stamped with before 0.7.0 came (so none is rebuilt).
        base_key = {"nemo_gym": version, "packages": list(FIRST_PACKAGES + rel.packages)}
        python = venv_python(venv)
        if stamp.get("base") != base_key or not python.exists():
            if not python.exists():
                _run([sys.executable, "-m", "venv", str(venv)], f"creating the venv {venv}", retry)
            pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            wheel = wheel_path(venv.parent, retry, version)
            _run(pip + list(FIRST_PACKAGES), f"installing {' '.join(FIRST_PACKAGES)} into {venv}", retry)
            _run(pip + list(rel.packages), f"installing NeMo Gym {version}'s server dependencies into {venv}", retry)
            _run(
                pip + ["--no-deps", "--ignore-requires-python", "--only-binary=:all:", str(wheel)],
                f"installing {wheel.name} into {venv}",
                retry,
            )
            stamp = {"base": base_key, "servers": {}}
            _write_stamp(venv, stamp)
        site = _site_packages(venv)
        for name in servers:
            _check_server_name(site, name, version)
            reqs = _server_requirements(site, name)
            if stamp.get("servers", {}).get(name) == reqs:
                continue
            if reqs:
                pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
                _run(pip + reqs, f"installing {name}'s requirements {reqs} into {venv}", retry)
            stamp.setdefault("servers", {})[name] = reqs
            _write_stamp(venv, stamp)
    return python


def server_dir(name: str, venv: str | os.PathLike | None = None, version: str = NEMO_GYM_VERSION) -> Path:
    """The folder of resources server `name` in the venv (app.py, configs/, data/)."""
    return _site_packages(venv_dir(venv, version)) / "resources_servers" / name


def available_servers(site: Path | None = None, wheel: Path | None = None) -> list[str]:
    """Names of the resources servers (folders with an app.py) in the venv or in the wheel."""
    if site is not None:
        return sorted(p.parent.name for p in (site / "resources_servers").glob("*/app.py"))
    with zipfile.ZipFile(wheel) as zf:
        names = {n.split("/")[1] for n in zf.namelist() if re.fullmatch(r"resources_servers/[^/]+/app\.py", n)}
    return sorted(names)


def _check_server_name(site: Path, name: str, version: str = NEMO_GYM_VERSION) -> None:
    if not (site / "resources_servers" / name / "app.py").exists():
        names = available_servers(site)
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        flag = f" --nemo-gym-version {version}" if version != NEMO_GYM_VERSION else ""
        raise SetupError(
            f"no resources server {name!r} in nemo-gym {version}; {hint}"
            f"python {Path(__file__).resolve()}{flag} --list shows all {len(names)}"
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


def agent_verify_inside(url: str, row_path: str, response_path: str) -> None:
    """Seed and verify one row as NeMo Gym's simple agent's /run does, with NeMo Gym's own HTTP
    client; print {"seed_status", "status", "answer"} as one JSON line.

    The bodies are built by the agent's own code of this release: its run request parses the
    row (task fields kept as extras, nulls included) and is dumped whole as the seed body; the
    verify body is that dump plus `response` (0.4.0 passes it through SimpleAgentVerifyRequest
    first, 0.7.0 sends the dict). NeMo Gym's `request` serialises a dict with orjson as it is
    (only pydantic models are dumped with exclude_unset), and the seed answer's cookies go
    with the verify, as the agent forwards them.
    """
    import asyncio
    from importlib.metadata import version as dist_version

    from nemo_gym.server_utils import (
        GlobalAIOHTTPAsyncClientConfig,
        get_response_json,
        request,
        set_global_aiohttp_client,
    )
    from responses_api_agents.simple_agent.app import SimpleAgentRunRequest, SimpleAgentVerifyRequest

    row = json.loads(Path(row_path).read_text())
    response = json.loads(Path(response_path).read_text())
    body = SimpleAgentRunRequest.model_validate(row)
    if dist_version("nemo-gym") == "0.4.0":
        payload = SimpleAgentVerifyRequest.model_validate(body.model_dump() | {"response": response}).model_dump()
    else:
        payload = body.model_dump() | {"response": response}

    async def go() -> dict:
        client = set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
        try:
            seed = await request("POST", f"{url}/seed_session", json=body.model_dump())
            out = {"seed_status": seed.status}
            if seed.ok:
                verify = await request("POST", f"{url}/verify", json=payload, cookies=seed.cookies)
                out["status"] = verify.status
                out["answer"] = await get_response_json(verify) if verify.ok else (await verify.read()).decode()
            return out
        finally:
            await client.close()

    print(json.dumps(asyncio.run(go())), flush=True)


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("name", nargs="?", help="resources server to serve (a folder of resources_servers/)")
    p.add_argument("--port", type=int, default=0, help="loopback port (0: a free one; the URL is printed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the server's config block (VALUE parsed as JSON)")  # fmt: skip
    p.add_argument("--venv", default=None, help=f"NeMo Gym venv (default $PTRAIN_NEMO_GYM_VENV or {DEFAULT_VENV}, "
                   "with -VERSION appended for a release other than the default)")  # fmt: skip
    p.add_argument("--nemo-gym-version", default=NEMO_GYM_VERSION, metavar="VERSION",
                   help=f"the nemo-gym release: {' or '.join(RELEASES)} (default {NEMO_GYM_VERSION})")  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the resources servers in the wheel")
    p.add_argument("--setup", nargs="+", metavar="NAME", help="build or reuse the venv for these servers, then exit")
    p.add_argument("--where", metavar="NAME", help="build or reuse the venv for NAME, print the server's folder")
    p.add_argument("--agent-verify", nargs=3, metavar=("URL", "ROW.json", "RESPONSE.json"),
                   help="seed and verify ROW with RESPONSE at URL as NeMo Gym's simple agent does, with its own "
                   "client; prints the answer")  # fmt: skip
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    version = args.nemo_gym_version

    if args.inside:
        if args.agent_verify:
            agent_verify_inside(*args.agent_verify)
        else:
            serve_inside(args.name, args.port, args.overrides)
        return 0
    try:
        release(version)
        if args.list:
            venv = venv_dir(args.venv, version)
            if (venv / STAMP).exists():
                names = available_servers(site=_site_packages(venv))
            else:
                names = available_servers(
                    wheel=wheel_path(venv.parent, setup_command(["NAME"], venv, version), version)
                )
            print("\n".join(names))
            return 0
        if args.setup:
            python = ensure_venv(args.setup, args.venv, version)
            print(python)
            return 0
        if args.where:
            python = ensure_venv([args.where], args.venv, version)
            print(server_dir(args.where, args.venv, version))
            return 0
        if args.agent_verify:
            url, *files = args.agent_verify
            for path in files:
                if not os.path.isfile(path):
                    p.error(
                        f"--agent-verify: no file {path!r} (pass a JSON file with the row, then one with the response)"
                    )
            python = ensure_venv([], args.venv, version)
            cmd = [str(python), str(Path(__file__).resolve()), "--inside", "--agent-verify", url,
                   *(str(Path(f).resolve()) for f in files)]  # fmt: skip
            return subprocess.run(cmd).returncode
        if not args.name:
            p.error("name a resources server (--list shows them), or pass --list / --setup")
        python = ensure_venv([args.name], args.venv, version)
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
