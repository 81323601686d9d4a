"""The CPU XLA flags that entry points set: when they are added, and that they keep the numerics."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ptrain.runtime import CPU_FLAGS, TUNED_JAXLIB, tune_xla_cpu

TESTED = TUNED_JAXLIB[0]


def test_flags_are_appended_to_what_the_user_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert tune_xla_cpu(env, TESTED) == list(CPU_FLAGS)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", *CPU_FLAGS]
    assert tune_xla_cpu(env, TESTED) == []  # idempotent: a second call adds nothing


@pytest.mark.parametrize("env, version", [
    ({"PTRAIN_XLA_CPU_TUNING": "0"}, TESTED),                                     # turned off
    ({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"}, TESTED),        # the user chose
    ({}, (0, 10, 1)),                                                             # older jaxlib
    ({}, TUNED_JAXLIB[1]),                                                        # newer jaxlib
    ({}, ()),                                                                     # no jaxlib
])
def test_flags_are_left_out(env, version):
    before = dict(env)
    assert tune_xla_cpu(env, version) == []
    assert env == before


def _run(flags: str) -> dict:
    script = os.path.join(os.path.dirname(__file__), "tuned_step_script.py")
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_flags_keep_loss_and_gradients():
    env = {}
    if not tune_xla_cpu(env):
        pytest.skip("this jaxlib gets no CPU flags")
    tuned, plain = _run(env["XLA_FLAGS"]), _run("")
    assert tuned["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert tuned["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    np.testing.assert_allclose(tuned["grad"], plain["grad"], rtol=1e-3, atol=1e-6)
