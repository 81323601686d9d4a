"""Model folders for the server tests: a tiny Qwen3 saved in Hugging Face format with the
embedded tokenizer (as the embedded recipes build theirs), a second one of the same shapes
with other weights, and one whose shapes differ (a weight update must refuse it)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.data.tokenizer import get_tokenizer
from ptrain.models import Decoder, save_hf

TINY = ModelConfig(
    family="qwen3",
    vocab_size=0,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    d_ff=128,
    max_seq_len=256,
)
CONTEXT = 128
MAX_RUNNING = 8

# A Qwen 2.5-style template that lists tools and writes calls as <tool_call>{json}</tool_call>;
# ours, for the tests (the embedded ChatML template has no tools).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool.function.name }} {% endfor %}</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- for call in message.get('tool_calls') or [] %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
    "{%- endfor %}{{ message['content'] or '' }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    return get_tokenizer(None, str(tmp_path_factory.mktemp("tokenizer")), vocab_size=300)


def _save(path: str, tokenizer, seed: int, **changes) -> str:
    cfg = dataclasses.replace(TINY, vocab_size=len(tokenizer), **changes)
    save_hf(Decoder(cfg, rngs=nnx.Rngs(seed)), path, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory, tiny_tokenizer) -> str:
    """The model the servers start with."""
    return _save(str(tmp_path_factory.mktemp("served") / "model"), tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory, tiny_tokenizer) -> str:
    """Same architecture, other weights: a good /update_weights_from_disk folder."""
    return _save(str(tmp_path_factory.mktemp("other") / "model"), tiny_tokenizer, seed=1)


@pytest.fixture(scope="session")
def bad_weights_dir(tmp_path_factory, tiny_tokenizer) -> str:
    """Other MLP width: every MLP tensor's shape differs from the served model's."""
    return _save(str(tmp_path_factory.mktemp("bad") / "model"), tiny_tokenizer, seed=2, d_ff=96)


@pytest.fixture(scope="session")
def tool_template_file(tmp_path_factory) -> str:
    path = os.path.join(str(tmp_path_factory.mktemp("template")), "tools.jinja")
    with open(path, "w") as f:
        f.write(TOOL_TEMPLATE)
    return path


# The in-process server of the route tests (test_server, test_serve_scoring, test_vllm_generate):
# one engine per module, so each module's compiles are shared by its tests. Modules with an
# engine or tokenizer of their own define fixtures of these names, which take precedence.


@pytest.fixture(scope="module")
def engine(served_model_dir):
    from ptrain.rollout.local import LocalEngine

    eng = LocalEngine.from_hf(served_model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(served_model_dir):
    from ptrain.data.tokenizer import load_tokenizer

    return load_tokenizer(served_model_dir)


@pytest.fixture(scope="module")
def client(engine, tokenizer, served_model_dir):
    from starlette.testclient import TestClient

    from ptrain.serve.server import make_app

    with TestClient(make_app(engine, tokenizer, served_model_name="tiny", model_path=served_model_dir)) as c:
        yield c
