"""A test environment with a dense reward that a freshly initialised policy can climb: the
share of ASCII letters in the completion's text (the arithmetic task's prompts; a reward
that random samples already spread over, so every group carries a learning signal)."""

from ptrain.envs.arithmetic_env import ArithmeticEnv
from ptrain.envs.base import Task
from ptrain.envs.single_turn import Score


def letter_share(text: str) -> float:
    return sum(ch.isascii() and ch.isalpha() for ch in text) / max(len(text), 1)


class LetterShareEnv(ArithmeticEnv):
    async def score(self, task: Task, text: str) -> Score:
        return self.scored(True, letter_share(text))


def use_letter_share_env() -> None:
    """Make the `arithmetic` kind build LetterShareEnv in this process (tests only)."""
    from ptrain.envs import registry

    registry.ENV_CLASSES["arithmetic"] = lambda: LetterShareEnv
