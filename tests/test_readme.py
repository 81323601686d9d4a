"""The README's Python examples run as written, at smoke scale (a tiny model, a few steps)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = [
    "train.steps=4", "train.eval_every=2", "train.eval_batches=1", "train.eval_generate=4",
    "train.eval_max_new_tokens=8", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
    "model.head_dim=16", "model.d_ff=48", "data.generated.n_train=64", "data.generated.n_eval=8",
    "checkpoint.async_save=false", "logging.console=false", "logging.tensorboard=false",
]  # fmt: skip


def python_blocks(section: str) -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def test_the_python_api_examples_run(tmp_path):
    blocks = python_blocks("Python API")
    assert len(blocks) == 2  # one per level: the run, and the training client
    code = "\n".join(blocks)
    smoke = code.replace('["train.steps=60"]', repr(SMOKE)).replace("range(3)", "range(2)")
    smoke = smoke.replace('"max_new_tokens": 48', '"max_new_tokens": 12')
    assert smoke != code
    p = subprocess.run([sys.executable, "-c", smoke], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert os.path.isfile(tmp_path / "runs" / "api_demo" / "stages" / "sft" / "DONE.json")
    assert os.path.isfile(tmp_path / "runs" / "api_demo" / "rl_export" / "config.json")
    steps = [line.split() for line in p.stdout.splitlines() if re.match(r"^[01] ", line)]
    assert len(steps) == 2 and all(len(s) == 3 for s in steps)
