"""Episode checkpoints of multi-turn environments.

    store = EpisodeStore("runs/x/episodes/step_000012")      # a folder the stage gives
    state = store.load(env_name, task_id, sample_index)       # None: a fresh episode
    ...; store.save(state)                                    # after every turn (atomic)

`EpisodeState` is everything an unfinished episode needs to go on where it stopped: the
token ids, loss mask and log-probs so far, the audit turns, the text of the conversation,
the policy's tool calls of its last turn and the results of those already answered, the
counters and token accounting, the workspace (a packed archive) and the kind's own state.
It is written after every policy turn, every tool result and every environment turn, to a
temporary file that is fsync'd and then renamed over the old one, so a crash leaves either
the previous state or the new one, never half of one. A resumed episode continues from it:
recorded tool calls are never run again, and the workspace is unpacked from the archive
(not re-created by replaying the calls). A finished episode's file also holds its score,
so a rollout of the same folder returns it without generating anything.

The folder belongs to one batch of rollouts (one GRPO step, one evaluation): the same task
and sample index in a later batch is another episode, so give each batch its own folder.

The stage's audit log (`ptrain.envs.audit`) gets each finished episode's
`Trajectory.audit_record()`: every turn (the policy's text, each tool call's name,
arguments, output, exit code and duration, the environment's messages), the reward and its
components, and the token accounting; `ptrain.rollout.replay.rescore` replays it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ptrain.envs.base import TokenCounts, Trajectory, Turn

STATE_VERSION = 1


@dataclass
class EpisodeState:
    """One episode as it stands (JSON-serialisable; see the module docstring)."""

    env: str
    task_id: str
    sample_index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    turns: list[dict[str, Any]] = field(default_factory=list)
    """Audit turns (`Turn` fields)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as text (role, content): what scoring reads."""
    pending_calls: list[dict[str, Any]] = field(default_factory=list)
    """The last policy turn's tool calls (name, arguments, error of a malformed one), in order."""
    call_results: list[dict[str, Any]] = field(default_factory=list)
    """Results of the first len(call_results) pending calls (output, exit_code, error, duration_s, invalid)."""
    policy_turns: int = 0
    env_turns: int = 0
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    tool_time_s: float = 0.0
    generation_time_s: float = 0.0
    tokens: dict[str, int] = field(default_factory=lambda: dataclasses.asdict(TokenCounts()))
    weight_versions: list[str] = field(default_factory=list)
    workspace: str | None = None
    """The workspace as a base64 gzip'd tar archive (None: the episode has no files)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The kind's own state (a long-horizon episode's next follow-up, ...)."""
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None
    result: dict[str, Any] | None = None
    """Once scored: reward, reward_components, reward_error, metrics (and masked, failure_kind)."""
    version: int = STATE_VERSION

    def append(self, ids: list[int], *, policy: bool, logprobs: list[float] | None = None) -> tuple[int, int]:
        """Add tokens (policy tokens with their log-probs, or environment tokens); returns their span."""
        start = len(self.token_ids)
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1 if policy else 0] * len(ids))
        if policy:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(
                    f"policy tokens need one log-prob each: {len(ids)} tokens, {logprobs and len(logprobs)}"
                )
            self.logprobs.extend(float(x) for x in logprobs)
        else:
            self.logprobs.extend([0.0] * len(ids))
        return start, len(self.token_ids)

    def add_turn(self, turn: Turn) -> None:
        self.turns.append(dataclasses.asdict(turn))

    def audit_turns(self) -> tuple[Turn, ...]:
        return tuple(Turn(**t) for t in self.turns)

    def add_weight_version(self, version: str) -> None:
        if not self.weight_versions or self.weight_versions[-1] != version:
            self.weight_versions.append(version)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "episode state") -> EpisodeState:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a JSON {type(d).__name__}, not an episode state; delete it to run that "
                             "episode again")  # fmt: skip
        if d.get("version") != STATE_VERSION:
            raise ValueError(
                f"{where}: state version {d.get('version')!r}, this ptrain reads version {STATE_VERSION}; "
                "finish the run with the ptrain that started it, or delete the episode folder to start over"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]  # fmt: skip
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}; delete it to run that episode again")
        return cls(**d)

    def trajectory(self, task) -> Trajectory:
        """The finished episode as a Trajectory (needs `result`)."""
        if not self.done or self.result is None:
            raise ValueError(f"episode {self.task_id}#{self.sample_index} is not finished and scored")
        r = self.result
        return Trajectory(
            task=task,
            sample_index=self.sample_index,
            token_ids=tuple(self.token_ids),
            prompt_length=self.prompt_length,
            loss_mask=tuple(self.loss_mask),
            logprobs=tuple(self.logprobs),
            reward=float(r["reward"]),
            reward_components=dict(r.get("reward_components", {})),
            finish_reason=self.finish_reason or "stop",
            reward_error=r.get("reward_error"),
            error=self.error,
            masked=bool(r.get("masked", False)),
            failure_kind=r.get("failure_kind"),
            metrics=dict(r.get("metrics", {})),
            turns=self.audit_turns(),
            weight_versions=tuple(self.weight_versions),
            tokens=TokenCounts(**self.tokens),
        )


def _safe(name: str) -> str:
    """A file name for an id: its safe characters plus a short hash (so distinct ids never collide)."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80].lstrip(".") or "_"
    return f"{clean}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def atomic_write(path: str, text: str) -> None:
    """Write text to path so that a crash leaves the old file or the new one: a temporary
    file in the same folder, fsync'd, renamed over path, and the folder fsync'd."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class EpisodeStore:
    """Episode states in a folder, one JSON file per (environment, task, sample)."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def path(self, env: str, task_id: str, sample_index: int) -> str:
        return os.path.join(self.folder, _safe(env), _safe(task_id), f"sample_{sample_index}.json")

    def load(self, env: str, task_id: str, sample_index: int) -> EpisodeState | None:
        """The saved state, or None when this episode has none yet."""
        path = self.path(env, task_id, sample_index)
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise ValueError(
                    f"episode state {path} is not valid JSON ({e}); it was written atomically, so something else "
                    "changed it: delete it to run that episode again"
                ) from None
        state = EpisodeState.from_dict(data, where=path)
        if (state.env, state.task_id, state.sample_index) != (env, task_id, sample_index):
            raise ValueError(f"episode state {path} belongs to {state.env}/{state.task_id}#{state.sample_index}")
        return state

    def save(self, state: EpisodeState) -> None:
        atomic_write(self.path(state.env, state.task_id, state.sample_index), state.to_json())


__all__ = ["EpisodeState", "EpisodeStore", "atomic_write"]
