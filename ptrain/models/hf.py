"""Hugging Face interop: config.json <-> ModelConfig, safetensors <-> Decoder state.

    model = load_hf("/path/to/hf_folder", dtype="bfloat16", mesh=mesh)   # sharded placement
    save_hf(model, "/path/to/out", tokenizer=tok)                        # transformers/SGLang layout

Families (HF `model_type`): llama, mistral, qwen2, qwen3 (dense); qwen3_moe, mixtral, and
dots1 — DeepSeek-V3 routing (sigmoid scores, aux-loss-free bias, group-limited top-k,
shared experts, routed scaling, first k layers dense) on grouped-query attention. The
`deepseek_v3` type itself needs multi-head latent attention, which this decoder does not
implement; loading one fails with that reason.

Qwen3-MoE checkpoints may mix dense and MoE layers (`mlp_only_layers`,
`decoder_sparse_step`; ModelConfig `dense_layers`, `moe_layer_step`), both read and
written. transformers builds such layers; SGLang's Qwen3-MoE model (0.5.x) makes every
layer MoE, so a mixed checkpoint serves through transformers, not SGLang.

Tensor layout: HF linear weights are [out, in]; ours are [in, ...out] with heads split
out ([D, H, Dh] for q/k/v, [H, Dh, D] for o), and routed experts stacked [E, D, F]. Each
tensor maps by a transpose and a reshape, listed once in `tensor_map`.

Reward models (`RewardModel`: a decoder with a scalar score head) are written as the
family's *ForSequenceClassification with num_labels 1 (`save_hf_reward_model`): the
decoder's tensors under `model.` without `lm_head.weight`, plus `score.weight` [1, D], and
config.json's pad_token_id, by which transformers picks the scored token;
`load_hf_reward_model` reads one back (also for dots1, whose classifier transformers lacks:
PTRAIN_ONLY_CLASSIFIERS). load_hf refuses such a folder by name rather than
reporting a missing LM head.

Safety: only safetensors are read (memory-mapped, tensor by tensor); pickled weights are
refused; config.json is parsed as JSON and `auto_map` / remote code is never executed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models.decoder import Decoder, RewardModel, layer_groups, moe_layer_flags
from ptrain.models.layers import as_dtype
from ptrain.models.safetensors_io import FLOAT_CODES, open_folder, write_sharded

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "dots1": "Dots1ForCausalLM",
}
FAMILY_ALIASES = {"deepseek_v3": "dots1"}
"""ModelConfig.family values that are written under another HF model_type (see module doc)."""

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

# Tensors in HF folders that carry no weights we need (RoPE tables some exporters keep).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_family(cfg: ModelConfig) -> str:
    """The HF model_type this config is written as."""
    fam = FAMILY_ALIASES.get(cfg.family, cfg.family)
    if fam not in ARCHITECTURES:
        raise ValueError(f"model.family={cfg.family!r} is not supported; pass one of {sorted(ARCHITECTURES)}")
    return fam


# --------------------------------------------------------------------------- config


def _rope_scaling_to_hf(scaling: dict | None) -> dict | None:
    """The scaling dict with its kind under `rope_type` (older configs wrote `type`; written as
    `type` beside the default `rope_type`, a reader would see no scaling at all)."""
    if not scaling:
        return None
    out = dict(scaling)
    if "type" in out:
        out.setdefault("rope_type", out.pop("type"))
    return out


def _rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either transformers-5 `rope_parameters` or the
    older `rope_theta` + `rope_scaling` keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    scaling.pop("type", None)
    return theta, scaling


def config_from_hf(hf: dict, **overrides: Any) -> ModelConfig:
    """Maps a HF config.json dict onto a ModelConfig; `overrides` set ModelConfig fields
    (dtype, remat, scan_layers, ...). Unsupported architectures or options raise ValueError
    naming the key."""
    mt = hf.get("model_type")
    if mt == "deepseek_v3":
        raise ValueError(
            "model_type 'deepseek_v3' uses multi-head latent attention, which ptrain's decoder does not "
            "implement; DeepSeek-V3 routing is available with grouped-query attention as model_type 'dots1'"
        )
    if mt not in ARCHITECTURES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (SwiGLU with silu only)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if mt in ("llama", "qwen3", "qwen3_moe", "dots1") and hf.get("attention_bias"):
        raise ValueError(f"attention_bias=true on {mt} also biases o_proj, which is not supported")
    layer_types = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ValueError("per-layer sliding-window attention (use_sliding_window / layer_types) is not supported")
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    absent = [k for k in required if hf.get(k) is None]
    if absent:
        raise ValueError(
            f"config.json of model_type {mt!r} lacks {', '.join(absent)}; it is incomplete or not a "
            "decoder's config: copy or convert the model folder again"
        )
    D, H = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    theta, scaling = _rope_from_hf(hf)
    c: dict[str, Any] = dict(
        family=mt,
        vocab_size=int(hf["vocab_size"]),
        d_model=D,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=H,
        n_kv_heads=int(hf.get("num_key_value_heads") or H),
        head_dim=int(hf.get("head_dim") or D // H),
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=mt in ("qwen3", "qwen3_moe", "dots1"),
        qkv_bias=mt == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=int(hf["sliding_window"]) if mt == "mistral" and hf.get("sliding_window") else None,
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    if mt == "qwen3_moe":
        step = hf.get("decoder_sparse_step")
        step = 1 if step is None else step
        only = hf.get("mlp_only_layers") or []
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"config.json: decoder_sparse_step={step!r} must be an integer >= 1")
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ValueError(f"config.json: mlp_only_layers={only!r} must be a list of layer indices")
        c.update(
            dense_layers=sorted(set(only)),
            moe_layer_step=step,
            n_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            d_ff_expert=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router="softmax",
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
    elif mt == "mixtral":
        c.update(
            n_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            d_ff_expert=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            router="softmax",
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
    elif mt == "dots1":
        c.update(
            n_experts=int(hf["n_routed_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            d_ff_expert=int(hf["moe_intermediate_size"]),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            n_groups=int(hf.get("n_group") or 1),
            topk_groups=int(hf.get("topk_group") or 1),
            first_k_dense=int(hf.get("first_k_dense_replace") or 0),
            router="sigmoid",
        )
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown ModelConfig fields in overrides: {sorted(unknown)}")
    c.update(overrides)
    return ModelConfig(**c)


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> HF config.json dict for its family (transformers 4.x and 5.x keys)."""
    fam = hf_family(cfg)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[fam]],
        "model_type": fam,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff_expert if fam == "mixtral" else cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling_to_hf(cfg.rope_scaling),
        "rope_parameters": {
            "rope_theta": cfg.rope_theta,
            "rope_type": "default",
            **(_rope_scaling_to_hf(cfg.rope_scaling) or {}),
        },
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    want_qk_norm = fam in ("qwen3", "qwen3_moe", "dots1")
    if cfg.qk_norm != want_qk_norm:
        raise ValueError(f"model.qk_norm={cfg.qk_norm} cannot be written as {fam} (which has qk_norm={want_qk_norm})")
    if cfg.qkv_bias != (fam == "qwen2"):
        raise ValueError(f"model.qkv_bias={cfg.qkv_bias} cannot be written as {fam}; only qwen2 has q/k/v bias")
    if cfg.sliding_window is not None and fam != "mistral":
        raise ValueError(f"model.sliding_window is only written for mistral, not {fam}")
    if fam == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    if fam in ("qwen2", "qwen3", "qwen3_moe"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if fam in ("llama", "qwen3", "qwen3_moe", "dots1"):
        hf.update(attention_bias=False)
    if fam in ("llama",):
        hf.update(mlp_bias=False)
    moe = fam in ("qwen3_moe", "mixtral", "dots1")
    if moe != cfg.is_moe:
        raise ValueError(f"family {fam} {'needs' if moe else 'cannot have'} experts (model.n_experts={cfg.n_experts})")
    flags = moe_layer_flags(cfg)
    n_leading_dense = flags.index(True) if any(flags) else cfg.n_layers
    leading_dense_only = all(flags[n_leading_dense:])
    if fam == "qwen3_moe":
        if cfg.router != "softmax" or cfg.n_shared_experts or cfg.n_groups != 1:
            raise ValueError("qwen3_moe takes softmax routing without shared experts or groups")
        # first_k_dense has no qwen3_moe key: those layers join mlp_only_layers (same layers,
        # same tensors; a re-import names them model.dense_layers).
        hf.update(
            num_experts=cfg.n_experts,
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.d_ff_expert,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.moe_layer_step,
            mlp_only_layers=sorted(set(cfg.dense_layers) | set(range(cfg.first_k_dense))),
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    elif fam == "mixtral":
        if cfg.router != "softmax" or not cfg.norm_topk_prob or cfg.n_shared_experts or not all(flags):
            raise ValueError(
                "mixtral takes softmax routing with norm_topk_prob and no shared experts or dense layers "
                "(model.first_k_dense, dense_layers, moe_layer_step); write a model with dense layers as qwen3_moe"
            )
        hf.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            router_jitter_noise=0.0,
        )
    elif fam == "dots1":
        if cfg.router != "sigmoid":
            raise ValueError("dots1 / deepseek_v3 routing is sigmoid; set model.router=sigmoid")
        if not leading_dense_only:
            raise ValueError(
                f"dots1 / deepseek_v3 can only make the first layers dense (first_k_dense_replace), but "
                f"model.dense_layers={list(cfg.dense_layers)} / moe_layer_step={cfg.moe_layer_step} put dense "
                "layers after MoE ones; use model.first_k_dense instead"
            )
        hf.update(
            n_routed_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.d_ff_expert,
            n_shared_experts=cfg.n_shared_experts,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.n_groups,
            topk_group=cfg.topk_groups,
            first_k_dense_replace=n_leading_dense,
            layer_types=["full_attention"] * cfg.n_layers,
            sliding_window=None,
        )
    return hf


# --------------------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """One HF tensor <-> one slice of one of our arrays.

    path: key path into the model state; index: leading indices of that array (stacked
    layer and/or expert); hf_shape: shape in the HF file; transpose: HF [out, in] vs our
    [in, ...out] (then reshaped to the slice shape).
    """

    hf_name: str
    path: tuple
    index: tuple
    hf_shape: tuple
    transpose: bool


def tensor_map(cfg: ModelConfig) -> list[TensorMapping]:
    """Every tensor of the HF checkpoint for `cfg`, in file order."""
    fam = hf_family(cfg)
    D, H, K, Dh, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    out: list[TensorMapping] = []

    def add(name, path, index, shape, transpose):
        out.append(TensorMapping(name, tuple(path), tuple(index), tuple(shape), transpose))

    add("model.embed_tokens.weight", ("embed",), (), (V, D), False)
    layer_places = [(g.name, g.moe, j) for g in layer_groups(cfg) for j in range(g.n)]
    for i, (group, moe, j) in enumerate(layer_places):
        base, idx = ((group,), (j,)) if cfg.scan_layers else ((group, j), ())
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", base + ("attn_norm", "scale"), idx, (D,), False)
        add(p + "post_attention_layernorm.weight", base + ("mlp_norm", "scale"), idx, (D,), False)
        for proj, n in (("q", H), ("k", K), ("v", K)):
            add(p + f"self_attn.{proj}_proj.weight", base + ("attn", proj), idx, (n * Dh, D), True)
            if cfg.qkv_bias:
                add(p + f"self_attn.{proj}_proj.bias", base + ("attn", f"{proj}_bias"), idx, (n * Dh,), False)
        add(p + "self_attn.o_proj.weight", base + ("attn", "o"), idx, (D, H * Dh), True)
        if cfg.qk_norm:
            add(p + "self_attn.q_norm.weight", base + ("attn", "q_norm", "scale"), idx, (Dh,), False)
            add(p + "self_attn.k_norm.weight", base + ("attn", "k_norm", "scale"), idx, (Dh,), False)
        if not moe:
            F = cfg.d_ff
            for proj, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                add(p + f"mlp.{proj}_proj.weight", base + ("mlp", proj), idx, shape, True)
            continue
        F, E = cfg.d_ff_expert, cfg.n_experts
        m = p + ("block_sparse_moe." if fam == "mixtral" else "mlp.")
        add(m + "gate.weight", base + ("mlp", "router"), idx, (E, D), True)
        if cfg.router == "sigmoid":
            add(m + "gate.e_score_correction_bias", base + ("mlp", "bias"), idx, (E,), False)
        names = ("w1", "w3", "w2") if fam == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            for hf_proj, ours, shape in zip(names, ("w_gate", "w_up", "w_down"), ((F, D), (F, D), (D, F))):
                add(m + f"experts.{e}.{hf_proj}.weight", base + ("mlp", ours), idx + (e,), shape, True)
        if cfg.n_shared_experts:
            Fs = F * cfg.n_shared_experts
            for proj, shape in (("gate", (Fs, D)), ("up", (Fs, D)), ("down", (D, Fs))):
                add(m + f"shared_experts.{proj}_proj.weight", base + ("mlp", "shared", proj), idx, shape, True)
    add("model.norm.weight", ("final_norm", "scale"), (), (D,), False)
    if not cfg.tie_embeddings:
        add("lm_head.weight", ("lm_head",), (), (V, D), True)
    return out


def _to_ours(hf_arr: np.ndarray, m: TensorMapping, slice_shape: tuple) -> np.ndarray:
    a = hf_arr.T if m.transpose else hf_arr
    return a.reshape(slice_shape)


def _to_hf(ours: np.ndarray, m: TensorMapping) -> np.ndarray:
    if m.transpose:
        return ours.reshape(m.hf_shape[::-1]).T
    return ours.reshape(m.hf_shape)


def _flat_state(model_or_state) -> dict[tuple, Any]:
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    return {tuple(k): v for k, v in nnx.to_flat_state(state)}


# --------------------------------------------------------------------------- load


def _check_tensor(name: str, files, m: TensorMapping) -> None:
    code, shape = files[name].info(name)
    if shape != m.hf_shape:
        raise ValueError(f"tensor {name!r}: shape {list(shape)} in the checkpoint, expected {list(m.hf_shape)}")
    if code not in FLOAT_CODES:
        raise ValueError(
            f"tensor {name!r}: dtype {code} (expected a float type: F32/BF16/F16); quantised checkpoints "
            "must be dequantised first"
        )


def read_hf_config(path: str) -> dict:
    """A folder's config.json as a dict; ValueError naming the file when it is not JSON."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except ValueError as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}); copy or convert the model folder again") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_path} holds a JSON {type(hf).__name__}, not a model config object")
    return hf


def load_hf(
    path: str,
    dtype: str = "float32",
    *,
    param_dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    rules: tuple | None = None,
    **overrides: Any,
) -> Decoder:
    """Loads a local Hugging Face folder into a Decoder.

    dtype: compute dtype; param_dtype: stored weight dtype (float32 master weights by
    default, whatever the file holds). With `mesh`, each parameter is created directly as
    a sharded array (logical axes -> mesh axes by `rules`, default
    ptrain.parallel.sharding.DEFAULT_RULES): every device's shard is read from the
    memory-mapped safetensors, so no host holds the whole model; and when the rules put
    the experts on a mesh axis larger than 1, the MoE blocks run expert-parallel on it
    (see ptrain.models.decoder). Other ModelConfig fields (remat, scan_layers,
    moe_implementation, ...) pass through `overrides`.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; pass a Hugging Face model folder")
    hf = read_hf_config(path)
    seq_cls = [a for a in hf.get("architectures") or [] if str(a).endswith("ForSequenceClassification")]
    if seq_cls:
        raise ValueError(
            f"{path} holds a reward model ({seq_cls[0]}: a score head and no LM head), not a causal LM; "
            "start a policy stage from the folder the reward-model stage started from (its init), or any "
            "causal-LM folder"
        )
    cfg = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, **overrides)
    return _read_folder(
        path, cfg, tensor_map(cfg), lambda: Decoder(cfg, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), mesh, rules
    )


def _read_folder(path: str, cfg: ModelConfig, mappings: list[TensorMapping], build, mesh, rules):
    """The module `build()` makes (built abstractly, never initialised), its every variable
    read from the folder's safetensors by `mappings`: checked against the files first
    (missing, unexplained, wrong shape or dtype), then read whole, or per device shard
    with a mesh."""
    files = open_folder(path)
    expected = {m.hf_name for m in mappings}
    missing = [m for m in mappings if m.hf_name not in files]
    if missing:
        listed = ", ".join(f"{m.hf_name} {list(m.hf_shape)}" for m in missing[:5])
        raise ValueError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. {listed}")
    extra = sorted(n for n in files if n not in expected and not _IGNORED.match(n))
    if extra:
        raise ValueError(f"{path}: tensors the {cfg.family} config does not explain (unsupported option?): {extra[:5]}")
    for m in mappings:
        _check_tensor(m.hf_name, files, m)

    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    flat = _flat_state(state)
    by_path: dict[tuple, list[TensorMapping]] = defaultdict(list)
    for m in mappings:
        if m.path not in flat:
            raise KeyError(f"internal: tensor map path {m.path} not in the model state")
        by_path[m.path].append(m)
    if mesh is not None:
        from ptrain.parallel.sharding import DEFAULT_RULES, logical_to_spec

    values = {}
    for path_key, var in flat.items():
        shape, pdt = tuple(var.shape), var.dtype
        maps = by_path.get(path_key, [])
        n_lead = len(maps[0].index) if maps else 0
        covered = {m.index for m in maps}
        need = set(np.ndindex(*shape[:n_lead])) if n_lead else {()}
        if not maps or covered != need:
            raise ValueError(f"internal: {path_key} is not fully covered by the tensor map")
        index_of = {m.index: m for m in maps}

        def read(idx: tuple, _index_of=index_of, _shape=shape, _n=n_lead, _dt=pdt) -> np.ndarray:
            """Reads the block `idx` (a tuple of slices over our array) from the checkpoint."""
            idx = tuple(idx) + (slice(None),) * (len(_shape) - len(idx))
            lead = [range(*s.indices(d)) for s, d in zip(idx[:_n], _shape[:_n])]
            rest = idx[_n:]
            rows = []
            for li in np.ndindex(*[len(r) for r in lead]) if _n else [()]:
                key = tuple(r[i] for r, i in zip(lead, li))
                m = _index_of[key]
                block = _to_ours(files[m.hf_name].get(m.hf_name), m, _shape[_n:])[rest]
                rows.append(np.asarray(block, dtype=np.float32).astype(_dt))
            out_lead = [len(r) for r in lead]
            return np.stack(rows).reshape(out_lead + list(rows[0].shape)) if _n else rows[0]

        if mesh is None:
            values[path_key] = jnp.asarray(read(()))
        else:
            names = var.get_metadata().get("out_sharding") or (None,) * len(shape)
            spec = logical_to_spec(names, shape, mesh, rules or DEFAULT_RULES)
            sharding = jax.sharding.NamedSharding(mesh, spec)
            values[path_key] = jax.make_array_from_callback(shape, sharding, read)

    for path_key, var in flat.items():
        var.set_value(values[path_key])
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------- save


def save_hf(
    model: Decoder | RewardModel,
    path: str,
    tokenizer: Any = None,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Writes config.json, safetensors (sharded with an index above max_shard_bytes) and,
    if given, the tokenizer (anything with `save_pretrained`, e.g. a
    PreTrainedTokenizerFast; or a `tokenizers.Tokenizer`, saved as tokenizer.json).

    dtype: stored weight dtype (default: the parameters' own, float32). A RewardModel is
    written as what it is, a sequence classifier (`save_hf_reward_model`), so that a stage's
    export writes whichever model the stage trained.
    """
    if isinstance(model, RewardModel):
        save_hf_reward_model(model, path, tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return
    cfg = model.cfg
    _write_folder(path, config_to_hf(cfg), tensor_map(cfg), _flat_state(model), tokenizer, dtype, max_shard_bytes)


def _write_folder(
    path: str,
    hf: dict,
    mappings: list[TensorMapping],
    flat: dict[tuple, Any],
    tokenizer: Any,
    dtype: str | None,
    max_shard_bytes: int,
    *,
    pad_token_id: int | None = None,
) -> None:
    """The folder save_hf and save_hf_reward_model write: the `mappings` tensors read from
    `flat` (our state by path), config.json with the tokenizer's special-token ids, the
    tokenizer. pad_token_id, when given, wins over the tokenizer's."""
    os.makedirs(path, exist_ok=True)
    store_dt = as_dtype(dtype) if dtype else None
    if store_dt is not None:
        hf["torch_dtype"] = dtype

    def tensors():
        host_cache: dict[tuple, np.ndarray] = {}
        for m in mappings:
            if m.path not in host_cache:
                host_cache.clear()  # keep one of our arrays on the host at a time
                host_cache[m.path] = np.asarray(jax.device_get(flat[m.path][...]))
            arr = _to_hf(host_cache[m.path][m.index] if m.index else host_cache[m.path], m)
            yield m.hf_name, np.ascontiguousarray(arr.astype(store_dt or arr.dtype))

    # Drop stale shards of an earlier save into the same folder before writing.
    for fn in os.listdir(path):
        if fn.startswith("model") and (fn.endswith(".safetensors") or fn == "model.safetensors.index.json"):
            os.remove(os.path.join(path, fn))
    write_sharded(tensors(), path, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None:
        if hasattr(tokenizer, "save_pretrained"):
            from ptrain.data.tokenizer import save_tokenizer  # files transformers 4.x (SGLang) loads too

            save_tokenizer(tokenizer, path)
        elif hasattr(tokenizer, "to_str"):
            with open(os.path.join(path, "tokenizer.json"), "w") as f:
                f.write(tokenizer.to_str())
        else:
            raise TypeError(f"tokenizer of type {type(tokenizer).__name__} has neither save_pretrained nor to_str")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            val = getattr(tokenizer, key, None)
            if isinstance(val, int):
                hf[key] = val
    if pad_token_id is not None:
        hf["pad_token_id"] = pad_token_id
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)


# --------------------------------------------------------------------------- reward models

SEQUENCE_CLASSIFICATION = {
    fam: arch.removesuffix("ForCausalLM") + "ForSequenceClassification" for fam, arch in ARCHITECTURES.items()
}
"""HF model_type -> the class a reward model of that family is written as."""
PTRAIN_ONLY_CLASSIFIERS = frozenset({"dots1"})
"""Families whose sequence-classification class transformers lacks (Dots1ForSequenceClassification):
their reward-model folders have the same layout (model.* and score.weight) and
load_hf_reward_model reads them, but transformers does not."""


TRAINED_TOKENS_KEY = "ptrain_trained_tokens"
"""config.json key of a reward model: the longest row it was trained on (tokens). A judge
scores no longer rows; transformers keeps the key as an attribute and ignores it."""


def reward_config_to_hf(cfg: ModelConfig, pad_token_id: int | None, trained_tokens: int | None = None) -> dict:
    """config.json of a reward model: the family's, as a one-label sequence classifier.

    transformers reads num_labels from id2label; pad_token_id is what it pools by (the
    rightmost token that is not pad), so a batch of more than one row needs it set."""
    fam = hf_family(cfg)
    hf = config_to_hf(cfg)
    hf.update(
        architectures=[SEQUENCE_CLASSIFICATION[fam]],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=pad_token_id,
    )
    if trained_tokens is not None:
        hf[TRAINED_TOKENS_KEY] = int(trained_tokens)
    return hf


def reward_tensor_map(cfg: ModelConfig) -> list[TensorMapping]:
    """The tensors of a reward-model folder: the decoder's under `model.` (our RewardModel's
    `model` subtree) without the LM head, which a RewardModel does not hold, and
    `score.weight` [1, D]."""
    out = [dataclasses.replace(m, path=("model",) + m.path) for m in tensor_map(cfg) if m.hf_name != "lm_head.weight"]
    out.append(TensorMapping("score.weight", ("score",), (), (1, cfg.d_model), True))
    return out


def save_hf_reward_model(
    model: RewardModel,
    path: str,
    tokenizer: Any = None,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Writes a `ptrain.models.RewardModel` as a Hugging Face sequence-classification folder
    (e.g. Qwen3ForSequenceClassification, num_labels 1): config.json with the model's
    pad_token_id, safetensors with model.* and score.weight (no lm_head), the tokenizer.
    `transformers.AutoModelForSequenceClassification.from_pretrained(path)(ids).logits[:, 0]`
    then equals the model's scores. dtype, max_shard_bytes: as in save_hf."""
    cfg = model.cfg
    hf = reward_config_to_hf(cfg, model.pad_token_id, model.trained_tokens)
    if hf_family(cfg) in PTRAIN_ONLY_CLASSIFIERS:
        log.warning(
            "%s: transformers has no %s, so this reward model loads in ptrain (load_hf_reward_model) and not in "
            "transformers; train it on %s for a folder transformers reads",
            path, hf["architectures"][0], sorted(set(SEQUENCE_CLASSIFICATION) - PTRAIN_ONLY_CLASSIFIERS),
        )  # fmt: skip
    flat = _flat_state(model)
    _write_folder(
        path, hf, reward_tensor_map(cfg), flat, tokenizer, dtype, max_shard_bytes, pad_token_id=model.pad_token_id
    )


def read_reward_model_config(path: str) -> dict:
    """config.json of a reward-model folder, checked to be a one-label sequence classifier:
    FileNotFoundError without one, ValueError naming what it holds instead."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json; pass a Hugging Face reward-model folder")
    hf = read_hf_config(path)
    archs = [str(a) for a in hf.get("architectures") or []]
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{path} holds {archs or 'no architectures'}, not a reward model (*ForSequenceClassification); "
            "train one with a stage of kind rm, or load a policy with load_hf"
        )
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default is 2
    if labels != 1:
        raise ValueError(f"{path}: a reward model has one label (a scalar score); this classifier has {labels}")
    return hf


def load_hf_reward_model(
    path: str,
    dtype: str = "float32",
    *,
    param_dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    rules: tuple | None = None,
    **overrides: Any,
) -> RewardModel:
    """Loads a sequence-classification folder with one label (what save_hf_reward_model and
    the rm stage write, or a transformers reward model of a supported family) into a
    RewardModel that pools by its config's pad_token_id. Arguments as load_hf's."""
    hf = read_reward_model_config(path)
    cfg = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, **overrides)
    pad, trained = hf.get("pad_token_id"), hf.get(TRAINED_TOKENS_KEY)

    def build() -> RewardModel:
        decoder = Decoder(cfg, rngs=nnx.Rngs(0), mesh=mesh, rules=rules)
        return RewardModel(
            decoder,
            rngs=nnx.Rngs(0),
            pad_token_id=pad if isinstance(pad, int) else None,
            trained_tokens=trained if type(trained) is int else None,
        )

    return _read_folder(path, cfg, reward_tensor_map(cfg), build, mesh, rules)


__all__ = [
    "ARCHITECTURES",
    "PTRAIN_ONLY_CLASSIFIERS",
    "SEQUENCE_CLASSIFICATION",
    "TensorMapping",
    "config_from_hf",
    "config_to_hf",
    "hf_family",
    "load_hf",
    "load_hf_reward_model",
    "read_reward_model_config",
    "reward_config_to_hf",
    "reward_tensor_map",
    "save_hf",
    "save_hf_reward_model",
    "tensor_map",
]
