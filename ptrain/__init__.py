"""ptrain: post-training for language models in JAX.

Shape legend used in names throughout (`logits_BxLxV`, `mask_BxL`, ...):
  B  batch (sequences, or prompts for RL)      L  sequence length (tokens)
  V  vocabulary                                D  model width (d_model)
  H  query heads      K  key/value heads       Dh head dimension
  F  MLP hidden       E  routed experts        k  experts per token (top-k)
  G  group (samples per prompt in RL; expert groups in grouped matmul)
  M  rows of a grouped matmul (tokens * top_k) N  output columns

Batch contract of the train steps (all `[B, L]`, numpy or jax arrays):
  input_ids    int32  tokens fed to the model
  target_ids   int32  token to predict at each position (input_ids shifted left by one)
  loss_mask    float32 1.0 where the target counts toward the loss (assistant tokens)
  segment_ids  int32  packed-sequence id, 1.. per document; 0 marks padding
  positions    int32  position within its own segment (RoPE restarts per segment)
"""

import os as _os

__version__ = "0.1.0"

# The Python API (ptrain/api.py, ptrain/client.py), imported on first use so that
# `python -m ptrain` can set process-wide options before JAX or Hydra load.
_API = {
    "ConfigError": "ptrain.config.run",
    "RunConfig": "ptrain.config.run",
    "compose": "ptrain.api",
    "run": "ptrain.api",
    "sft": "ptrain.api",
    "dpo": "ptrain.api",
    "grpo": "ptrain.api",
    "evaluate": "ptrain.api",
    "RunResult": "ptrain.pipeline",
    "StageResult": "ptrain.pipeline",
    "TrainingClient": "ptrain.client",
    "Datum": "ptrain.client",
    "AdamParams": "ptrain.client",
}
__all__ = sorted([*_API, "continuous"])


def __getattr__(name: str):
    if name == "continuous":  # a callable module: ptrain.continuous(...) runs the loop
        import importlib

        return importlib.import_module("ptrain.continuous")
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'ptrain' has no attribute {name!r}")


def _source_tree_path() -> None:
    """Let `ptrain.kernels` and `ptrain.conf` import from a source checkout.

    A wheel holds them as ptrain/kernels/ and ptrain/conf/ (pyproject maps the top-level
    kernels/ and conf/ there). Running `python -m ptrain` from the root of a clone imports
    the clone's ptrain/ instead of the installed one, and that folder lacks both; adding the
    clone root to this package's search path finds them where they live. An installed
    package, or an editable install's own finder, never reaches this branch's effect.
    """
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if (
        not _os.path.isdir(_os.path.join(here, "kernels"))
        and _os.path.isfile(_os.path.join(root, "kernels", "moe", "__init__.py"))
        and _os.path.isfile(_os.path.join(root, "conf", "config.yaml"))
    ):
        __path__.append(root)  # noqa: F821 (set by the import system for packages)


_source_tree_path()
