"""Command-line tools run on tiny inputs."""

import json
import subprocess
import sys

import pytest

from tools import plot_run


def test_plot_run_writes_one_png_per_metric(tmp_path):
    stage = tmp_path / "stages" / "sft"
    stage.mkdir(parents=True)
    recs = [{"step": s, "time": s, "train/loss": 3.0 / s, "train/lr": 0.1} for s in range(1, 6)]
    recs.append({"step": 5, "time": 6, "eval/loss": 0.9, "eval/exact_match": 0.5})
    (stage / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut by a kil")
    assert plot_run.main([str(tmp_path)]) == 0
    names = sorted(p.name for p in (stage / "plots").iterdir())
    assert names == ["exact_match.png", "loss.png", "lr.png"]
    assert (stage / "plots" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_run_says_what_to_pass_when_there_is_nothing(tmp_path, capsys):
    assert plot_run.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_bench_train_runs_on_a_tiny_shape():
    out = subprocess.run(
        [
            sys.executable,
            "tools/bench_train.py",
            "--layers",
            "1",
            "--d-model",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--d-ff",
            "128",
            "--vocab",
            "128",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--peak-n",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["tokens_per_s"] > 0 and 0 < res["mfu"] < 1.5


def test_bench_train_reports_memory_per_device_against_length_with_the_sequence_split():
    shape = "--layers 1 --d-model 32 --heads 2 --kv-heads 2 --head-dim 16 --d-ff 64 --vocab 128".split()
    args = [*shape, "--seq-len", "256,512", "--context", "2", "--device-memory-gib", "0.03"]
    out = subprocess.run([sys.executable, "tools/bench_train.py", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    one, split = res["rows"]["1"], res["rows"]["2"]
    assert [r["seq_len"] for r in one] == [r["seq_len"] for r in split] == [32, 256, 512]  # 16 x context: the base
    # the split holds less at the longest length, and the one-device step grows faster with length
    assert split[-1]["peak_mib"] < one[-1]["peak_mib"]
    assert one[-1]["activations_mib"] > split[-1]["activations_mib"]
    for n, rows in (("1", one), ("2", split)):
        fits = [r["seq_len"] for r in rows if r["peak_mib"] <= 0.03 * 1024]
        assert res["longest_within_budget"][n] == max(fits, default=None)
    bad = subprocess.run([sys.executable, "tools/bench_train.py", "--seq-len", "100", "--context", "3"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "do not split over --context 3" in bad.stderr


def test_bench_train_compares_full_fine_tuning_with_lora():
    tiny = "--layers 1 --d-model 64 --heads 2 --kv-heads 1 --head-dim 32 --d-ff 128 --vocab 128 --batch 2 --seq 32"
    args = [*tiny.split(), "--steps", "1", "--warmup", "0", "--peak-n", "256", "--lora", "4"]
    out = subprocess.run([sys.executable, "tools/bench_train.py", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout[out.stdout.index("\n{") :])
    full, lora = rows["full"], rows["lora r=4"]
    assert lora["lora_rank"] == 4 and full["lora_rank"] == 0
    assert lora["trainable_M"] < full["trainable_M"] / 5 and lora["opt_state_MiB"] < full["opt_state_MiB"] / 5
    assert lora["tokens_per_s"] > 0 and full["params_M"] == lora["params_M"]


def test_bench_dpo_runs_on_a_tiny_shape():
    out = subprocess.run(
        [
            sys.executable,
            "tools/bench_dpo.py",
            "--layers",
            "1",
            "--d-model",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--d-ff",
            "128",
            "--vocab",
            "128",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "1",
            "--warmup",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["step_s_median"] > 0 and res["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference


def test_bench_train_torch_runs_on_a_tiny_shape():
    out = subprocess.run(
        [
            sys.executable,
            "tools/bench_train_torch.py",
            "--layers",
            "1",
            "--d-model",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--d-ff",
            "128",
            "--vocab",
            "128",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["tokens_per_s"] > 0


def test_bench_vs_torch_reports_a_ratio_per_round():
    out = subprocess.run(
        [
            sys.executable,
            "tools/bench_vs_torch.py",
            "--rounds",
            "1",
            "--grad-accum",
            "2",
            "--layers",
            "1",
            "--d-model",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--d-ff",
            "128",
            "--vocab",
            "128",
            "--batch",
            "2",
            "--seq",
            "32",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--peak-n",
            "256",
            "--untuned",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    (row,) = summary["rounds"]
    for label in ("ga2", "ga2_untuned"):  # the step with and without ptrain's XLA:CPU flag
        assert row[f"ratio_{label}"] == pytest.approx(
            row["torch"]["step_s_median"] / row[f"ptrain_{label}"]["step_s_median"], rel=1e-2
        )
        assert summary[f"median_ratio_{label}"] == row[f"ratio_{label}"] > 0


def test_plot_run_draws_every_environments_reward_on_one_figure(tmp_path):
    rows = [
        {"step": 0, "eval/countdown/reward": 0.1, "eval/math/reward": 0.2, "eval/reward": 0.15},
        {"step": 1, "train/reward/countdown/mean": 0.3, "train/reward/math/mean": 0.1},
        {"step": 2, "train/reward/countdown/mean": 0.4, "train/reward/math/mean": 0.2,
         "eval/countdown/reward": 0.3, "eval/math/sampled/reward": 0.25},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_run.plot(str(tmp_path / "metrics.jsonl"), str(tmp_path / "plots"), None)
    assert str(tmp_path / "plots" / "rewards_by_env.png") in written
    labels = {plot_run._env_reward(k) for r in rows for k in r}
    assert {"countdown train", "math train", "countdown held-out", "math held-out", "math held-out, sampled"} <= labels
    assert plot_run._env_reward("eval/reward") is None and plot_run._env_reward("eval/sampled/reward") is None
