"""Held-out evaluation: loss over the eval split, exact-match accuracy of greedy answers."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from ptrain.config import RunConfig
from ptrain.data.pipeline import EvalPrompt, make_sft_iterator
from ptrain.data.tasks import check_answer
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


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn: the chat template's <|im_end|>, else end-of-sequence."""
    stop = [tokenizer.convert_tokens_to_ids(s) for s in ("<|im_end|>",) if s in tokenizer.get_vocab()]
    return stop or [tokenizer.eos_token_id]


def exact_match_evaluator(run: RunConfig, prompts: list[EvalPrompt], tokenizer, placed,
                          batch_size: int = 64) -> Callable[[TrainState], dict]:
    """Fraction of held-out prompts whose greedy answer the task's verifier accepts."""
    from ptrain.models.generate import bucket_length, generate

    t = run.train
    prompts = [p for p in prompts if p.task]
    stop = stop_token_ids(tokenizer)
    bucket = bucket_length(max(len(p.prompt_ids) for p in prompts))
    pad = tokenizer.pad_token_id or 0

    def evaluate(state: TrainState) -> dict:
        model = placed.model_def.bind(state.params, state.model_state)
        correct, lengths = 0, []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            # pad the last chunk to the batch size so every call reuses one compiled program
            ids = [p.prompt_ids.tolist() for p in chunk] + [chunk[0].prompt_ids.tolist()] * (batch_size - len(chunk))
            out = generate(model, ids, max_new_tokens=t.eval_max_new_tokens, temperature=0.0, stop_tokens=stop,
                           pad_id=pad, prompt_bucket=bucket)
            for r, p in enumerate(chunk):
                text = tokenizer.decode(out.tokens_BxN[r, : out.lengths_B[r]].tolist(), skip_special_tokens=True)
                correct += bool(check_answer(p.task, text))
                lengths.append(int(out.lengths_B[r]))
        return {"exact_match": correct / max(len(prompts), 1), "response_length": float(np.mean(lengths))}

    return evaluate
