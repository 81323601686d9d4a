"""Minimal safetensors reader/writer over numpy memory maps.

Why our own: the `safetensors` numpy frontend has no bfloat16, and HF checkpoints are
mostly bfloat16. The format is tiny (8-byte little-endian header length, a JSON header
of {name: {dtype, shape, data_offsets}}, then raw little-endian bytes), so we read
tensors lazily from a memory map — one tensor (or one slice of it) at a time, never the
whole file — and write with `ml_dtypes` covering bfloat16. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}

FLOAT_CODES = ("F64", "F32", "F16", "BF16")


class SafetensorsFile:
    """Lazy read access to one .safetensors file: `keys()`, `info(name)`, `get(name)`."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise ValueError(f"{path}: safetensors header of {n} bytes is implausible; the file is corrupt")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both are
                raise ValueError(
                    f"{path}: the safetensors header is not valid JSON ({e}); the file is corrupt: "
                    "copy or convert it again"
                ) from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
        self._meta = header.pop("__metadata__", {}) or {}
        self._header = header
        self._offset = 8 + n
        self._check_layout(os.path.getsize(path) - self._offset)
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

    def _check_layout(self, data_bytes: int) -> None:
        """Every tensor's byte range lies in the file and matches its shape and dtype, so a
        truncated download fails here, naming the tensor, not later as a reshape error."""
        for name, h in self._header.items():
            try:
                start, end = (int(x) for x in h["data_offsets"])
                count = int(np.prod(h["shape"], dtype=np.int64))
                itemsize = _DTYPES[h["dtype"]].itemsize if h["dtype"] in _DTYPES else None
            except (KeyError, TypeError, ValueError):
                raise ValueError(
                    f"{self.path}: tensor {name!r} has a malformed header entry {h!r}; "
                    "the file is corrupt: copy or convert it again"
                ) from None
            if end > data_bytes or start > end:
                raise ValueError(
                    f"{self.path}: tensor {name!r} needs bytes {start}-{end} of the data section, "
                    f"which holds {data_bytes}; the file is truncated: copy or convert it again"
                )
            if itemsize is not None and end - start != count * itemsize:
                raise ValueError(
                    f"{self.path}: tensor {name!r} spans {end - start} bytes, but shape {h['shape']} "
                    f"of {h['dtype']} needs {count * itemsize}; the file is corrupt"
                )

    def keys(self) -> list[str]:
        return list(self._header)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape) of a tensor."""
        h = self._header[name]
        return h["dtype"], tuple(h["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view on the memory map (no copy)."""
        h = self._header[name]
        code = h["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        start, end = h["data_offsets"]
        buf = self._mmap[self._offset + start : self._offset + end]
        return buf.view(_DTYPES[code]).reshape(h["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` (name -> numpy array) as one safetensors file, names sorted."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        arr = tensors[name]
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).astype(tensors[name].dtype, copy=False).tobytes())
    os.replace(tmp, path)


def open_folder(folder: str) -> dict[str, SafetensorsFile]:
    """Maps every tensor name of a HF folder to its open file (single file or sharded index).

    Refuses pickled weights (pytorch_model.bin, *.pt) with an error that says how to convert.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = {fn: SafetensorsFile(os.path.join(folder, fn)) for fn in sorted(set(weight_map.values()))}
        out = {}
        for name, fn in weight_map.items():
            if name not in files[fn]._header:
                raise ValueError(f"{folder}: index says {name!r} is in {fn}, but that file does not hold it")
            out[name] = files[fn]
        return out
    if os.path.exists(single):
        f = SafetensorsFile(single)
        return {k: f for k in f.keys()}
    pickles = [p for p in os.listdir(folder) if p.endswith((".bin", ".pt", ".pth", ".pkl"))]
    hint = (
        f" It holds pickled weights ({', '.join(sorted(pickles))}), which ptrain never loads: convert them to "
        "safetensors in a trusted environment first."
        if pickles
        else ""
    )
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json.{hint}")


def write_sharded(tensors: Iterable[tuple[str, np.ndarray]], folder: str, *, max_shard_bytes: int) -> list[str]:
    """Writes tensors into model.safetensors, or into model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json when the total exceeds max_shard_bytes. Returns file names."""
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    total = 0
    for name, arr in tensors:
        if sizes[-1] and sizes[-1] + arr.nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = arr
        sizes[-1] += arr.nbytes
        total += arr.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"))
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fn, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, fn))
        weight_map.update({k: fn for k in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return names
