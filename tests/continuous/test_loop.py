"""The continuous loop end to end at smoke scale, as a user drives it: the Python API and the
CLI over one run folder, environments dropped into the inbox, a running `python -m
ptrain.serve` that gets each promoted model, a judge served over HTTP whose calibration is
re-scored every round, a promotion, a rejection, an idle re-launch, a rollback, and a
SIGTERM and a `kill -9` in the middle of a round."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import ptrain
from ptrain.continuous import ledger
from ptrain.serve.in_process import serving
from tests.rollout.test_serve_process import start_server

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = ["scale=smoke", "logging.console=false", "logging.tensorboard=false"]
SUBTRACTION = "kind: arithmetic\nn_train: 16\nn_eval: 4\noptions: {ops: ['-'], min_digits: 2, max_digits: 2}\n"
ADDITION = "kind: arithmetic\nn_train: 16\nn_eval: 4\noptions: {ops: ['+'], min_digits: 3, max_digits: 3}\n"


# The judge: a GenRM behind an OpenAI-compatible endpoint that scores a response 5 when it
# says "helpful" and 1 otherwise, until a redeployment (JUDGE["inverted"]) flips its taste.
JUDGE = {"inverted": False}
CALIBRATION = [
    {"messages": [{"role": "user", "content": f"Question {k}?"}], "response_1": first, "response_2": second,
     "better": better}
    for k, (first, second, better) in enumerate([("A helpful answer.", "No.", 1), ("Maybe.", "A helpful reply.", 2)])
]  # fmt: skip


async def _judge_chat(request: Request) -> JSONResponse:
    content = (await request.json())["messages"][0]["content"]
    answers = [re.search(rf"<response_{i}>\n(.*?)\n</response_{i}>", content, re.S).group(1) for i in (1, 2)]
    s1, s2 = (5 if ("helpful" in a) != JUDGE["inverted"] else 1 for a in answers)
    verdict = {"score_1": s1, "score_2": s2, "ranking": 2 if s1 > s2 else 5 if s2 > s1 else 3}
    message = {"role": "assistant", "content": json.dumps(verdict)}
    return JSONResponse({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})


@pytest.fixture(scope="module")
def judge_url():
    with serving(Starlette(routes=[Route("/v1/chat/completions", _judge_chat, methods=["POST"])])) as url:
        yield url


def served_version(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=10).json()["weight_version"]


def leaderboard(run_dir: str) -> list[dict]:
    return ledger.read_jsonl(os.path.join(run_dir, "leaderboard.jsonl"))


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("continuous")
    inbox, run_dir = base / "inbox", str(base / "R")
    inbox.mkdir()
    calibration = base / "calibration.jsonl"
    calibration.write_text("".join(json.dumps(row) + "\n" for row in CALIBRATION))
    # The calibration set is named before any judge environment exists: rounds skip it until one arrives.
    judged = [f"continuous.judge_calibration={calibration}"]
    first = ptrain.continuous("continuous", [*SMOKE, *judged], inbox=str(inbox), run_dir=run_dir, until_idle=True)
    return base, inbox, run_dir, first, judged


def test_round_zero_makes_the_base_the_champion(loop_run):
    base, inbox, run_dir, first, _ = loop_run
    assert first.stopped == "idle" and [r["round"] for r in first.rounds] == [0]
    (row,) = leaderboard(run_dir)
    assert row["decision"] == "promoted" and set(row["envs"]) == {"arithmetic"}
    assert row["envs"]["arithmetic"]["n"] == 4
    assert os.path.realpath(os.path.join(run_dir, "champion")) == os.path.realpath(
        os.path.join(run_dir, "stages", "sft", "export")
    )
    assert row["cost_usd"]["total"] > 0 and row["cost_usd"]["eval"] > 0  # list prices by default
    assert os.path.isfile(os.path.join(run_dir, "leaderboard.png"))
    manifest = json.load(open(os.path.join(run_dir, "rounds", "0", "manifest.json")))
    assert manifest["decision"] == "promoted" and manifest["envs"]["arithmetic"]["spec"]["seed"] is not None


def test_promotion_rejection_idle_relaunch_and_rollback(loop_run, judge_url, tmp_path):
    base, inbox, run_dir, _, judged = loop_run
    server = start_server(os.path.join(run_dir, "champion"), str(tmp_path / "server.log"))
    try:
        # Two arrivals and a broken file: the file is rejected, the round runs, and with
        # improve=none (non-inferior suffices) the challenger is promoted and pushed. The judge
        # arrives with this round, so the champion's calibration is measured here too.
        (inbox / "subtraction.yaml").write_text(SUBTRACTION)
        (inbox / "judge.yaml").write_text(
            f"kind: judge\nn_train: 8\nn_eval: 4\noptions: {{judge: openai, judge_url: '{judge_url}', judge_model: genrm}}\n"
        )
        (inbox / "broken.yaml").write_text("kind: nonsense\n")
        result = ptrain.continuous(
            "continuous", [*SMOKE, *judged, "continuous.improve=none", f"continuous.serve_urls=[{server.url}]"],
            inbox=str(inbox), run_dir=run_dir, max_rounds=1,
        )  # fmt: skip
        assert result.stopped == "max_rounds"  # one training round, then out without waiting
        (row,) = result.rounds
        assert row["round"] == 1 and row["decision"] == "promoted", row["reasons"]
        assert row["new_envs"] == ["judge", "subtraction"] and row["targets"] == ["judge", "subtraction"]
        assert set(row["envs"]) == {"arithmetic", "judge", "subtraction"}
        assert row["judge"] == {"champion": 1.0, "challenger": 1.0, "drop": 0.0}
        for key in ("champion", "challenger", "delta", "ci_low", "ci_high", "n"):
            assert key in row["envs"]["subtraction"]
        assert set(row["cost_usd"]) == {"sample", "train", "eval", "judge", "total"} and row["cost_usd"]["train"] > 0
        assert row["tokens"]["output"] > 0 and row["cum_cost_usd"] > row["cost_usd"]["total"]
        assert {t["name"] for t in row["tripwires"]} >= {"format_errors", "abstentions", "length_ratio", "kl"}
        # The defaults are list prices: the GRPO stage's own cost metric is a real number too.
        grpo_metrics = ledger.read_jsonl(os.path.join(run_dir, "rounds", "1", "stages", "grpo", "metrics.jsonl"))
        assert [r["train/cost/total_usd"] for r in grpo_metrics if "train/cost/total_usd" in r][-1] > 0
        round1 = os.path.join(run_dir, "rounds", "1", "stages", "grpo", "export")
        assert os.path.realpath(os.path.join(run_dir, "champion")) == os.path.realpath(round1)
        assert row["push"][0]["ok"] and served_version(server.url) == "round-1"
        assert os.path.isfile(inbox / "rejected" / "broken.yaml.error")
        assert "unknown environment kind" in (inbox / "rejected" / "broken.yaml.error").read_text()

        # A round that must improve every target and cannot (smoke-scale scores are all 0):
        # rejected with the reason, the champion and the served model unchanged.
        # The judge is redeployed between rounds and now prefers the worse response: its
        # calibration agreement falls from 1 to 0, which blocks promotion on its own.
        JUDGE["inverted"] = True
        (inbox / "addition.yaml").write_text(ADDITION)
        result = ptrain.continuous(
            "continuous", [*SMOKE, *judged, "continuous.improve=all", f"continuous.serve_urls=[{server.url}]"],
            inbox=str(inbox), run_dir=run_dir, until_idle=True,
        )  # fmt: skip
        (row,) = result.rounds
        assert row["decision"] == "rejected" and "no improvement" in row["reasons"][0]
        assert row["judge"] == {"champion": 1.0, "challenger": 0.0, "drop": 1.0}
        assert "the judge's calibration agreement fell by 1.000" in row["reasons"][-1]
        assert row["reward_gain_per_usd"] == 0.0 and row["champion"] == round1
        assert os.path.realpath(os.path.join(run_dir, "champion")) == os.path.realpath(round1)
        assert served_version(server.url) == "round-1"
        # The old champion was scored on the new environment in this round; the next round reuses it.
        assert os.path.isfile(os.path.join(run_dir, "rounds", "2", "stages", "eval_champion", "scores.json"))

        # Nothing new: the same command again trains nothing and writes no round.
        before = sorted(os.listdir(os.path.join(run_dir, "rounds")))
        result = ptrain.continuous("continuous", [*SMOKE, f"continuous.serve_urls=[{server.url}]"], inbox=str(inbox),
                                   run_dir=run_dir, until_idle=True)  # fmt: skip
        assert result.rounds == [] and sorted(os.listdir(os.path.join(run_dir, "rounds"))) == before
        assert [r["round"] for r in leaderboard(run_dir)] == [0, 1, 2]

        # Rollback from the shell: round 0's champion again, pushed, logged.
        out = subprocess.run([sys.executable, "-m", "ptrain.continuous", "rollback", run_dir], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr
        base_export = os.path.join(run_dir, "stages", "sft", "export")
        assert os.path.realpath(os.path.join(run_dir, "champion")) == os.path.realpath(base_export)
        assert served_version(server.url) == "rollback-1-round-0"
        state = ledger.load_state(run_dir)
        assert state["champion_round"] == 0 and state["champion"] == os.path.abspath(base_export)
        (log,) = ledger.read_jsonl(os.path.join(run_dir, "rollbacks.jsonl"))
        assert log["from_round"] == 1 and log["to_round"] == 0 and log["push"][0]["ok"]
        out = subprocess.run([sys.executable, "-m", "ptrain.continuous", "rollback", run_dir], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 2 and "no earlier champion" in out.stderr
        status = subprocess.run([sys.executable, "-m", "ptrain.continuous", "status", run_dir], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert "round   2 rejected" in status.stdout
    finally:
        JUDGE["inverted"] = False
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)


def wait_for_checkpoint(proc, ckpt: str, step: int, log) -> None:
    deadline = time.monotonic() + 600
    while not (os.path.isdir(ckpt) and any(d.isdigit() and int(d) >= step for d in os.listdir(ckpt))):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of step {step}"
        time.sleep(0.2)


def test_sigterm_and_kill_9_mid_round_each_resume_the_round(tmp_path):
    inbox, run_dir = tmp_path / "inbox", str(tmp_path / "R")
    inbox.mkdir()
    (inbox / "subtraction.yaml").write_text(SUBTRACTION)
    cmd = [sys.executable, "-m", "ptrain", "recipe=continuous", *SMOKE, f"continuous.inbox={inbox}",
           f"run_dir={run_dir}", "continuous.until_idle=true", "continuous.improve=none", "train.steps=6"]  # fmt: skip
    ckpt = os.path.join(run_dir, "rounds", "1", "stages", "grpo", "checkpoints")

    def undecided() -> None:
        state = ledger.load_state(run_dir)
        assert state["current"]["round"] == 1
        assert not os.path.isfile(os.path.join(run_dir, "rounds", "1", "decision.json"))

    # SIGTERM: the loop leaves at once, cleanly, and says how to resume
    log = tmp_path / "first.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_for_checkpoint(proc, ckpt, 2, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert "stopped; launch the same command again to resume" in log.read_text()
    undecided()
    # kill -9 in the resumed round: no handler runs
    log = tmp_path / "second.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_for_checkpoint(proc, ckpt, 4, log)
    proc.kill()
    proc.wait()
    undecided()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resum" in out.stdout + out.stderr  # the GRPO stage picked up its checkpoint
    assert [r["round"] for r in leaderboard(run_dir)] == [0, 1]
    steps = [r["step"] for r in ledger.read_jsonl(os.path.join(ckpt, "..", "metrics.jsonl")) if "train/loss" in r]
    assert steps[-1] == 6 and ledger.load_state(run_dir)["current"] is None
