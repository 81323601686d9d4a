"""Every recipe runs end to end at `scale=smoke` through the real CLI: each of its stages
finishes (DONE.json, an export where the kind writes one). The recipes' own sizes run for
minutes to hours; smoke is the same stages on a one-layer model for a few steps."""

import json
import os
import subprocess
import sys

import pytest

from ptrain.config.recipes import available_recipes

pytestmark = pytest.mark.slow


# The continuous recipe is a loop that waits for arrivals: tests/continuous/test_loop.py runs it
# at smoke scale through the CLI and the API, with environments dropped into its inbox.
LOOPS = {"continuous"}


@pytest.mark.parametrize("recipe", [r for r in available_recipes() if r not in LOOPS])
def test_the_recipe_runs_at_smoke_scale(recipe, tmp_path):
    import ptrain

    cfg = ptrain.compose(recipe, ["scale=smoke"])
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "ptrain", f"recipe={recipe}", "scale=smoke", "logging.console=false",
         "logging.tensorboard=false", f"run_dir={run_dir}"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for stage in cfg.stages:
        done = run_dir / "stages" / stage.name / "DONE.json"
        assert done.is_file(), f"stage {stage.name} did not finish:\n{p.stdout[-2000:]}"
        assert json.loads(done.read_text())["stage"] == stage.name
        if stage.kind != "eval":
            assert os.path.isfile(run_dir / "stages" / stage.name / "export" / "config.json")
