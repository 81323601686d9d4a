"""`python -m ptrain.serve`: serve a Hugging Face model folder with SGLang's HTTP API.

    python -m ptrain.serve --model-path DIR [--port 30000] [--tp-size 1] ...

Flags carry `python -m sglang.launch_server`'s names where SGLang has them (--model-path,
--tokenizer-path, --host, --port, --context-length, --max-running-requests,
--served-model-name, --tp-size, --dtype, --weight-version, --random-seed, --chat-template,
--tool-call-parser, --skip-tokenizer-init, --skip-server-warmup, --log-level,
--log-requests), so a user swaps one command for the other. `--tp-size N` shards the model
over N local devices on the mesh's tensor axis. The server stops on SIGTERM or Ctrl-C after
the requests in flight finish (at most --graceful-shutdown-timeout seconds).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ptrain.serve.server import DEFAULT_MAX_REQUEST_BYTES, read_json_file

DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    check_address(p, args.host, args.port)
    if args.dtype == "auto":
        args.dtype = "float32"


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
