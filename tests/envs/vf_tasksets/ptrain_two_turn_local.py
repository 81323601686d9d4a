"""A two-turn verifiers 0.4 taskset of our own for the tests: the word-reversal prompt, then a
scripted user turn asking for the word again (the pattern of verifiers' alphabet_sort), through
the single agent's `interaction`. Scored on the last reply (`lcs` against the word itself)."""

from collections.abc import Iterable
from difflib import SequenceMatcher

import verifiers.v1 as vf
from verifiers.v1.envs.single_agent import SingleAgentEnv

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon")
FOLLOW_UP = "Now write the word itself."


class TwoTurnData(vf.TaskData):
    word: str = ""


class TwoTurnTask(vf.Task[TwoTurnData]):
    @vf.reward
    async def lcs(self, task: TwoTurnData, trace) -> float:
        return SequenceMatcher(None, trace.last_reply, task.word).ratio()


class TwoTurnLocal(vf.Taskset[TwoTurnTask]):
    def load(self) -> Iterable[TwoTurnTask]:
        for word in WORDS:
            yield TwoTurnTask(TwoTurnData(prompt=f"Reverse the word: {word}", word=word, id=word), self.config.task)


class TwoTurnEnv(SingleAgentEnv):
    """The one agent answers the prompt, then the scripted follow-up."""

    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn(FOLLOW_UP)


__all__ = ["TwoTurnLocal", "TwoTurnEnv"]
