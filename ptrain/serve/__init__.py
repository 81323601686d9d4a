"""`python -m ptrain.serve`: an HTTP server around a rollout engine, speaking SGLang's API.

  cli.py         the command line (SGLang's `launch_server` flag names), `main`
  server.py      the Starlette app: SGLang's native routes (/generate, weight updates, LoRA
                 adapter loads, /model_info, /health_generate, ...), streaming, stop
                 strings, shutdown
  openai_api.py  the OpenAI-compatible routes (/v1/completions, /v1/chat/completions,
                 /v1/models), tool-call parsing

Serving sits above the engines (ptrain.rollout): the fleet client and the stages never import
it; they reach a server over HTTP.
"""

from ptrain.serve.cli import build_parser, main

__all__ = ["build_parser", "main"]
