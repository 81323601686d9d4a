"""Packaging: a built wheel carries ptrain.kernels (from kernels/), the Hydra configs and recipes."""

import importlib.util
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_editable_install_maps_kernels_to_ptrain_kernels():
    import ptrain.kernels.moe as moe

    assert os.path.realpath(os.path.dirname(moe.__file__)) == os.path.realpath(os.path.join(ROOT, "kernels", "moe"))


def test_source_checkout_finds_kernels_and_conf_without_an_editable_finder():
    """`python -m ptrain` from a clone's root imports the clone's ptrain/, not the installed
    wheel; its kernels and Hydra configs must still resolve (to the top-level folders).
    `-S` leaves out site-packages and with it the editable install's finder."""
    probe = (
        "import sys, importlib.util as u; sys.path.insert(0, sys.argv[1]); import ptrain;"
        "print(u.find_spec('ptrain.kernels.moe').origin); print(u.find_spec('ptrain.conf').origin)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe, ROOT], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    kernels, conf = out.stdout.split()
    assert os.path.realpath(kernels) == os.path.realpath(os.path.join(ROOT, "kernels", "moe", "__init__.py"))
    assert os.path.realpath(conf) == os.path.realpath(os.path.join(ROOT, "conf", "__init__.py"))


def test_a_clone_root_on_sys_path_does_not_shadow_another_kernels_package():
    """The top-level kernels/ folder has no __init__.py, so with a clone's root first on
    sys.path (pytest's rootdir, `python -m` from the root) a real `kernels` distribution
    (Hugging Face's, which transformers imports when it is installed) still wins, and without
    one transformers' probe finds no package to import."""
    probe = "import sys, importlib.util as u; sys.path.insert(0, sys.argv[1]); s = u.find_spec('kernels'); print(s and s.origin)"
    out = subprocess.run([sys.executable, "-c", probe, ROOT], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    assert not os.path.realpath(origin).startswith(os.path.realpath(os.path.join(ROOT, "kernels"))), origin


@pytest.mark.slow
def test_wheel_install_imports_kernels_and_composes_recipes(tmp_path):
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w", str(tmp_path / "w"), *isolation],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next((tmp_path / "w").glob("ptrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "ptrain/kernels/moe/ops.py" in names
    for source in ("decode.cc", "matmul.cc", "parallel.h"):  # built at first use from the installed source
        assert f"ptrain/kernels/cpu/{source}" in names
    assert "ptrain/conf/config.yaml" in names and "ptrain/conf/recipe/sft_arithmetic.yaml" in names
    assert not any(n.startswith("kernels/") for n in names)  # no top-level `kernels` package
    # Every package of the source tree is in the wheel (pyproject lists them by name).
    for folder, _, files in os.walk(os.path.join(ROOT, "ptrain")):
        if "__init__.py" in files and "__pycache__" not in folder:
            rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
            assert f"{rel}/__init__.py" in names, f"package {rel} is missing from pyproject's packages list"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import ptrain.kernels.moe, ptrain, os, ptrain.stages.grpo, ptrain.serve, ptrain.stages.loop;"
        "assert ptrain.__file__.startswith(os.environ['SITE']), ptrain.__file__;"
        "from ptrain.kernels import cpu; assert all(p.is_file() for p in cpu.SOURCES + cpu.HEADERS);"
        "from hydra import compose, initialize_config_module;"
        "from ptrain.config import register_configs, to_run_config; register_configs();"
        "ctx = initialize_config_module(config_module='ptrain.conf', version_base='1.3'); ctx.__enter__();"
        "run = to_run_config(compose(config_name='config', overrides=['recipe=sft_dpo_arithmetic']));"
        "print([s.kind for s in run.stages])"
    )
    env = dict(os.environ, PYTHONPATH=str(site), SITE=str(site))
    res = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "['sft', 'dpo']" in res.stdout
