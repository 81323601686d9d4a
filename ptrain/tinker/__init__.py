"""`python -m ptrain.tinker`: a local server speaking Thinking Machines' Tinker API.

The `tinker` SDK and tinker-cookbook's trainers (supervised and RL) run against it unchanged:
they create LoRA training clients over one base model, run forward/backward passes with
Tinker's named losses, take Adam steps, save weights for sampling and sample from them,
save and load training state, all on this machine's accelerators.

    python -m ptrain.tinker --model-path DIR [--port 8000] [--base-model NAME]
    # prints base_url (and a generated API key unless TINKER_API_KEY or --api-key gave one)

    export TINKER_API_KEY=tml-...              # the key the server printed or was given
    # then point the cookbook at it: base_url=http://127.0.0.1:8000 in its config
    # (or TINKER_BASE_URL), and base_model = the server's --base-model

  service.py   TinkerService: models, LoRA adapters, optimizer steps, checkpoints, samplers
               (transport-free; raises TinkerError for refusals)
  wire.py      the codec: the SDK's protobuf messages <-> ptrain.client.Datum and results
  server.py    the Starlette app: Tinker's /api/v1 routes, futures and retrieve_future, auth
  __main__.py  the command line

The `tinker` package (pip install tinker) is needed only for its protobuf schema.
"""
