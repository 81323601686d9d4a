"""Batched generation with a KV cache: one prefill, then a `lax.while_loop` of decode steps.

    out = generate(model, [[1, 5, 7], [1, 9]], max_new_tokens=32, temperature=0.0,
                   stop_tokens=[eos_id])
    out.tokens_BxN, out.logprobs_BxN, out.lengths_B, out.finish_reasons  (host numpy)

Prompts of different lengths are LEFT-padded to a common bucket length P, so every row
writes its next key/value at the same cache slot (one dynamic_update_slice per layer);
positions are `slot - pad` per row, and pad slots are masked out of attention. The whole
loop is one jitted function, compiled once per (batch, prompt bucket, max new tokens)
and reused across calls and sampling settings (temperature, top-p, top-k and stop tokens
are traced arguments, not compile-time constants).

Sampling (per row, in float32): logits / temperature, keep the top_k largest (0 = all),
keep the smallest set of tokens whose probability reaches top_p (nucleus; Holtzman et al.
2020), then sample. `logprobs` are log p(token) under exactly that filtered, tempered
distribution. Greedy decoding (temperature == 0) picks argmax and reports the log-prob
under the model's untempered distribution (a point mass would say 0 for every token).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain.models.decoder import Decoder, init_cache

MAX_STOP_TOKENS = 8
"""Stop-token slots; a fixed size keeps the compiled loop reusable across stop sets."""

FINISH_LENGTH, FINISH_STOP = 0, 1
FINISH_NAMES = {FINISH_LENGTH: "length", FINISH_STOP: "stop"}


@dataclasses.dataclass
class GenerateOutput:
    """Result of `generate` (host numpy arrays).

    tokens_BxN: int32 generated ids, N = max_new_tokens, `pad_id` after each row's end.
    logprobs_BxN: float32 log-prob of each generated token (0 after the end).
    lengths_B: int32 generated tokens per row, the stop token included.
    finish_reasons: per row "stop" (a stop token was generated) or "length".
    """

    tokens_BxN: np.ndarray
    logprobs_BxN: np.ndarray
    lengths_B: np.ndarray
    finish_reasons: list[str]


def filter_logits(logits_BxV: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tempered logits with tokens outside the top-k / top-p sets at -inf (float32).

    temperature > 0 (scalar); top_k: int scalar, 0 keeps all; top_p: scalar in (0, 1].
    The token with the highest probability always survives.
    """
    x = logits_BxV.astype(jnp.float32) / temperature
    V = x.shape[-1]
    sorted_desc = -jnp.sort(-x, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, (x.shape[0], 1)), axis=-1)
    # Nucleus: keep sorted token i if the mass strictly before it is < top_p.
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1, keepdims=True), 1)
    pth = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    cutoff = jnp.maximum(kth, pth)
    return jnp.where(x >= cutoff, x, -jnp.inf)


def sample_tokens(logits_BxV, rng, temperature, top_k, top_p):
    """One sampling step: (token ids [B] int32, their log-probs [B] float32).

    Branches with lax.cond so greedy decoding skips sampling, and sampling without top-k /
    top-p skips the vocabulary sort.
    """
    logits = logits_BxV.astype(jnp.float32)

    def greedy(_):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]

    def sampled(_):
        need_filter = (top_k > 0) | (top_p < 1.0)
        filtered = jax.lax.cond(need_filter, filter_logits, lambda x, t, k, p: x / t, logits, temperature, top_k, top_p)
        tok = jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(filtered, axis=-1)
        return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]

    return jax.lax.cond(temperature <= 0.0, greedy, sampled, None)


def _decode_mask(pad_B: jax.Array, q_slots_T: jax.Array, S: int, window: int | None) -> jax.Array:
    """[B, T, S]: key slot s visible to query slot t iff pad_b <= s <= t (and in window)."""
    s = jnp.arange(S)[None, None, :]
    t = q_slots_T[None, :, None]
    ok = (s >= pad_B[:, None, None]) & (s <= t)
    if window is not None:
        ok = ok & (t - s < window)
    return ok


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate_jit(
    graphdef, state, prompt_BxP, pad_B, rng, temperature, top_k, top_p, stop_ids, pad_id, *, max_new_tokens: int
):
    cfg = nnx.merge(graphdef, state).cfg

    def decode_step(st, *args):
        return nnx.merge(graphdef, st).decode_step(*args)

    B, P = prompt_BxP.shape
    S = P + max_new_tokens
    window = cfg.sliding_window
    caches = init_cache(cfg, B, S)
    slots = jnp.arange(P)
    positions = jnp.maximum(slots[None, :] - pad_B[:, None], 0).astype(jnp.int32)
    mask = _decode_mask(pad_B, slots, S, window)
    logits, caches = decode_step(state, prompt_BxP, positions, mask, caches, jnp.zeros((), jnp.int32))
    last = logits[:, -1, :]

    tokens = jnp.full((B, max_new_tokens), pad_id, jnp.int32)
    logps = jnp.zeros((B, max_new_tokens), jnp.float32)
    done = jnp.zeros((B,), bool)
    lengths = jnp.zeros((B,), jnp.int32)
    stopped = jnp.zeros((B,), bool)

    # The model state rides in the loop carry (unchanged) rather than being closed over:
    # nnx transforms inside the model (scan over stacked layers) refuse variables whose
    # values come from an outer trace level.
    def cond(carry):
        t, _, _, _, done, *_ = carry
        return (t < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        t, last, caches, rng, done, tokens, logps, lengths, stopped, st = carry
        rng, sub = jax.random.split(rng)
        tok, lp = sample_tokens(last, sub, temperature, top_k, top_p)
        tok = jnp.where(done, pad_id, tok)
        lp = jnp.where(done, 0.0, lp)
        tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, t))
        logps = jax.lax.dynamic_update_slice(logps, lp[:, None], (0, t))
        lengths = lengths + (~done).astype(jnp.int32)
        is_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1) & ~done
        stopped = stopped | is_stop
        done = done | is_stop
        slot = P + t
        pos = (slot - pad_B)[:, None].astype(jnp.int32)
        m = _decode_mask(pad_B, slot[None], S, window)
        logits, caches = decode_step(st, tok[:, None], pos, m, caches, slot)
        return t + 1, logits[:, 0, :], caches, rng, done, tokens, logps, lengths, stopped, st

    carry = (jnp.zeros((), jnp.int32), last, caches, rng, done, tokens, logps, lengths, stopped, state)
    _, _, _, _, _, tokens, logps, lengths, stopped, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, logps, lengths, stopped


def bucket_length(n: int, minimum: int = 16) -> int:
    """Prompt bucket: the next power of two >= n (at least `minimum`), bounding recompiles."""
    b = minimum
    while b < n:
        b *= 2
    return b


def prompt_bucket_for(longest: int, max_new_tokens: int, max_seq_len: int) -> int:
    """`bucket_length(longest)`, capped so that bucket + max_new_tokens fits max_seq_len
    whenever the prompt itself does: the power of two is there to bound recompiles, not to
    refuse a request that fits."""
    return max(longest, min(bucket_length(longest), max_seq_len - max_new_tokens))


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists to [B, length]; returns (ids, pad counts [B])."""
    B = len(prompts)
    ids = np.full((B, length), pad_id, np.int32)
    pads = np.zeros((B,), np.int32)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(p) > length:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than the bucket length {length}")
        ids[i, length - len(p) :] = np.asarray(p, np.int32)
        pads[i] = length - len(p)
    return ids, pads


def generate(
    model: Decoder,
    prompts: Sequence[Sequence[int]] | tuple[np.ndarray, np.ndarray],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    rng: jax.Array | None = None,
    pad_id: int = 0,
    prompt_bucket: int | None = None,
) -> GenerateOutput:
    """Generates continuations for a batch of prompts (see the module docstring).

    prompts: a list of token-id lists, or (ids_BxP right-padded, lengths_B) arrays.
    max_new_tokens: tokens generated per row at most (also the cache extension).
    temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off; stop_tokens: up to
    MAX_STOP_TOKENS ids that end a row (the stop token is included in the output).
    prompt_bucket: padded prompt length (default: next power of two >= longest prompt, capped
    at model.max_seq_len - max_new_tokens when the longest prompt fits under that).
    """
    if isinstance(prompts, tuple) and len(prompts) == 2 and np.ndim(prompts[0]) == 2 and np.ndim(prompts[1]) == 1:
        ids, lens = np.asarray(prompts[0]), np.asarray(prompts[1])
        prompts = [ids[i, : int(lens[i])].tolist() for i in range(ids.shape[0])]
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"bad sampling settings temperature={temperature} top_p={top_p} top_k={top_k}: "
            "need temperature >= 0, 0 < top_p <= 1, top_k >= 0"
        )
    if len(stop_tokens) > MAX_STOP_TOKENS:
        raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens, got {len(stop_tokens)}")
    longest = max(len(p) for p in prompts)
    cfg = model.cfg
    P = prompt_bucket or prompt_bucket_for(longest, max_new_tokens, cfg.max_seq_len)
    if P < longest:
        raise ValueError(f"prompt_bucket={P} is shorter than the longest prompt ({longest} tokens)")
    if P + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt of {longest} tokens (padded to {P}) + max_new_tokens {max_new_tokens} exceeds "
            f"model.max_seq_len={cfg.max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    ids, pads = left_pad(prompts, pad_id, P)
    stop = np.full((MAX_STOP_TOKENS,), -1, np.int32)
    stop[: len(stop_tokens)] = np.asarray(stop_tokens, np.int32)
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    tokens, logps, lengths, stopped = _generate_jit(
        graphdef,
        state,
        jnp.asarray(ids),
        jnp.asarray(pads),
        rng,
        jnp.float32(temperature),
        jnp.int32(top_k),
        jnp.float32(top_p),
        jnp.asarray(stop),
        jnp.int32(pad_id),
        max_new_tokens=max_new_tokens,
    )
    stopped = np.asarray(stopped)
    return GenerateOutput(
        tokens_BxN=np.asarray(tokens),
        logprobs_BxN=np.asarray(logps),
        lengths_B=np.asarray(lengths),
        finish_reasons=[FINISH_NAMES[FINISH_STOP if s else FINISH_LENGTH] for s in stopped],
    )
