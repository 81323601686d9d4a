"""Plan a recipe at scale: memory per device, step time, generation speed and cost of each stage.

    python tools/plan.py recipe=nemotron_like scale=published --hardware h100x64 --model nemotron3-nano-30b-a3b
    python tools/plan.py recipe=sft_arithmetic --hardware h200x8 --model qwen3-8b model.remat=full mesh.fsdp=8
    python tools/plan.py recipe=sft_grpo_arithmetic --hardware v5px256 --model qwen3-32b --mfu 0.35 --price 4.2

Nothing runs: the recipe is composed as `python -m ptrain` composes it (key=value overrides
included, the recipe's `scales` entry merged in) but without the validation that needs files
or servers, so a published scale's "???" values (data paths, server URLs) may stay unset.
`--model NAME` replaces the recipe's model with a preset below, keeping the recipe's numerics
(model.dtype, param_dtype, remat); it is required when model.hf_path is "???".

Per stage the table gives:

- memory per device (GiB): parameters, gradients, optimizer state, activations, and for a
  GRPO stage the engine's KV cache, with the shares of the mesh (mesh.fsdp shards params,
  gradients and optimizer state; mesh.tensor heads, MLP hidden and vocabulary; mesh.expert
  the routed experts; mesh.context the sequence; data x fsdp x expert the batch). A stage
  over the device's memory is flagged with the knob that helps.
- step time at `--mfu` of the hardware's dense bf16 peak, from ptrain.models.flops_per_token.
- decode throughput: a decode step is bandwidth-bound, reading the weights it needs once for
  the whole batch plus every sequence's KV cache.
- weight sync: the bf16 weights over one device's scale-out link (trainer to engine).
- dollars per step and per stage at list prices (`--price` overrides).

The memory model follows what ptrain's own step keeps (the constants in `activation_bytes`
were checked against XLA's buffer assignment of the real SFT step on CPU,
tests/tools/test_plan.py):

- optimizer state: optax AdamW keeps its two moments in the parameters' dtype, and the
  parameters are the master weights (model.param_dtype float32 with model.dtype bfloat16 is
  ptrain's mixed precision), so it is 2 x the parameter bytes; with param_dtype bfloat16 the
  moments are bfloat16 too and there is no float32 copy.
- gradients: one parameter-sized buffer in param_dtype.
- activations per layer and token (compute-dtype elements): 3 x d_model (block input, norm
  output, residual), 4 x (q + k + v) width (projections, q/k norm, RoPE, head-major copies),
  3 x d_ff (gate, up, their product), a routed MoE layer 3 x top_k x (d_ff_expert + d_model)
  (dispatched copies of the tokens) plus router scores; and attention: on one device (no
  context split) ptrain's blocked attention keeps the float32 probabilities of the causal
  triangle for its hand-written backward, which holds as much again, so n_heads x seq_len x
  4 bytes per token, quadratic in the length. With mesh.context > 1 the ring attention keeps
  no scores; it builds one [query block x chunk] score block per head at a time (a transient
  of one layer; ptrain.models.context_parallel.RING_QUERY_BLOCK queries). Outside the layers: the vocabulary chunk's float32 logits (train.vocab_chunk).
- rematerialisation (model.remat): full keeps only each block's input plus one block's
  activations while it is recomputed; dots keeps the matmul outputs (q, k, v, attention
  projection, gate, up, down); attention keeps the attention output. XLA:CPU does not lower
  its peak with rematerialisation (jax.checkpoint moves the recompute but the buffers stay
  live), which is why `plan_memory(..., remat_lowers_peak=False)` exists for the CPU check;
  GPU and TPU schedulers honour it.

FLOPs: 6 x active matmul parameters + the attention term (PaLM's formula, as
ptrain.models.flops_per_token); a GRPO stage adds one forward pass of the trainer over the
samples (their log-probabilities under the trainer), a DPO stage one forward of the reference.
Prefill is left out of the generation time, and the engine is one instance over all the
stage's devices (tensor and expert parallel), which is the throughput's upper bound.

Model presets are published config.json values (Hugging Face model cards). Approximations:
- DeepSeek-V3's multi-head latent attention is not implemented in ptrain; the preset is
  grouped-query attention with 128 heads of 128 and 2 kv heads, whose KV cache (512 values a
  token a layer) is close to MLA's 576 and whose parameters are within 1% of 671B.
- Nemotron 3 Nano 30B-A3B (hybrid pattern MEMEM*EMEMEM*... of 23 Mamba-2, 23 MoE and 6
  attention layers, Megatron-Bridge's Nemotron3NanoProvider) is the MoE transformer stand-in
  ptrain can express: 23 blocks of GQA attention (32 heads, 2 kv heads, head_dim 128) and MoE
  (128 experts, top-6, 2 shared, sigmoid routing, scaling 2.5). Its experts are squared-ReLU
  (two matrices of 2688 x 1856), so d_ff_expert is 1237 = 1856 x 2/3, which keeps the expert
  parameters and FLOPs of the three-matrix SwiGLU equal. The Mamba-2 layers are not modelled:
  their ~0.9B parameters are missing, and the KV cache and attention FLOPs count 23 attention
  layers where Nano has 6 (its KV cache is overstated about 3.8x; the Mamba state is absent).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ptrain.config.model import ModelConfig  # noqa: E402

GIB = 2**30


class PlanError(ValueError):
    """Bad input to the planner: the message names the value and the valid choices."""


# ------------------------------------------------------------------------------ hardware


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float
    """HBM per device, decimal GB (as the vendors state it)."""
    hbm_tb_s: float
    """HBM bandwidth per device, TB/s."""
    bf16_tflops: float
    """Dense (no sparsity) bf16 peak per device, TFLOP/s."""
    link_gb_s: float
    """Bandwidth of the link weights travel over from trainer to engine, GB/s per device."""
    usd_per_hour: float
    """List price of one device-hour, USD (PRICE_SOURCES)."""


HARDWARE = {
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16 (1,979 with
    # sparsity); scale-out: one 400 Gb/s ConnectX-7 NDR port per GPU (DGX H100) = 50 GB/s.
    "h100": Hardware("h100", 80, 3.35, 989, 50, 3.90),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16; 400 Gb/s per GPU.
    "h200": Hardware("h200", 141, 4.8, 989, 50, 5.00),
    # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e and 64 TB/s for 8 GPUs = 180 GB and 8 TB/s per
    # GPU; HGX B200 72 PFLOP/s FP8 training for 8 GPUs (with sparsity), so 2.25 PFLOP/s dense bf16
    # per GPU; 400 Gb/s ConnectX-7 per GPU.
    "b200": Hardware("b200", 180, 8.0, 2250, 50, 7.00),
    # Google Cloud TPU v5p docs: 95 GB HBM2e, 2,765 GB/s, 459 TFLOP/s bf16; ICI 4,800 Gbps a chip
    # (600 GB/s): an engine in the same slice receives the weights over ICI.
    "v5p": Hardware("v5p", 95, 2.765, 459, 600, 4.20),
    # Google Cloud TPU v6e (Trillium) docs: 32 GB HBM, 1,640 GB/s, 918 TFLOP/s bf16; ICI 3,584
    # Gbps a chip (448 GB/s).
    "v6e": Hardware("v6e", 32, 1.64, 918, 448, 2.70),
}

PRICE_SOURCES = """\
List prices, USD per device-hour, on-demand, as of 2026; a contract or a reservation differs,
so pass --price USD_PER_DEVICE_HOUR to use yours.
  h100  AWS EC2 P5 (8 x H100) after AWS's June 2025 cut: about $3.90 a GPU-hour (the figure of
        ptrain/config/cost.py, costnimbus.com, March 2026).
  h200  AWS EC2 P5en (8 x H200): about $5.00 a GPU-hour after the same cut.
  b200  AWS EC2 P6-B200 (8 x B200): about $7.00 a GPU-hour.
  v5p   Google Cloud TPU v5p on-demand: $4.20 a chip-hour (cloud.google.com/tpu/pricing).
  v6e   Google Cloud TPU v6e on-demand: $2.70 a chip-hour (cloud.google.com/tpu/pricing)."""


def parse_hardware(text: str) -> tuple[Hardware, int]:
    """ "h100x64" -> (H100, 64); a bare name is one device."""
    name, _, count = text.lower().partition("x")
    if name not in HARDWARE or (count and not count.isdigit()) or (count and int(count) < 1):
        raise PlanError(
            f"--hardware {text!r}: pass NAMExCOUNT with NAME one of {', '.join(HARDWARE)} (e.g. h100x64, v5px256)"
        )
    return HARDWARE[name], int(count or 1)


# ------------------------------------------------------------------------- model presets


def _qwen3(d: int, layers: int, heads: int, kv: int, ff: int, tie: bool, **moe: Any) -> ModelConfig:
    return ModelConfig(family="qwen3_moe" if moe else "qwen3", vocab_size=151936, d_model=d, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv, head_dim=128, d_ff=ff, max_seq_len=40960, rope_theta=1e6,
                       qk_norm=True, tie_embeddings=tie, **moe)  # fmt: skip


MODELS: dict[str, ModelConfig] = {
    # Qwen/Qwen3-*: config.json (hidden_size, num_hidden_layers, num_attention_heads,
    # num_key_value_heads, head_dim 128, intermediate_size, vocab 151936, tie_word_embeddings).
    "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 8, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 8, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288, False),
    "qwen3-14b": _qwen3(5120, 40, 40, 8, 17408, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 8, 25600, False),
    # Qwen3-MoE: moe_intermediate_size, num_experts, num_experts_per_tok, norm_topk_prob.
    "qwen3-30b-a3b": _qwen3(2048, 48, 32, 4, 6144, False, n_experts=128, top_k=8, d_ff_expert=768),
    "qwen3-235b-a22b": _qwen3(4096, 94, 64, 4, 12288, False, n_experts=128, top_k=8, d_ff_expert=1536),
    # Module docstring: the attention + MoE stand-in for the hybrid Mamba model.
    "nemotron3-nano-30b-a3b": ModelConfig(
        family="deepseek_v3",
        vocab_size=131072,
        d_model=2688,
        n_layers=23,
        n_heads=32,
        n_kv_heads=2,
        head_dim=128,
        d_ff=1237,
        max_seq_len=262144,
        qk_norm=False,
        tie_embeddings=False,
        n_experts=128,
        top_k=6,
        d_ff_expert=1237,
        n_shared_experts=2,
        router="sigmoid",
        routed_scaling_factor=2.5,
    ),  # fmt: skip
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers (first 3 dense, intermediate
    # 18432), 256 routed experts of 2048, top-8, 1 shared, 8 groups / top-4, vocab 129280; the
    # attention is the GQA stand-in of the module docstring.
    "deepseek-v3": ModelConfig(
        family="deepseek_v3",
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=2,
        head_dim=128,
        d_ff=18432,
        max_seq_len=163840,
        qk_norm=False,
        tie_embeddings=False,
        n_experts=256,
        top_k=8,
        d_ff_expert=2048,
        n_shared_experts=1,
        router="sigmoid",
        routed_scaling_factor=2.5,
        n_groups=8,
        topk_groups=4,
        first_k_dense=3,
    ),  # fmt: skip
}


def preset(name: str) -> ModelConfig:
    key = name.lower()
    if key not in MODELS:
        raise PlanError(f"--model {name!r}: no such preset; pass one of {', '.join(MODELS)}")
    return MODELS[key]


# ----------------------------------------------------------------------------- composing


@dataclass
class StagePlanInput:
    """What the planner reads of one stage's config."""

    name: str
    kind: str
    model: ModelConfig
    train: Any
    mesh: Any
    algo: Any
    rollout: Any
    eval_rows: int


def compose_stages(recipe: str, overrides: list[str], model_preset: str | None) -> tuple[str, list[StagePlanInput]]:
    """The recipe's stages with their own train/optim/algo overrides merged in, as
    ptrain.config.run.stage_config merges them, without the checks that need files."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    from ptrain.config import RunConfig, register_configs
    from ptrain.config.algo import AlgoConfig
    from ptrain.config.mesh import MeshConfig
    from ptrain.config.recipes import available_recipes
    from ptrain.config.rollout import RolloutConfig
    from ptrain.config.run import apply_scale
    from ptrain.config.train import TrainConfig

    if recipe not in available_recipes():
        raise PlanError(f"recipe={recipe!r}: no such recipe; pass one of {', '.join(available_recipes())}")
    register_configs()
    try:
        with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=[f"recipe={recipe}", *overrides])
        merged = apply_scale(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg), overrides)
    except Exception as e:  # Hydra's, OmegaConf's and ptrain's ConfigError name the key
        raise PlanError(f"composing recipe={recipe}: {str(e).splitlines()[0]}") from None

    model_node = merged.model
    if model_preset is not None:
        chosen = dataclasses.replace(
            preset(model_preset), dtype=model_node.dtype, param_dtype=model_node.param_dtype, remat=model_node.remat,
            context_attention=model_node.context_attention,
        )  # fmt: skip
        # key=value overrides of model.* still win over the preset
        for o in overrides:
            key, _, value = o.partition("=")
            if key.startswith("model.") and key.count(".") == 1 and key[6:] != "hf_path":
                field_type = type(getattr(chosen, key[6:]))
                chosen = dataclasses.replace(chosen, **{key[6:]: field_type(OmegaConf.create({"v": value}).v)})
        model = chosen
    else:
        if OmegaConf.is_missing(model_node, "hf_path"):
            raise PlanError(f"recipe={recipe}: model.hf_path is ??? at this scale; pass --model, one of "
                            f"{', '.join(MODELS)}")  # fmt: skip
        with_path = OmegaConf.to_object(model_node)
        model = dataclasses.replace(with_path, lora=with_path.lora)
    stages = []
    for stage in merged.stages:
        parts = {}
        for key, schema in (("train", TrainConfig), ("algo", AlgoConfig)):
            node = OmegaConf.merge(OmegaConf.structured(schema), merged[key], stage.get(key) or {})
            parts[key] = _object_without_missing(node)
        n_eval = sum(int(env.get("n_eval", 0) or 0) for env in merged.envs.values()) if merged.envs else 0
        stages.append(
            StagePlanInput(
                name=stage.name, kind=stage.kind, model=model, train=parts["train"], algo=parts["algo"],
                mesh=OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MeshConfig), merged.mesh)),
                rollout=_object_without_missing(OmegaConf.merge(OmegaConf.structured(RolloutConfig), merged.rollout)),
                eval_rows=n_eval,
            )
        )  # fmt: skip
    return str(merged.name), stages


def _object_without_missing(node):
    from omegaconf import OmegaConf

    for key in OmegaConf.missing_keys(node):
        OmegaConf.update(node, key, None, force_add=True)
    return OmegaConf.to_object(node)


# ---------------------------------------------------------------------------- the model

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shards:
    """Mesh axis sizes one device's share is divided by."""

    data: int = 1
    fsdp: int = 1
    context: int = 1
    tensor: int = 1
    expert: int = 1

    @property
    def batch(self) -> int:
        """Devices the rows are split over (ptrain.parallel.BATCH_AXES)."""
        return self.data * self.fsdp * self.expert


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(routed-expert parameters, every other parameter)."""
    from ptrain.models.decoder import count_params, moe_layer_flags

    routed = sum(moe_layer_flags(cfg)) * 3 * cfg.d_model * cfg.d_ff_expert * cfg.n_experts if cfg.is_moe else 0
    return routed, count_params(cfg) - routed


def activation_bytes(cfg: ModelConfig, tokens: int, seq_len: int, shards: Shards, vocab_chunk: int,
                     remat_lowers_peak: bool = True) -> float:  # fmt: skip
    """Activation memory of one micro-batch of `tokens` (this device's rows x the full length)
    at its peak, the start of the backward pass; module docstring for the terms."""
    from ptrain.models.decoder import moe_layer_flags

    a = DTYPE_BYTES[cfg.dtype]
    D, H, K, Dh, t = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, shards.tensor
    T = tokens / shards.context  # this device's tokens
    L_local = seq_len / shards.context
    qkv = (H + 2 * K) * Dh / t

    def layer(moe: bool) -> tuple[float, float]:
        """(bytes a layer keeps without remat, bytes with the configured remat) for T tokens."""
        mlp = 3 * cfg.d_ff / t
        if moe:
            mlp = 3 * (cfg.top_k * (cfg.d_ff_expert / t + D) + cfg.n_shared_experts * cfg.d_ff_expert / t)
        per_token = a * (3 * D + 4 * qkv + mlp) + (4 * cfg.n_experts if moe else 0)
        scores = 4 * H / t * seq_len if shards.context == 1 else 0.0  # blocked attention keeps them
        full = T * (per_token + scores)
        kept = {
            "none": full,
            "full": T * a * D,
            "dots": T * a * (2 * D + qkv + (cfg.top_k * (2 * cfg.d_ff_expert / t + D) if moe else 2 * cfg.d_ff / t)),
            "attention": T * a * (D + H * Dh / t),
        }[cfg.remat if remat_lowers_peak else "none"]
        return full, kept

    flags = moe_layer_flags(cfg)
    layers = [layer(bool(m)) for m in flags]
    saved = sum(k for _, k in layers)
    # rematerialised: one block's full activations live again while its backward runs
    recompute = max(f for f, _ in layers) if cfg.remat != "none" and remat_lowers_peak else 0.0
    # ring attention: one score block (a block of this chunk's queries x one chunk's keys) per head
    from ptrain.models.context_parallel import RING_QUERY_BLOCK

    rows = min(L_local, RING_QUERY_BLOCK)
    ring = (tokens / seq_len) * (H / t) * rows * L_local * 4 if shards.context > 1 else 0.0
    chunk = min(cfg.vocab_size, vocab_chunk or cfg.vocab_size)
    outside = T * 4 * chunk / t
    return saved + recompute + ring + outside


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    reference: float = 0.0
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.reference + self.kv_cache


def plan_memory(cfg: ModelConfig, *, rows: int, seq_len: int, shards: Shards, vocab_chunk: int = 1024,
                trains: bool = True, reference: bool = False, kv_tokens: int = 0,
                remat_lowers_peak: bool = True) -> Memory:  # fmt: skip
    """Bytes per device of one train step over `rows` sequences of `seq_len` on this device
    (the per-device micro-batch), plus a KV cache of `kv_tokens` tokens over all devices."""
    routed, other = param_counts(cfg)
    p = DTYPE_BYTES[cfg.param_dtype]
    per_device = (other / (shards.fsdp * shards.tensor) + routed / (shards.fsdp * shards.tensor * shards.expert)) * p
    n_devices = shards.data * shards.fsdp * shards.context * shards.tensor * shards.expert
    kv = kv_tokens * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES[cfg.dtype] / n_devices
    if not trains:
        return Memory(per_device, 0.0, 0.0, 0.0, kv_cache=kv)
    acts = activation_bytes(cfg, rows * seq_len, seq_len, shards, vocab_chunk, remat_lowers_peak)
    return Memory(per_device, per_device, 2 * per_device, acts, per_device if reference else 0.0, kv)


def training_flops(cfg: ModelConfig, seq_len: int, tokens: int, kind: str) -> float:
    """Training FLOPs of one step over `tokens` tokens of sequences of `seq_len`."""
    from ptrain.models.decoder import flops_per_token

    per_token = flops_per_token(cfg, seq_len)
    extra_forward = 1 / 3 if kind in ("grpo", "dpo") else 0.0  # samples' logprobs / the reference
    return per_token * tokens * (1 + extra_forward)


def decode_step_seconds(cfg: ModelConfig, batch: int, context_tokens: float, hw: Hardware, devices: int) -> float:
    """One decode step of `batch` sequences holding `context_tokens` tokens each on average:
    the weights it touches (every routed expert some token picked) plus the KV cache, read
    once from HBM, spread over the devices."""
    routed, other = param_counts(cfg)
    if cfg.is_moe:
        touched = 1 - (1 - cfg.top_k / cfg.n_experts) ** batch  # fraction of experts some token picks
        routed *= touched
    weight_bytes = (routed + other) * 2  # the engine serves bf16 weights
    kv_bytes = batch * context_tokens * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
    return (weight_bytes + kv_bytes) / (devices * hw.hbm_tb_s * 1e12)


# ------------------------------------------------------------------------------ planning


@dataclass
class StagePlan:
    name: str
    kind: str
    steps: int
    rows_per_device: float
    seq_len: int
    memory: Memory
    step_s: float
    decode_tok_s: float
    gen_s: float
    sync_s: float
    usd_step: float
    usd_stage: float
    flags: list[str]


def mesh_shards(mesh, devices: int) -> tuple[Shards, list[str]]:
    fixed = mesh.fsdp * mesh.context * mesh.tensor * mesh.expert
    notes = []
    if mesh.data != -1 and mesh.data * fixed != devices or devices % fixed:
        notes.append(
            f"mesh data={mesh.data} fsdp={mesh.fsdp} context={mesh.context} tensor={mesh.tensor} expert={mesh.expert} "
            f"needs a multiple of {fixed} devices, not {devices}: planned as one replica of {fixed} devices; pass "
            f"mesh.* overrides (e.g. mesh.expert=...) or --hardware NAMEx{fixed * max(1, devices // fixed)}"
        )
        data = 1
    else:
        data = mesh.data if mesh.data != -1 else devices // fixed
    return Shards(data, mesh.fsdp, mesh.context, mesh.tensor, mesh.expert), notes


def plan_stage(s: StagePlanInput, hw: Hardware, devices: int, mfu: float, price: float) -> StagePlan:
    shards, flags = mesh_shards(s.mesh, devices)
    n = shards.data * shards.fsdp * shards.context * shards.tensor * shards.expert
    cfg, train = s.model, s.train
    L = train.seq_len
    grpo = s.algo.grpo
    steps, trains = train.steps, s.kind in ("sft", "grpo", "dpo", "rm")
    sequences = train.global_batch_size
    kv_tokens, decode_batch, new_tokens = 0, 0, 0
    if s.kind == "grpo":
        decode_batch = grpo.prompts_per_step * grpo.group_size
        new_tokens = grpo.max_new_tokens
        sequences = decode_batch
        if s.rollout.kind == "local":  # the engine shares the trainer's devices
            kv_tokens = decode_batch * L
    elif s.kind == "dpo":
        sequences = 2 * train.global_batch_size  # chosen and rejected
    elif s.kind == "eval":
        samples = max(s.algo.eval.samples, 1)
        decode_batch = s.rollout.max_running_requests
        new_tokens = s.algo.eval.max_new_tokens
        kv_tokens = decode_batch * L
        steps = math.ceil(s.eval_rows * samples / decode_batch) if s.eval_rows else 1
    rows = sequences / max(train.grad_accum, 1) / shards.batch
    reference = (s.kind == "dpo") or (s.kind == "grpo" and grpo.kl_coef > 0)
    mem = plan_memory(cfg, rows=rows, seq_len=L, shards=shards, vocab_chunk=train.vocab_chunk, trains=trains,
                      reference=reference, kv_tokens=kv_tokens)  # fmt: skip
    step_s = training_flops(cfg, L, sequences * L, s.kind) / (n * hw.bf16_tflops * 1e12 * mfu) if trains else 0.0
    decode_tok_s = gen_s = 0.0
    if decode_batch:
        prompt = max(L - new_tokens, 0)
        dt = decode_step_seconds(cfg, decode_batch, prompt + new_tokens / 2, hw, n)
        decode_tok_s, gen_s = decode_batch / dt, new_tokens * dt
    routed, other = param_counts(cfg)
    sync_s = (routed + other) * 2 / (hw.link_gb_s * 1e9) if s.kind == "grpo" else 0.0
    wall = step_s + gen_s + sync_s
    usd_step = wall / 3600 * price * n
    cap = hw.memory_gb * 1e9
    if mem.total > cap:
        flags.append(f"{s.name}: {mem.total / GIB:.1f} GiB per device is {(mem.total - cap) / GIB:.1f} GiB over the "
                     f"{hw.memory_gb:g} GB of a {hw.name}; {knob_hint(s, mem, shards)}")  # fmt: skip
    return StagePlan(s.name, s.kind, steps, rows, L, mem, step_s, decode_tok_s, gen_s, sync_s, usd_step,
                     usd_step * steps, flags)  # fmt: skip


def knob_hint(s: StagePlanInput, mem: Memory, shards: Shards) -> str:
    state = mem.params + mem.grads + mem.optimizer + mem.reference
    hints = []
    if mem.activations > state:
        if s.model.remat in ("none", "dots"):
            hints.append("model.remat=full (or attention)")
        hints.append(f"a larger mesh.context (now {shards.context}) splits the sequence")
        hints.append(f"train.grad_accum (now {s.train.grad_accum}) shrinks the micro-batch")
    else:
        hints.append(f"a larger mesh.fsdp (now {shards.fsdp}) shards params, gradients and optimizer state")
        if s.model.is_moe:
            hints.append(f"mesh.expert (now {shards.expert}) splits the experts")
    if mem.kv_cache > 0.2 * mem.total:
        hints.append("a smaller rollout batch or a separate engine (rollout.kind=sglang) for the KV cache")
    return "try " + "; ".join(hints)


def format_table(name: str, hw: Hardware, devices: int, model: ModelConfig, plans: list[StagePlan], mfu: float,
                 price: float) -> str:  # fmt: skip
    routed, other = param_counts(model)
    from ptrain.models.decoder import count_params

    active = count_params(model, active=True)
    lines = [
        f"{name} on {devices} x {hw.name} ({hw.memory_gb:g} GB, {hw.hbm_tb_s:g} TB/s, {hw.bf16_tflops:g} TFLOP/s bf16),"
        f" MFU {mfu:g}, ${price:.2f} per device-hour (list price; --price overrides)",
        f"model: {(routed + other) / 1e9:.2f}B parameters, {active / 1e9:.2f}B active; dtype {model.dtype}, "
        f"param_dtype {model.param_dtype}, remat {model.remat}",
        "",
        f"{'stage':<8} {'kind':<5} {'rows/dev':>8} {'seq':>7} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>8} "
        f"{'ref':>6} {'kv':>7} {'total':>8} {'step s':>8} {'dec tok/s':>10} {'gen s':>8} {'sync s':>7} "
        f"{'$/step':>9} {'$/stage':>10}",
    ]
    for p in plans:
        m = p.memory
        g = lambda x: f"{x / GIB:.1f}"  # noqa: E731
        lines.append(
            f"{p.name:<8} {p.kind:<5} {p.rows_per_device:>8.3g} {p.seq_len:>7} {g(m.params):>7} {g(m.grads):>7} "
            f"{g(m.optimizer):>7} {g(m.activations):>8} {g(m.reference):>6} {g(m.kv_cache):>7} {g(m.total):>8} "
            f"{p.step_s:>8.2f} {p.decode_tok_s:>10.3g} {p.gen_s:>8.1f} {p.sync_s:>7.2f} {p.usd_step:>9.2f} "
            f"{p.usd_stage:>10.0f}"
        )
    lines.append("memory in GiB per device; step s at the MFU; gen s = one rollout batch's decode (no prefill)")
    flags = [f for p in plans for f in p.flags]
    for f in dict.fromkeys(flags):
        lines.append(f"FLAG {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=PRICE_SOURCES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="recipe=NAME, scale=NAME and key=value overrides, as python -m ptrain")
    ap.add_argument("--hardware", required=True, help=f"NAMExCOUNT, NAME one of {', '.join(HARDWARE)}")
    ap.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation of the step time (default 0.4)")
    ap.add_argument("--price", type=float, help="USD per device-hour instead of the list price")
    args = ap.parse_intermixed_args(argv)
    try:
        hw, devices = parse_hardware(args.hardware)
        if args.model is not None:
            preset(args.model)
        recipes = [o.split("=", 1)[1] for o in args.overrides if o.startswith("recipe=")]
        if len(recipes) != 1:
            raise PlanError("pass the recipe as recipe=NAME")
        if not 0 < args.mfu <= 1:
            raise PlanError(f"--mfu {args.mfu}: pass a fraction in (0, 1]")
        rest = [o for o in args.overrides if not o.startswith("recipe=")]
        name, stages = compose_stages(recipes[0], rest, args.model)
        price = hw.usd_per_hour if args.price is None else args.price
        plans = [plan_stage(s, hw, devices, args.mfu, price) for s in stages]
    except PlanError as e:
        print(f"plan.py: {e}", file=sys.stderr)
        return 2
    print(format_table(name, hw, devices, stages[0].model, plans, args.mfu, price))
    return 0


if __name__ == "__main__":
    sys.exit(main())
