"""A sweep through Hydra's submitit launcher, each point a 2-process JAX job: `python -m
ptrain -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2 ... seed=0,1` starts
two jobs of two tasks; each task finds its rank in submitit's environment
(ptrain.config.distributed.submitit_local_plan) and the two join one mesh. Each job trains as
one process with the same devices does."""

import json

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
