"""LoRA adapters as PEFT adapter folders: `adapter_config.json` + `adapter_model.safetensors`,
the layout `peft.PeftModel.from_pretrained` loads onto a transformers model, read back the
same way.

PEFT stores, per adapted linear layer `<module>` of the HF model, `base_model.model.<module>.
lora_A.weight` [r, in] and `lora_B.weight` [out, r], and computes W x + (alpha / r) B A x.
Our adapter of the weight at a param path is A [..., *in, r] and B [..., r, *out] over the
same flattened axes (ptrain/models/lora.py), so each PEFT tensor is one slice of ours,
transposed, located by the same tensor map as the full weights (`hf.tensor_map`). Routed
experts are not written here: transformers holds an MoE's experts as fused parameters that
PEFT adapts by another mechanism; export those runs merged.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from ptrain.config.lora import LORA_TARGETS, TARGET_GROUPS
from ptrain.config.model import ModelConfig
from ptrain.models.hf import tensor_map
from ptrain.models.lora import LoRASpec, split_shape, target_of

PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _slots(cfg: ModelConfig, spec: LoRASpec) -> list[tuple[str, tuple, tuple]]:
    """(PEFT module name, our weight path, leading index) of every adapted HF linear layer."""
    out = []
    for m in tensor_map(cfg):
        t = target_of(m.path)
        if t is None or t[0] not in spec.targets or not m.hf_name.endswith(".weight"):
            continue
        out.append((m.hf_name[: -len(".weight")], m.path, m.index))
    return out


def save_peft(adapters: dict, spec: LoRASpec, cfg: ModelConfig, path: str, *, base_model: str | None = None) -> None:
    """Write `adapters` (for a model of `cfg`) as a PEFT adapter folder at `path`."""
    from safetensors.numpy import save_file

    if "experts" in spec.targets:
        raise ValueError(
            "adapters of the routed experts have no PEFT layout that transformers' fused experts load; "
            "export this model merged (the stage's export/ folder) or train without the 'experts' target"
        )
    tensors: dict[str, np.ndarray] = {}
    host: dict[tuple, dict] = {}
    for module, wpath, index in _slots(cfg, spec):
        if wpath not in host:
            node = adapters
            for k in wpath:
                node = node[k]
            host[wpath] = {k: np.asarray(jax.device_get(v), np.float32) for k, v in node.items()}
        a, b = (host[wpath][k][index] if index else host[wpath][k] for k in ("a", "b"))
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, spec.rank).T)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(spec.rank, -1).T)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "target_modules": sorted(t for t in spec.targets if t != "experts"),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def read_peft_spec(path: str) -> LoRASpec:
    """The LoRASpec of the PEFT adapter folder at `path`; a clear error for anything we do not run."""
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG}; pass a PEFT adapter folder")
    with open(cfg_path) as f:
        c = json.load(f)
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {c.get('peft_type')!r}; only LORA adapters load here")
    unsupported = {
        "bias": c.get("bias", "none") != "none",
        "fan_in_fan_out": bool(c.get("fan_in_fan_out")),
        "use_dora": bool(c.get("use_dora")),
        "rank_pattern": bool(c.get("rank_pattern")),
        "alpha_pattern": bool(c.get("alpha_pattern")),
        "modules_to_save": bool(c.get("modules_to_save")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{cfg_path}: {', '.join(bad)} set; these adapters hold more than low-rank A and B "
                         "per layer, which ptrain does not load (merge them in PEFT and load the merged model)")  # fmt: skip
    targets = c.get("target_modules") or []
    if isinstance(targets, str):  # a shorthand, or a regular expression over module names
        if targets not in TARGET_GROUPS:
            raise ValueError(f"{cfg_path}: target_modules is the pattern {targets!r}; ptrain reads a list of module "
                             "names (or all-linear): save the adapter with target_modules as a list")  # fmt: skip
        targets = list(TARGET_GROUPS[targets])
    names = tuple(t for t in LORA_TARGETS if t in {str(x).rsplit(".", 1)[-1] for x in targets})
    unknown = sorted({str(x).rsplit(".", 1)[-1] for x in targets} - set(LORA_TARGETS))
    if unknown:
        raise ValueError(
            f"{cfg_path}: target_modules {unknown} are not layers ptrain adapts ({', '.join(LORA_TARGETS)})"
        )
    return LoRASpec(names, int(c["r"]), float(c["lora_alpha"]), float(c.get("lora_dropout") or 0.0),
                    bool(c.get("use_rslora")))  # fmt: skip


def load_peft(path: str, params: Any, cfg: ModelConfig) -> tuple[dict, LoRASpec]:
    """(adapters for `params` of a model of `cfg`, their spec) from a PEFT adapter folder.
    Every adapted layer of the model must be in the file with the shape the model needs."""
    from safetensors import safe_open

    spec = read_peft_spec(path)
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read; re-save "
                                "with safe_serialization=True)")  # fmt: skip
    out: dict = {}
    with safe_open(file, "np") as f:
        names = set(f.keys())
        seen = set()
        for module, wpath, index in _slots(cfg, spec):
            w = params
            for k in wpath:
                w = w[k]
            _, n_in, n_out = target_of(wpath)
            lead, ins, outs = split_shape(tuple(w.shape), n_in, n_out)
            node = out
            for k in wpath[:-1]:
                node = node.setdefault(k, {})
            pair = node.setdefault(wpath[-1], {"a": np.zeros((*lead, *ins, spec.rank), np.float32),
                                                 "b": np.zeros((*lead, spec.rank, *outs), np.float32)})  # fmt: skip
            for side, want in (("A", (spec.rank, int(np.prod(ins)))), ("B", (int(np.prod(outs)), spec.rank))):
                key = f"{PREFIX}{module}.lora_{side}.weight"
                if key not in names:
                    raise ValueError(f"{file}: no tensor {key}; the adapter does not cover layer {module} that its "
                                     f"config targets, or it was made for another model")  # fmt: skip
                t = f.get_tensor(key)
                if tuple(t.shape) != want:
                    raise ValueError(f"{file}: {key} has shape {list(t.shape)}, this model needs {list(want)} "
                                     "(an adapter for another model size, or another rank)")  # fmt: skip
                seen.add(key)
                if side == "A":
                    pair["a"][index] = t.T.reshape(*ins, spec.rank)
                else:
                    pair["b"][index] = t.T.reshape(spec.rank, *outs)
        extra = sorted(names - seen)
        if extra:
            raise ValueError(f"{file}: {len(extra)} tensors match no layer of this model (first: {extra[0]}); "
                             "the adapter was made for another architecture")  # fmt: skip
    return jax.tree.map(np.asarray, out), spec
