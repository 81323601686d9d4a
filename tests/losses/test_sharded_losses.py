"""Sharded losses (rows over `data`, vocabulary over `tensor`, 8 simulated devices) equal unsharded ones."""

import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.multidevice
def test_sharded_losses_match_single_device():
    script = pathlib.Path(__file__).with_name("sharded_losses_script.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in (
        "sft vocab-sharded logits",
        "hidden path, head sharded by vocab columns",
        "policy loss, rows sharded",
    ):
        assert f"ok {check}" in proc.stdout, proc.stdout + proc.stderr
