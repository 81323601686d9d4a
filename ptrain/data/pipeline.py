"""Grain pipelines: rows -> tokenised examples -> shuffle -> epochs -> packing -> batches.

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
Grain state: `get_state()` / `set_state()` resume exactly, also across epoch boundaries,
and `grain.checkpoint.CheckpointHandler` saves it in the Orbax checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from ptrain.config.data import DataConfig
from ptrain.data import report as R
from ptrain.data import tasks
from ptrain.data.chat import RowProblem, TokenizedRows, prompt_ids, row_location, sft_conversation, tokenize_sft_rows
from ptrain.data.report import BadRowReport
from ptrain.data.sources import TABLE_EXTENSIONS, ListSource, RowDecodeError, open_source, table_files

SPLITS = ("train", "eval")
CONTRACT_KEYS = ("input_ids", "target_ids", "loss_mask", "segment_ids", "positions")


# --------------------------------------------------------------------------- sources


def generated_records(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """The embedded task's records of one split: chat rows, or preference rows for format=preference."""
    g = cfg.generated
    kind = "preference" if cfg.format == "preference" else "chat"
    train, held = tasks.generate_records(
        g.n_train, g.n_eval, kind=kind, ops=tuple(g.ops), min_digits=g.min_digits, max_digits=g.max_digits, seed=g.seed
    )
    return train if split == "train" else held


def write_generated(cfg: DataConfig, out_dir: str) -> DataConfig:
    """Write the generated task as JSONL into out_dir; return cfg pointing at those files.

    Files: train.jsonl and eval.jsonl (preference_train.jsonl / preference_eval.jsonl for
    format=preference). The returned config has source=jsonl; the data are the same rows
    the generated source would give, so either config trains identically.
    """
    if cfg.source != "generated":
        return cfg
    prefix = "preference_" if cfg.format == "preference" else ""
    g = cfg.generated
    splits = tasks.generate_records(
        g.n_train,
        g.n_eval,
        kind="preference" if prefix else "chat",
        ops=tuple(g.ops),
        min_digits=g.min_digits,
        max_digits=g.max_digits,
        seed=g.seed,
    )
    paths = {}
    for split, records in zip(SPLITS, splits):
        # Same rows as on disk (a resumed run): leave the file alone, so its mtime stays.
        paths[split] = tasks.write_jsonl(records, os.path.join(out_dir, f"{prefix}{split}.jsonl"), if_changed=True)
    return dataclasses.replace(cfg, source="jsonl", train_path=paths["train"], eval_path=paths["eval"])


def open_split(cfg: DataConfig, split: str):
    """Random-access source of the rows of one split ('train' or 'eval')."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; pass train or eval")
    if cfg.source == "generated":
        return ListSource(generated_records(cfg, split), name=f"generated {split}")
    path = cfg.train_path if split == "train" else cfg.eval_path
    if path is None:
        raise ValueError(f"no data.{split}_path is set, so there is no {split} split; pass data.{split}_path=FILE")
    return open_source(path, cfg.source)


# --------------------------------------------------------------------------- tokenised examples

_CACHE: dict[tuple, tuple[Any, BadRowReport]] = {}
_CACHE_SIZE = 8  # splits x settings kept per process (train + eval of an SFT and a DPO stage fit)


def _cache_key(cfg: DataConfig, tokenizer, split: str, seq_len: int, what: str) -> tuple:
    if cfg.source == "generated":
        g = cfg.generated
        where: tuple = ("generated", g.n_train, g.n_eval, g.min_digits, g.max_digits, tuple(g.ops), g.seed)
    else:
        path = cfg.train_path if split == "train" else cfg.eval_path
        files = table_files(path, cfg.source) if cfg.source in TABLE_EXTENSIONS and path else [path]
        where = (cfg.source, path) + tuple(
            (f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files if f and os.path.isfile(f)
        )
    return (
        what,
        where,
        split,
        tokenizer_fingerprint(tokenizer),
        cfg.format,
        seq_len,
        cfg.truncate,
        cfg.bad_rows,
        cfg.max_bad_fraction,
        cfg.report_rows,
    )


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary, merges, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    text = body + "\0" + str(getattr(tokenizer, "chat_template", None))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _remember(key: tuple, value: tuple) -> tuple:
    while len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))  # the oldest entry
    _CACHE[key] = value
    return value


def cached_split(cfg: DataConfig, tokenizer, *, seq_len: int, split: str, what: str, tokenize) -> tuple:
    """tokenize(source, name) of one split, cached per process under `what` and everything
    that changes the result (files and their mtimes, tokenizer, format, limits)."""
    key = _cache_key(cfg, tokenizer, split, seq_len, what)
    if key not in _CACHE:
        source = open_split(cfg, split)
        _remember(key, tokenize(source, getattr(source, "path", None) or getattr(source, "name", split)))
    return _CACHE[key]


def sft_examples(
    cfg: DataConfig, tokenizer, *, seq_len: int, split: str = "train"
) -> tuple[TokenizedRows, BadRowReport]:
    """Validated, tokenised SFT examples of one split (cached per process) and their bad-row report."""
    return cached_split(
        cfg,
        tokenizer,
        seq_len=seq_len,
        split=split,
        what="sft",
        tokenize=lambda source, name: tokenize_sft_rows(
            source,
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


def clear_cache() -> None:
    """Forget tokenised examples (tests that rewrite a file in place use it)."""
    _CACHE.clear()


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
        out = {k: _pad(v, self.seq_len) for k, v in ex.items()}
        out["input_ids_segment_ids"] = _pad(np.ones(n, np.int32), self.seq_len)
        out["input_ids_positions"] = _pad(np.arange(n, dtype=np.int32), self.seq_len)
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


def _pad(x: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n,) + x.shape[1:], x.dtype)
    out[: len(x)] = x
    return out


# --------------------------------------------------------------------------- iterators


class DataChangedError(ValueError):
    """A checkpoint's data-iterator state was taken on other examples than the run has now."""


def examples_fingerprint(examples) -> str:
    """sha256 of tokenised examples (TokenizedRows, PreferencePairs or a list of EvalPrompt):
    any change of a row, its tokens, its mask or their order changes it."""
    h = hashlib.sha256()
    parts = [examples.chosen, examples.rejected] if hasattr(examples, "chosen") else [examples]
    for part in parts:
        if isinstance(part, TokenizedRows):
            for a in (part.offsets, part.tokens, part.mask, part.rows):
                h.update(np.ascontiguousarray(a).tobytes())
        else:
            for p in part:
                h.update(np.asarray(p.prompt_ids, np.int32).tobytes())
                h.update(int(p.row).to_bytes(8, "little"))
    return h.hexdigest()


class DataIterator(grain.DatasetIterator):
    """A Grain iterator over batches that also tells the epoch and the bad-row report.

    `epoch` is the highest epoch among the examples of the last batch (packing can mix
    the last rows of one epoch with the first of the next). State is the parent's Grain
    state plus the examples' count and fingerprint (`examples`), so that a resume on data
    that changed since the checkpoint (rows added, removed or edited, another tokenizer or
    seq_len), which would silently repeat some rows and skip others, stops with
    `DataChangedError` instead. States without that entry (older checkpoints) load as before.
    """

    STATE_KEY = "ptrain_examples"

    def __init__(self, parent: grain.DatasetIterator, report: BadRowReport, n_examples: int, examples=None):
        super().__init__(parent)
        self.report = report
        self.n_examples = n_examples
        self.epoch = 0
        self._examples = examples
        self._fingerprint: str | None = None

    def _identity(self) -> dict[str, Any] | None:
        if self._examples is None:
            return None
        if self._fingerprint is None:  # hashed on the first save or resume only
            self._fingerprint = examples_fingerprint(self._examples)
        return {"count": self.n_examples, "fingerprint": self._fingerprint}

    def __next__(self) -> Any:
        batch = next(self._parent)
        if isinstance(batch, dict) and "epoch" in batch:
            batch = dict(batch)
            self.epoch = int(batch.pop("epoch").max())
        return batch

    def get_state(self) -> dict[str, Any]:
        state = dict(self._parent.get_state())
        identity = self._identity()
        if identity is not None:
            state[self.STATE_KEY] = identity
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved, now = state.pop(self.STATE_KEY, None), self._identity()
        if saved is not None and now is not None and saved != now:
            raise DataChangedError(
                f"the training examples differ from those the checkpoint was taken on ({saved['count']} examples, "
                f"fingerprint {saved['fingerprint'][:12]} then; {now['count']}, {now['fingerprint'][:12]} now): "
                "resuming would repeat some rows and skip others. Restore the run's data files, tokenizer and "
                "data/train settings, or start the stage again in a new run_dir"
            )
        self._parent.set_state(state)


def _examples_dataset(
    examples, *, seed: int, shuffle: bool, num_epochs: int | None, shard_index: int, shard_count: int
) -> tuple[grain.MapDataset, int]:
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    ds = grain.MapDataset.source(examples)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    n = len(ds)
    if n == 0:
        raise ValueError(f"shard {shard_index} of {shard_count} has no examples; use fewer data shards or more rows")
    if shuffle:
        ds = ds.shuffle(seed)
    ds = ds.repeat(num_epochs)
    return ds, n


_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # examples are in memory already


def _finish(it_ds: grain.IterDataset, num_workers: int) -> grain.IterDataset:
    if num_workers > 0:
        # Grain's worker processes read absl flags; a program that is not an absl app never
        # parsed them, and the defaults are what we want.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return it_ds


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
    seed = cfg.shuffle_seed if seed is None else seed
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
    ds, n = _examples_dataset(
        examples,
        seed=seed,
        shuffle=train and cfg.shuffle,
        num_epochs=cfg.num_epochs if train else 1,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    it_ds = ds.map_with_index(_ShiftAndTag(n)).to_iter_dataset(_READ)
    it_ds = _pack_or_pad(it_ds, cfg, batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle_bins=train)
    it_ds = it_ds.batch(batch_size, drop_remainder=train)
    it_ds = it_ds.map(_ToContract(0 if train else batch_size))
    return _finish(it_ds, cfg.num_workers), n


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


# --------------------------------------------------------------------------- evaluation prompts


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
    from ptrain.data.preference import preference_conversations  # preference imports this module

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
        if task is None and tasks.extract_answer(reference) is not None:
            task = {"answer": tasks.extract_answer(reference)}
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
    seed = cfg.shuffle_seed if seed is None else seed
    ds, n = _examples_dataset(
        prompts,
        seed=seed,
        shuffle=cfg.shuffle,
        num_epochs=cfg.num_epochs,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    it_ds = ds.to_iter_dataset(_READ).batch(batch_size, drop_remainder=True, batch_fn=_PromptList())
    return DataIterator(iter(_finish(it_ds, cfg.num_workers)), rep, n, prompts)


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
