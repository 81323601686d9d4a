"""Model config: one decoder description that covers the dense and MoE families.

The same dataclass is the Hydra `model` group schema and the argument of
`ptrain.models.Decoder`. Field names follow the architecture, not a family; the
Hugging Face importer maps each family's config.json onto them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ptrain.config.lora import LoRAConfig


@dataclass
class ModelConfig:
    # --- where the weights come from ---
    hf_path: str | None = None
    """Local Hugging Face folder to load (config.json + safetensors). None: build the
    embedded tiny model from the fields below and save it into the run directory."""
    family: str = "qwen3"
    """Architecture family written to config.json on export: llama | qwen2 | qwen3 |
    mistral | qwen3_moe | mixtral | dots1. deepseek_v3 is accepted as an alias of dots1
    (DeepSeek-V3 routing on grouped-query attention; multi-head latent attention is not
    implemented). Overwritten by the importer."""

    # --- shape ---
    vocab_size: int = 0
    """Vocabulary size. 0: take it from the tokenizer (embedded default)."""
    d_model: int = 256
    """Hidden size (HF `hidden_size`)."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    head_dim: int = 64
    """Per-head dimension (Qwen3 decouples it from d_model / n_heads)."""
    d_ff: int = 768
    """SwiGLU hidden size of the dense MLP (HF `intermediate_size`)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables and KV cache are built for, in tokens."""

    # --- block options ---
    rms_norm_eps: float = 1e-6
    """Epsilon inside RMSNorm."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """HF-style rope scaling dict, e.g. {rope_type: llama3, factor: 8, low_freq_factor: 1,
    high_freq_factor: 4, original_max_position_embeddings: 8192}. None: plain RoPE."""
    qk_norm: bool = True
    """RMSNorm on each query/key head before RoPE (Qwen3)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2/2.5)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head."""
    sliding_window: int | None = None
    """Mistral-style sliding attention window in tokens; None: full causal attention."""

    # --- Mixture of Experts (n_experts == 0 means dense) ---
    n_experts: int = 0
    """Routed experts per MoE layer; 0 makes every layer dense."""
    top_k: int = 2
    """Experts each token is sent to."""
    d_ff_expert: int = 256
    """SwiGLU hidden size of one routed expert (HF `moe_intermediate_size`)."""
    n_shared_experts: int = 0
    """Always-on shared experts (DeepSeek); their hidden size is n_shared * d_ff_expert."""
    router: str = "softmax"
    """softmax (Qwen3-MoE, Mixtral) | sigmoid (DeepSeek-V3: sigmoid scores, aux-loss-free bias)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k weights to sum to one."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' output (DeepSeek-V3: 2.5)."""
    n_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3: 8)."""
    topk_groups: int = 1
    """Groups each token may draw experts from."""
    first_k_dense: int = 0
    """The first k layers use a dense MLP (DeepSeek-V3: 3)."""
    dense_layers: list[int] = field(default_factory=list)
    """Indices (0-based) of further layers with a dense MLP (Qwen3-MoE `mlp_only_layers`)."""
    moe_layer_step: int = 1
    """MoE only on layers i with (i + 1) % moe_layer_step == 0, the others dense (Qwen3-MoE
    `decoder_sparse_step`); >= 1. A layer is MoE when it passes all three: i >= first_k_dense,
    i not in dense_layers, and this step."""
    router_aux_loss_coef: float = 0.0
    """Weight of the Switch-style load-balancing loss added to the training loss."""
    router_bias_update_rate: float = 0.0
    """Aux-loss-free bias step per train step: bias += rate * sign(mean_load - load)."""
    moe_implementation: str = "auto"
    """ptrain.kernels.moe implementation: auto | xla | pallas_tpu | pallas_gpu | *_interpret."""

    # --- numerics and memory ---
    dtype: str = "float32"
    """Compute dtype of activations and matmuls: float32 | bfloat16. Params stay float32."""
    param_dtype: str = "float32"
    """Master weight dtype."""
    remat: str = "none"
    """Activation rematerialisation per block: none | full | dots (save matmul outputs) |
    attention (save only the attention outputs: the backward pass recomputes the cheap
    per-token layers, not the attention)."""
    context_attention: str = "ring"
    """Attention when mesh.context > 1 splits the sequence: ring (keys and values passed
    round the devices) | all_to_all (Ulysses: sequence split exchanged for a heads split;
    the kv heads must divide over the axis). See ptrain.models.context_parallel."""
    scan_layers: bool = False
    """Scan over stacked layers (faster compile for deep models)."""
    init_std: float = 0.02
    """Std of the normal initialiser for the embedded (from-scratch) model."""
    seed: int | None = None
    """Seed of the embedded model's initial weights; null: derived from the top-level `seed`
    (ptrain/config/seeds.py)."""

    # --- adapters ---
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Train low-rank adapters on a frozen base instead of every weight (ptrain/config/lora.py)."""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0
