"""The code sandbox: runs untrusted commands (model-written code, its tests, tool calls)
isolated from the host, with resource limits and a wall timeout.

  isolation  `Sandbox`, its result and the backends (bwrap, unshare, none)
  __main__   `python -m ptrain.sandbox [options] -- CMD ARGS...`, one command from the shell

Its config, `SandboxConfig`, lives in `ptrain.config.sandbox`. Jax-free: the environments'
worker processes and the CLI import it cheaply. It imports nothing of ptrain but config.
"""

from ptrain.config.sandbox import SandboxConfig
from ptrain.sandbox.isolation import SCRATCH_DIR, Sandbox, SandboxResult, SandboxUnavailableError

__all__ = ["SCRATCH_DIR", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailableError"]
