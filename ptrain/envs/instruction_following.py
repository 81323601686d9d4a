"""The `instruction_following` environment: a writing request plus constraints that code checks.

A scaled-down, locally generated stand-in for Nemotron 3 Nano's IFEval/IFBench-style
environment: each prompt is a request ("Write a short blog post about lighthouses.") followed
by 1 to 3 constraints drawn from IF_FAMILIES (ptrain/config/env_verifiable.py), never two that
IF_CONFLICTS says contradict each other:

    word_count      at least / at most N words (words: runs of letters and digits, an inner
                    apostrophe joins one: "don't" is one word, "well-known" two)
    bullets         exactly N bullet points: lines starting with "* " or "- " (after indent)
    keywords        both keywords, each as a whole word, any case
    forbidden_word  never the word, as a whole word, in any case
    lowercase       no capital letter, and at least one letter (str.islower)
    uppercase       no lowercase letter, and at least one letter (str.isupper)
    end_phrase      the response ends with the exact phrase (case and punctuation included)
    quotation       the response starts and ends with a double quote (")
    paragraphs      exactly N non-empty paragraphs separated by *** (IFEval's rule: an empty
                    piece inside fails; empty pieces at either end are not counted)
    first_word      the first word (leading punctuation skipped) is the given one, any case
    title           a title in double angle brackets, <<like this>>, on one line, not empty
    no_commas       no "," anywhere

Each check is a pure function `(response, args) -> bool` in CHECKS. Scoring is IFEval's strict
mode: the response as written, stripped of surrounding whitespace and of a reasoning block
closed by </think>. The judge returns the fraction of the prompt's constraints met (reward
component `correct`); metric all_met is 1 when every one is met (IFEval's prompt-level
accuracy). An empty response, or one longer than options.max_answer_chars, scores 0 unchecked.

`demonstration(task)` builds a response that meets every constraint of the task from the
constraint specs (a title line, an opening sentence with the required first word, the
keywords, the bullets or paragraphs asked for, sentences about the topic up to the word count,
the end phrase, then the case and the quotes), checks it with CHECKS, and puts a one-line
summary of the request and its rules before it as reasoning.

The split key is the whole prompt: no prompt is in both train and eval, and the eval prompts
are drawn first, so the held-out split does not change with n_train.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable
from itertools import combinations
from typing import Any

from ptrain.config.env_verifiable import IF_CONFLICTS
from ptrain.envs.base import Task
from ptrain.envs.single_turn import SingleTurnEnv, draw_distinct

TOPICS = (
    "lighthouses", "the history of tea", "urban gardening", "learning a new language", "volcanoes",
    "the night sky", "bicycles", "public libraries", "honeybees", "rainforests", "chess", "bread baking",
    "ocean tides", "recycling", "winter hiking", "jazz music", "paper airplanes", "ancient maps",
    "coral reefs", "solar power", "board games", "city parks", "migrating birds", "clocks",
    "the water cycle", "street food", "mountain railways", "deserts", "origami", "kites",
    "a rainy afternoon", "moving to a new town", "a first day at work", "a lost umbrella",
    "an old bookshop", "a summer festival", "a broken radio", "a quiet harbor", "a school play",
    "a long train journey",
)  # fmt: skip
"""Subjects of the writing requests."""
TEMPLATES = (
    "Write a short essay about {topic}.",
    "Write a blog post about {topic}.",
    "Describe {topic} for a curious ten-year-old.",
    "Write a short story about {topic}.",
    "Write a letter to a friend about {topic}.",
    "Explain why {topic} matters to people.",
    "Write a speech about {topic}.",
    "Write a product description inspired by {topic}.",
)
"""Writing requests, each with one topic."""
KEYWORDS = (
    "history", "future", "balance", "energy", "journey", "community", "silence", "pattern",
    "window", "river", "signal", "memory", "bridge", "harvest", "compass", "lantern",
)  # fmt: skip
"""Words a keywords constraint asks for."""
FORBIDDEN = ("very", "really", "basically", "actually", "thing", "stuff", "nice", "literally", "totally", "great")
"""Words a forbidden_word constraint bans: none occurs in TOPICS, TEMPLATES, KEYWORDS, FIRST_WORDS,
END_PHRASES or the constraint descriptions, so the prompt never asks for a banned word."""
FIRST_WORDS = ("Today", "Imagine", "Consider", "Honestly", "Remember", "Surprisingly", "Once", "Listen")
"""Words a first_word constraint asks the response to start with."""
END_PHRASES = (
    "Is there anything else I can help with?",
    "Let me know if you have additional questions.",
    "That is all for now.",
    "Thank you for reading.",
    "Any other questions?",
)
"""Phrases an end_phrase constraint asks the response to end with (no commas, so that they
fit no_commas too)."""

WORD_RE = re.compile(r"\w+(?:['’]\w+)*")
BULLET_RE = re.compile(r"^[ \t]*[*-][ \t]+\S", re.MULTILINE)
PARAGRAPH_SPLIT_RE = re.compile(r"\s?\*\*\*\s?")
TITLE_RE = re.compile(r"<<([^<>\n]+)>>")
FIRST_WORD_RE = re.compile(r"[\W_]*(\w+)")


def final_response(text: str) -> str:
    """The part of a completion that is the response: after the last </think>, stripped."""
    end = text.rfind("</think>")
    return (text[end + len("</think>") :] if end >= 0 else text).strip()


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


def count_words(text: str) -> int:
    """Words of text: runs of letters and digits (an inner apostrophe joins two runs)."""
    return sum(1 for _ in WORD_RE.finditer(text))


def check_word_count(response: str, args: dict[str, Any]) -> bool:
    n = count_words(response)
    return n >= args["n"] if args["relation"] == "at_least" else n <= args["n"]


def check_bullets(response: str, args: dict[str, Any]) -> bool:
    return len(BULLET_RE.findall(response)) == args["n"]


def check_keywords(response: str, args: dict[str, Any]) -> bool:
    return all(_has_word(response, k) for k in args["words"])


def check_forbidden_word(response: str, args: dict[str, Any]) -> bool:
    return not _has_word(response, args["word"])


def check_lowercase(response: str, args: dict[str, Any]) -> bool:
    return response.islower()


def check_uppercase(response: str, args: dict[str, Any]) -> bool:
    return response.isupper()


def check_end_phrase(response: str, args: dict[str, Any]) -> bool:
    return response.strip().endswith(args["phrase"])


def check_quotation(response: str, args: dict[str, Any]) -> bool:
    text = response.strip()
    return len(text) >= 2 and text[0] == '"' and text[-1] == '"'


def check_paragraphs(response: str, args: dict[str, Any]) -> bool:
    pieces = PARAGRAPH_SPLIT_RE.split(response)
    count = len(pieces)
    for i, piece in enumerate(pieces):
        if not piece.strip():
            if 0 < i < len(pieces) - 1:
                return False
            count -= 1
    return count == args["n"]


def check_first_word(response: str, args: dict[str, Any]) -> bool:
    m = FIRST_WORD_RE.match(response.strip())
    return m is not None and m.group(1).lower() == args["word"].lower()


def check_title(response: str, args: dict[str, Any]) -> bool:
    return any(m.group(1).strip() for m in TITLE_RE.finditer(response))


def check_no_commas(response: str, args: dict[str, Any]) -> bool:
    return "," not in response


CHECKS: dict[str, Callable[[str, dict[str, Any]], bool]] = {
    "word_count": check_word_count,
    "bullets": check_bullets,
    "keywords": check_keywords,
    "forbidden_word": check_forbidden_word,
    "lowercase": check_lowercase,
    "uppercase": check_uppercase,
    "end_phrase": check_end_phrase,
    "quotation": check_quotation,
    "paragraphs": check_paragraphs,
    "first_word": check_first_word,
    "title": check_title,
    "no_commas": check_no_commas,
}
"""Constraint family -> its check: (response, args) -> whether the response meets it."""


def _word_count_args(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        return {"relation": "at_least", "n": rng.choice(range(50, 301, 25))}
    return {"relation": "at_most", "n": rng.choice(range(80, 401, 40))}


ARGS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "word_count": _word_count_args,
    "bullets": lambda rng: {"n": rng.randint(2, 6)},
    "keywords": lambda rng: {"words": rng.sample(KEYWORDS, 2)},
    "forbidden_word": lambda rng: {"word": rng.choice(FORBIDDEN)},
    "lowercase": lambda rng: {},
    "uppercase": lambda rng: {},
    "end_phrase": lambda rng: {"phrase": rng.choice(END_PHRASES)},
    "quotation": lambda rng: {},
    "paragraphs": lambda rng: {"n": rng.randint(2, 5)},
    "first_word": lambda rng: {"word": rng.choice(FIRST_WORDS)},
    "title": lambda rng: {},
    "no_commas": lambda rng: {},
}
"""Constraint family -> a draw of its arguments."""


def describe(family: str, args: dict[str, Any]) -> str:
    """The instruction that asks for constraint `family` with `args`, as the prompt says it."""
    if family == "word_count":
        if args["relation"] == "at_least":
            return f"Your response should contain at least {args['n']} words."
        return f"Answer with at most {args['n']} words."
    if family == "bullets":
        return (
            f"Your answer must contain exactly {args['n']} bullet points. Use markdown bullet points "
            "such as:\n* This is point 1.\n* This is point 2"
        )
    if family == "keywords":
        a, b = args["words"]
        return f'Include the keywords "{a}" and "{b}" in the response.'
    if family == "forbidden_word":
        return f'Do not use the word "{args["word"]}" anywhere in your response.'
    if family == "lowercase":
        return (
            "Your entire response should be in English, and in all lowercase letters. No capital letters are allowed."
        )
    if family == "uppercase":
        return "Your entire response should be in English and in all capital letters."
    if family == "end_phrase":
        return f'End your response with this exact phrase: "{args["phrase"]}" No other words should follow it.'
    if family == "quotation":
        return "Wrap your entire response with double quotation marks."
    if family == "paragraphs":
        return (
            f"There should be exactly {args['n']} paragraphs. Paragraphs are separated from each other by the "
            "markdown divider: ***"
        )
    if family == "first_word":
        return f'Start your response with the word "{args["word"]}".'
    if family == "title":
        return "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."
    if family == "no_commas":
        return "In your entire response, refrain from the use of any commas."
    raise ValueError(f"unknown constraint family {family!r}")


def constraint_results(response: str, constraints: list[dict[str, Any]]) -> list[bool]:
    """Whether `response` meets each constraint ({"family", "args"}), in order."""
    return [bool(CHECKS[c["family"]](response, c["args"])) for c in constraints]


def judge_instruction_following(response: str, data: dict[str, Any]) -> float:
    """The fraction of data["constraints"] that `response` meets; 0.0 for a response longer
    than data["max_answer_chars"] (never checked)."""
    if len(response) > data.get("max_answer_chars", 16000):
        return 0.0
    results = constraint_results(response, data["constraints"])
    return sum(results) / len(results)


# ----------------------------------------------------------------------------- demonstrations

OPENERS = {
    "Today": "Today I want to write about {topic}.",
    "Imagine": "Imagine a whole day spent with {topic}.",
    "Consider": "Consider {topic} for a moment.",
    "Honestly": "Honestly {topic} deserves more attention.",
    "Remember": "Remember that {topic} has a story of its own.",
    "Surprisingly": "Surprisingly few people stop to think about {topic}.",
    "Once": "Once you look closely {topic} turns out to be fascinating.",
    "Listen": "Listen closely and {topic} has a lot to teach us.",
}
"""The opening sentence of a demonstration for each of FIRST_WORDS."""
PLAIN_OPENERS = (
    "This piece is about {topic}.",
    "Here are a few thoughts on {topic}.",
    "Let us take a closer look at {topic}.",
)
SENTENCES = (
    "There is more to {topic} than most of us expect.",
    "Each detail of {topic} tells a small story.",
    "People have talked about {topic} for a long time.",
    "It rewards anyone who takes the time to look.",
    "A good place to start is with simple questions.",
    "Over time the picture becomes clear.",
    "Small changes can make a big difference here.",
    "Many people remember their first encounter with {topic}.",
    "It can be calm one day and busy the next.",
    "Careful attention reveals patterns that are easy to miss.",
    "Friends and neighbors often share their own stories about it.",
    "The best way to learn is to try it yourself.",
    "Old books and new ideas both have something to say.",
    "Every season brings a different side of {topic}.",
    "Some of the most useful lessons are also the simplest.",
    "Curiosity is the only tool you need to begin.",
    "It is worth sharing what you learn with others.",
    "Questions lead to answers and answers lead to new questions.",
    "Looking back it is clear how much there is to discover.",
    "A quiet moment is often enough to notice something new.",
)
"""Sentences a demonstration is written from: no commas, none of FORBIDDEN, a topic at most."""
BULLET_POINTS = (
    "It has a long past.",
    "It changes with the seasons.",
    "It brings people together.",
    "It rewards patience.",
    "It teaches us to look closely.",
    "It is easy to start.",
    "It keeps surprising us.",
    "It connects many places.",
)
"""Short bullet points (no more than the largest bullets constraint asks for)."""
RULES = {
    "word_count": lambda a: f"{a['relation'].replace('_', ' ')} {a['n']} words",
    "bullets": lambda a: f"exactly {a['n']} bullet points",
    "keywords": lambda a: f"use {a['words'][0]} and {a['words'][1]}",
    "forbidden_word": lambda a: f"never the word {a['word']}",
    "lowercase": lambda a: "all lowercase",
    "uppercase": lambda a: "all capitals",
    "end_phrase": lambda a: "end with the given phrase",
    "quotation": lambda a: "wrap it in double quotes",
    "paragraphs": lambda a: f"{a['n']} paragraphs split by ***",
    "first_word": lambda a: f"start with {a['word']}",
    "title": lambda a: "a title in << >>",
    "no_commas": lambda a: "no commas",
}
"""Each constraint family in a few words (a demonstration's reasoning)."""
_TEMPLATE_RES = [re.compile(re.escape(t).replace(re.escape("{topic}"), "(.+)") + "$") for t in TEMPLATES]


def request_topic(request: str) -> str:
    """The topic of a generated writing request ("this topic" for a request of another shape)."""
    for pattern in _TEMPLATE_RES:
        m = pattern.match(request)
        if m:
            return m.group(1)
    return "this topic"


def write_response(topic: str, constraints: list[dict[str, Any]], rng: random.Random) -> str:
    """A response about `topic` that meets every constraint of `constraints` (which must not
    conflict, IF_CONFLICTS); sentences are drawn with rng. Constraint families it does not
    know are not met (the caller checks)."""
    by = {c["family"]: c["args"] for c in constraints}
    pool = [s.format(topic=topic) for s in SENTENCES]
    rng.shuffle(pool)
    drawn = itertools.cycle(pool)
    if "first_word" in by:
        word = by["first_word"]["word"]
        opener = OPENERS.get(word, word + ": this is about {topic}.").format(topic=topic)
    else:
        opener = rng.choice(PLAIN_OPENERS).format(topic=topic)
    intro = [opener[0].upper() + opener[1:]]
    if "keywords" in by:
        a, b = by["keywords"]["words"]
        intro.append(f"Two words come to mind here: {a} and {b}.")
    count = by.get("word_count")
    short = count is not None and count["relation"] == "at_most"
    title = f"<<On {topic}>>" if "title" in by else None
    end = by["end_phrase"]["phrase"] if "end_phrase" in by else None
    points = itertools.cycle(rng.sample(BULLET_POINTS, len(BULLET_POINTS)))
    bullets = [f"* {next(points)}" for _ in range(by["bullets"]["n"])] if "bullets" in by else []
    if "paragraphs" in by:
        rest = [[next(drawn)] for _ in range(by["paragraphs"]["n"] - 1)]
        paragraphs = [intro + ([] if short else [next(drawn)]), *rest]
    else:
        paragraphs = [intro + ([] if short or bullets else [next(drawn), next(drawn)])]

    def assemble() -> str:
        texts = [" ".join(p) for p in paragraphs]
        if title:
            texts[0] = f"{title}\n{texts[0]}"
        if bullets:
            texts[-1] = "\n".join([texts[-1], *bullets])
        if end:
            texts[-1] = f"{texts[-1]}\n{end}" if bullets else f"{texts[-1]} {end}"
        return "\n***\n".join(texts)

    if count is not None and count["relation"] == "at_least":
        k = 0
        while count_words(assemble()) < count["n"]:
            paragraphs[k % len(paragraphs)].append(next(drawn))
            k += 1
    text = assemble()
    if "lowercase" in by:
        text = text.lower()
    if "uppercase" in by:
        text = text.upper()
    if "quotation" in by:
        text = f'"{text}"'
    return text


def compatible_subsets(families: list[str], sizes: range) -> dict[int, list[tuple[str, ...]]]:
    """Per size in `sizes`, the sets of `families` (in their order) with no pair in IF_CONFLICTS."""
    return {
        k: [s for s in combinations(families, k) if all(frozenset(p) not in IF_CONFLICTS for p in combinations(s, 2))]
        for k in sizes
    }


class InstructionFollowingEnv(SingleTurnEnv):
    """IFEval-style constrained writing requests (options: InstructionFollowingOptions)."""

    kind = "instruction_following"
    judge = staticmethod(judge_instruction_following)
    extra_metrics = ("all_met",)
    full_credit_metric = "all_met"

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        rng = random.Random(seed)
        subsets = compatible_subsets(list(o.families), range(o.min_constraints, o.max_constraints + 1))
        need = self.cfg.n_train + self.cfg.n_eval

        def draw() -> dict[str, Any]:
            request = rng.choice(TEMPLATES).format(topic=rng.choice(TOPICS))
            families = list(rng.choice(subsets[rng.randint(o.min_constraints, o.max_constraints)]))
            rng.shuffle(families)
            constraints = [{"family": f, "args": ARGS[f](rng)} for f in families]
            prompt = " ".join([request, *(describe(c["family"], c["args"]) for c in constraints)])
            return {
                "request": request,
                "prompt": prompt,
                "constraints": constraints,
                "max_answer_chars": o.max_answer_chars,
            }

        drawn = draw_distinct(
            draw,
            lambda row: row["prompt"],
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct prompts with families "
                f"{o.families}; add families, raise max_constraints or lower n_train / n_eval"
            ),
        )

        def make(split: str, rows: list[dict[str, Any]]) -> list[Task]:
            return [self.task(split, i, self.user(row["prompt"]), row) for i, row in enumerate(rows)]

        return make("train", drawn[self.cfg.n_eval :]), make("eval", drawn[: self.cfg.n_eval])

    def extract(self, task: Task, text: str) -> str | None:
        response = final_response(text)
        if not response or len(response) > self.options.max_answer_chars:
            return None
        return response

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the request and its rules in a line `</think>` a response that meets
        every constraint (`write_response`; the sentences drawn with a seed from the task)."""
        d = task.data
        constraints = list(d["constraints"])
        request = d["request"]
        rng = random.Random(f"{task.id}/{d.get('prompt', request)}")
        response = write_response(request_topic(request), constraints, rng)
        unmet = [c["family"] for c, ok in zip(constraints, constraint_results(response, constraints)) if not ok]
        limit = d.get("max_answer_chars", self.options.max_answer_chars)
        if unmet or len(response) > limit:
            why = f"constraints {unmet} are not met" if unmet else f"it is {len(response)} characters, over {limit}"
            raise ValueError(
                f"env {self.name} task {task.id}: cannot write a demonstration that meets every constraint of "
                f"{[c['family'] for c in constraints]}: {why}"
            )
        rules = "; ".join(RULES[c["family"]](c["args"]) for c in constraints)
        reasoning = f"{request} Rules: {rules}."
        return [{"role": "assistant", "content": f"<think>{reasoning}</think>{response}"}]
