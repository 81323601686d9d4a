"""The `judge` environment: RLHF rewards from a generative reward model that compares responses.

Nemotron 3 Nano's RLHF stage (arXiv 2512.20848 §3.3; NeMo Gym's genrm_compare) has no verifier:
a GenRM reads the conversation and two of the policy's responses and answers

    {"score_1": 4, "score_2": 2, "ranking": 2}

score_k: how helpful response k is, 1 (not at all) to 5 (very); ranking: 1 = response 1 is much
better, 2 = better, 3 = slightly better, 4 = response 2 is slightly better, 5 = better, 6 =
much better. A group's rewards need the whole group at once, which is what `rollout(task,
engine, sampling)` gets: the n = G samples of one prompt.

Circular comparison. The responses that can be judged (finish "stop", or "length" with
env.score_truncated) are compared in a circle, (0,1), (1,2) ... (G-1,0): G judge calls instead
of G(G-1)/2, each response in two of them, once as response 1 and once as response 2 (which
evens out the judge's position bias). Two responses give (0,1) and (1,0). The judge sees the
answer only (the text after </think>), cut to options.judge_max_response_chars.

A reply parses when the text after its last </think> holds a flat JSON object with all three
keys, numbers, score_k in [1, 5] and ranking in [1, 6] (the last such object counts). One that
does not (prose, a cut-off verdict, a score of 7) is a tie, score 3 each and ranking 3.5, and
counts in metric judge_parse_failures.

Aggregation (simple_tiebreaker). In comparison (i, j) with verdict (s1, s2, r): if s1 == s2,
the ranking breaks the tie,

    d = tie_break * (3.5 - r) / 2.5;   s1 += d;   s2 -= d

(r = 1 moves the full options.tie_break to response i, r = 6 to response j; NeMo Gym moves
3.5 - r, i.e. tie_break 2.5). Unequal scores stand as they are. A response's score is the mean
of its (adjusted) scores over its comparisons, and the `judge` reward component is that score,
mapped to [0, 1] as (score - 1) / 4 with options.rescale (else the raw 1-5 score). A response
that is the only judgeable one of its group has nothing to be compared with: it gets the
neutral 3 (0.5 rescaled) and metric unjudged 1.

Group-Relative Length Control (Nano's; every coefficient 0 by default, as Nano ships it). Each
response is split into reasoning (inside <think>...</think>) and answer (after the last
</think>), lengths in characters. Over the judged responses J of a group (|J| >= 2), for each
of the two lengths L with coefficient c (options.reasoning_length_penalty,
options.answer_length_penalty):

    x_i = (L_i - min_J L) / (max_J L - min_J L)        (0 for all when the lengths are equal)
    length_penalty_i = -c * (x_i - mean_J x)

which is zero-centred (it sums to 0 over J), bounded by c, and favours the shorter (Nano's
min-max form; NeMo Gym's genrm_compare computes the same weights). The component
`length_penalty` is the reasoning term plus the answer term. The quality-gated conciseness
bonus: with k = max(1, floor(top_percentile * |J|)) and the gate q* = the k-th highest `judge`
component in J, the responses with judge >= q* and a non-empty reasoning whose reasoning is
the shortest among them get options.reasoning_bonus (all of them on a tie of lengths), and
likewise for the answer and options.answer_bonus; component `conciseness_bonus` is their sum.
A short answer of low quality never gets a bonus.

    reward = judge + length_penalty + conciseness_bonus

The judge (options.judge): `policy` asks the engine the rollout got (a GenerateRequest of the
judge prompt rendered by the policy tokenizer's chat template, rid "<rollout rid>/judge-i-j",
the judge's own sampling options); `openai` posts to an OpenAI-compatible
/v1/chat/completions (options.judge_url and judge_model; httpx with the options' timeouts and
retries), which `python -m ptrain.serve` speaks, so any ptrain model can judge. A judge call
that fails (the endpoint unreachable or too slow after its retries, an error status, a body
that is no chat completion, the engine refusing or aborting the request) makes both of its
responses env errors: finish_reason "error", `Trajectory.error` saying which call and why,
reward 0, and no loss tokens (the tokens stay for the audit log; a reward that is no judgement
must not train). The group's other responses keep their comparisons, and length control runs
over them.

`reward_model` scores each judgeable response on its own with a Bradley-Terry reward model
(options.reward_model_path: what a stage of kind rm exports; ptrain/envs/reward_model.py): the
prompt and the whole response, reasoning included, as one conversation, the way the rm stage
trains on preference pairs. One call per response, no comparisons and no tie-breaks; the
`judge` component is the model's score, through the logistic function with options.rescale
(sigmoid(score), in [0, 1]) or raw. Length control is the same. A scoring failure makes the
group's judged responses env errors, as a failed judge call does.

A sample cut by max_new_tokens is not judged unless env.score_truncated (reward 0, metric
truncated 1); an aborted one never (reward 0, metric aborted 1). Metrics of every trajectory:
judge_calls and judge_parse_failures (the calls whose pair starts with this response: one per
response in a full circle, so their sums are the group's calls and failures), tie_breaks
(likewise, the calls decided by the ranking), reasoning_chars, answer_chars, unjudged,
truncated, aborted.

Tasks are chat prompts: JSONL rows (options.path, eval_path) of {"messages": [...]} or
{"prompt": str}, or, without a path, open-ended requests generated from the seed (explain a
term, write about a topic, give tips, tell two things apart, answer a simple question, rewrite
a sentence), so the kind runs without downloads. There is no demonstration: the kind has no
reference answers to write SFT rows from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import re
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ptrain.config.env_options import EnvConfigError
from ptrain.envs.base import Task, Trajectory
from ptrain.envs.single_turn import Score, SingleTurnEnv, draw_distinct
from ptrain.rollout.protocol import EngineUnavailable, GenerateRequest, RequestError, Sample, SamplingParams

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NEUTRAL_SCORE = 3.0
"""Score of each side of an unparsable verdict, and of a response with nothing to compare with."""
RANKING_MIDPOINT = 3.5
"""The ranking that prefers neither response (between 3, response 1 slightly better, and 4)."""
MAX_VERDICT_CHARS = 20000
"""Characters of a judge reply's tail searched for the verdict (bounds the parser's work)."""
METRICS = (
    "judge_calls", "judge_parse_failures", "tie_breaks", "reasoning_chars", "answer_chars", "unjudged",
    "truncated", "aborted",
)  # fmt: skip
"""Metrics every episode of this kind reports (module docstring)."""
CHAT_ROLES = ("system", "user", "assistant")


# ----------------------------------------------------------------------------- the judge's answer


@dataclass(frozen=True)
class Verdict:
    """One parsed judge answer (module docstring: the scales)."""

    score_1: float
    score_2: float
    ranking: float


@dataclass(frozen=True)
class Comparison:
    """One judge call: the pair (i, j) of sample indices, and its verdict (None: the reply did
    not parse, a tie) or why the call failed."""

    i: int
    j: int
    verdict: Verdict | None = None
    error: str | None = None


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a response, both stripped: the reasoning is what precedes the last
    </think> (its <think> tags removed), the answer what follows it. No </think>: a response
    that opens with <think> is all (unfinished) reasoning, any other all answer."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        reasoning = text[:close].replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
        return reasoning.strip(), text[close + len(THINK_CLOSE) :].strip()
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN) :].strip(), ""
    return "", text.strip()


def _number(value: Any, lo: float, hi: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and lo <= value <= hi else None


def parse_verdict(text: str) -> Verdict | None:
    """The verdict in a judge reply, or None when there is none (module docstring)."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        text = text[close + len(THINK_CLOSE) :]
    elif text.lstrip().startswith(THINK_OPEN):
        return None  # cut off while reasoning
    text = text[-MAX_VERDICT_CHARS:]
    for match in reversed(list(re.finditer(r"\{[^{}]*\}", text))):
        try:
            obj = json.loads(match.group(0))
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        s1 = _number(obj.get("score_1"), 1, 5)
        s2 = _number(obj.get("score_2"), 1, 5)
        r = _number(obj.get("ranking"), 1, 6)
        if s1 is not None and s2 is not None and r is not None:
            return Verdict(s1, s2, r)
    return None


# ----------------------------------------------------------------------------- aggregation, length control


def circular_pairs(n: int) -> list[tuple[int, int]]:
    """(0,1), (1,2) ... (n-1,0): n pairs for n >= 2, none for fewer."""
    return [(k, (k + 1) % n) for k in range(n)] if n >= 2 else []


def aggregate(n: int, comparisons: Sequence[Comparison], tie_break: float) -> tuple[list[float | None], list[int]]:
    """simple_tiebreaker over n responses (module docstring): each response's mean score over
    the comparisons it is in (None: in none), and per response the tie-breaks of the
    comparisons whose pair starts with it. Comparisons with an error are left out."""
    sums, counts, tie_breaks = [0.0] * n, [0] * n, [0] * n
    for c in comparisons:
        if c.error is not None:
            continue
        v = c.verdict or Verdict(NEUTRAL_SCORE, NEUTRAL_SCORE, RANKING_MIDPOINT)
        s1, s2 = v.score_1, v.score_2
        d = tie_break * (RANKING_MIDPOINT - v.ranking) / (RANKING_MIDPOINT - 1) if s1 == s2 else 0.0
        if d:
            s1, s2 = s1 + d, s2 - d
            tie_breaks[c.i] += 1
        sums[c.i] += s1
        sums[c.j] += s2
        counts[c.i] += 1
        counts[c.j] += 1
    return [s / k if k else None for s, k in zip(sums, counts)], tie_breaks


def length_penalties(lengths: Sequence[int], coeff: float) -> list[float]:
    """-coeff * (x_i - mean x), x the min-max normalised lengths: zero-centred, shorter gains
    (module docstring). All 0 with coeff 0, fewer than two lengths, or equal lengths."""
    n = len(lengths)
    lo, hi = (min(lengths), max(lengths)) if n else (0, 0)
    if coeff == 0 or n < 2 or hi == lo:
        return [0.0] * n
    x = [(length - lo) / (hi - lo) for length in lengths]
    mean = sum(x) / n
    return [-coeff * (xi - mean) for xi in x]


def conciseness_bonus(
    quality: Sequence[float], lengths: Sequence[int], bonus: float, top_percentile: float
) -> list[float]:
    """`bonus` for the responses that pass the quality gate (judge >= the k-th highest,
    k = max(1, floor(top_percentile * n))) and have the shortest non-empty length among those
    that pass; 0 for the others (module docstring). All 0 with bonus 0 or fewer than two."""
    n = len(quality)
    if bonus == 0 or n < 2:
        return [0.0] * n
    k = max(1, math.floor(top_percentile * n + 1e-9))
    gate = sorted(quality, reverse=True)[k - 1]
    eligible = [i for i in range(n) if quality[i] >= gate and lengths[i] > 0]
    if not eligible:
        return [0.0] * n
    shortest = min(lengths[i] for i in eligible)
    return [bonus if i in eligible and lengths[i] == shortest else 0.0 for i in range(n)]


# ----------------------------------------------------------------------------- the judge's prompt


def _shown(answer: str, max_chars: int) -> str:
    if not answer:
        return "(empty response)"
    if len(answer) <= max_chars:
        return answer
    return f"{answer[:max_chars]}\n[... cut here: {len(answer) - max_chars} more characters]"


def judge_prompt(messages: Sequence[Mapping[str, Any]], answer_1: str, answer_2: str, max_chars: int) -> str:
    """The judge's instructions for one comparison: the conversation so far, the two answers
    (each cut to max_chars), the two scales, and the JSON to answer with."""
    conversation = "\n\n".join(f"[{m.get('role', 'user')}]\n{m.get('content', '')}" for m in messages)
    return (
        "You are judging two candidate replies from an AI assistant to the same conversation. Decide how "
        "helpful each one is to the user: is it correct, does it address what was asked, is it complete "
        "where it needs to be, clear, and free of padding?\n\n"
        f"<conversation>\n{conversation}\n</conversation>\n\n"
        f"<response_1>\n{_shown(answer_1, max_chars)}\n</response_1>\n\n"
        f"<response_2>\n{_shown(answer_2, max_chars)}\n</response_2>\n\n"
        "Give each reply a helpfulness score from 1 (not helpful at all) to 5 (as helpful as it could be). "
        "Then rank the two with a number from 1 to 6:\n"
        "1 = reply 1 is much better than reply 2\n"
        "2 = reply 1 is better than reply 2\n"
        "3 = reply 1 is slightly better than reply 2\n"
        "4 = reply 2 is slightly better than reply 1\n"
        "5 = reply 2 is better than reply 1\n"
        "6 = reply 2 is much better than reply 1\n\n"
        "Answer with this JSON object and nothing else:\n"
        '{"score_1": <1-5>, "score_2": <1-5>, "ranking": <1-6>}'
    )


# ----------------------------------------------------------------------------- generated prompts

_AUDIENCES = ("", " to a ten-year-old", " to someone new to the subject", " to a busy manager")
_LENGTHS = ("in one sentence", "in two or three sentences", "in under fifty words", "in a short paragraph")
_TERMS = (
    "photosynthesis", "inflation", "a hash table", "gravity", "compound interest", "machine learning",
    "the water cycle", "a black hole", "recursion", "an API", "how vaccines work", "plate tectonics",
    "supply and demand", "encryption", "a neural network", "the greenhouse effect", "DNA", "an index fund",
    "entropy", "a compiler", "osmosis", "a recession", "a prime number", "the immune system", "version control",
    "an electric circuit", "natural selection", "a database index", "opportunity cost", "a placebo",
)  # fmt: skip
_TOPICS = (
    "the ocean at night", "a busy train station", "autumn leaves", "a first day at a new job", "an old library",
    "a thunderstorm", "a mountain village", "a bakery at dawn", "a city after rain", "a quiet lake",
    "a crowded market", "the first snowfall", "a long road trip", "a garden in spring", "an empty stadium",
    "a lighthouse", "a summer festival", "a desert at noon", "a child learning to ride a bike", "a ferry crossing",
)  # fmt: skip
_FORMS = ("one sentence", "two sentences", "a short paragraph", "a four-line poem")
_FOR_WHOM = ("", " for a travel magazine", " for a children's book", " for a friend's postcard")
_ACTIVITIES = (
    "learning a new language", "sleeping better", "saving money each month", "starting to run",
    "keeping houseplants alive", "writing clearer emails", "studying for an exam", "cooking on a weeknight",
    "preparing for a job interview", "reducing screen time", "organising a small desk", "giving a short talk",
    "staying focused while working from home", "traveling with only a carry-on", "learning to touch type",
    "making new friends in a new city", "drinking more water", "keeping a journal", "learning to draw",
    "planning a birthday party",
)  # fmt: skip
_TIP_COUNTS = ("two", "three", "four", "five")
_TIP_FOR = ("", " for a complete beginner", " on a tight budget")
_PAIRS = (
    ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("a loan", "a grant"),
    ("RAM", "storage"), ("a simile", "a metaphor"), ("an alligator", "a crocodile"), ("baking soda", "baking powder"),
    ("a democracy", "a republic"), ("an emulsion", "a solution"), ("a comet", "an asteroid"),
    ("a stock", "a bond"), ("latitude", "longitude"), ("empathy", "sympathy"), ("a lake", "a pond"),
    ("a font", "a typeface"), ("mass", "weight"), ("a hurricane", "a tornado"), ("a list", "a set in Python"),
    ("affect", "effect"),
)  # fmt: skip
_QUESTIONS = (
    "Why is the sky blue?", "Why do we have seasons?", "How do airplanes stay in the air?",
    "Why does ice float on water?", "What causes the tides?", "Why do cats purr?",
    "How does a refrigerator keep food cold?", "Why do onions make people cry?", "What makes a rainbow?",
    "Why do leaves change color in autumn?", "How do bees make honey?", "Why is the ocean salty?",
    "How does a compass work?", "Why do we yawn?", "What is the tallest mountain on Earth?",
    "How long does light from the Sun take to reach Earth?", "Why does bread rise?",
    "How do noise-cancelling headphones work?", "Why do stars twinkle?", "What is a leap year for?",
    "Why do we dream?", "How does soap clean things?", "Why do boats float?", "What makes thunder?",
    "How do birds know where to migrate?", "Why is the Moon sometimes visible during the day?",
    "How do touch screens sense a finger?", "Why do people get hiccups?", "How is glass made?",
    "Why does metal feel colder than wood?",
)  # fmt: skip
_QUESTION_ASKS = ("", " Keep it short.", " Explain your reasoning briefly.")
_SENTENCES = (
    "The meeting that was scheduled for the purpose of discussing the budget has been moved to a later time.",
    "Due to the fact that it was raining, the game was not played by the teams.",
    "In my personal opinion I think that the new policy is not a very good idea at all.",
    "The report it was written by the team and it has many errors in it that need fixing.",
    "At this point in time we are not able to offer a refund to customers.",
    "The dog that belongs to my neighbor barks very loudly at basically every single car.",
    "It is important to note that the deadline is on Friday and cannot be changed.",
    "She made the decision to go ahead and start the project without waiting.",
    "There are many people who think that the city should build more bike lanes.",
    "The results of the experiment were analyzed by the researchers in a careful way.",
    "We would like to take this opportunity to thank you for your patience.",
    "Our product is the best product on the market because it is better than the others.",
    "The train was late which meant that I was late and so the meeting started late.",
    "He has a tendency to forget things that he has been told.",
    "Please be advised that the office will be closed on the holiday.",
)  # fmt: skip
_STYLES = ("clearer", "more formal", "friendlier", "shorter")


def draw_request(rng: random.Random, family: str) -> str:
    """One generated request of `family` (JUDGE_FAMILIES in ptrain.config.env_judge)."""
    if family == "explain":
        return f"Explain {rng.choice(_TERMS)}{rng.choice(_AUDIENCES)}, {rng.choice(_LENGTHS)}."
    if family == "describe":
        return f"Write {rng.choice(_FORMS)} about {rng.choice(_TOPICS)}{rng.choice(_FOR_WHOM)}."
    if family == "advice":
        return f"Give {rng.choice(_TIP_COUNTS)} practical tips for {rng.choice(_ACTIVITIES)}{rng.choice(_TIP_FOR)}."
    if family == "compare":
        a, b = rng.choice(_PAIRS)
        return f"What is the difference between {a} and {b}? Answer {rng.choice(_LENGTHS)}."
    if family == "question":
        return f"{rng.choice(_QUESTIONS)}{rng.choice(_QUESTION_ASKS)}"
    if family == "rewrite":
        return f'Rewrite this sentence to make it {rng.choice(_STYLES)}: "{rng.choice(_SENTENCES)}"'
    raise ValueError(f"unknown judge request family {family!r}")


def _row_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a prompt row, or None (rows: {"messages": [...]} or {"prompt": str})."""
    if ("messages" in row) == ("prompt" in row):
        return 'each row needs exactly one of "messages" (a chat) and "prompt" (a string)'
    if "prompt" in row:
        ok = isinstance(row["prompt"], str) and row["prompt"].strip()
        return None if ok else f'"prompt" must be a non-empty string, got {row["prompt"]!r:.80}'
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return f'"messages" must be a non-empty list of {{"role", "content"}} objects, got {messages!r:.80}'
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            return f'"messages"[{k}] must be {{"role": one of {list(CHAT_ROLES)}, "content": str}}, got {m!r:.80}'
    if messages[-1]["role"] != "user":
        return '"messages" must end with a user turn (the one the policy answers)'
    return None


def _row_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    if "prompt" in row:
        return [{"role": "user", "content": row["prompt"]}]
    return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]


# ----------------------------------------------------------------------------- the environment


class JudgeError(RuntimeError):
    """A judge call that gave no verdict to parse; the message names the call and the cause."""


def _finish(sample: Sample) -> str:
    return sample.finish_reason.type if sample.finish_reason is not None else "abort"


def _excerpt(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit]}..."


class JudgeEnv(SingleTurnEnv):
    """Chat prompts whose samples a GenRM compares circularly (module docstring)."""

    kind: ClassVar[str] = "judge"
    component_names: ClassVar[tuple[str, ...]] = ("judge", "length_penalty", "conciseness_bonus")  # type: ignore[assignment]
    extra_metrics: ClassVar[tuple[str, ...]] = METRICS

    def __init__(self, cfg: Any, options: Any, *, tokenizer: Any, sandbox: Any = None, runner: Any = None):
        super().__init__(cfg, options, tokenizer=tokenizer, sandbox=sandbox, runner=runner)
        self.stats.update({"judge_calls": 0, "judge_parse_failures": 0, "judge_errors": 0})
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.endpoint: str | None = None
        """The judge's POST URL (judge openai)."""
        self._headers: dict[str, str] = {"content-type": "application/json"}
        self.scorer: Any = None
        """The reward model (judge reward_model): a RewardModelScorer."""
        self.stats["reward_model_cut"] = 0
        if options.judge == "reward_model":
            from ptrain.envs.reward_model import RewardModelScorer

            self.scorer = RewardModelScorer(
                options.reward_model_path,
                tokenizer,
                max_tokens=options.reward_model_max_tokens,
                what=f"envs.{self.name}.options.reward_model_path",
            )
        if options.judge == "openai":
            base = options.judge_url.rstrip("/")
            self.endpoint = f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"
            var = options.judge_api_key_env
            if var is not None:
                key = os.environ.get(var)
                if not key:
                    raise EnvConfigError(
                        f"config key 'envs.{self.name}.options.judge_api_key_env': environment variable {var} is not "
                        "set or empty; export it with the judge endpoint's API key, or set judge_api_key_env: null"
                    )
                self._headers["authorization"] = f"Bearer {key}"

    # ------------------------------------------------------------------ tasks

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        if o.path is not None:
            train_rows, held_rows = self.row_splits(o.path, o.eval_path, (), _row_problem)
            return (
                [self.task("train", i, _row_messages(r), {}) for i, r in enumerate(train_rows)],
                [self.task("eval", i, _row_messages(r), {}) for i, r in enumerate(held_rows)],
            )
        rng = random.Random(seed)
        need = self.cfg.n_train + self.cfg.n_eval

        def draw() -> tuple[str, str]:
            family = rng.choice(o.families)
            return family, draw_request(rng, family)

        drawn = draw_distinct(
            draw,
            lambda d: d[1],
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct requests of families {o.families}; add "
                "families, lower n_train / n_eval, or pass options.path"
            ),
        )

        def make(split: str, requests: list[tuple[str, str]]) -> list[Task]:
            return [self.task(split, i, self.user(text), {"family": fam}) for i, (fam, text) in enumerate(requests)]

        return make("train", drawn[self.cfg.n_eval :]), make("eval", drawn[: self.cfg.n_eval])

    def extract(self, task: Task, text: str) -> str | None:
        """The answer the judge reads (after </think>), or None when it is empty."""
        return split_reasoning(text)[1] or None

    def unscored(self, **metrics: float) -> Score:
        """A zero score with every metric of this kind 0 except those given."""
        base = {k: 0.0 for k in METRICS}
        base.update({k: float(v) for k, v in metrics.items()})
        return Score(0.0, {c: 0.0 for c in self.component_names}, base)

    # ------------------------------------------------------------------ rollout

    async def rollout(self, task: Task, engine: Any, sampling: SamplingParams) -> list[Trajectory]:
        """`sampling.n` trajectories of `task`, rewarded by circular judge comparisons (Environment.rollout)."""
        prompt = self.prompt_ids(task)
        sampling = self.sampling_for(sampling)
        rid = self._rid(task)
        start = time.monotonic()
        try:
            try:
                future = engine.submit(GenerateRequest(prompt, sampling, rid=rid))
            except RequestError as e:
                self.stats["errors"] += sampling.n
                return [self._error(task, j, prompt, str(e)) for j in range(sampling.n)]
            try:
                samples = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                engine.abort(rid)
                raise
            wall = time.monotonic() - start
            texts = [self.tokenizer.decode(list(s.output_ids), skip_special_tokens=True) for s in samples]
            scores, errors = await self._judge_group(task, engine, samples, texts, rid, sampling.sampling_seed)
        finally:
            self._release(task)
        self.stats["episodes"] += len(samples)
        out = []
        for s, text, score, error in zip(samples, texts, scores, errors):
            t = self._trajectory(task, s, text, score, wall)
            if error is not None:
                n = len(t.token_ids)
                t = dataclasses.replace(t, finish_reason="error", error=error, loss_mask=(0,) * n, logprobs=(0.0,) * n)
            out.append(t)
        return out

    async def _judge_group(
        self, task: Task, engine: Any, samples: Sequence[Sample], texts: Sequence[str], rid: str, seed: int | None
    ) -> tuple[list[Score], list[str | None]]:
        """Per sample: its Score, and why it is an env error (None: it is not)."""
        o = self.options
        n = len(samples)
        parts = [split_reasoning(t) for t in texts]
        finishes = [_finish(s) for s in samples]
        self.stats["truncated"] += finishes.count("length")
        judged = [j for j, f in enumerate(finishes) if f == "stop" or (f == "length" and self.cfg.score_truncated)]
        errors: list[str | None] = [None] * n
        calls, failures, tie_breaks = [0] * n, [0] * n, [0] * n
        if self.scorer is not None:
            # An empty answer is never scored: the rm stage's pairs hold none, so the model has
            # no score for one worth trusting (it gets the unjudged reward 0).
            judged = [j for j in judged if parts[j][1]]
            means = await self._reward_model_scores(task, judged, texts, errors)
            for j in judged:
                calls[j] = 1
            self.stats["judge_calls"] += len(judged)
        else:
            pairs = [(judged[a], judged[b]) for a, b in circular_pairs(len(judged))]
            comparisons = await self._compare_all(task, engine, pairs, [a for _, a in parts], rid, seed)
            for c in comparisons:
                calls[c.i] += 1
                if c.error is not None:
                    for k in (c.i, c.j):
                        errors[k] = errors[k] or c.error
                elif c.verdict is None:
                    failures[c.i] += 1
            self.stats["judge_calls"] += len(comparisons)
            self.stats["judge_parse_failures"] += sum(failures)
            means, tie_breaks = aggregate(n, comparisons, o.tie_break)
        self.stats["errors"] += sum(e is not None for e in errors)

        scored = [j for j in judged if errors[j] is None]
        raw = {j: NEUTRAL_SCORE if means[j] is None else means[j] for j in scored}
        quality = [self._rescaled(raw[j]) if o.rescale else raw[j] for j in scored]
        reasoning_len = [len(parts[j][0]) for j in scored]
        answer_len = [len(parts[j][1]) for j in scored]
        penalty = [
            r + a
            for r, a in zip(
                length_penalties(reasoning_len, o.reasoning_length_penalty),
                length_penalties(answer_len, o.answer_length_penalty),
            )
        ]
        bonus = [
            r + a
            for r, a in zip(
                conciseness_bonus(quality, reasoning_len, o.reasoning_bonus, o.top_percentile),
                conciseness_bonus(quality, answer_len, o.answer_bonus, o.top_percentile),
            )
        ]
        terms = {j: (quality[k], penalty[k], bonus[k]) for k, j in enumerate(scored)}

        scores = []
        for j in range(n):
            metrics = {
                "judge_calls": calls[j],
                "judge_parse_failures": failures[j],
                "tie_breaks": tie_breaks[j],
                "reasoning_chars": len(parts[j][0]),
                "answer_chars": len(parts[j][1]),
                "truncated": float(finishes[j] == "length"),
                "aborted": float(finishes[j] == "abort"),
            }
            if j not in terms:
                scores.append(self.unscored(**metrics))
                continue
            judge, pen, bon = terms[j]
            components = dict(zip(self.component_names, (judge, pen, bon)))
            metrics["unjudged"] = float(means[j] is None)
            scores.append(Score(judge + pen + bon, components, self.unscored(**metrics).metrics))
        return scores, errors

    def _rescaled(self, score: float) -> float:
        """A judge score on [0, 1]: a GenRM's 1-5 score as (score - 1) / 4; a reward model's
        logit through the logistic function (its Bradley-Terry odds against a score of 0)."""
        if self.scorer is not None:
            from ptrain.envs.reward_model import logistic

            return logistic(score)
        return (score - 1.0) / 4.0

    async def _reward_model_scores(
        self, task: Task, judged: Sequence[int], texts: Sequence[str], errors: list[str | None]
    ) -> list[float | None]:
        """The reward model's score of each judged response (None for the others). The model
        reads the whole response, reasoning included, as the rm stage trained it. A failure
        makes every judged response of the group an env error (in `errors`)."""
        out: list[float | None] = [None] * len(texts)
        if not judged:
            return out
        try:
            rows = [self.scorer.response_tokens(task.messages, texts[j]) for j in judged]
            self.stats["reward_model_cut"] += sum(cut for _, cut in rows)
            async with self._gate():
                scores = await asyncio.to_thread(self.scorer.scores, [ids for ids, _ in rows])
        except Exception as e:  # noqa: BLE001 - a failed scoring fails this group's responses, not the batch
            log.exception("env %s task %s: the reward model failed", self.name, task.id)
            message = f"the reward model ({self.options.reward_model_path}) failed: {type(e).__name__}: {str(e)[:300]}"
            self.stats["judge_errors"] += 1
            for j in judged:
                errors[j] = message
            return out
        for j, value in zip(judged, scores):
            out[j] = value
        return out

    # ------------------------------------------------------------------ judge calls

    def _gate(self) -> asyncio.Semaphore:
        """This event loop's limit on judge calls in flight (options.judge_concurrency)."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.options.judge_concurrency)
        return gate

    async def _compare_all(
        self,
        task: Task,
        engine: Any,
        pairs: Sequence[tuple[int, int]],
        answers: Sequence[str],
        rid: str,
        seed: int | None,
    ) -> list[Comparison]:
        if not pairs:
            return []
        o = self.options

        async def one(k: int, i: int, j: int, client: Any) -> Comparison:
            text = judge_prompt(task.messages, answers[i], answers[j], o.judge_max_response_chars)
            judge_rid = f"{rid}/judge-{i}-{j}"
            try:
                async with self._gate():
                    if client is None:
                        pair_seed = None if seed is None else (seed * 1_000_003 + 7_919 * (k + 1)) % (2**31 - 1)
                        reply = await self._ask_engine(engine, text, judge_rid, pair_seed)
                    else:
                        reply = await self._ask_endpoint(client, text)
            except (asyncio.CancelledError, EngineUnavailable):
                raise  # the stage's to handle: nothing can sample, or the rollout was cancelled
            except JudgeError as e:
                return self._failed_call(task, i, j, str(e))
            except Exception as e:  # noqa: BLE001 - what no check foresaw fails this comparison, not the batch
                log.exception("env %s task %s: judge call %d-%d failed", self.name, task.id, i, j)
                return self._failed_call(task, i, j, f"failed unexpectedly ({type(e).__name__}: {str(e)[:300]})")
            verdict = parse_verdict(reply)
            if verdict is None:
                log.debug("env %s task %s: judge reply %d-%d has no verdict: %s", self.name, task.id, i, j,
                          _excerpt(reply))  # fmt: skip
            return Comparison(i, j, verdict)

        if o.judge == "openai":
            import httpx

            timeout = httpx.Timeout(o.judge_timeout_s, connect=o.judge_connect_timeout_s)
            async with httpx.AsyncClient(timeout=timeout, headers=self._headers) as client:
                return list(await asyncio.gather(*(one(k, i, j, client) for k, (i, j) in enumerate(pairs))))
        return list(await asyncio.gather(*(one(k, i, j, None) for k, (i, j) in enumerate(pairs))))

    async def calibrate(self, rows: Sequence[Mapping[str, Any]], engine: Any, seed: int = 0) -> dict[str, float]:
        """How often this environment's judge prefers the response a calibration row marks
        better: each row `{"messages": [...], "response_1": str, "response_2": str, "better":
        1 or 2}` is one comparison as training makes them (ranking 1-3: response 1 is better).
        A tie, a reply without a verdict or a failed call counts as a miss. Returns agreement,
        rows and unparsed (replies without a verdict)."""
        right = unparsed = 0
        if self.scorer is not None:  # each response scored on its own; a tie picks neither
            for row in rows:
                answers = [str(row["response_1"]), str(row["response_2"])]
                ids = [self.scorer.response_tokens(list(row["messages"]), a)[0] for a in answers]
                s1, s2 = await asyncio.to_thread(self.scorer.scores, ids)
                if s1 != s2:
                    right += (1 if s1 > s2 else 2) == int(row["better"])
            n = max(len(rows), 1)
            return {"agreement": right / n, "rows": float(len(rows)), "unparsed": 0.0}
        for k, row in enumerate(rows):
            task = Task(self.name, f"calibration-{k}", tuple(row["messages"]))
            answers = [str(row["response_1"]), str(row["response_2"])]
            (c,) = await self._compare_all(task, engine, [(0, 1)], answers, f"{self.name}/calibration-{k}", seed + k)
            if c.verdict is None:
                unparsed += 1
                continue
            if c.verdict.ranking != RANKING_MIDPOINT:  # a tie picks neither
                right += (1 if c.verdict.ranking < RANKING_MIDPOINT else 2) == int(row["better"])
        n = max(len(rows), 1)
        return {"agreement": right / n, "rows": float(len(rows)), "unparsed": float(unparsed)}

    def _failed_call(self, task: Task, i: int, j: int, why: str) -> Comparison:
        self.stats["judge_errors"] += 1
        message = f"the judge's comparison of samples {i} and {j} failed: {why}"
        log.warning("env %s task %s: %s", self.name, task.id, message)
        return Comparison(i, j, error=message)

    def judge_prompt_ids(self, text: str) -> tuple[int, ...]:
        """The judge prompt as one user turn, rendered by the policy tokenizer's chat template."""
        out = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **self.options.judge_chat_template_kwargs,
        )
        return tuple(int(i) for i in out["input_ids"])

    async def _ask_engine(self, engine: Any, text: str, rid: str, seed: int | None) -> str:
        """The policy engine's reply to the judge prompt (judge policy)."""
        o = self.options
        sampling = SamplingParams(
            max_new_tokens=o.judge_max_new_tokens,
            temperature=o.judge_temperature,
            top_p=o.judge_top_p,
            stop_token_ids=self.stop_token_ids,
            sampling_seed=seed,
        )
        try:
            future = engine.submit(GenerateRequest(self.judge_prompt_ids(text), sampling, rid=rid))
        except RequestError as e:
            raise JudgeError(f"the engine refused judge request {rid!r}: {e}") from None
        try:
            (sample,) = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            engine.abort(rid)
            raise
        if _finish(sample) == "abort":
            message = sample.finish_reason.message if sample.finish_reason is not None else None
            raise JudgeError(f"the engine aborted judge request {rid!r} ({message or 'no reason given'})")
        return self.tokenizer.decode(list(sample.output_ids), skip_special_tokens=True)

    async def _ask_endpoint(self, client: Any, text: str) -> str:
        """The endpoint's reply to the judge prompt (judge openai), with options.judge_retries."""
        import httpx

        o = self.options
        body: dict[str, Any] = {
            "model": o.judge_model,
            "messages": [{"role": "user", "content": text}],
            "temperature": o.judge_temperature,
            "top_p": o.judge_top_p,
            "max_tokens": o.judge_max_new_tokens,
            "n": 1,
        }
        if o.judge_chat_template_kwargs:
            body["chat_template_kwargs"] = dict(o.judge_chat_template_kwargs)
        where = f"POST {self.endpoint}"
        fix = f"check that the judge server is up, or fix envs.{self.name}.options.judge_url"
        problem = ""
        for attempt in range(o.judge_retries + 1):
            if attempt:
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            try:
                response = await client.post(self.endpoint, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                problem = f"the judge endpoint is unreachable ({type(e).__name__}: {e})"
                continue
            except httpx.TimeoutException:
                problem = f"no answer within {o.judge_timeout_s:g} s (options.judge_timeout_s)"
                continue
            except httpx.HTTPError as e:
                problem = f"the request failed ({type(e).__name__}: {e})"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                problem = f"answered {response.status_code}: {_excerpt(response.text)}"
                continue
            if not 200 <= response.status_code < 300:
                raise JudgeError(
                    f"{where} answered {response.status_code}: {_excerpt(response.text)}; check "
                    f"envs.{self.name}.options.judge_model and the judge sampling options"
                )
            try:
                content = response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise JudgeError(
                    f"{where} answered {response.status_code} with a body that is not an OpenAI chat completion "
                    f"({type(e).__name__}: {e}): {_excerpt(response.text)}"
                ) from None
            if content is not None and not isinstance(content, str):
                raise JudgeError(f"{where}: choices[0].message.content is a {type(content).__name__}, not text")
            return content or ""
        raise JudgeError(f"{where}: {problem} ({o.judge_retries + 1} attempt(s)); {fix}")
