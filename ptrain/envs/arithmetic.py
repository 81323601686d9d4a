"""The arithmetic environment's verifier: read the final `Answer: n` of a completion and grade it.

The embedded task (ptrain.data.tasks) writes its worked solutions to end in this line;
evaluation, on-policy DPO pairs and the RL stage grade completions with `check_answer`
against the task metadata a row carries ({"kind": "arithmetic", "answer": "936", ...}).
"""

from __future__ import annotations

import re
from typing import Any

ANSWER_PREFIX = "Answer:"
"""What precedes the final answer in a worked solution."""
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


def extract_answer(completion: str) -> str | None:
    """The integer after the last `Answer:` in completion, normalised ('007' -> '7'); None if absent."""
    found = _ANSWER_RE.findall(completion)
    if not found:
        return None
    if len(found[-1]) > 4000:
        # int() refuses strings past 4300 digits, and a completion can hold them; no task's
        # answer is that long, so the text as it stands grades the same.
        return found[-1]
    return str(int(found[-1]))


def check_answer(task: dict[str, Any], completion: str) -> bool:
    """True when completion's final `Answer: n` equals the task's expected answer."""
    got = extract_answer(completion)
    return got is not None and got == str(int(task["answer"]))
