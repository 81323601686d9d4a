"""The JSONL and TensorBoard sinks on resume: a re-launched stage's file reads like one run."""

import json

import pytest

from ptrain.config.outputs import LoggingConfig
from ptrain.metrics import MetricsLogger


def _records(stage_dir):
    return [json.loads(line) for line in open(stage_dir / "metrics.jsonl")]


def _first_run(stage_dir, steps):
    log = MetricsLogger(
        LoggingConfig(console=False, tensorboard=False), str(stage_dir), total_steps=9, start_step=0, name="t"
    )
    log.log(0, {"rows": 3.0}, prefix="data")
    for s in steps:
        log.log(s, {"loss": float(s)})
    log.log(steps[-1], {"loss": 0.5}, prefix="eval")
    log.close()


@pytest.mark.parametrize("start, kept", [(0, []), (2, [0, 1, 2])])
def test_resume_drops_lost_steps_and_a_restart_drops_everything(tmp_path, start, kept):
    """Resuming at step 2 keeps steps <= 2; a stage that starts over (killed before its first
    checkpoint) logs its step-0 records again, so none of the old ones stay."""
    _first_run(tmp_path, [1, 2, 3])
    log = MetricsLogger(
        LoggingConfig(console=False, tensorboard=False), str(tmp_path), total_steps=9, start_step=start, name="t"
    )
    log.close()
    assert [r["step"] for r in _records(tmp_path)] == kept


def test_tensorboard_purges_the_steps_it_will_write_again(tmp_path):
    log = MetricsLogger(LoggingConfig(console=False), str(tmp_path), total_steps=9, start_step=2, name="t")
    assert log.tb._w.purge_step == 3
    log.close()
