"""The real CLI on a tiny config: run, skip finished stages, resume after SIGKILL, sweep, errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

TINY = [
    "recipe=sft_arithmetic",
    "model.d_model=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=32",
    "model.d_ff=128",
    "model.max_seq_len=256",
    "data.generated.n_train=300",
    "data.generated.n_eval=16",
    "train.global_batch_size=8",
    "train.seq_len=64",
    "train.eval_batches=1",
    "train.eval_generate=0",
    "logging.console=false",
    "logging.tensorboard=false",
]


def cli(*args, timeout=600, check=True):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and out.returncode != 0:
        raise AssertionError(
            f"ptrain {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


def train_losses(stage_dir):
    losses = {}
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "train/loss" in rec:
                losses[rec["step"]] = rec["train/loss"]
    return [losses[k] for k in sorted(losses)]


@pytest.mark.slow
def test_run_export_skip_and_kill_resume(tmp_path):
    """One uninterrupted run; one killed with SIGKILL mid-stage and re-launched: same losses."""
    steps = ["train.steps=8", "checkpoint.every_steps=2", "train.eval_every=0"]
    ref_dir = tmp_path / "ref"
    cli(*TINY, *steps, f"run_dir={ref_dir}")
    stage = ref_dir / "stages" / "sft"
    assert (stage / "DONE.json").is_file() and (stage / "export" / "config.json").is_file()
    assert (ref_dir / "data" / "train.jsonl").is_file()  # the generated data are there to read
    ref = train_losses(stage)
    assert len(ref) == 8 and ref[-1] < ref[0]
    meta = json.loads((stage / "checkpoints" / "8" / "meta" / "metadata").read_text())
    assert meta["step"] == 8 and meta["config"]["train"]["steps"] == 8  # the resolved config travels along

    # the export loads back as a model
    from ptrain.models import load_hf

    assert load_hf(str(stage / "export")).cfg.d_model == 64

    # re-launch: the finished stage is skipped
    again = cli(*TINY, *steps, f"run_dir={ref_dir}")
    assert "already finished" in again.stdout

    # a damaged stage marker: one message with the fix, no traceback
    done = (stage / "DONE.json").read_text()
    (stage / "DONE.json").write_text(done[:10])
    broken = cli(*TINY, *steps, f"run_dir={ref_dir}", check=False)
    assert broken.returncode == 1 and "ptrain: error: " in broken.stderr and "delete it and re-launch" in broken.stderr
    assert "Traceback" not in broken.stderr
    (stage / "DONE.json").write_text(done)

    # kill at an arbitrary point after the first checkpoint, then re-launch the same command
    run_dir = tmp_path / "killed"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ptrain", *TINY, *steps, f"run_dir={run_dir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    metrics = run_dir / "stages" / "sft" / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(train_losses(metrics.parent)) >= 5:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "stages" / "sft" / "DONE.json").exists(), "the run finished before it could be killed"
    out = cli(*TINY, *steps, f"run_dir={run_dir}")
    assert "resumed from checkpoint" in out.stdout
    resumed = train_losses(run_dir / "stages" / "sft")
    assert len(resumed) == 8
    assert resumed == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
def test_sweep_runs_every_job_in_its_own_folder(tmp_path):
    """Each job gets its folder; a job with a bad value fails alone (the others still run),
    the summary shows its error and the sweep exits non-zero."""
    out = cli(
        "-m",
        *TINY,
        "train.steps=2",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        f"hydra.sweep.dir={tmp_path}",
        "optim.lr=1e-3,-1,3e-3",
        check=False,
    )
    assert "Sweep summary (3 jobs" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.returncode == 1 and "1 of 3 sweep jobs failed" in out.stderr
    assert re.search(r"optim.lr=-1  ->  \{\"error\": \"ptrain: config error: .*'optim.lr': must be > 0", out.stdout)
    for job in ("job0", "job2"):
        assert (tmp_path / job / "stages" / "sft" / "DONE.json").is_file()
    lrs = {json.loads((tmp_path / j / "stages" / "sft" / "DONE.json").read_text())["lr"] for j in ("job0", "job2")}
    assert len(lrs) == 2


@pytest.mark.slow
def test_seed_sweep_gives_different_runs_and_a_repeated_seed_the_same_run(tmp_path):
    """`-m seed=1,2,1`: the top-level seed reaches the model's init, the data and the task
    (every component seed derives from it), so seeds 1 and 2 train differently and the
    two seed-1 jobs are bit-identical; each job's config.yaml holds the concrete seeds."""
    from ptrain.config.seeds import derive_seed

    cli(
        "-m",
        *TINY,
        "train.steps=3",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        f"hydra.sweep.dir={tmp_path}",
        "seed=1,2,1",
    )
    losses = [train_losses(tmp_path / f"job{i}" / "stages" / "sft") for i in range(3)]
    assert len(losses[0]) == 3
    assert losses[0] == losses[2], "the same seed twice must give the same run"
    assert all(a != b for a, b in zip(losses[0], losses[1])), "two seeds must give different runs"
    saved = (tmp_path / "job1" / "config.yaml").read_text()
    assert "seed: 2\n" in saved and f"seed: {derive_seed(2, 'model.seed')}" in saved


def test_a_later_stage_that_does_not_fit_the_mesh_stops_the_run_before_any_training(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    stages = "stages=[{name: a, kind: sft}, {name: b, kind: sft, train: {global_batch_size: 9}}]"
    out = cli(*TINY, stages, f"run_dir={tmp_path}", check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "stage 'b'" in out.stderr and "train.global_batch_size" in out.stderr
    assert not (tmp_path / "stages" / "a" / "DONE.json").exists()


def test_cfg_job_prints_the_resolved_config():
    out = cli("recipe=sft_arithmetic", "optim.lr=0.0042", "--cfg", "job")
    assert "lr: 0.0042" in out.stdout and "stages:" in out.stdout


def test_help_lists_groups():
    out = cli("--help")
    for group in ("model", "data", "optim", "mesh", "recipe"):
        assert group in out.stdout


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=-3", "optim.lr"),
        ("data.source=jsonl", "data.train_path"),
        ("stages=[{name: x, kind: rlhf}]", "stages[0].kind"),
    ],
)
def test_bad_values_fail_fast_naming_the_key(override, key, tmp_path):
    t0 = time.time()
    out = cli("recipe=sft_arithmetic", override, f"run_dir={tmp_path}", check=False)
    assert out.returncode == 2
    assert key in out.stderr, out.stderr
    assert time.time() - t0 < 60


def test_unknown_key_fails_naming_it(tmp_path):
    out = cli("recipe=sft_arithmetic", "optim.learnig_rate=1", f"run_dir={tmp_path}", check=False)
    assert out.returncode != 0 and "learnig_rate" in out.stderr


def test_a_worker_url_without_list_brackets_shows_the_bracketed_form(tmp_path):
    """Hydra alone would refuse it with "str is not a ListConfig, list or tuple"."""
    out = cli("recipe=sft_grpo_arithmetic", "rollout=sglang", "rollout.urls=http://10.0.0.1:30000",
              f"run_dir={tmp_path}", check=False)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "ptrain: config error: config key 'rollout.urls': must be a list, got the single value "
        "'http://10.0.0.1:30000'; pass \"rollout.urls=[http://10.0.0.1:30000]\" (in quotes, so the shell "
        "leaves the brackets alone)"
    ), out.stderr


@pytest.mark.slow
def test_sft_then_dpo_pipeline_hands_the_export_on(tmp_path):
    tiny = [a for a in TINY if not a.startswith("recipe=")]
    cli(
        "recipe=sft_dpo_arithmetic",
        *tiny,
        "train.steps=3",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        "algo.dpo.precompute_reference=true",
        "algo.dpo.policy_pairs=0",  # the data's own (scripted) pairs
        "stages.0.train.steps=3",
        "stages.0.train.eval_every=0",
        "stages.1.data.generated.n_train=64",
        "++stages.1.data.generated.n_eval=16",
        "stages.1.train.steps=2",
        "stages.1.train.global_batch_size=4",
        "stages.1.train.eval_every=2",
        f"run_dir={tmp_path}",
    )
    sft = json.loads((tmp_path / "stages" / "sft" / "DONE.json").read_text())
    dpo = json.loads((tmp_path / "stages" / "dpo" / "DONE.json").read_text())
    assert sft["steps"] == 3 and dpo["steps"] == 2
    assert 0.0 <= dpo["eval/preference_accuracy"] <= 1.0 and "rewards_chosen" in dpo
    assert (tmp_path / "data" / "preference_train.jsonl").is_file()
    cfg = (tmp_path / "stages" / "dpo" / "config.yaml").read_text()
    assert "format: preference" in cfg
    # any Hugging Face folder can start a run: here the DPO export, tokenizer included
    tiny_data = [a for a in tiny if not a.startswith("model.")]
    out = cli(
        "recipe=sft_arithmetic",
        *tiny_data,
        "model=hf",
        f"model.hf_path={tmp_path / 'stages' / 'dpo' / 'export'}",
        "train.steps=1",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        f"run_dir={tmp_path / 'from_hf'}",
    )
    assert "from " + str(tmp_path / "stages" / "dpo" / "export") in out.stdout
    assert (tmp_path / "from_hf" / "stages" / "sft" / "DONE.json").is_file()
    assert not (tmp_path / "from_hf" / "base_model").exists()


@pytest.mark.slow
def test_dpo_on_policy_pairs_samples_grades_and_trains(tmp_path):
    tiny = [a for a in TINY if not a.startswith("recipe=")]
    cli(
        "recipe=sft_dpo_arithmetic",
        *tiny,
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        "stages.0.train.steps=2",
        "stages.0.train.eval_every=0",
        # sampled at temperature 1: a 2-step model's greedy answer is often empty (no pair)
        "algo.dpo.policy_pairs=8",
        "algo.dpo.policy_samples=2",
        "algo.dpo.policy_temperature=1.0",
        "algo.dpo.policy_step_level=false",
        "algo.dpo.policy_max_new_tokens=16",
        "stages.1.data.generated.n_train=64",
        "++stages.1.data.generated.n_eval=16",
        "stages.1.train.steps=2",
        "stages.1.train.global_batch_size=4",
        "stages.1.train.eval_every=0",
        f"run_dir={tmp_path}",
    )
    stage = tmp_path / "stages" / "dpo"
    meta = json.loads((stage / "policy_pairs.json").read_text())
    assert meta["settings"]["prompts"] == 8 and meta["counts"]["prompts"] == 8
    rows = [json.loads(line) for line in (stage / "policy_pairs.jsonl").read_text().splitlines()]
    assert len(rows) == meta["counts"]["pairs"] >= 1
    assert all(r["chosen"][0]["content"] != r["rejected"][0]["content"] and "answer" in r["task"] for r in rows)
    assert json.loads((stage / "DONE.json").read_text())["steps"] == 2


def test_cfg_job_prints_a_scale_merged_and_a_published_launch_names_what_to_pass():
    out = cli("recipe=nemotron_like", "scale=published", "algo.grpo.group_size=8", "--cfg", "job")
    cfg = yaml.safe_load(out.stdout)
    assert cfg["algo"]["grpo"]["prompts_per_step"] == 128 and cfg["algo"]["grpo"]["group_size"] == 8
    assert cfg["model"]["hf_path"] == "???" and cfg["envs"]["math"]["kind"] == "nemo_gym"
    assert cfg["scales"] == {"published": {}}
    smoke = yaml.safe_load(cli("recipe=nemotron_like", "scale=smoke", "--cfg", "job").stdout)
    assert smoke["model"]["n_layers"] == 2
    start = time.time()
    launch = cli("recipe=nemotron_like", "scale=published", check=False)
    assert launch.returncode == 2 and time.time() - start < 60
    assert "model.hf_path=..." in launch.stderr and "+envs.math.options.url=..." in launch.stderr


@pytest.mark.slow
def test_optuna_search_returns_the_recipes_declared_objective_from_each_trial(tmp_path):
    """`hydra/sweeper=optuna` over a recipe that declares `objective`: each trial runs the
    recipe with the sampled value and returns that metric of its last stage; the sweeper's
    optimization_results.yaml and ptrain's sweep_summary.jsonl agree with the jobs' files."""
    import yaml

    cli(
        "-m", "recipe=countdown_zero", "scale=smoke", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize",
        "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0", "algo.grpo.clip_high=interval(0.2,0.3)",
        "logging.console=false", "logging.tensorboard=false", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "sweep_summary.jsonl").read_text().splitlines()]
    assert [r["job"] for r in rows] == [0, 1]
    for row in rows:
        job = tmp_path / f"job{row['job']}"
        last = json.loads((job / "stages" / "eval" / "metrics.jsonl").read_text().splitlines()[-1])
        assert row["result"] == last["eval/countdown/sampled/accuracy"]
        sampled = next(float(o.split("=")[1]) for o in row["overrides"] if o.startswith("algo.grpo.clip_high="))
        assert 0.2 <= sampled <= 0.3 and f"clip_high: {sampled}" in (job / "config.yaml").read_text()
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(r["result"] for r in rows)


@pytest.mark.slow
def test_optuna_search_without_a_usable_objective_stops_at_the_first_trial(tmp_path):
    search = ["-m", "recipe=sft_arithmetic", "scale=smoke", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
              "optim.lr=interval(1e-4,1e-3)", "logging.console=false", "logging.tensorboard=false"]  # fmt: skip
    out = cli(*search, f"hydra.sweep.dir={tmp_path / 'none'}", check=False)
    assert out.returncode == 2 and "config key 'objective': recipe 'sft_arithmetic' declares none" in out.stderr
    assert not (tmp_path / "none" / "job0" / "stages").exists() and not (tmp_path / "none" / "job1").exists()
    wrong = ["objective=eval/nope", "hydra.sweeper.direction=minimize", f"hydra.sweep.dir={tmp_path / 'wrong'}"]
    out = cli(*search, *wrong, check=False)
    assert out.returncode == 2 and "'eval/nope' is not a final metric of the last stage 'sft'" in out.stderr
    assert "pass one of " in out.stderr and "eval/loss" in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "wrong" / "job0" / "stages" / "sft" / "DONE.json").is_file()
    assert not (tmp_path / "wrong" / "job1").exists()
    # a declared objective, but no direction: optuna would minimise an accuracy
    out = cli(*search[:1], "recipe=countdown_zero", *search[2:], f"hydra.sweep.dir={tmp_path / 'nodir'}", check=False)
    assert out.returncode == 2 and "without a direction" in out.stderr and "direction=maximize" in out.stderr
    assert not (tmp_path / "nodir" / "job0" / "stages").exists()
    # an environment the last stage does not evaluate: refused before the first trial trains
    misspelt = ["objective=eval/countdwn/sampled/accuracy", "hydra.sweeper.direction=maximize",
                f"hydra.sweep.dir={tmp_path / 'env'}"]  # fmt: skip
    out = cli(*search[:1], "recipe=countdown_zero", *search[2:], *misspelt, check=False)
    assert out.returncode == 2 and "names environment 'countdwn', which the last stage 'eval'" in out.stderr
    assert "['countdown']" in out.stderr and not (tmp_path / "env" / "job0" / "stages").exists()


@pytest.mark.slow
def test_a_search_whose_trials_fail_says_why_without_a_traceback(tmp_path):
    """A trial whose sampled settings are not a valid config stops the search at once (the
    space must be narrowed); a trial that fails while training is a failed trial, and when
    every trial failed the search ends with the reasons instead of optuna's "No trials are
    completed yet" traceback."""
    search = ["-m", "recipe=sft_arithmetic", "scale=smoke", "objective=eval/loss", "hydra/sweeper=optuna",
              "hydra.sweeper.direction=minimize", "logging.console=false", "logging.tensorboard=false"]  # fmt: skip
    out = cli(*search, "hydra.sweeper.n_trials=2", "optim.lr=choice(-1.0,-2.0)",
              f"hydra.sweep.dir={tmp_path / 'invalid'}", check=False)  # fmt: skip
    assert out.returncode == 2 and "config key 'optim.lr': must be > 0" in out.stderr, out.stderr[-2000:]
    assert "narrow the space" in out.stderr and "Traceback" not in out.stderr
    out = cli(*search, "hydra.sweeper.n_trials=1", "optim.lr=1e30", f"hydra.sweep.dir={tmp_path / 'nan'}", check=False)
    assert out.returncode == 1 and "loss is nan at step" in out.stdout + out.stderr
    assert "every one of the search's 1 trials failed" in out.stderr and "Traceback" not in out.stderr, out.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "nan" / "sweep_summary.jsonl").read_text().splitlines()]
    assert "loss is nan" in row["result"]["error"]
    # past failed trials with max_failure_rate=1.0: the search ends, best trial found, and the failure listed
    out = cli(*search, "hydra.sweeper.n_trials=2", "hydra.sweeper.max_failure_rate=1.0",
              "hydra.sweeper.sampler.seed=0", "optim.lr=choice(1e30,1e-3)", f"hydra.sweep.dir={tmp_path / 'some'}",
              check=False)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "some" / "sweep_summary.jsonl").read_text().splitlines()]
    assert sorted("error" in str(r["result"]) for r in rows) == [False, True], rows
    assert out.returncode == 1 and "1 of 2 sweep jobs failed" in out.stderr, out.stderr[-2000:]
    assert "optim.lr: 0.001" in (tmp_path / "some" / "optimization_results.yaml").read_text()


def test_a_search_stops_at_its_first_failed_trial_as_optuna_does_and_says_so(tmp_path, capsys):
    """Under optuna's default max_failure_rate (0) the sweeper re-raises a failed trial's error
    through a traceback; the sweep callback ends the search first, with the table and the fix."""
    from omegaconf import OmegaConf

    from ptrain.cli import SweepSummary, TrialFailed

    class Job:
        def __init__(self, value, hydra_cfg):
            self.overrides, self._value, self.hydra_cfg = ["optim.lr=1"], value, hydra_cfg

        @property
        def return_value(self):
            if isinstance(self._value, Exception):
                raise self._value
            return self._value

    def hydra_cfg(**sweeper):
        return OmegaConf.create({"hydra": {"sweeper": {"n_trials": 3, **sweeper}, "sweep": {"dir": str(tmp_path)},
                                           "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher."
                                                                    "BasicLauncher"}}})  # fmt: skip

    summary = SweepSummary()
    summary.on_job_end(None, Job(0.5, hydra_cfg(max_failure_rate=0.0)))  # a good trial: nothing happens
    with pytest.raises(SystemExit):
        summary.on_job_end(None, Job(TrialFailed("ptrain: error: loss is nan"), hydra_cfg(max_failure_rate=0.0)))
    err = capsys.readouterr().err
    assert "optuna stops a search at its first failed trial" in err and "max_failure_rate=1.0" in err
    tolerant = SweepSummary()
    tolerant.on_job_end(None, Job(TrialFailed("ptrain: error: x"), hydra_cfg(max_failure_rate=1.0)))  # goes on
    assert len(tolerant.jobs) == 1
