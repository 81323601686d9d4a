"""The audit log: records round-trip, stay readable (one JSON object a line), survive a torn
last line, and replay: `rescore` scores recorded episodes again with an environment."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from ptrain.config.env import EnvConfig
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.audit import AuditLog, read_audit
from ptrain.envs.base import Task, TokenCounts, Trajectory, Turn
from ptrain.envs.registry import make_env
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine, rescore


def trajectory() -> Trajectory:
    task = Task(env="countdown", id="train-3", messages=({"role": "user", "content": "hi"},), data={"target": 5})
    return Trajectory(
        task=task,
        sample_index=1,
        token_ids=(1, 2, 3, 4),
        prompt_length=2,
        loss_mask=(0, 0, 1, 1),
        logprobs=(0.0, 0.0, -0.5, -0.25),
        reward=0.1,
        reward_components={"format": 0.1, "correct": 0.0},
        finish_reason="stop",
        metrics={"correct": 0.0, "formatted": 1.0},
        turns=(
            Turn("policy", 2, 3, text="<answer>2 + 2</answer>", duration_s=0.5),
            Turn("tool", 3, 4, text="4", tool="python", arguments={"code": "print(2+2)"}, exit_code=1, duration_s=0.1),
        ),
        weight_versions=("v3",),
        tokens=TokenCounts(prompt_uncached=1, prompt_cached=1, output=2),
    )


def test_records_round_trip_and_read_as_plain_json(tmp_path):
    path = tmp_path / "stage" / "audit.jsonl"
    t = trajectory()
    with AuditLog(str(path)) as audit:
        written = audit.write(t, step=7)
        audit.write_all([t, t], step=8)
        assert audit.count == 3
    records = list(read_audit(str(path)))
    assert len(records) == 3 and records[0] == json.loads(json.dumps(written))
    r = records[0]
    assert r["env"] == "countdown" and r["task_id"] == "train-3" and r["sample"] == 1 and r["step"] == 7
    assert r["reward"] == 0.1 and r["reward_components"] == {"format": 0.1, "correct": 0.0}
    assert r["tokens"] == {"prompt_uncached": 1, "prompt_cached": 1, "output": 2}
    assert r["turns"][0]["text"] == "<answer>2 + 2</answer>" and r["turns"][0]["role"] == "policy"
    assert r["turns"][1]["arguments"] == {"code": "print(2+2)"} and r["turns"][1]["exit_code"] == 1
    assert {k for k in r} >= {"finish_reason", "reward_error", "metrics", "weight_versions", "time"}
    for line in path.read_text().splitlines():  # a person (or jq) reads it line by line
        assert isinstance(json.loads(line), dict)
    with AuditLog(str(path)) as audit:  # a resumed stage appends
        audit.write(t, step=9)
    assert [r["step"] for r in read_audit(str(path))] == [7, 8, 8, 9]


def test_torn_last_line_is_skipped_and_damage_is_named(tmp_path, caplog):
    path = tmp_path / "audit.jsonl"
    with AuditLog(str(path)) as audit:
        audit.write(trajectory())
    with open(path, "a") as f:
        f.write('{"env": "countdown", "task_')
    assert len(list(read_audit(str(path)))) == 1
    assert "torn last line" in caplog.text
    path.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"audit.jsonl:2"):
        list(read_audit(str(path)))
    with pytest.raises(FileNotFoundError, match="no audit log"):
        list(read_audit(str(tmp_path / "missing.jsonl")))


def test_a_resumed_stage_appends_after_a_torn_last_line(tmp_path, caplog):
    """The resumed stage's first record used to join the fragment, and read_audit then
    refused the whole log at that line."""
    path = tmp_path / "audit.jsonl"
    with AuditLog(str(path)) as audit:
        audit.write(trajectory(), step=1)
    with open(path, "a") as f:
        f.write('{"env": "countdown", "task_')  # the crash
    with AuditLog(str(path)) as audit:
        audit.write(trajectory(), step=2)
    assert [r["step"] for r in read_audit(str(path))] == [1, 2]
    assert "dropped a torn last line (27 bytes)" in caplog.text
    path.write_text('{"env": "count')  # a crash before the first newline
    with AuditLog(str(path)) as audit:
        audit.write(trajectory(), step=3)
    assert [r["step"] for r in read_audit(str(path))] == [3]


def test_rescore_replays_recorded_episodes(tmp_path):
    tok = build_tokenizer(vocab_size=300)
    env = make_env(EnvConfig(kind="countdown", n_train=4, n_eval=2, reward_workers=1), tokenizer=tok)
    try:
        tasks = list(env.tasks("train", seed=0)) + list(env.tasks("eval", seed=0))
        task = tasks[0]
        answers = [f"<answer>{task.data['solution']}</answer>", "<answer>1 + 2</answer>", "none"]
        out = asyncio.run(env.rollout(task, ReplayEngine(answers, tokenizer=tok), SamplingParams(n=3)))
        path = str(tmp_path / "audit.jsonl")
        with AuditLog(path) as audit:
            audit.write_all(out, step=0)
        records = list(read_audit(path))
        again = rescore(env, records, tasks=tasks)
        assert [t.reward for t in again] == [t.reward for t in out] == pytest.approx([1.0, 0.1, 0.0])
        assert [t.sample_index for t in again] == [0, 1, 2]
        assert [t.turns[0].text for t in again] == answers
        # A changed scorer (no format reward) re-scores the same text.
        strict = make_env(
            dataclasses.replace(env.cfg, options={"format_reward": 0.0, "correct_reward": 1.0}), tokenizer=tok
        )
        try:
            assert [t.reward for t in rescore(strict, records, tasks=tasks)] == [1.0, 0.0, 0.0]
        finally:
            strict.close()
        with pytest.raises(ValueError, match="not among the"):
            rescore(env, records, tasks=tasks[1:])
    finally:
        env.close()
