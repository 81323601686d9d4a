"""Versioned weight export for an SGLang fleet, and the push that loads it on every worker.

    result = export_weights(cfg, params, model_state, "runs/x/stages/grpo/weights", "12")
        -> runs/x/stages/grpo/weights/v12/  (config.json, *.safetensors, manifest.json)
    outcomes = await push_to_workers(client, urls, result.path, "12", mode="drain", ...)
    prune_versions(weight_dir, keep=2, current="12")

A stage exports into a folder of its own: `<stage>/weights`, or under a shared
rollout.weight_dir the folder `run_weight_dir` names, so runs never touch each other's versions.

Layout. A version folder is a Hugging Face folder SGLang's `/update_weights_from_disk` and
`python -m ptrain.serve` load: config.json, model.safetensors (or model-0000i-of-0000n
shards with model.safetensors.index.json), and manifest.json, which lists every tensor's
name, shape, dtype, file, byte range and sha256, and every file's size.

Atomicity (the `STABLE` marker of prime-rl's file-system transfer, done by rename): an export
is written into `<weight_dir>/.v<version>.partial/`, every file fsync'd, the manifest last,
and only then renamed to `v<version>` (one rename(2), atomic on a POSIX file system), so a
folder named v<version> is always complete and a worker is only ever told of such folders. An
export killed halfway leaves a `.partial` folder that no one loads; the next export of that
version, or `prune_versions`, deletes it. `read_manifest` checks a folder against its manifest
(sizes and safetensors headers; `check_data=True` also re-hashes every tensor).

Speed. The tensors are written straight from the trainer's pure-dict params: each one is
transposed to the Hugging Face layout and cast to the export dtype in one pass into a buffer,
hashed and written from it (no intermediate copies), `writers` shard files at once (hashlib
and file writes release the GIL). `tools/bench_weight_sync.py` measures it beside the disk's
bandwidth and beside `ptrain.models.save_hf`.

Multi-host. With `process_count` > 1 every process calls `export_weights` with the same
arguments: each writes the shard files assigned to it (shard i belongs to process
i % process_count) in parallel with the others, then process 0 merges their manifests,
writes the index and renames. `barrier` synchronises the steps (default:
`jax.experimental.multihost_utils.sync_global_devices`). Arrays a process cannot address in
full are gathered with `process_allgather` first (every process, same order).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ptrain.rollout.protocol import EngineUnavailable

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "ptrain-weights/1"
DTYPES = {"bfloat16": "BF16", "float32": "F32"}
DEFAULT_MAX_SHARD_BYTES = 4 << 30
PARALLEL_MIN_BYTES = 64 << 20
"""Exports smaller than this are one file: a tiny model gains nothing from parallel shards."""
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class WeightSyncError(EngineUnavailable):
    """A weight export or push that failed; the message names the folder or worker and why.
    An engine that cannot get the trained weights cannot sample them either, so a stage that
    meets it saves a resumable checkpoint and stops, as for EngineUnavailable."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """A finished export: the renamed folder and what writing it cost."""

    path: str
    version: str
    bytes: int
    seconds: float
    files: tuple[str, ...]

    @property
    def gbps(self) -> float:
        """Bytes written per second, in GB/s (10^9)."""
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str
    path: tuple
    index: tuple
    hf_shape: tuple[int, ...]
    transpose: bool
    nbytes: int


def run_weight_dir(weight_dir: str, owner_dir: str, name: str) -> str:
    """The folder of one stage under a weight_dir that runs may share (rollout.weight_dir, e.g.
    /dev/shm/ptrain): `<weight_dir>/<name>-<8 hex digits of owner_dir's absolute path>`.

    Versions are named by optimizer step, so two runs exporting into one folder would replace
    each other's v<step> (a worker told to load one run's weights could read the other's), and
    each run's prune_versions would delete the other's newest versions. Under its own folder a
    run only ever sees, replaces and prunes what it wrote; the same stage folder (a resumed
    run) maps to the same one. `name` keeps it readable (run and stage name)."""
    digest = hashlib.sha256(os.path.abspath(owner_dir).encode()).hexdigest()[:8]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"
    return os.path.join(weight_dir, f"{safe[:80]}-{digest}")


def version_folder(weight_dir: str, version: str) -> str:
    """`<weight_dir>/v<version>`; WeightSyncError for a version that is not a safe folder name."""
    check_version(version)
    return os.path.join(weight_dir, f"v{version}")


def check_version(version: str) -> None:
    """Versions name folders: letters, digits, '.', '_', '-' (not leading), at most 128."""
    if not isinstance(version, str) or not _VERSION_RE.match(version):
        raise WeightSyncError(
            f"weight version {version!r} cannot name a folder; use letters, digits, '.', '_' or '-' "
            "(the GRPO stage uses the optimizer step)"
        )


def _partial_folder(weight_dir: str, version: str) -> str:
    return os.path.join(weight_dir, f".v{version}.partial")


def _lookup(trees: Sequence[Mapping], path: tuple) -> Any:
    for tree in trees:
        node: Any = tree
        try:
            for key in path:
                node = node[key]
        except (KeyError, IndexError, TypeError):
            continue
        return node
    raise WeightSyncError(
        f"the params have no tensor at {'/'.join(map(str, path))}; they do not match the model config"
    )


def _plan(cfg, store_itemsize: int) -> list[_Tensor]:
    from ptrain.models.hf import tensor_map

    out = []
    for m in tensor_map(cfg):
        n = math.prod(m.hf_shape) * store_itemsize
        out.append(_Tensor(m.hf_name, m.path, m.index, tuple(m.hf_shape), m.transpose, n))
    return out


def _shards(tensors: list[_Tensor], n_shards: int) -> list[list[_Tensor]]:
    """Tensors into n_shards files of about equal bytes; all slices of one array share a file
    (so each array is fetched to the host once), largest arrays first into the lightest file."""
    groups: dict[tuple, list[_Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.path, []).append(t)
    order = sorted(groups.values(), key=lambda g: -sum(t.nbytes for t in g))
    bins: list[list[_Tensor]] = [[] for _ in range(n_shards)]
    sizes = [0] * n_shards
    for g in order:
        i = min(range(n_shards), key=lambda k: sizes[k])
        bins[i] += g
        sizes[i] += sum(t.nbytes for t in g)
    rank = {t.name: k for k, t in enumerate(tensors)}
    return [sorted(b, key=lambda t: rank[t.name]) for b in bins if b]


def _header(tensors: list[_Tensor], code: str) -> tuple[bytes, list[tuple[int, int]]]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets = []
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": code, "shape": list(t.hf_shape), "data_offsets": [off, off + t.nbytes]}
        offsets.append((off, off + t.nbytes))
        off += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offsets


def _hf_view(arr: np.ndarray, t: _Tensor) -> np.ndarray:
    """The tensor in the Hugging Face layout, as a view of our array where possible."""
    a = arr[t.index] if t.index else arr
    if t.transpose:
        return a.reshape(t.hf_shape[::-1]).T
    return a.reshape(t.hf_shape)


def _host_arrays(paths, trees, gather: bool) -> dict[tuple, np.ndarray]:
    """Host copies of the arrays at `paths` (fetched lazily by the writers unless `gather`)."""
    import jax

    out = {}
    for path in paths:
        leaf = _lookup(trees, path)
        if gather and isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            from jax.experimental import multihost_utils

            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        out[path] = leaf
    return out


def _to_host(leaf) -> np.ndarray:
    import jax

    return np.asarray(jax.device_get(leaf))


def _write_shard(path: str, tensors: list[_Tensor], leaves: dict, dtype, code: str, fsync: bool, checksums: bool,
                 on_tensor: Callable[[str], None] | None) -> dict[str, dict]:  # fmt: skip
    """One safetensors file; returns the manifest entries of its tensors."""
    head, offsets = _header(tensors, code)
    entries: dict[str, dict] = {}
    host: dict[tuple, np.ndarray] = {}
    buffer = np.empty(max((t.nbytes for t in tensors), default=0), np.uint8)
    fname = os.path.basename(path)
    with open(path, "wb", buffering=0) as f:
        f.write(head)
        for t, (start, end) in zip(tensors, offsets):
            if t.path not in host:
                host.clear()  # slices of one array are consecutive in the shard
                host[t.path] = _to_host(leaves[t.path])
            out = buffer[: t.nbytes].view(dtype).reshape(t.hf_shape)
            np.copyto(out, _hf_view(host[t.path], t), casting="unsafe")
            raw = memoryview(buffer[: t.nbytes])
            entries[t.name] = {
                "file": fname,
                "shape": list(t.hf_shape),
                "dtype": code,
                "data_offsets": [start, end],
                "sha256": hashlib.sha256(raw).hexdigest() if checksums else None,
            }
            f.write(raw)
            if on_tensor is not None:
                on_tensor(t.name)
        if fsync:
            os.fsync(f.fileno())
    return entries


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any, fsync: bool) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def export_weights(cfg, params: Mapping, model_state: Mapping | None, weight_dir: str, version: str,
                   **options) -> ExportResult:  # fmt: skip
    """`_write_export` (its docstring has the options), with a file-system failure (a full
    disk, a read-only or vanished weight_dir) as a WeightSyncError naming the folder, and the
    half-written `.partial` folder removed."""
    try:
        return _write_export(cfg, params, model_state, weight_dir, version, **options)
    except OSError as e:
        shutil.rmtree(_partial_folder(weight_dir, version), ignore_errors=True)
        raise WeightSyncError(
            f"{weight_dir}: writing weight version {version} failed ({e.strerror or e}"
            f"{': ' + e.filename if e.filename else ''}); free space there, or point rollout.weight_dir "
            "at a writable folder every worker can read"
        ) from e


def _write_export(
    cfg,
    params: Mapping,
    model_state: Mapping | None,
    weight_dir: str,
    version: str,
    *,
    dtype: str = "bfloat16",
    writers: int = 2,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_config: Mapping[str, Any] | None = None,
    fsync: bool = True,
    checksums: bool = True,
    process_index: int | None = None,
    process_count: int | None = None,
    barrier: Callable[[str], None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write `params` (and `model_state`: pure dicts, as in TrainState) of a model with config
    `cfg` (ModelConfig) into `<weight_dir>/v<version>/` atomically (module docstring).

    dtype: bfloat16 | float32, the stored dtype. writers: shard files written at once.
    extra_config: keys added to config.json (e.g. eos_token_id). fsync: flush every file to
    the disk before the rename (off only for benchmarks of the page cache). checksums: the
    sha256 of every tensor in the manifest (about a second of one core per GB; off where
    the export is CPU-bound and the folder never leaves the machine). on_tensor: called
    with each tensor's name after it is written (progress; tests kill the process from it).
    An existing v<version> (a resumed run re-exporting its step) is replaced, never merged.
    Returns the ExportResult (on every process; its bytes are this process's share).
    """
    from ptrain.models.hf import config_to_hf
    from ptrain.models.layers import as_dtype

    check_version(version)
    if dtype not in DTYPES:
        raise WeightSyncError(f"dtype {dtype!r}: pass one of {sorted(DTYPES)}")
    if writers < 1:
        raise WeightSyncError(f"writers must be >= 1, got {writers}")
    if process_count is None or process_index is None:
        import jax

        process_count, process_index = jax.process_count(), jax.process_index()
    if process_count > 1 and barrier is None:
        from jax.experimental import multihost_utils

        barrier = multihost_utils.sync_global_devices
    sync = barrier or (lambda _name: None)
    code = DTYPES[dtype]
    store = np.dtype(as_dtype(dtype))
    t0 = time.perf_counter()
    final = version_folder(weight_dir, version)
    tmp = _partial_folder(weight_dir, version)
    lead = process_index == 0
    hf = config_to_hf(cfg)  # fails before anything is written when cfg has no HF equivalent
    hf["torch_dtype"] = dtype
    hf.update(dict(extra_config or {}))

    if lead:
        os.makedirs(weight_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export of this version
        os.makedirs(tmp)
    sync(f"ptrain-export-{version}-start")

    plan = _plan(cfg, store.itemsize)
    total = sum(t.nbytes for t in plan)
    parallel = writers if total >= PARALLEL_MIN_BYTES else 1
    n_shards = max(math.ceil(total / max_shard_bytes), process_count * parallel, 1)
    shards = _shards(plan, n_shards)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    mine = [i for i in range(len(shards)) if i % process_count == process_index]
    trees = (params, model_state or {})
    leaves = _host_arrays([t.path for i in mine for t in shards[i]] if process_count == 1 else
                          list(dict.fromkeys(t.path for t in plan)), trees, gather=process_count > 1)  # fmt: skip
    entries: dict[str, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, min(writers, len(mine))), "ptrain-export") as pool:
        jobs = [
            pool.submit(
                _write_shard, os.path.join(tmp, names[i]), shards[i], leaves, store, code, fsync, checksums, on_tensor
            )  # fmt: skip
            for i in mine
        ]
        for job in jobs:
            entries.update(job.result())
    files = {names[i]: os.path.getsize(os.path.join(tmp, names[i])) for i in mine}
    mine_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries.values())
    if not lead:
        _write_json(os.path.join(tmp, f"host-{process_index}.json"), {"tensors": entries, "files": files}, fsync)
    sync(f"ptrain-export-{version}-written")

    if lead:
        for k in range(1, process_count):
            with open(os.path.join(tmp, f"host-{k}.json")) as f:
                part = json.load(f)
            entries.update(part["tensors"])
            files.update(part["files"])
            os.remove(os.path.join(tmp, f"host-{k}.json"))
        missing = [t.name for t in plan if t.name not in entries]
        if missing:
            raise WeightSyncError(f"{tmp}: the export lacks {len(missing)} tensors, e.g. {missing[:3]}")
        if len(names) > 1:
            weight_map = {name: e["file"] for name, e in sorted(entries.items())}
            _write_json(
                os.path.join(tmp, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map},
                fsync,
            )
        _write_json(os.path.join(tmp, "config.json"), hf, fsync)
        manifest = {
            "format": FORMAT,
            "version": version,
            "dtype": dtype,
            "checksums": "sha256" if checksums else None,
            "created": time.time(),
            "total_bytes": total,
            "files": dict(sorted(files.items())),
            "tensors": {t.name: entries[t.name] for t in plan},
        }
        _write_json(os.path.join(tmp, MANIFEST), manifest, fsync)
        if fsync:
            _fsync_dir(tmp)
        if os.path.exists(final):  # the same version again: swap, never merge
            old = os.path.join(weight_dir, f".v{version}.replaced-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        if fsync:
            _fsync_dir(weight_dir)
    sync(f"ptrain-export-{version}-renamed")
    return ExportResult(final, version, mine_bytes if process_count > 1 else total, time.perf_counter() - t0,
                        tuple(names))  # fmt: skip


def read_manifest(folder: str, *, check_data: bool = False) -> dict:
    """The folder's manifest after checking the folder against it: every file's size, every
    tensor's safetensors header entry, and with check_data every tensor's sha256.
    WeightSyncError names the first difference (a damaged or foreign folder)."""
    from ptrain.models.safetensors_io import SafetensorsFile

    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise WeightSyncError(f"{folder}: no {MANIFEST}; not a complete ptrain weight export") from None
    except ValueError as e:
        raise WeightSyncError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise WeightSyncError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for fname, size in manifest["files"].items():
        p = os.path.join(folder, fname)
        if not os.path.isfile(p) or os.path.getsize(p) != size:
            got = os.path.getsize(p) if os.path.isfile(p) else "missing"
            raise WeightSyncError(f"{p}: {got} bytes, the manifest says {size}")
    opened = {fname: SafetensorsFile(os.path.join(folder, fname)) for fname in manifest["files"]}
    for name, e in manifest["tensors"].items():
        st = opened[e["file"]]
        if name not in st.keys():
            raise WeightSyncError(f"{folder}/{e['file']}: has no tensor {name!r}, which the manifest lists")
        code, shape = st.info(name)
        if code != e["dtype"] or list(shape) != e["shape"]:
            raise WeightSyncError(
                f"{folder}/{e['file']}: {name} is {code}{list(shape)}, the manifest says {e['dtype']}{e['shape']}"
            )
        if check_data:
            if not e.get("sha256"):
                raise WeightSyncError(f"{path}: exported without checksums; check_data has nothing to compare")
            digest = hashlib.sha256(memoryview(np.ascontiguousarray(st.get(name)).view(np.uint8))).hexdigest()
            if digest != e["sha256"]:
                raise WeightSyncError(
                    f"{folder}/{e['file']}: {name} has sha256 {digest}, the manifest says {e['sha256']}"
                )
    return manifest


def list_versions(weight_dir: str) -> list[tuple[float, str, str]]:
    """(created, version, folder) of every complete version folder, oldest first."""
    out = []
    if not os.path.isdir(weight_dir):
        return out
    for entry in os.scandir(weight_dir):
        if not (entry.is_dir() and entry.name.startswith("v")):
            continue
        try:
            with open(os.path.join(entry.path, MANIFEST)) as f:
                created = float(json.load(f).get("created", entry.stat().st_mtime))
        except (OSError, ValueError):
            continue  # not ours
        out.append((created, entry.name[1:], entry.path))
    return sorted(out)


def prune_versions(weight_dir: str, *, keep: int, current: str | None = None) -> list[str]:
    """Delete all but the newest `keep` versions (never `current`) and any folder an export or
    a prune left half-done. Each is renamed to a hidden name first, so a half-deleted folder
    never looks like a version. Returns the versions deleted."""
    versions = list_versions(weight_dir)
    doomed = [(v, p) for _, v, p in versions[: max(len(versions) - keep, 0)] if v != current]
    deleted = []
    for version, path in doomed:
        trash = os.path.join(weight_dir, f".v{version}.deleting-{os.getpid()}")
        try:
            os.rename(path, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(version)
    if os.path.isdir(weight_dir):
        for entry in os.scandir(weight_dir):
            if (
                entry.is_dir()
                and entry.name.startswith(".v")
                and (".deleting-" in entry.name or ".replaced-" in entry.name or entry.name.endswith(".partial"))
            ):
                if current is not None and entry.name == f".v{current}.partial":
                    continue
                shutil.rmtree(entry.path, ignore_errors=True)
    return deleted


# ----------------------------------------------------------------------------- pushing to workers

PUSH_MODES = ("drain", "abort", "pause")


@dataclasses.dataclass
class PushOutcome:
    """What one worker did with a weight update."""

    url: str
    ok: bool
    seconds: float = 0.0
    attempts: int = 0
    version_seen: str | None = None
    error: str | None = None
    permanent: bool = False
    """The worker refused the folder itself (HTTP 400): re-sending cannot help."""
    update_s: float = 0.0
    """Seconds of the last /update_weights_from_disk call (the worker loading the folder)."""
    verify_s: float = 0.0
    """Seconds of the last /model_info check."""


def answer_text(response) -> str:
    """A short description of an HTTP answer for error messages: status and message."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if isinstance(body, dict):
        err = body.get("error")
        msg = body.get("message") or (err.get("message") if isinstance(err, dict) else err)
        body = msg or body
    text = str(body).strip().replace("\n", " ")
    return f"HTTP {response.status_code}" + (f": {text[:300]}" if text else "")


def describe_error(e: BaseException, timeout_s: float | None = None) -> str:
    """A transport error in words (timeouts name the limit)."""
    import httpx

    if isinstance(e, httpx.TimeoutException):
        return f"no answer within {timeout_s:g} s" if timeout_s else "timed out"
    if isinstance(e, httpx.ConnectError):
        return f"connection failed ({e or 'refused'})"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _json_object(response, what: str) -> dict:
    """A 200 answer's JSON object; WeightSyncError (the worker's failure) for anything else,
    such as another kind of server on the worker's port."""
    body = response.json()  # ValueError when not JSON at all: a worker's failure as well
    if not isinstance(body, dict):
        raise WeightSyncError(f"{what}: answered {type(body).__name__} {str(body)[:100]}, not SGLang's JSON object")
    return body


async def worker_version(client, url: str, timeout_s: float) -> str:
    """The weight version a worker reports in /model_info."""
    r = await client.get(url + "/model_info", timeout=timeout_s)
    if r.status_code != 200:
        raise WeightSyncError(f"{url}/model_info: {answer_text(r)}")
    return str(_json_object(r, f"{url}/model_info").get("weight_version"))


async def push_to_worker(
    client,
    url: str,
    folder: str,
    version: str,
    *,
    mode: str = "drain",
    timeout_s: float = 600.0,
    retries: int = 2,
    backoff_s: float = 1.0,
) -> PushOutcome:
    """`/update_weights_from_disk` of `folder` as `version` on one worker, then /model_info
    must report the version. mode: drain (in-flight requests finish first, SGLang's default),
    abort (abort_all_requests), pause (pause_generation in_place, update, continue_generation).
    Transport errors, timeouts, 5xx and a wrong version are retried `retries` times; a 400
    (the worker refuses the folder) is permanent. Never raises for a worker's failure."""
    import httpx

    if mode not in PUSH_MODES:
        raise WeightSyncError(f"push mode {mode!r}: pass one of {PUSH_MODES}")
    t0 = time.perf_counter()
    out = PushOutcome(url, False)
    body = {"model_path": os.path.abspath(folder), "weight_version": version, "abort_all_requests": mode == "abort"}
    for attempt in range(retries + 1):
        out.attempts = attempt + 1
        if attempt:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        paused = False
        try:
            if mode == "pause":
                r = await client.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=timeout_s)
                if r.status_code != 200:
                    out.error = f"POST /pause_generation: {answer_text(r)}"
                    continue
                paused = True
            t_update = time.perf_counter()
            r = await client.post(url + "/update_weights_from_disk", json=body, timeout=timeout_s)
            out.update_s = time.perf_counter() - t_update
            if r.status_code == 400 or (
                r.status_code == 200 and _json_object(r, "POST /update_weights_from_disk").get("success") is False
            ):
                out.error, out.permanent = f"POST /update_weights_from_disk: {answer_text(r)}", True
                break
            if r.status_code != 200:
                out.error = f"POST /update_weights_from_disk: {answer_text(r)}"
                continue
            t_verify = time.perf_counter()
            out.version_seen = await worker_version(client, url, timeout_s)
            out.verify_s = time.perf_counter() - t_verify
            if out.version_seen != version:
                out.error = (
                    f"GET /model_info reports weight_version {out.version_seen!r} after the update to {version!r}"
                )
                continue
            out.ok, out.error = True, None
            break
        except (httpx.HTTPError, WeightSyncError, ValueError) as e:
            out.error = describe_error(e, timeout_s) if isinstance(e, httpx.HTTPError) else str(e)
        finally:
            if paused:
                try:
                    await client.post(url + "/continue_generation", json={}, timeout=timeout_s)
                except httpx.HTTPError as e:  # a worker that died paused comes back unpaused
                    log.warning("%s: continue_generation after a weight update failed: %s", url, describe_error(e))
    out.seconds = time.perf_counter() - t0
    return out


async def push_to_workers(client, urls: Sequence[str], folder: str, version: str, **kw) -> list[PushOutcome]:
    """`push_to_worker` on every worker at once; outcomes in `urls` order."""
    return list(await asyncio.gather(*(push_to_worker(client, u, folder, version, **kw) for u in urls)))


# ----------------------------------------------------------------------------- LoRA adapters

LORA_SUFFIX = "-lora"
"""An adapter version's folder is `<weight_dir>/v<version>-lora` (a PEFT folder, no manifest)."""
LORA_FLAGS = "--enable-lora --max-lora-rank {rank} --lora-target-modules {targets}"
"""The worker flags an adapter push needs (SGLang's and `python -m ptrain.serve`'s names)."""


def lora_flags(spec) -> str:
    """LORA_FLAGS for adapters of `spec` (a LoRASpec)."""
    return LORA_FLAGS.format(rank=spec.rank, targets=" ".join(t for t in spec.targets if t != "experts"))


def lora_folder(weight_dir: str, version: str) -> str:
    """`<weight_dir>/v<version>-lora`; WeightSyncError for a version that is not a safe folder name."""
    check_version(version)
    return os.path.join(weight_dir, f"v{version}{LORA_SUFFIX}")


def export_adapters(adapters, spec, cfg, weight_dir: str, version: str, *, fsync: bool = True) -> ExportResult:
    """Write LoRA `adapters` (the trainer's pytree, with its LoRASpec `spec`, for a model of
    ModelConfig `cfg`) as a PEFT folder `<weight_dir>/v<version>-lora/`, atomically as
    `export_weights` does: written into a hidden `.partial` folder, fsync'd, then renamed, so
    a worker told to load the folder never reads half of it. bytes: the folder's size."""
    from ptrain.models.peft_io import save_peft

    final = lora_folder(weight_dir, version)
    tmp = os.path.join(weight_dir, f".v{version}{LORA_SUFFIX}.partial")
    t0 = time.perf_counter()
    try:
        os.makedirs(weight_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        save_peft(adapters, spec, cfg, tmp)
        files = tuple(sorted(os.listdir(tmp)))
        nbytes = 0
        for name in files:
            path = os.path.join(tmp, name)
            nbytes += os.path.getsize(path)
            if fsync:
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        if fsync:
            _fsync_dir(tmp)
        if os.path.exists(final):  # the same version again (a resumed run): swap, never merge
            old = os.path.join(weight_dir, f".v{version}{LORA_SUFFIX}.replaced-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        if fsync:
            _fsync_dir(weight_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WeightSyncError(
            f"{weight_dir}: writing adapter version {version} failed ({e.strerror or e}"
            f"{': ' + e.filename if e.filename else ''}); free space there, or point rollout.weight_dir "
            "at a writable folder every worker can read"
        ) from e
    except ValueError as e:  # adapters PEFT cannot hold (save_peft names them and the way out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise WeightSyncError(f"adapter version {version}: {e}") from e
    return ExportResult(final, version, nbytes, time.perf_counter() - t0, files)


def prune_lora_versions(weight_dir: str, *, keep: int, current: str | None = None) -> list[str]:
    """Delete all but the newest `keep` adapter folders (never `current`'s); returns their versions."""
    if not os.path.isdir(weight_dir):
        return []
    found = []
    for entry in os.scandir(weight_dir):
        if entry.is_dir() and entry.name.startswith("v") and entry.name.endswith(LORA_SUFFIX):
            found.append((entry.stat().st_mtime, entry.name[1 : -len(LORA_SUFFIX)], entry.path))
    found.sort()
    deleted = []
    for _, version, path in found[: max(len(found) - keep, 0)]:
        if version == current:
            continue
        trash = os.path.join(weight_dir, f".v{version}{LORA_SUFFIX}.deleting-{os.getpid()}")
        try:
            os.rename(path, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(version)
    return deleted


async def load_lora_on_worker(client, url: str, name: str, folder: str, *, timeout_s: float = 600.0,
                              retries: int = 2, backoff_s: float = 1.0) -> PushOutcome:  # fmt: skip
    """`/load_lora_adapter` of the PEFT `folder` as adapter `name` on one worker. Transport
    errors, timeouts and 5xx are retried `retries` times; a 400 (LoRA off, a rank above
    --max-lora-rank, targets outside --lora-target-modules, no free slot) is permanent. Never
    raises for a worker's failure."""
    import httpx

    t0 = time.perf_counter()
    out = PushOutcome(url, False)
    body = {"lora_name": name, "lora_path": os.path.abspath(folder)}
    for attempt in range(retries + 1):
        out.attempts = attempt + 1
        if attempt:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            t_update = time.perf_counter()
            r = await client.post(url + "/load_lora_adapter", json=body, timeout=timeout_s)
            out.update_s = time.perf_counter() - t_update
            if r.status_code == 400 or (
                r.status_code == 200 and _json_object(r, "POST /load_lora_adapter").get("success") is False
            ):
                out.error, out.permanent = f"POST /load_lora_adapter: {lora_answer_text(r)}", True
                break
            if r.status_code != 200:
                out.error = f"POST /load_lora_adapter: {answer_text(r)}"
                continue
            out.ok, out.error, out.version_seen = True, None, name
            break
        except (httpx.HTTPError, WeightSyncError, ValueError) as e:
            out.error = describe_error(e, timeout_s) if isinstance(e, httpx.HTTPError) else str(e)
    out.seconds = time.perf_counter() - t0
    return out


async def unload_lora_on_worker(client, url: str, name: str, *, timeout_s: float = 600.0) -> str | None:
    """`/unload_lora_adapter` of adapter `name` on one worker (the worker waits for the requests
    using it); None when done, else what went wrong (never raises for a worker's failure)."""
    import httpx

    try:
        r = await client.post(url + "/unload_lora_adapter", json={"lora_name": name}, timeout=timeout_s)
    except httpx.HTTPError as e:
        return f"POST /unload_lora_adapter: {describe_error(e, timeout_s)}"
    return None if r.status_code == 200 else f"POST /unload_lora_adapter: {lora_answer_text(r)}"


async def worker_adapters(client, url: str, timeout_s: float) -> set[str]:
    """The names of the LoRA adapters a worker serves (GET /v1/models lists them beside the
    model, as SGLang does)."""
    r = await client.get(url + "/v1/models", timeout=timeout_s)
    if r.status_code != 200:
        raise WeightSyncError(f"{url}/v1/models: {answer_text(r)}")
    data = _json_object(r, f"{url}/v1/models").get("data") or []
    return {str(m.get("id")) for m in data if isinstance(m, dict) and m.get("parent")}


def lora_answer_text(response) -> str:
    """answer_text of a LoRAUpdateOutput, whose message is in `error_message`."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("error_message"):
        return f"HTTP {response.status_code}: {str(body['error_message']).strip()[:300]}"
    return answer_text(response)


async def push_lora_to_worker(client, url: str, name: str, served: str, folder: str, *, keep: Sequence[str] = (),
                              reload: bool = True, timeout_s: float = 600.0, retries: int = 2,
                              backoff_s: float = 1.0) -> PushOutcome:  # fmt: skip
    """Bring one worker to adapter version `served` (of adapter `name`) from the PEFT `folder`:
    versions of `name` it still holds that are not in `keep` (an earlier run's, or one it
    missed the unload of while out of service) are unloaded first, so they do not fill its
    adapter slots; then `load_lora_on_worker`. A worker that holds `served` already keeps it
    without `reload`, else it is unloaded first (a resumed run re-exports the version it resumes
    from into the same folder). Every unload waits on the worker for the requests using that
    adapter. Never raises for a worker's failure."""
    t0 = time.perf_counter()
    try:
        held = await worker_adapters(client, url, timeout_s)
    except Exception as e:  # noqa: BLE001 - a worker's failure is an outcome
        import httpx

        why = describe_error(e, timeout_s) if isinstance(e, httpx.HTTPError) else str(e)
        return PushOutcome(url, False, time.perf_counter() - t0, 1, error=f"GET /v1/models: {why}")
    if served in held and not reload:
        out = PushOutcome(url, True, time.perf_counter() - t0, 1, version_seen=served)
        stale = []
    else:
        out = None
        stale = [served] if served in held else []
    stale += sorted(a for a in held if a != served and a.startswith(f"{name}-v") and a not in keep)
    for adapter in stale:
        error = await unload_lora_on_worker(client, url, adapter, timeout_s=timeout_s)
        if error is not None:
            log.warning("%s: unloading stale adapter %s failed: %s", url, adapter, error)
    if out is not None:
        return out
    out = await load_lora_on_worker(client, url, served, folder, timeout_s=timeout_s, retries=retries,
                                    backoff_s=backoff_s)  # fmt: skip
    out.seconds = time.perf_counter() - t0
    return out
