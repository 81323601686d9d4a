"""What every environment kind's options share: the kind table and its decorator, the error
type, and the bounds the kinds check against. ptrain/config/env.py and the modules of the
multi-turn and NeMo Gym kinds register their options dataclasses here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


class EnvConfigError(ValueError):
    """An environment config value that cannot work; the message names the key and what to pass."""


KIND_OPTIONS: dict[str, type] = {}
"""Options dataclass of each kind (filled by `register_options`)."""


def register_options(kind: str) -> Callable[[type], type]:
    """Class decorator: `cls` is the options dataclass of environment kind `kind`."""

    def add(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"options of env kind {kind!r}: {cls.__name__} must be a dataclass")
        if kind in KIND_OPTIONS and KIND_OPTIONS[kind] is not cls:
            raise ValueError(f"env kind {kind!r} already has options {KIND_OPTIONS[kind].__name__}")
        KIND_OPTIONS[kind] = cls
        return cls

    return add


MAX_TIMEOUT_S = 86400.0
"""Longest timeout of any one step (a reward computation, a test, a tool call): a day. The
waits behind them overflow somewhere past it (a worker's pipe polls whole milliseconds as a
C int, about 24 days; setitimer past the platform's time_t)."""
