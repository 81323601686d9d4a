"""Runs a script of this folder in a subprocess that sees 8 CPU host devices (XLA fixes the
device count when jax starts), and reads the JSON it writes."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def run_on_eight_devices(script: str, out_path) -> tuple[dict, str]:
    """(the JSON `script` wrote to out_path, its stderr); fails the test with its output."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out_path) as f:
        return json.load(f), proc.stderr
