"""The GRPO stage end to end, as a user runs it (a subprocess per launch): it learns a dense
reward, a kill -9 resumes to the same rewards and losses (sync), and asynchronous mode uses
every sample at most once within its staleness bound, across a kill as well."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "grpo_script.py")
TINY = [
    "stages=[{name: grpo, kind: grpo}]",
    "env=arithmetic",
    "envs.arithmetic.n_train=64",
    "envs.arithmetic.n_eval=8",
    "model.d_model=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=32",
    "model.d_ff=128",
    "model.max_seq_len=256",
    "data.tokenizer_vocab_size=300",
    "train.seq_len=64",
    "train.eval_every=0",
    "train.eval_generate=4",
    "train.eval_max_new_tokens=8",
    "algo.grpo.prompts_per_step=4",
    "algo.grpo.group_size=4",
    "algo.grpo.max_new_tokens=24",
    "optim.lr=3e-3",
    "optim.schedule=constant",
    "rollout.max_running_requests=16",
    "rollout.decode_steps=4",
    "checkpoint.every_steps=2",
    "checkpoint.async_save=false",
    "logging.console=false",
    "logging.tensorboard=false",
]


def launch(run_dir, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, SCRIPT, *TINY, *extra, f"run_dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def run(run_dir, *extra, timeout=900):
    p = launch(run_dir, *extra)
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


def metrics(run_dir):
    steps = {}
    with open(os.path.join(run_dir, "stages", "grpo", "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "train/loss" in rec:
                steps[rec["step"]] = rec
    return [steps[k] for k in sorted(steps)]


def audit(run_dir):
    with open(os.path.join(run_dir, "stages", "grpo", "audit.jsonl")) as f:
        return [json.loads(line) for line in f]


def kill_after_checkpoint(run_dir, step, *extra):
    """Start a run, SIGKILL it once checkpoint `step` is on disk."""
    p = launch(run_dir, *extra)
    ckpt = os.path.join(run_dir, "stages", "grpo", "checkpoints", str(step))
    deadline = time.time() + 600
    while not os.path.isdir(ckpt) and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    assert p.poll() is None, "the run finished before it could be killed: " + p.stdout.read()[-3000:]
    p.send_signal(signal.SIGKILL)
    p.wait(60)


@pytest.mark.slow
def test_sync_grpo_learns_and_resumes_exactly_after_kill(tmp_path):
    steps = ["train.steps=6"]
    ref = tmp_path / "ref"
    run(ref, *steps)
    m = metrics(ref)
    assert len(m) == 6
    rewards = [r["train/reward/mean"] for r in m]
    assert np.mean(rewards[2:]) > np.mean(rewards[:2]), rewards  # it climbs the dense reward
    for key in ("train/pg_loss", "train/frac_zero_std_groups", "train/mismatch_kl", "train/time/generate_s",
                "train/tokens/output", "train/cost/total_usd", "train/reward/arithmetic/correct"):  # fmt: skip
        assert key in m[0]
    assert abs(m[0]["train/mismatch_kl"]) < 1e-4  # engine and trainer agree in float32

    cut = tmp_path / "cut"
    kill_after_checkpoint(cut, 2, *steps)
    run(cut, *steps)
    again = metrics(cut)
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(m, again):
        for key in ("train/reward/mean", "train/loss", "train/pg_loss", "train/response_length/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
def test_async_grpo_uses_each_sample_once_within_the_staleness_bound(tmp_path):
    steps = ["train.steps=6", "algo.grpo.mode=async", "algo.grpo.max_staleness=1"]
    cut = tmp_path / "async"
    kill_after_checkpoint(cut, 2, *steps)
    run(cut, *steps)
    m = metrics(cut)
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5, 6]
    assert all(r["train/staleness/max"] <= 1 for r in m)
    batches = [r for r in audit(cut) if r.get("record") == "train_batch"]
    # Steps 3..6 after the kill, plus those before it: every step trained on 4 groups.
    used = [(b["version"], g) for b in batches for g in b["groups"]]
    by_step = {}
    for b in batches:
        by_step[b["version"]] = b  # a step redone after the kill replaces its first record
    assert sorted(by_step) == [0, 1, 2, 3, 4, 5]
    groups_used = [g for b in by_step.values() for g in b["groups"]]
    assert len(groups_used) == len(set(groups_used)) == 6 * 4, used  # none used twice, none missing
    for b in by_step.values():
        assert all(b["version"] - v <= 1 for v in b["group_versions"])


@pytest.mark.slow
def test_grpo_options_run_together(tmp_path):
    """Dynamic sampling, the soft overlong penalty, overlong filtering, a solved-task
    curriculum, two epochs of two mini-batches (proximal log-probs), KL to a reference and
    masked IS in one short run: it trains, and reports what each option did. Its samples of at
    most about 50 tokens train at 128 of train.seq_len's 256 (bucket_lengths), packed several to
    a row (pack_rows)."""
    out = tmp_path / "options"
    run(out, "train.steps=4", "checkpoint.every_steps=4", "train.seq_len=256", "algo.grpo.dynamic_sampling=true",
        "algo.grpo.max_sampling_rounds=2", "algo.grpo.overlong_buffer=8", "algo.grpo.overlong_filter=true",
        "algo.grpo.drop_solved=true", "algo.grpo.epochs=2", "algo.grpo.mini_batches=2", "algo.grpo.kl_coef=0.05",
        "algo.grpo.is_correction=mis", "algo.grpo.is_low=0.5", "algo.grpo.max_seq_mult_prob_error=2.0",
        "algo.grpo.pack_rows=true")  # fmt: skip
    m = metrics(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    first = m[0]
    for key in ("train/dropped_zero_std_groups", "train/curriculum/skipped_solved", "train/kl_loss",
                "train/frac_is_masked", "train/approx_kl"):  # fmt: skip
        assert key in first, key
    # Steps 2 and 4 are each the second mini-batch pass; the rollouts happen at steps 1 and 3.
    assert "train/reward/mean" in m[0] and "train/reward/mean" not in m[1]
    assert m[0]["train/row_length"] == 128
    # 16 samples in a few rows (a multiple of the 2 mini-batches), two or more to a row.
    rows = [r["train/rows"] for r in m if "train/rows" in r]
    assert rows and all(n <= 8 and n % 2 == 0 for n in rows), rows
    with pytest.raises(AssertionError, match="multiple of 4"):
        run(tmp_path / "bad", "train.steps=6", "algo.grpo.epochs=2", "algo.grpo.mini_batches=2")


@pytest.mark.slow
def test_a_fleet_with_no_healthy_worker_stops_the_stage_naming_it(tmp_path):
    """rollout=sglang on a URL where nothing listens: the stage stops before sampling, says which
    worker answered what, exits 1, and leaves the stage resumable (no DONE.json)."""
    args = [a for a in TINY if not a.startswith("rollout.")]
    out = subprocess.run(
        [sys.executable, "-m", "ptrain", *args, "train.steps=2", "rollout=sglang", "rollout.urls=[http://127.0.0.1:9]",
         "rollout.unhealthy_timeout_s=3", f"run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "ptrain: stopped:" in out.stderr and "127.0.0.1:9" in out.stderr, out.stderr[-2000:]
    # The fleet was down from the start: nothing was trained, so nothing claims a checkpoint.
    assert "stopped before its first step" in out.stderr and "re-launch the same command" in out.stderr
    assert not (tmp_path / "stages" / "grpo" / "DONE.json").exists()


@pytest.mark.slow
def test_a_rollout_batch_of_nothing_but_failed_samples_stops_the_stage(tmp_path):
    """Prompts longer than the engine's context: every request is refused, so instead of
    training on nothing to the end the stage stops resumably with the engine's reason."""
    args = [a for a in TINY if not a.startswith("algo.grpo.max_new_tokens")]
    out = subprocess.run(
        [sys.executable, "-m", "ptrain", *args, "train.steps=2", "algo.grpo.max_new_tokens=4",
         "rollout.context_length=8", f"run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "ptrain: stopped: every one of the 16 samples of this rollout batch failed" in out.stderr, out.stderr[-2000:]
    assert "the context length is 8" in out.stderr and "re-launch the same command" in out.stderr
    assert not (tmp_path / "stages" / "grpo" / "DONE.json").exists()


@pytest.mark.slow
def test_a_checkpoint_without_rollout_state_is_an_error_naming_the_folder(tmp_path):
    """A checkpoint whose data item is readable JSON but not a GRPO stage's (another stage kind
    under this name, or a damaged file): one message naming the folder, not a KeyError."""
    run(tmp_path, "train.steps=2")
    stage = tmp_path / "stages" / "grpo"
    (stage / "DONE.json").unlink()
    (stage / "checkpoints" / "2" / "data" / "metadata").write_text(json.dumps({"ptrain_examples": 8}))
    out = subprocess.run(
        [sys.executable, "-m", "ptrain", *TINY, "train.steps=4", f"run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    want = f"ptrain: error: the checkpoint in {stage / 'checkpoints'} that the stage resumes from holds no GRPO"
    assert want + " rollout state (KeyError: 'collector')" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_resuming_async_with_another_group_size_is_refused_and_another_prompts_per_step_is_not(tmp_path):
    """An async checkpoint holds finished groups of group_size samples. Resumed with a larger
    group_size they used to train silently as one padded batch of the old groups (a smaller
    one failed in policy_batch with "16 trajectories do not fit 8 rows"); now the resume
    stops before anything runs, naming both values. A changed prompts_per_step is sound (each
    group stands alone) and resumes: every later step takes the new number of groups, none
    twice, within the staleness bound."""
    steps = ["algo.grpo.mode=async", "algo.grpo.max_staleness=1"]
    run(tmp_path, "train.steps=2", *steps)
    stage = tmp_path / "stages" / "grpo"
    (stage / "DONE.json").unlink()
    out = subprocess.run(
        [sys.executable, "-m", "ptrain", *TINY, "train.steps=4", *steps, "algo.grpo.group_size=8",
         f"run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    want = (
        f"ptrain: config error: config key 'algo.grpo.group_size': the checkpoint in {stage / 'checkpoints'} that "
        "this stage resumes from holds 4 finished rollout groups of 4 samples each (algo.grpo.group_size=4 when it "
        "was saved), which a rollout batch of group_size=8 cannot train on; restore algo.grpo.group_size=4 to "
        "resume this run, or start the changed run in a new run_dir"
    )
    assert want in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (stage / "DONE.json").exists()

    run(tmp_path, "train.steps=4", *steps, "algo.grpo.prompts_per_step=2")
    m = metrics(tmp_path)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert [r["train/loss_seqs"] for r in m] == [16, 16, 8, 8]  # 4 then 2 groups of 4 samples
    by_step = {b["version"]: b for b in audit(tmp_path) if b.get("record") == "train_batch"}
    assert [len(by_step[v]["groups"]) for v in range(4)] == [4, 4, 2, 2]
    used = [g for b in by_step.values() for g in b["groups"]]
    assert len(used) == len(set(used)) == 12
    assert all(b["version"] - v <= 1 for b in by_step.values() for v in b["group_versions"])
