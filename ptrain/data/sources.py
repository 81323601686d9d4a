"""Random-access row sources over local files, usable as Grain `MapDataset.source(...)`.

Grain reads sources from a thread pool, and worker processes pickle them, so:
- `JsonlSource` indexes line offsets once and reads each row with `os.pread` (no shared
  file position: a shared handle gave interleaved reads and JSONDecodeError under
  threads); it reopens its descriptor after unpickling.
- `TableSource` (`ParquetSource`, `ArrowSource`) holds an immutable pyarrow Table (safe
  to read from many threads) and converts one row at a time to Python objects; Arrow
  covers Hugging Face `datasets` caches and `save_to_disk` folders.

Rows come back as Python dicts. A row that cannot be decoded raises `RowDecodeError`,
which the tokenisation pass turns into a counted bad row.

`open_split(cfg, split)` is where a DataConfig's rows come from: the embedded task's
records (`generated_records`, or `write_generated`'s JSONL files) or the local files.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ptrain.config.data import TABLE_EXTENSIONS, DataConfig
from ptrain.config.seeds import seed_or_default
from ptrain.data import tasks

SPLITS = ("train", "eval")


class RowDecodeError(ValueError):
    """A row that is not valid JSON (or not a JSON object)."""


class JsonlSource:
    """Rows of a JSONL file. Blank lines are not rows; `line_number(i)` maps back (1-based)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"JSONL file '{path}' does not exist; pass the path of a local .jsonl file")
        self.path = path
        offsets, lengths, lines = [], [], []
        pos = 0
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(pos)
                    lengths.append(len(raw))
                    lines.append(line_no)
                pos += len(raw)
        self._offsets, self._lengths, self._lines = offsets, lengths, lines
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._offsets)

    def line_number(self, index: int) -> int:
        return self._lines[index]

    def where(self, index: int) -> str:
        return f"{self.path} row {index} (line {self._lines[index]})"

    def __getitem__(self, index: int) -> dict[str, Any]:
        raw = os.pread(self._fd, self._lengths[index], self._offsets[index])
        if index == 0 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark (some editors write one) is not part of the row
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RowDecodeError(f"invalid JSON: {e}") from None
        if not isinstance(row, dict):
            raise RowDecodeError(f"a row must be a JSON object, got {type(row).__name__}")
        return row

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_fd"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"JsonlSource({self.path!r}, rows={len(self)})"


class TableSource:
    """Rows of Parquet or Arrow data (nested columns such as `messages` come back as lists of dicts).

    path: one file, a folder of them, or a glob such as `data/train-*.parquet` (Hugging
    Face's sharded layout); shards are read in sorted name order and concatenated, and
    `where` names the shard and the row inside it. kind 'arrow' reads Arrow IPC files, the
    format of a `datasets` cache or `save_to_disk` folder (data-00000-of-00001.arrow).
    The table is immutable, so Grain's reader threads can share it.
    """

    def __init__(self, path: str, kind: str = "parquet"):
        import pyarrow as pa

        self.path, self.kind = path, kind
        self.files = table_files(path, kind)
        tables = [_read_table(f, kind) for f in self.files]
        self._starts = np.cumsum([0] + [t.num_rows for t in tables])
        try:
            self._table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
        except pa.ArrowInvalid as e:
            raise ValueError(
                f"the {kind} shards of '{path}' have incompatible columns ({e}); pass shards of one dataset split"
            ) from None

    def __len__(self) -> int:
        return self._table.num_rows

    def where(self, index: int) -> str:
        if len(self.files) == 1:
            return f"{self.files[0]} row {index}"
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return f"{self.files[k]} row {index - int(self._starts[k])} (row {index} overall)"

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        return self._table.slice(index, 1).to_pylist()[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, rows={len(self)})"


class ParquetSource(TableSource):
    """Parquet file, folder or glob (see TableSource)."""

    def __init__(self, path: str):
        super().__init__(path, "parquet")


class ArrowSource(TableSource):
    """Arrow IPC file, folder or glob, e.g. a Hugging Face `datasets` cache (see TableSource)."""

    def __init__(self, path: str):
        super().__init__(path, "arrow")


def _read_table(path: str, kind: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.read_table(path)
    try:  # `datasets` writes the streaming format; feather v2 / `pa.ipc.new_file` the file format
        return pa.ipc.open_stream(pa.memory_map(path)).read_all()
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(pa.memory_map(path)).read_all()
        except pa.ArrowInvalid as e:
            raise ValueError(
                f"{path} is neither an Arrow stream nor an Arrow file ({e}); pass a valid .arrow "
                "file (as `datasets` or pyarrow.ipc write them), or a .parquet or .jsonl file"
            ) from None


class ListSource:
    """Rows held in memory (the generated task before it is written out, or tests)."""

    def __init__(self, rows: Sequence[dict[str, Any]], name: str = "rows"):
        self._rows = list(rows)
        self.name = name

    def __len__(self) -> int:
        return len(self._rows)

    def where(self, index: int) -> str:
        return f"{self.name} row {index}"

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._rows[index]

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, rows={len(self)})"


class RowTransform:
    """A row source over another whose rows a subclass rewrites on read (`__getitem__`). It
    keeps the other's length, row locations and file name, so a bad-row report still points
    at the row in the file."""

    def __init__(self, source):
        self.source = source
        for name in ("path", "name"):
            if hasattr(source, name):
                setattr(self, name, getattr(source, name))

    def __len__(self) -> int:
        return len(self.source)

    def where(self, index: int) -> str:
        return self.source.where(index) if hasattr(self.source, "where") else f"row {index}"


def _saved_dataset_files(folder: str) -> list[str] | None:
    """The shards a `datasets` save_to_disk folder lists in its state.json, in order; None when
    there is no such list. Other .arrow files there (`cache-*.arrow` from a .map) are not rows
    of the dataset."""
    try:
        with open(os.path.join(folder, "state.json")) as f:
            names = [d["filename"] for d in json.load(f).get("_data_files", [])]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return [os.path.join(folder, n) for n in names] or None


def table_files(path: str, kind: str = "parquet") -> list[str]:
    """The files a path names: the file itself, every file of the kind in a folder, or a glob's matches."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = _saved_dataset_files(path) if kind == "arrow" else None
        files = files or sorted(f for f in glob.glob(os.path.join(path, "*")) if f.endswith(TABLE_EXTENSIONS[kind]))
    else:
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
    if not files:
        ext = TABLE_EXTENSIONS[kind][0]
        raise FileNotFoundError(
            f"no {kind} data at '{path}'; pass a local {ext} file, a folder of them or a "
            f"glob such as data/train-*{ext} (nothing is downloaded)"
        )
    return files


def open_source(path: str, kind: str | None = None):
    """The source for path; kind 'jsonl' | 'parquet' | 'arrow', or None to go by the extension."""
    if kind is None:
        ext = os.path.splitext(path)[1].lower()
        kind = next((k for k, exts in TABLE_EXTENSIONS.items() if ext in exts), "jsonl")
    if kind == "jsonl":
        return JsonlSource(path)
    if kind in TABLE_EXTENSIONS:
        return TableSource(path, kind)
    raise ValueError(f"unknown source kind '{kind}'; pass jsonl, parquet or arrow")


# --------------------------------------------------------------------------- splits of a DataConfig


def generated_task_seed(cfg: DataConfig) -> int:
    """data.generated.seed, or the one derived from the default top-level seed when it is null."""
    return seed_or_default(cfg.generated.seed, "data.generated.seed")


def _generate(cfg: DataConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    g = cfg.generated
    return tasks.generate_records(
        g.n_train,
        g.n_eval,
        kind="preference" if cfg.format == "preference" else "chat",
        ops=tuple(g.ops),
        min_digits=g.min_digits,
        max_digits=g.max_digits,
        seed=generated_task_seed(cfg),
        noise=g.noise,
    )


def generated_records(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """The embedded task's records of one split: chat rows, or preference rows for format=preference."""
    train, held = _generate(cfg)
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
    paths = {}
    for split, records in zip(SPLITS, _generate(cfg)):
        # Same rows as on disk (a resumed run): leave the file alone, so its mtime stays.
        paths[split] = tasks.write_jsonl(records, os.path.join(out_dir, f"{prefix}{split}.jsonl"), if_changed=True)
    return dataclasses.replace(cfg, source="jsonl", train_path=paths["train"], eval_path=paths["eval"])


def open_split(cfg: DataConfig, split: str):
    """Random-access source of the rows of one split ('train' or 'eval')."""
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}'; pass train or eval")
    if cfg.source == "generated":
        return ListSource(generated_records(cfg, split), name=f"generated {split}")
    if cfg.source == "envs":
        raise ValueError(
            "data.source=envs rows are written from the environments by the stage "
            "(ptrain.stages.setup.stage_data); open the JSONL config it returns"
        )
    path = cfg.train_path if split == "train" else cfg.eval_path
    if path is None:
        raise ValueError(f"no data.{split}_path is set, so there is no {split} split; pass data.{split}_path=FILE")
    return open_source(path, cfg.source)
