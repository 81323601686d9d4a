"""The `long_context` environment: find one fact in several long documents.

A locally generated stand-in for Nemotron 3 Nano's long-context QA environment, so that a
recipe can train and evaluate at growing prompt lengths (options.context_tokens). A prompt
holds `n_documents` generated documents, each a title and paragraphs of filler sentences
about made-up places, with `facts_per_document` facts planted among them, then a question:

    Read the 4 documents below, then answer the question that follows them. The answer is
    in exactly one document.

    Document 1: Letters from Orvane

    Few records explain why the Kelwick foundry keeps a pale bell above its door. ...
    The access code of the Tordris guild is 5093. ...

    Document 2: ...

    Question: What is the access code of the Vantor archive?
    Put your final answer in \\boxed{}.

Every document states the asked attribute of one of its entities, so the other documents
carry the distractors (the access codes of other entities); in the right document a second
fact, where there is one, gives the asked entity's value of another attribute. Filler
sentences carry no digits and no facts, and every stated value is distinct, so exactly one
sentence answers.

Length: filler sentences are taken until the rendered prompt (chat template included,
counted with the policy's tokenizer, or in words where there is none) would pass
context_tokens, so it ends within about a sentence below it. The fact sits at
options.needle_depth of the filler (0: the start of the first document, 1: the end of the
last; "random": drawn per task), which also decides the document that holds it. Building a
task tokenizes its prompt two or three times, so a 128k-token split of 1000 tasks takes
minutes, once per seed.

The answer is read as math's is (`extract_math_answer`: the last \\boxed{...}, or the last
<answer> tag) and matches when equal to the value after `normalize_answer` (case, spaces, a
final period, \\text{...}). Metric `distractor` is 1 when the answer is another stated value:
the model found a fact, but the wrong one. The question (attribute and entity) decides the
split, and the eval tasks are drawn first, so train and eval never share a question and the
held-out split does not change with n_train. task.data keeps the answer and where it is
(document, depth, prompt_tokens), never the documents themselves.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import re
from collections.abc import Callable
from itertools import accumulate, cycle
from typing import Any

from ptrain.config.env_options import EnvConfigError
from ptrain.envs.base import Task
from ptrain.envs.math import extract_math_answer
from ptrain.envs.single_turn import Score, SingleTurnEnv, draw_distinct

HEADS = ("Van", "Del", "Kor", "Mir", "Tal", "Ost", "Bel", "Cyr", "Dun", "Esk", "Fal", "Gor", "Hal", "Ith", "Jor",
         "Kel", "Lor", "Mal", "Nor", "Orv", "Pel", "Quen", "Ros", "Sil", "Tor", "Ulm", "Ver", "Wyn", "Yar", "Zel")  # fmt: skip
TAILS = ("tor", "mora", "ith", "ane", "dris", "wick", "haven", "ora", "mont", "ric", "essa", "uin", "bar", "eth",
         "ova", "ard", "ish", "ulon", "ent", "ay")  # fmt: skip
NAMES = tuple(sorted({h + t for h in HEADS for t in TAILS}))
"""Made-up proper names (600): entities, document titles and keepers' surnames."""
KINDS = ("archive", "observatory", "guild", "harbor", "foundry", "library", "monastery", "orchard", "mine",
         "academy", "lighthouse", "vineyard")  # fmt: skip
FIRST_NAMES = ("Ilsa", "Bram", "Corin", "Dalia", "Edric", "Fenna", "Garrick", "Hesper", "Ivo", "Juna", "Kasimir",
               "Liesel", "Marek", "Nadia", "Oren", "Petra", "Rosalind", "Soren", "Talia", "Wendel")  # fmt: skip
ADJECTIVES = ("amber", "quiet", "weathered", "narrow", "silver", "crooked", "ancient", "pale", "bright", "hollow",
              "mossy", "gilded", "dusty", "broad", "faded", "sturdy")  # fmt: skip
NOUNS = ("lantern", "bell", "bridge", "fountain", "tapestry", "statue", "well", "gate", "mill", "tower", "garden",
         "ledger", "banner", "clock", "window", "stairway")  # fmt: skip
SEASONS = ("spring", "summer", "autumn", "winter", "the rainy months", "the dry season")
FILLER = (
    "{E} stands beside a {a} {n} that travellers mention in their letters.",
    "In {s}, visitors to {e} often remark on the {a} {n} near the gate.",
    "Older accounts describe {e} as {a} and quiet, with a {n} in every room.",
    "Local stories claim that a {a} {n} once drifted past {e} at dawn.",
    "The path from {e} to the {n} crosses a {a} stream and two low hills.",
    "Few records explain why {e} keeps a {a} {n} above its door.",
    "Traders who pass {e} in {s} bring {a} cloth and news from the coast.",
    "A {a} {n} hangs in the main hall of {e}, and nobody remembers who placed it there.",
    "The walls of {e} look {a}, and moss grows thick on the side facing the {n}.",
    "Each year in {s}, the people near {e} gather to repair the {a} {n}.",
    "Some say the {n} behind {e} was carved by a {a} sculptor from the north.",
    "Rain in {s} makes the road to {e} slow, and the {a} {n} is hard to reach.",
)
"""Filler sentence templates: no digits and no attribute, so no filler states a fact."""
TITLES = ("Notes on the {} Valley", "A Survey of {}", "Letters from {}", "The {} Chronicle",
          "Records of the {} Coast", "Travels through {}")  # fmt: skip
INSTRUCTION = "Put your final answer in \\boxed{}."


def attribute_value(rng: random.Random, attribute: str) -> str:
    """A value of `attribute` (ptrain.config.env_verifiable.LONG_CONTEXT_ATTRIBUTES)."""
    if attribute == "access code":
        return str(rng.randint(1000, 9999))
    if attribute == "founding year":
        return str(rng.randint(1100, 1899))
    if attribute == "registry number":
        return str(rng.randint(100000, 999999))
    if attribute == "head keeper":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(NAMES)}"
    if attribute == "call sign":
        return f"{rng.choice(HEADS)[:2].upper()}-{rng.randint(100, 999)}"
    raise ValueError(f"long_context has no attribute {attribute!r}")


def fact_sentence(attribute: str, entity: str, value: str) -> str:
    return f"The {attribute} of the {entity} is {value}."


def question_text(attribute: str, entity: str) -> str:
    return f"{'Who' if attribute == 'head keeper' else 'What'} is the {attribute} of the {entity}?"


def normalize_answer(text: str) -> str:
    """An answer as compared: \\text{...} unwrapped, spaces collapsed, case folded, and
    surrounding spaces and a final period dropped."""
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", str(text))
    return " ".join(text.split()).casefold().removesuffix(".").strip()


def judge_long_context(answer: str, data: dict[str, Any]) -> float:
    """1.0 when `answer` is the task's value (normalize_answer on both), else 0.0."""
    return 1.0 if normalize_answer(answer) == normalize_answer(data["answer"]) else 0.0


def word_counts(texts: list[str]) -> list[int]:
    """Lengths in words: the stand-in for a tokenizer's counts where there is none."""
    return [len(t.split()) for t in texts]


class Filler:
    """A task's endless stream of filler sentences, with their token counts (counted in
    batches as the stream grows)."""

    def __init__(self, rng: random.Random, count: Callable[[list[str]], list[int]]):
        self.rng, self.count = rng, count
        self.sentences: list[str] = []
        self.cum: list[int] = []

    def _sentence(self) -> str:
        r = self.rng
        e = f"the {r.choice(NAMES)} {r.choice(KINDS)}"
        t = r.choice(FILLER)
        return t.format(e=e, E=e[0].upper() + e[1:], a=r.choice(ADJECTIVES), n=r.choice(NOUNS), s=r.choice(SEASONS))

    def fits(self, budget: int) -> int:
        """How many sentences from the stream's start count at most `budget` tokens."""
        while not self.cum or self.cum[-1] <= budget:
            more = [self._sentence() for _ in range(max(32, len(self.sentences)))]
            self.cum.extend(list(accumulate(self.count(more), initial=self.cum[-1] if self.cum else 0))[1:])
            self.sentences.extend(more)
        return bisect.bisect_right(self.cum, budget)


def make_task(
    rng: random.Random,
    question: tuple[str, str],
    options: Any,
    measure: Callable[[str], int],
    count: Callable[[list[str]], list[int]] = word_counts,
    where: str = "options",
) -> tuple[str, dict[str, Any]]:
    """(prompt, data) of one task that asks `question` (attribute, entity), built to at most
    options.context_tokens as `measure(prompt)` counts; `count` gives the lengths of filler
    sentences. EnvConfigError (naming `where`.context_tokens) when the documents' titles,
    facts and the question alone are longer than that."""
    o = options
    attribute, entity = question
    n, k = o.n_documents, o.facts_per_document
    depth = rng.random() if o.needle_depth == "random" else float(o.needle_depth)
    target = min(n - 1, int(depth * n))  # the document that covers that depth of the filler
    entities = {entity}
    while len(entities) < n * k:
        entities.add(f"{rng.choice(NAMES)} {rng.choice(KINDS)}")
    others = sorted(entities - {entity})
    rng.shuffle(others)
    unused = iter(others)
    values: set[str] = set()

    def fact(attr: str, ent: str) -> tuple[str, str, str]:
        while (v := attribute_value(rng, attr)) in values:
            pass
        values.add(v)
        return attr, ent, v

    docs = []  # per document: its facts, the first one about the asked attribute
    for i in range(n):
        first = fact(attribute, entity if i == target else next(unused))
        rest = []
        for j in range(1, k):
            if i == target and j == 1 and len(o.attributes) > 1:
                rest.append(fact(rng.choice([a for a in o.attributes if a != attribute]), entity))
            else:
                rest.append(fact(rng.choice(o.attributes), next(unused)))
        docs.append([first, *rest])
    answer = docs[target][0][2]
    names = sorted(set(NAMES) - {e.split()[0] for e in entities})
    titles = [rng.choice(TITLES).format(name) for name in rng.sample(names, n)]
    slots = [[rng.random() for _ in doc] for doc in docs]  # where each fact goes in its document
    slots[target][0] = depth * n - target
    cuts = [rng.randint(3, 6) for _ in range(64)]  # paragraph lengths, in sentences
    ask = question_text(attribute, entity)
    if o.name_title:
        ask = f"According to Document {target + 1} ({titles[target]}), {ask[0].lower()}{ask[1:]}"
    them = f"the {n} documents below, then answer the question that follows them" if n > 1 else (
        "the document below, then answer the question that follows it")  # fmt: skip

    def render(filler: list[str]) -> str:
        parts = [f"Read {them}. The answer is in exactly one document."]
        for i, doc in enumerate(docs):
            mine = filler[round(i * len(filler) / n) : round((i + 1) * len(filler) / n)]
            for at, j in sorted(((round(s * len(mine)), j) for j, s in enumerate(slots[i])), reverse=True):
                mine.insert(at, fact_sentence(*doc[j]))
            paras, at = [], 0
            for cut in cycle(cuts):
                if at >= len(mine):
                    break
                paras.append(" ".join(mine[at : at + cut]))
                at += cut
            parts.append(f"Document {i + 1}: {titles[i]}\n\n" + "\n\n".join(paras))
        return "\n\n".join([*parts, f"Question: {ask}\n{INSTRUCTION}"])

    want = o.context_tokens
    bare = measure(render([]))
    if bare > want:
        raise EnvConfigError(
            f"config key '{where}.context_tokens': {want} is below the {bare} tokens that the titles, facts and "
            f"question of {n} documents take alone; raise it, or lower n_documents or facts_per_document"
        )
    # Sentence counts add up to a little less than the prompt grows (joins, paragraph breaks):
    # measure, and move the budget by the difference until the prompt is as long as fits.
    filler, budget = Filler(rng, count), want - bare
    prompt, got, tried = render([]), bare, {0}
    while (used := filler.fits(budget)) not in tried:
        tried.add(used)
        text = render(filler.sentences[:used])
        length = measure(text)
        if length <= want:
            if length > got:
                prompt, got = text, length
            budget += want - length
        else:  # at least one sentence fewer
            budget = min(budget + want - length, filler.cum[used - 1] - 1)
    distractors = sorted(v for doc in docs for _, _, v in doc if v != answer)
    data = {"question": ask, "attribute": attribute, "entity": entity, "answer": answer,
            "distractors": distractors, "document": target + 1, "title": titles[target], "depth": depth,
            "prompt_tokens": got, "key": f"{attribute}|{entity}"}  # fmt: skip
    return prompt, data


class LongContextEnv(SingleTurnEnv):
    """Questions over long generated documents (options: LongContextOptions)."""

    kind = "long_context"
    judge = staticmethod(judge_long_context)
    extra_metrics = ("distractor",)

    def _measure(self, prompt: str) -> int:
        return len(self.prompt_ids(Task(self.name, "", self.user(prompt))))

    def _count(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        rng = random.Random(seed)
        need = self.cfg.n_train + self.cfg.n_eval
        questions = draw_distinct(
            lambda: (rng.choice(o.attributes), f"{rng.choice(NAMES)} {rng.choice(KINDS)}"),
            lambda q: q,
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct questions about attributes "
                f"{o.attributes}; add attributes or lower n_train / n_eval"
            ),
        )

        def build(split: str, i: int, q: tuple[str, str]) -> Task:
            rng = random.Random(f"long_context/{seed}/{q}")  # per task: it does not change with n_train
            prompt, data = make_task(rng, q, o, self._measure, self._count, f"envs.{self.name}.options")
            return self.task(split, i, self.user(prompt), data)

        held = [build("eval", i, q) for i, q in enumerate(questions[: self.cfg.n_eval])]
        return [build("train", i, q) for i, q in enumerate(questions[self.cfg.n_eval :])], held

    def extract(self, task: Task, text: str) -> str | None:
        return extract_math_answer(text)

    async def score(self, task: Task, text: str) -> Score:
        """The base score, plus metric distractor: 1 when the answer is another stated value."""
        out = await super().score(task, text)
        answer = extract_math_answer(text) if out.metrics.get("formatted") else None
        if answer is not None and normalize_answer(answer) in {normalize_answer(v) for v in task.data["distractors"]}:
            out = dataclasses.replace(out, metrics={**out.metrics, "distractor": 1.0})
        return out

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` the document and sentence that answer `</think>` the value in \\boxed{}."""
        d = task.data
        found = fact_sentence(d["attribute"], d["entity"], d["answer"])
        if found not in task.messages[-1]["content"]:
            raise ValueError(f"env {self.name} task {task.id}: the prompt does not state {found!r}")
        reasoning = f"The question asks for the {d['attribute']} of the {d['entity']}. Document {d['document']} " \
                    f"({d['title']}) says: \"{found}\""  # fmt: skip
        return [{"role": "assistant", "content": f"<think>{reasoning}</think>\\boxed{{{d['answer']}}}"}]
