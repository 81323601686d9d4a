"""Plumbing every Grain iterator of ptrain shares: SFT batches, preference pairs, RL prompts.

  cached_split        tokenise a split once per process (keyed by files, tokenizer, limits)
  shuffle_seed        the seed an iterator shuffles with
  examples_dataset    tokenised examples -> grain.MapDataset: shard -> seeded shuffle -> repeat
  READ_OPTIONS        in-process reads (the examples are in memory already)
  finish              optional worker processes at the end of a pipeline
  pad_to              zero-pad an array along its first axis
  DataIterator        the iterator a stage trains from: epoch, bad-row report, exact resume
                      that refuses changed data (DataChangedError)

Iterator state is Grain's own (shuffle order, epoch, packer buffers) plus a fingerprint of
the examples, so `grain.checkpoint.CheckpointHandler` saves it in the Orbax checkpoint and
a resume continues exactly where the run stopped.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import grain
import numpy as np

from ptrain.config.data import DataConfig
from ptrain.config.seeds import seed_or_default
from ptrain.data.chat import TokenizedRows
from ptrain.data.report import BadRowReport
from ptrain.data.sources import TABLE_EXTENSIONS, generated_task_seed, open_split, table_files

# --------------------------------------------------------------------------- tokenised examples

_CACHE: dict[tuple, tuple[Any, BadRowReport]] = {}
_CACHE_SIZE = 8  # splits x settings kept per process (train + eval of an SFT and a DPO stage fit)


def _cache_key(cfg: DataConfig, tokenizer, split: str, seq_len: int, what: str) -> tuple:
    if cfg.source == "generated":
        g = cfg.generated
        where: tuple = (
            "generated",
            g.n_train,
            g.n_eval,
            g.min_digits,
            g.max_digits,
            tuple(g.ops),
            generated_task_seed(cfg),
            g.noise,
        )
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
        (cfg.reasoning.strip, cfg.reasoning.budget, cfg.tool_hallucination, shuffle_seed(cfg))
        if split == "train"
        else None,
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


def clear_cache() -> None:
    """Forget tokenised examples (tests that rewrite a file in place use it)."""
    _CACHE.clear()


# --------------------------------------------------------------------------- Grain datasets

READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
"""Read options of `to_iter_dataset`: no reader threads, since the examples are in memory already."""


def shuffle_seed(cfg: DataConfig, seed: int | None = None) -> int:
    """The shuffle seed of an iterator: `seed` when given, else data.shuffle_seed (derived from
    the default top-level seed when that is null, as in a DataConfig built on its own)."""
    return seed_or_default(cfg.shuffle_seed, "data.shuffle_seed") if seed is None else seed


def examples_dataset(
    examples, *, seed: int, shuffle: bool, num_epochs: int | None, shard_index: int = 0, shard_count: int = 1
) -> tuple[grain.MapDataset, int]:
    """(MapDataset over this shard's examples, shuffled with `seed` per epoch and repeated
    `num_epochs` times (None: forever), examples per epoch of the shard)."""
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


def finish(it_ds: grain.IterDataset, num_workers: int) -> grain.IterDataset:
    """The pipeline as it is (num_workers=0) or run in that many Grain worker processes."""
    if num_workers > 0:
        # Grain's worker processes read absl flags; a program that is not an absl app never
        # parsed them, and the defaults are what we want.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return it_ds


def pad_to(x: np.ndarray, n: int) -> np.ndarray:
    """x zero-padded along its first axis to length n (x must not be longer)."""
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
