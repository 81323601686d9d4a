"""verifiers 0.4 tasksets with ptrain (ptrain/envs/verifiers_env.py, ptrain/serve/vllm_api.py), on a
taskset of our own (tests/envs/vf_tasksets/ptrain_reverse_local.py, no downloads):

- the `verifiers` env kind: config errors, and episodes whose tokens and log-probs are the
  engine's own for the same seed, with the taskset's reward components;
- `vf-eval` against a `python -m ptrain.serve` process, eval mode (chat completions) and train
  mode (vLLM's /inference/v1/generate), as a user runs it;
- a short GRPO stage on the taskset.

Skipped without verifiers (pip install ".[verifiers]"). verifiers' null harness runs its chat
program with `uv`, which fetches the program's packages from PyPI once (cached in ~/.cache/uv)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verifiers.v1")

from ptrain.config.env import EnvConfig, validate_env_config  # noqa: E402
from ptrain.config.env_options import EnvConfigError  # noqa: E402
from ptrain.envs.registry import make_env  # noqa: E402
from ptrain.envs.verifiers_env import sample_seed  # noqa: E402
from ptrain.rollout.local import LocalEngine  # noqa: E402
from ptrain.rollout.protocol import GenerateRequest, SamplingParams  # noqa: E402
from ptrain.serve.server import load_tokenizer  # noqa: E402
from tests.rollout.conftest import CONTEXT, MAX_RUNNING, served_model_dir, tiny_tokenizer  # noqa: E402, F401

TASKSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vf_tasksets")
TASKSET = "ptrain-reverse-local"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def options(**kw):
    return {"taskset": TASKSET, "taskset_path": TASKSETS, **kw}


@pytest.mark.parametrize(
    "opts, key, words",
    [
        ({}, "options.taskset", "required"),
        ({"taskset": TASKSET, "taskset_path": "/no/such/folder"}, "options.taskset_path", "not a folder"),
        (options(episode_timeout_s=0), "options.episode_timeout_s", "(0,"),
        (options(taskset_args={"id": "x"}), "options.taskset_args.id", "options.taskset"),
        (options(renderer="qwen3"), "options.renderer", "mapping"),
    ],
)
def test_bad_options_name_the_key_and_the_fix(opts, key, words):
    with pytest.raises(EnvConfigError) as e:
        validate_env_config(EnvConfig(kind="verifiers", options=opts))
    assert key in str(e.value) and words in str(e.value), str(e.value)


def test_an_unknown_taskset_says_what_to_install(tiny_tokenizer):  # noqa: F811
    with pytest.raises(ValueError) as e:
        make_env(EnvConfig(kind="verifiers", options={"taskset": "no-such-taskset-here"}), tokenizer=tiny_tokenizer)
    assert "no-such-taskset-here" in str(e.value) and "install" in str(e.value)


@pytest.fixture(scope="module")
def engine(served_model_dir):  # noqa: F811
    eng = LocalEngine.from_hf(served_model_dir, max_running_requests=MAX_RUNNING, context_length=CONTEXT)
    yield eng
    eng.close()


def test_episodes_are_the_engines_tokens_and_logprobs_with_the_tasksets_rewards(engine, served_model_dir):  # noqa: F811
    env = make_env(
        EnvConfig(kind="verifiers", n_train=4, n_eval=2, options=options()), tokenizer=load_tokenizer(served_model_dir)
    )
    try:
        train, held = env.tasks("train", seed=0), env.tasks("eval", seed=0)
        assert len(train) == 4 and len(held) == 2
        assert held[0].messages == ({"role": "user", "content": "Reverse the word: apple"},)
        assert train[0].messages[-1]["content"] == "Reverse the word: stone"
        sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, sampling_seed=11)
        trajectories = asyncio.run(env.rollout(train[0], engine, sampling))
    finally:
        env.close()
    assert [t.sample_index for t in trajectories] == [0, 1, 2]
    outputs = []
    for t in trajectories:
        assert t.reward_error is None and not t.masked, t.reward_error
        assert set(t.reward_components) == {"lcs", "short"}
        assert t.reward == pytest.approx(sum(t.reward_components.values()))
        assert 0 <= t.reward_components["short"] <= 0.5 and 0 <= t.reward_components["lcs"] <= 1
        p = t.prompt_length
        assert set(t.loss_mask[:p]) == {0} and sum(t.loss_mask) == len(t.token_ids) - p > 0
        request = GenerateRequest(
            t.token_ids[:p],
            SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=sample_seed(11, t.sample_index)),
        )
        (want,) = engine.generate_many([request])[0]
        k = len(t.token_ids) - p  # the renderer's stop tokens may have ended it sooner
        assert list(t.token_ids[p:]) == list(want.output_ids[:k])
        assert list(t.logprobs[p:]) == pytest.approx(list(want.logprobs[:k]), abs=1e-5)
        assert all(x == 0.0 for x in t.logprobs[:p])
        outputs.append(t.token_ids[p:])
    assert len(set(outputs)) > 1  # each sample has its own seed


def vf_eval(cwd, url, *extra):
    exe = os.path.join(BIN, "vf-eval")
    if not os.path.exists(exe):
        pytest.skip("vf-eval is not installed")
    env = dict(
        os.environ, OPENAI_API_KEY="unused", PYTHONPATH=TASKSETS, PATH=BIN + os.pathsep + os.environ.get("PATH", "")
    )
    cmd = [
        exe, TASKSET, "--model", "tiny", "--client.base-url", url + "/v1", "--client.api-key-var", "OPENAI_API_KEY",
        "-n", "2", "-r", "2", "--sampling.max-tokens", "8", "--sampling.temperature", "1.0", "--no-rich", "--no-push",
        "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess", *extra,
    ]  # fmt: skip
    os.makedirs(cwd, exist_ok=True)
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = glob.glob(os.path.join(cwd, "outputs", "*", "traces.jsonl"))
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_vf_eval_in_eval_and_train_mode_against_a_server_process(served_model_dir, tmp_path, engine):  # noqa: F811
    from tests.rollout.test_serve_process import start_server

    srv = start_server(served_model_dir, str(tmp_path / "server.log"))
    try:
        episodes = vf_eval(str(tmp_path / "eval"), srv.url)
        assert len(episodes) == 4
        for ep in episodes:
            assert ep["ok"] and not ep["errors"], ep["errors"]
            (trace,) = ep["traces"]
            assert trace["stop_condition"] == "agent_completed"
            assert set(trace["rewards"]) == {"lcs", "short"}

        episodes = vf_eval(
            str(tmp_path / "train"), srv.url, "--client.type", "train", "--client.renderer-model-name",
            served_model_dir, "--sampling.seed", "7",
        )  # fmt: skip
    finally:
        srv.proc.kill()
        srv.proc.wait(30)
    assert len(episodes) == 4
    for ep in episodes:
        assert ep["ok"] and not ep["errors"], ep["errors"]
        (trace,) = ep["traces"]
        nodes = trace["nodes"]
        sampled = [node for node in nodes if node.get("sampled")]
        assert sampled
        for node in sampled:
            ids, mask, logprobs = node["token_ids"], node["mask"], node["logprobs"]
            assert len(ids) == len(mask) and sum(mask) == len(logprobs) > 0
            p = mask.index(True)
            # a node holds its own tokens; the prompt is its ancestors' tokens, then its unsampled head
            prompt, up = list(ids[:p]), node.get("parent")
            while up is not None:
                prompt = nodes[up]["token_ids"] + prompt
                up = nodes[up].get("parent")
            # --sampling.seed 7 reaches the server as the string "7"
            request = GenerateRequest(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=7))
            (want,) = engine.generate_many([request])[0]
            k = len(ids) - p
            assert ids[p:] == list(want.output_ids[:k])
            assert logprobs == pytest.approx(list(want.logprobs[:k]), abs=1e-3)  # traces keep 4 decimals


@pytest.mark.slow
def test_a_grpo_stage_trains_on_the_taskset(tmp_path):
    overrides = [
        "stages=[{name: grpo, kind: grpo}]", "env=verifiers", f"envs.verifiers.options.taskset={TASKSET}",
        f"envs.verifiers.options.taskset_path={TASKSETS}", "envs.verifiers.n_train=6", "model.d_model=64",
        "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=32", "model.d_ff=128",
        "model.max_seq_len=256", "data.tokenizer_vocab_size=300", "train.seq_len=64", "train.eval_every=0",
        "train.steps=2", "algo.grpo.prompts_per_step=2", "algo.grpo.group_size=2", "algo.grpo.max_new_tokens=8",
        "rollout.max_running_requests=8", "checkpoint.async_save=false", "logging.console=false",
        "logging.tensorboard=false", f"run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run(
        [sys.executable, "-m", "ptrain", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    stage = tmp_path / "run" / "stages" / "grpo"
    with open(stage / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert abs(r["train/mismatch_kl"]) < 1e-4  # the episodes' log-probs are the trainer's
        assert "train/reward/verifiers/lcs" in r and "train/reward/verifiers/short" in r, sorted(r)
    with open(stage / "audit.jsonl") as f:
        audit = [a for a in map(json.loads, f) if a.get("env") == "verifiers"]
    assert len(audit) == 2 * 2 * 2  # steps x prompts x group
    assert all(a["weight_versions"] and a["tokens"]["output"] > 0 for a in audit)
    assert all(a["reward_error"] is None and set(a["reward_components"]) == {"lcs", "short"} for a in audit)


def test_a_two_turn_taskset_whose_turns_do_not_bridge_is_kept_out_of_training(engine, served_model_dir):  # noqa: F811
    """The scripted follow-up re-renders turn 1; a turn-1 reply cut at max_tokens (the tiny
    model rarely stops by itself) renders differently from the sampled ids, so verifiers splits
    the episode into two token sequences: the episode is masked, and its last sequence's
    turn-2 tokens are still the engine's own."""
    env = make_env(
        EnvConfig(kind="verifiers", n_train=2, n_eval=0, options=options(taskset="ptrain-two-turn-local")),
        tokenizer=load_tokenizer(served_model_dir),
    )
    try:
        (task, _) = env.tasks("train", seed=0)
        sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, sampling_seed=3)
        trajectories = asyncio.run(env.rollout(task, engine, sampling))
    finally:
        env.close()
    for t in trajectories:
        assert t.metrics["turns"] == 2
        if t.metrics["branches"] == 1:  # turn 1 ended in a stop token: one sequence, two sampled spans
            assert not t.masked and t.reward_error is None
            continue
        assert t.masked and t.failure_kind == "branched" and "split into 2" in t.reward_error
        mask = list(t.loss_mask)
        start = len(mask) - mask[::-1].index(0)  # the last sampled span (turn 2)
        request = GenerateRequest(
            t.token_ids[:start],
            SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=sample_seed(3, t.sample_index)),
        )
        (want,) = engine.generate_many([request])[0]
        k = len(mask) - start
        assert 0 < k and list(t.token_ids[start:]) == list(want.output_ids[:k])
        assert list(t.logprobs[start:]) == pytest.approx(list(want.logprobs[:k]), abs=1e-5)
