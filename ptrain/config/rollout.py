"""The rollout engine of stages that sample (Hydra group `rollout/`): the in-process engine
(`local`) or an SGLang fleet (`sglang`) with its timeouts, retries and versioned weight push.
Jax-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RolloutConfig:
    kind: str = "local"
    """local (the in-process JAX engine; as several JAX processes, in process 0 on one of its
    devices) | sglang (an SGLang fleet: ptrain.rollout.fleet)."""
    max_running_requests: int = 64
    """local: samples decoded at once (KV-cache rows)."""
    context_length: int | None = None
    """local: prompt + output tokens per row; None: train.seq_len + 1."""
    decode_steps: int = 8
    """local: tokens per decode call before the host checks stops."""
    urls: list[str] = field(default_factory=list)
    """sglang: worker URLs (http://host:port). Without a router the client spreads requests
    over them itself; with router_url they are the workers behind it (empty: the router's
    GET /workers list), which get health probes, weight updates and aborts directly."""
    router_url: str | None = None
    """sglang: an sglang-router URL (http://host:port): /generate goes through it; weight
    updates and aborts still go to each worker (the router does not proxy /abort_request)."""
    request_timeout_s: float = 600.0
    """sglang: a /generate with no answer after this many seconds is abandoned (aborted on its
    worker) and re-issued on another (> 0; set it above the longest generation you expect)."""
    connect_timeout_s: float = 5.0
    """sglang: seconds to open a connection to a worker or the router (> 0)."""
    unhealthy_timeout_s: float = 120.0
    """sglang: with no healthy worker for this many seconds, waiting requests fail with
    FleetUnavailable (naming every URL and its last answer), and the stage checkpoints and stops."""
    max_retries: int = 5
    """sglang: re-issues of one request at most (>= 0) after a dead, hung or failing worker;
    waiting for a healthy worker is not counted."""
    retry_backoff_s: float = 0.5
    """sglang: wait before re-issuing a failed request; doubles per attempt, capped at
    probe_backoff_max_s (>= 0)."""
    per_worker_concurrency: int = 64
    """sglang: requests in flight per worker at most (>= 1); with a router, this times the
    healthy workers in flight in all."""
    health_interval_s: float = 10.0
    """sglang: seconds between /health_generate polls of each worker in service (> 0)."""
    health_timeout_s: float = 20.0
    """sglang: a /health_generate that has not answered 200 after this many seconds counts as
    a failure (> 0)."""
    probe_backoff_s: float = 1.0
    """sglang: a worker taken out of service is probed again after this many seconds, doubling
    after each failed probe (> 0)."""
    probe_backoff_max_s: float = 30.0
    """sglang: the longest wait between probes of a worker out of service (>= probe_backoff_s)."""
    manage_router_workers: bool = True
    """sglang with a router: remove a worker the client takes out of service from the router
    (DELETE /workers/{id}) and add it back (POST /workers) once it is healthy and on the
    current weight version, so the router stops sending it requests at once instead of after
    its own health checks."""
    weight_dir: str | None = None
    """sglang: where weight versions are exported, one folder v<version> each. null:
    <stage>/weights. Set: each stage exports into a folder of its own under it,
    <weight_dir>/<run name>-<stage>-<hash of the stage folder>, so runs that share it never
    replace or prune each other's versions. Every worker must read this path: a shared file
    system, or /dev/shm for a fleet on the trainer's own host."""
    keep_weight_versions: int = 2
    """sglang: exported versions kept on disk (>= 1); older ones are deleted after a push."""
    weight_dtype: str = "bfloat16"
    """sglang: dtype of exported weights: bfloat16 | float32 (the trainer's own float32 makes
    the engine's log-probs match the trainer's exactly)."""
    weight_push_mode: str = "stage"
    """sglang: what a weight update does to requests in flight on the workers: stage (what the
    stage asks: drain, abort, or in_place as pause/continue), or always one of drain (they
    finish on the old weights first), abort (they end with their partial tokens), pause
    (pause_generation in_place, update, continue_generation: they go on with the new weights)."""
    weight_push_timeout_s: float = 600.0
    """sglang: a worker that has not confirmed a weight update after this many seconds is
    retried, then taken out of service until it is brought to the version (> 0)."""
    weight_push_retries: int = 2
    """sglang: re-sends of a failed weight update to one worker (>= 0)."""
    export_writers: int = 2
    """sglang: threads writing a weight export's shard files in parallel (>= 1)."""
    weight_checksums: bool = True
    """sglang: put every exported tensor's sha256 in the version's manifest.json (about a second
    of one core per GB exported; false where the export is CPU-bound and the folder never
    leaves the machine, e.g. /dev/shm)."""
