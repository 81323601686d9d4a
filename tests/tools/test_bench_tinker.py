"""tools/bench_tinker.py on a tiny model: the server starts, the tinker SDK trains and samples
through it, the in-process client does the same, and the table of ratios is printed."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("tinker")


def test_bench_tinker_prints_both_paths_ratios():
    cmd = [sys.executable, "tools/bench_tinker.py", "--small", "--rounds", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert out.startswith("machine: ") and "model: 2 layers" in out
    assert "train round 0:" in out and "sample round 0:" in out
    rows = {}
    for name in ("train", "sample"):
        m = re.search(rf"^{name}\s+(\d+)\s+(\d+)\s+([0-9.]+)\s+(\S+)", out, re.M)
        assert m, out
        rows[name] = float(m[1]), float(m[2]), float(m[3])
        assert rows[name][0] > 0 and rows[name][1] > 0
        assert rows[name][2] == pytest.approx(rows[name][1] / rows[name][0], rel=0.05, abs=2e-3)
    assert ">= 0.90" in out and "ratio = server / in-process" in out
