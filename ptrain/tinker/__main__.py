"""`python -m ptrain.tinker`: serve a Hugging Face model folder with Tinker's REST API.

    python -m ptrain.tinker --model-path DIR [--host 127.0.0.1] [--port 8000]
        [--base-model NAME] [--root-dir ./tinker_runs] [--api-key KEY | --no-auth]
        [--max-loras 8] [--max-lora-rank 64] [--context-length N]

The API key clients must send (X-API-Key) is --api-key, else $TINKER_API_KEY, else a fresh
`tml-...` key printed at start; the SDK refuses keys without the `tml-` prefix. The server
listens on the loopback address unless --host says otherwise, and prints one line with its
base_url once it accepts requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys

log = logging.getLogger("ptrain.tinker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ptrain.tinker",
        description="Serve a Hugging Face model folder with Tinker's REST API (for the tinker SDK and tinker-cookbook).",
    )
    p.add_argument("--model-path", required=True, help="Hugging Face folder: config.json + *.safetensors + tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--base-model",
        default=None,
        help="the model name clients ask for (default: the folder's absolute path, which the cookbook's "
        "get_tokenizer loads without the hub)",
    )
    p.add_argument("--root-dir", default="./tinker_runs", help="where checkpoints go (default ./tinker_runs)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="the key clients send (default: $TINKER_API_KEY, else generated)")
    key.add_argument("--no-auth", action="store_true", help="accept requests without a key")
    p.add_argument("--max-loras", type=int, default=8, help="sampler snapshots the engine holds at once (default 8)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="largest LoRA rank a client may ask for (default 64)")
    p.add_argument("--context-length", type=int, default=None, help="longest sequence in tokens (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="seeds adapter initialization and sampling (default 0)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Mistakes in the command line end with one message (exit 2) before the model loads."""
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        p.error(f"--model-path {args.model_path}: no config.json there; pass a Hugging Face model folder")
    for flag, value, low in (
        ("--port", args.port, 0),
        ("--max-loras", args.max_loras, 1),
        ("--max-lora-rank", args.max_lora_rank, 1),
        ("--context-length", args.context_length, 2),
    ):
        if value is not None and value < low:
            p.error(f"{flag}: must be >= {low}, got {value}")
    if args.port > 65535:
        p.error(f"--port: must be <= 65535, got {args.port}")
    if args.api_key is not None and not args.api_key.startswith("tml-"):
        p.error("--api-key: must start with 'tml-' (the tinker SDK sends no other kind of key)")
    if os.path.exists(args.root_dir) and not os.path.isdir(args.root_dir):
        p.error(f"--root-dir {args.root_dir}: exists and is not a folder")
    from ptrain.serve.cli import check_address

    check_address(p, args.host, args.port)


def resolve_api_key(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(the key, whether it was generated here): --no-auth gives None."""
    if args.no_auth:
        return None, False
    if args.api_key:
        return args.api_key, False
    env = os.environ.get("TINKER_API_KEY")
    if env:
        return env, False
    return "tml-" + secrets.token_urlsafe(24), True


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    env_key = os.environ.get("TINKER_API_KEY")
    if not args.no_auth and not args.api_key and env_key and not env_key.startswith("tml-"):
        p.error("$TINKER_API_KEY: must start with 'tml-' (the tinker SDK sends no other kind of key)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from ptrain.tinker import wire

        wire.pb()  # the SDK's schema, checked before the model loads
    except ImportError as e:
        print(f"python -m ptrain.tinker: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from ptrain.tinker.server import make_app
    from ptrain.tinker.service import TinkerService

    api_key, generated = resolve_api_key(args)
    if api_key is None:
        log.warning(
            "--no-auth: any client that reaches %s:%d may train and sample on this server", args.host, args.port
        )
    base_model = args.base_model or os.path.abspath(args.model_path)
    log.info("loading %s as %r", args.model_path, base_model)
    service = TinkerService(
        args.model_path,
        base_model=base_model,
        root_dir=args.root_dir,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        context_length=args.context_length,
        seed=args.seed,
    )
    app = make_app(service, api_key=api_key)
    host = f"[{args.host}]" if ":" in args.host else args.host
    base_url = f"http://{host}:{args.port}"

    class AnnouncingServer(uvicorn.Server):
        """uvicorn's server, printing the base_url once the socket accepts requests."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                key_note = f" api_key={api_key}" if generated else ""
                print(f"ptrain.tinker: serving {base_model!r} at base_url={base_url}{key_note}", flush=True)

    server = AnnouncingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
