"""The audit log: one JSON line per episode, for people to read and tools to replay.

    with AuditLog(stage_dir + "/audit.jsonl") as audit:
        audit.write(trajectory, step=12)           # Trajectory.audit_record() + step + time
    for record in read_audit(stage_dir + "/audit.jsonl"):
        ...                                         # dicts, in the order written

A record holds the environment and task id, the sample index, reward and components, the
finish reason, reward and environment errors, metrics, weight versions, token counts
(uncached prompt, cached prompt, output) and every turn (the policy's text; tool calls
with arguments, output, exit code and duration). One file per stage; lines are appended
and flushed one at a time, so a crash loses at most the line being written, and
`read_audit` skips such a torn last line with a warning. `ptrain.rollout.replay.rescore`
scores records again with an environment's current scorer.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return repr(value)


def _drop_torn_tail(path: str) -> None:
    """Cut a last line that a crash left without its newline. A resumed stage appends to the
    same file: its first record would join that fragment, and both would be one unreadable
    line in the middle of the log."""
    try:
        f = open(path, "rb+")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        cut, pos = 0, size
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            k = f.read(step).rfind(b"\n")
            if k >= 0:
                cut = pos + k + 1
                break
        f.truncate(cut)
    log.warning("%s: dropped a torn last line (%d bytes) that the previous writer left unfinished", path, size - cut)


class AuditLog:
    """Appends audit records to a JSONL file (thread-safe; each line flushed)."""

    def __init__(self, path: str):
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        _drop_torn_tail(path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the stage
        self._lock = threading.Lock()
        self.count = 0
        """Records written through this object."""

    def write(self, episode: Any, **extra: Any) -> dict[str, Any]:
        """Append one record: a Trajectory (its audit_record()) or a ready dict, plus `extra`
        fields (step, stage, ...) and the wall-clock `time`. Returns the record."""
        record = dict(episode.audit_record() if hasattr(episode, "audit_record") else episode)
        record.update(extra)
        record.setdefault("time", time.time())
        line = json.dumps(record, ensure_ascii=False, default=_jsonable) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"audit log {self.path} is closed")
            self._file.write(line)
            self._file.flush()
            self.count += 1
        return record

    def write_all(self, episodes: Iterable[Any], **extra: Any) -> None:
        """`write` each episode with the same extra fields."""
        for episode in episodes:
            self.write(episode, **extra)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_audit(path: str) -> Iterator[dict[str, Any]]:
    """The records of an audit log, in order. A last line cut by a crash is skipped with a
    warning; an unreadable line before it is a ValueError naming the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no audit log at '{path}'; a stage writes <stage_dir>/audit.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not line.endswith("\n"):
                log.warning("%s:%d: skipping a torn last line (the writer stopped mid-line)", path, i)
                return
            raise ValueError(f"{path}:{i}: not a JSON record ({e}); the audit log is damaged at this line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{i}: a JSON {type(record).__name__}, not a record")
        yield record
