"""The eval stage: a model on environments, per-environment metrics and an audit log, as a
user launches it; a stage after it starts from the weights it evaluated."""

import json
import os
import subprocess
import sys

import pytest

from ptrain.config import RunConfig, StageConfig
from ptrain.pipeline import initial_weights, stage_dir

TINY_MODEL = [
    "model.d_model=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=32",
    "model.d_ff=128",
    "model.max_seq_len=256",
    "data.tokenizer_vocab_size=300",
]


def test_previous_looks_through_eval_stages(tmp_path):
    run = RunConfig(
        run_dir=str(tmp_path),
        stages=[StageConfig(name="sft"), StageConfig(name="check", kind="eval"), StageConfig(name="rl", kind="grpo")],
    )
    sft_export = os.path.join(stage_dir(run, "sft"), "export")
    assert initial_weights(run, 1) == sft_export and initial_weights(run, 2) == sft_export


@pytest.mark.slow
def test_eval_stage_reports_every_environment(tmp_path):
    args = [
        "recipe=eval",
        "env=[countdown,arithmetic]",
        "envs.countdown.n_eval=3",
        "envs.arithmetic.n_eval=3",
        "algo.eval.samples=2",
        "algo.eval.max_new_tokens=8",
        "rollout.max_running_requests=8",
        "logging.console=false",
        f"run_dir={tmp_path}",
        *TINY_MODEL,
    ]
    out = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    done = json.load(open(tmp_path / "stages" / "eval" / "DONE.json"))
    for env in ("countdown", "arithmetic"):
        for key in ("pass@1", "reward", "response_length", "tokens_output", "sampled/pass@1", "sampled/accuracy"):
            assert f"eval/{env}/{key}" in done, (env, key, sorted(done))
    audit = [json.loads(line) for line in open(tmp_path / "stages" / "eval" / "audit.jsonl")]
    assert len(audit) == 2 * 3 * (1 + 2)  # envs x tasks x (greedy + 2 samples)
    assert {r["decoding"] for r in audit} == {"greedy", "sampled"}
    bad = subprocess.run([sys.executable, "-m", "ptrain", "stages=[{name: e, kind: eval}]", f"run_dir={tmp_path}/none"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "env=countdown" in bad.stderr


def test_an_environment_without_held_out_tasks_is_a_config_error(tmp_path):
    """It was skipped: the stage ended done, exit code 0, with no metrics at all (the
    nemo_gym file's n_eval is 0)."""
    args = ["recipe=eval", "env=[countdown,math]", "envs.math.n_eval=0", f"run_dir={tmp_path}", *TINY_MODEL]
    out = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "ptrain: config error: config key 'envs.math.n_eval': eval stage 'eval' samples held-out tasks, and ['math'] "
        "have none (n_eval=0); pass envs.math.n_eval=N, or leave them out of the stage's envs list"
    )
    assert not (tmp_path / "stages" / "eval" / "DONE.json").exists()


def test_an_environment_whose_every_episode_failed_stops_the_eval_stage(capsys):
    """Every prompt refused (longer than rollout.context_length, a dead NeMo Gym server): the
    stage was marked done with zeros, which a relaunch then skipped. The periodic evaluation
    of an RL stage still reports it and goes on."""
    from ptrain.config.env import EnvConfig
    from ptrain.config.grpo import EvalAlgoConfig
    from ptrain.data.tokenizer import build_tokenizer
    from ptrain.envs.registry import make_env
    from ptrain.rollout.replay import ReplayEngine
    from ptrain.stages.env_metrics import evaluate_envs

    tok = build_tokenizer(vocab_size=300)
    env = make_env(EnvConfig(kind="countdown", n_train=1, n_eval=2), tokenizer=tok)
    refusing = ReplayEngine([], tokenizer=tok)  # no completions: every request is refused
    cfg = EvalAlgoConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match=r"every one of the 2 greedy episodes of environment 'countdown' failed, "
                       r"the first with: replay engine: no completion left for rid 'countdown/eval-0'"):  # fmt: skip
        evaluate_envs({"countdown": env}, refusing, cfg, strict=True)
    assert "ptrain: eval:" not in capsys.readouterr().out  # the error says it
    assert evaluate_envs({"countdown": env}, refusing, cfg)["countdown/env_errors"] == 2
    said = capsys.readouterr().out
    assert "ptrain: eval: 2 of 2 greedy episodes of environment 'countdown' failed and count as wrong" in said


def test_an_unreachable_fleet_stops_the_eval_stage_with_its_answers(tmp_path):
    """It was a FleetUnavailable traceback (and the fleet client was never closed)."""
    args = ["recipe=eval", "env=countdown", "rollout=sglang", "rollout.urls=[http://127.0.0.1:1]",
            "rollout.unhealthy_timeout_s=1", "rollout.health_interval_s=0.2", "rollout.connect_timeout_s=0.5",
            f"run_dir={tmp_path}", *TINY_MODEL]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ptrain: stopped: no healthy SGLang worker") and "http://127.0.0.1:1" in last, last
    assert last.endswith("eval stage 'eval' stopped unfinished; once the engine can sample again, re-launch the same "
                         "command")  # fmt: skip
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "stages" / "eval" / "DONE.json").exists()


def test_a_model_folder_without_its_tokenizer_is_a_config_error(tmp_path):
    """The stage tokenized with the embedded tokenizer instead, whose ids are not the model's,
    and reported the zeros as the model's scores."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ["recipe=eval", "env=countdown", "model=hf", f"model.hf_path={model}", f"run_dir={tmp_path}/run"]
    out = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"ptrain: config error: config key 'data.tokenizer_path': the model folder '{model}' has no tokenizer.json; "
        "pass data.tokenizer_path=DIR, a folder with the model's tokenizer.json"
    )


def test_more_samples_than_engine_slots_is_a_config_error(tmp_path):
    """Every sampled request was refused by the engine after the greedy pass had run."""
    args = ["recipe=eval", "env=countdown", "algo.eval.samples=16", "rollout.max_running_requests=8"]
    out = subprocess.run([sys.executable, "-m", "ptrain", *args, f"run_dir={tmp_path}"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "ptrain: config error: config key 'algo.eval.samples': eval stage 'eval' samples 16 at once per task, but the "
        "local engine decodes at most rollout.max_running_requests=8; raise that or lower samples"
    )


def test_the_runs_sandbox_settings_reach_its_environments(tmp_path):
    """`sandbox.*` is the run's sandbox, as the sandbox's own errors advise: a bwrap that does
    not exist is named (the stage used to build a default sandbox whatever was set), and an
    impossible value is a config error before anything loads."""
    args = ["recipe=eval", "env=code", "envs.code.n_eval=2", "sandbox.backend=bwrap",
            f"sandbox.bwrap_path={tmp_path}/no-bwrap", f"run_dir={tmp_path}/run", *TINY_MODEL]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"ptrain: error: sandbox.backend=bwrap: sandbox.bwrap_path='{tmp_path}/no-bwrap' is not" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]

    bad = subprocess.run([sys.executable, "-m", "ptrain", "recipe=eval", "sandbox.backend=docker",
                          f"run_dir={tmp_path}/bad"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("ptrain: config error: config key 'sandbox.backend': ")
