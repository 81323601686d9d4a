"""A LoRA SFT stage end to end through the Python API: it trains only the adapters, checkpoints
hold no base weights, the stage exports the merged model and a PEFT adapter folder that
agree, and a stage cut after its first checkpoint resumes to the same losses."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import ptrain
from ptrain.models import load_hf
from ptrain.models.lora import merge
from ptrain.models.peft_io import load_peft
from ptrain.train.state import split_model

SMOKE = [
    "scale=smoke",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "model.lora.dropout=0.1",
    "train.steps=4",
    "checkpoint.every_steps=2",
    "optim.lr=3e-3",
    "logging.console=false",
    "logging.tensorboard=false",
]


def losses(stage_dir) -> dict[int, float]:
    out = {}
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "train/loss" in rec:
                out[rec["step"]] = rec["train/loss"]
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_sft")
    result = ptrain.run("sft_arithmetic", SMOKE, run_dir=str(run_dir))
    return run_dir, result.stages["sft"]


def test_checkpoints_hold_the_adapters_alone(finished):
    run_dir, _ = finished
    ckpts = run_dir / "stages" / "sft" / "checkpoints"
    newest = max(int(s) for s in os.listdir(ckpts) if s.isdigit())
    with open(os.path.join(ckpts, str(newest), "state", "_METADATA")) as f:
        keys = [eval(k) for k in json.load(f)["tree_metadata"]]  # keys are tuple reprs
    params = [k for k in keys if k[0] == "params"]
    assert params and all(k[-1] in ("a", "b") for k in params)
    assert not [k for k in keys if k[0] in ("base_params", "ref_params") and len(k) > 1]
    moments = [k for k in keys if k[0] == "opt_state" and k[-1] in ("a", "b")]
    assert len(moments) == 2 * len(params)  # Adam's two moments, of the adapters only


def test_exports_merged_model_and_peft_adapter_that_agree(finished):
    run_dir, _ = finished
    stage = run_dir / "stages" / "sft"
    base = load_hf(str(run_dir / "base_model"))
    _, base_params, _ = split_model(base)
    adapters, spec = load_peft(str(stage / "adapter"), base_params, base.cfg)
    assert spec.rank == 4 and spec.alpha == 8.0 and "q_proj" in spec.targets
    _, exported, _ = split_model(load_hf(str(stage / "export")))
    rebuilt = merge(base_params, adapters, spec)
    for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(rebuilt)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(base_params)))  # fmt: skip
    assert moved > 1e-4  # the adapters trained


def test_a_cut_stage_resumes_to_the_same_losses(finished, tmp_path):
    run_dir, _ = finished
    ref = losses(run_dir / "stages" / "sft")
    assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1]
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    stage = cut / "stages" / "sft"
    for name in ("DONE.json", "export", "adapter", "checkpoints/4"):
        p = stage / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    kept = [line for line in (stage / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (stage / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    ptrain.run("sft_arithmetic", SMOKE, run_dir=str(cut))
    got = losses(stage)
    assert got == pytest.approx(ref, rel=1e-6)
