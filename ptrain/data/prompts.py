"""Prompts: held-out prompts for exact-match evaluation, and batches of prompts for RL stages.

A prompt is every turn of a row before its last assistant turn (for a preference row,
its prompt), tokenised with the chat template up to the assistant's generation prompt,
with the row's task metadata for the verifier (`EvalPrompt`). `make_prompt_iterator`
shuffles and repeats them like the SFT iterator, with the same exact resume;
`batch_prompts` lays a list of them out in fixed shapes for generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ptrain.config.data import DataConfig
from ptrain.data import report as R
from ptrain.data.chat import RowProblem, prompt_ids, row_location, sft_conversation
from ptrain.data.grain_ops import READ_OPTIONS, DataIterator, examples_dataset, finish, shuffle_seed
from ptrain.data.preference import preference_conversations
from ptrain.data.report import BadRowReport
from ptrain.data.sources import RowDecodeError, open_split
from ptrain.data.tasks import extract_answer


@dataclass
class EvalPrompt:
    """One held-out prompt for exact-match generation evaluation (or an RL prompt)."""

    prompt_ids: np.ndarray
    """[P] int32: the conversation up to the assistant's generation prompt."""
    task: dict[str, Any] | None
    """Verification metadata (e.g. {"kind": "arithmetic", "answer": "936", ...}); None if the row has none."""
    reference: str
    """The row's own final assistant answer (the SFT target)."""
    row: int
    """Row index in the source."""


def make_eval_prompts(
    cfg: DataConfig, tokenizer, *, split: str = "eval", limit: int | None = None, report: BadRowReport | None = None
) -> list[EvalPrompt]:
    """Prompts of a split: every turn before the last assistant turn, with its task metadata.

    Rows that are bad for SFT are skipped; with `report` each one is counted there with its
    row number (and `bad_rows=fail` raises at the first), otherwise the SFT stage's own
    report of the same file counts them.
    """
    source = open_split(cfg, split)
    out: list[EvalPrompt] = []
    for i in range(len(source)):
        if limit is not None and len(out) >= limit:
            break
        if report is not None:
            report.total += 1
        try:
            try:
                row = source[i]
            except RowDecodeError as e:
                raise RowProblem(R.INVALID_JSON, str(e)) from None
            if cfg.format == "preference" or "chosen" in row:
                prompt, chosen, _ = preference_conversations(row)
                reference = chosen[-1]["content"]
            else:
                messages, _ = sft_conversation(row, cfg.format)
                last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
                prompt, reference = messages[:last], messages[last]["content"]
        except RowProblem as p:
            if report is not None:
                report.add(p.reason, i, row_location(source, i), p.problem)
            continue
        if report is not None:
            report.good += 1
        task = row.get("task") if isinstance(row.get("task"), dict) else None
        if task is None and extract_answer(reference) is not None:
            task = {"answer": extract_answer(reference)}
        out.append(EvalPrompt(prompt_ids(tokenizer, prompt), task, reference, i))
    return out


class _PromptList:
    """Grain batch_fn: a batch of prompts is a plain list (they have different lengths)."""

    def __call__(self, prompts):
        return list(prompts)


def make_prompt_iterator(
    cfg: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seed: int | None = None,
    split: str = "train",
    shard_index: int = 0,
    shard_count: int = 1,
) -> DataIterator:
    """Iterator of prompt batches (lists of EvalPrompt with task metadata) for RL stages.

    Seeded shuffle and cfg.num_epochs passes over the split's prompts, full batches only,
    exact get_state/set_state like the SFT iterator. `.report` is the SFT report of the split.
    """
    rep = BadRowReport(source=f"{split} prompts", policy=cfg.bad_rows, keep_rows=cfg.report_rows)
    prompts = make_eval_prompts(cfg, tokenizer, split=split, report=rep)
    rep.finish(cfg.max_bad_fraction)
    seed = shuffle_seed(cfg, seed)
    ds, n = examples_dataset(
        prompts,
        seed=seed,
        shuffle=cfg.shuffle,
        num_epochs=cfg.num_epochs,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    it_ds = ds.to_iter_dataset(READ_OPTIONS).batch(batch_size, drop_remainder=True, batch_fn=_PromptList())
    return DataIterator(iter(finish(it_ds, cfg.num_workers)), rep, n, prompts)


def batch_prompts(
    prompts: list[EvalPrompt], batch_size: int, pad_id: int, *, pad_to: int | None = None, side: str = "left"
) -> Iterator[dict[str, Any]]:
    """Fixed-shape prompt batches for generation (one compile per shape).

    Yields {"prompt_ids": int32 [B, P], "prompt_lens": int32 [B], "valid": bool [B],
    "prompts": list of EvalPrompt (len <= B)}. P = pad_to or the longest prompt overall;
    side 'left' right-aligns prompts (pad first), 'right' pads after. A short final batch
    is filled with copies of a padding row marked valid=False.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be left or right, got '{side}'")
    longest = max((len(p.prompt_ids) for p in prompts), default=1)
    width = pad_to or longest
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids = np.full((batch_size, width), pad_id, np.int32)
        lens = np.zeros(batch_size, np.int32)
        for r, p in enumerate(chunk):
            n = len(p.prompt_ids)
            lens[r] = n
            if side == "left":
                ids[r, width - n :] = p.prompt_ids
            else:
                ids[r, :n] = p.prompt_ids
        valid = np.arange(batch_size) < len(chunk)
        yield {"prompt_ids": ids, "prompt_lens": lens, "valid": valid, "prompts": chunk}
