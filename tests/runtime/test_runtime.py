"""The CPU XLA flags that entry points set: when they are added, and that they keep the numerics."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ptrain.runtime import (
    CPU_FLAGS,
    MALLOC_TUNABLE,
    RETAIN_TUNABLES,
    TUNED_JAXLIB,
    malloc_tuning_env,
    reexec_with_malloc_tuning,
    tune_xla_cpu,
)

TESTED = TUNED_JAXLIB[0]


def test_flags_are_appended_to_what_the_user_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert tune_xla_cpu(env, TESTED) == list(CPU_FLAGS)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", *CPU_FLAGS]
    assert tune_xla_cpu(env, TESTED) == []  # idempotent: a second call adds nothing


@pytest.mark.parametrize(
    "env, version, model",
    [
        ({"PTRAIN_XLA_CPU_TUNING": "0"}, TESTED, {}),  # turned off
        ({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"}, TESTED, {}),  # the user chose
        ({}, (0, 10, 1), {}),  # older jaxlib
        ({}, TUNED_JAXLIB[1], {}),  # newer jaxlib
        ({}, (), {}),  # no jaxlib
        ({}, TESTED, {"moe": True}),  # slows the grouped matmuls
        ({}, TESTED, {"compute_dtype": "bfloat16"}),  # slows bf16 dots
    ],
)
def test_flags_are_left_out(env, version, model):
    before = dict(env)
    assert tune_xla_cpu(env, version, **model) == []
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


# ----------------------------------------------------------------------------- malloc tunable

LINUX = dict(system="linux", glibc_version=(2, 36), thp_mode="madvise")


def test_malloc_tunable_is_added_to_what_the_user_set():
    env = malloc_tuning_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"}, **LINUX)
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{MALLOC_TUNABLE}", "HOME": "/h"}
    assert malloc_tuning_env({}, **LINUX) == {"GLIBC_TUNABLES": MALLOC_TUNABLE}


@pytest.mark.parametrize(
    "env, overrides",
    [
        ({"PTRAIN_MALLOC_TUNING": "0"}, {}),  # turned off
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}),  # the user chose
        ({"GLIBC_TUNABLES": MALLOC_TUNABLE}, {}),  # already restarted
        ({}, {"system": "darwin"}),  # not Linux
        ({}, {"glibc_version": ()}),  # musl or unknown libc
        ({}, {"glibc_version": (2, 34)}),  # tunable not known yet
        ({}, {"thp_mode": "always"}),  # huge pages already
        ({}, {"thp_mode": "never"}),  # no huge pages at all
        ({}, {"thp_mode": ""}),  # no THP in this kernel
    ],
)
def test_malloc_tunable_is_left_out(env, overrides):
    assert malloc_tuning_env(env, **{**LINUX, **overrides}) is None


@pytest.mark.parametrize(
    "env, overrides, added",
    [
        ({}, {}, [MALLOC_TUNABLE, *RETAIN_TUNABLES]),
        # the user's arena count is kept
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {}, [MALLOC_TUNABLE, *RETAIN_TUNABLES[1:]]),
        ({}, {"thp_mode": "always"}, list(RETAIN_TUNABLES)),  # huge pages already: only the retaining part
        ({}, {"glibc_version": (2, 31)}, list(RETAIN_TUNABLES)),  # no hugetlb tunable before 2.35
    ],
)
def test_retain_mode_adds_the_missing_tunables(env, overrides, added):
    env = {**env, "PTRAIN_MALLOC_TUNING": "retain"}
    out = malloc_tuning_env(env, **{**LINUX, **overrides})
    assert out["GLIBC_TUNABLES"] == ":".join([*filter(None, [env.get("GLIBC_TUNABLES", "")]), *added])
    assert malloc_tuning_env(out, **{**LINUX, **overrides}) is None  # the restarted process does not restart again


@pytest.mark.parametrize("overrides", [{"system": "darwin"}, {"glibc_version": ()}, {"glibc_version": (2, 17)}])
def test_retain_mode_is_left_out_without_glibc_tunables(overrides):
    assert malloc_tuning_env({"PTRAIN_MALLOC_TUNING": "retain"}, **{**LINUX, **overrides}) is None


def test_unknown_malloc_mode_names_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="PTRAIN_MALLOC_TUNING='fast'.*retain"):
        malloc_tuning_env({"PTRAIN_MALLOC_TUNING": "fast"}, **LINUX)
    monkeypatch.setenv("PTRAIN_MALLOC_TUNING", "fast")
    with pytest.raises(SystemExit, match="ptrain: PTRAIN_MALLOC_TUNING='fast'"):
        reexec_with_malloc_tuning()


def test_restart_keeps_the_command_line_and_happens_once(tmp_path):
    """The entry-point call replaces the process once; the restarted process sees the same
    arguments and the tunable, and does not restart again."""
    script = tmp_path / "entry.py"
    script.write_text(
        "import os, sys\n"
        "print('start', flush=True)\n"
        "from ptrain.runtime import reexec_with_malloc_tuning\n"
        "reexec_with_malloc_tuning()\n"
        "print('args', sys.argv[1:], os.environ.get('GLIBC_TUNABLES', ''))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PTRAIN_MALLOC_TUNING")}
    out = subprocess.run([sys.executable, str(script), "a", "b=1"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    expected = malloc_tuning_env(env)
    assert lines[-1] == f"args ['a', 'b=1'] {expected['GLIBC_TUNABLES'] if expected else ''}"
    assert lines.count("start") == (2 if expected else 1)
