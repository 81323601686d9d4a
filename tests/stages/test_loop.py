"""Stage drivers' shared parts: checks before any training step, and the loop's seam."""

import dataclasses
import os
import time

import pytest
from flax import nnx

from ptrain.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    GeneratedTaskConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from ptrain.data import build_tokenizer, make_sft_iterator, write_generated
from ptrain.models import Decoder, save_hf
from ptrain.stages.loop import IteratorBatches, StageStopped, train_evaluate_export
from ptrain.stages.setup import load_model, setup_stage, stage_mesh, tokenizer_for
from ptrain.stages.sft import sft_algorithm


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    """Ids past the embedding would read garbage rows and turn the loss NaN (which looks like
    divergence); the load names both sizes and the fix instead."""
    cfg = ModelConfig(
        family="qwen3", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48
    )
    save_hf(Decoder(cfg, rngs=nnx.Rngs(0)), str(tmp_path))
    run = RunConfig()
    tokenizer = build_tokenizer()
    assert len(tokenizer) > 64
    with pytest.raises(ValueError, match=r"vocabulary of 64 but the tokenizer has \d+ tokens"):
        load_model(run, str(tmp_path), stage_mesh(run), tokenizer)


class RecordingBatches(IteratorBatches):
    """Batches that note every begin and after_step call and every state they are set to."""

    def __init__(self, iterator):
        super().__init__(iterator)
        self.after, self.restored, self.began = [], [], []

    def begin(self, step, state):
        self.began.append((step, int(state.step)))

    def after_step(self, step, state, metrics):
        self.after.append((step, int(state.step), "loss" in metrics and "grad_norm" in metrics))

    def set_state(self, state):
        self.restored.append(state)
        super().set_state(state)


def tiny_sft_run(tmp_path, *, steps: int, checkpoint_every: int):
    """A one-layer SFT run on generated arithmetic: (run, tokenizer, data config, stage dir)."""
    run = RunConfig(
        run_dir=str(tmp_path),
        model=ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48, max_seq_len=64),
        data=DataConfig(generated=GeneratedTaskConfig(n_train=40, n_eval=8), tokenizer_vocab_size=300),
        train=TrainConfig(steps=steps, global_batch_size=2, seq_len=32, eval_every=0, eval_batches=0, eval_generate=0),
        logging=LoggingConfig(console=False, tensorboard=False, jsonl=True),
        checkpoint=CheckpointConfig(every_steps=checkpoint_every, async_save=False),
    )
    tokenizer = tokenizer_for(run, None)
    return run, tokenizer, write_generated(run.data, str(tmp_path / "data")), str(tmp_path / "stages" / "sft")


def test_the_loop_seam_calls_after_step_each_step_and_resumes_the_batches(tmp_path):
    """The seam an RL stage plugs into: begin(start step, state) once before the loop,
    after_step(step, new state, metrics) once per step, and on resume the batches get the
    state saved with the checkpoint (and begin the restored state)."""
    run, tokenizer, data_cfg, stage_dir = tiny_sft_run(tmp_path, steps=2, checkpoint_every=2)

    def launch(steps):
        r = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=steps))
        it = make_sft_iterator(data_cfg, tokenizer, batch_size=2, seq_len=32)
        stage = setup_stage(r, stage_dir, None, tokenizer, kind="sft", t_start=time.time())
        batches = RecordingBatches(it)
        summary = train_evaluate_export(stage, sft_algorithm(r, stage.placed.model_def), batches, report=it.report)
        return batches, summary

    first, summary = launch(2)
    assert first.after == [(1, 1, True), (2, 2, True)] and first.began == [(0, 0)]
    assert first.restored == [] and summary["steps"] == 2
    assert os.path.isfile(os.path.join(stage_dir, "DONE.json"))
    again, _ = launch(3)  # the same stage with one more step: resumes from step 2
    assert again.after == [(3, 3, True)] and again.began == [(2, 2)]
    assert len(again.restored) == 1 and "ptrain_examples" in again.restored[0]


class UnavailableAt(IteratorBatches):
    """Batches whose engine cannot sample for step `fail_at` (raised from next())."""

    def __init__(self, iterator, fail_at):
        super().__init__(iterator)
        self.fail_at, self.calls = fail_at, 0

    def __next__(self):
        from ptrain.rollout.protocol import EngineUnavailable

        self.calls += 1
        if self.calls == self.fail_at:
            raise EngineUnavailable("no healthy worker: http://127.0.0.1:1 (connection refused)")
        return super().__next__()


def test_an_engine_that_cannot_sample_checkpoints_and_stops_the_stage(tmp_path):
    """The step before the failed one is saved (no periodic checkpoint was due), the stage stops
    with StageStopped naming the cause, and a re-launch resumes from that step."""
    run, tokenizer, data_cfg, stage_dir = tiny_sft_run(tmp_path, steps=4, checkpoint_every=100)

    def launch(batches_of):
        it = make_sft_iterator(data_cfg, tokenizer, batch_size=2, seq_len=32)
        stage = setup_stage(run, stage_dir, None, tokenizer, kind="sft", t_start=time.time())
        return train_evaluate_export(stage, sft_algorithm(run, stage.placed.model_def), batches_of(it),
                                     report=it.report)  # fmt: skip

    with pytest.raises(StageStopped, match=r"connection refused.*checkpoint at step 2"):
        launch(lambda it: UnavailableAt(it, fail_at=3))
    assert os.path.isdir(os.path.join(stage_dir, "checkpoints", "2"))
    assert not os.path.exists(os.path.join(stage_dir, "DONE.json"))
    again = RecordingBatches
    summary = launch(lambda it: again(it))
    assert summary["steps"] == 4 and os.path.exists(os.path.join(stage_dir, "DONE.json"))


class PushFailsAt(IteratorBatches):
    """Batches whose engine cannot take the weights of step `fail_at` (raised from after_step)."""

    def __init__(self, iterator, fail_at):
        super().__init__(iterator)
        self.fail_at = fail_at

    def after_step(self, step, state, metrics):
        from ptrain.rollout.weight_sync import WeightSyncError

        if step == self.fail_at:
            raise WeightSyncError("/dev/shm/w: writing weight version 3 failed (No space left on device)")


def test_weights_that_cannot_reach_the_engine_checkpoint_the_trained_step_and_stop(tmp_path):
    """A failed weight export or push after step 3 keeps step 3 (no periodic checkpoint was
    due) and stops the stage naming the cause, instead of a traceback that loses the steps."""
    run, tokenizer, data_cfg, stage_dir = tiny_sft_run(tmp_path, steps=4, checkpoint_every=100)
    it = make_sft_iterator(data_cfg, tokenizer, batch_size=2, seq_len=32)
    stage = setup_stage(run, stage_dir, None, tokenizer, kind="sft", t_start=time.time())
    with pytest.raises(StageStopped, match=r"No space left on device\).*checkpoint at step 3"):
        train_evaluate_export(stage, sft_algorithm(run, stage.placed.model_def), PushFailsAt(it, 3), report=it.report)
    assert os.path.isdir(os.path.join(stage_dir, "checkpoints", "3"))


def test_a_stage_stopped_before_its_first_step_does_not_claim_a_checkpoint():
    from ptrain.rollout.protocol import EngineUnavailable

    fresh = str(StageStopped.at("grpo", 0, EngineUnavailable("no healthy worker")))
    assert "before its first step" in fresh and "checkpoint at step" not in fresh
    assert "checkpoint at step 5" in str(StageStopped.at("grpo", 5, EngineUnavailable("no healthy worker")))


def test_a_model_folder_without_a_tokenizer_is_refused_for_every_stage(tmp_path):
    """The embedded tokenizer's ids are not the folder's model's; it used to stand in silently."""
    (tmp_path / "model").mkdir()
    run = RunConfig(run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"'data.tokenizer_path': the model folder .*model' has no tokenizer.json"):
        tokenizer_for(run, str(tmp_path / "model"))
