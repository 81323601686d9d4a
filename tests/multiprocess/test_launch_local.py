"""tools/launch_local.py with plain Python children (no JAX): the rank variables, prefixed
output, and a failing rank that stops the others at once with its exit code."""

import os
import subprocess
import sys
import time

import pytest

from tools import launch_local

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "tools", "launch_local.py")


def test_each_rank_gets_its_variables_and_its_device_count():
    env = launch_local.child_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_other=1"},
        rank=1,
        processes=3,
        coordinator="127.0.0.1:5",
        devices_per_process=4,
        gpus_per_process=2,
    )
    assert env["PTRAIN_PROCESS_ID"] == "1" and env["PTRAIN_NUM_PROCESSES"] == "3"
    assert env["PTRAIN_COORDINATOR"] == "127.0.0.1:5"
    assert env["XLA_FLAGS"].split() == ["--xla_other=1", "--xla_force_host_platform_device_count=4"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert launch_local.exit_code(-9) == 137 and launch_local.exit_code(3) == 3


@pytest.mark.multiprocess
def test_a_failing_rank_stops_the_others_and_its_code_is_the_jobs():
    child = (
        "import os, sys, time\n"
        "rank = int(os.environ['PTRAIN_PROCESS_ID'])\n"
        "print('hello from', rank, 'of', os.environ['PTRAIN_NUM_PROCESSES'], flush=True)\n"
        "print('a warning', file=sys.stderr, flush=True)\n"
        "time.sleep(0.5)\n"
        "sys.exit(3) if rank == 1 else time.sleep(120)\n"
    )
    t0 = time.time()
    out = subprocess.run([sys.executable, LAUNCH, "--processes", "3", "--stop-timeout", "2", "--",
                          sys.executable, "-c", child], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 3, out.stdout + out.stderr
    assert time.time() - t0 < 30  # the sleeping ranks were stopped, not waited for
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank} of 3" in out.stdout
        assert f"[rank {rank}] a warning" in out.stderr
    assert "rank 1 exited with code 3; stopping the others" in out.stderr


@pytest.mark.multiprocess
def test_all_ranks_succeeding_is_success():
    child = "import os; print('rank', os.environ['PTRAIN_PROCESS_ID'])"
    out = subprocess.run([sys.executable, LAUNCH, "--processes", "2", "--", sys.executable, "-c", child],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "[rank 0] rank 0" in out.stdout and "[rank 1] rank 1" in out.stdout


def test_a_launch_without_a_command_or_with_no_processes_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        launch_local.main(["--processes", "2"])
    assert e.value.code == 2 and "give the command after --" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch_local.main(["--processes", "0", "--", "true"])
    assert "--processes must be >= 1" in capsys.readouterr().err
