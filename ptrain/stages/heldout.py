"""Held-out evaluation: loss over the eval split, exact-match accuracy of greedy answers
(sampled by the rollout engine, ptrain.rollout.LocalEngine; as several JAX processes, by
process 0 alone, and every process gets its metrics)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from ptrain.config import RunConfig
from ptrain.data.prompts import EvalPrompt
from ptrain.data.sft import make_sft_iterator
from ptrain.data.tasks import check_answer
from ptrain.data.tokenizer import stop_token_ids
from ptrain.losses import sft_loss
from ptrain.parallel import batch_sharding
from ptrain.parallel.multihost import host_array, on_primary, put_global_batch
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
            n, c, k = sums(
                state.merged_params(), state.model_state, put_global_batch(batch, batch_sharding(placed.mesh))
            )
            nll, tokens, correct = nll + float(n), tokens + float(c), correct + float(k)
        tokens = max(tokens, 1.0)
        return {"loss": nll / tokens, "token_accuracy": correct / tokens}

    return evaluate


@dataclasses.dataclass
class Completion:
    text: str
    """Decoded completion, special tokens dropped."""
    finished: bool
    """True when a stop token ended it (False: cut by max_new_tokens or the context)."""
    length: int
    """Generated tokens, the stop token included."""
    token_ids: tuple[int, ...] = ()
    """The generated ids as the engine sampled them."""
    logprobs: tuple[float, ...] = ()
    """Their log-probs under the tempered full-vocabulary softmax (ptrain.rollout.protocol)."""


def engine_weights(state: TrainState):
    """(params, model_state) for `eval_engine`: the state's weights, adapters merged.

    As several JAX processes the embedded engine runs in process 0 alone, on one of its devices
    (sampling holds no collective that the processes would have to reach in step), so the
    weights are gathered to every host here: a collective that every process reaches, in the
    same order, before process 0 samples (`on_primary`)."""
    params, model_state = state.merged_params(), state.model_state
    if jax.process_count() > 1:
        params, model_state = jax.tree.map(host_array, (params, model_state))
    return params, model_state


def eval_engine(run: RunConfig, placed, weights, *, longest_prompt: int, max_new_tokens: int, rows: int = 64):
    """A LocalEngine for a stage's evaluations and sampling with `weights` (`engine_weights`),
    on the stage's mesh (as several processes: on one device of process 0, the only one that
    calls this); the caller swaps newer weights in."""
    from ptrain.rollout.local import LocalEngine
    from ptrain.stages.setup import rules_of

    model = placed.model_def.bind(*weights)
    max_len = model.cfg.max_seq_len
    context = min(max_len, longest_prompt + max_new_tokens + 1)
    return LocalEngine(
        model,
        max_running_requests=rows,
        context_length=max(context, 2),
        mesh=placed.mesh if jax.process_count() == 1 else None,
        rules=tuple(rules_of(run)),
        decode_steps=8,
    )


def complete(
    engine,
    prompt_ids: list[list[int]],
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    samples: int = 1,
) -> list[list[Completion]]:
    """`samples` completions of each prompt from a rollout engine (the n samples of a prompt
    share one prefill); sample j of prompt i draws with sampling_seed seed + i (and index j).
    The assistant turn's end (<|im_end|>, else end-of-sequence) stops a completion."""
    from ptrain.rollout.protocol import GenerateRequest, SamplingParams

    stop = tuple(stop_token_ids(tokenizer))
    requests = [
        GenerateRequest(
            tuple(int(x) for x in p),
            SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                n=samples,
                stop_token_ids=stop,
                sampling_seed=seed + i,
            ),  # fmt: skip
            rid=f"complete-{seed}-{i}",
        )
        for i, p in enumerate(prompt_ids)
    ]
    out = []
    for group in engine.generate_many(requests):
        out.append(
            [
                Completion(
                    tokenizer.decode(list(s.output_ids), skip_special_tokens=True),
                    s.finish_reason.type == "stop",
                    len(s.output_ids),
                    s.output_ids,
                    s.logprobs,
                )
                for s in group
            ]
        )
    return out


class ExactMatchEvaluator:
    """Fraction of held-out prompts whose greedy answer the task's verifier accepts. It owns
    one engine for the stage (compiled once); each evaluation swaps in the state's weights."""

    def __init__(self, run: RunConfig, prompts: list[EvalPrompt], tokenizer, placed):
        self.run, self.tokenizer, self.placed = run, tokenizer, placed
        self.prompts = [p for p in prompts if p.task]
        self.ids = [p.prompt_ids.tolist() for p in self.prompts]
        self.engine = None

    def __call__(self, state: TrainState) -> dict:
        weights = engine_weights(state)
        return on_primary(lambda: self._evaluate(weights), "the exact-match evaluation")

    def _evaluate(self, weights) -> dict:
        t = self.run.train
        if self.engine is None:
            longest = max(map(len, self.ids), default=1)
            self.engine = eval_engine(
                self.run, self.placed, weights, longest_prompt=longest, max_new_tokens=t.eval_max_new_tokens
            )
        else:
            self.engine.update_weights(weights[0], weights[1] or None, mode="abort")
        outs = [c[0] for c in complete(self.engine, self.ids, self.tokenizer, max_new_tokens=t.eval_max_new_tokens)]
        correct = sum(bool(check_answer(p.task, o.text)) for p, o in zip(self.prompts, outs))
        return {
            "exact_match": correct / max(len(self.prompts), 1),
            "response_length": float(np.mean([o.length for o in outs])) if outs else 0.0,
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
