"""The `reverse_text` environment: write a text backwards, character by character.

The task of prime-rl's reverse-text example (examples/basic/reverse-text): the policy is given a
text and answers with its characters in the opposite order inside
<reversed_text>...</reversed_text>, e.g. `the cat` -> `<reversed_text>tac eht</reversed_text>`.
The reward is dense, as there: difflib.SequenceMatcher(None, answer, target).ratio() of the
answer against the reversed text, a number in [0, 1] that is 1 only for the exact reversal
("abcd" for "abdc" scores 0.75).

No dataset is downloaded: each text is lowercase words drawn from WORDS (a few hundred common
English words) joined by single spaces, options.min_chars to options.max_chars characters long,
generated from the seed. The text decides the split: no text is in both train and eval, and
the eval tasks are drawn first, so the held-out split does not change with n_train.

Extraction mirrors `extract_tag`: the stripped content of the last complete
<reversed_text>...</reversed_text>; none (no tag, an unclosed one, an empty one) is
unformatted, reward 0. Components: `format` (options.format_reward for a parsed answer) and
`correct` (options.correct_reward x the ratio). Metrics: `correct` is the ratio (so pass rate,
solved tasks and eval accuracy count exact reversals only: they need correct >= 1), and
`exact` is 1 for the exact reversal.

`demonstration(task)` writes a one-line reasoning, then the reversed text in the tags.
"""

from __future__ import annotations

import difflib
import random
from typing import Any

from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv, draw_distinct, extract_tag

TAG = "reversed_text"
"""The answer's tag: <reversed_text>...</reversed_text>."""

WORDS = (
    "about", "above", "across", "act", "add", "after", "again", "age", "ago", "agree", "air", "all",
    "almost", "alone", "along", "also", "always", "among", "and", "animal", "answer", "any", "apple",
    "area", "arm", "around", "art", "ask", "away", "baby", "back", "bad", "ball", "bank", "base",
    "bear", "beat", "bed", "before", "begin", "behind", "bell", "best", "better", "big", "bird",
    "black", "blue", "boat", "body", "bone", "book", "both", "bottom", "box", "boy", "bread",
    "break", "bright", "bring", "brother", "brown", "build", "busy", "but", "buy", "call", "came",
    "camp", "can", "car", "care", "carry", "case", "cat", "catch", "cause", "cell", "center",
    "chair", "change", "check", "child", "city", "class", "clean", "clear", "climb", "clock",
    "close", "cloud", "coast", "cold", "color", "come", "common", "cook", "cool", "copy", "corn",
    "corner", "count", "country", "course", "cover", "cow", "cross", "cry", "cut", "dance", "dark",
    "day", "deep", "desk", "did", "dinner", "dog", "door", "down", "draw", "dream", "dress",
    "drink", "drive", "drop", "dry", "duck", "early", "earth", "east", "easy", "eat", "egg",
    "end", "enough", "even", "evening", "ever", "every", "eye", "face", "fact", "fall", "family",
    "far", "farm", "fast", "father", "feel", "feet", "few", "field", "fill", "find", "fine",
    "fire", "first", "fish", "five", "floor", "flower", "fly", "follow", "food", "foot", "forest",
    "form", "four", "free", "friend", "from", "front", "fruit", "full", "fun", "game", "garden",
    "gate", "gave", "gift", "girl", "give", "glad", "glass", "gold", "good", "grass", "great",
    "green", "ground", "group", "grow", "hair", "half", "hand", "happy", "hard", "hat", "have",
    "head", "hear", "heart", "heavy", "help", "here", "high", "hill", "hold", "home", "hope",
    "horse", "hot", "hour", "house", "idea", "inside", "iron", "island", "job", "join", "jump",
    "just", "keep", "key", "kind", "king", "kitchen", "know", "lake", "land", "large", "last",
    "late", "laugh", "lead", "leaf", "learn", "leave", "left", "leg", "letter", "light", "line",
    "lion", "list", "listen", "little", "live", "long", "look", "lost", "loud", "love", "low",
    "lunch", "made", "main", "make", "many", "map", "mark", "market", "milk", "mind", "minute",
    "money", "month", "moon", "morning", "mother", "mouth", "move", "much", "music", "name",
    "near", "never", "new", "next", "nice", "night", "north", "nose", "note", "number", "ocean",
    "off", "often", "old", "once", "only", "open", "orange", "other", "over", "page", "paint",
    "paper", "park", "part", "party", "pass", "past", "pay", "pen", "people", "pick", "picture",
    "piece", "place", "plan", "plant", "play", "point", "poor", "press", "pull", "push", "put",
    "queen", "quick", "quiet", "rain", "reach", "read", "ready", "red", "rest", "rich", "ride",
    "right", "ring", "river", "road", "rock", "room", "round", "run", "salt", "same", "sand",
    "save", "say", "school", "sea", "seat", "second", "see", "seed", "send", "seven", "shape",
    "ship", "shoe", "short", "show", "side", "sign", "silver", "simple", "sing", "sister", "sit",
    "six", "size", "skin", "sky", "sleep", "slow", "small", "smile", "snow", "soft", "song",
    "soon", "sound", "south", "space", "speak", "spring", "square", "stand", "star", "start",
    "stay", "step", "stone", "stop", "story", "street", "strong", "study", "summer", "sun",
    "sure", "swim", "table", "tail", "take", "talk", "tall", "teach", "tell", "ten", "test",
    "thank", "thing", "think", "three", "time", "today", "told", "tone", "tool", "top", "town",
    "train", "tree", "true", "try", "turn", "two", "under", "until", "upon", "use", "very",
    "visit", "voice", "wait", "walk", "wall", "want", "warm", "wash", "watch", "water", "wave",
    "way", "weather", "week", "well", "west", "wheel", "white", "whole", "wide", "wild", "wind",
    "window", "winter", "wish", "with", "wood", "word", "work", "world", "write", "yard", "year",
    "yellow", "young",
)  # fmt: skip
"""Words the texts are made of: distinct, lowercase a-z, at most REVERSE_TEXT_MAX_WORD_CHARS
(8) letters each."""


def make_text(rng: random.Random, min_chars: int, max_chars: int) -> str | None:
    """A text of words from WORDS joined by spaces, min_chars to max_chars characters long, or
    None when this draw missed (words are added while they fit a length drawn in the range)."""
    limit = rng.randint(min_chars, max_chars)
    text = ""
    while True:
        word = rng.choice(WORDS)
        longer = f"{text} {word}" if text else word
        if len(longer) > limit:
            break
        text = longer
    return text if len(text) >= min_chars else None


def similarity(answer: str, target: str) -> float:
    """difflib.SequenceMatcher(None, answer, target).ratio(): 2 x matched characters / total
    characters, in [0, 1], 1 only when answer == target. Without difflib's autojunk, which
    from 200 characters on treats the commonest letters and the space as junk and would
    distort the reward of long texts (prime-rl's texts are shorter, where both agree)."""
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


def judge_reverse_text(answer: str, data: dict[str, Any]) -> float:
    """The similarity of `answer` to data["target"], the reversed text."""
    if not isinstance(answer, str):
        return 0.0
    return similarity(answer, str(data["target"]))


def prompt_text(text: str) -> str:
    """The prompt of one task: the text and the answer format. Kept short: the embedded
    tokenizer spends about 1.5 characters a token on plain English."""
    return f"Write this text backwards, character by character, inside <{TAG}></{TAG}>.\nText: {text}"


class ReverseTextEnv(SingleTurnEnv):
    """Text reversal tasks (options: ReverseTextOptions)."""

    kind = "reverse_text"
    judge = staticmethod(judge_reverse_text)
    extra_metrics = ("exact",)
    full_credit_metric = "exact"

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        rng = random.Random(seed)
        need = self.cfg.n_train + self.cfg.n_eval
        drawn = draw_distinct(
            lambda: make_text(rng, o.min_chars, o.max_chars),
            lambda text: text,
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct texts of {o.min_chars} to "
                f"{o.max_chars} characters; widen min_chars / max_chars or lower n_train / n_eval"
            ),
        )

        def make(split: str, texts: list[str]) -> list[Task]:
            return [
                self.task(split, i, self.user(prompt_text(text)), {"text": text, "target": text[::-1]})
                for i, text in enumerate(texts)
            ]

        return make("train", drawn[self.cfg.n_eval :]), make("eval", drawn[: self.cfg.n_eval])

    def extract(self, task: Task, text: str) -> str | None:
        return extract_tag(text, TAG)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` a line on what to reverse `</think><reversed_text>` the reversed text
        `</reversed_text>`."""
        d = task.data
        text, target = str(d["text"]), str(d["target"])
        if target != text[::-1] or target.strip() != target or not target:
            raise ValueError(
                f"env {self.name} task {task.id}: the stored target {target!r} is not the reversal of {text!r} "
                "(or has surrounding spaces, which the answer's extraction strips); the task's data is inconsistent"
            )
        reasoning = f"{len(text)} characters, the last first."
        return [{"role": "assistant", "content": f"<think>{reasoning}</think><{TAG}>{target}</{TAG}>"}]
