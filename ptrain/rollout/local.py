"""LocalEngine: the in-process JAX rollout engine, and the embedded default sampler.

    engine = LocalEngine.from_hf("runs/x/stages/sft/export", max_running_requests=16)
    samples = engine.generate_many([GenerateRequest(prompt_ids, SamplingParams(n=8))])

How it runs. One engine thread owns the device state; `submit` only queues. The KV cache
is allocated once: `max_running_requests` rows of `context_length` slots per layer. Each
row holds one sequence left-aligned from slot 0, so every row writes its next key at its
own slot (a per-row scatter) and a finished sequence frees its row for the next queued
request without touching the others (continuous batching). Each loop iteration:

  1. control commands (abort, weight swaps, pause, cache flush) run between device calls;
  2. queued requests are admitted while rows are free: the prompt's longest prefix already
     held by some row (the prefix cache) is copied or, from an idle row, kept in place, and
     only the rest is prefilled ("extend", in chunks); a request's n samples share that one
     prefill, the other n - 1 rows get a copy of the row;
  3. one jitted decode call advances every running row by `decode_steps` tokens (the
     sampled tokens feed back on the device; the host checks stops once per call);
  4. finished samples resolve their futures; their rows stay as prefix-cache entries
     (token ids -> KV) until a new request needs the row (least recently used first).

The prompt's last token is never prefilled: it is the first decode step's input, so the
first output token is sampled by the same code as every other, and a group's n rows share
everything before it.

Compiles: decode once per (row bucket, key-length bucket), extend once per (chunk bucket,
key-length bucket), powers of two; weights, sampling settings and stop tokens are traced
arguments, so weight swaps and new requests never recompile. A decode call in which some
running sample has an open thinking budget runs a second program (per bucket) that also
carries the forcing state; without one, the plain program runs. Likewise a call in which some
request asks for top log-probs (`GenerateRequest.top_logprobs_num`, a scorer's request), and
the prefill of such a request, run programs that also take a top-k over the vocabulary at every
position (k bucketed to a power of two); nobody else pays for it.

Thinking budget (`SamplingParams.thinking_budget` = B, `think_end_ids` = the tokenizer's
`</think>`; Nemotron 3 Nano's budget control, arXiv 2512.20856 §2.7). A sample's reasoning
is open until its generated tokens contain think_end_ids; the prompt does not count (a
reasoning-off prompt already ending in `</think>` should carry no budget). From output token
B on, an open sample takes the next token of think_end_ids instead of a draw, continuing
from however far its last tokens already reach into the sequence (the model's own `</`, as
SGLang's strict-thinking grammar does), until the sequence is complete; then it samples the
answer as before. The forcing runs inside the jitted multi-step decode: per row the budget,
the end ids and the last MAX_THINK_END_IDS output tokens go in, and the loop carries how far
into the sequence each row is and whether it has closed, so decode_steps > 1 needs no early
exit. A forced token still advances the sample's PRNG counter t, so later tokens use the
keys of their positions. Recorded for a forced token: `logprobs` is log softmax(logits / T)
at it (temperature 0: the untempered softmax), what the trainer computes for the same token,
so its importance ratio stays 1; `sampling_logprobs` is the same number (it was not drawn
from a truncated distribution).

Sampling randomness: sample j of a request with seed s draws token t with key
fold_in(fold_in(key(s), j), t), whatever else runs (`ptrain.models.generate.sample_key`);
without `sampling_seed` the engine draws s from its own seeded generator.

Weight swaps (`update_weights`, `update_weights_from_disk`) keep shapes, dtypes and
shardings, bump `weight_version`, and drop idle prefix-cache rows (their keys came from
the old weights). Modes: "drain" (admission pauses, running samples finish on the old
weights, then the swap), "abort" (running samples end with finish_reason abort and their
partial tokens), "in_place" (swap between two decode calls; running samples continue on
the new weights, and `Sample.weight_versions` records where the version changed).

LoRA adapters (`max_loras` > 0). The engine keeps `max_loras` adapter slots beside the base
weights (`ptrain.models.lora.empty_slots`; slot 0 is the base model): `load_lora` writes a PEFT
folder or trained adapters into a free slot (adapter-sized work; the base is untouched), a
request names its adapter in `lora_path`, and every prefill and decode call applies each row's
own slot (x W + (x A_slot) B_slot), so requests for different adapters share decode steps.
Prefix-cache rows are reused only by requests for the same adapter. The adapted weights are
served unmerged, so such an engine decodes without the CPU panel-layout weights.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ptrain.models.generate import base_keys, filters, sample_key, sample_rows, think_end_match
from ptrain.models.lora import SERVABLE, attach_slots, empty_slots, write_slot
from ptrain.rollout.protocol import (
    MAX_THINK_END_IDS,
    MAX_TOP_LOGPROBS,
    SWAP_MODES,
    EngineBase,
    FinishReason,
    GenerateRequest,
    RequestError,
    Sample,
    WeightSpan,
)

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
NO_BUDGET = np.iinfo(np.int32).max
"""A row's thinking budget when it has none, or its reasoning has closed: never reached."""


class WeightsError(ValueError):
    """New weights that cannot replace the served ones; the old weights keep serving."""


class LoRAError(ValueError):
    """An adapter this engine cannot load or unload; the message names the mismatch and the fix."""


class EngineClosed(RuntimeError):
    """The engine was closed (or its thread failed) before the request finished."""


def _bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi (hi itself when n > the last power)."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


# ----------------------------------------------------------------------------- pure device functions


def _cache_axis(x: jax.Array) -> int:
    """Row axis of a cache leaf: [R, K, S, Dh] per layer, or [n_layers, R, K, S, Dh] stacked."""
    return x.ndim - 4


def _extend(model_def, params, model_state, caches, row, tokens_1xM, start, n_valid, targets_1xM, temperature,
            lora=None, *, key_len: int, with_logprobs: bool, top_n: int = 0):  # fmt: skip
    """Prefill tokens [start, start + M) of cache row `row` (only the first n_valid are real).

    The row is sliced out, run through `decode_step` with a scalar write index, and written
    back. Returns (caches, log-probs [M] of `targets_1xM` under softmax(logits / T), or None,
    top), top being None, or with top_n > 0 (static; only with with_logprobs) the top_n most
    likely tokens of each position and their log-probs, ([M, top_n] int32, [M, top_n] float32),
    from the same log-softmax: a request that asks for none compiles and runs without the top-k.
    lora: None, or (adapter slots, the row's slot [1]).
    """
    model = model_def.bind(params if lora is None else attach_slots(params, *lora), model_state)
    window = model.cfg.sliding_window
    M = tokens_1xM.shape[1]
    row_caches = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=_cache_axis(x)), caches)
    q_pos = start + jnp.arange(M, dtype=jnp.int32)
    s = jnp.arange(key_len, dtype=jnp.int32)
    mask = s[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (q_pos[:, None] - s[None, :] < window)
    logits, row_caches = model.decode_step(tokens_1xM, q_pos[None, :], mask[None], row_caches, start)
    caches = jax.tree.map(
        lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, row, axis=_cache_axis(x)), caches, row_caches
    )
    if not with_logprobs:
        return caches, None, None
    z = logits[0] / jnp.where(temperature > 0, temperature, 1.0)
    logp_MxV = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(logp_MxV, targets_1xM[0][:, None], axis=-1)[:, 0]
    top = None
    if top_n:
        top_lp_MxN, top_ids_MxN = jax.lax.top_k(logp_MxV, top_n)
        top = (top_ids_MxN.astype(jnp.int32), top_lp_MxN.astype(jnp.float32))
    return caches, jnp.where(jnp.arange(M) < n_valid, lp, 0.0), top


def _copy_row(caches, src, dst_N):
    """Rows dst_N[i] := row src in every layer's keys and values, in one call (a GRPO group's
    n - 1 copies of the prefilled row); a destination >= the row count is skipped (padding)."""

    def one(x):
        axis = _cache_axis(x)
        row = jax.lax.dynamic_slice_in_dim(x, src, 1, axis=axis)
        shape = x.shape[:axis] + (dst_N.shape[0],) + x.shape[axis + 1 :]
        index = (slice(None),) * axis + (dst_N,)
        return x.at[index].set(jnp.broadcast_to(row, shape), mode="drop")

    return jax.tree.map(one, caches)


def _decode(model_def, params, model_state, caches, tok_B, pos_B, t_B, keys_Bx2, temp_B, top_k_B, top_p_B, min_p_B,
            think=None, lora=None, *, steps: int, key_len: int, filtering: bool, top_n: int = 0):  # fmt: skip
    """`steps` decode steps of cache rows [0, B): feed tok_B at slot pos_B, sample the next.

    A row with pos_B >= the cache length is idle: it writes nothing and its outputs are
    ignored (it attends to every slot, so its numbers stay finite). Returns (caches, tokens,
    full-softmax log-probs, sampling log-probs, top), the middle three [steps, B]; top is None,
    or with top_n > 0 (static: a batch where some request asks for top log-probs) each step's
    top_n most likely tokens and their log-probs under the tempered full softmax,
    ([steps, B, top_n] int32, [steps, B, top_n] float32).

    think: None (no thinking budget in the batch: the plain program), or (budget_B,
    end_ids_BxM, end_len_B, recent_BxM): per row the budget (NO_BUDGET: none, or closed),
    the end-of-thinking ids (-1 padded) and the row's last M output tokens (-1 padded). A
    row whose output count t has reached its budget and whose reasoning is open takes the
    next end id instead of a draw (module docstring).

    lora: None, or (adapter slots, each row's slot [B]).
    """
    model = model_def.bind(params if lora is None else attach_slots(params, *lora), model_state)
    window = model.cfg.sliding_window
    s = jnp.arange(key_len, dtype=jnp.int32)

    def body(i, carry):
        caches, tok, pos, t, out_tok, out_lp, out_slp, out_top, state = carry
        mask = (s[None, :] <= pos[:, None]) | (pos[:, None] >= key_len)
        if window is not None:
            mask = mask & ((pos[:, None] - s[None, :] < window) | (pos[:, None] >= key_len))
        logits, caches = model.decode_step(tok[:, None], pos[:, None], mask[:, None, :], caches, pos)
        forced = None
        if think is not None:
            budget_B, end_ids_BxM, end_len_B, _ = think
            recent, partial, closed = state
            nxt_end = jnp.take_along_axis(end_ids_BxM, partial[:, None], axis=-1)[:, 0]
            forced = jnp.where(~closed & (t >= budget_B), nxt_end, -1)
        nxt, lp, slp = sample_rows(
            logits[:, 0], sample_key(keys_Bx2, t), temp_B, top_k_B, top_p_B, min_p_B, filtering=filtering,
            forced_B=forced,
        )  # fmt: skip
        if think is not None:
            recent = jnp.concatenate([recent[:, 1:], nxt[:, None]], axis=1)
            partial, done = think_end_match(recent, end_ids_BxM, end_len_B)
            state = (recent, partial, closed | done)
        out_tok = out_tok.at[i].set(nxt)
        out_lp = out_lp.at[i].set(lp)
        out_slp = out_slp.at[i].set(slp)
        if top_n:
            x = logits[:, 0].astype(jnp.float32)
            z = x / jnp.where(temp_B <= 0.0, 1.0, temp_B)[:, None]  # sample_rows's tempered softmax
            top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(z, axis=-1), top_n)
            out_top = (out_top[0].at[i].set(top_ids.astype(jnp.int32)), out_top[1].at[i].set(top_lp))
        return caches, nxt, pos + 1, t + 1, out_tok, out_lp, out_slp, out_top, state

    B = tok_B.shape[0]
    state = None
    if think is not None:
        _, end_ids_BxM, end_len_B, recent_BxM = think
        partial, closed = think_end_match(recent_BxM, end_ids_BxM, end_len_B)
        state = (recent_BxM, partial, closed)
    init = (
        caches,
        tok_B,
        pos_B,
        t_B,
        jnp.zeros((steps, B), jnp.int32),
        jnp.zeros((steps, B), jnp.float32),
        jnp.zeros((steps, B), jnp.float32),
        (jnp.zeros((steps, B, top_n), jnp.int32), jnp.zeros((steps, B, top_n), jnp.float32)) if top_n else None,
        state,
    )
    caches, _, _, _, out_tok, out_lp, out_slp, out_top, _ = jax.lax.fori_loop(0, steps, body, init)
    return caches, out_tok, out_lp, out_slp, out_top


# ----------------------------------------------------------------------------- host-side bookkeeping


@dataclasses.dataclass(eq=False)
class _SampleState:
    request: _Request
    index: int
    row: int = -1
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    spans: list[list[Any]] = dataclasses.field(default_factory=list)  # [version, start]
    cached_tokens: int = 0
    first_token_time: float = 0.0
    end_time: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.request.rid}-{self.index}"

    def to_sample(self, weight_version: str) -> Sample:
        req = self.request
        spans = []
        for i, (version, start) in enumerate(self.spans):
            end = self.spans[i + 1][1] if i + 1 < len(self.spans) else len(self.output)
            spans.append(WeightSpan(version, start, end))
        version = self.spans[-1][0] if self.spans else weight_version
        t0 = req.submit_time
        return Sample(
            rid=req.rid,
            index=self.index,
            prompt_ids=req.request.input_ids,
            output_ids=tuple(self.output),
            logprobs=tuple(self.logprobs),
            sampling_logprobs=tuple(self.sampling_logprobs),
            finish_reason=self.finish,
            weight_version=version,
            weight_versions=tuple(spans),
            cached_tokens=self.cached_tokens,
            prompt_logprobs=req.prompt_logprobs,
            top_logprobs=tuple(self.top) if req.request.top_logprobs_num else None,
            prompt_top_logprobs=req.prompt_top_logprobs,
            queue_time_s=max(req.admit_time - t0, 0.0) if req.admit_time else 0.0,
            first_token_time_s=max(self.first_token_time - t0, 0.0) if self.first_token_time else 0.0,
            e2e_latency_s=max((self.end_time or time.time()) - t0, 0.0),
        )


@dataclasses.dataclass(eq=False)
class _Request:
    request: GenerateRequest
    rid: str
    future: concurrent.futures.Future
    on_update: Callable[[list[Sample]], None] | None
    submit_time: float
    seed: int
    stop_ids: frozenset[int]
    max_new_tokens: int
    samples: list[_SampleState] = dataclasses.field(default_factory=list)
    admit_time: float = 0.0
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    lora_slot: int = 0


FREE, IDLE, ACTIVE = 0, 1, 2


# ----------------------------------------------------------------------------- the engine


class LocalEngine(EngineBase):
    """Continuous-batching JAX engine over one Decoder (module docstring).

    model: a `ptrain.models.Decoder` (placed on `mesh` already if sharded).
    max_running_requests: cache rows = samples decoded at once (SGLang's flag of that name).
    context_length: slots per row, prompt + output (default: the model's max_seq_len).
    mesh: the mesh the weights live on; the cache is sharded over its `tensor` axis on
      kv heads (by the logical-axis rules), rows replicated.
    eos_token_ids: ids that end a sample unless `ignore_eos`.
    decode_steps: tokens per decode call before the host checks stops (>= 1).
    prefill_chunk: longest prefill call, in tokens (longer prompts are prefilled in chunks).
    max_prefill_tokens: prompt tokens admitted per loop iteration, so running samples keep
      decoding while a burst of prompts arrives (at least one request is always admitted).
    seed: seeds the per-request sampling seeds of requests without `sampling_seed`.
    max_loras: LoRA adapters served at once (0: none; module docstring); max_lora_rank: the
      largest rank one may have; lora_targets: the layers an adapter may adapt (of
      ptrain.models.lora.SERVABLE).
    """

    def __init__(
        self,
        model,
        *,
        max_running_requests: int = 16,
        context_length: int | None = None,
        mesh=None,
        rules=None,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        weight_version: str = "default",
        model_path: str | None = None,
        decode_steps: int = 4,
        prefill_chunk: int = 512,
        max_prefill_tokens: int = 4096,
        seed: int = 0,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        lora_targets: tuple[str, ...] = SERVABLE,
    ):
        from ptrain.train.state import split_model

        cfg = model.cfg
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        if decode_steps < 1 or prefill_chunk < 16:
            raise ValueError(f"decode_steps must be >= 1 and prefill_chunk >= 16, got {decode_steps}, {prefill_chunk}")
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.context_length = int(context_length or cfg.max_seq_len)
        if not 2 <= self.context_length <= cfg.max_seq_len:
            raise ValueError(
                f"context_length={self.context_length} must be in [2, the model's max_seq_len={cfg.max_seq_len}]"
            )
        self.max_running_requests = int(max_running_requests)
        self.model_path = model_path
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.decode_steps = int(decode_steps)
        self.prefill_chunk = int(prefill_chunk)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.mesh = mesh
        self._rules = rules
        self._model_def, params, model_state = split_model(model)
        # The engine owns its weights (a copy: a trainer may donate its own buffers to the next
        # step), placed committed from the start: jit keys its cache on whether arguments are
        # committed to devices, and swapped-in weights always are.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

        def commit(x):
            return jax.device_put(x, device if mesh is None else x.sharding, may_alias=False)

        self._params, self._model_state = jax.tree.map(commit, params), jax.tree.map(commit, model_state)
        # On one CPU device with float32 weights, decode steps read a second copy of the dense
        # weights in the CPU matmul kernel's panel layout (ptrain.kernels.cpu), made once per
        # weight version; prefill keeps XLA's dots on the weights as they are.
        from ptrain.kernels import cpu as cpu_kernels
        from ptrain.models import pack_decode_weights

        if max_loras < 0 or (max_loras and max_lora_rank < 1):
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {max_loras}, {max_lora_rank}")
        unservable = sorted(set(lora_targets) - set(SERVABLE))
        if unservable:
            raise ValueError(f"lora_targets {unservable} cannot be served per request; pass targets of {SERVABLE}")
        self.max_loras, self.max_lora_rank, self.lora_targets = int(max_loras), int(max_lora_rank), tuple(lora_targets)
        self._lora_slots = None
        if max_loras:
            slots = empty_slots(self._params, self.lora_targets, self.max_loras + 1, self.max_lora_rank)
            rep = device if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._lora_slots = jax.device_put(slots, rep)
        self._lora_names: dict[str, int] = {}  # adapter name -> slot (1 ..)
        self._lora_info: dict[str, dict] = {}
        self._default_lora: str | None = None
        packs = mesh is None and not max_loras and cpu_kernels.packing_applies(self._params)
        self._pack_fn = pack_decode_weights if packs else None
        self._decode_params = self._packed(self._params)
        self._weight_version = str(weight_version)
        self._updates = 0
        self._seeds = np.random.default_rng(seed)

        R, S = self.max_running_requests, self.context_length
        from ptrain.models import init_cache

        self._caches = self._place_caches(jax.eval_shape(lambda: init_cache(cfg, R, S)))
        self.kv_cache_bytes = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self._caches)))

        # Jitted once here: static shapes by bucket; the cache is donated, so it updates in place.
        self._extend_fn = jax.jit(
            _extend, static_argnames=("model_def", "key_len", "with_logprobs", "top_n"), donate_argnames=("caches",)
        )
        self._copy_fn = jax.jit(_copy_row, donate_argnums=(0,))
        self._decode_fn = jax.jit(
            _decode,
            static_argnames=("model_def", "steps", "key_len", "filtering", "top_n"),
            donate_argnames=("caches",),
        )
        # One program per (slot, adapter shape): a push is then one device call, not one per array.
        self._write_slot = jax.jit(write_slot, static_argnums=(1, 3), donate_argnums=(0,))

        # Per-row host state.
        self._row_state = np.full(R, FREE, np.int8)
        self._row_tokens: list[np.ndarray] = [np.zeros(0, np.int32) for _ in range(R)]
        self._row_used = np.zeros(R, np.float64)
        self._row_sample: list[_SampleState | None] = [None] * R
        self._tok = np.zeros(R, np.int32)
        self._pos = np.full(R, S, np.int32)  # S: idle
        self._t = np.zeros(R, np.int32)
        self._keys = np.zeros((R, 2), np.uint32)
        self._temp = np.zeros(R, np.float32)
        self._top_k = np.zeros(R, np.int32)
        self._top_p = np.ones(R, np.float32)
        self._min_p = np.zeros(R, np.float32)
        self._budget = np.full(R, NO_BUDGET, np.int32)  # NO_BUDGET: none, or the reasoning has closed
        self._end_ids = np.full((R, MAX_THINK_END_IDS), -1, np.int32)
        self._end_len = np.zeros(R, np.int32)
        self._row_lora = np.zeros(R, np.int32)  # a row's adapter slot (0: the base), also for its prefix cache

        self._lock = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._requests: dict[str, _Request] = {}
        self._paused = False
        self._pending_swap: tuple | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_calls": 0, "output_tokens": 0}
        self._thread = threading.Thread(target=self._run, name="ptrain-local-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_hf(cls, path: str, *, dtype: str = "float32", tp_size: int = 1, mesh=None, **kw) -> LocalEngine:
        """Load a Hugging Face folder (config.json + safetensors); `tp_size` > 1 shards the
        weights tensor-parallel over that many devices. eos ids come from the folder's
        generation_config.json (else config.json) unless `eos_token_ids` is given."""
        from ptrain.models import load_hf

        if mesh is None and tp_size > 1:
            mesh = tensor_parallel_mesh(tp_size)
        model = load_hf(path, dtype=dtype, mesh=mesh)
        kw.setdefault("eos_token_ids", eos_ids_of(path))
        return cls(model, mesh=mesh, model_path=path, **kw)

    def _place_caches(self, abstract):
        if self.mesh is None:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            return jax.tree.map(lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype), device), abstract)
        from ptrain.parallel.sharding import DEFAULT_RULES, logical_to_spec

        def one(a):
            names = (None,) * (a.ndim - 3) + ("kv_heads", None, "head_dim")
            spec = logical_to_spec(names, a.shape, self.mesh, self._rules or DEFAULT_RULES)
            return jax.device_put(jnp.zeros(a.shape, a.dtype), jax.sharding.NamedSharding(self.mesh, spec))

        return jax.tree.map(one, abstract)

    # ------------------------------------------------------------------ public API

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def failure(self) -> BaseException | None:
        """What ended the engine thread, if it failed (the engine then serves nothing more)."""
        return self._failure

    def submit(self, request: GenerateRequest, on_update=None) -> concurrent.futures.Future:
        """Queue a request (RolloutEngine.submit). Raises RequestError for a request this
        engine can never serve, with the field and the limit named."""
        req = self._validate(request)
        future: concurrent.futures.Future = concurrent.futures.Future()
        sp = req.sampling
        with self._lock:
            seed = sp.sampling_seed if sp.sampling_seed is not None else int(self._seeds.integers(0, 2**31 - 1))
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop.update(self.eos_token_ids)
        room = self.context_length - len(req.input_ids)
        item = _Request(
            request=req,
            rid=req.rid,
            future=future,
            on_update=on_update,
            submit_time=time.time(),
            seed=seed,
            stop_ids=frozenset(stop),
            max_new_tokens=min(sp.max_new_tokens, room),
            lora_slot=self._lora_slot(req.lora_path),
        )
        item.samples = [_SampleState(item, j) for j in range(sp.n)]
        with self._lock:
            if self._closed or self._failure is not None:
                raise EngineClosed(self._closed_message())
            if item.rid in self._requests:
                raise RequestError(f"rid {item.rid!r} is already in flight; give each request its own rid")
            self._requests[item.rid] = item
            self._queue.append(item)
            self._lock.notify()
        return future

    def abort(self, rid: str | None = None) -> int:
        """End request `rid` (all its samples), sample `rid-j`, or every request when None;
        queued ones end with no tokens. Returns the number of samples ended."""
        return self._call(lambda: self._abort(rid, "aborted by request"))

    def update_weights(self, params, model_state=None, *, weight_version: str | None = None,
                       mode: str = "drain") -> str:  # fmt: skip
        """Swap in new weights (pure-dict params like `TrainState.params`, same structure,
        shapes and dtypes), copied onto the served weights' placement, so the caller may
        donate or change its own arrays afterwards. Blocks until swapped; returns the new
        version. `mode`: drain | abort | in_place (module docstring). Not from an
        `on_update` callback except with mode="in_place"."""
        if mode not in SWAP_MODES:
            raise ValueError(f"mode={mode!r}: pass one of {SWAP_MODES}")
        params = self._checked_params(params, self._params, "params")
        if model_state is not None:
            model_state = self._checked_params(model_state, self._model_state, "model_state")
        return self._request_swap(lambda: self._install_weights(params, model_state), weight_version, mode)

    def _request_swap(self, install: Callable[[], None], weight_version: str | None, mode: str) -> str:
        """Run `install` (which puts new weights or adapters in place) as a weight update in
        `mode`, bumping the weight version; blocks until done and returns the version."""
        version = str(weight_version) if weight_version is not None else str(self._updates + 1)
        done: concurrent.futures.Future = concurrent.futures.Future()

        def request_swap():
            if mode == "abort":
                self._abort(None, "aborted for a weight update", queued=False)
            # Paused, nothing decodes: a drain would never end, so the swap happens now.
            if mode == "in_place" or self._paused or not any(self._row_state == ACTIVE):
                self._swap(install, version)
                done.set_result(version)
            else:
                self._pending_swap = (install, version, done)

        self._call(request_swap)
        return done.result()

    def update_weights_from_disk(self, path: str, *, weight_version: str | None = None,
                                 abort_all_requests: bool = False, flush_cache: bool = True) -> str:  # fmt: skip
        """Load a Hugging Face folder, check it against the served model (config, every
        tensor's name, shape and dtype), and swap it in (drain, or abort with
        abort_all_requests). WeightsError names the problem; the old weights keep serving.
        Idle prefix-cache rows are always dropped (they hold the old weights' keys), so
        `flush_cache` has nothing further to do here. Returns the new version."""
        del flush_cache
        from ptrain.models import load_hf

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise WeightsError(f"{path}: no config.json; pass a Hugging Face folder exported by the trainer")
        m = self.cfg
        try:
            model = load_hf(path, dtype=m.dtype, param_dtype=m.param_dtype, mesh=self.mesh, rules=self._rules,
                            scan_layers=m.scan_layers, moe_implementation=m.moe_implementation)  # fmt: skip
        except (ValueError, KeyError, OSError) as e:
            raise WeightsError(f"{path}: {e}") from None
        new = model.cfg
        fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "n_experts",
                  "top_k", "d_ff_expert", "tie_embeddings", "qkv_bias", "qk_norm")  # fmt: skip
        diff = [
            f"{f}: served {getattr(m, f)}, new {getattr(new, f)}" for f in fields if getattr(m, f) != getattr(new, f)
        ]
        if diff:
            raise WeightsError(f"{path}: a different architecture than the served model ({'; '.join(diff)})")
        from ptrain.train.state import split_model

        _, params, model_state = split_model(model)
        version = self.update_weights(
            params, model_state or None, weight_version=weight_version, mode="abort" if abort_all_requests else "drain"
        )
        self.model_path = path
        return version

    # ------------------------------------------------------------------ LoRA adapters

    def loras(self) -> dict[str, dict]:
        """The loaded adapters by name: slot, rank, alpha, targets and the folder (if any)."""
        with self._lock:
            return {name: dict(info) for name, info in self._lora_info.items()}

    def load_lora(self, name: str, path: str | None = None, *, adapters=None, spec=None, replace: bool = False) -> int:
        """Serve adapter `name`: a PEFT folder at `path`, or trained `adapters` (the trainer's
        pytree) with their `spec` (ptrain.models.lora.LoRASpec). It takes a free slot, or with
        `replace` the slot of the adapter loaded under that name (the trainer's push: running
        samples of it continue on the new adapter). Adapter-sized work: the base is untouched.
        Returns the slot; LoRAError names what does not fit."""

        if self._lora_slots is None:
            raise LoRAError("this engine serves no LoRA adapters; start it with max_loras >= 1")
        if not isinstance(name, str) or not name:
            raise LoRAError(f"lora_name: pass a non-empty name, got {name!r}")
        if path is not None:
            from ptrain.models.peft_io import load_peft

            try:
                adapters, spec = load_peft(path, self._params, self.cfg)
            except (ValueError, KeyError, OSError) as e:
                raise LoRAError(f"adapter {name!r}: {e}") from None  # e names the folder
        elif adapters is None or spec is None:
            raise LoRAError("load_lora needs a PEFT folder (path) or adapters with their spec")
        self._check_adapters(name, adapters, spec)

        def load() -> int:
            with self._lock:
                slot = self._lora_names.get(name)
                if slot is not None and not replace:
                    raise LoRAError(
                        f"an adapter named {name!r} is already loaded; unload it first or pick another name"
                    )
                if slot is None:
                    used = set(self._lora_names.values())
                    free = [k for k in range(1, self.max_loras + 1) if k not in used]
                    if not free:
                        raise LoRAError(f"all {self.max_loras} adapter slots are in use ({sorted(self._lora_names)}); "
                                        "unload one first, or start the engine with a larger max_loras")  # fmt: skip
                    slot = free[0]
            self._lora_slots = self._write_slot(self._lora_slots, slot, adapters, spec)
            self._drop_idle_rows(slot)
            with self._lock:
                self._lora_names[name] = slot
                self._lora_info[name] = dict(slot=slot, rank=spec.rank, alpha=spec.alpha, targets=list(spec.targets),
                                             path=path)  # fmt: skip
            return slot

        return self._call(load)

    def _check_adapters(self, name: str, adapters, spec) -> None:
        """LoRAError unless `adapters` (with `spec`) fit this engine's slots and base model."""
        from ptrain.models.lora import split_shape, target_of

        extra = sorted(set(spec.targets) - set(self.lora_targets))
        if extra:
            raise LoRAError(f"adapter {name!r} adapts {extra}, which this engine does not serve (it serves "
                            f"{list(self.lora_targets)}); start the engine with those lora targets")  # fmt: skip
        if spec.rank > self.max_lora_rank:
            raise LoRAError(f"adapter {name!r} has rank {spec.rank}, above this engine's max_lora_rank "
                            f"{self.max_lora_rank}; start the engine with max_lora_rank >= {spec.rank}")  # fmt: skip
        for p, leaf in jax.tree_util.tree_flatten_with_path(adapters)[0]:
            keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p)
            wpath, side = keys[:-1], keys[-1]
            t = target_of(wpath) if wpath else None
            node = self._params
            try:
                for k in wpath:
                    node = node[k]
            except (KeyError, TypeError):
                t = None
            if t is None or side not in ("a", "b"):
                raise LoRAError(f"adapter {name!r}: {'/'.join(map(str, keys))} is no adaptable weight of this model")
            lead, ins, outs = split_shape(tuple(node.shape), t[1], t[2])
            want = (*lead, *ins, spec.rank) if side == "a" else (*lead, spec.rank, *outs)
            if tuple(leaf.shape) != want:
                raise LoRAError(f"adapter {name!r}: {'/'.join(map(str, keys))} has shape {list(leaf.shape)}, this "
                                f"model needs {list(want)} (an adapter for another model size?)")  # fmt: skip

    def update_lora(self, name: str, adapters, spec, *, weight_version: str | None = None, mode: str = "drain") -> str:
        """The trainer's push of adapter `name` (loaded now if it is not yet): a weight update as
        `update_weights` makes one (a new weight_version, `mode` drain | abort | in_place), whose
        work is adapter-sized: the slot's A and B are rewritten and the base is untouched. The
        adapters are copied, so the caller may donate its arrays afterwards. Returns the version."""
        if mode not in SWAP_MODES:
            raise ValueError(f"mode={mode!r}: pass one of {SWAP_MODES}")
        if name not in self.loras():
            self.load_lora(name, adapters=adapters, spec=spec)
        self._check_adapters(name, adapters, spec)
        adapters = jax.tree.map(lambda x: jnp.array(x, copy=True), adapters)
        slot = self.loras()[name]["slot"]

        def install() -> None:
            self._lora_slots = self._write_slot(self._lora_slots, slot, adapters, spec)

        return self._request_swap(install, weight_version, mode)

    @property
    def default_lora(self) -> str | None:
        """The adapter requests without `lora_path` sample with (None: the base model)."""
        return self._default_lora

    def set_default_lora(self, name: str | None) -> None:
        """Requests without `lora_path` sample with adapter `name` (None: the base model), as a
        trainer's engine serves its policy's adapters."""
        if name is not None:
            self._lora_slot(name)  # loaded, or RequestError
        self._default_lora = name

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` and free its slot; refused while requests for it wait or run."""

        def unload() -> None:
            with self._lock:
                slot = self._lora_names.get(name)
                if slot is None:
                    raise LoRAError(
                        f"no adapter named {name!r} is loaded (loaded: {sorted(self._lora_names) or 'none'})"
                    )
                busy = sum(1 for r in self._queue if r.lora_slot == slot) + int(
                    np.sum((self._row_state == ACTIVE) & (self._row_lora == slot))
                )
                if busy:
                    raise LoRAError(f"adapter {name!r} has {busy} requests queued or running; unload it when they end")
                del self._lora_names[name], self._lora_info[name]
            self._lora_slots = self._write_slot(self._lora_slots, slot, {}, None)
            self._drop_idle_rows(slot)

        self._call(unload)

    def _drop_idle_rows(self, slot: int) -> None:
        """Free the prefix-cache rows computed with adapter `slot` (they hold its old keys)."""
        for r in range(self.max_running_requests):
            if self._row_state[r] == IDLE and self._row_lora[r] == slot:
                self._row_state[r] = FREE
                self._row_tokens[r] = np.zeros(0, np.int32)

    def flush_cache(self) -> bool:
        """Drop every prefix-cache entry; False (nothing dropped) while requests run or wait."""

        def flush():
            if self._queue or any(self._row_state == ACTIVE):
                return False
            self._row_state[:] = FREE
            for r in range(self.max_running_requests):
                self._row_tokens[r] = np.zeros(0, np.int32)
            return True

        return self._call(flush)

    def pause(self, mode: str = "abort") -> None:
        """Stop generating: "abort" ends running and queued requests (partial tokens);
        "retract" and "in_place" keep them, with their cache rows, until `resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: pass one of {PAUSE_MODES}")

        def do():
            if mode == "abort":
                self._abort(None, "aborted by pause_generation")
            self._paused = True

        self._call(do)

    def resume(self) -> None:
        def do():
            self._paused = False

        self._call(do)

    def load(self) -> dict[str, int]:
        with self._lock:
            queued = sum(len(r.samples) for r in self._queue)
        return {"running": int(np.sum(self._row_state == ACTIVE)), "queued": queued}

    def info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "weight_version": self._weight_version,
            "kv_cache_bytes": self.kv_cache_bytes,
            "paused": self._paused,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "loras": self.loras(),
        }

    def close(self) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason abort."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ validation

    def _validate(self, request: GenerateRequest) -> GenerateRequest:
        if not isinstance(request, GenerateRequest):
            raise RequestError(f"submit takes a GenerateRequest, got {type(request).__name__}")
        ids = request.input_ids
        if len(ids) == 0:
            raise RequestError("input_ids: the prompt is empty; send at least one token")
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise RequestError("input_ids: must be integers")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise RequestError(
                f"input_ids: token id(s) {sorted(set(bad.tolist()))[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.context_length:
            raise RequestError(
                f"input_ids: the prompt has {len(ids)} tokens, but the context length is {self.context_length} "
                f"(prompt + output); shorten the prompt or start the engine with a longer context length"
            )
        sp = request.sampling
        sp.validate(self.vocab_size)
        if sp.thinking_budget is not None and not sp.think_end_ids:
            raise RequestError(
                f"sampling_params.custom_params.thinking_budget={sp.thinking_budget} needs the end-of-thinking token "
                "ids to force: set SamplingParams.think_end_ids (custom_params.__sglang_reasoning_end_token_ids) to "
                "the tokenizer's encoding of '</think>'"
            )
        if sp.n > self.max_running_requests:
            raise RequestError(
                f"sampling_params.n={sp.n} exceeds max_running_requests={self.max_running_requests}; the n samples "
                "of a prompt run at once: lower n or raise max_running_requests"
            )
        k = request.return_prompt_logprobs_from
        if k is not None and not 0 <= k < len(ids):
            raise RequestError(f"logprob_start_len={k} must be in [0, prompt length {len(ids)})")
        top = request.top_logprobs_num
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs_num: must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per position), "
                f"got {top!r}"
            )
        if request.lora_path is not None:
            self._lora_slot(request.lora_path)  # loaded now; admission looks it up again
        if not request.rid:
            request = dataclasses.replace(request, rid=uuid.uuid4().hex)
        return request

    def _lora_slot(self, name: str | None) -> int:
        name = self._default_lora if name is None else name
        if name is None:
            return 0
        if self._lora_slots is None:
            raise RequestError(f"lora_path={name!r}: this engine serves no LoRA adapters; start it with max_loras >= 1")
        with self._lock:
            slot = self._lora_names.get(name)
        if slot is None:
            raise RequestError(f"lora_path={name!r}: no adapter of that name is loaded (loaded: "
                               f"{sorted(self._lora_names) or 'none'}); load it first (/load_lora_adapter)")  # fmt: skip
        return slot

    def _checked_params(self, new, old, what: str):
        new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
        old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
        if new_def != old_def:
            new_names = {jax.tree_util.keystr(p) for p, _ in new_leaves}
            old_names = {jax.tree_util.keystr(p) for p, _ in old_leaves}
            raise WeightsError(
                f"{what}: different tensors than the served model (missing {sorted(old_names - new_names)[:5]}, "
                f"unexpected {sorted(new_names - old_names)[:5]})"
            )
        problems = []
        for (path, a), (_, b) in zip(new_leaves, old_leaves):
            if tuple(a.shape) != tuple(b.shape) or jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
                problems.append(
                    f"{jax.tree_util.keystr(path)}: {a.dtype}{list(a.shape)}, served {b.dtype}{list(b.shape)}"
                )
        if problems:
            raise WeightsError(f"{what}: {len(problems)} tensors differ from the served model, e.g. {problems[:3]}")
        return jax.tree.map(lambda a, b: jax.device_put(a, b.sharding, may_alias=False), new, old)

    # ------------------------------------------------------------------ engine thread

    def _closed_message(self) -> str:
        if self._failure is not None:
            return f"the engine thread failed: {self._failure!r}; create a new engine"
        return "the engine is closed"

    def _call(self, fn):
        """Run fn on the engine thread (between device calls) and return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._failure is not None:
                raise EngineClosed(self._closed_message())
            self._commands.append((fn, future))
            self._lock.notify()
        return future.result()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (
                        self._closed
                        or self._commands
                        or (self._queue and not self._paused and self._pending_swap is None)
                        or (not self._paused and any(self._row_state == ACTIVE))
                        or (self._pending_swap is not None and not any(self._row_state == ACTIVE))
                    ):
                        self._lock.wait()
                    if self._closed:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, future in commands:
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # the caller sees the command's own error
                        future.set_exception(e)
                if self._pending_swap is not None and not any(self._row_state == ACTIVE):
                    install, version, done = self._pending_swap
                    self._pending_swap = None
                    self._swap(install, version)
                    done.set_result(version)
                if self._paused:
                    continue
                if self._pending_swap is None:
                    self._admit()
                if any(self._row_state == ACTIVE):
                    self._decode_step()
        except BaseException as e:
            log.error("ptrain LocalEngine thread failed:\n%s", traceback.format_exc())
            self._failure = e
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            commands = list(self._commands)
            self._commands.clear()
        for _, future in commands:
            future.set_exception(EngineClosed(self._closed_message()))
        if self._pending_swap is not None:
            self._pending_swap[2].set_exception(EngineClosed(self._closed_message()))
            self._pending_swap = None
        message = "engine closed" if self._failure is None else f"engine failed: {self._failure!r}"
        try:
            self._abort(None, message)
        except Exception:  # a half-failed device state must not keep futures pending
            for req in list(self._requests.values()):
                if not req.future.done():
                    req.future.set_exception(EngineClosed(self._closed_message()))

    # ------------------------------------------------------------------ state changes (engine thread)

    def _packed(self, params):
        return params if self._pack_fn is None else self._pack_fn(params)

    def _install_weights(self, params, model_state) -> None:
        self._params = params
        self._decode_params = self._packed(params)
        if model_state is not None:
            self._model_state = model_state

    def _swap(self, install: Callable[[], None], version: str) -> None:
        install()
        self._weight_version = version
        self._updates += 1
        for r in range(self.max_running_requests):
            if self._row_state[r] == IDLE:
                self._row_state[r] = FREE
                self._row_tokens[r] = np.zeros(0, np.int32)
            elif self._row_state[r] == ACTIVE:
                s = self._row_sample[r]
                s.spans.append([version, len(s.output)])

    def _abort(self, rid: str | None, message: str, *, queued: bool = True) -> int:
        """Finish the named request or sample (every one when rid is None) with abort;
        queued=False leaves requests that are still waiting alone. Engine thread only."""
        reason = FinishReason("abort", message=message)
        with self._lock:
            if rid is None:
                pairs = [(r, s) for r in self._requests.values() for s in r.samples]
            elif rid in self._requests:
                pairs = [(self._requests[rid], s) for s in self._requests[rid].samples]
            else:
                base, _, j = rid.rpartition("-")
                req = self._requests.get(base)
                ok = req is not None and j.isdigit() and int(j) < len(req.samples)
                pairs = [(req, req.samples[int(j)])] if ok else []
            if not queued:
                pairs = [(r, s) for r, s in pairs if r.admit_time]
        n = 0
        touched: dict[int, _Request] = {}
        for req, sample in pairs:
            if sample.finish is None:
                self._finish(sample, reason)
                n += 1
            touched[id(req)] = req
        for req in touched.values():
            if all(x.finish is not None for x in req.samples):
                with self._lock:
                    if req in self._queue:
                        self._queue.remove(req)
            self._maybe_resolve(req)
        return n

    def _finish(self, s: _SampleState, reason: FinishReason) -> None:
        s.finish = reason
        s.end_time = time.time()
        if s.row >= 0:
            r = s.row
            self._row_state[r] = IDLE
            self._row_sample[r] = None
            self._pos[r] = self.context_length
            self._budget[r] = NO_BUDGET
            # KV is valid for every token fed: the prompt and all outputs but the last.
            fed = (
                list(s.request.request.input_ids) + s.output[:-1]
                if s.output
                else list(s.request.request.input_ids[:-1])
            )
            self._row_tokens[r] = np.asarray(fed, np.int32)
            self._row_used[r] = time.time()
            s.row = -1

    def _maybe_resolve(self, req: _Request) -> None:
        if all(s.finish is not None for s in req.samples) and not req.future.done():
            with self._lock:
                self._requests.pop(req.rid, None)
            req.future.set_result([s.to_sample(self._weight_version) for s in req.samples])

    # ------------------------------------------------------------------ admission and prefill

    def _lcp_row(self, prompt: np.ndarray, limit: int, lora_slot: int = 0) -> tuple[int, int]:
        """(row, length) of the row sharing the longest prefix with prompt[:limit] under the same
        adapter; (-1, 0) if none."""
        best, best_len = -1, 0
        for r in range(self.max_running_requests):
            toks = self._row_tokens[r]
            if self._row_state[r] == FREE or toks.size == 0 or self._row_lora[r] != lora_slot:
                continue
            m = min(limit, toks.size)
            if m <= best_len:
                continue
            neq = np.nonzero(toks[:m] != prompt[:m])[0]
            c = int(neq[0]) if neq.size else m
            if c > best_len:
                best, best_len = r, c
        return best, best_len

    def _take_rows(self, n: int, keep: int) -> list[int] | None:
        """n rows for new samples: free rows (lowest first), then idle ones (least recently
        used first), never `keep`. None when fewer than n are available."""
        free = [r for r in range(self.max_running_requests) if self._row_state[r] == FREE and r != keep]
        idle = sorted(
            (r for r in range(self.max_running_requests) if self._row_state[r] == IDLE and r != keep),
            key=lambda r: self._row_used[r],
        )
        rows = (free + idle)[:n]
        return rows if len(rows) == n else None

    def _admit(self) -> None:
        budget = self.max_prefill_tokens
        admitted = 0
        while True:
            with self._lock:
                if not self._queue:
                    return
                req = self._queue[0]
            pending = [x for x in req.samples if x.finish is None]
            n = len(pending)
            prompt = np.asarray(req.request.input_ids, np.int32)
            L = prompt.size
            want_lp = req.request.return_prompt_logprobs_from is not None
            src, c = (-1, 0) if want_lp else self._lcp_row(prompt, L - 1, req.lora_slot)
            if admitted and L - 1 - c > budget:
                return
            claim_src = src >= 0 and self._row_state[src] == IDLE
            rows = self._take_rows(n - 1 if claim_src else n, keep=src if claim_src else -1)
            if rows is None:
                return  # waits for rows; running samples free them
            if claim_src:
                rows = [src] + rows
            with self._lock:
                self._queue.popleft()
            req.admit_time = time.time()
            first = rows[0]
            if src >= 0 and src != first:
                self._copy_rows(src, [first])
            self._prefill(req, first, prompt, c)
            if len(rows) > 1:
                self._copy_rows(first, rows[1:])
            sp = req.request.sampling
            keys = np.asarray(base_keys(jax.random.key(req.seed), len(req.samples)))
            for j, (s, r) in enumerate(zip(pending, rows)):
                s.row = r
                s.cached_tokens = c if j == 0 else L - 1
                s.spans = [[self._weight_version, 0]]
                self._row_state[r] = ACTIVE
                self._row_sample[r] = s
                self._row_lora[r] = req.lora_slot
                self._row_tokens[r] = prompt[:-1]
                self._row_used[r] = time.time()
                self._tok[r] = prompt[-1]
                self._pos[r] = L - 1
                self._t[r] = 0
                self._keys[r] = keys[s.index]
                self._temp[r] = sp.temperature
                self._top_k[r] = sp.top_k if 0 < sp.top_k < self.vocab_size else 0
                self._top_p[r] = sp.top_p
                self._min_p[r] = sp.min_p
                # A budget the sample cannot reach (>= its max_new_tokens) forces nothing.
                binding = sp.thinking_budget is not None and sp.thinking_budget < req.max_new_tokens
                ends = sp.think_end_ids if binding else ()
                self._budget[r] = sp.thinking_budget if binding else NO_BUDGET
                self._end_ids[r] = -1
                self._end_ids[r, : len(ends)] = ends
                self._end_len[r] = len(ends)
            self.stats["prefill_tokens"] += L - 1 - c
            self.stats["cached_tokens"] += c + (n - 1) * (L - 1)
            budget -= L - 1 - c
            admitted += 1
            if req.max_new_tokens <= 0:
                for s in pending:
                    self._finish(s, FinishReason("length", length=0))
                self._maybe_resolve(req)

    def _prefill(self, req: _Request, row: int, prompt: np.ndarray, start: int) -> None:
        """Keys and values of prompt[start : L-1] into `row` (chunked); prompt log-probs if asked."""
        L = prompt.size
        end = L - 1
        k = req.request.return_prompt_logprobs_from
        want_top = req.request.top_logprobs_num if k is not None else 0
        top_n = self._top_n(want_top)
        temperature = jnp.float32(req.request.sampling.temperature)
        lps: list[np.ndarray] = []
        tops: list[tuple[np.ndarray, np.ndarray]] = []
        pos = start
        while pos < end:
            n_valid = min(end - pos, self.prefill_chunk)
            M = _bucket(n_valid, 16, self.prefill_chunk)
            M = min(M, self.context_length - pos)  # the chunk must fit the row
            key_len = _bucket(pos + n_valid, 16, self.context_length)
            tokens = np.zeros((1, M), np.int32)
            tokens[0, :n_valid] = prompt[pos : pos + n_valid]
            targets = np.zeros((1, M), np.int32)
            targets[0, :n_valid] = prompt[pos + 1 : pos + 1 + n_valid]
            self._caches, lp, top = self._extend_fn(
                self._model_def, self._params, self._model_state, self._caches, jnp.int32(row), jnp.asarray(tokens),
                jnp.int32(pos), jnp.int32(n_valid), jnp.asarray(targets), temperature,
                self._lora_args(np.array([req.lora_slot], np.int32)), key_len=key_len, with_logprobs=k is not None,
                top_n=top_n,
            )  # fmt: skip
            if lp is not None:
                lps.append(np.asarray(lp)[:n_valid])
            if top is not None:
                tops.append((np.asarray(top[0])[:n_valid, :want_top], np.asarray(top[1])[:n_valid, :want_top]))
            pos += n_valid
        if k is not None:
            # lps[i] is the log-prob of prompt[i + 1]; keep tokens max(k, 1) .. L - 1
            allp = np.concatenate(lps) if lps else np.zeros(0, np.float32)
            req.prompt_logprobs = tuple(float(x) for x in allp[max(k, 1) - 1 :])
            if want_top:
                ids = np.concatenate([t[0] for t in tops]) if tops else np.zeros((0, want_top), np.int32)
                vals = np.concatenate([t[1] for t in tops]) if tops else np.zeros((0, want_top), np.float32)
                req.prompt_top_logprobs = _top_entries(ids[max(k, 1) - 1 :], vals[max(k, 1) - 1 :])

    def _top_n(self, wanted: int) -> int:
        """The static top-k width a device call computes for `wanted` alternatives (0: none):
        powers of two up to MAX_TOP_LOGPROBS, so a handful of programs serve every request,
        never more than the vocabulary."""
        return min(_bucket(wanted, 1, MAX_TOP_LOGPROBS), self.vocab_size) if wanted else 0

    def _copy_rows(self, src: int, dsts: list[int]) -> None:
        """Copy row src into every row of dsts (one call; the count padded to a power of two)."""
        R = self.max_running_requests
        n = _bucket(len(dsts), 1, R)
        dst = np.full(n, R, np.int32)  # R: no such row, the write is dropped
        dst[: len(dsts)] = dsts
        self._caches = self._copy_fn(self._caches, jnp.int32(src), jnp.asarray(dst))

    # ------------------------------------------------------------------ decoding

    def _lora_args(self, rows: np.ndarray) -> tuple | None:
        """`_extend`/`_decode`'s adapter input: the slots and each row's slot; None without adapters."""
        return None if self._lora_slots is None else (self._lora_slots, jnp.asarray(rows, jnp.int32))

    def _think_arrays(self, active: np.ndarray, B: int) -> tuple | None:
        """`_decode`'s thinking-budget state for rows [0, B), or None when no running sample
        has an open budget (the plain program runs)."""
        open_rows = [r for r in active if self._budget[r] != NO_BUDGET]
        if not open_rows:
            return None
        M = MAX_THINK_END_IDS
        recent = np.full((B, M), -1, np.int32)
        for r in open_rows:
            tail = self._row_sample[r].output[-M:]
            if tail:
                recent[r, M - len(tail) :] = tail
        return (
            jnp.asarray(self._budget[:B]),
            jnp.asarray(self._end_ids[:B]),
            jnp.asarray(self._end_len[:B]),
            jnp.asarray(recent),
        )

    def _decode_step(self) -> None:
        active = np.nonzero(self._row_state == ACTIVE)[0]
        B = _bucket(int(active.max()) + 1, 1, self.max_running_requests)
        steps = self.decode_steps
        key_len = _bucket(int(self._pos[active].max()) + steps, 16, self.context_length)
        want_top = [self._row_sample[r].request.request.top_logprobs_num for r in active]
        top_n = self._top_n(max(want_top))
        self._caches, tok, lp, slp, top = self._decode_fn(
            self._model_def, self._decode_params, self._model_state, self._caches, jnp.asarray(self._tok[:B]),
            jnp.asarray(self._pos[:B]), jnp.asarray(self._t[:B]), jnp.asarray(self._keys[:B]),
            jnp.asarray(self._temp[:B]), jnp.asarray(self._top_k[:B]), jnp.asarray(self._top_p[:B]),
            jnp.asarray(self._min_p[:B]), self._think_arrays(active, B), self._lora_args(self._row_lora[:B]),
            steps=steps, key_len=key_len,
            filtering=filters(self._temp[active], self._top_k[active], self._top_p[active], self._min_p[active],
                              self.vocab_size),
            top_n=top_n,
        )  # fmt: skip
        tok, lp, slp = np.asarray(tok), np.asarray(lp), np.asarray(slp)
        top_ids, top_lp = (np.asarray(top[0]), np.asarray(top[1])) if top is not None else (None, None)
        self.stats["decode_calls"] += 1
        now = time.time()
        touched: dict[int, _Request] = {}
        for r in active:
            s = self._row_sample[r]
            req = s.request
            n_top = req.request.top_logprobs_num
            taken = 0
            for i in range(steps):
                token = int(tok[i, r])
                s.output.append(token)
                s.logprobs.append(float(lp[i, r]))
                s.sampling_logprobs.append(float(slp[i, r]))
                if n_top:
                    # The drawn token's entry is its recorded log-prob: the top-k's log-softmax
                    # rounds differently in the last bit, and a client comparing the two (is
                    # this the greedy token?) must see one number.
                    alts = _top_entries(top_ids[i, r, None, :n_top], top_lp[i, r, None, :n_top])[0]
                    s.top.append(tuple((t, s.logprobs[-1] if t == token else v) for t, v in alts))
                taken += 1
                if not s.first_token_time:
                    s.first_token_time = now
                if self._budget[r] != NO_BUDGET:
                    ends = req.request.sampling.think_end_ids
                    if tuple(s.output[-len(ends) :]) == ends:
                        self._budget[r] = NO_BUDGET  # the reasoning closed (by itself or forced)
                if token in req.stop_ids:
                    self._finish(s, FinishReason("stop", matched=token))
                    break
                if len(s.output) >= req.max_new_tokens:
                    self._finish(s, FinishReason("length", length=len(s.output)))
                    break
            self.stats["output_tokens"] += taken
            if s.finish is None:
                self._tok[r] = s.output[-1]
                self._pos[r] += steps
                self._t[r] += steps
                self._row_used[r] = now
            touched[id(req)] = req
        for req in touched.values():
            if req.on_update is not None and not req.future.done():
                try:
                    req.on_update([s.to_sample(self._weight_version) for s in req.samples])
                except Exception:  # a caller's callback must not stop the engine
                    log.exception("on_update callback of request %s raised", req.rid)
            self._maybe_resolve(req)


# ----------------------------------------------------------------------------- helpers


def _top_entries(ids_PxN: np.ndarray, logprobs_PxN: np.ndarray) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per position, its (token id, log-prob) alternatives, as `Sample.top_logprobs` holds them."""
    return tuple(
        tuple((int(t), float(v)) for t, v in zip(ids, vals))
        for ids, vals in zip(ids_PxN.tolist(), logprobs_PxN.tolist())
    )


def eos_ids_of(path: str) -> tuple[int, ...]:
    """End-of-sequence ids of a Hugging Face folder: generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            try:
                with open(p) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError):
                continue
            if eos is None:
                continue
            return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


def tensor_parallel_mesh(tp_size: int):
    """A mesh (the axes of choices.MESH_AXES) with the weights split over `tp_size` devices of its tensor axis."""
    from ptrain.config.mesh import MeshConfig
    from ptrain.parallel import make_mesh

    n = jax.device_count()
    if tp_size < 1 or n % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide the {n} devices here")
    return make_mesh(MeshConfig(data=n // tp_size, tensor=tp_size))
