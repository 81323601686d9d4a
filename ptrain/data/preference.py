"""Preference pairs (DPO family): prompt + chosen + rejected -> padded token batches.

Rows: {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
(the TRL layout; a str completion is one assistant turn). Each side is tokenised as
prompt + completion with the chat template; its loss mask covers the completion's
assistant tokens only. Bad pairs are counted like bad SFT rows: missing field, wrong
type, unknown role, empty completion, identical chosen and rejected, too long.

Batches (numpy, [B, L] unless noted), the SFT contract once per side:
  chosen_input_ids, chosen_target_ids, chosen_loss_mask, chosen_segment_ids, chosen_positions
  rejected_input_ids, ... (the same five)
  pair_index  int32 [B]  index of the pair in the tokenised split (-1: padding row of a
              final eval batch), to look up per-pair values precomputed in one pass, such
              as reference log-probs.
Sequence-level sums over the loss mask give the per-sequence log-probs of the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from ptrain.config.data import DataConfig
from ptrain.data import report as R
from ptrain.data.chat import (
    RowProblem,
    TokenizedRows,
    as_messages,
    fit_length,
    tokenize_conversations,
    tokenize_pass,
)
from ptrain.data.grain_ops import (
    READ_OPTIONS,
    DataIterator,
    cached_split,
    examples_dataset,
    finish,
    pad_to,
    shuffle_seed,
)
from ptrain.data.report import BadRowReport

SIDES = ("chosen", "rejected")


def preference_conversations(row: dict[str, Any]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of one row, validated; raises RowProblem."""
    for key in ("prompt", "chosen", "rejected"):
        if key not in row:
            raise RowProblem(R.MISSING_FIELD, f"no '{key}' field (a preference row needs prompt, chosen, rejected)")
    prompt = as_messages(row["prompt"], "prompt", "user")
    sides = []
    for key in SIDES:
        try:
            msgs = as_messages(row[key], key, "assistant")
        except RowProblem as p:
            if p.reason == R.EMPTY_ASSISTANT:
                raise RowProblem(R.EMPTY_COMPLETION, p.problem) from None
            raise
        if not any(m["role"] == "assistant" for m in msgs):
            raise RowProblem(R.EMPTY_COMPLETION, f"'{key}' has no assistant turn")
        sides.append(msgs)
    if sides[0] == sides[1]:
        raise RowProblem(R.IDENTICAL_PAIR, "chosen and rejected are identical; the pair carries no preference")
    return prompt, sides[0], sides[1]


class PreferencePairs:
    """Tokenised pairs: item i is {"chosen": {tokens, mask}, "rejected": {tokens, mask}, "index": i, "row": r}."""

    def __init__(self, chosen: TokenizedRows, rejected: TokenizedRows):
        self.chosen, self.rejected = chosen, rejected

    def __len__(self) -> int:
        return len(self.chosen)

    def __getitem__(self, i: int) -> dict[str, Any]:
        c, r = self.chosen[i], self.rejected[i]
        return {"chosen": c, "rejected": r, "index": i, "row": c["row"]}


def tokenize_preference_rows(
    source,
    tokenizer,
    *,
    seq_len: int,
    truncate: bool,
    bad_rows: str = "skip",
    max_bad_fraction: float = 0.5,
    report_rows: int = 10,
    name: str | None = None,
) -> tuple[PreferencePairs, BadRowReport]:
    """Validate and tokenise every pair; each side holds at most seq_len + 1 tokens."""

    def tokenize(convs: list[tuple[list, list, list]]) -> list:
        flat = [
            (prompt + completion, len(prompt))
            for prompt, chosen, rejected in convs
            for completion in (chosen, rejected)
        ]
        tokens = tokenize_conversations(tokenizer, flat)
        return [(tokens[2 * k], tokens[2 * k + 1]) for k in range(len(convs))]

    def check(pair):
        out, cut = [], False
        for key, (ids, mask) in zip(SIDES, pair):
            if not mask[1:].any():
                raise RowProblem(R.EMPTY_COMPLETION, f"the chat template left no {key} token to train on")
            ids, mask, was_cut = fit_length(ids, mask, seq_len + 1, truncate)
            out.append((ids, mask))
            cut = cut or was_cut
        (c_ids, c_mask), (r_ids, r_mask) = out
        if cut and np.array_equal(c_ids, r_ids) and np.array_equal(c_mask, r_mask):
            raise RowProblem(
                R.IDENTICAL_PAIR,
                f"chosen and rejected differ only past data.seq_len={seq_len} "
                "tokens, so truncation made them identical; raise seq_len or drop the pair",
            )
        return tuple(out), cut

    rep = BadRowReport(source=name or repr(source), policy=bad_rows, keep_rows=report_rows)
    pairs, rows = tokenize_pass(
        source,
        parse=preference_conversations,
        tokenize=tokenize,
        check=check,
        report=rep,
        max_bad_fraction=max_bad_fraction,
    )
    return PreferencePairs(TokenizedRows([p[0] for p in pairs], rows), TokenizedRows([p[1] for p in pairs], rows)), rep


def preference_examples(
    cfg: DataConfig, tokenizer, *, seq_len: int, split: str = "train"
) -> tuple[PreferencePairs, BadRowReport]:
    """Tokenised pairs of one split (cached per process) and their bad-row report."""
    return cached_split(
        cfg,
        tokenizer,
        seq_len=seq_len,
        split=split,
        what="preference",
        tokenize=lambda source, name: tokenize_preference_rows(
            source,
            tokenizer,
            seq_len=seq_len,
            truncate=cfg.truncate,
            bad_rows=cfg.bad_rows,
            max_bad_fraction=cfg.max_bad_fraction,
            report_rows=cfg.report_rows,
            name=name,
        ),
    )


class _PairToArrays(grain.transforms.MapWithIndex):
    """Pair -> padded next-token features per side, tagged with its epoch."""

    def __init__(self, seq_len: int, epoch_size: int):
        self.seq_len, self.epoch_size = seq_len, epoch_size

    def map_with_index(self, index: int, pair: dict[str, Any]) -> dict[str, np.ndarray]:
        L = self.seq_len
        out: dict[str, np.ndarray] = {}
        for side in SIDES:
            tokens, mask = pair[side]["tokens"], pair[side]["mask"]
            n = len(tokens) - 1
            out[f"{side}_input_ids"] = pad_to(tokens[:-1].astype(np.int32), L)
            out[f"{side}_target_ids"] = pad_to(tokens[1:].astype(np.int32), L)
            out[f"{side}_loss_mask"] = pad_to(mask[1:].astype(np.float32), L)
            out[f"{side}_segment_ids"] = pad_to(np.ones(n, np.int32), L)
            out[f"{side}_positions"] = pad_to(np.arange(n, dtype=np.int32), L)
        out["pair_index"] = np.int32(pair["index"])
        out["epoch"] = np.int32(index // self.epoch_size)
        return out


class _PadPairBatch(grain.transforms.Map):
    """Fill a short final eval batch with empty rows (pair_index -1)."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def map(self, b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        extra = self.batch_size - b["pair_index"].shape[0]
        if extra <= 0:
            return b
        out = {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)]) for k, v in b.items()}
        out["pair_index"][-extra:] = -1
        return out


def make_preference_iterator(
    cfg: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | None = None,
    split: str = "train",
    shuffle: bool | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
) -> DataIterator:
    """Iterator of preference batches (see the module docstring) with exact get_state/set_state.

    split='train': seeded shuffle (cfg.shuffle, or the shuffle argument when given),
    cfg.num_epochs passes, full batches only. split='eval': one pass in order, the last
    batch padded (pair_index -1). For a one-pass precompute over the training pairs use
    `make_preference_pass`.
    """
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
    pairs, rep = preference_examples(cfg, tokenizer, seq_len=seq_len, split=split)
    seed = shuffle_seed(cfg, seed)
    train = split == "train"
    do_shuffle = (train and cfg.shuffle) if shuffle is None else shuffle
    ds, n = examples_dataset(
        pairs,
        seed=seed,
        shuffle=do_shuffle,
        num_epochs=cfg.num_epochs if train else 1,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    it_ds = ds.map_with_index(_PairToArrays(seq_len, n)).to_iter_dataset(READ_OPTIONS)
    it_ds = it_ds.batch(batch_size, drop_remainder=train)
    if not train:
        it_ds = it_ds.map(_PadPairBatch(batch_size))
    return DataIterator(iter(finish(it_ds, cfg.num_workers)), rep, n, pairs)


def make_preference_pass(
    cfg: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seq_len: int,
    split: str = "train",
    shard_index: int = 0,
    shard_count: int = 1,
) -> DataIterator:
    """One in-order pass over a split's pairs, last batch padded: for precomputing per-pair values
    (e.g. reference log-probs, stored by pair_index)."""
    one = dataclasses.replace(cfg, num_epochs=1, shuffle=False)
    pairs, rep = preference_examples(one, tokenizer, seq_len=seq_len, split=split)
    ds, n = examples_dataset(
        pairs, seed=0, shuffle=False, num_epochs=1, shard_index=shard_index, shard_count=shard_count
    )
    it_ds = ds.map_with_index(_PairToArrays(seq_len, n)).to_iter_dataset(READ_OPTIONS)
    it_ds = it_ds.batch(batch_size, drop_remainder=False).map(_PadPairBatch(batch_size))
    return DataIterator(iter(it_ds), rep, n)
