"""Orbax checkpoints of a stage, resume with fallback past corrupt ones, and stage export.

Layout of one stage folder (<run_dir>/stages/<name>/):
  checkpoints/<step>/{state,data,meta}   Orbax steps: TrainState, data-iterator state, metadata
  export/                                Hugging Face folder of the final weights (next stage's input,
                                         loadable by transformers and SGLang)
  DONE.json                              written last; its presence marks the stage finished
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from ptrain.config.train import CheckpointConfig

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required; the message says what was tried."""


class StageCheckpointer:
    """Saves and restores one stage's TrainState + data-iterator state + metadata."""

    def __init__(self, directory: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(directory)
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "meta"))

    def should_save(self, step: int, last_step: int) -> bool:
        every = self.cfg.every_steps
        return step == last_step or (every > 0 and step % every == 0)

    def save(self, step: int, state, data_state: Any, meta: dict) -> None:
        """Start a (possibly asynchronous) save; the previous save is finished first."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        ), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state) -> Optional[tuple[int, Any, Any, dict]]:
        """Restore the newest checkpoint that reads back whole; None when there is none.

        A checkpoint that fails to read (truncated file, bad metadata, missing item) is
        reported and skipped in favour of the one before it; half-written saves are never
        listed, since Orbax only finalises a step once all of it is on disk.
        """
        steps = self.steps()
        for step in reversed(steps):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ))
            except Exception as e:  # Orbax raises many kinds here; any of them means unusable
                log.error("checkpoint %s/%d is unreadable (%s: %s); falling back to the previous one",
                          self.directory, step, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                continue
            return step, restored["state"], restored["data"], restored["meta"]
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self.directory} could be read; delete the folder to "
                "restart the stage from its initial weights, or restore a backup")
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with shardings, when given) for restoring onto devices."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ---- stage completion markers ----

def done_path(stage_dir: str) -> str:
    return os.path.join(stage_dir, "DONE.json")


def is_done(stage_dir: str) -> bool:
    return os.path.isfile(done_path(stage_dir)) and os.path.isdir(os.path.join(stage_dir, "export"))


def mark_done(stage_dir: str, summary: dict) -> None:
    """Atomically write DONE.json (after the export is complete)."""
    tmp = done_path(stage_dir) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2, default=float)
    os.replace(tmp, done_path(stage_dir))


def read_done(stage_dir: str) -> dict:
    with open(done_path(stage_dir)) as f:
        return json.load(f)
