"""Running as one of several JAX processes (`jax.distributed`): start-up, who writes, barriers.

Every process runs the same program (SPMD): the same config, the same data pipeline (so
every process holds the same global batch and places only its own devices' rows), the same
jitted step over a mesh of all processes' devices. Files are written by process 0 alone;
`primary_first` runs a build-once helper there first and then on the others, which find
its result on disk. Orbax checkpoints are the exception: every process saves and restores
its own shards (ptrain/checkpoint.py).

A process that dies takes the job with it: the others block in their next collective and
the coordination service aborts them after its heartbeat timeout. A run is restarted as a
whole (tools/launch_local.py, Slurm requeue), and resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

from ptrain.config.distributed import DistributedConfig

T = TypeVar("T")


def initialize(cfg: DistributedConfig) -> None:
    """Join the job `cfg` describes (config keys, PTRAIN_* variables or the launcher: see
    ptrain.config.distributed); nothing for one process. Idempotent. Must run before anything
    touches a JAX device: the backend of a multi-process job is created collectively."""
    plan = cfg.resolve()
    if plan.mode == "single" or jax.distributed.is_initialized():
        return
    if plan.mode == "explicit":
        jax.distributed.initialize(
            coordinator_address=plan.coordinator_address,
            num_processes=plan.num_processes,
            process_id=plan.process_id,
        )
    else:
        jax.distributed.initialize()
    # Every process must create its backend (a collective exchange of local topologies);
    # one that never touches a device leaves the others waiting until they time out.
    jax.devices()


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (nothing with one process). `name` must be the same
    string on every process, and reached in the same order."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def primary_first(fn: Callable[[], T], name: str) -> T:
    """fn() on process 0, then, once it returned, on the others. For helpers that build a
    file or folder once and find it on later calls (the embedded tokenizer and model, the
    generated data): process 0 writes it, the others read it, nobody races on a rename."""
    if jax.process_count() == 1:
        return fn()
    if is_primary():
        out = fn()
        barrier(name)
        return out
    barrier(name)
    return fn()


def broadcast_from_primary(value: T) -> T:
    """Process 0's `value` (any picklable object) on every process; a collective that every
    process calls in the same order. For what one process computes for all: the GRPO stage's
    rollout batch, sampled from the fleet once, trained on by every process."""
    if jax.process_count() == 1:
        return value
    import pickle

    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(value), np.uint8) if is_primary() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int64))[0])
    if not is_primary():
        data = np.zeros(size, np.uint8)
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(data)).tobytes())


def on_primary(fn: Callable[[], T], what: str, *, keep: tuple[type[BaseException], ...] = ()) -> T:
    """`fn()` computed by process 0 alone and given to every process (a collective every
    process calls in the same order): one sampling of a fleet, say, which every process then
    trains on. A failure there reaches every process, so none is left waiting: process 0
    raises its own exception, the others the same type when it is one of `keep` (built from its
    message, e.g. EngineUnavailable, so every process stops resumably), else a RuntimeError
    naming `what` and the failure."""
    if jax.process_count() == 1:
        return fn()
    result = failure = error = None
    if is_primary():
        try:
            result = fn()
        except Exception as e:
            failure = e
            kept = next((k for k in keep if isinstance(e, k)), None)
            error = (keep.index(kept) if kept is not None else -1, f"{type(e).__name__}: {e}", str(e))
    result, error = broadcast_from_primary((result, error))
    if error is None:
        return result
    if failure is not None:
        raise failure
    kind, described, message = error
    if kind >= 0:
        raise keep[kind](message)
    raise RuntimeError(f"{what} failed on process 0 ({described}); its log says more")


def put_global_batch(batch, sharding):
    """A global batch (a pytree of numpy arrays, the same on every process) on the mesh, each
    process copying only its own devices' rows. With one process, plain `jax.device_put`.
    With several, not `device_put`: for input that spans processes it checks the whole value
    is the same everywhere by gathering it from every process, every call; the stages check
    once instead, at the start (the data iterator's state and examples, `check_same_everywhere`)."""
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index]), batch)


def host_array(x) -> np.ndarray:
    """A global array's value on this host; gathered from the other processes when this one
    holds only some of its shards (a collective: every process must call it, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def check_same_everywhere(value, what: str) -> None:
    """Raise ValueError unless `value` (JSON data) is equal on every process. For what each
    process computes for itself but must agree on, such as the data iterator's position and
    its examples' fingerprint: a process that read other files would otherwise feed rows that
    silently disagree with the global batch the others assume. A collective."""
    if jax.process_count() == 1:
        return
    import hashlib
    import json

    from jax.experimental import multihost_utils

    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    mine = np.frombuffer(digest, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if differ:
        raise ValueError(
            f"{what} differs between processes 0 and {differ} (process {jax.process_index()} here): every process "
            "must read the same files (data, tokenizer, model); put run_dir and the data on storage all hosts share"
        )


def exit_now(code: int) -> None:
    """End a process of a multi-process job that failed, at once. A normal interpreter exit
    runs jax.distributed's shutdown barrier, which waits for the other processes (still
    training, or blocked on this one) until the heartbeat timeout; exiting here lets the
    launcher see the failure and stop the job. One process exits normally."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
