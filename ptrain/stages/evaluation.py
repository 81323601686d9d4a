"""Held-out evaluation: loss over the eval split, exact-match accuracy of greedy answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from ptrain.config import RunConfig
from ptrain.data.prompts import EvalPrompt
from ptrain.data.sft import make_sft_iterator
from ptrain.data.tokenizer import stop_token_ids
from ptrain.envs.arithmetic import check_answer
from ptrain.losses import sft_loss
from ptrain.parallel import batch_sharding
from ptrain.train.state import TrainState


def heldout_loss_evaluator(run: RunConfig, data_cfg, tokenizer, placed) -> Callable[[TrainState], dict]:
    """Token-mean cross-entropy over up to train.eval_batches held-out batches."""
    t = run.train
    model_def = placed.model_def

    @jax.jit
    def sums(params, model_state, batch):
        model = model_def.bind(params, model_state)
        logits = model(batch["input_ids"], batch["positions"], batch["segment_ids"])
        _, aux = sft_loss(logits, batch["target_ids"], batch["loss_mask"])
        return aux.nll_sum, aux.token_count, aux.correct_count

    def evaluate(state: TrainState) -> dict:
        it = make_sft_iterator(data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len, split="eval")
        nll = tokens = correct = 0.0
        for i, batch in enumerate(it):
            if i >= t.eval_batches:
                break
            n, c, k = sums(state.params, state.model_state, jax.device_put(batch, batch_sharding(placed.mesh)))
            nll, tokens, correct = nll + float(n), tokens + float(c), correct + float(k)
        tokens = max(tokens, 1.0)
        return {"loss": nll / tokens, "token_accuracy": correct / tokens}

    return evaluate


@dataclasses.dataclass
class Completion:
    text: str
    """Decoded completion, special tokens dropped."""
    finished: bool
    """True when a stop token ended it (False: cut by max_new_tokens)."""
    length: int
    """Generated tokens, the stop token included."""


def complete(
    model,
    prompt_ids: list[list[int]],
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
) -> list[Completion]:
    """One completion per prompt, generated `batch_size` rows at a time. Every call is padded
    to `batch_size` rows and one prompt bucket, so all of them reuse one compiled program;
    call b samples with key fold_in(key(seed), b)."""
    from ptrain.models.generate import generate, prompt_bucket_for

    bucket = prompt_bucket_for(max(len(p) for p in prompt_ids), max_new_tokens, model.cfg.max_seq_len)
    stop, pad = stop_token_ids(tokenizer), tokenizer.pad_token_id or 0
    out: list[Completion] = []
    for b, start in enumerate(range(0, len(prompt_ids), batch_size)):
        chunk = prompt_ids[start : start + batch_size]
        ids = chunk + [chunk[0]] * (batch_size - len(chunk))
        gen = generate(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_tokens=stop,
            pad_id=pad,
            prompt_bucket=bucket,
            rng=jax.random.fold_in(jax.random.key(seed), b),
        )
        for r in range(len(chunk)):
            n = int(gen.lengths_B[r])
            out.append(
                Completion(
                    tokenizer.decode(gen.tokens_BxN[r, :n].tolist(), skip_special_tokens=True),
                    gen.finish_reasons[r] == "stop",
                    n,
                )
            )
    return out


def exact_match_evaluator(
    run: RunConfig, prompts: list[EvalPrompt], tokenizer, placed, batch_size: int = 64
) -> Callable[[TrainState], dict]:
    """Fraction of held-out prompts whose greedy answer the task's verifier accepts."""
    t = run.train
    prompts = [p for p in prompts if p.task]
    ids = [p.prompt_ids.tolist() for p in prompts]

    def evaluate(state: TrainState) -> dict:
        model = placed.model_def.bind(state.params, state.model_state)
        outs = complete(model, ids, tokenizer, max_new_tokens=t.eval_max_new_tokens, batch_size=batch_size)
        correct = sum(bool(check_answer(p.task, o.text)) for p, o in zip(prompts, outs))
        return {
            "exact_match": correct / max(len(prompts), 1),
            "response_length": float(np.mean([o.length for o in outs])),
        }

    return evaluate
