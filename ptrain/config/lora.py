"""LoRA adapters (`model.lora`): which weights get a low-rank update, its rank and scale.

With `rank > 0` a stage trains only the adapters (Hu et al. 2021): each targeted weight W
becomes W + (alpha / rank) * A @ B, with A random and B zero, so the model at step 0 is the
base model exactly. The optimizer state, the gradients and the checkpoints hold the adapters
alone; the base stays frozen (in `base_dtype`) and is the reference model of DPO and of a
KL term, so no second copy of the weights exists.

Targets use the Hugging Face module names PEFT uses, so an adapter's `target_modules` reads
the same on both sides. Jax-free (tests/test_layering.py): the arithmetic lives in
ptrain/models/lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts", "lm_head")
"""Weights an adapter can target. gate_proj, up_proj and down_proj cover dense MLPs and an
MoE's shared experts; `experts` covers the routed experts (one adapter per expert)."""

TARGET_GROUPS = {
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
"""Shorthands: `all-linear` is PEFT's (every linear layer but the output head)."""

BASE_DTYPES = ("float32", "bfloat16", "int8")


@dataclass
class LoRAConfig:
    rank: int = 0
    """Adapter rank r (>= 0); 0 turns LoRA off and the stage trains every weight."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) * A @ B (alpha / sqrt(rank) with rslora)."""
    dropout: float = 0.0
    """Dropout on an adapter's input during training, in [0, 1). Applies to the attention and
    MLP projections; the routed experts and the output head add their update to the weight
    (one merged matmul per expert), which has no separate input to drop."""
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    """Weights that get adapters: names from LORA_TARGETS or the shorthands of TARGET_GROUPS."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank) (Kalajdzievski 2023; PEFT's use_rslora)."""
    base_dtype: str = "float32"
    """Storage of the frozen base weights: float32 | bfloat16 (half the memory) | int8 (the
    adapted weights as int8 with a float32 scale per output channel, a quarter of their
    memory, QLoRA's idea; the other weights bfloat16). The adapters and their optimizer state
    stay float32."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def target_names(self) -> tuple[str, ...]:
        """The targets with shorthands expanded, in LORA_TARGETS order."""
        names = set()
        for t in self.targets:
            names.update(TARGET_GROUPS.get(t, (t,)))
        return tuple(t for t in LORA_TARGETS if t in names)

    def lora_problems(self, *, tie_embeddings: bool, is_moe: bool) -> list[tuple[str, str]]:
        """Every impossible value, as (field, what is wrong and what to pass); reported under
        `model.lora.<field>`."""
        out: list[tuple[str, str]] = []
        if self.rank < 0:
            out.append(("rank", f"must be >= 0 (0: LoRA off), got {self.rank}"))
        if not self.enabled:
            return out
        if not self.alpha > 0:
            out.append(("alpha", f"must be > 0, got {self.alpha}"))
        if not 0 <= self.dropout < 1:
            out.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        known = set(LORA_TARGETS) | set(TARGET_GROUPS)
        unknown = [t for t in self.targets if t not in known]
        if unknown:
            out.append(("targets", f"{unknown} are not targets; pass names from {', '.join(LORA_TARGETS)} or "
                                   f"{', '.join(TARGET_GROUPS)}"))  # fmt: skip
        elif not self.targets:
            out.append(("targets", "is empty; pass at least one target, e.g. [all-linear]"))
        names = self.target_names()
        if "lm_head" in names and tie_embeddings:
            out.append(("targets", "lm_head is the input embedding here (model.tie_embeddings=true), which an "
                                   "adapter does not cover; drop lm_head from the targets"))  # fmt: skip
        if "experts" in names and not is_moe:
            out.append(("targets", "'experts' names the routed experts, and this model is dense; drop it"))
        if self.base_dtype not in BASE_DTYPES:
            out.append(("base_dtype", f"pass {' | '.join(BASE_DTYPES)}, got '{self.base_dtype}'"))
        return out
