"""tools/bench_grpo.py on a tiny model (no TRL): the stage's pieces run, every part of the step
is timed, and the floor follows from the batch's own token counts."""

import json
import subprocess
import sys

import pytest

from tools.bench_grpo import digit_share, floor_at, random_words, rows_of, step_floor


def test_bench_grpo_times_a_sync_step_of_the_real_stage(tmp_path):
    out = tmp_path / "sync.json"
    cmd = [sys.executable, "tools/bench_grpo.py", "--small", "--mode", "sync", "--steps", "1", "--warmup", "0",
           "--prompts", "2", "--group", "2", "--new-tokens", "8", "--grad-accum", "1", "--json", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "sync" and r["steps_timed"] == 1 and len(r["steps"]) == 2
    m = r["median"]
    parts = ("generate_s", "reward_s", "idle_s", "batch_s", "train_s", "sync_s")
    assert all(m[k] >= 0 for k in parts) and m["train_s"] > 0 and m["generate_s"] > 0
    assert sum(m[k] for k in parts) <= m["step_s"] * 1.001  # the parts are disjoint pieces of the step
    assert m["idle_s"] == 0.0  # sync: the trainer never waits beside the engine
    # 2 prompts x 2 samples of at most 8 tokens, every row's tokens trained
    assert 0 < m["output_tokens"] <= 2 * 2 * 8
    assert m["train_tokens"] == m["prompt_tokens"] + m["output_tokens"] - 4
    assert r["floor"]["floor_s"] > 0 and r["matmul_gflops"] > 0 and r["peak_rss_gib"] > 0
    assert "ptrain sync:" in p.stdout and "floor:" in p.stdout


@pytest.mark.slow
def test_bench_grpo_times_async_steps_within_the_staleness_bound(tmp_path):
    out = tmp_path / "async.json"
    cmd = [sys.executable, "tools/bench_grpo.py", "--small", "--mode", "async", "--steps", "2", "--warmup", "0",
           "--prompts", "2", "--group", "2", "--new-tokens", "8", "--grad-accum", "1", "--json", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "async" and len(r["steps"]) == 3
    for s in r["steps"]:
        assert s["generate_s"] == 0.0 and s["idle_s"] >= 0  # in async mode the trainer's wait is idle time
        assert s["staleness_max"] <= 1 and s["dropped_stale_groups"] == 0
    assert "ptrain async:" in p.stdout


def test_prompts_and_reward_are_the_peer_scripts_kind():
    import random

    text = random_words(random.Random(0), 16)
    assert len(text.split()) == 16
    assert digit_share("ab12") == 0.5 and digit_share("") == 0.0


def test_floor_counts_one_prefill_per_group_and_every_sampled_token():
    import numpy as np

    from tools.bench_engine import SMALL

    # two rows: prompt 5 + response 3, prompt 5 + response 2 (one group of two samples)
    seg = np.zeros((3, 16), np.int32)
    seg[0, :7], seg[1, :6] = 1, 1
    mask = np.zeros((3, 16), np.float32)
    mask[0, 4:7], mask[1, 4:6] = 1, 1
    rows = rows_of({"segment_ids": seg, "loss_mask": mask})
    assert rows == [(5, 3), (5, 2)]
    f = step_floor(SMALL, [5, 5], [3, 2], 2, gflops=100.0, gbs=10.0)
    one = step_floor(SMALL, [5], [3], 1, gflops=100.0, gbs=10.0)
    # the second sample adds its 2 decoded tokens but no prefill
    assert f["gen_gflop"] < 2 * one["gen_gflop"]
    assert f["train_gflop"] > one["train_gflop"]
    # each phase is bound by the slower of its FLOPs and its bytes
    assert f["gen_floor_s"] == pytest.approx(max(f["gen_gflop"] / 100.0, f["gen_gbyte"] / 10.0))
    assert f["floor_s"] == pytest.approx(f["gen_floor_s"] + f["train_floor_s"])
    # TRL's step is put against the same work at the rates measured around its own run
    assert floor_at(f, 100.0, 10.0) == pytest.approx(f["floor_s"])
    assert floor_at(f, 200.0, 20.0) == pytest.approx(f["floor_s"] / 2)
