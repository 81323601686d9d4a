"""tinker-cookbook's own trainers against `python -m ptrain.tinker`, started as a user starts it.

The supervised trainer (`tinker_cookbook.supervised.train`, through tools/cookbook_sl.py) on
the cookbook's example conversations, and the RL recipe `tinker_cookbook.recipes.math_rl.train`
on its arithmetic environment, run from its own command line, changed in nothing but
`base_url` and a model name that is the served folder (the cookbook loads its tokenizer from
there; the hub is switched off). The RL run starts from a short supervised run on arithmetic
conversations in the environment's own few-shot format: from random weights no sample ends
with the stop sequence, every group's rewards are equal and nothing can be learned.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "tml-cookbook-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": ROOT}  # fmt: skip


@pytest.fixture(scope="module")
def server(tinker_model_dir, tmp_path_factory):
    port = free_port()
    root = str(tmp_path_factory.mktemp("tinker_runs"))
    cmd = [sys.executable, "-m", "ptrain.tinker", "--model-path", tinker_model_dir, "--port", str(port),
           "--root-dir", root]  # fmt: skip
    log_path = os.path.join(root, "server.log")
    log = open(log_path, "w")  # a file, not a pipe: the server logs every request and must never block on it
    proc = subprocess.Popen(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while "base_url=" not in open(log_path).read():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("ptrain.tinker did not start:\n" + open(log_path).read()[-3000:])
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def run(cmd: list[str], log_path: str) -> list[dict]:
    out = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def supervised(server: str, model: str, log_path: str, *args: str) -> list[dict]:
    cmd = [sys.executable, "tools/cookbook_sl.py", "--base-url", server, "--model-name", model,
           "--log-path", log_path, *args]  # fmt: skip
    return run(cmd, log_path)


def test_the_cookbooks_supervised_trainer_lowers_the_nll(server, tinker_model_dir, tmp_path):
    rows = supervised(server, tinker_model_dir, str(tmp_path / "sl"), "--epochs", "2", "--learning-rate", "2e-3")
    nll = [r["train_mean_nll"] for r in rows]
    assert len(nll) == 8  # 128 conversations, 32 a batch, two epochs
    assert np.mean(nll[4:]) < np.mean(nll[:4]) - 0.2, nll


def test_the_cookbooks_rl_recipe_raises_the_reward(server, tinker_model_dir, tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "arithmetic.jsonl"
    with open(path, "w") as f:
        for _ in range(4096):
            x, y = (int(v) for v in rng.integers(0, 101, 2))
            messages = [("user", "What is 4 + 5?"), ("assistant", "9"), ("user", f"What is {x} + {y}?"),
                        ("assistant", str(x + y))]  # fmt: skip
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]}) + "\n")
    sl = str(tmp_path / "warm")
    supervised(server, tinker_model_dir, sl, "--file", str(path), "--batch-size", "64", "--learning-rate", "3e-3",
               "--steps", "60")  # fmt: skip
    with open(os.path.join(sl, "checkpoints.jsonl")) as f:
        warm = [json.loads(line) for line in f][-1]["state_path"]
    assert warm.startswith("tinker://")

    log = str(tmp_path / "rl")
    cmd = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={server}",
           f"model_name={tinker_model_dir}", "renderer_name=role_colon", "env=arithmetic", "groups_per_batch=16",
           "group_size=8", "max_tokens=12", "lora_rank=8", "learning_rate=1e-3", "max_steps=20",
           f"load_checkpoint_path={warm}", f"log_path={log}", "behavior_if_log_dir_exists=delete"]  # fmt: skip
    rows = run(cmd, log)
    reward = [r["env/all/reward/total"] for r in rows]
    assert len(reward) == 20
    assert np.mean(reward[-5:]) > np.mean(reward[:5]) + 0.015, reward


def test_a_custom_loss_trains_as_the_same_named_loss_does(server, tinker_model_dir):
    """The SDK's forward_backward_custom (a forward, the loss's gradient in torch on the
    client, then a linear surrogate sent back) moves the weights as the named loss does."""
    import tinker
    import torch

    service = tinker.ServiceClient(base_url=server, api_key=KEY)
    try:
        tokens = [5, 17, 42, 8, 99, 23, 61, 4, 77]
        weights = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
        )

        def nll(data, logprobs_list):
            loss = sum(-(torch.tensor(weights) * lp).sum() for lp in logprobs_list)
            return loss, {"nll": float(loss)}

        named = service.create_lora_training_client(base_model=tinker_model_dir, rank=4, seed=7)
        custom = service.create_lora_training_client(base_model=tinker_model_dir, rank=4, seed=7)
        a = named.forward_backward([datum], "cross_entropy").result()
        b = custom.forward_backward_custom([datum], nll).result()
        np.testing.assert_allclose(b.metrics["nll"], a.metrics["loss:sum"], rtol=1e-5)
        np.testing.assert_allclose(b.metrics["loss:sum"], a.metrics["loss:sum"], rtol=1e-5)
        for client in (named, custom):
            client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        after = [
            c.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data for c in (named, custom)
        ]
        np.testing.assert_allclose(after[0], after[1], atol=1e-5)
        assert not np.allclose(after[0], a.loss_fn_outputs[0]["logprobs"].data, atol=1e-3)
    finally:
        service.close("success").result()  # ends its session and stops its heartbeat thread
