"""`python -m ptrain.serve`: serve a Hugging Face model folder with SGLang's HTTP API.

    python -m ptrain.serve --model-path DIR [--port 30000] [--tp-size 1] ...

Flags carry `python -m sglang.launch_server`'s names where SGLang has them (--model-path,
--tokenizer-path, --host, --port, --context-length, --max-running-requests,
--served-model-name, --tp-size, --dtype, --weight-version, --random-seed, --chat-template,
--tool-call-parser, --skip-tokenizer-init, --skip-server-warmup, --log-level,
--log-requests, and LoRA's --enable-lora, --lora-paths, --max-loras-per-batch,
--max-lora-rank, --lora-target-modules), so a user swaps one command for the other.
`--tp-size N` shards the model over N local devices on the mesh's tensor axis. The server
stops on SIGTERM or Ctrl-C after the requests in flight finish (at most
--graceful-shutdown-timeout seconds).

LoRA, as SGLang resolves its flags: `--lora-paths` turns LoRA on and its adapters load at
start (entries `PATH`, `NAME=PATH` or SGLang's JSON `{"lora_name", "lora_path", "pinned"}`; a
bare PATH is also the adapter's name, as SGLang names it); `--max-lora-rank` and
`--lora-target-modules` default to the largest rank and the union of the targets of those
adapters, and without `--lora-paths` both are required (adapters loaded later through
/load_lora_adapter must fit them). `--max-loras-per-batch` is the number of adapters loaded
at once: the engine keeps one slot for each beside the base weights, and every running
request may use any of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid

from ptrain.serve.server import DEFAULT_MAX_REQUEST_BYTES, read_json_file

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MAX_LORAS = 8
"""SGLang's --max-loras-per-batch default."""
LORA_TARGET_ALL = ("all", "all-linear")
"""--lora-target-modules for every layer the engine serves per request: SGLang's and PEFT's word."""
LORA_TARGET_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""SGLang's fused module names, for the per-layer ones they stand for."""


def build_parser() -> argparse.ArgumentParser:
    """The command line, with SGLang's flag names and defaults where SGLang has them."""
    p = argparse.ArgumentParser(
        prog="python -m ptrain.serve",
        description="Serve a Hugging Face model folder with SGLang's HTTP API (native and OpenAI-compatible).",
    )
    p.add_argument("--model-path", required=True, help="Hugging Face folder: config.json + *.safetensors (+ tokenizer)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer folder (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-running-requests", type=int, default=None, help="samples decoded at once (engine slots; default 16)"
    )
    p.add_argument("--served-model-name", default=None, help="the model name /v1/models reports (default: the path)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel degree: devices on the mesh's tensor axis")
    p.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="compute dtype (auto: float32, the trainer's log-probs)"
    )
    p.add_argument("--weight-version", default="default", help="version name of the weights loaded at start")
    p.add_argument(
        "--random-seed", type=int, default=0, help="seeds the sampling of requests without sampling_seed (default 0)"
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat-template file (default: the tokenizer's)")
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=("auto", "qwen25", "hermes", "none"),
        help="tool-call format of /v1/chat/completions (auto: <tool_call> blocks when the template writes them)",
    )
    p.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: token-id prompts only, no text")
    p.add_argument("--skip-server-warmup", action="store_true", help="answer /health at once, before a warm-up request")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body in bytes; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=int,
        default=30,
        help="seconds requests in flight may take to finish after SIGTERM (default 30)",
    )
    lora = p.add_argument_group("LoRA adapters (SGLang's flags)")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters (on by itself with --lora-paths); requests name one in lora_path or model",
    )
    lora.add_argument(
        "--lora-paths",
        nargs="*",
        default=None,
        help='adapters (PEFT folders) to load at start: PATH | NAME=PATH | {"lora_name":..,"lora_path":..,"pinned":..}',
    )
    lora.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=None,
        help=f"adapters loaded at once, each usable by any running request (default {DEFAULT_MAX_LORAS})",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=None, help="largest adapter rank (default: the largest of --lora-paths)"
    )
    lora.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="layers adapters may adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, qkv_proj, "
        "gate_up_proj, or all / all-linear (default: the union of the --lora-paths adapters' targets)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-requests", action="store_true", help="log every HTTP request (uvicorn's access log)")
    return p


def check_address(p: argparse.ArgumentParser, host: str, port: int) -> None:
    """A host that does not resolve or a port in use ends here, not after the model has loaded."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        p.error(f"--host {host}: not an address of this machine ({e})")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            s.bind(address)
        except OSError as e:
            p.error(
                f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); pass another --port or stop what uses it"
            )


def check_template(p: argparse.ArgumentParser, path: str) -> None:
    """A template that does not parse would fail every chat request as if the messages were
    at fault. Parsed with the statements transformers renders with: loop controls and
    {% generation %} blocks."""
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    try:
        with open(path, encoding="utf-8") as f:
            jinja2.Environment(extensions=[Generation, jinja2.ext.loopcontrols]).parse(f.read())
    except jinja2.TemplateSyntaxError as e:
        p.error(f"--chat-template {path}: not a valid Jinja template (line {e.lineno}: {e.message})")
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"--chat-template {path}: cannot be read ({e})")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Mistakes in the command line end with one message (exit 2) before any model loads."""
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        p.error(f"--model-path {args.model_path}: no config.json there; pass a Hugging Face model folder")
    try:
        hf_config = read_json_file(os.path.join(args.model_path, "config.json"))
    except ValueError as e:
        p.error(f"--model-path {args.model_path}: {e}")
    limit = hf_config.get("max_position_embeddings")
    if args.context_length is not None and isinstance(limit, int) and args.context_length > limit:
        p.error(f"--context-length {args.context_length}: above the model's max_position_embeddings={limit}")
    if args.tokenizer_path and not os.path.isdir(args.tokenizer_path):
        p.error(f"--tokenizer-path {args.tokenizer_path}: not a folder")
    if args.chat_template and not os.path.isfile(args.chat_template):
        p.error(f"--chat-template {args.chat_template}: no such file")
    if args.chat_template:
        check_template(p, args.chat_template)
    for flag, value, low in (
        ("--port", args.port, 0),
        ("--tp-size", args.tp_size, 1),
        ("--context-length", args.context_length, 2),
        ("--max-running-requests", args.max_running_requests, 1),
        ("--max-request-bytes", args.max_request_bytes, 1024),
        ("--graceful-shutdown-timeout", args.graceful_shutdown_timeout, 0),
        ("--random-seed", args.random_seed, 0),
    ):
        if value is not None and value < low:
            p.error(f"{flag}: must be >= {low}, got {value}")
    if args.port > 65535:  # the socket layer would bind port % 65536 without a word
        p.error(f"--port: must be <= 65535, got {args.port}")
    check_lora(p, args)
    check_address(p, args.host, args.port)
    if args.dtype == "auto":
        args.dtype = "float32"


def lora_refs(p: argparse.ArgumentParser, entries: list[str]) -> list[dict]:
    """--lora-paths entries as SGLang's LoRARef records {lora_id, lora_name, lora_path, pinned}."""
    refs = []
    for entry in entries:
        entry = entry.strip()
        if entry.startswith("{") and entry.endswith("}"):
            try:
                obj = json.loads(entry)
            except ValueError as e:
                p.error(f"--lora-paths {entry}: not valid JSON ({e})")
            if not isinstance(obj.get("lora_name"), str) or not isinstance(obj.get("lora_path"), str):
                p.error(f'--lora-paths {entry}: a JSON entry needs "lora_name" and "lora_path" strings')
            extra = sorted(set(obj) - {"lora_name", "lora_path", "pinned"})
            if extra:
                p.error(f"--lora-paths {entry}: unknown key(s) {extra}; valid keys are lora_name, lora_path, pinned")
            name, path, pinned = obj["lora_name"], obj["lora_path"], obj.get("pinned", False)
            if not isinstance(pinned, bool):
                p.error(f"--lora-paths {entry}: pinned must be true or false")
        elif "=" in entry:
            name, path = entry.split("=", 1)
            pinned = False
        else:
            name, path, pinned = entry, entry, False  # SGLang names a bare path by the path itself
        if not name or not path:
            p.error(f"--lora-paths {entry!r}: pass PATH, NAME=PATH or a JSON entry, with a non-empty name and path")
        # SGLang's deterministic id (LoRARef.deterministic_id), as its /server_info shows it
        lora_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex
        refs.append({"lora_id": lora_id, "lora_name": name, "lora_path": path, "pinned": pinned})
    names = [r["lora_name"] for r in refs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--lora-paths: the adapter name(s) {twice} are given more than once; name each adapter once")
    return refs


def lora_targets(p: argparse.ArgumentParser, names: list[str]) -> tuple[str, ...]:
    """--lora-target-modules as the engine's per-layer targets; the ones it cannot serve end here."""
    from ptrain.models.lora import SERVABLE

    if not names:
        p.error("--lora-target-modules: give at least one module, e.g. all")
    if "all" in names and len(names) > 1:  # SGLang's rule
        p.error("--lora-target-modules: 'all' must be the only module given")
    out: set[str] = set()
    for name in names:
        short = name.rsplit(".", 1)[-1]  # PEFT also names modules by a dotted suffix
        if short in LORA_TARGET_ALL:
            out.update(SERVABLE)
        elif short in LORA_TARGET_FUSED:
            out.update(LORA_TARGET_FUSED[short])
        elif short in SERVABLE:
            out.add(short)
        else:
            p.error(
                f"--lora-target-modules {name}: this server applies adapters per request to the attention and MLP "
                f"projections only ({', '.join(SERVABLE)}, or all / all-linear / qkv_proj / gate_up_proj); the "
                "output head, the embeddings and routed experts need the adapter merged into the model "
                "(serve the merged export instead)"
            )
    return tuple(t for t in SERVABLE if t in out)


def check_lora(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve the LoRA flags as SGLang does (--lora-paths turns LoRA on; the rank and the
    targets default to what those adapters need) and read the adapters' configs, so a bad
    combination or folder ends here. Sets args.lora_refs, args.lora_targets, args.max_loras."""
    from ptrain.models.peft_io import read_peft_spec

    refs = lora_refs(p, args.lora_paths or [])
    if refs and args.enable_lora is None:
        args.enable_lora = True
    args.enable_lora = bool(args.enable_lora)
    args.lora_refs = refs
    if not args.enable_lora:
        for flag, value in (
            ("--max-loras-per-batch", args.max_loras_per_batch),
            ("--max-lora-rank", args.max_lora_rank),
            ("--lora-target-modules", args.lora_target_modules),
        ):
            if value is not None:
                p.error(f"{flag}: LoRA serving is off; add --enable-lora (or --lora-paths) or drop {flag}")
        args.max_loras, args.lora_targets = 0, ()
        return
    args.max_loras = DEFAULT_MAX_LORAS if args.max_loras_per_batch is None else args.max_loras_per_batch
    if args.max_loras < 1:
        p.error(f"--max-loras-per-batch: must be >= 1, got {args.max_loras}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        p.error(f"--max-lora-rank: must be >= 1, got {args.max_lora_rank}")
    if not refs and (args.max_lora_rank is None or args.lora_target_modules is None):
        p.error(
            "--enable-lora without --lora-paths needs both --max-lora-rank and --lora-target-modules (as SGLang "
            "does): the adapter slots are sized before any adapter arrives; e.g. --max-lora-rank 16 "
            "--lora-target-modules all"
        )
    if len(refs) > args.max_loras:
        p.error(
            f"--lora-paths: {len(refs)} adapters, but --max-loras-per-batch is {args.max_loras}; raise "
            "--max-loras-per-batch or load fewer"
        )
    specs = {}
    for ref in refs:
        try:
            specs[ref["lora_name"]] = read_peft_spec(ref["lora_path"])
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--lora-paths {ref['lora_name']}: {e}")  # e names the folder
    targets = None if args.lora_target_modules is None else lora_targets(p, args.lora_target_modules)
    if targets is None:
        from ptrain.models.lora import SERVABLE

        wanted = {t for spec in specs.values() for t in spec.targets}
        unservable = sorted(wanted - set(SERVABLE))
        if unservable:
            p.error(
                f"--lora-paths: the adapters adapt {unservable}, which this server cannot apply per request "
                f"(it serves {', '.join(SERVABLE)}); serve the merged export instead"
            )
        targets = tuple(t for t in SERVABLE if t in wanted)
        if not targets:
            p.error("--lora-paths: the adapters' configs name no target modules; pass --lora-target-modules")
    args.lora_targets = targets
    if args.max_lora_rank is None:
        args.max_lora_rank = max(spec.rank for spec in specs.values())
    for name, spec in specs.items():
        extra = sorted(set(spec.targets) - set(targets))
        if extra:
            p.error(f"--lora-paths {name}: the adapter adapts {extra}, not in --lora-target-modules {list(targets)}")
        if spec.rank > args.max_lora_rank:
            p.error(
                f"--lora-paths {name}: the adapter has rank {spec.rank}, above --max-lora-rank {args.max_lora_rank}"
            )


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve until stopped; returns the exit code."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for name in ("absl", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from ptrain.serve.server import serve

    try:
        return serve(args)
    except (FileNotFoundError, ValueError) as e:  # a model or tokenizer folder that does not load
        print(f"ptrain.serve: error: {e}", file=sys.stderr, flush=True)
        return 1
