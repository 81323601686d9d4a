"""The run-level Python API: compose, run, one stage of a kind, and its errors."""

import json
import os
import subprocess
import sys

import pytest

import ptrain
from ptrain.config.recipes import available_recipes

TINY_SFT = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.d_ff=48",
    "model.max_seq_len=64",
    "data.generated.n_train=40",
    "data.generated.n_eval=8",
    "data.tokenizer_vocab_size=300",
    "train.steps=2",
    "train.global_batch_size=2",
    "train.seq_len=32",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.eval_generate=0",
    "checkpoint.async_save=false",
    "logging.console=false",
    "logging.tensorboard=false",
]


def test_compose_gives_the_typed_config_the_cli_composes():
    cfg = ptrain.compose("sft_dpo_arithmetic", ["train.steps=7", "seed=3"])
    assert isinstance(cfg, ptrain.RunConfig)
    assert cfg.name == "sft_dpo_arithmetic" and cfg.train.steps == 7 and cfg.seed == 3
    assert [(s.name, s.kind) for s in cfg.stages] == [("sft", "sft"), ("dpo", "dpo")]
    assert cfg.data.shuffle_seed is not None  # component seeds are derived, as for a launch


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (
            "alpaca_farm",
            [],
            r"no recipe 'alpaca_farm'; pass one of continuous, countdown_zero, .*, nemotron_like, .*, sft_arithmetic, "
            r".*, zephyr \(recipes/ holds them",
        ),
        ("sft_arith", [], r"did you mean sft_arithmetic"),
        ("sft_arithmetic", ["trian.steps=3"], r"config key 'trian'.*Valid keys here: name, run_dir"),
        ("sft_arithmetic", ["train.steps=abc"], r"config key 'train.steps'.*could not be converted"),
        ("sft_arithmetic", ["train.steps=-1"], r"config key 'train.steps': must be > 0"),
        ("sft_arithmetic", ["model=nonexistent"], r"Could not find 'model/nonexistent'.*tiny_moe"),
        ("sft_arithmetic", ["rollout.urls=http://h:1"], r"must be a list.*rollout.urls=\[http://h:1\]"),
        ("sft_arithmetic", ["recipe=eval"], r"pass the recipe as compose's first argument"),
        ("sft_arithmetic", "train.steps=3", r"a list of 'key=value' strings"),
    ],
)
def test_a_bad_key_or_value_raises_config_error_naming_it(recipe, overrides, message):
    with pytest.raises(ptrain.ConfigError, match=message):
        ptrain.compose(recipe, overrides)


def test_every_shipped_recipe_composes():
    names = available_recipes()
    assert {"sft_arithmetic", "sft_dpo_arithmetic", "sft_grpo_arithmetic", "eval"} <= set(names)
    launch = {"continuous": ["continuous.inbox=inbox"]}  # what a recipe leaves to its launch
    for name in names:
        assert ptrain.compose(name, launch.get(name, [])).name


def test_run_writes_the_stages_and_a_relaunch_skips_them(tmp_path):
    cfg = ptrain.compose(None, TINY_SFT)
    result = ptrain.run(cfg, run_dir=str(tmp_path / "run"))
    assert result.run_dir == str(tmp_path / "run") and list(result.stages) == ["sft"]
    sft = result.stages["sft"]
    assert sft.done and sft.kind == "sft" and sft.name == "sft"
    assert os.path.isfile(os.path.join(sft.export, "config.json"))
    assert sft.metrics_path == str(tmp_path / "run" / "stages" / "sft" / "metrics.jsonl")
    rows = [json.loads(line) for line in open(sft.metrics_path)]
    last_loss = [r["train/loss"] for r in rows if "train/loss" in r][-1]
    assert sft.metrics["train/loss"] == pytest.approx(last_loss)
    assert "eval/loss" in sft.metrics and all(isinstance(v, float) for v in sft.metrics.values())
    again = ptrain.run(cfg, run_dir=str(tmp_path / "run"))
    assert again.stages["sft"].metrics == sft.metrics  # skipped: nothing trained again


def test_one_stage_of_a_kind_from_a_recipe_a_config_or_the_defaults(tmp_path):
    sft = ptrain.sft(None, TINY_SFT, run_dir=str(tmp_path / "a"), train={"steps": 1})
    assert sft.done and sft.kind == "sft" and sft.export is not None
    assert json.load(open(os.path.join(tmp_path, "a", "stages", "sft", "DONE.json")))["steps"] == 1
    # The DPO stage of a two-stage recipe starts from the SFT stage's export: it must be there.
    cfg = ptrain.compose("sft_dpo_arithmetic", TINY_SFT)
    with pytest.raises(FileNotFoundError, match="run the previous stage first"):
        ptrain.dpo(cfg, run_dir=str(tmp_path / "b"))
    with pytest.raises(ptrain.ConfigError, match="stage 'sft' is a sft stage, not dpo"):
        ptrain.dpo(cfg, stage="sft")
    with pytest.raises(ptrain.ConfigError, match="no stage named 'nope'"):
        ptrain.sft(cfg, stage="nope")
    # No DPO stage in the defaults: a one-stage DPO run, which needs preference data.
    with pytest.raises(ptrain.ConfigError, match="a dpo stage reads data.format=preference"):
        ptrain.dpo(None, TINY_SFT)
    with pytest.raises(ptrain.ConfigError, match="config key 'trian'"):
        ptrain.sft(cfg, ["trian.steps=1"])
    with pytest.raises(ptrain.ConfigError, match="model=tiny_moe apply only when composing"):
        ptrain.sft(cfg, ["model=tiny_moe"])


def test_the_cli_refuses_an_unknown_recipe_in_one_line_before_hydra(tmp_path):
    for args in (
        ["recipe=nemotron_zz"],
        ["recipe=alpaca_farm", "--cfg", "job"],
        ["-m", "recipe=sft_arithmetic,alpaca_farm"],
    ):
        p = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ptrain: config error: config key 'recipe': there is no recipe")
        assert "sft_grpo_arithmetic" in lines[0]
        assert not os.path.exists(tmp_path / "runs")


def test_a_scale_is_the_recipes_own_table_and_the_command_line_still_wins():
    smoke = ptrain.compose("sft_grpo_arithmetic", ["scale=smoke"])
    tiny = ptrain.compose("sft_grpo_arithmetic")
    assert (tiny.scale, smoke.scale) == ("tiny", "smoke")
    assert tiny.model.d_model == 256 and smoke.model.d_model == 32
    assert [s.name for s in smoke.stages] == ["sft", "grpo", "eval"] and smoke.stages[1].train["steps"] == 2
    mine = ptrain.compose("sft_grpo_arithmetic", ["scale=smoke", "train.steps=6", "model.d_model=64", "seed=5"])
    assert (mine.train.steps, mine.model.d_model, mine.seed) == (6, 64, 5)
    # Validated again with more overrides (the API's path), the scale is not applied twice.
    again = ptrain.api._with_overrides(mine, ["seed=7"])
    assert (again.train.steps, again.model.d_model, again.seed, again.scales) == (6, 64, 7, {"smoke": {}})
    with pytest.raises(ptrain.ConfigError, match=r"recipe 'sft_arithmetic' has no scale 'huge'; it has tiny, smoke"):
        ptrain.compose("sft_arithmetic", ["scale=huge"])
    with pytest.raises(ptrain.ConfigError, match=r"recipe 'default' has no scale 'smoke'; it has tiny"):
        ptrain.compose(None, ["scale=smoke"])
