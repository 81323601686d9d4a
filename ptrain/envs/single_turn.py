"""Single-turn environments: one prompt, n sampled answers, each scored by the kind's verifier.

    class CountdownEnv(SingleTurnEnv):
        judge = staticmethod(judge_countdown)       # module-level: runs in a worker process
        def make_tasks(self, seed): ...             # (train, eval) lists of Task
        def extract(self, task, text): ...          # the answer the judge reads, or None

A rollout renders `task.messages` with the tokenizer's chat template once
(add_generation_prompt), submits one GenerateRequest with `sampling.n` samples (rid from
the task id), and scores every sample's decoded text:

  1. `extract(task, text)` (in this process, cheap, bounded): the answer, or None when the
     completion has none (reward 0, metric formatted=0, the judge is not called);
  2. `judge(*judge_args(task, answer))` in a worker process of `ptrain.envs.safety`, off
     the event loop (on the environment's own threads), with env.reward_timeout_s: a number in [0, 1] (1 = correct). A judge
     that raises, hangs, crashes or returns something else scores 0 with `reward_error`
     set, is logged and counted (`stats["reward_errors"]`), and the other samples go on;
  3. reward = format_reward * formatted + correct_reward * judged value, as the components
     `format` and `correct` (formatted: the answer was there, and `follows_format` holds).

A sample that hit the token limit (finish "length") is not scored unless
env.score_truncated: reward 0, metric truncated=1. An aborted one gets reward 0, aborted=1.
A request the engine refuses (a prompt longer than its context) gives finish "error"
trajectories that say why. Trajectories hold the engine's ids as they came: prompt, then
output (loss_mask 1 on the output only, the engine's log-probs there), the sample's token
counts (uncached prompt, cached prompt, output), weight versions, and one policy Turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import json
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ptrain.envs.base import Task, TaskSplits, TokenCounts, Trajectory, Turn
from ptrain.rollout.protocol import GenerateRequest, RequestError, Sample, SamplingParams

log = logging.getLogger(__name__)


BASE_METRICS = ("correct", "formatted", "truncated", "aborted", "reward_error")
"""Metrics every single-turn episode reports (0 or 1 each; `correct` may be a fraction)."""


def draw_distinct(draw: Callable[[], Any], key: Callable[[Any], Any], need: int, too_few: Callable[[int], str]) -> list:
    """`need` results of `draw()` with distinct `key`s, in the order drawn (a generated kind's
    tasks: the eval split takes the first ones, so it stays put when n_train changes). A
    draw may return None (no task this time). ValueError(too_few(found)) once draws have
    repeated or failed 200 x need + 10000 times: the kind's options leave too few tasks."""
    seen: set = set()
    drawn: list = []
    misses = 0
    while len(drawn) < need:
        got = draw()
        k = None if got is None else key(got)
        if got is None or k in seen:
            misses += 1
            if misses > 200 * need + 10000:
                raise ValueError(too_few(len(drawn)))
            continue
        seen.add(k)
        drawn.append(got)
    return drawn


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last complete <tag>...</tag> in text; None if there is none
    (or it is empty)."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, close)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : close].strip() or None


WARM_UP_TIMEOUT_S = 120.0
"""Time a cold reward worker gets to start and import the judge's modules."""


def import_modules(names: Sequence[str]) -> float:
    """Import `names` (in a reward worker); returns 1.0. The short hold keeps concurrent
    warm-up calls on distinct workers."""
    for name in names:
        importlib.import_module(name)
    time.sleep(0.2)
    return 1.0


def load_rows(
    path: str, fields: tuple[str, ...], key: str, check: Callable[[dict[str, Any]], str | None] | None = None
) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, each with `fields`; ValueError names the file, the
    line and what is wrong (config key `key` gave the path). check(row): what is wrong with
    a row's values, or None."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config key '{key}': no file '{path}'; pass a JSONL file")
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text ({e}); write UTF-8 JSONL") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON object ({e}); write one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{line_no}: a JSON {type(row).__name__}, expected an object with {list(fields)}"
                )
            missing = [k for k in fields if k not in row]
            if missing:
                raise ValueError(f"{path}:{line_no}: missing field(s) {missing}; each row needs {list(fields)}")
            problem = check(row) if check is not None else None
            if problem:
                raise ValueError(f"{path}:{line_no}: {problem}")
            rows.append(row)
    if not rows:
        raise ValueError(f"config key '{key}': '{path}' has no rows")
    return rows


@dataclass(frozen=True)
class Score:
    """How one completion scored: reward = sum(components)."""

    reward: float
    components: Mapping[str, float] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    reward_error: str | None = None


class SingleTurnEnv(TaskSplits):
    """Base of the single-turn kinds (module docstring). Subclasses set `judge` and
    implement `make_tasks` and `extract`; they may override `judge_args`, `score` (code
    runs a sandbox instead of a judge) and `extra_metrics`."""

    kind: ClassVar[str] = ""
    judge: ClassVar[Callable[..., float] | None] = None
    """Module-level function (picklable) that grades an extracted answer: a number in [0, 1]."""
    extra_metrics: ClassVar[tuple[str, ...]] = ()
    """Kind-specific metrics, 0 in episodes that were not scored."""
    full_credit_metric: ClassVar[str | None] = None
    """For a judge whose value is a fraction (constraints met, similarity): the name of a
    metric that is 1 when a formatted answer was judged wholly right (value 1). List it in
    extra_metrics too."""
    component_names: ClassVar[tuple[str, str]] = ("format", "correct")
    warm_modules: ClassVar[tuple[str, ...]] = ()
    """Modules the judge needs, imported by every reward worker before the first judgement,
    so that a cold worker's imports do not count against env.reward_timeout_s."""

    def __init__(self, cfg: Any, options: Any, *, tokenizer: Any, sandbox: Any = None, runner: Any = None):
        from ptrain.data.tokenizer import stop_token_ids

        self.cfg = cfg
        self.options = options
        self.tokenizer = tokenizer
        self.name: str = cfg.env_name
        self.weight: float = float(cfg.weight)
        self.seed: int | None = cfg.seed
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids(tokenizer))
        self._runner = runner
        self._owns_runner = runner is None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._warm_lock = threading.Lock()
        self._warmed = False
        self._in_flight: Counter[str] = Counter()
        self.stats: Counter[str] = Counter({"episodes": 0, "reward_errors": 0, "truncated": 0, "errors": 0})
        """Episodes scored, reward-code failures, truncated samples, engine-refused requests."""

    # ------------------------------------------------------------------ tasks

    def row_splits(
        self, path: str, eval_path: str | None, fields: tuple[str, ...], check: Callable | None = None
    ) -> tuple[list, list]:
        """(train, eval) rows of JSONL files: eval from eval_path, else the first n_eval rows of
        path (the rest train); at most n_train / n_eval rows each. check: as for load_rows."""
        rows = load_rows(path, fields, f"envs.{self.name}.options.path", check)
        n_train, n_eval = self.cfg.n_train, self.cfg.n_eval
        if eval_path is not None:
            held = load_rows(eval_path, fields, f"envs.{self.name}.options.eval_path", check)[:n_eval]
            return rows[:n_train], held
        if len(rows) <= n_eval:
            raise ValueError(
                f"envs.{self.name}.options.path: '{path}' has {len(rows)} rows, and the first n_eval={n_eval} are "
                f"held out, which leaves none to train on; pass more rows, a smaller envs.{self.name}.n_eval, or "
                f"envs.{self.name}.options.eval_path"
            )
        return rows[n_eval:][:n_train], rows[:n_eval]

    @staticmethod
    def user(content: str) -> tuple[dict[str, str], ...]:
        """A one-message chat: the user's content."""
        return ({"role": "user", "content": content},)

    # ------------------------------------------------------------------ scoring

    @property
    def runner(self):
        """The worker pool that runs this environment's judge (started on first use)."""
        if self._runner is None:
            from ptrain.envs.safety import RewardRunner

            self._runner = RewardRunner(workers=self.cfg.reward_workers, timeout_s=self.cfg.reward_timeout_s)
        return self._runner

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """This environment's threads that wait on its reward workers (one per worker): its
        own, so that a backlog of slow judgements never takes the threads other environments
        (or the event loop's default executor) need."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.cfg.reward_workers, thread_name_prefix=f"ptrain-reward-{self.name}"
            )
        return self._executor

    def warm_up(self) -> None:
        """Start every reward worker and import the judge's modules there (blocking; once)."""
        if type(self).judge is None:  # a kind that scores without reward workers (code: the sandbox)
            return
        with self._warm_lock:
            if self._warmed:
                return
            modules = (type(self).judge.__module__, *self.warm_modules)
            runner = self.runner
            with concurrent.futures.ThreadPoolExecutor(runner.workers) as pool:
                calls = [
                    pool.submit(runner.run, import_modules, modules, timeout_s=max(WARM_UP_TIMEOUT_S, runner.timeout_s))
                    for _ in range(runner.workers)
                ]
                for call in calls:
                    outcome = call.result()
                    if not outcome.ok:
                        log.warning("env %s: a reward worker failed to start: %s", self.name, outcome.reason)
            self._warmed = True

    def judge_blocking(self, task: Task, answer: Any):
        """Run the judge on `answer` in a reward worker (blocking): a RewardOutcome."""
        self.warm_up()
        outcome = self.runner.run(type(self).judge, *self.judge_args(task, answer), timeout_s=self.cfg.reward_timeout_s)
        if outcome.kind in ("timeout", "crashed"):
            # That worker was replaced by a cold one: warm it before the next judgement.
            with self._warm_lock:
                self._warmed = False
        return outcome

    def extract(self, task: Task, text: str) -> Any:
        """The answer in `text` that the judge grades, or None when there is none."""
        raise NotImplementedError

    def follows_format(self, task: Task, text: str) -> bool:
        """Whether a completion with an extractable answer also has the shape the prompt asked
        for (the `format` component and metric `formatted`); by default having the answer is
        enough. A kind with a stricter template says so here; its answer is graded either way."""
        return True

    def judge_args(self, task: Task, answer: Any) -> tuple:
        """Arguments of `judge` (picklable): by default the answer and the task's data."""
        return (answer, dict(task.data))

    def unscored(self, **metrics: float) -> Score:
        """A zero score with every metric 0 except those given."""
        base = {k: 0.0 for k in (*BASE_METRICS, *self.extra_metrics)}
        base.update({k: float(v) for k, v in metrics.items()})
        return Score(0.0, {c: 0.0 for c in self.component_names}, base)

    def scored(self, formatted: bool, value: float, **metrics: float) -> Score:
        """The score of a completion judged `value` in [0, 1]: components format and correct."""
        fmt, correct = self.component_names
        components = {
            fmt: self.options.format_reward * float(formatted),
            correct: self.options.correct_reward * float(value),
        }
        if self.full_credit_metric:
            metrics = {**metrics, self.full_credit_metric: float(formatted and value >= 1.0)}
        out = self.unscored(correct=value, formatted=float(formatted), **metrics)
        return Score(sum(components.values()), components, out.metrics)

    def failed(self, task: Task, reason: str) -> Score:
        """Reward 0 because the reward code failed: logged, counted, reason kept."""
        self.stats["reward_errors"] += 1
        log.warning("env %s task %s: reward code failed, reward 0: %s", self.name, task.id, reason)
        out = self.unscored(reward_error=1.0)
        return dataclasses.replace(out, reward_error=reason)

    async def score(self, task: Task, text: str) -> Score:
        """Score one completion's text (module docstring, steps 1-3)."""
        try:
            answer = self.extract(task, text)
        except Exception as e:  # noqa: BLE001 - an extractor bug scores this sample 0 with its reason
            return self.failed(task, f"extracting the answer raised {type(e).__name__}: {e}")
        if answer is None:
            return self.unscored()
        outcome = await asyncio.get_running_loop().run_in_executor(self.executor, self.judge_blocking, task, answer)
        if not outcome.ok:
            return self.failed(task, outcome.reason)
        value = outcome.reward
        if not 0.0 <= value <= 1.0 or math.isnan(value):
            return self.failed(task, f"judge returned {value}, outside [0, 1]")
        return self.scored(self.follows_format(task, text), value)

    # ------------------------------------------------------------------ rollout

    def prompt_ids(self, task: Task) -> tuple[int, ...]:
        """task.messages rendered by the chat template, with the assistant generation prompt."""
        out = self.tokenizer.apply_chat_template(
            [dict(m) for m in task.messages], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return tuple(int(i) for i in out["input_ids"])

    def sampling_for(self, sampling: SamplingParams) -> SamplingParams:
        """The stage's sampling with this environment's token budget and end-of-turn stop ids."""
        stops = tuple(sampling.stop_token_ids) + tuple(
            i for i in self.stop_token_ids if i not in sampling.stop_token_ids
        )
        budget = self.cfg.max_new_tokens if self.cfg.max_new_tokens is not None else sampling.max_new_tokens
        return dataclasses.replace(sampling, stop_token_ids=stops, max_new_tokens=budget)

    def _rid(self, task: Task) -> str:
        base = f"{self.name}/{task.id}"
        k = self._in_flight[base]
        self._in_flight[base] += 1
        return base if k == 0 else f"{base}#{k + 1}"

    def _release(self, task: Task) -> None:
        base = f"{self.name}/{task.id}"
        self._in_flight[base] -= 1
        if self._in_flight[base] <= 0:
            del self._in_flight[base]

    async def rollout(self, task: Task, engine: Any, sampling: SamplingParams) -> list[Trajectory]:
        """`sampling.n` scored trajectories of `task` (Environment.rollout)."""
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
        finally:
            self._release(task)
        wall = time.monotonic() - start
        texts = [self.tokenizer.decode(list(s.output_ids), skip_special_tokens=True) for s in samples]
        scores = await asyncio.gather(*(self._score_sample(task, s, t) for s, t in zip(samples, texts)))
        self.stats["episodes"] += len(samples)
        return [self._trajectory(task, s, t, sc, wall) for s, t, sc in zip(samples, texts, scores)]

    async def _score_sample(self, task: Task, sample: Sample, text: str) -> Score:
        finish = sample.finish_reason.type if sample.finish_reason is not None else "abort"
        if finish == "abort":
            return self.unscored(aborted=1.0)
        if finish == "length":
            self.stats["truncated"] += 1
            if not self.cfg.score_truncated:
                return self.unscored(truncated=1.0)
            score = await self.score(task, text)
            return dataclasses.replace(score, metrics={**score.metrics, "truncated": 1.0})
        return await self.score(task, text)

    def _trajectory(self, task: Task, s: Sample, text: str, score: Score, wall: float) -> Trajectory:
        P, O = len(s.prompt_ids), len(s.output_ids)
        spans = tuple(w.version for w in s.weight_versions) or (s.weight_version,)
        return Trajectory(
            task=task,
            sample_index=s.index,
            token_ids=tuple(s.prompt_ids) + tuple(s.output_ids),
            prompt_length=P,
            loss_mask=(0,) * P + (1,) * O,
            logprobs=(0.0,) * P + tuple(float(x) for x in s.logprobs),
            reward=float(score.reward),
            reward_components=dict(score.components),
            finish_reason=s.finish_reason.type if s.finish_reason is not None else "abort",
            reward_error=score.reward_error,
            metrics=dict(score.metrics),
            turns=(Turn("policy", P, P + O, text=text, duration_s=s.e2e_latency_s or wall),),
            weight_versions=spans,
            tokens=TokenCounts(
                prompt_uncached=s.prompt_tokens - s.cached_tokens,
                prompt_cached=s.cached_tokens,
                output=s.completion_tokens,
            ),
        )

    def _error(self, task: Task, j: int, prompt: tuple[int, ...], message: str) -> Trajectory:
        log.warning("env %s task %s: the engine refused the request: %s", self.name, task.id, message)
        n = len(prompt)
        return Trajectory(
            task=task,
            sample_index=j,
            token_ids=prompt,
            prompt_length=n,
            loss_mask=(0,) * n,
            logprobs=(0.0,) * n,
            reward=0.0,
            reward_components={c: 0.0 for c in self.component_names},
            finish_reason="error",
            error=message,
            metrics=dict(self.unscored().metrics),
        )

    def close(self) -> None:
        """Stop this environment's reward workers and threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._runner is not None and self._owns_runner:
            self._runner.close()
            self._runner = None
