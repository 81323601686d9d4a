"""`python -m ptrain.serve`'s command line: SGLang's flag names, and mistakes that end with
one message before any model loads."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import pytest
from flax import nnx

from ptrain.config.lora import LoRAConfig
from ptrain.data.tokenizer import get_tokenizer
from ptrain.models import Decoder, load_hf
from ptrain.models.lora import LoRASpec, init_adapters
from ptrain.models.peft_io import save_peft
from ptrain.rollout.local import LocalEngine
from ptrain.serve import build_parser
from ptrain.serve.cli import check_args
from ptrain.serve.server import load_startup_adapters
from ptrain.train.state import split_model
from tests.rollout import sglang_schema as schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS_ONLY = {"--max-request-bytes", "--graceful-shutdown-timeout"}


def sglang_flags() -> set[str]:
    """`python -m sglang.launch_server`'s flags: its ServerArgs fields (arg_groups/fields/*.py)
    and the flags server_args.py spells out."""
    fields_dir = schema.sglang_file("srt/arg_groups/fields/model.py").parent
    flags = set()
    for name in os.listdir(fields_dir):
        if name.endswith(".py"):
            for node in ast.walk(ast.parse((fields_dir / name).read_text())):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    flags.add("--" + node.target.id.replace("_", "-"))
    for node in ast.walk(ast.parse(schema.sglang_file("srt/server_args.py").read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
            flags.add(node.value)
    return flags


def serve(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m ptrain.serve ARGV` as a user runs it, to its exit (these all exit at start)."""
    return subprocess.run([sys.executable, "-m", "ptrain.serve", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)  # fmt: skip


def test_flags_are_sglangs_where_sglang_has_them():
    ours = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    required = {"--model-path", "--host", "--port", "--context-length", "--max-running-requests"}
    assert required | {"--served-model-name", "--tp-size"} <= ours
    assert sorted(ours - OURS_ONLY - sglang_flags()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-path", "/no/such/folder"], "no config.json there"),
        (["--model-path", "{model}", "--tp-size", "0"], "--tp-size: must be >= 1"),
        (["--model-path", "{model}", "--chat-template", "/no/such.jinja"], "no such file"),
        (["--model-path", "{model}", "--dtype", "int4"], "invalid choice"),
        (["--port", "30000"], "--model-path"),
        (["--model-path", "{model}", "--port", "70000"], "--port: must be <= 65535"),
        (["--model-path", "{model}", "--random-seed", "-1"], "--random-seed: must be >= 0, got -1"),
        (["--model-path", "{model}", "--context-length", "100000"], "above the model's max_position_embeddings=256"),
        (["--model-path", "{model}", "--port", "{busy}"], "Address already in use); pass another --port"),
        (["--model-path", "{model}", "--host", "no.such.host.invalid"], "--host no.such.host.invalid: not an address"),
        (["--model-path", "{corrupt}"], "config.json is not valid JSON"),
        (["--model-path", "{model}", "--chat-template", "{template}"], "not a valid Jinja template (line 1: "),
    ],
)
def test_command_line_mistakes_exit_2_with_one_message(argv, message, served_model_dir, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "qwen3",')
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    template = tmp_path / "broken.jinja"
    template.write_text("{% for message in %}{{ message.content }}{% endfor %}")
    subs = {"{model}": served_model_dir, "{corrupt}": str(corrupt), "{busy}": str(busy.getsockname()[1]),
            "{template}": str(template)}  # fmt: skip
    argv = [subs.get(a, a) for a in argv]
    out = serve(*argv, timeout=120)
    busy.close()
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_folder_without_tokenizer_says_what_to_pass(tmp_path, served_model_dir):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in os.listdir(served_model_dir):
        if not name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.symlink(os.path.join(served_model_dir, name), folder / name)
    out = serve("--model-path", str(folder))
    assert out.returncode == 1 and "--skip-tokenizer-init" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_corrupt_tokenizer_names_its_folder(tmp_path, served_model_dir):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in os.listdir(served_model_dir):
        if name != "tokenizer.json":
            os.symlink(os.path.join(served_model_dir, name), folder / name)
    (folder / "tokenizer.json").write_text('{"version": "1.0",')
    out = serve("--model-path", str(folder))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"the tokenizer in '{folder}' does not load" in out.stderr, out.stderr


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_start(tmp_path, served_model_dir):
    big = get_tokenizer(None, str(tmp_path / "big"), vocab_size=600)
    out = serve("--model-path", served_model_dir, "--tokenizer-path", str(tmp_path / "big"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"has {len(big)} tokens, but the model in '{served_model_dir}' has a vocabulary of" in out.stderr, out.stderr


FAILING_ENGINE = """
import sys
from ptrain.rollout.local import LocalEngine
from ptrain.serve import main

admit = LocalEngine._admit


def failing_admit(self):
    if self._queue:  # the first request (the warm-up) ends the engine thread
        raise RuntimeError("injected")
    return admit(self)


LocalEngine._admit = failing_admit
sys.exit(main(sys.argv[1:]))
"""


def test_a_server_whose_engine_thread_fails_exits_1_naming_the_failure(served_model_dir):
    out = subprocess.run(
        [sys.executable, "-c", FAILING_ENGINE, "--model-path", served_model_dir, "--port", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "ptrain.serve: error: the engine thread failed: RuntimeError('injected')" in out.stderr, out.stderr[-3000:]


# ---- LoRA flags: resolved as SGLang resolves them, bad combinations end at start ----


def _peft_config(folder, rank: int, targets) -> str:
    """An adapter folder's config (all the flag checks read; the weights load with the model)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)})
    )
    return str(folder)


def _resolve(model_dir: str, *argv: str):
    p = build_parser()
    args = p.parse_args(["--model-path", model_dir, "--port", "0", *argv])
    check_args(p, args)
    return args


def test_lora_flags_resolve_as_sglangs(served_model_dir, tmp_path):
    a = _peft_config(tmp_path / "a", 4, ["q_proj", "v_proj"])
    b = _peft_config(tmp_path / "b", 2, ["model.layers.0.mlp.down_proj"])  # PEFT's dotted names too
    args = _resolve(served_model_dir, "--lora-paths", a, f'{{"lora_name": "b", "lora_path": "{b}", "pinned": true}}')
    assert args.enable_lora and args.max_loras == 8 and args.max_lora_rank == 4
    assert args.lora_targets == ("q_proj", "v_proj", "down_proj")
    assert [(r["lora_name"], r["lora_path"], r["pinned"]) for r in args.lora_refs] == [(a, a, False), ("b", b, True)]
    args = _resolve(served_model_dir, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all-linear")
    assert args.lora_refs == [] and len(args.lora_targets) == 7 and args.max_lora_rank == 8
    args = _resolve(
        served_model_dir, "--lora-paths", f"x={a}", "--lora-target-modules", "qkv_proj", "--max-loras-per-batch", "1"
    )
    assert args.lora_targets == ("q_proj", "k_proj", "v_proj") and args.max_loras == 1
    assert not _resolve(served_model_dir).enable_lora


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--enable-lora"], "needs both --max-lora-rank and --lora-target-modules"),
        (["--max-lora-rank", "8"], "--max-lora-rank: LoRA serving is off; add --enable-lora"),
        (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "lm_head"],
         "--lora-target-modules lm_head: this server applies adapters per request to the attention and MLP"),
        (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"], "'all' must be the only"),
        (["--enable-lora", "--max-lora-rank", "0", "--lora-target-modules", "all"], "--max-lora-rank: must be >= 1"),
        (["--lora-paths", "{a}", "--max-loras-per-batch", "0"], "--max-loras-per-batch: must be >= 1"),
        (["--lora-paths", "/no/such"], "--lora-paths /no/such: /no/such: no adapter_config.json"),
        (["--lora-paths", "x={a}", "x={a}"], "the adapter name(s) ['x'] are given more than once"),
        (["--lora-paths", "x={a}", "y={a}", "--max-loras-per-batch", "1"], "2 adapters, but --max-loras-per-batch is 1"),
        (["--lora-paths", "x={a}", "--max-lora-rank", "2"], "--lora-paths x: the adapter has rank 4, above --max-lora-rank 2"),
        (["--lora-paths", "x={a}", "--lora-target-modules", "q_proj"], "adapts ['v_proj'], not in --lora-target-modules"),
        (["--lora-paths", '{"lora_name": "x"}'], 'a JSON entry needs "lora_name" and "lora_path"'),
        (["--lora-paths", "x={head}"], "the adapters adapt ['lm_head'], which this server cannot apply per request"),
    ],
)  # fmt: skip
def test_lora_flag_mistakes_exit_2_with_one_message(argv, message, served_model_dir, tmp_path, capsys):
    subs = {"{a}": _peft_config(tmp_path / "a", 4, ["q_proj", "v_proj"]),
            "{head}": _peft_config(tmp_path / "head", 4, ["lm_head"])}  # fmt: skip
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
    with pytest.raises(SystemExit) as e:
        _resolve(served_model_dir, *argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_startup_adapter_for_another_model_stops_the_server_naming_it(served_model_dir, tmp_path):
    model = load_hf(served_model_dir)
    other = Decoder(dataclasses.replace(model.cfg, d_model=48), rngs=nnx.Rngs(0))
    spec = LoRASpec.of(LoRAConfig(rank=2, alpha=4.0, targets=["q_proj"]))
    save_peft(init_adapters(split_model(other)[1], spec, jax.random.key(0)), spec, other.cfg, str(tmp_path / "x"))
    engine = LocalEngine(model, max_running_requests=2, context_length=32, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"--lora-paths x: adapter 'x': .*this model needs"):
        load_startup_adapters(engine, [{"lora_name": "x", "lora_path": str(tmp_path / "x")}])
    assert engine._closed
