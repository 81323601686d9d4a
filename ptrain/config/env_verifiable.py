"""Options of the verifiable single-turn kinds modelled on Nemotron 3 Nano's RL environments
(its `mcqa`, `instruction_following`, `structured_outputs_json` and long-context QA), scaled
down and generated locally from the seed: nothing is downloaded.

    envs:
      mcqa:
        kind: mcqa
        options: {min_choices: 4, max_choices: 10}
      instruction_following:
        kind: instruction_following
        options: {min_constraints: 1, max_constraints: 3}
      structured_output:
        kind: structured_output
        options: {min_properties: 2, max_properties: 6}
      long_context:
        kind: long_context
        options: {n_documents: 4, context_tokens: 8192}

The kinds live in ptrain/envs/mcqa.py, ptrain/envs/instruction_following.py,
ptrain/envs/structured_output.py and ptrain/envs/long_context.py. The vocabularies those
modules draw from (question families, constraint families and which of them contradict each
other, schema property names by type, fact attributes) are declared here, so that an option
naming something unknown, or asking for more than the vocabulary can give, is refused while
the config is validated.

Jax-free, like the rest of ptrain.config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from ptrain.config.env_options import EnvConfigError, register_options

MCQA_FAMILIES = ("arithmetic", "unit_conversion", "comparison", "prime", "letter_count", "alphabetical")
"""Generated multiple-choice question families: a sum, difference or product; a unit
conversion (km to m, hours to minutes, ...) either way; the largest or smallest of some
decimals; the one prime among composites; how often a letter occurs in a word; the word that
comes first in alphabetical order."""
MCQA_MAX_CHOICES = 10
"""Most options of a question (letters A to J)."""

IF_FAMILIES = (
    "word_count", "bullets", "keywords", "forbidden_word", "lowercase", "uppercase",
    "end_phrase", "quotation", "paragraphs", "first_word", "title", "no_commas",
)  # fmt: skip
"""IFEval-style constraint families (ptrain/envs/instruction_following.py checks each):
at least / at most N words; exactly N bullet points; include two keywords; never use a word;
all lowercase; all uppercase; end with an exact phrase; wrap the response in double quotes;
exactly N paragraphs separated by ***; start with a given word; a title in <<...>>; no commas."""
IF_CONFLICTS = frozenset(
    frozenset(pair)
    for pair in (
        ("lowercase", "uppercase"),  # contradict each other
        ("lowercase", "end_phrase"),  # the exact phrase has capitals
        ("uppercase", "end_phrase"),  # ... and lowercase letters
        ("quotation", "end_phrase"),  # the closing quote would follow the phrase
        ("quotation", "first_word"),  # the opening quote would precede the word
        ("quotation", "bullets"),  # the first bullet's line would start with the quote
        ("bullets", "paragraphs"),  # two layouts that fight over the response's shape
        ("first_word", "title"),  # a title usually comes first
    )
)
"""Pairs of IF_FAMILIES never given together in one prompt: one makes the other impossible or
unnatural."""

STRUCTURED_FIELDS: dict[str, tuple[str, ...]] = {
    "string": ("name", "city", "title", "email", "country", "sku"),
    "integer": ("age", "quantity", "year", "floor", "page_count"),
    "number": ("price", "rating", "weight_kg", "temperature_c"),
    "boolean": ("in_stock", "is_verified", "is_public", "has_parking"),
    "enum": ("color", "status", "priority", "size"),
    "array": ("tags", "languages", "ingredients"),
    "object": ("address", "dimensions", "owner", "location"),
}
"""Schema property names by type (ptrain/envs/structured_output.py generates each one's schema
and value): string, integer, number, boolean, a string enum, an array of strings, and an
object nested one level (its own properties all required, of the scalar types)."""
STRUCTURED_TYPES = tuple(STRUCTURED_FIELDS)
STRUCTURED_MAX_PROPERTIES = 10
"""Most top-level properties of a generated schema."""

LONG_CONTEXT_ATTRIBUTES = ("access code", "founding year", "registry number", "head keeper", "call sign")
"""Attributes of the made-up entities whose values the long_context documents state (a
4-digit code, a year, a 6-digit number, a person's name, a code like KR-417), one fact a
sentence: `The access code of the Vantor archive is 4817.`"""
LONG_CONTEXT_MAX_DOCUMENTS = 64
LONG_CONTEXT_MAX_FACTS = 8
LONG_CONTEXT_TOKENS = (256, 1 << 20)
"""Shortest and longest prompt (context_tokens) a long_context task is built to."""


def largest_compatible(families: list[str] | tuple[str, ...]) -> int:
    """The size of the largest set of `families` in which no two are in IF_CONFLICTS: the most
    constraints one prompt can carry."""
    fams = list(dict.fromkeys(families))
    for k in range(len(fams), 0, -1):
        for subset in combinations(fams, k):
            if all(frozenset(p) not in IF_CONFLICTS for p in combinations(subset, 2)):
                return k
    return 0


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise EnvConfigError(f"config key '{key}': {msg}")


def _check_names(values: list[str], key: str, allowed: tuple[str, ...]) -> None:
    _check(bool(values), key, f"pass at least one of {list(allowed)}")
    bad = [v for v in values if v not in allowed]
    _check(not bad, key, f"unknown name(s) {bad}; valid ones are {list(allowed)}")
    _check(len(set(values)) == len(values), key, f"names repeat in {list(values)}; list each once")


def _check_rewards(opts: Any, where: str) -> None:
    for name in ("format_reward", "correct_reward"):
        value = getattr(opts, name)
        _check(value >= 0, f"{where}.{name}", f"must be >= 0, got {value}")


@register_options("mcqa")
@dataclass
class McqaOptions:
    """Multiple-choice questions generated from the seed, 2 to 10 lettered options with exactly
    one right; the answer is the option's letter in \\boxed{} (Nano's MCQA default,
    strict_single_letter_boxed), e.g. `\\boxed{C}`."""

    families: list[str] = field(default_factory=lambda: list(MCQA_FAMILIES))
    """Question families drawn from, each equally likely (MCQA_FAMILIES above)."""
    min_choices: int = 4
    """Fewest options of a question (>= 2)."""
    max_choices: int = 10
    """Most options of a question (>= min_choices, <= 10: letters A to J)."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a completion whose last \\boxed{} holds one of the
    question's letters."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0) for the right letter."""

    def validate(self, where: str) -> None:
        _check_names(self.families, f"{where}.families", MCQA_FAMILIES)
        _check(
            2 <= self.min_choices <= self.max_choices <= MCQA_MAX_CHOICES,
            f"{where}.min_choices",
            f"need 2 <= min_choices <= max_choices <= {MCQA_MAX_CHOICES}, got {self.min_choices} and "
            f"{self.max_choices}",
        )
        _check_rewards(self, where)


@register_options("instruction_following")
@dataclass
class InstructionFollowingOptions:
    """IFEval-style prompts: a writing request plus constraints that code checks (strict mode:
    the response as written, nothing stripped but surrounding whitespace and a reasoning block
    closed by </think>). Reward `correct` = correct_reward times the fraction of the prompt's
    constraints the response meets; metric all_met is 1 when it meets every one."""

    families: list[str] = field(default_factory=lambda: list(IF_FAMILIES))
    """Constraint families drawn from (IF_FAMILIES above); pairs in IF_CONFLICTS never share a
    prompt."""
    min_constraints: int = 1
    """Fewest constraints of a prompt (>= 1)."""
    max_constraints: int = 3
    """Most constraints of a prompt (>= min_constraints, and no more than the largest set of
    `families` without a conflicting pair)."""
    max_answer_chars: int = 16000
    """Longer responses score 0 unchecked, as unformatted (>= 100; bounds the checks' work)."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a non-empty response of at most max_answer_chars."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0): correct_reward times the fraction of constraints met."""

    def validate(self, where: str) -> None:
        _check_names(self.families, f"{where}.families", IF_FAMILIES)
        _check(
            1 <= self.min_constraints <= self.max_constraints,
            f"{where}.min_constraints",
            f"need 1 <= min_constraints <= max_constraints, got {self.min_constraints} and {self.max_constraints}",
        )
        most = largest_compatible(self.families)
        _check(
            self.max_constraints <= most,
            f"{where}.max_constraints",
            f"families {self.families} give at most {most} constraint(s) that do not contradict each other "
            f"(IF_CONFLICTS); pass max_constraints <= {most} or more families",
        )
        _check(
            self.max_answer_chars >= 100, f"{where}.max_answer_chars", f"must be >= 100, got {self.max_answer_chars}"
        )
        _check_rewards(self, where)


@register_options("structured_output")
@dataclass
class StructuredOutputOptions:
    """A generated JSON schema and the values to put in it; the answer is a JSON object (bare or
    in a ```json block) that must validate against the schema exactly (types, required keys, no
    other keys, enum members, array item types) and carry the given values. Nano's
    structured-output reward is schema adherence only: format_reward 0 keeps it so."""

    types: list[str] = field(default_factory=lambda: list(STRUCTURED_TYPES))
    """Property types drawn from (STRUCTURED_TYPES: string, integer, number, boolean, enum,
    array of strings, object nested one level)."""
    min_properties: int = 2
    """Fewest top-level properties of a schema (>= 1)."""
    max_properties: int = 6
    """Most top-level properties (>= min_properties, <= 10, and no more than STRUCTURED_FIELDS
    names of the chosen types)."""
    optional_probability: float = 0.3
    """Chance (0 to 1) that a property is left out of `required`. Required properties always
    get a value in the prompt; an optional one gets one half the time (then it must appear
    with that value), else the answer may leave it out."""
    max_answer_chars: int = 4096
    """Longer answers are refused before parsing (>= 64; bounds the parser's work)."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for an answer that parses as a JSON object."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0) for an object that validates and has the given values."""

    def validate(self, where: str) -> None:
        _check_names(self.types, f"{where}.types", STRUCTURED_TYPES)
        _check(
            1 <= self.min_properties <= self.max_properties <= STRUCTURED_MAX_PROPERTIES,
            f"{where}.min_properties",
            f"need 1 <= min_properties <= max_properties <= {STRUCTURED_MAX_PROPERTIES}, got "
            f"{self.min_properties} and {self.max_properties}",
        )
        names = sum(len(STRUCTURED_FIELDS[t]) for t in self.types)
        _check(
            self.max_properties <= names,
            f"{where}.max_properties",
            f"types {self.types} have {names} property name(s); pass max_properties <= {names} or more types",
        )
        _check(
            0.0 <= self.optional_probability <= 1.0,
            f"{where}.optional_probability",
            f"must be between 0 and 1, got {self.optional_probability}",
        )
        _check(self.max_answer_chars >= 64, f"{where}.max_answer_chars", f"must be >= 64, got {self.max_answer_chars}")
        _check_rewards(self, where)


@register_options("long_context")
@dataclass
class LongContextOptions:
    """Long-context QA: a question over several generated documents whose answer is a fact
    stated in exactly one of them, the documents padded with filler to a prompt of
    context_tokens tokens; the answer goes in \\boxed{} (or <answer> tags), matched exactly
    after normalisation (case, surrounding space, a final period)."""

    n_documents: int = 4
    """Documents in each prompt (1 to 64)."""
    facts_per_document: int = 2
    """Facts stated in each document (1 to 8): each document states the asked attribute of one
    of its entities (the other documents' ones are the distractors); in the right document a
    second fact, when there is one, gives the asked entity's value of another attribute (with
    two or more attributes)."""
    context_tokens: int = 4096
    """Prompt length to build to, in the policy tokenizer's tokens with the chat template
    (256 to 1048576): filler sentences are added until one more would pass it."""
    needle_depth: Any = "random"
    """Where the answer's fact sits in the documents: a number from 0 (the start of the first
    document) to 1 (the end of the last), or "random" (uniform, drawn per task)."""
    attributes: list[str] = field(default_factory=lambda: list(LONG_CONTEXT_ATTRIBUTES))
    """Attributes asked about and stated (LONG_CONTEXT_ATTRIBUTES above)."""
    name_title: bool = False
    """The question names the document that holds the answer. False: the model must find it."""
    format_reward: float = 0.0
    """Reward component `format` (>= 0) for a completion with a final answer in \\boxed{} or
    <answer> tags."""
    correct_reward: float = 1.0
    """Reward component `correct` (>= 0) for the right value."""

    def validate(self, where: str) -> None:
        _check(
            1 <= self.n_documents <= LONG_CONTEXT_MAX_DOCUMENTS,
            f"{where}.n_documents",
            f"need 1 <= n_documents <= {LONG_CONTEXT_MAX_DOCUMENTS}, got {self.n_documents}",
        )
        _check(
            1 <= self.facts_per_document <= LONG_CONTEXT_MAX_FACTS,
            f"{where}.facts_per_document",
            f"need 1 <= facts_per_document <= {LONG_CONTEXT_MAX_FACTS}, got {self.facts_per_document}",
        )
        lo, hi = LONG_CONTEXT_TOKENS
        _check(
            lo <= self.context_tokens <= hi,
            f"{where}.context_tokens",
            f"must be between {lo} and {hi} (the prompt length in the policy's tokens), got {self.context_tokens}",
        )
        d = self.needle_depth
        number = isinstance(d, int | float) and not isinstance(d, bool)
        _check(
            d == "random" or (number and 0.0 <= d <= 1.0),
            f"{where}.needle_depth",
            f'pass "random" or a number from 0 (start of the first document) to 1 (end of the last), got {d!r}',
        )
        _check_names(self.attributes, f"{where}.attributes", LONG_CONTEXT_ATTRIBUTES)
        _check_rewards(self, where)
