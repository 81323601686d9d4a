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
from typing import Any

import jax
import orbax.checkpoint as ocp

from ptrain.config.outputs import CheckpointConfig

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
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))
        # Steps that `restore_latest` could not read. They stay on disk, untouched, until
        # the resumed run saves the same step again (`save` then renames the old one).
        self.unreadable: set[int] = set()

    def should_save(self, step: int, last_step: int) -> bool:
        every = self.cfg.every_steps
        return step == last_step or (every > 0 and step % every == 0)

    def save(self, step: int, state, data_state: Any, meta: dict) -> None:
        """Start a (possibly asynchronous) save; the previous save is finished first."""
        if step in self.unreadable:
            self._set_aside(step)
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def _set_aside(self, step: int) -> None:
        """Rename the unreadable checkpoint of `step` to `<step>.unreadable[.N]`, out of
        Orbax's listing, so the resumed run can save that step again; nothing is deleted.
        Done only when the run gets there, so a checkpoint that failed for another reason
        (a changed model config, say) is left as it was if the run stops earlier."""
        self.manager.wait_until_finished()
        from ptrain.parallel.multihost import barrier, is_primary

        if is_primary():  # one renamer; the others wait, then list the folder again
            self._rename_unreadable(step)
        barrier(f"ptrain:set_aside:{step}")
        self.manager.reload()
        self.unreadable.discard(step)

    def _rename_unreadable(self, step: int) -> None:
        src = os.path.join(self.directory, str(step))
        if not os.path.isdir(src):
            raise CheckpointError(
                f"checkpoint {src} could not be read earlier and is now missing or renamed; "
                "check the folder, or delete it to restart the stage"
            )
        dst, n = src + ".unreadable", 1
        while os.path.exists(dst):
            dst, n = f"{src}.unreadable.{n}", n + 1
        os.rename(src, dst)
        log.warning("saving step %d again: the unreadable checkpoint of that step is kept as %s", step, dst)

    def restore_latest(self, abstract_state) -> tuple[int, Any, Any, dict] | None:
        """Restore the newest checkpoint that reads back whole; None when there is none.

        A checkpoint that fails to read (truncated file, bad metadata, missing item) is
        reported and skipped in favour of the one before it; half-written saves are never
        listed, since Orbax only finalises a step once all of it is on disk.
        """
        steps = self.steps()
        first_error = ""
        for step in reversed(steps):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        data=ocp.args.JsonRestore(),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as e:  # Orbax raises many kinds here; any of them means unusable
                log.error(
                    "checkpoint %s/%d is unreadable (%s: %s); falling back to the previous one",
                    self.directory,
                    step,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
                self.unreadable.add(step)
                first_error = first_error or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                continue
            return step, restored["state"], restored["data"], restored["meta"]
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self.directory} could be read (newest: {first_error[:300]}). "
                "If the model, optimizer or mesh settings changed since they were written, re-launch with the "
                "settings they were saved with (each checkpoint's meta/ holds its resolved config) or use a new "
                "run_dir; if the files are damaged, restore a backup or delete the folder to restart the stage "
                "from its initial weights"
            )
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with shardings, when given) for restoring onto devices."""
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
        )
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


# ---- stage completion markers ----


def done_path(stage_dir: str) -> str:
    return os.path.join(stage_dir, "DONE.json")


def is_done(stage_dir: str, exports: bool = True) -> bool:
    """DONE.json is there, and so is the export of a stage that writes one."""
    return os.path.isfile(done_path(stage_dir)) and (not exports or os.path.isdir(os.path.join(stage_dir, "export")))


def write_json_atomic(path: str, obj) -> None:
    """Write JSON so that a reader (or a crash) sees the old file or the whole new one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=float)
        f.flush()
        os.fsync(f.fileno())  # a crash right after the rename must not leave an empty file
    os.replace(tmp, path)


def mark_done(stage_dir: str, summary: dict) -> None:
    """Atomically write DONE.json (after the export is complete)."""
    write_json_atomic(done_path(stage_dir), summary)


def read_done(stage_dir: str) -> dict:
    """The finished stage's summary; CheckpointError (with the fix) when the marker is damaged."""
    path = done_path(stage_dir)
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} marks the stage finished but cannot be read ({type(e).__name__}: {e}); delete it "
            "and re-launch: the stage resumes from its last checkpoint and exports again"
        ) from e
    if not isinstance(summary, dict):
        raise CheckpointError(
            f"{path} holds {type(summary).__name__}, not the stage summary; delete it and "
            "re-launch: the stage resumes from its last checkpoint and exports again"
        )
    return summary
