"""`python -m ptrain.serve`: an HTTP server around a rollout engine, speaking SGLang's API.

  cli.py         the command line (SGLang's `launch_server` flag names), `main`
  server.py      the Starlette app: SGLang's native routes (/generate, weight updates, LoRA
                 adapter loads, /model_info, /health_generate, ...), streaming, stop
                 strings, shutdown
  openai_api.py  the OpenAI-compatible routes (/v1/completions, /v1/chat/completions,
                 /v1/models), tool-call parsing
  tokenizer_api.py  /tokenize, /detokenize, /tokenizer_info (remote tokenizers: lm-eval's)
  in_process.py  `serving(app)`: an app on a loopback port in a thread of this process
  lm_harness.py  lm-evaluation-harness tasks against an in-process server (the eval stage's
                 algo.eval.lm_eval)

Serving sits above the engines (ptrain.rollout): the fleet client never imports it, and the
stages reach a server over HTTP, except the eval stage, which serves its own engine in process
for lm-eval through lm_harness.py (a server process of its own would hold a second copy of the
weights).
"""

from ptrain.serve.cli import build_parser, main

__all__ = ["build_parser", "main"]
