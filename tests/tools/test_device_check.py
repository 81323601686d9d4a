"""tools/device_check.py --dry-run: every row of the accelerator check runs on CPU at toy shapes,
so the script's code paths stay working before any accelerator is lent."""

import json
import math
import os
import subprocess
import sys

import pytest

from tools.device_check import ROWS, SHAPES, datasheet, format_table, judge

CHECKS = {
    "gmm": "grouped matmul, E=8, vs dense bf16",
    "sft": "SFT step MFU, dense bf16",
    "decode": "engine decode vs bandwidth floor",
    "grpo": "GRPO step time split",
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check") / "table.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "tools/device_check.py", "--dry-run", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    return p, out


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The printed markdown table's body rows, by their check name."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in CHECKS.values():
            rows[cells[0]] = cells
    return rows


def test_dry_run_prints_every_row_with_a_number_and_no_goal_on_cpu(dry_run):
    p, _ = dry_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = table_rows(p.stdout)
    assert set(rows) == set(CHECKS.values())
    for check, value, goal, passed, _detail in rows.values():
        assert math.isfinite(float(value.split()[0])) and float(value.split()[0]) > 0, (check, value)
        assert goal == "n/a on cpu" and passed == "-", (check, goal, passed)


def test_dry_run_json_holds_the_same_rows(dry_run):
    p, out = dry_run
    assert p.returncode == 0, p.stderr[-3000:]
    table = json.loads(out.read_text())
    assert table["platform"] == "cpu" and table["mode"] == "dry_run"
    assert [r["key"] for r in table["rows"]] == list(ROWS)
    printed = table_rows(p.stdout)
    for r in table["rows"]:
        assert r["check"] == CHECKS[r["key"]]
        assert isinstance(r["value"], float) and r["value"] > 0
        assert r["goal"] == "n/a on cpu" and r["pass"] == "-"
        assert printed[r["check"]][1] == f"{r['value']:.3g} {r['unit']}"
    grpo = next(r for r in table["rows"] if r["key"] == "grpo")["data"]["median"]
    parts = ("generate_s", "reward_s", "batch_s", "train_s", "sync_s")
    assert grpo["train_s"] > 0 and sum(grpo[k] for k in parts) <= grpo["step_s"] * 1.001


def test_both_modes_shape_the_same_rows():
    assert SHAPES["dry_run"].keys() == SHAPES["accelerator"].keys()
    for part, shape in SHAPES["dry_run"].items():
        assert shape.keys() == SHAPES["accelerator"][part].keys(), part


def test_goals_pass_fail_and_errors_on_an_accelerator():
    assert judge("gmm", 71.0, on_cpu=False)[1] == "yes"
    assert judge("gmm", 69.0, on_cpu=False)[1] == "NO"
    assert judge("sft", 45.0, on_cpu=False)[1] == "yes"
    assert judge("sft", None, on_cpu=False)[1] == "error"
    assert judge("decode", 30.0, on_cpu=False)[1] == "-"  # no goal set: recorded only
    assert judge("sft", 10.0, on_cpu=True) == ("n/a on cpu", "-")
    assert "error" in format_table([dict(check="x", value=None, unit="%", goal="g", detail="d", **{"pass": "error"})])


def test_datasheet_knows_the_first_accelerators_and_not_a_cpu():
    assert datasheet("NVIDIA H200") == (989e12, 4.8e12)
    assert datasheet("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert datasheet("NVIDIA H100 PCIe")[0] == 756e12
    assert datasheet("cpu") == (None, None)
