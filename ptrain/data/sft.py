"""The SFT pipeline: rows -> tokenised examples -> shuffle -> epochs -> packing -> batches.

    source (generated | JSONL | Parquet | Arrow)
      -> validate + tokenise every row once (bad rows counted, see report.py)
      -> grain.MapDataset over the examples -> shard -> seeded shuffle -> repeat (epochs)
      -> next-token shift, epoch tag -> to_iter_dataset
      -> first-fit packing (segment ids, per-segment positions) or padding
      -> batch -> the batch contract (ptrain/__init__.py)

Batches are dicts of numpy arrays, all [B, L]: input_ids, target_ids (int32),
loss_mask (float32), segment_ids, positions (int32). The shift happens per example
before packing, so no target ever crosses into the next segment, and positions restart
at 0 in every segment, so a packed row computes what the separate examples would.

Tokenising up front (a few seconds for 20k rows) gives a complete bad-row report before
any compute and lets `bad_rows=fail` stop a run at once. The examples then live in a
Grain `MapDataset`, so the whole iterator (shuffle order, epoch, packer buffers) is one
Grain state: `get_state()` / `set_state()` resume exactly, also across epoch boundaries
(grain_ops.DataIterator).
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from ptrain.config.data import DataConfig
from ptrain.data.chat import TokenizedRows, tokenize_sft_rows
from ptrain.data.grain_ops import (
    READ_OPTIONS,
    DataIterator,
    cached_split,
    examples_dataset,
    finish,
    pad_to,
    shuffle_seed,
)
from ptrain.data.reasoning import ReasoningControls
from ptrain.data.report import BadRowReport
from ptrain.data.tool_hallucination import ToolHallucination

CONTRACT_KEYS = ("input_ids", "target_ids", "loss_mask", "segment_ids", "positions")


def sft_examples(
    cfg: DataConfig, tokenizer, *, seq_len: int, split: str = "train"
) -> tuple[TokenizedRows, BadRowReport]:
    """Validated, tokenised SFT examples of one split (cached per process) and their bad-row report.

    Training rows carry the reasoning-off and thinking-budget transforms at the shares of
    cfg.reasoning (ptrain/data/reasoning.py) and the planted calls to undeclared tools of
    cfg.tool_hallucination (ptrain/data/tool_hallucination.py), chosen by the shuffle seed
    and row index."""
    r = cfg.reasoning

    def rows(source):
        if split != "train":
            return source
        if r.strip or r.budget:
            source = ReasoningControls(source, tokenizer, strip=r.strip, budget=r.budget, seed=shuffle_seed(cfg))
        if cfg.tool_hallucination:
            source = ToolHallucination(source, share=cfg.tool_hallucination, seed=shuffle_seed(cfg))
        return source

    return cached_split(
        cfg,
        tokenizer,
        seq_len=seq_len,
        split=split,
        what="sft",
        tokenize=lambda source, name: tokenize_sft_rows(
            rows(source),
            tokenizer,
            fmt=cfg.format,
            seq_len=seq_len,
            truncate=cfg.truncate,
            bad_rows=cfg.bad_rows,
            max_bad_fraction=cfg.max_bad_fraction,
            report_rows=cfg.report_rows,
            name=name,
        ),
    )


# --------------------------------------------------------------------------- transforms
# Top-level classes (not lambdas) so that Grain worker processes can pickle them.


class _ShiftAndTag(grain.transforms.MapWithIndex):
    """Example -> next-token features, tagged with its epoch (global index // epoch size)."""

    def __init__(self, epoch_size: int):
        self.epoch_size = epoch_size

    def map_with_index(self, index: int, ex: dict[str, Any]) -> dict[str, np.ndarray]:
        tokens, mask = ex["tokens"], ex["mask"]
        n = len(tokens) - 1
        return {
            "input_ids": tokens[:-1].astype(np.int32),
            "target_ids": tokens[1:].astype(np.int32),
            "loss_mask": mask[1:].astype(np.float32),
            "epoch": np.full(n, index // self.epoch_size, np.int32),
        }


class _PadExample(grain.transforms.Map):
    """Unpacked layout: one example per row, padded to seq_len (segment 1, padding 0)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def map(self, ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(ex["input_ids"])
        out = {k: pad_to(v, self.seq_len) for k, v in ex.items()}
        out["input_ids_segment_ids"] = pad_to(np.ones(n, np.int32), self.seq_len)
        out["input_ids_positions"] = pad_to(np.arange(n, dtype=np.int32), self.seq_len)
        return out


class _ToContract(grain.transforms.Map):
    """Packed/padded batch -> the batch contract (plus 'epoch', popped by the iterator)."""

    def __init__(self, batch_size: int = 0):
        self.batch_size = batch_size  # > 0: pad a short final batch with empty rows (eval)

    def map(self, b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {
            "input_ids": b["input_ids"].astype(np.int32),
            "target_ids": b["target_ids"].astype(np.int32),
            "loss_mask": b["loss_mask"].astype(np.float32),
            "segment_ids": b["input_ids_segment_ids"].astype(np.int32),
            "positions": b["input_ids_positions"].astype(np.int32),
        }
        if "epoch" in b:
            out["epoch"] = b["epoch"].astype(np.int32)
        if self.batch_size and out["input_ids"].shape[0] < self.batch_size:
            extra = self.batch_size - out["input_ids"].shape[0]
            out = {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)]) for k, v in out.items()}
        return out


def _pack_or_pad(
    ds: grain.IterDataset, cfg: DataConfig, *, batch_size: int, seq_len: int, seed: int, shuffle_bins: bool
) -> grain.IterDataset:
    if cfg.packing:
        lengths = {"input_ids": seq_len, "target_ids": seq_len, "loss_mask": seq_len, "epoch": seq_len}
        return grain.experimental.FirstFitPackIterDataset(
            ds,
            length_struct=lengths,
            num_packing_bins=cfg.packing_bins or batch_size,
            seed=seed,
            shuffle_bins=shuffle_bins,
        )
    return ds.map(_PadExample(seq_len))


def make_sft_dataset(
    cfg: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | None = None,
    split: str = "train",
    shard_index: int = 0,
    shard_count: int = 1,
) -> tuple[grain.IterDataset, BadRowReport, int]:
    """(Grain dataset of SFT batches, bad-row report, examples per epoch) for one split.

    train: seeded shuffle, cfg.num_epochs passes (None: forever), full batches only.
    eval: one pass in file order, the last batch padded with empty rows (segment 0).
    batch_size is per process (rows of shard_index of shard_count).
    """
    ds, rep, n, _ = _sft_dataset_and_examples(
        cfg,
        tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        split=split,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    return ds, rep, n


def _sft_dataset_and_examples(
    cfg: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | None,
    split: str,
    shard_index: int,
    shard_count: int,
):
    """make_sft_dataset's work, also returning the tokenised examples (for the iterator's fingerprint)."""
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
    if cfg.format == "preference":
        raise ValueError(
            "data.format=preference is for DPO stages (make_preference_iterator); an SFT stage needs "
            "chat, prompt_completion or auto"
        )
    examples, rep = sft_examples(cfg, tokenizer, seq_len=seq_len, split=split)
    seed = shuffle_seed(cfg, seed)
    ds, n = sft_batches(
        examples,
        cfg,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        train=split == "train",
        shard_index=shard_index,
        shard_count=shard_count,
    )
    return ds, rep, n, examples


def sft_batches(
    examples,
    cfg: DataConfig,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    train: bool,
    shard_index: int = 0,
    shard_count: int = 1,
) -> tuple[grain.IterDataset, int]:
    """The Grain part: tokenised examples ({tokens, mask} of <= seq_len + 1 tokens) -> contract batches.

    Returns (dataset, examples per epoch of this shard). Uses cfg.shuffle, num_epochs,
    packing, packing_bins and num_workers.
    """
    ds, n = examples_dataset(
        examples,
        seed=seed,
        shuffle=train and cfg.shuffle,
        num_epochs=cfg.num_epochs if train else 1,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    it_ds = ds.map_with_index(_ShiftAndTag(n)).to_iter_dataset(READ_OPTIONS)
    it_ds = _pack_or_pad(it_ds, cfg, batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle_bins=train)
    it_ds = it_ds.batch(batch_size, drop_remainder=train)
    it_ds = it_ds.map(_ToContract(0 if train else batch_size))
    return finish(it_ds, cfg.num_workers), n


def make_sft_iterator(
    cfg: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | None = None,
    split: str = "train",
    shard_index: int = 0,
    shard_count: int = 1,
) -> DataIterator:
    """Iterator of SFT batches (the batch contract, numpy [B, L]) with exact get_state/set_state.

    split='train' repeats per cfg.num_epochs; split='eval' is one finite pass over the
    held-out rows (build a new one for each evaluation). `.report` is the bad-row report,
    `.epoch` the epoch of the last batch. seed None uses cfg.shuffle_seed.
    """
    ds, rep, n, examples = _sft_dataset_and_examples(
        cfg,
        tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        split=split,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    return DataIterator(iter(ds), rep, n, examples)


# --------------------------------------------------------------------------- packed vs unpacked


def pack_examples(
    examples: list[dict[str, np.ndarray]], seq_len: int
) -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
    """First-fit pack shifted examples ({input_ids, target_ids, loss_mask} [n_i]) into rows.

    Returns (batch in the contract layout [R, seq_len], placements) where placements[k] =
    (row, segment_id, start column) of example k. Used to check that a packed batch gives
    the same per-token losses as the unpacked one (`unpacked_batch`).
    """
    rows: list[list[int]] = []  # example indices per row
    used: list[int] = []
    for k, ex in enumerate(examples):
        n = len(ex["input_ids"])
        if n > seq_len:
            raise ValueError(f"example {k} has {n} tokens, more than seq_len={seq_len}")
        for r in range(len(rows)):
            if used[r] + n <= seq_len:
                rows[r].append(k)
                used[r] += n
                break
        else:
            rows.append([k])
            used.append(n)
    batch = {
        key: np.zeros((len(rows), seq_len), np.float32 if key == "loss_mask" else np.int32) for key in CONTRACT_KEYS
    }
    placements: list[tuple[int, int, int]] = [(0, 0, 0)] * len(examples)
    for r, members in enumerate(rows):
        col = 0
        for s, k in enumerate(members, start=1):
            ex = examples[k]
            n = len(ex["input_ids"])
            for key in ("input_ids", "target_ids", "loss_mask"):
                batch[key][r, col : col + n] = ex[key]
            batch["segment_ids"][r, col : col + n] = s
            batch["positions"][r, col : col + n] = np.arange(n)
            placements[k] = (r, s, col)
            col += n
    return batch, placements


def unpacked_batch(examples: list[dict[str, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """One example per row, padded to seq_len, in the contract layout [len(examples), seq_len]."""
    pad = _PadExample(seq_len)
    rows = [pad.map({k: ex[k] for k in ("input_ids", "target_ids", "loss_mask")}) for ex in examples]
    stacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return _ToContract().map(stacked)


def shifted_examples(
    cfg: DataConfig, tokenizer, *, seq_len: int, n: int, split: str = "train"
) -> list[dict[str, np.ndarray]]:
    """The first n examples of a split as next-token features (for packed/unpacked checks)."""
    examples, _ = sft_examples(cfg, tokenizer, seq_len=seq_len, split=split)
    shift = _ShiftAndTag(len(examples))
    return [
        {k: v for k, v in shift.map_with_index(i, examples[i]).items() if k != "epoch"}
        for i in range(min(n, len(examples)))
    ]
