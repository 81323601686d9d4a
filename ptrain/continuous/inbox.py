"""The inbox: a folder where each YAML file is one environment for the loop to take in.

A file `INBOX/<name>.yaml` holds the keys of `envs.<name>` (`kind:` and that kind's options,
`n_train`, `n_eval`, `weight`, ...). It is read, validated as an EnvConfig and hashed; what
does not validate moves to `INBOX/rejected/` with `<file>.error` beside it saying why, and
nothing else stops. An environment is frozen once taken in (its held-out split is the gate's
yardstick): the same name with other content is rejected, the same content again is a no-op.
Files whose name starts with "." are not read (write one there and rename it into place).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config

SUFFIXES = (".yaml", ".yml")
REJECTED = "rejected"


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One environment file that validated."""

    name: str
    path: str
    spec: dict[str, Any]
    """The file's mapping, with `name` set to the file's name."""
    sha256: str
    """Of the canonical JSON of `spec`: what the run records and compares."""

    def env_config(self) -> EnvConfig:
        return env_config(self.spec)


class InboxError(ValueError):
    """An inbox file that cannot become an environment; the message says why and what to do."""


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def env_config(spec: Mapping[str, Any]) -> EnvConfig:
    """A validated EnvConfig from a mapping of its keys (InboxError naming the key otherwise)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ptrain.config.run import explain_omegaconf_error

    try:
        cfg: EnvConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), dict(spec)))
    except OmegaConfBaseException as e:
        raise InboxError(explain_omegaconf_error(e, prefix=f"envs.{spec.get('name')}.")) from None
    try:
        validate_env_config(cfg)
    except EnvConfigError as e:
        raise InboxError(str(e)) from None
    return cfg


def read_file(path: str) -> Arrival:
    """Parse and validate one inbox file (InboxError says why not)."""
    from omegaconf import OmegaConf

    stem, suffix = os.path.splitext(os.path.basename(path))
    if suffix not in SUFFIXES:
        raise InboxError(f"'{os.path.basename(path)}' is not a .yaml file; an environment is INBOX/<name>.yaml")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # YAML syntax errors come in several types
        raise InboxError(f"'{os.path.basename(path)}' is not valid YAML: {str(e).strip().splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise InboxError(
            f"'{os.path.basename(path)}' holds {type(raw).__name__}, not a mapping; write the keys of envs.<name>, "
            "e.g. `kind: countdown` and `n_eval: 64`"
        )
    if raw.get("name") not in (None, stem):
        raise InboxError(
            f"'{os.path.basename(path)}' sets name: {raw['name']!r}; an inbox environment is named by its file "
            f"({stem!r}): drop the name key or rename the file"
        )
    spec = {**raw, "name": stem}
    env_config(spec)
    return Arrival(stem, path, spec, spec_hash(spec))


def reject(path: str, reason: str) -> str:
    """Move `path` to INBOX/rejected/ with `<file>.error` holding the reason; the moved path."""
    folder = os.path.join(os.path.dirname(path), REJECTED)
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, os.path.basename(path))
    with open(target + ".error", "w") as f:
        f.write(reason.rstrip() + "\n")
    shutil.move(path, target)
    return target


def scan(inbox: str, known: Mapping[str, str]) -> tuple[list[Arrival], list[tuple[str, str]]]:
    """The inbox's new environments (sorted by file name) and what was rejected this look
    ((moved path, reason) each). `known`: name -> sha256 of the environments the run has."""
    if not os.path.isdir(inbox):
        raise FileNotFoundError(f"continuous.inbox: '{inbox}' is not a folder; create it (mkdir -p {inbox})")
    new: list[Arrival] = []
    rejected: list[tuple[str, str]] = []
    for entry in sorted(os.listdir(inbox)):
        path = os.path.join(inbox, entry)
        if entry.startswith(".") or not os.path.isfile(path) or entry.endswith(".error"):
            continue
        try:
            arrival = read_file(path)
            if arrival.name in known and known[arrival.name] != arrival.sha256:
                raise InboxError(
                    f"an environment named '{arrival.name}' is already in the run with other content; environments "
                    "are frozen once taken in (their held-out tasks are the gate's yardstick): drop the new version "
                    "under another name"
                )
        except InboxError as e:
            rejected.append((reject(path, str(e)), str(e)))
            continue
        if arrival.name not in known:
            new.append(arrival)
    return new, rejected
