"""Scored trajectories -> the batch of a policy-gradient step.

One trajectory per row, `[B, L]` with L = train.seq_len (or the shortest halving of it that
holds the longest row, ptrain.data.buckets, so a stage compiles a few step shapes):

  input_ids    int32   token_ids[:-1], padded with 0
  target_ids   int32   token_ids[1:]
  positions    int32   0 .. n-2
  segment_ids  int32   1 on real tokens, 0 on padding
  loss_mask    float32 1 where the target token was sampled by the policy (and counts)
  engine_logp  float32 the engine's log-prob of each target token (0 where not sampled)
  advantages   float32 [B] per trajectory
  row_valid    float32 [B] 1 for a real row, 0 for a padding row

Packed (`pack=True`), trajectories share rows, first-fit in decreasing length: each is its own
segment (segment_ids 1, 2, ... within a row, positions restarting at 0), attention stays inside
it, and `advantages` is per token, [B, L]. A batch of mixed lengths then trains on far fewer
rows; the row count is rounded up to a few sizes (`packed_rows`) so a stage compiles few shapes.

The shift keeps the batch contract of SFT (ptrain/__init__.py): position i predicts
target i. Token ids are used exactly as the engine and the environment produced them.

A masked trajectory (`Trajectory.masked`: its environment says the reward is no measurement,
NeMo Gym's mask_sample) is trained on by no row, and `measured_advantages` leaves its reward
out of its group's baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from ptrain.envs.base import Trajectory
from ptrain.losses.advantages import AdvantageAux, group_advantages

POLICY_BATCH_KEYS = (
    "input_ids", "target_ids", "positions", "segment_ids", "loss_mask", "engine_logp", "advantages", "row_valid",
)  # fmt: skip


def policy_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float] | np.ndarray,
    *,
    rows: int,
    seq_len: int,
    mask_truncated: bool = False,
    pack: bool = False,
    multiple: int = 1,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Place trajectories into `rows` rows of `seq_len` tokens (padding rows at the end).

    mask_truncated: drop the tokens of trajectories that hit a length limit from the loss
    (DAPO's overlong filtering). A trajectory longer than seq_len + 1 tokens keeps its first
    seq_len + 1 and is counted in `clipped_trajectories` (the stage's config check makes that
    rare: prompts + max_new_tokens should fit).

    pack: several trajectories to a row (module docstring); the batch has `packed_rows(needed,
    rows, multiple)` rows instead of `rows`.

    A masked trajectory gets no row content (row_valid 0, no loss tokens), counted in
    `masked_samples`.

    Returns (batch, counts): counts has `trajectories`, `clipped_trajectories`,
    `masked_truncated`, `masked_samples`, `loss_tokens`.
    """
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit {rows} rows; raise the batch or split it")
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    L = seq_len
    # Each trajectory's tokens, cut to seq_len + 1 (the shifted row holds seq_len of them).
    kept = [None if t.masked else min(len(t.token_ids), L + 1) for t in trajectories]
    place = _packed_places(kept, L) if pack else [(b, 0) for b in range(len(trajectories))]
    n_rows = packed_rows(1 + max((r for r, _ in place), default=-1), rows, multiple) if pack else rows
    batch = {
        "input_ids": np.zeros((n_rows, L), np.int32),
        "target_ids": np.zeros((n_rows, L), np.int32),
        "positions": np.zeros((n_rows, L), np.int32),
        "segment_ids": np.zeros((n_rows, L), np.int32),
        "loss_mask": np.zeros((n_rows, L), np.float32),
        "engine_logp": np.zeros((n_rows, L), np.float32),
        "advantages": np.zeros((n_rows, L) if pack else (n_rows,), np.float32),
        "row_valid": np.zeros((n_rows,), np.float32),
    }
    clipped = masked = dropped = 0
    for t, adv, size, (b, at) in zip(trajectories, advantages, kept, place):
        if size is None:
            dropped += 1
            continue
        clipped += size < len(t.token_ids)
        n = size - 1
        if n < 1:
            continue
        ids = np.asarray(t.token_ids[:size], np.int32)
        keep = np.asarray(t.loss_mask[1:size], np.float32)
        if mask_truncated and t.finish_reason in ("length", "token_limit"):
            keep = np.zeros_like(keep)
            masked += 1
        span = slice(at, at + n)
        batch["input_ids"][b, span] = ids[:-1]
        batch["target_ids"][b, span] = ids[1:]
        batch["positions"][b, span] = np.arange(n)
        batch["segment_ids"][b, span] = batch["segment_ids"][b].max() + 1 if pack else 1
        batch["loss_mask"][b, span] = keep
        batch["engine_logp"][b, span] = np.where(keep > 0, np.asarray(t.logprobs[1:size], np.float32), 0.0)
        batch["advantages"][(b, span) if pack else b] = adv
        batch["row_valid"][b] = 1.0
    counts = {
        "trajectories": float(len(trajectories)),
        "clipped_trajectories": float(clipped),
        "masked_truncated": float(masked),
        "masked_samples": float(dropped),
        "loss_tokens": float(batch["loss_mask"].sum()),
    }
    return batch, counts


def _packed_places(sizes: Sequence[int | None], length: int) -> list[tuple[int, int]]:
    """(row, offset) of each trajectory of `sizes` tokens (None: it gets no row) in rows of
    `length` tokens, first fit in decreasing size (deterministic: ties keep their order)."""
    free: list[int] = []
    place = [(0, 0)] * len(sizes)
    for i in sorted((i for i, s in enumerate(sizes) if s is not None), key=lambda i: -sizes[i]):
        n = max(sizes[i] - 1, 0)
        row = next((r for r, f in enumerate(free) if f >= n), None)
        if row is None:
            row = len(free)
            free.append(length)
        place[i] = (row, length - free[row])
        free[row] -= n
    return place


def packed_rows(needed: int, rows: int, multiple: int = 1) -> int:
    """The row count of a packed batch that needs `needed` rows: the smallest of rows, 3/4, 1/2,
    3/8, 1/4, ... of `rows` that holds them and is a multiple of `multiple` (the data-parallel
    size x micro-batches, which divides `rows`), so a stage compiles about 2 log2(rows) shapes."""
    best, size = rows, rows
    while size >= 1:
        for candidate in (size, size * 3 / 4):
            if candidate == int(candidate) and int(candidate) % multiple == 0 and needed <= candidate < best:
                best = int(candidate)
        size /= 2
    return best


def measured_advantages(
    rewards_BxG: np.ndarray, masked_BxG: np.ndarray, *, cfg, invalid_BxG: np.ndarray
) -> tuple[np.ndarray, AdvantageAux]:
    """`group_advantages` with masked samples left out: each group's baseline (and std) comes
    from its measured samples only, and a masked sample's advantage is 0.

    rewards_BxG float [B, G]; masked_BxG, invalid_BxG bool [B, G]. Without a masked sample this
    is `group_advantages(rewards_BxG, cfg=cfg, invalid_BxG=invalid_BxG)` itself. A group left with
    fewer than 2 measured samples has no baseline to compare against and carries no signal:
    advantages 0 (cfg.invalid_tool_call_advantage still applies to an invalid measured sample),
    counted in frac_zero_std. The aux statistics are over measured samples: reward_mean their
    mean, reward_std the mean over groups of their std (0 for a group with fewer than 2),
    advantage_abs_mean over all samples as returned.
    """
    rewards = np.asarray(rewards_BxG, np.float32)
    masked = np.asarray(masked_BxG, bool)
    invalid = np.asarray(invalid_BxG, bool)
    if not masked.any():
        adv, aux = group_advantages(jnp.asarray(rewards), cfg=cfg, invalid_BxG=jnp.asarray(invalid))
        return np.asarray(adv), aux
    adv = np.zeros_like(rewards)
    zero_std, stds = np.zeros(len(rewards), bool), np.zeros(len(rewards), np.float32)
    for i in range(len(rewards)):
        keep = ~masked[i]
        if keep.sum() >= 2:
            a, aux_i = group_advantages(jnp.asarray(rewards[i, keep][None]), cfg=cfg,
                                        invalid_BxG=jnp.asarray(invalid[i, keep][None]))  # fmt: skip
            adv[i, keep] = np.asarray(a)[0]
            zero_std[i], stds[i] = bool(aux_i.frac_zero_std > 0), float(aux_i.reward_std)
        else:
            zero_std[i] = True
            if cfg.invalid_tool_call_advantage is not None:
                adv[i, keep & invalid[i]] = cfg.invalid_tool_call_advantage
    measured = rewards[~masked]
    aux = AdvantageAux(
        frac_zero_std=jnp.float32(zero_std.mean()),
        reward_mean=jnp.float32(measured.mean() if measured.size else 0.0),
        reward_std=jnp.float32(stds.mean()),
        advantage_abs_mean=jnp.float32(np.abs(adv).mean()),
    )
    return adv, aux
