"""Expert parallelism (EP 2, 4, 8) equals no expert parallelism: outputs and all gradients."""

import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.multidevice
def test_expert_parallel_matches_single_device():
    script = pathlib.Path(__file__).with_name("moe_ep_script.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for ep in (2, 4, 8):
        for exchange in ("padded", "ragged_emulated"):
            assert f"ok ep={ep} exchange={exchange}" in proc.stdout
    assert "ok errors" in proc.stdout
