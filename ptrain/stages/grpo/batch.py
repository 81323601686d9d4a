"""Scored trajectories -> the fixed-shape batch of a policy-gradient step.

One trajectory per row, `[B, L]` with L = train.seq_len, so the step compiles once:

  input_ids    int32   token_ids[:-1], padded with 0
  target_ids   int32   token_ids[1:]
  positions    int32   0 .. n-2
  segment_ids  int32   1 on real tokens, 0 on padding
  loss_mask    float32 1 where the target token was sampled by the policy (and counts)
  engine_logp  float32 the engine's log-prob of each target token (0 where not sampled)
  advantages   float32 [B] per trajectory
  row_valid    float32 [B] 1 for a real row, 0 for a padding row

The shift keeps the batch contract of SFT (ptrain/__init__.py): position i predicts
target i. Token ids are used exactly as the engine and the environment produced them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ptrain.envs.base import Trajectory

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
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Pack trajectories into `rows` rows of `seq_len` tokens (padding rows at the end).

    mask_truncated: drop the tokens of trajectories that hit a length limit from the loss
    (DAPO's overlong filtering). A trajectory longer than seq_len + 1 tokens keeps its first
    seq_len + 1 and is counted in `clipped_trajectories` (the stage's config check makes that
    rare: prompts + max_new_tokens should fit).

    Returns (batch, counts): counts has `trajectories`, `clipped_trajectories`,
    `masked_truncated`, `loss_tokens`.
    """
    if len(trajectories) > rows:
        raise ValueError(f"{len(trajectories)} trajectories do not fit {rows} rows; raise the batch or split it")
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    L = seq_len
    batch = {
        "input_ids": np.zeros((rows, L), np.int32),
        "target_ids": np.zeros((rows, L), np.int32),
        "positions": np.zeros((rows, L), np.int32),
        "segment_ids": np.zeros((rows, L), np.int32),
        "loss_mask": np.zeros((rows, L), np.float32),
        "engine_logp": np.zeros((rows, L), np.float32),
        "advantages": np.zeros((rows,), np.float32),
        "row_valid": np.zeros((rows,), np.float32),
    }
    clipped = masked = 0
    for b, (t, adv) in enumerate(zip(trajectories, advantages)):
        ids = np.asarray(t.token_ids, np.int32)
        mask = np.asarray(t.loss_mask, np.float32)
        logp = np.asarray(t.logprobs, np.float32)
        if ids.size > L + 1:
            ids, mask, logp = ids[: L + 1], mask[: L + 1], logp[: L + 1]
            clipped += 1
        n = ids.size - 1
        if n < 1:
            continue
        batch["input_ids"][b, :n] = ids[:-1]
        batch["target_ids"][b, :n] = ids[1:]
        batch["positions"][b, :n] = np.arange(n)
        batch["segment_ids"][b, :n] = 1
        keep = mask[1:]
        if mask_truncated and t.finish_reason in ("length", "token_limit"):
            keep = np.zeros_like(keep)
            masked += 1
        batch["loss_mask"][b, :n] = keep
        batch["engine_logp"][b, :n] = np.where(keep > 0, logp[1:], 0.0)
        batch["advantages"][b] = adv
        batch["row_valid"][b] = 1.0
    counts = {
        "trajectories": float(len(trajectories)),
        "clipped_trajectories": float(clipped),
        "masked_truncated": float(masked),
        "loss_tokens": float(batch["loss_mask"].sum()),
    }
    return batch, counts
