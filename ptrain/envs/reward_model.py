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
shapes. A row longer than `max_tokens` (at most the longest row the model was trained on, which
an rm stage's export records, and its max_position_embeddings) keeps its first max_tokens
tokens: the score then reads a cut response, which the caller counts.
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
    """Scores (messages, response) rows with a reward model folder (module docstring).

    Checked when built (a folder that is no reward model, or whose tokenizer is not the
    policy's, is an EnvConfigError naming `what`); the weights load at the first score, so a
    process that never scores (every one of a multi-process stage but the one that samples)
    holds none."""

    def __init__(self, path: str, tokenizer: Any, *, max_tokens: int, what: str):
        from ptrain.config.env_options import EnvConfigError
        from ptrain.models.hf import TRAINED_TOKENS_KEY, read_reward_model_config

        try:
            hf = read_reward_model_config(path)
        except FileNotFoundError:
            raise EnvConfigError(
                f"config key '{what}': no reward model at {path!r} (no config.json); run a stage of kind rm "
                "before any stage that samples with it (its export is <run_dir>/stages/<name>/export; an earlier "
                "stage that samples every environment lists its own in stages[].envs) or pass a Hugging Face "
                "sequence-classification folder"
            ) from None
        except ValueError as e:
            raise EnvConfigError(f"config key '{what}': {e}") from None
        own = os.path.join(path, "tokenizer.json")
        if os.path.isfile(own) and hasattr(tokenizer, "get_vocab"):
            from transformers import PreTrainedTokenizerFast

            if PreTrainedTokenizerFast(tokenizer_file=own).get_vocab() != tokenizer.get_vocab():
                raise EnvConfigError(
                    f"config key '{what}': the reward model at {path} has its own tokenizer, not the policy's; it "
                    "reads the policy's token ids, so train it from the policy's weights (a stage of kind rm)"
                )
        self.path = path
        self.what = what
        self.tokenizer = tokenizer
        known = (hf.get(TRAINED_TOKENS_KEY), hf.get("max_position_embeddings"))
        self.max_tokens = min([max_tokens] + [v for v in known if type(v) is int and v > 0])
        """Tokens a row keeps: the caller's limit, and at most the longest row the model was
        trained on (when its folder says) and the positions it has."""
        if self.max_tokens < max_tokens:
            print(f"ptrain: {what}: rows are scored up to {self.max_tokens} tokens (what the reward model at "
                  f"{path} was trained on or holds), not {max_tokens}; longer ones are cut and counted",
                  flush=True)  # fmt: skip
        self._model: Any = None
        self._lock = threading.Lock()

    def _load(self) -> None:
        import jax
        from flax import nnx

        from ptrain.config.env_options import EnvConfigError
        from ptrain.models import load_hf_reward_model

        try:
            model = load_hf_reward_model(self.path)
        except (FileNotFoundError, ValueError) as e:
            raise EnvConfigError(f"config key '{self.what}': {e}") from None
        graphdef, state = nnx.split(model)
        self.vocab_size = model.cfg.vocab_size
        self._model = (jax.jit(lambda st, ids, seg: nnx.merge(graphdef, st)(ids, segment_ids=seg)), state)

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
        with self._lock:
            if self._model is None:
                self._load()
            for r in rows:
                if r.size and (r.min() < 0 or r.max() >= self.vocab_size):
                    raise ValueError(
                        f"token id {int(r.max())} is outside the reward model's vocabulary of {self.vocab_size} "
                        f"({self.path}); the reward model must share the policy's tokenizer"
                    )
            length = _bucket(max(len(r) for r in rows), MIN_BUCKET)
            batch = _bucket(len(rows), 1)
            ids = np.zeros((batch, length), np.int32)
            segments = np.zeros((batch, length), np.int32)
            for k, r in enumerate(rows):
                ids[k, : len(r)] = r
                segments[k, : len(r)] = 1
            score, state = self._model
            out = np.asarray(score(state, ids, segments))
        return [float(x) for x in out[: len(rows)]]


UNSCORED_FINISHES = ("length", "token_limit", "abort", "error")
"""Finish reasons whose episodes the reward model does not score: cut, aborted or failed. With
the environment's score_truncated, cut ones ("length", "token_limit") are scored."""
CUT_FINISHES = ("length", "token_limit")


def logistic(score: float) -> float:
    """sigmoid(score): a Bradley-Terry score as the odds of beating a response scored 0."""
    return 0.5 * (1.0 + math.tanh(0.5 * score))


class RewardModelScored:
    """An environment whose finished episodes a reward model scores in place of its verifier.

    Tasks, prompts, tools and episodes are the wrapped environment's (`inner`). Each episode
    without an error that finished (cut ones too with the environment's score_truncated) and
    whose policy wrote something gets reward sigmoid(the model's score of the prompt and every
    turn after it, as preference pairs render them) and the single component `reward_model`.
    Every other episode gets reward 0 and that component 0: the model never saw empty or cut
    answers in training, so it has no score for them worth trusting. The verifier's verdict
    stays as metrics: `verifier_reward` (its reward) and `correct` (whether it solved the
    task), so accuracy and pass@k still measure the task while training optimises the learned
    reward. A scoring failure makes the group's scored episodes env errors (no loss tokens).
    Every other attribute is the wrapped environment's.
    """

    def __init__(self, inner: Any, scorer: RewardModelScorer):
        self.inner = inner
        self.scorer = scorer
        self.name = inner.name
        inner.stats.setdefault("reward_model_cut", 0)
        inner.stats.setdefault("reward_model_errors", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def scored(self, t: Any) -> bool:
        """Whether the model scores episode t (class docstring)."""
        if t.error is not None or not any(turn.text.strip() for turn in t.turns if turn.role == "policy"):
            return False
        cut_ok = bool(getattr(self.inner.cfg, "score_truncated", False)) and t.finish_reason in CUT_FINISHES
        return t.finish_reason not in UNSCORED_FINISHES or cut_ok

    async def rollout(self, task: Any, engine: Any, sampling: Any) -> list[Any]:
        import asyncio

        from ptrain.envs.base import is_correct
        from ptrain.envs.demonstrations import episode_messages, prompt_messages

        out = list(await self.inner.rollout(task, engine, sampling))

        def verdict(t: Any) -> dict[str, float]:
            return {**t.metrics, "verifier_reward": float(t.reward), "correct": float(is_correct(t))}

        keep = [k for k, t in enumerate(out) if self.scored(t)]
        kept = set(keep)
        for k, t in enumerate(out):
            if t.error is None and k not in kept:
                out[k] = dataclasses.replace(t, reward=0.0, reward_components={"reward_model": 0.0}, metrics=verdict(t))
        if not keep:
            return out
        prompt = prompt_messages(self.inner, task)
        try:
            rows = [self.scorer.tokens(prompt + episode_messages(out[k]), len(prompt)) for k in keep]
            self.inner.stats["reward_model_cut"] += sum(cut for _, cut in rows)
            scores = await asyncio.to_thread(self.scorer.scores, [ids for ids, _ in rows])
        except Exception as e:  # noqa: BLE001 - a failed scoring fails this group's episodes, not the batch
            why = f"the reward model ({self.scorer.path}) failed: {type(e).__name__}: {str(e)[:300]}"
            self.inner.stats["reward_model_errors"] += 1
            for k in keep:
                n = len(out[k].token_ids)
                out[k] = dataclasses.replace(out[k], finish_reason="error", error=why, reward=0.0,
                                             loss_mask=(0,) * n, logprobs=(0.0,) * n)  # fmt: skip
            return out
        for k, score in zip(keep, scores):
            t = out[k]
            reward = logistic(score)
            metrics = {**verdict(t), "reward_model_score": float(score)}
            out[k] = dataclasses.replace(t, reward=reward, reward_components={"reward_model": reward}, metrics=metrics)
        return out
