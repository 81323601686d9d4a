"""A Bradley-Terry reward model as a judge: scalar scores of whole conversations.

The `judge` kind's `reward_model` backend. The model is a Hugging Face sequence-classification
folder with one label: what a stage of kind rm exports, or any reward model of a family
ptrain loads (`ptrain.models.load_hf_reward_model`). A response is scored as the rm stage
trained on it: the prompt's messages and the response as one assistant turn, rendered by the
policy tokenizer's chat template (the tokenisation of preference pairs), scored at its last
real token.

The model runs in the process that samples (the driver), on JAX's default device, in a worker
thread so the event loop keeps serving other rollouts. Rows are padded to a power of two of
tokens (at least 64) and batches to a power of two of rows, so a run compiles a handful of
shapes. A row longer than `max_tokens` keeps its first max_tokens tokens: the score then
reads a cut response, which the caller reports.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MIN_BUCKET = 64
"""Shortest padded row length (tokens)."""


def _bucket(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


class RewardModelScorer:
    """Scores (messages, response) rows with a reward model folder (module docstring)."""

    def __init__(self, path: str, tokenizer: Any, *, max_tokens: int, what: str):
        from ptrain.config.env_options import EnvConfigError

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise EnvConfigError(
                f"config key '{what}': no reward model at {path!r} (no config.json); run a stage of kind rm "
                "before this one (its export is <run_dir>/stages/<name>/export) or pass a Hugging Face "
                "sequence-classification folder"
            )
        import jax
        from flax import nnx

        from ptrain.models import load_hf_reward_model

        try:
            model = load_hf_reward_model(path)
        except (FileNotFoundError, ValueError) as e:
            raise EnvConfigError(f"config key '{what}': {e}") from None
        self.path = path
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.vocab_size = model.cfg.vocab_size
        self._graphdef, self._state = nnx.split(model)
        self._lock = threading.Lock()

        def score(state, ids, segments):
            return nnx.merge(self._graphdef, state)(ids, segment_ids=segments)

        self._score = jax.jit(score)

    def tokens(self, messages: Sequence[Mapping[str, Any]], n_prompt: int) -> tuple[np.ndarray, bool]:
        """Token ids of a conversation whose first n_prompt messages are the prompt (rendered as
        preference pairs are), and whether they were cut to max_tokens."""
        from ptrain.data.chat import tokenize_conversations

        ((ids, _),) = tokenize_conversations(self.tokenizer, [([dict(m) for m in messages], n_prompt)])
        return ids[: self.max_tokens], len(ids) > self.max_tokens

    def response_tokens(self, messages: Sequence[Mapping[str, Any]], response: str) -> tuple[np.ndarray, bool]:
        """`tokens` of the prompt `messages` followed by `response` as one assistant turn."""
        return self.tokens([*messages, {"role": "assistant", "content": response}], len(messages))

    def scores(self, rows: Sequence[np.ndarray]) -> list[float]:
        """The model's score of each row of token ids (float32 scalars as floats)."""
        if not rows:
            return []
        for ids in rows:
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise ValueError(
                    f"token id {int(ids.max())} is outside the reward model's vocabulary of {self.vocab_size} "
                    f"({self.path}); the reward model must share the policy's tokenizer"
                )
        length = _bucket(max(len(r) for r in rows), MIN_BUCKET)
        batch = _bucket(len(rows), 1)
        ids = np.zeros((batch, length), np.int32)
        segments = np.zeros((batch, length), np.int32)
        for k, r in enumerate(rows):
            ids[k, : len(r)] = r
            segments[k, : len(r)] = 1
        with self._lock:
            out = np.asarray(self._score(self._state, ids, segments))
        return [float(x) for x in out[: len(rows)]]


UNSCORED_FINISHES = ("length", "token_limit", "abort", "error")
"""Finish reasons whose episodes keep the environment's own (zero) reward: cut, aborted or failed.
With the environment's score_truncated, "length" is scored."""


def logistic(score: float) -> float:
    """sigmoid(score): a Bradley-Terry score as the odds of beating a response scored 0."""
    return 0.5 * (1.0 + math.tanh(0.5 * score))


class RewardModelScored:
    """An environment whose finished episodes a reward model scores in place of its verifier.

    Tasks, prompts, tools and episodes are the wrapped environment's; each episode that it
    scored (no error, finished; cut ones only with its score_truncated) gets reward
    sigmoid(the model's score of the prompt and every turn after it, as preference pairs render
    them) and the single component `reward_model`. The verifier's verdict stays as metrics:
    `verifier_reward` (its reward) and `correct` (whether it solved the task), so accuracy and
    pass@k still measure the task while training optimises the learned reward. A scoring
    failure makes the group's scored episodes env errors (no loss tokens). Every other
    attribute is the wrapped environment's.
    """

    def __init__(self, env: Any, scorer: RewardModelScorer):
        self.env = env
        self.scorer = scorer
        self.name = env.name
        env.stats.setdefault("reward_model_cut", 0)
        env.stats.setdefault("reward_model_errors", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def scored(self, t: Any) -> bool:
        truncated_ok = bool(getattr(self.env.cfg, "score_truncated", False)) and t.finish_reason == "length"
        return t.error is None and (t.finish_reason not in UNSCORED_FINISHES or truncated_ok)

    async def rollout(self, task: Any, engine: Any, sampling: Any) -> list[Any]:
        import asyncio

        from ptrain.envs.base import is_correct
        from ptrain.envs.demonstrations import episode_messages, prompt_messages

        out = list(await self.env.rollout(task, engine, sampling))
        keep = [k for k, t in enumerate(out) if self.scored(t)]
        if not keep:
            return out
        prompt = prompt_messages(self.env, task)
        try:
            rows = [self.scorer.tokens(prompt + episode_messages(out[k]), len(prompt)) for k in keep]
            self.env.stats["reward_model_cut"] += sum(cut for _, cut in rows)
            scores = await asyncio.to_thread(self.scorer.scores, [ids for ids, _ in rows])
        except Exception as e:  # noqa: BLE001 - a failed scoring fails this group's episodes, not the batch
            why = f"the reward model ({self.scorer.path}) failed: {type(e).__name__}: {str(e)[:300]}"
            self.env.stats["reward_model_errors"] += 1
            for k in keep:
                n = len(out[k].token_ids)
                out[k] = dataclasses.replace(out[k], finish_reason="error", error=why, reward=0.0,
                                             loss_mask=(0,) * n, logprobs=(0.0,) * n)  # fmt: skip
            return out
        for k, score in zip(keep, scores):
            t = out[k]
            reward = logistic(score)
            metrics = {**t.metrics, "verifier_reward": float(t.reward), "correct": float(is_correct(t)),
                       "reward_model_score": float(score)}  # fmt: skip
            out[k] = dataclasses.replace(t, reward=reward, reward_components={"reward_model": reward}, metrics=metrics)
        return out
