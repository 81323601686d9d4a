"""Convert between a Hugging Face folder and an Orbax checkpoint of ptrain's model state.

    python tools/convert.py hf-to-orbax  HF_FOLDER  ORBAX_DIR  [--scan-layers]
    python tools/convert.py orbax-to-hf  ORBAX_DIR  HF_FOLDER  [--tokenizer-from HF_FOLDER] [--dtype bfloat16]

The Orbax side is a directory holding `state/` (the model's nnx state as a pytree of
arrays, restorable with `ocp.StandardCheckpointer`) and `model_config.json` (the
ModelConfig, so the model can be rebuilt without the HF folder). Round trips are exact
in float32. Only safetensors are read; tokenizer files are copied, never executed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, load_hf, save_hf

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def hf_to_orbax(hf_folder: str, orbax_dir: str, **overrides) -> ModelConfig:
    """Loads `hf_folder` and writes its state and config under `orbax_dir`."""
    model = load_hf(hf_folder, **overrides)
    os.makedirs(orbax_dir, exist_ok=True)
    state = nnx.to_pure_dict(nnx.state(model))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(os.path.join(orbax_dir, "state")), state, force=True)
    ckpt.wait_until_finished()
    cfg = model.cfg
    with open(os.path.join(orbax_dir, "model_config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    for name in TOKENIZER_FILES:
        src = os.path.join(hf_folder, name)
        if os.path.isfile(src):
            os.makedirs(os.path.join(orbax_dir, "tokenizer"), exist_ok=True)
            shutil.copy(src, os.path.join(orbax_dir, "tokenizer", name))
    return cfg


def load_orbax(orbax_dir: str) -> Decoder:
    """Rebuilds the Decoder saved by `hf_to_orbax` (or by a stage export in this layout)."""
    cfg_path = os.path.join(orbax_dir, "model_config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{orbax_dir}: no model_config.json; is this a tools/convert.py checkpoint?")
    with open(cfg_path) as f:
        cfg = ModelConfig(**json.load(f))
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    restored = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(orbax_dir, "state")), target)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def orbax_to_hf(orbax_dir: str, hf_folder: str, *, tokenizer_from: str | None = None, dtype: str | None = None) -> None:
    """Writes the Orbax checkpoint as a HF folder (plus tokenizer files if known)."""
    model = load_orbax(orbax_dir)
    save_hf(model, hf_folder, dtype=dtype)
    tok_dir = tokenizer_from or os.path.join(orbax_dir, "tokenizer")
    for name in TOKENIZER_FILES:
        src = os.path.join(tok_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(hf_folder, name))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-orbax", help="HF folder -> Orbax checkpoint")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--scan-layers", action="store_true", help="store layers stacked (for scan_layers runs)")
    b = sub.add_parser("orbax-to-hf", help="Orbax checkpoint -> HF folder")
    b.add_argument("src")
    b.add_argument("dst")
    b.add_argument("--tokenizer-from", default=None, help="folder whose tokenizer files to copy")
    b.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="stored weight dtype")
    args = ap.parse_args(argv)
    if args.cmd == "hf-to-orbax":
        cfg = hf_to_orbax(args.src, args.dst, scan_layers=args.scan_layers)
        print(f"wrote {args.dst} ({cfg.family}, {cfg.n_layers} layers)")
    else:
        orbax_to_hf(args.src, args.dst, tokenizer_from=args.tokenizer_from, dtype=args.dtype)
        print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
