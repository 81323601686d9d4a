"""The train loop's config (`train`): steps, batch, sequence length, evaluation cadence.

Every field is documented where it is declared: meaning, unit, constraint.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps in a stage (> 0)."""
    global_batch_size: int = 16
    """Sequences (packed rows) per optimizer step, over all devices; must divide by the
    data-parallel size (mesh data * fsdp * expert) times grad_accum. A grpo stage sets it to
    prompts_per_step * group_size / mini_batches."""
    grad_accum: int = 1
    """Micro-batches per optimizer step, accumulated inside the jitted step (>= 1); the
    gradient is the same. Also a speed setting on CPU: XLA:CPU returns a step's temporaries
    to the kernel every step, which zeroes them again on the next, so micro-batches of about
    1k tokens are faster and need less memory (docs/performance.md)."""
    seq_len: int = 128
    """Tokens per row after packing/padding."""
    eval_every: int = 50
    """Held-out evaluation every N steps and at the end; 0 disables periodic evaluation."""
    eval_batches: int = 4
    """Batches of held-out loss per evaluation (0: loss evaluation off)."""
    eval_generate: int = 64
    """Held-out prompts answered greedily for exact-match accuracy per evaluation (0: off)."""
    eval_max_new_tokens: int = 64
    """Generation budget per held-out prompt, in tokens."""
    seed: int | None = None
    """Seed of the train state's RNG and of the on-policy DPO pairs' sampling; null: derived
    from the top-level `seed` (ptrain/config/seeds.py)."""
    vocab_chunk: int = 1024
    """> 0: the loss reads final hidden states and the output head and walks the vocabulary
    in chunks of this many columns, so [B, L, V] logits never exist (~a tenth of the memory
    at V = 150k). 0: it reads full [B, L, V] logits. The default also keeps the head's
    matmuls off output rows of 4096 floats, which XLA:CPU runs at about half speed."""
    nan_check: bool = True
    """Stop with an error when the loss turns NaN/inf (checked on the host one step behind)."""
