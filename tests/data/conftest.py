"""Shared fixtures for the data tests: one embedded tokenizer and small generated configs."""

import pytest

from ptrain.config.data import DataConfig, GeneratedTaskConfig
from ptrain.data import build_tokenizer
from ptrain.data.tokenizer import save_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(tokenizer, str(d))
    return str(d)


def small_cfg(**kw) -> DataConfig:
    """A generated config small enough for tests (hundreds of rows)."""
    gen = kw.pop("generated", GeneratedTaskConfig(n_train=120, n_eval=24))
    return DataConfig(generated=gen, **kw)


@pytest.fixture(scope="session")
def make_cfg():
    return small_cfg
