"""The replay engine: answers generate requests with given completions instead of a model.

    engine = ReplayEngine({"countdown/train-0": ["<answer>(3 + 5) * 2</answer>", "no idea"]},
                          tokenizer=tok)
    samples = await engine.generate(GenerateRequest(ids, SamplingParams(n=2), rid="countdown/train-0"))

It speaks the rollout protocol (`EngineBase`), so an environment cannot tell it from a real
engine: environment tests score known completions with it, and `rescore` re-runs recorded
rollouts (audit-log records) through an environment's current scorer.

Completions are queued per key and consumed in order, n per request (sample j gets the
j-th next one). A key is a request id (`rid`; a rid with a `#k` suffix, which environments
add to a second concurrent request for one task, also finds its plain form), a prompt as a
tuple of token ids, or None: the queue of any request no other key claims (what a plain
list of completions gives). A completion is token ids, text (encoded with the tokenizer,
without special tokens), a `Completion`, or its dict form {"output_ids" | "text",
"finish", "logprobs"}.

Finish reasons. With `finish` unset, the output is cut like a real engine's: at the first
stop id (the request's stop_token_ids, plus the engine's eos ids unless ignore_eos; the
stop id is kept, finish "stop") or at max_new_tokens (finish "length"); a text completion
that ends without one gets the request's first stop id appended, as a model ends its turn.
With `finish` given ("stop", "length", "abort"), the output is used exactly as given.
Log-probs are the given ones, or 0.0 per token. The weight version is "replay", and
cached_tokens emulates a prefix cache: the longest prefix shared with an earlier request's
prompt plus output (the prompt's last token excluded, as LocalEngine always computes it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ptrain.rollout.protocol import (
    FINISH_TYPES,
    EngineBase,
    FinishReason,
    GenerateRequest,
    RequestError,
    Sample,
    SamplingParams,
    WeightSpan,
)

REPLAY_VERSION = "replay"
"""The weight version of every replayed sample."""
HISTORY = 4096
"""Sequences the emulated prefix cache remembers (the most recent)."""


@dataclass(frozen=True)
class Completion:
    """One scripted answer: token ids or text, an optional finish reason and log-probs."""

    output_ids: tuple[int, ...] | None = None
    """The output tokens (exactly these); or None with `text`."""
    text: str | None = None
    """The output as text, encoded with the engine's tokenizer (no special tokens added)."""
    finish: str | None = None
    """stop | length | abort: use the output as given with this reason. None: cut at stop
    ids and max_new_tokens as a real engine would (module docstring)."""
    logprobs: tuple[float, ...] | None = None
    """Log-prob of each output token (same length as the output); None: 0.0 each."""

    def __post_init__(self) -> None:
        if (self.output_ids is None) == (self.text is None):
            raise ValueError("a replay Completion needs exactly one of output_ids and text")
        if self.output_ids is not None:
            object.__setattr__(self, "output_ids", tuple(int(i) for i in self.output_ids))
        if self.finish is not None and self.finish not in FINISH_TYPES:
            raise ValueError(f"replay Completion finish={self.finish!r}: pass one of {', '.join(FINISH_TYPES)} or None")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
            if self.output_ids is not None and len(self.logprobs) != len(self.output_ids):
                raise ValueError(
                    f"replay Completion: {len(self.logprobs)} logprobs for {len(self.output_ids)} output ids"
                )

    @classmethod
    def of(cls, item: Any) -> Completion:
        """A Completion from any accepted form: Completion, str, ids, or a dict."""
        if isinstance(item, Completion):
            return item
        if isinstance(item, str):
            return cls(text=item)
        if isinstance(item, Mapping):
            unknown = sorted(set(item) - {"output_ids", "text", "finish", "logprobs"})
            if unknown:
                raise ValueError(f"replay completion keys {unknown}: valid keys are output_ids, text, finish, logprobs")
            return cls(**dict(item))
        if isinstance(item, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in item):
            return cls(output_ids=tuple(item))
        raise ValueError(
            f"replay completion {item!r:.80}: pass token ids, text, a Completion or a dict with output_ids or text"
        )


def _key_of(key: Any) -> str | tuple[int, ...] | None:
    if key is None or isinstance(key, str):
        return key
    if isinstance(key, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in key):
        return tuple(int(i) for i in key)
    raise ValueError(f"replay key {key!r:.80}: pass a rid (str), prompt token ids, or None")


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ReplayEngine(EngineBase):
    """A RolloutEngine whose samples are given completions (module docstring).

    completions: {key: [completion, ...]} or a list of completions (key None).
    tokenizer: encodes text completions (needed only for those).
    eos_token_ids: ids that end a sample unless the request sets ignore_eos.
    delay_s: seconds each request takes before its samples resolve (for concurrency tests).
    """

    def __init__(
        self,
        completions: Mapping[Any, Iterable[Any]] | Iterable[Any] = (),
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        delay_s: float = 0.0,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.delay_s = float(delay_s)
        self._lock = threading.Lock()
        self._queues: dict[Any, deque[Completion]] = {}
        self._pending: dict[str, tuple[concurrent.futures.Future, list[Sample], threading.Timer]] = {}
        self._history: deque[tuple[int, ...]] = deque(maxlen=HISTORY)
        self._closed = False
        self._rid_counter = 0
        self.requests: list[GenerateRequest] = []
        """Every request served, in order (tests read the prompts and sampling they got)."""
        self.add(completions)

    @property
    def weight_version(self) -> str:
        return REPLAY_VERSION

    def add(self, completions: Mapping[Any, Iterable[Any]] | Iterable[Any]) -> None:
        """Queue more completions (same forms as the constructor's)."""
        items = completions.items() if isinstance(completions, Mapping) else [(None, completions)]
        with self._lock:
            for key, values in items:
                if isinstance(values, str | Completion | Mapping):
                    values = [values]
                self._queues.setdefault(_key_of(key), deque()).extend(Completion.of(v) for v in values)

    def remaining(self, key: Any = None) -> int:
        """Completions still queued under `key`."""
        with self._lock:
            return len(self._queues.get(_key_of(key), ()))

    def _queue_for(self, request: GenerateRequest) -> tuple[Any, deque[Completion]]:
        rid = request.rid
        for key in (rid, rid.split("#", 1)[0], request.input_ids, None):
            queue = self._queues.get(key)
            if queue:
                return key, queue
        raise RequestError(
            f"replay engine: no completion left for rid {rid!r} (prompt of {len(request.input_ids)} tokens); "
            "queue completions under this rid, its prompt ids, or as a plain list"
        )

    def _encode(self, c: Completion) -> list[int]:
        if c.output_ids is not None:
            return list(c.output_ids)
        if self.tokenizer is None:
            raise RequestError("replay engine: a text completion needs ReplayEngine(..., tokenizer=...)")
        return list(self.tokenizer.encode(c.text, add_special_tokens=False))

    def _sample(self, request: GenerateRequest, rid: str, j: int, c: Completion, cached: int) -> Sample:
        sp = request.sampling
        ids = self._encode(c)
        logprobs = list(c.logprobs) if c.logprobs is not None else None
        if logprobs is not None and len(logprobs) != len(ids):
            raise RequestError(
                f"replay engine: completion {j} of rid {rid!r} has {len(logprobs)} logprobs for {len(ids)} tokens"
            )
        stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_token_ids))
        if c.text is not None and c.finish in (None, "stop") and stops and not any(i in stops for i in ids):
            ids.append(stops[0])  # a model ends its turn with a stop token
            if logprobs is not None:
                logprobs.append(0.0)
        if c.finish is not None:
            reason = FinishReason(
                c.finish,
                matched=ids[-1] if c.finish == "stop" and ids and ids[-1] in stops else None,
                length=len(ids) if c.finish == "length" else None,
                message="replayed abort" if c.finish == "abort" else None,
            )
        else:
            reason = None
            for k, tok in enumerate(ids):
                if tok in stops:
                    ids = ids[: k + 1]
                    reason = FinishReason("stop", matched=tok)
                    break
            if len(ids) > sp.max_new_tokens:
                ids = ids[: sp.max_new_tokens]
                reason = FinishReason("length", length=len(ids))
            if reason is None:
                reason = FinishReason("stop", matched=None)
        lp = tuple(logprobs[: len(ids)]) if logprobs is not None else (0.0,) * len(ids)
        return Sample(
            rid=rid,
            index=j,
            prompt_ids=request.input_ids,
            output_ids=tuple(ids),
            logprobs=lp,
            sampling_logprobs=lp,
            finish_reason=reason,
            weight_version=REPLAY_VERSION,
            weight_versions=(WeightSpan(REPLAY_VERSION, 0, len(ids)),),
            cached_tokens=cached,
            e2e_latency_s=self.delay_s,
        )

    def submit(self, request: GenerateRequest, on_update=None) -> concurrent.futures.Future:
        """Answer `request` with its next n completions (RequestError when too few are left)."""
        if not request.input_ids:
            raise RequestError("input_ids: the prompt is empty; pass at least one token id")
        request.sampling.validate()
        with self._lock:
            if self._closed:
                raise RuntimeError("replay engine is closed")
            rid = request.rid
            if not rid:
                self._rid_counter += 1
                rid = f"replay-{self._rid_counter}"
            if rid in self._pending:
                raise RequestError(f"rid {rid!r} is already in flight; give each request its own rid")
            key, queue = self._queue_for(request)
            n = request.sampling.n
            if len(queue) < n:
                raise RequestError(
                    f"replay engine: rid {rid!r} asks for {n} samples but only {len(queue)} completions are "
                    f"queued under {key!r}; queue at least {n}"
                )
            prompt = request.input_ids
            cached = min(max((_lcp(prompt, h) for h in self._history), default=0), len(prompt) - 1)
            samples = [self._sample(request, rid, j, queue[j], cached) for j in range(n)]
            for _ in range(n):  # consumed only once every sample was built
                queue.popleft()
            self._history.extend(prompt + s.output_ids for s in samples)
            self.requests.append(dataclasses.replace(request, rid=rid))
            future: concurrent.futures.Future = concurrent.futures.Future()
            if self.delay_s <= 0:
                self._resolve(future, samples, on_update)
                return future
            timer = threading.Timer(self.delay_s, self._finish_pending, args=(rid, on_update))
            timer.daemon = True
            self._pending[rid] = (future, samples, timer)
            timer.start()
            return future

    @staticmethod
    def _resolve(future: concurrent.futures.Future, samples: list[Sample], on_update) -> None:
        if on_update is not None:
            on_update(samples)
        future.set_result(samples)

    def _finish_pending(self, rid: str, on_update) -> None:
        with self._lock:
            item = self._pending.pop(rid, None)
        if item is not None:
            self._resolve(item[0], item[1], on_update)

    def abort(self, rid: str | None = None) -> int:
        """End delayed requests still pending (all, or `rid`) with finish abort and no tokens."""
        with self._lock:
            rids = [r for r in self._pending if rid is None or r == rid or rid.startswith(f"{r}-")]
            items = [self._pending.pop(r) for r in rids]
        count = 0
        for future, samples, timer in items:
            timer.cancel()
            aborted = [
                dataclasses.replace(
                    s,
                    output_ids=(),
                    logprobs=(),
                    sampling_logprobs=(),
                    finish_reason=FinishReason("abort", message="aborted"),
                    weight_versions=(),
                )
                for s in samples
            ]
            count += len(aborted)
            future.set_result(aborted)
        return count

    def close(self) -> None:
        self.abort()
        with self._lock:
            self._closed = True


# ----------------------------------------------------------------------------- re-scoring records


def _policy_texts(record: Mapping[str, Any]) -> list[str]:
    turns = record.get("turns") or []
    texts = [t.get("text", "") for t in turns if t.get("role") == "policy"]
    if not texts:
        raise ValueError(
            f"record of task {record.get('task_id')!r} sample {record.get('sample')}: no policy turn; "
            "an audit record holds the policy's text in turns[*] with role 'policy'"
        )
    return texts


async def rescore_async(env: Any, records: Iterable[Mapping[str, Any]], *, tasks: Iterable[Any]) -> list[Any]:
    """`rescore` from asyncio."""
    by_id = {t.id: t for t in tasks}
    jobs = []
    for record in records:
        if record.get("env") not in (None, env.name):
            raise ValueError(f"record of env {record.get('env')!r} given to environment {env.name!r}")
        task_id = record.get("task_id")
        if task_id not in by_id:
            raise ValueError(
                f"record's task {task_id!r} is not among the {len(by_id)} tasks given; pass the tasks of the "
                "split and seed the records were made with"
            )
        finish = record.get("finish_reason")
        finish = finish if finish in FINISH_TYPES else None
        texts = _policy_texts(record)
        # Each recorded policy turn but the last ended the way a turn ends (stop).
        completions = [Completion(text=t, finish="stop") for t in texts[:-1]]
        completions.append(Completion(text=texts[-1], finish=finish or "stop"))
        engine = ReplayEngine(completions, tokenizer=env.tokenizer)
        sampling = SamplingParams(n=1, max_new_tokens=1 << 20)
        jobs.append((record, env.rollout(by_id[task_id], engine, sampling)))
    results = await asyncio.gather(*(job for _, job in jobs))
    out = []
    for (record, _), trajectories in zip(jobs, results):
        (trajectory,) = trajectories
        out.append(dataclasses.replace(trajectory, sample_index=int(record.get("sample", 0))))
    return out


def rescore(env: Any, records: Iterable[Mapping[str, Any]], *, tasks: Iterable[Any]) -> list[Any]:
    """Score recorded rollouts again with `env`'s scorer: one Trajectory per record.

    records: audit-log records (`Trajectory.audit_record()`, e.g. from
    ptrain.envs.audit.read_audit); tasks: the environment's tasks they refer to (e.g.
    env.tasks("train", seed=s) + env.tasks("eval", seed=s)). Each record's policy turns are
    replayed as text in order (re-encoded with env.tokenizer, so the token ids may differ
    from the recorded ones; the text and finish reason are the recorded ones).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(rescore_async(env, records, tasks=tasks))
    raise RuntimeError("rescore() was called inside a running event loop; use `await rescore_async(...)`")
