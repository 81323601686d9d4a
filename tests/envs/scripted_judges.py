"""Reward functions that misbehave on command, for the environment tests. Kept in a module
of their own that imports nothing heavy: a reward worker imports it on its first call, and
that import counts against the call's timeout."""

from __future__ import annotations

import os
import time


def scripted_judge(answer: str, data: dict) -> float:
    """1.0 for data["answer"], 0.0 for other text; raises, hangs, crashes or returns garbage
    for the answers named below."""
    if answer == "boom":
        raise RuntimeError("the verifier blew up")
    if answer == "hang":
        time.sleep(600)
    if answer == "slow":
        time.sleep(0.4)
        return 1.0
    if answer == "nan":
        return float("nan")
    if answer == "big":
        return 5.0
    if answer == "words":
        return "yes"  # type: ignore[return-value]
    if answer == "crash":
        os._exit(3)
    return 1.0 if answer == data["answer"] else 0.0
