"""Generation with a KV cache: the pure pieces (sampling, masks, static-batch generation)
that the serving engine (`ptrain.rollout.LocalEngine`) and `StaticGenerator` jit.

    out = generate(model, [[1, 5, 7], [1, 9]], max_new_tokens=32, temperature=0.0,
                   stop_tokens=[eos_id])
    out.tokens_BxN, out.logprobs_BxN, out.sampling_logprobs_BxN, out.lengths_B,
    out.finish_reasons  (host numpy)

Prompts of different lengths are LEFT-padded to a common bucket length P, so every row
writes its next key/value at the same cache slot (one dynamic_update_slice per layer);
positions are `slot - pad` per row, and pad slots are masked out of attention. The whole
loop is one jitted function, compiled once per (batch, prompt bucket, max new tokens)
and reused across calls and sampling settings (temperature, top-p, top-k and stop tokens
are traced arguments, not compile-time constants).

Sampling (per row, in float32): logits / temperature, keep the top_k largest (0 = all),
keep the smallest set of tokens whose probability reaches top_p (nucleus; Holtzman et al.
2020) and those within min_p of the top token, then sample. Two log-probs come back per
token: under the tempered full-vocabulary softmax (`logprobs`: what a policy loss computes
for that token) and under the filtered distribution sampled from (`sampling_logprobs`).
Greedy decoding (temperature == 0) picks argmax and reports the untempered softmax's
log-prob for both (a point mass would say 0 for every token).

A thinking budget (`SamplingParams.thinking_budget`) is the serving engine's: `sample_rows`
takes forced tokens and `think_end_match` tracks the end-of-thinking sequence there. Static
generation has no budget; it serves tests and the batching baseline, not reasoning evals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain.kernels import cpu as cpu_kernels
from ptrain.models.decoder import Decoder, init_cache
from ptrain.models.weights import pack_decode_weights

MAX_STOP_TOKENS = 64
"""Stop-token slots; a fixed size keeps the compiled loop reusable across stop sets."""

FINISH_LENGTH, FINISH_STOP = 0, 1
FINISH_NAMES = {FINISH_LENGTH: "length", FINISH_STOP: "stop"}


@dataclasses.dataclass
class GenerateOutput:
    """Result of `generate` (host numpy arrays).

    tokens_BxN: int32 generated ids, N = max_new_tokens, `pad_id` after each row's end.
    logprobs_BxN: float32 log-prob of each generated token under the tempered full-vocabulary
      softmax (the untempered one when greedy), the distribution a policy loss computes;
      0 after the end.
    sampling_logprobs_BxN: float32 log-prob under the top-k / top-p filtered distribution
      actually sampled from (equal to logprobs_BxN without filtering); 0 after the end.
    lengths_B: int32 generated tokens per row, the stop token included.
    finish_reasons: per row "stop" (a stop token was generated) or "length".
    """

    tokens_BxN: np.ndarray
    logprobs_BxN: np.ndarray
    sampling_logprobs_BxN: np.ndarray
    lengths_B: np.ndarray
    finish_reasons: list[str]


def filter_logits(z_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array, min_p_B: jax.Array) -> jax.Array:
    """Tempered logits with tokens outside each row's top-k / top-p / min-p set at -inf.

    z_BxV: float32 logits already divided by the temperature. Per row: top_k (<= 0 or >= V
    keeps all), top_p in (0, 1] (nucleus: the smallest set of most likely tokens whose mass
    reaches top_p; Holtzman et al. 2020), min_p in [0, 1] (tokens with p >= min_p * p_max).
    The most likely token always survives.
    """
    return jnp.where(z_BxV >= filter_cutoff(z_BxV, top_k_B, top_p_B, min_p_B), z_BxV, -jnp.inf)


def _order_key(z: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 values (-inf lowest, NaN-free input)."""
    bits = jax.lax.bitcast_convert_type(z, jnp.uint32)
    negative = (bits >> 31).astype(bool)
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_where(key_BxV: jax.Array, ok) -> jax.Array:
    """[B, 1] uint32: per row the largest threshold c with ok(key_BxV >= c) ([B, V] bool ->
    [B] bool, true for the row's smallest key and monotone in c), by bisection over the 32
    bits: 32 passes over [B, V] instead of a sort of the vocabulary."""
    lo = jnp.min(key_BxV, axis=-1, keepdims=True)  # ok holds here: every entry is kept
    hi = jnp.max(key_BxV, axis=-1, keepdims=True)

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2  # > lo while lo < hi; no overflow in uint32
        good = ok(key_BxV >= mid)[:, None]
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return lo


def filter_cutoff(z_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array, min_p_B: jax.Array) -> jax.Array:
    """[B, 1]: the smallest tempered logit `filter_logits` keeps in each row.

    top-k: the largest threshold that keeps at least k tokens (the k-th largest value);
    top-p: the largest that keeps at least top_p of the mass (the value at which the running
    mass of the tokens in descending order first reaches top_p). Both are found by bisection
    on the values' bit patterns, not by sorting: XLA:CPU sorted 16 rows of 151936 in 0.55 s.
    """
    V = z_BxV.shape[-1]
    key = _order_key(z_BxV)
    k = jnp.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
    kth = _largest_key_where(key, lambda keep: jnp.sum(keep, axis=-1) >= k)
    zmax = jnp.max(z_BxV, axis=-1, keepdims=True)
    p = jnp.exp(z_BxV - zmax)
    total = jnp.sum(p, axis=-1)
    pth = _largest_key_where(key, lambda keep: jnp.sum(jnp.where(keep, p, 0.0), axis=-1) >= top_p_B * total)
    # top_p = 1 keeps everything: in float32 the head's mass can already equal the total.
    pth = jnp.where(top_p_B[:, None] >= 1.0, jnp.min(key, axis=-1, keepdims=True), pth)
    cutoff_key = jnp.maximum(kth, pth)
    # Back to a value: the smallest logit whose key reaches the cutoff (one that exists).
    cut = jnp.min(jnp.where(key >= cutoff_key, z_BxV, jnp.inf), axis=-1, keepdims=True)
    # p >= min_p * p_max  <=>  z >= z_max + log(min_p)
    mth = zmax + jnp.log(jnp.maximum(min_p_B[:, None], 1e-30))
    return jnp.maximum(cut, jnp.where(min_p_B[:, None] > 0, mth, -jnp.inf))


def sample_key(base_key_data_Bx2: jax.Array, t_B: jax.Array) -> jax.Array:
    """The PRNG key of each row's token t: fold_in(base_b, t_b). With base_b =
    fold_in(key(seed), b) a sample's tokens depend only on its seed, its index and t, not on
    the batch it ran in, so static and continuous batching draw the same samples."""
    return jax.vmap(lambda k, t: jax.random.fold_in(jax.random.wrap_key_data(k), t))(base_key_data_Bx2, t_B)


def base_keys(seed_key: jax.Array, n: int, first: int = 0) -> jax.Array:
    """uint32 [n, 2] key data fold_in(seed_key, first + j) for j < n."""
    return jax.vmap(lambda j: jax.random.key_data(jax.random.fold_in(seed_key, j)))(
        first + jnp.arange(n, dtype=jnp.int32)
    )


SAMPLE_BLOCK = 256
"""Vocabulary block of `draw_tokens`' two-level running sum."""


def draw_tokens(z_BxV: jax.Array, u_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row from softmax(z_BxV), never a -inf entry, given a uniform u_B in
    [0, 1) per row: (int32 [B], the rows' logsumexp [B]). A row needs one finite entry.

    Inverse transform sampling: the token is the first whose running probability mass
    passes u times the row's total. The running sum is two-level
    (sums of SAMPLE_BLOCK-token blocks, then the chosen block's own sum), so its float32
    rounding stays at the scale of one block. The Gumbel-max trick (`jax.random.categorical`)
    draws a uniform and takes two logarithms per vocabulary entry instead: on 2 CPU cores at
    16 rows it took 1.0-1.5 ms at V=4096 and 41-58 ms at V=151936, against 0.13-0.25 and
    2.2-3.5 ms here (docs/performance.md).
    """
    B, V = z_BxV.shape
    n_blocks = -(-V // SAMPLE_BLOCK)
    m = jnp.max(z_BxV, axis=-1)
    p = jnp.exp(z_BxV - m[:, None])  # the largest entry is 1, -inf entries are 0
    blocks = jnp.pad(p, ((0, 0), (0, n_blocks * SAMPLE_BLOCK - V))).reshape(B, n_blocks, SAMPLE_BLOCK)
    block_mass = blocks.sum(-1)
    mass = jnp.cumsum(block_mass, axis=-1)  # [B, n_blocks]
    target = u_B * mass[:, -1]

    def last_nonzero(x):  # index of the last entry > 0 along the last axis
        return x.shape[-1] - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)

    # `<=` steps over zero-mass blocks and tokens, so u = 0 lands on the first drawable token;
    # u * total can round up to the total, and then the last drawable block / token is taken.
    blk = jnp.minimum(jnp.sum(mass <= target[:, None], axis=-1), last_nonzero(block_mass))
    before = jnp.where(blk > 0, jnp.take_along_axis(mass, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, SAMPLE_BLOCK]
    within = before[:, None] + jnp.cumsum(inner, axis=-1)
    j = jnp.minimum(jnp.sum(within <= target[:, None], axis=-1), last_nonzero(inner))
    return (blk * SAMPLE_BLOCK + j).astype(jnp.int32), m + jnp.log(mass[:, -1])


def sample_rows(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B, min_p_B, *, filtering: bool | None = None,
                forced_B: jax.Array | None = None):  # fmt: skip
    """One sampling step per row: (token ids [B] int32, log-prob under the tempered full
    softmax [B], log-prob under the filtered distribution sampled from [B]), float32.

    temperature_B <= 0 decodes that row greedily (argmax; both log-probs are the untempered
    softmax's). `filtering` (static) says whether some sampled row has a top-k / top-p /
    min-p filter, when the caller knows (`filters`): False skips the cutoff search, True
    always runs it, None decides on device with lax.cond. A caller that knows should say: at
    V=151936 XLA:CPU ran the whole step about 6x slower with a [B, V] operand going into a cond.

    forced_B: int32 [B], a token id that row b takes instead of drawing one, or -1 to draw
    (a thinking budget's end-of-thinking tokens). A forced token's two log-probs are both its
    log-prob under the tempered full softmax: it was not drawn from any truncated distribution,
    and the trainer recomputes exactly that number, so its importance ratio stays 1. None
    traces the plain step.
    """
    x = logits_BxV.astype(jnp.float32)
    greedy = temperature_B <= 0.0
    z = x / jnp.where(greedy, 1.0, temperature_B)[:, None]
    V = x.shape[-1]
    if filtering is None:
        any_filter = jnp.any(_filtering_rows(temperature_B, top_k_B, top_p_B, min_p_B, V))
        cutoff = jax.lax.cond(
            any_filter,
            lambda a: filter_cutoff(a, top_k_B, top_p_B, min_p_B),
            lambda a: jnp.full((a.shape[0], 1), -jnp.inf, a.dtype),
            z,
        )
        filtered = jnp.where(z >= cutoff, z, -jnp.inf)
    elif filtering:
        filtered = filter_logits(z, top_k_B, top_p_B, min_p_B)
    else:
        filtered = z
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B)
    drawn, lse_filtered = draw_tokens(filtered, u)
    tok = jax.lax.cond(
        jnp.any(greedy), lambda: jnp.where(greedy, jnp.argmax(x, axis=-1).astype(jnp.int32), drawn), lambda: drawn
    )
    if forced_B is not None:
        tok = jnp.where(forced_B >= 0, forced_B, tok)
    lse_full = lse_filtered if filtering is False else jax.nn.logsumexp(z, axis=-1)
    lp_full = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - lse_full
    lp_filtered = jnp.take_along_axis(filtered, tok[:, None], axis=-1)[:, 0] - lse_filtered
    one_lp = greedy if forced_B is None else greedy | (forced_B >= 0)  # rows whose two log-probs agree
    return tok, lp_full, jnp.where(one_lp, lp_full, lp_filtered)


def think_end_match(recent_BxM: jax.Array, end_ids_BxM: jax.Array, end_len_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """How far each row's last tokens have got into its end-of-thinking sequence.

    recent_BxM: the row's last M generated tokens, oldest first, -1 where there are fewer;
    end_ids_BxM: its end-of-thinking ids, left-aligned, end_len_B of them (-1 after).
    Returns (partial_B, closed_B): the longest k < end_len with recent[-k:] == end_ids[:k]
    (the KMP state: how many end tokens a forced completion may skip), and whether
    recent[-end_len:] == end_ids[:end_len] (the sequence was just completed). [B, M, M]
    compares; M is small.
    """
    M = recent_BxM.shape[1]
    k_K = jnp.arange(1, M + 1, dtype=jnp.int32)
    i_I = jnp.arange(M, dtype=jnp.int32)
    idx_KxI = jnp.clip(M - k_K[:, None] + i_I[None, :], 0, M - 1)
    window_BxKxI = recent_BxM[:, idx_KxI]
    ok = (window_BxKxI == end_ids_BxM[:, None, :]) | (i_I[None, None, :] >= k_K[None, :, None])
    match_BxK = jnp.all(ok, axis=-1)
    closed = jnp.any(match_BxK & (k_K[None, :] == end_len_B[:, None]), axis=-1) & (end_len_B > 0)
    partial = jnp.max(jnp.where(match_BxK & (k_K[None, :] < end_len_B[:, None]), k_K[None, :], 0), axis=-1)
    return partial, closed


def _filtering_rows(temperature, top_k, top_p, min_p, vocab_size: int):
    """Per row (numpy or jax arrays): sampled (temperature > 0) with a top-k below the
    vocabulary, a top-p below 1 or a min-p above 0."""
    return (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0) | (min_p > 0.0)) & (temperature > 0)


def filters(temperature, top_k, top_p, min_p, vocab_size: int) -> bool:
    """Host side of `sample_rows`' `filtering`: whether any row filters (numpy arrays or scalars)."""
    t, k, p, m = (np.asarray(a) for a in (temperature, top_k, top_p, min_p))
    return bool(np.any(_filtering_rows(t, k, p, m, vocab_size)))


def decode_mask(pad_B: jax.Array, q_slots_T: jax.Array, S: int, window: int | None) -> jax.Array:
    """[B, T, S]: key slot s visible to query slot t iff pad_b <= s <= t (and in window)."""
    s = jnp.arange(S)[None, None, :]
    t = q_slots_T[None, :, None]
    ok = (s >= pad_B[:, None, None]) & (s <= t)
    if window is not None:
        ok = ok & (t - s < window)
    return ok


def generate_tokens(
    graphdef, state, prompt_BxP, pad_B, rng, temperature, top_k, top_p, stop_ids, pad_id, *, max_new_tokens: int,
    filtering: bool | None = None, decode_state=None,
):  # fmt: skip
    """Static-batch generation as one pure function (the owner jits it, with `graphdef` and
    `max_new_tokens` static): prefill a left-padded [B, P] batch, then a `lax.while_loop` of
    single-token decode steps until every row stopped or max_new_tokens.

    state: the model's nnx state (`nnx.split(model)`); rng: a key, row b samples with
    `sample_key(fold_in(rng, b), t)`; temperature / top_k / top_p: scalars for every row;
    stop_ids: int32 [MAX_STOP_TOKENS] padded with -1. Returns (tokens, logprobs,
    sampling_logprobs [B, N], lengths [B], stopped [B]). decode_state: the same weights for
    the single-token steps in another layout (`pack_decode_weights` of its pure dict), or
    None to use `state`.
    """
    cfg = nnx.merge(graphdef, state).cfg

    def decode_step(st, *args):
        return nnx.merge(graphdef, st).decode_step(*args)

    B, P = prompt_BxP.shape
    S = P + max_new_tokens
    window = cfg.sliding_window
    caches = init_cache(cfg, B, S)
    slots = jnp.arange(P)
    positions = jnp.maximum(slots[None, :] - pad_B[:, None], 0).astype(jnp.int32)
    logits, caches = decode_step(state, prompt_BxP, positions, decode_mask(pad_B, slots, S, window), caches, 0)
    keys = base_keys(rng, B)
    row = lambda x: jnp.broadcast_to(x, (B,))
    temp_B, top_k_B, top_p_B, min_p_B = row(temperature), row(top_k), row(top_p), row(jnp.float32(0))

    tokens = jnp.full((B, max_new_tokens), pad_id, jnp.int32)
    logps = jnp.zeros((B, max_new_tokens), jnp.float32)
    slogps = jnp.zeros((B, max_new_tokens), jnp.float32)
    done = jnp.zeros((B,), bool)
    lengths = jnp.zeros((B,), jnp.int32)
    stopped = jnp.zeros((B,), bool)

    # The model state rides in the loop carry (unchanged) rather than being closed over:
    # nnx transforms inside the model (scan over stacked layers) refuse variables whose
    # values come from an outer trace level.
    def cond(carry):
        t, _, _, done, *_ = carry
        return (t < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        t, last, caches, done, tokens, logps, slogps, lengths, stopped, st = carry
        tok, lp, slp = sample_rows(
            last, sample_key(keys, row(t)), temp_B, top_k_B, top_p_B, min_p_B, filtering=filtering
        )
        tok = jnp.where(done, pad_id, tok)
        tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, t))
        logps = jax.lax.dynamic_update_slice(logps, jnp.where(done, 0.0, lp)[:, None], (0, t))
        slogps = jax.lax.dynamic_update_slice(slogps, jnp.where(done, 0.0, slp)[:, None], (0, t))
        lengths = lengths + (~done).astype(jnp.int32)
        is_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1) & ~done
        stopped = stopped | is_stop
        done = done | is_stop
        slot = P + t
        pos = (slot - pad_B)[:, None].astype(jnp.int32)
        logits, caches = decode_step(st, tok[:, None], pos, decode_mask(pad_B, slot[None], S, window), caches, slot)
        return t + 1, logits[:, 0, :], caches, done, tokens, logps, slogps, lengths, stopped, st

    st = state if decode_state is None else decode_state
    carry = (jnp.zeros((), jnp.int32), logits[:, -1, :], caches, done, tokens, logps, slogps, lengths, stopped, st)
    _, _, _, _, tokens, logps, slogps, lengths, stopped, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, logps, slogps, lengths, stopped


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


class StaticGenerator:
    """Static-batch generation for one model: `generate_tokens` jitted once, here, by its
    owner; compiled once per (batch, prompt bucket, max new tokens) and reused across calls,
    sampling settings and weights (`params` may be passed per call).

        gen = StaticGenerator(model)
        out = gen([[1, 5, 7], [1, 9]], max_new_tokens=32, stop_tokens=[eos_id])

    The serving engine (`ptrain.rollout.LocalEngine`) batches continuously instead; this is
    the simple path for one-off batches, tests and the static-batching baseline. Like the
    engine, on one CPU device with float32 weights its decode steps read the dense weights
    packed for ptrain.kernels.cpu (a second copy, made here or per call for `state`).
    """

    def __init__(self, model: Decoder):
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self._fn = jax.jit(generate_tokens, static_argnames=("graphdef", "max_new_tokens", "filtering"))
        packs = cpu_kernels.packing_applies(nnx.to_pure_dict(self.state))
        self._pack = (lambda st: pack_decode_weights(nnx.to_pure_dict(st))) if packs else None
        self._decode_state = self._pack(self.state) if packs else None

    def __call__(
        self,
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
        state=None,
    ) -> GenerateOutput:
        """Continuations of a batch of prompts (see `generate`); `state` replaces the
        model's nnx state (same structure) for this call."""
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
        P = prompt_bucket or prompt_bucket_for(longest, max_new_tokens, self.cfg.max_seq_len)
        if P < longest:
            raise ValueError(f"prompt_bucket={P} is shorter than the longest prompt ({longest} tokens)")
        if P + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt of {longest} tokens (padded to {P}) + max_new_tokens {max_new_tokens} exceeds "
                f"model.max_seq_len={self.cfg.max_seq_len}; shorten the prompt or lower max_new_tokens"
            )
        ids, pads = left_pad(prompts, pad_id, P)
        stop = np.full((MAX_STOP_TOKENS,), -1, np.int32)
        stop[: len(stop_tokens)] = np.asarray(stop_tokens, np.int32)
        if state is None:
            state, decode_state = self.state, self._decode_state
        else:
            decode_state = None if self._pack is None else self._pack(state)
        tokens, logps, slogps, lengths, stopped = self._fn(
            self.graphdef,
            state,
            jnp.asarray(ids),
            jnp.asarray(pads),
            jax.random.key(0) if rng is None else rng,
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
            jnp.asarray(stop),
            jnp.int32(pad_id),
            max_new_tokens=max_new_tokens,
            filtering=filters(temperature, top_k, top_p, 0.0, self.cfg.vocab_size),
            decode_state=decode_state,
        )
        stopped = np.asarray(stopped)
        return GenerateOutput(
            tokens_BxN=np.asarray(tokens),
            logprobs_BxN=np.asarray(logps),
            sampling_logprobs_BxN=np.asarray(slogps),
            lengths_B=np.asarray(lengths),
            finish_reasons=[FINISH_NAMES[FINISH_STOP if s else FINISH_LENGTH] for s in stopped],
        )


def generate(model: Decoder, prompts, **kw) -> GenerateOutput:
    """One static batch: `StaticGenerator(model)(prompts, **kw)`.

    prompts: a list of token-id lists, or (ids_BxP right-padded, lengths_B) arrays.
    max_new_tokens: tokens generated per row at most (also the cache extension).
    temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off; stop_tokens: up to
    MAX_STOP_TOKENS ids that end a row (the stop token is included in the output).
    prompt_bucket: padded prompt length (default: next power of two >= longest prompt, capped
    at model.max_seq_len - max_new_tokens when the longest prompt fits under that).
    Calls with the same model structure and shapes reuse one compiled program (jit caches
    on the pure function `generate_tokens`); a driver that samples repeatedly keeps a
    StaticGenerator or a LocalEngine instead, which also skips re-splitting the model.
    """
    return StaticGenerator(model)(prompts, **kw)
