"""Orbax stage checkpoints: round trip, keep-last-K, and fallback past a corrupt newest one."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from ptrain.checkpoint import CheckpointError, StageCheckpointer, abstract_like
from ptrain.config import CheckpointConfig
from ptrain.train.state import TrainState


def state_at(step):
    return TrainState(
        step=jnp.asarray(step, jnp.int32),
        params={"w": jnp.full((4, 3), float(step))},
        opt_state=({"mu": jnp.zeros((4, 3))},),
        rng=jnp.arange(2, dtype=jnp.uint32),
        model_state={},
    )


def saved(tmp_path, steps, keep=3):
    ckpt = StageCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep=keep, async_save=True))
    for s in steps:
        ckpt.save(s, state_at(s), {"epoch": s}, {"step": s})
    ckpt.wait()
    return ckpt


def test_round_trip_restores_state_data_and_meta(tmp_path):
    ckpt = saved(tmp_path, [1, 2])
    step, state, data, meta = ckpt.restore_latest(abstract_like(state_at(0)))
    assert step == 2 and data == {"epoch": 2} and meta["step"] == 2
    np.testing.assert_array_equal(state.params["w"], np.full((4, 3), 2.0))
    assert int(state.step) == 2
    ckpt.close()


def test_keeps_only_the_last_k(tmp_path):
    ckpt = saved(tmp_path, [1, 2, 3, 4], keep=2)
    assert ckpt.steps() == [3, 4]
    ckpt.close()


def _corrupt(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"\x00garbage")


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    ckpt = saved(tmp_path, [1, 2])
    ckpt.close()
    _corrupt(tmp_path / "ckpt" / "2")
    ckpt = StageCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep=3))
    step, state, _, _ = ckpt.restore_latest(abstract_like(state_at(0)))
    assert step == 1 and float(state.params["w"][0, 0]) == 1.0
    assert any("unreadable" in r.message for r in caplog.records)
    ckpt.close()


def test_resumed_run_saves_over_an_unreadable_step_and_keeps_it_aside(tmp_path, caplog):
    """After falling back past a corrupt step 2, training reaches step 2 again and saves it:
    the corrupt one is renamed out of the way (not deleted) and the new one is the latest."""
    ckpt = saved(tmp_path, [1, 2])
    ckpt.close()
    _corrupt(tmp_path / "ckpt" / "2")
    ckpt = StageCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep=3, async_save=False))
    assert ckpt.restore_latest(abstract_like(state_at(0)))[0] == 1
    assert (tmp_path / "ckpt" / "2").is_dir()  # nothing moved before the run gets there
    ckpt.save(2, state_at(5), {"epoch": 0}, {"step": 2})  # w = 5 tells the new save from the old
    ckpt.wait()
    assert ckpt.steps() == [1, 2] and (tmp_path / "ckpt" / "2.unreadable").is_dir()
    step, state, _, _ = ckpt.restore_latest(abstract_like(state_at(0)))
    assert step == 2 and float(state.params["w"][0, 0]) == 5.0
    assert any("kept as" in r.message for r in caplog.records)
    ckpt.close()


def test_all_checkpoints_corrupt_is_a_clear_error(tmp_path):
    ckpt = saved(tmp_path, [1])
    ckpt.close()
    _corrupt(tmp_path / "ckpt" / "1")
    ckpt = StageCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep=3))
    with pytest.raises(CheckpointError, match="could be read .newest: .*settings they were saved with"):
        ckpt.restore_latest(abstract_like(state_at(0)))
    ckpt.close()


def test_half_written_save_is_not_listed(tmp_path):
    ckpt = saved(tmp_path, [1])
    ckpt.close()
    (tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-123").mkdir()  # what a kill mid-save leaves
    ckpt = StageCheckpointer(str(tmp_path / "ckpt"), CheckpointConfig(keep=3))
    assert ckpt.steps() == [1]
    ckpt.close()


@pytest.mark.parametrize("text", ["", '{"loss": 0.1', "[1, 2]"])
def test_damaged_done_marker_is_a_clear_error(tmp_path, text):
    """An empty, cut-off or wrong DONE.json names the file and says how to recover."""
    from ptrain.checkpoint import mark_done, read_done

    mark_done(str(tmp_path), {"loss": 0.1})
    assert read_done(str(tmp_path)) == {"loss": 0.1}
    (tmp_path / "DONE.json").write_text(text)
    with pytest.raises(CheckpointError, match="DONE.json .*delete it and re-launch"):
        read_done(str(tmp_path))
