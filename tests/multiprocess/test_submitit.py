"""A sweep through Hydra's submitit launcher, each point a 2-process JAX job: `python -m
ptrain -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2 ... seed=0,1` starts
two jobs of two tasks; each task finds its rank in submitit's environment
(ptrain.config.distributed.submitit_local_plan) and the two join one mesh. Each job trains as
one process with the same devices does. A job preempted mid-stage is requeued by submitit and
resumes from its newest checkpoint."""

import json
import os
import re

import pytest

from tests.multiprocess.test_training import STEPS, TINY, assert_same_run, env_with_devices

pytestmark = pytest.mark.multiprocess
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def test_a_submitit_sweep_runs_each_point_as_a_two_process_job(tmp_path):
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    args = [*TINY, *STEPS, "stages=[{name: sft, kind: sft}]"]
    launcher = ["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10"]
    cmd = [sys.executable, "-m", "ptrain", "-m", *launcher, *args, "seed=0,1", f"hydra.sweep.dir={sweep}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_with_devices(1))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 4, logs  # 2 jobs x 2 tasks
    for log in logs:  # every task joined a 2-process job
        assert "connected to 1 peer ranks" in log.read_text(), log.read_text()[-2000:]
    for job, seed in (("job0", 0), ("job1", 1)):
        assert json.loads((sweep / job / "stages" / "sft" / "DONE.json").read_text())["steps"] == 4
        assert f"seed: {seed}" in (sweep / job / "config.yaml").read_text()
    # the first point as one process holding both devices: the same losses
    one = tmp_path / "one"
    single = [sys.executable, "-m", "ptrain", *args, "seed=0", f"run_dir={one}"]
    ref = subprocess.run(single, capture_output=True, text=True, timeout=600, env=env_with_devices(2))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_same_run(sweep / "job0", one, stages=("sft",))


def _task_pids(folder) -> list[int]:
    """Processes running a task of a submitit job whose files are under `folder`."""
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "submitit.core._submit" in cmd and any(str(folder) in part for part in cmd):
            pids.append(int(pid))
    return pids


def test_a_preempted_submitit_job_is_requeued_and_resumes_from_its_checkpoint(tmp_path):
    """Preemption as a cluster sends it: SIGUSR2 to the running task (Slurm sends it before a
    time limit or a preemption, and submitit's handler requeues the job). The job starts again
    with the same overrides in the same folder, ptrain resumes the stage from its newest
    checkpoint, and the step losses are those of an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    from tests.multiprocess.test_training import metric

    sweep = tmp_path / "sweep"
    steps = ["train.steps=300", "train.eval_every=100", "checkpoint.every_steps=20"]
    args = [*TINY, *steps, "stages=[{name: sft, kind: sft}]", "seed=0"]
    launcher = ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=60"]  # preempted, not timed out
    cmd = [sys.executable, "-m", "ptrain", "-m", *launcher, *args, f"hydra.sweep.dir={sweep}"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_with_devices(1))
    stage = sweep / "job0" / "stages" / "sft"
    try:
        deadline = time.monotonic() + 300
        while not (stage / "checkpoints" / "40").is_dir():  # two checkpoints written: the newest is complete
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before its second checkpoint"
            time.sleep(0.05)
        (pid,) = _task_pids(sweep / ".submitit")
        os.kill(pid, signal.SIGUSR2)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:]
    (log,) = (sweep / ".submitit").glob("*/*_log.out")
    text = log.read_text()
    assert "this job is preempted" in text and "Requeued job" in text, text[-3000:]
    resumed = re.search(r"resumed from checkpoint step (\d+)", text)
    assert resumed and int(resumed.group(1)) >= 40, text[-3000:]
    assert json.loads((stage / "DONE.json").read_text())["steps"] == 300
    # the same run, never interrupted
    one = tmp_path / "one"
    ref = subprocess.run(
        [sys.executable, "-m", "ptrain", *args, f"run_dir={one}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env_with_devices(1),
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    want, got = metric(one / "stages" / "sft", "train/loss"), metric(stage, "train/loss")
    assert sorted(got) == sorted(want) and len(want) >= 300
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5, abs=1e-5)
