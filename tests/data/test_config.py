"""validate_data_config: a table of mistakes, each named by key with the fix."""

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from ptrain.config.data import DataConfig, DataConfigError, GeneratedTaskConfig, validate_data_config


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    (d / "train.jsonl").write_text("{}\n")
    (d / "train.parquet").write_bytes(b"")
    (d / "notes.txt").write_text("x")
    return d


MISTAKES = [
    (dict(source="csv"), "data.source"),
    (dict(format="sharegpt"), "data.format"),
    (dict(bad_rows="ignore"), "data.bad_rows"),
    (dict(max_bad_fraction=1.5), "data.max_bad_fraction"),
    (dict(num_epochs=0), "data.num_epochs"),
    (dict(num_workers=-1), "data.num_workers"),
    (dict(packing_bins=-2), "data.packing_bins"),
    (dict(tokenizer_vocab_size=100), "data.tokenizer_vocab_size"),
    (dict(generated=GeneratedTaskConfig(n_train=0)), "data.generated.n_train"),
    (dict(generated=GeneratedTaskConfig(min_digits=4, max_digits=3)), "data.generated.min_digits"),
    (dict(generated=GeneratedTaskConfig(ops=["/"])), "data.generated.ops"),
    (dict(source="jsonl"), "data.train_path"),
    (dict(source="jsonl", train_path="{d}/missing.jsonl"), "data.train_path"),
    (dict(source="jsonl", train_path="{d}/train.jsonl", eval_path="{d}/gone.jsonl"), "data.eval_path"),
    (dict(source="jsonl", train_path="{d}/notes.txt"), "data.train_path"),
    (dict(source="parquet", train_path="{d}/train.jsonl"), "data.train_path"),
    (dict(source="parquet", train_path="{d}/shards-*.parquet"), "data.train_path"),
    (dict(source="arrow", train_path="{d}"), "data.train_path"),
    (dict(tokenizer_path="{d}"), "data.tokenizer_path"),
]


@pytest.mark.parametrize("overrides,key", MISTAKES)
def test_mistakes_name_the_key(overrides, key, files):
    kw = {k: v.format(d=files) if isinstance(v, str) else v for k, v in overrides.items()}
    with pytest.raises((DataConfigError, FileNotFoundError)) as e:
        validate_data_config(DataConfig(**kw))
    assert f"'{key}'" in str(e.value)
    assert "pass" in str(e.value)


def test_good_configs_pass(files):
    validate_data_config(DataConfig())
    validate_data_config(DataConfig(source="jsonl", train_path=str(files / "train.jsonl")))
    validate_data_config(DataConfig(source="parquet", train_path=str(files / "train.parquet"), num_epochs=3))
    validate_data_config(DataConfig(source="parquet", train_path=str(files / "train.parq*")))
    validate_data_config(DataConfig(source="parquet", train_path=str(files)))


def test_schema_composes_with_omegaconf():
    """The dataclass works as a Hydra structured config (types enforced on merge)."""
    base = OmegaConf.structured(DataConfig)
    merged = OmegaConf.merge(base, {"packing": False, "generated": {"ops": ["*"], "n_train": 50}})
    cfg = OmegaConf.to_object(merged)
    assert cfg.packing is False and cfg.generated.ops == ["*"] and cfg.generated.n_train == 50
    with pytest.raises(ValidationError):
        OmegaConf.merge(base, {"num_workers": "many"})
