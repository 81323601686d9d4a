"""NeMo Gym's old and new resources-server protocols, against real servers of nemo-gym 0.4.0 and 0.7.0.

Both releases run from venvs of their own (tools/nemo_gym_servers.py; 0.7.0 declares Python
>= 3.13.14 and is installed with --ignore-requires-python, its code runs on 3.11). Checked
against each release's own servers, and where it matters against NeMo Gym's own client code
(`tools/nemo_gym_servers.py --agent-verify`: the simple agent's seed and verify bodies, sent
with NeMo Gym's own HTTP client):

  - null task fields: a row whose expected call holds `"units": null` reaches the verifier
    as NeMo Gym's agent sends it (the verifier reads the null: with it dropped the same
    call scores differently), in a training episode and through `reverify`;
  - 0.7's session protocol: the session seed body where the server's seed takes it (read
    from its OpenAPI document), the row where it does not, /close_session after every
    episode (the server then refuses to seed that session again), nothing of it on 0.4;
  - mask_sample: 0.7's math_with_judge with its judge on and no judge to reach answers a
    wrong library answer with mask_sample true and failure_kind judge_failed; the sample is
    masked, named in the audit record and the metrics, and the GRPO batch neither trains on
    it nor counts it in its group's baseline (on 0.4 the same failure is a 500);
  - 0.7's verifier fixtures (tests/verifier_cases.jsonl) through `reverify`.

Without the package registry the venvs cannot be built and these tests skip, naming the
command that builds them; in CI (CI=true) they fail instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.audit import AuditLog, read_audit
from ptrain.envs.base import Task, Trajectory
from ptrain.envs.nemo_gym import (
    NemoGymEnv,
    SessionIds,
    model_calls,
    output_items,
    read_verdict,
    recorded_verify_body,
    responses_response,
    takes_session_seed,
    verify_record,
)
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine
from tests.envs.test_nemo_gym import started
from tools.nemo_gym_servers import NEMO_GYM_VERSION, STAMP, SetupError, ensure_venv, server_dir, setup_command

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "nemo_gym_servers.py"
OLD, NEW = NEMO_GYM_VERSION, "0.7.0"
SERVERS = {
    OLD: ("example_single_tool_call", "example_tool_call_multireward", "math_with_judge"),
    NEW: ("example_single_tool_call", "example_session_state_mgmt", "example_tool_call_multireward", "math_with_judge"),
}
START_TIMEOUT_S = 180


def _setup(version: str) -> None:
    flag = [] if version == OLD else ["--nemo-gym-version", version]
    proc = subprocess.run([sys.executable, str(TOOL), *flag, "--setup", *SERVERS[version]], capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        message = (
            f"NeMo Gym {version}'s servers run from a venv of their own, which could not be built here:\n"
            f"{proc.stderr.strip()[-1500:]}\nBuild it with: {setup_command(list(SERVERS[version]), version=version)}"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def venvs() -> None:
    """Both releases' venvs with the servers these tests start (built once, then reused)."""
    _setup(OLD)
    _setup(NEW)


@dataclass
class Server:
    name: str
    version: str
    url: str
    folder: Path


def serve(name: str, version: str, log_dir: Path, *overrides: str):
    """Start `tools/nemo_gym_servers.py [--nemo-gym-version V] NAME` and wait for its URL."""
    flag = [] if version == OLD else ["--nemo-gym-version", version]
    cmd = [sys.executable, str(TOOL), *flag, name] + [arg for o in overrides for arg in ("--set", o)]
    with started(cmd, f"{name} ({version})", log_dir / f"{name}-{version}.log", START_TIMEOUT_S) as url:
        yield Server(name, version, url, server_dir(name, version=version))


@pytest.fixture(scope="module", params=[OLD, NEW])
def multireward(venvs, request, tmp_path_factory):
    yield from serve("example_tool_call_multireward", request.param, tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def single_old(venvs, tmp_path_factory):
    yield from serve("example_single_tool_call", OLD, tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def single_new(venvs, tmp_path_factory):
    yield from serve("example_single_tool_call", NEW, tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def session_new(venvs, tmp_path_factory):
    yield from serve("example_session_state_mgmt", NEW, tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module", params=[OLD, NEW])
def judge_on(venvs, request, tmp_path_factory):
    """math_with_judge with its LLM judge on and no judge to reach: the launcher gives the server
    no client to NeMo Gym's other servers, so every judge call fails (an AttributeError inside
    the call, which 0.7's judge failsafe reports as failure_kind judge_failed)."""
    yield from serve("math_with_judge", request.param, tmp_path_factory.mktemp("logs"), "should_use_judge=true")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


def make_env(tok, url: str, rows: str, **options) -> NemoGymEnv:
    cfg = EnvConfig(kind="nemo_gym", n_train=10, n_eval=0, options={"url": url, "rows": rows, **options})
    return NemoGymEnv(cfg, validate_env_config(cfg), tokenizer=tok)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run(env: NemoGymEnv, task, engine, **sampling) -> list[Trajectory]:
    sampling.setdefault("max_new_tokens", 256)
    return asyncio.run(env.rollout(task, engine, SamplingParams(**sampling)))


def sent_response(t: Trajectory) -> dict:
    """The Responses object ptrain sent to /verify for an episode without tool answers."""
    items = output_items(model_calls(t.token_ids, t.logprobs, t.turns), {})
    usage = {"input_tokens": t.tokens.prompt_uncached, "output_tokens": t.tokens.output}
    return responses_response(t.task.data["responses_create_params"], items, usage=usage)


def agent_verify(server: Server, row: dict, response: dict, tmp_path: Path) -> dict:
    """What NeMo Gym's own simple agent and client get from the server for this row and response."""
    (tmp_path / "row.json").write_text(json.dumps(row))
    (tmp_path / "response.json").write_text(json.dumps(response))
    flag = [] if server.version == OLD else ["--nemo-gym-version", server.version]
    proc = subprocess.run(
        [sys.executable, str(TOOL), *flag, "--agent-verify", server.url, str(tmp_path / "row.json"),
         str(tmp_path / "response.json")], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seed_status"] == 200 and out["status"] == 200, out
    return out["answer"]


def reverify(server: Server, rollouts: Path, *extra: str) -> tuple[list[dict], str, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "ptrain.envs.nemo_gym", "reverify", "--url", server.url, *extra, str(rollouts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    return [json.loads(x) for x in lines[:-1]], (lines[-1] if lines else ""), proc


# ----------------------------------------------------------------------------- rows with nulls


NULL_ROW = {
    "responses_create_params": {
        "input": [
            {"role": "developer", "content": "Answer with exactly one get_weather tool call and no other text."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
        "tools": [{
            "type": "function", "name": "get_weather", "description": "Get the current weather for a city.", "strict": False,
            "parameters": {"type": "object", "required": ["city"], "properties": {
                "city": {"type": "string"}, "units": {"type": ["string", "null"]}}},
        }],
    },
    # The call must name Paris and must not set units: example_tool_call_multireward compares
    # every expected argument, so a null one matches only a call whose units are null or absent.
    "expected_call": {"name": "get_weather", "arguments": {"city": "Paris", "units": None}},
    "difficulty": None,
}  # fmt: skip


def without_nulls(value):
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def test_null_task_fields_reach_the_verifier_as_nemo_gyms_agent_sends_them(tok, multireward, tmp_path):
    """ptrain's episode, NeMo Gym's own agent and `reverify` all get the server's reward for the
    row as it is; the verifier reads the null (without it the units call would be correct)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(NULL_ROW) + "\n")
    env = make_env(tok, multireward.url, str(rows), max_turns=1)  # the call is the whole response
    task = env.tasks("train", seed=0)[0]
    assert task.data["expected_call"]["arguments"] == {"city": "Paris", "units": None}
    rid = f"{env.name}/{task.id}"
    engine = ReplayEngine({
        f"{rid}/s0/t0": [call("get_weather", city="Paris")],
        f"{rid}/s1/t0": [call("get_weather", city="Paris", units="fahrenheit")],
    }, tokenizer=tok)  # fmt: skip
    plain, units = run(env, task, engine, n=2)
    assert plain.reward_components == {"correctness": 1.0, "schema_valid": 1.0, "format": 1.0}
    assert units.reward_components == {"correctness": 0.0, "schema_valid": 1.0, "format": 1.0}
    assert (plain.reward, units.reward) == (3.0, 2.0)
    # NeMo Gym's own simple agent and client, with the same row and the response ptrain sent.
    answer = agent_verify(multireward, NULL_ROW, sent_response(units), tmp_path)
    assert answer["reward"] == units.reward == 2.0 and answer["correctness"] == 0.0
    assert agent_verify(multireward, without_nulls(NULL_ROW), sent_response(units), tmp_path)["reward"] == 3.0

    # A recorded rollout whose task row holds the nulls (the row, the response, the reward)
    # verifies to the recorded reward through reverify, with and without the example row.
    recorded = {**NULL_ROW, "response": answer["response"], "reward": answer["reward"],
                "reward_components": answer["reward_components"]}  # fmt: skip
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps(recorded) + "\n")
    for extra in ([], ["--rows", str(rows)]):
        results, last, proc = reverify(multireward, rollouts, *extra)
        assert proc.returncode == 0, (proc.stderr, results)
        assert results[0]["reward"] == 2.0 and results[0]["matches_recorded"], results
        assert last == "mean_reward 2.0"


def test_recorded_verify_body_keeps_task_nulls_and_drops_only_null_request_parameters():
    rollout = {**NULL_ROW, "responses_create_params": {**NULL_ROW["responses_create_params"],
                                                       "parallel_tool_calls": None, "temperature": None},
               "response": {"output": []}, "reward": 2.0, "reward_components": {"a": 2.0}, "mask_sample": False,
               "failure_kind": None, "failure_reason": None, "correctness": 0.0}  # fmt: skip
    body = recorded_verify_body(rollout)
    assert body["expected_call"]["arguments"]["units"] is None and body["difficulty"] is None
    assert "parallel_tool_calls" not in body["responses_create_params"]
    assert body["responses_create_params"]["tools"] == NULL_ROW["responses_create_params"]["tools"]
    assert not {"reward", "reward_components", "mask_sample", "failure_kind", "failure_reason"} & set(body)
    assert body["correctness"] == 0.0  # an answer field the verifier ignores goes back as NeMo Gym's would
    # With the example row: the row exactly as it is, plus the recorded response.
    assert recorded_verify_body(rollout, NULL_ROW) == {**NULL_ROW, "response": {"output": []}}


# ----------------------------------------------------------------------------- the session protocol


def example_rows(server: Server) -> str:
    return str(server.folder / "data" / "example.jsonl")


def test_a_0_7_server_gets_the_session_seed_and_is_closed_after_the_episode(tok, single_new):
    env = make_env(tok, single_new.url, example_rows(single_new))
    task = env.tasks("train", seed=0)[0]
    rid = f"{env.name}/{task.id}"
    engine = ReplayEngine({
        f"{rid}/s0/t0": [call("get_weather", city="San Francisco")], f"{rid}/s0/t1": ["It is cold."],
        f"{rid}/s1/t0": ["I cannot check the weather."],
    }, tokenizer=tok)  # fmt: skip
    called, text_only = run(env, task, engine, n=2)
    assert env.seed_body == "session" and env.has_close_session
    # 0.7's verifier: 1.0 for a get_weather call, 0.0 for text alone (0.4's gave 1.0 to both).
    assert (called.reward, text_only.reward) == (1.0, 0.0)
    assert [(u.role, u.tool) for u in called.turns] == [
        ("env", "seed_session"), ("policy", None), ("tool", "get_weather"), ("policy", None), ("env", "verify"),
        ("env", "close_session")]  # fmt: skip
    seeded = json.loads(called.turns[0].text)
    assert seeded["resources_session_id"].startswith("ptrain-") and seeded["resources_tools"] is None
    closed = json.loads(called.turns[-1].text)
    assert closed == {"resources_session_id": seeded["resources_session_id"]}
    assert json.loads(text_only.turns[0].text)["resources_session_id"] != seeded["resources_session_id"]
    assert called.metrics["close_errors"] == 0 and env.stats["close_errors"] == 0
    # The server did close it: the same session cannot be seeded again (0.7 answers 500).
    import httpx

    again = {"resources_session_id": seeded["resources_session_id"], "task_id": {"taskset": env.name, "task_id": task.id},
             "episode_id": {"rollout_id": seeded["resources_session_id"], "attempt": 0}, "task_data": dict(task.data)}  # fmt: skip
    assert httpx.post(f"{single_new.url}/seed_session", json=again).status_code == 500
    # The row itself is still a seed this server takes (what NeMo Gym's simple agent sends).
    env = make_env(tok, single_new.url, example_rows(single_new), seed_body="legacy")
    (t,) = run(env, task, ReplayEngine([call("get_weather", city="Paris"), "Cold."], tokenizer=tok))
    assert t.reward == 1.0 and t.turns[0].text == "{}" and t.turns[-1].tool == "close_session"


def test_a_0_7_server_whose_seed_reads_row_fields_gets_the_row_and_is_closed(tok, session_new):
    env = make_env(tok, session_new.url, example_rows(session_new))
    task = env.tasks("train", seed=0)[0]  # add 1 then add 2 then get the count; starts at 3
    script = [call("increment_counter", count=1) + call("increment_counter", count=2), call("get_counter_value"),
              "The count is 6."]  # fmt: skip
    (t,) = run(env, task, ReplayEngine(script, tokenizer=tok))
    assert env.seed_body == "legacy" and t.reward == 1.0
    assert t.turns[0].tool == "seed_session" and t.turns[-1].tool == "close_session" and t.turns[-1].error is None
    # Asked for the session body, it refuses it (its seed model requires initial_count): named.
    env = make_env(tok, session_new.url, example_rows(session_new), seed_body="session")
    (t,) = run(env, task, ReplayEngine(["6"], tokenizer=tok))
    assert t.finish_reason == "error" and t.error.startswith(f"POST {session_new.url}/seed_session answered 422")
    assert "initial_count" in t.error


def test_a_0_4_server_gets_the_row_and_no_close(tok, single_old):
    env = make_env(tok, single_old.url, example_rows(single_old))
    task = env.tasks("train", seed=0)[0]
    (t,) = run(env, task, ReplayEngine([call("get_weather", city="Paris"), "Cold."], tokenizer=tok))
    assert t.reward == 1.0 and t.error is None
    assert env.seed_body == "legacy" and not env.has_close_session  # 404 once, then never asked again
    assert [u.tool for u in t.turns if u.role == "env"] == ["seed_session", "verify"]
    assert env.stats["close_errors"] == 0 and t.metrics["close_errors"] == 0
    # 0.4's seed ignores fields it does not know, so it would swallow the session body without
    # seeding anything: asked for it, the episode fails and says what to set.
    env = make_env(tok, single_old.url, example_rows(single_old), seed_body="session")
    (t,) = run(env, task, ReplayEngine(["Cold."], tokenizer=tok))
    assert t.finish_reason == "error" and "does not echo resources_session_id" in t.error
    assert "options.seed_body=legacy" in t.error


def test_openapi_documents_of_both_releases_say_which_seed_they_take(single_old, single_new, session_new):
    import httpx

    docs = [httpx.get(f"{s.url}/openapi.json").json() for s in (single_old, single_new, session_new)]
    assert [takes_session_seed(d) for d in docs] == [False, True, False]
    assert not takes_session_seed({}) and not takes_session_seed({"paths": {"/seed_session": {}}})
    ids = SessionIds.new("env", "train-0")
    assert set(ids.body()) == {"resources_session_id", "episode_id"} and ids.episode_id["attempt"] == 0


def test_seed_body_option_is_checked(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(NULL_ROW) + "\n")
    with pytest.raises(EnvConfigError, match=r"options.seed_body': must be one of \['auto', 'legacy', 'session'\]"):
        validate_env_config(EnvConfig(kind="nemo_gym", options={"url": "http://127.0.0.1:8000", "rows": str(rows),
                                                                "seed_body": "new"}))  # fmt: skip


# ----------------------------------------------------------------------------- mask_sample


def test_a_failed_judge_masks_the_sample_on_0_7_and_is_a_server_error_on_0_4(tok, judge_on, tmp_path):
    from ptrain.config.advantages import AdvantageConfig
    from ptrain.losses.advantages import group_advantages
    from ptrain.stages.grpo.batch import measured_advantages, policy_batch

    env = make_env(tok, judge_on.url, example_rows(judge_on))
    task = env.tasks("train", seed=0)[0]  # expected answer 32
    rid = f"{env.name}/{task.id}"
    engine = ReplayEngine({
        f"{rid}/s0/t0": ["So there are \\boxed{32} such numbers."],  # math-verify says right: no judge
        f"{rid}/s1/t0": ["I get \\boxed{31}."],  # math-verify says wrong: the judge is asked, and fails
        f"{rid}/s2/t0": ["It is \\boxed{32}."],
        f"{rid}/s3/t0": ["I do not know."],  # 0.7: no \\boxed{} answer is 0, without asking the judge
    }, tokenizer=tok)  # fmt: skip
    group = run(env, task, engine, n=4)
    right, wrong = group[0], group[1]
    assert right.reward == 1.0 and not right.masked and right.metrics["masked"] == 0.0
    if judge_on.version == OLD:
        # 0.4 has no judge failsafe: the failed judge call is the server's 500.
        assert wrong.finish_reason == "error" and f"POST {judge_on.url}/verify answered 500" in wrong.error
        assert not wrong.masked and env.stats["masked"] == 0
        return
    assert group[3].reward == 0.0 and not group[3].masked and group[3].reward_error is None
    assert wrong.masked and wrong.failure_kind == "judge_failed" and wrong.finish_reason == "stop"
    assert (
        wrong.error is None
        and "masked the sample (mask_sample true, failure_kind 'judge_failed')" in wrong.reward_error
    )
    assert wrong.metrics["masked"] == 1.0 and wrong.metrics["failure_kind/judge_failed"] == 1.0
    record = verify_record(wrong)
    assert record["mask_sample"] is True and record["failure_kind"] == "judge_failed"
    assert record["failure_reason"] and record["failure_reason"] in wrong.reward_error
    assert env.stats["masked"] == 1
    # The audit log names it.
    with AuditLog(str(tmp_path / "audit.jsonl")) as audit:
        audit.write_all(group, step=0)
    records = list(read_audit(str(tmp_path / "audit.jsonl")))
    assert [r.get("masked", False) for r in records] == [False, True, False, False]
    assert records[1]["failure_kind"] == "judge_failed"
    assert records[1]["reward_error"].endswith(verify_record(wrong)["failure_reason"])

    # The GRPO batch: masked samples get no row and stay out of the group's baseline.
    cfg = AdvantageConfig()
    rewards = np.array([[t.reward for t in group]], np.float32)
    masked = np.array([[t.masked for t in group]])
    adv, aux = measured_advantages(rewards, masked, cfg=cfg, invalid_BxG=np.zeros_like(masked))
    three, _ = group_advantages(rewards[:, [0, 2, 3]], cfg=cfg)  # the measured samples alone
    np.testing.assert_allclose(adv[0, [0, 2, 3]], np.asarray(three)[0])
    assert adv[0, 1] == 0.0 and adv[0, 0] > 0 > adv[0, 3]
    assert float(aux.reward_mean) == pytest.approx(2 / 3)  # not 2 / 4: the masked 0 is no measurement
    batch, counts = policy_batch(group, adv[0], rows=4, seq_len=512)
    assert batch["row_valid"].tolist() == [1.0, 0.0, 1.0, 1.0] and counts["masked_samples"] == 1
    assert batch["loss_mask"][1].sum() == 0 and batch["loss_mask"][[0, 2, 3]].sum() > 0

    # Recorded, the masked rollout says so again through reverify, and counts in no mean.
    rollouts = tmp_path / "rollouts.jsonl"
    answers = [agent_verify(judge_on, dict(task.data), sent_response(t), tmp_path) for t in (right, wrong)]
    rollouts.write_text("".join(json.dumps(a) + "\n" for a in answers))
    results, last, proc = reverify(judge_on, rollouts, "--rows", example_rows(judge_on))  # answers lack `question`
    assert proc.returncode == 0, (proc.stderr, results)
    assert results[0]["reward"] == 1.0 and "masked" not in results[0]
    assert results[1]["masked"] is True and results[1]["failure_kind"] == "judge_failed"
    assert last == "mean_reward 1.0"


def mask_trajectory(reward: float, masked: bool, env: str = "e") -> Trajectory:
    return Trajectory(task=Task(env=env, id="t", messages=()), sample_index=0, token_ids=(1, 2, 3), prompt_length=1,
                      loss_mask=(0, 1, 1), logprobs=(0.0, -0.5, -0.5), reward=reward, masked=masked)  # fmt: skip


def test_measured_advantages_leave_masked_samples_out_of_the_baseline():
    from ptrain.config.advantages import AdvantageConfig
    from ptrain.losses.advantages import group_advantages

    cfg = AdvantageConfig()
    rewards = np.array([[1.0, 0.0, 0.5, 0.0], [1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]], np.float32)
    none = np.zeros(rewards.shape, bool)
    adv, aux = measured_advantages_of(rewards, none, cfg)
    ref, ref_aux = group_advantages(rewards, cfg=cfg)
    np.testing.assert_array_equal(adv, np.asarray(ref))  # nothing masked: group_advantages itself
    assert float(aux.reward_std) == float(ref_aux.reward_std)
    masked = np.array([[False, True, False, False], [False, False, False, False], [True, True, True, False]])
    adv, aux = measured_advantages_of(rewards, masked, cfg)
    first, _ = group_advantages(rewards[:1, [0, 2, 3]], cfg=cfg)
    np.testing.assert_allclose(adv[0, [0, 2, 3]], np.asarray(first)[0])
    assert adv[0, 1] == 0.0
    np.testing.assert_allclose(adv[1], np.asarray(group_advantages(rewards[1:2], cfg=cfg)[0])[0])
    assert adv[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # one measured sample: no baseline, no signal
    assert float(aux.frac_zero_std) == pytest.approx(1 / 3)  # group 2 has one measured sample
    assert float(aux.reward_mean) == pytest.approx(float(rewards[~masked].mean()))
    # With an advantage for invalid tool calls, a lone measured invalid sample still gets it.
    cfg = AdvantageConfig(invalid_tool_call_advantage=-5.0)
    invalid = np.zeros(rewards.shape, bool)
    invalid[2, 3] = True
    adv, _ = measured_advantages_of(rewards, masked, cfg, invalid)
    assert adv[2].tolist() == [0.0, 0.0, 0.0, -5.0]


def measured_advantages_of(rewards, masked, cfg, invalid=None):
    from ptrain.stages.grpo.batch import measured_advantages

    invalid = np.zeros(rewards.shape, bool) if invalid is None else invalid
    return measured_advantages(rewards, masked, cfg=cfg, invalid_BxG=invalid)


def test_the_grpo_metrics_count_masked_samples_per_environment_and_failure_kind():
    import dataclasses

    from ptrain.stages.grpo.batch import policy_batch

    ts = [mask_trajectory(1.0, False), mask_trajectory(0.0, True), mask_trajectory(0.0, False, "f")]
    ts[1] = dataclasses.replace(ts[1], failure_kind="judge_failed", reward_error="judge down")
    batch, counts = policy_batch(ts, [0.5, 0.0, -0.5], rows=4, seq_len=8)
    assert counts["masked_samples"] == 1 and batch["row_valid"].tolist() == [1.0, 0.0, 1.0, 0.0]
    record = ts[1].audit_record()
    assert record["masked"] is True and record["failure_kind"] == "judge_failed"
    assert "masked" not in ts[0].audit_record() and "failure_kind" not in ts[0].audit_record()


def test_verify_answers_with_mask_sample_and_failure_kind_are_read():
    sent = {"responses_create_params": {"input": "x"}, "expected": 1}
    judge = {"reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed", "failure_reason": "timed out",
             "_ng_failure_class": "judge_failed", "_ng_failure_judge_error": "timed out"}  # fmt: skip
    v = read_verdict(judge, sent, where="POST u/verify")
    assert v.masked and (v.failure_kind, v.failure_reason) == ("judge_failed", "timed out")
    assert (
        v.reward_error == "POST u/verify masked the sample (mask_sample true, failure_kind 'judge_failed'): timed out"
    )
    assert v.metrics == {"verify_failed": 1.0}  # mask_sample is `masked`, not a verify_ metric
    # A diagnosis on a valid measurement: kept, not an error, not masked.
    v = read_verdict({"reward": 1.0, "mask_sample": False, "failure_kind": "verifier_error", "failure_reason": "slow"},
                     sent, where="v")  # fmt: skip
    assert (v.reward, v.masked, v.reward_error, v.failure_kind) == (1.0, False, None, "verifier_error")
    v = read_verdict({"reward": 1.0, "mask_sample": "yes"}, sent, where="POST u/verify")
    assert v.masked and v.reward == 0.0 and 'mask_sample must be true or false, got "yes"' in v.reward_error
    # 0.4's answers have none of it.
    v = read_verdict({"reward": 1.0}, sent, where="v")
    assert (v.masked, v.failure_kind, v.failure_reason) == (False, None, None)
    # A 0.4-style failure class stands in for the kind.
    v = read_verdict({"reward": 0.0, "_ng_failure_class": "judge_failed"}, sent, where="v")
    assert not v.masked and v.failure_kind == "judge_failed" and "_ng_failure_class" in v.reward_error


# ----------------------------------------------------------------------------- 0.7's verifier fixtures


def test_0_7_verifier_cases_reverify_to_their_expected_rewards(single_new, tmp_path):
    cases = [json.loads(x) for x in (single_new.folder / "tests" / "verifier_cases.jsonl").read_text().splitlines()]
    assert [c["kind"] for c in cases] == ["full_reward", "zero_reward", "malformed"]
    rollouts = tmp_path / "cases.jsonl"
    rollouts.write_text("".join(json.dumps(c["request"]) + "\n" for c in cases))
    results, _, proc = reverify(single_new, rollouts, "--verify-only")
    assert [r.get("reward") for r in results[:2]] == [c["expected_reward"] for c in cases[:2]]
    assert "not a recorded rollout" in results[2]["error"] and proc.returncode == 1


# ----------------------------------------------------------------------------- the server tool


def test_the_server_tool_refuses_an_unknown_release_and_a_venv_of_another_release(tmp_path):
    bad = subprocess.run([sys.executable, str(TOOL), "--nemo-gym-version", "0.9.9", "--setup", "x"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "nemo-gym '0.9.9' is not one this tool sets up" in bad.stderr
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / STAMP).write_text(json.dumps({"base": {"nemo_gym": OLD, "packages": []}, "servers": {}}))
    with pytest.raises(SetupError, match=f"holds nemo-gym {OLD}, not {NEW}; each release needs a venv of its own"):
        ensure_venv([], venv, NEW)
    assert setup_command(["x"], version=NEW).endswith(f"--nemo-gym-version {NEW} --setup x")
