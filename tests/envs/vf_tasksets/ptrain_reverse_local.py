"""A verifiers 0.4 taskset of our own for the tests (no downloads): reverse a word, scored by the
longest-common-subsequence ratio of the reply and the reversed word (`lcs`, weight 1) plus a
`short` reward (weight 0.5) for a reply of at most 12 characters. The tests put this folder on
PYTHONPATH, so `vf-eval ptrain-reverse-local` and the `verifiers` env kind import it by id."""

from __future__ import annotations

from collections.abc import Iterable
from difflib import SequenceMatcher

import verifiers.v1 as vf

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "zebra")


class ReverseData(vf.TaskData):
    answer: str = ""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward
    async def lcs(self, task: ReverseData, trace) -> float:
        return SequenceMatcher(None, trace.last_reply, task.answer).ratio()

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 12)


class ReverseLocal(vf.Taskset[ReverseTask]):
    def load(self) -> Iterable[ReverseTask]:
        for word in WORDS:
            data = ReverseData(prompt=f"Reverse the word: {word}", answer=word[::-1], id=word)
            yield ReverseTask(data, self.config.task)


__all__ = ["ReverseLocal"]
