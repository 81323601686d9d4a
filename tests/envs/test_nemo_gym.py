"""NeMo Gym's resources-server protocol, against NeMo Gym's own servers from the nemo-gym wheel.

The servers run as separate processes from their own venv (tools/nemo_gym_servers.py builds
it once and caches it): example_single_tool_call (one tool, constant reward),
example_session_state_mgmt (a counter kept per session cookie), math_with_judge
(math-verify; its LLM judge is off in its config) and example_tool_call_multireward
(reward_components: correctness, schema_valid, format). Episodes are scripted through the
ReplayEngine with known tool calls and answers, so each reward is what the server says for
them; one episode runs on a real LocalEngine with a tiny random model (the protocol is
checked, not the reward). Without the package registry the venv cannot be built and these
tests skip, naming the command that builds it; in CI (CI=true) they fail instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import math
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.config.env_nemo_gym import NemoGymOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.base import Trajectory
from ptrain.envs.multi_turn import ChatFormat
from ptrain.envs.nemo_gym import (
    NemoGymEnv,
    RowError,
    model_calls,
    output_items,
    read_verdict,
    split_policy_text,
    verify_record,
)
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine
from tests.envs.chat_templates import QWEN25
from tools.nemo_gym_servers import server_dir, setup_command

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "nemo_gym_servers.py"
SERVERS = ("example_single_tool_call", "example_session_state_mgmt", "math_with_judge", "example_tool_call_multireward")
START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def nemo_gym_venv() -> None:
    """The NeMo Gym venv with what the three servers need (built once, then reused)."""
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--setup", *SERVERS], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        message = (
            f"NeMo Gym's servers run from a venv of their own, which could not be built here:\n"
            f"{proc.stderr.strip()[-1500:]}\nBuild it with: {setup_command(list(SERVERS))}"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class Server:
    name: str
    url: str
    folder: Path

    @property
    def rows(self) -> str:
        return str(self.folder / "data" / "example.jsonl")

    @property
    def rollouts(self) -> str:
        return str(self.folder / "data" / "example_rollouts.jsonl")


@contextlib.contextmanager
def started(cmd: list[str], label: str, log_path: Path, timeout_s: float = START_TIMEOUT_S):
    """Run a `tools/nemo_gym_servers.py` command line (stderr to `log_path`), give the URL it
    prints on stdout once up, and stop it afterwards."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    url = ""
    while not url and time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.5):
            url = proc.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        proc.wait()
        pytest.fail(f"{label} did not start within {timeout_s} s:\n{log_path.read_text()[-2000:]}")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(name: str, log_dir: Path, *overrides: str):
    """Start `python tools/nemo_gym_servers.py NAME [--set KEY=VALUE ...]` and wait for the URL it prints."""
    cmd = [sys.executable, str(TOOL), name] + [arg for o in overrides for arg in ("--set", o)]
    with started(cmd, name, log_dir / f"{name}.log") as url:
        yield Server(name, url, server_dir(name))


@pytest.fixture(scope="module")
def single_tool(nemo_gym_venv, tmp_path_factory):
    yield from serve("example_single_tool_call", tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def session_state(nemo_gym_venv, tmp_path_factory):
    yield from serve("example_session_state_mgmt", tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def math_judge(nemo_gym_venv, tmp_path_factory):
    # math-verify's comparison of one recorded answer (powers of 2 +- sqrt(3) to the 2016th)
    # takes seconds; on a busy shared CPU the server's default 10 s limit can cut it and score 0.
    yield from serve("math_with_judge", tmp_path_factory.mktemp("logs"), "library_verifier_timeout_seconds=120")


@pytest.fixture(scope="module")
def multireward(nemo_gym_venv, tmp_path_factory):
    yield from serve("example_tool_call_multireward", tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


@pytest.fixture(scope="module")
def qwen_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = QWEN25
    return t


def make_env(tok, url: str, rows: str, *, n_eval: int = 0, **options) -> NemoGymEnv:
    cfg = EnvConfig(kind="nemo_gym", n_train=10, n_eval=n_eval, options={"url": url, "rows": rows, **options})
    opts = validate_env_config(cfg)
    return NemoGymEnv(cfg, opts, tokenizer=tok)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run(env: NemoGymEnv, task, engine, **sampling) -> list[Trajectory]:
    sampling.setdefault("max_new_tokens", 256)
    return asyncio.run(env.rollout(task, engine, SamplingParams(**sampling)))


def check_alignment(t: Trajectory, engine: ReplayEngine | None = None) -> None:
    """Policy spans carry mask 1 and the engine's log-probs, everything else mask 0 and
    log-prob 0; the turns tile the response; each request was the episode so far."""
    n = len(t.token_ids)
    assert len(t.loss_mask) == len(t.logprobs) == n
    pos, policy = t.prompt_length, set()
    for turn in t.turns:
        assert turn.start == pos or turn.start == turn.end, (turn, pos)
        pos = max(pos, turn.end)
        if turn.role == "policy":
            policy.update(range(turn.start, turn.end))
    assert pos == n
    for i in range(n):
        assert t.loss_mask[i] == int(i in policy)
        if i not in policy:
            assert t.logprobs[i] == 0.0
    if engine is not None:
        starts = [u.start for u in t.turns if u.role == "policy"]
        assert [r.input_ids for r in engine.requests] == [tuple(t.token_ids[:s]) for s in starts]


def check_training_fields(t: Trajectory) -> None:
    """The Responses items carry each model call's exact tokens, and every call's prompt
    extends the previous call's prompt + generation (NeMo RL's contiguity check)."""
    calls = model_calls(t.token_ids, t.logprobs, t.turns)
    items = output_items(calls, {})
    carriers = [i for i in items if "generation_token_ids" in i]
    assert len(carriers) == len(calls) == sum(u.role == "policy" for u in t.turns)
    previous: list[int] = []
    for item in carriers:
        prompt, gen = item["prompt_token_ids"], item["generation_token_ids"]
        assert prompt[: len(previous)] == previous
        assert len(item["generation_log_probs"]) == len(gen)
        previous = prompt + gen
    assert tuple(previous) == t.token_ids[: len(previous)]


def rendered_ids(tok, t: Trajectory, tools) -> list[int]:
    """The chat template's render of the whole conversation, tokenised at once."""
    conv = [dict(m) for m in t.task.messages]
    for u in t.turns:
        if u.role == "policy":
            conv.append({"role": "assistant", "content": u.text})
        elif u.role == "tool":
            conv.append({"role": "tool", "name": u.tool, "content": u.text})
    fmt = ChatFormat(tok, tools)
    return fmt.encode(fmt._render(fmt.with_tools(conv)))


# ----------------------------------------------------------------------------- the server tool


def test_server_tool_lists_servers_and_names_close_matches(nemo_gym_venv):
    listed = subprocess.run([sys.executable, str(TOOL), "--list"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0
    names = listed.stdout.split()
    assert set(SERVERS) <= set(names) and len(names) > 50
    bad = subprocess.run(
        [sys.executable, str(TOOL), "example_single_tool"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert "no resources server 'example_single_tool'" in bad.stderr and "example_single_tool_call" in bad.stderr


def test_server_venv_is_reused_not_rebuilt(nemo_gym_venv):
    """A second setup finds everything in the stamp and installs nothing (the stamp is not rewritten)."""
    from tools.nemo_gym_servers import STAMP, venv_dir

    stamp = venv_dir() / STAMP
    before = (stamp.stat().st_mtime_ns, json.loads(stamp.read_text()))
    again = subprocess.run([sys.executable, str(TOOL), "--setup", *SERVERS], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert again.returncode == 0 and again.stdout.strip() == str(venv_dir() / "bin" / "python")
    assert (stamp.stat().st_mtime_ns, json.loads(stamp.read_text())) == before
    assert set(SERVERS) <= set(before[1]["servers"]) and before[1]["servers"]["math_with_judge"] == [
        "math-verify==0.8.0"
    ]


# ----------------------------------------------------------------------------- scripted episodes


def test_single_tool_call_episode_is_seeded_called_and_verified(tok, single_tool):
    env = make_env(tok, single_tool.url, single_tool.rows)
    task = env.tasks("train", seed=0)[0]
    assert task.messages[0]["role"] == "system"  # the row's developer message
    assert task.data["responses_create_params"]["tools"][0]["name"] == "get_weather"
    first = call("get_weather", city="San Francisco")
    ids = tok.encode(first, add_special_tokens=False) + [env.format.end_of_turn_ids[0]]
    logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
    script = [Completion(output_ids=ids, finish="stop", logprobs=logprobs), "It is cold in San Francisco."]
    engine = ReplayEngine(script, tokenizer=tok)
    (t,) = run(env, task, engine)
    assert (t.reward, t.finish_reason, t.error, t.reward_error) == (1.0, "stop", None, None)
    check_alignment(t, engine)
    check_training_fields(t)
    roles = [(u.role, u.tool) for u in t.turns]
    assert roles == [("env", "seed_session"), ("policy", None), ("tool", "get_weather"), ("policy", None),
                     ("env", "verify")]  # fmt: skip
    policy = t.turns[1]
    assert list(t.logprobs[policy.start : policy.end]) == pytest.approx(logprobs)
    answer = json.loads(t.turns[2].text)
    assert answer == {"city": "San Francisco", "weather_description": "The weather in San Francisco is cold."}
    assert t.metrics["tool_calls"] == 1 and t.metrics["tool_errors"] == 0 and t.metrics["verified"] == 1
    assert verify_record(t)["reward"] == 1.0
    assert t.tokens.output == sum(t.loss_mask)


def test_tool_results_are_rendered_by_the_chat_template_qwen25(qwen_tok, session_state):
    """With a template that renders tools itself, the episode's ids are the template's render
    of the whole conversation: tool answers are appended exactly as it writes tool messages."""
    env = make_env(qwen_tok, session_state.url, session_state.rows)
    task = env.tasks("train", seed=0)[0]  # add 1 then add 2 then get the count; starts at 3
    script = [call("increment_counter", count=1) + call("increment_counter", count=2),
              call("get_counter_value"), "The count is 6."]  # fmt: skip
    engine = ReplayEngine(script, tokenizer=qwen_tok)
    (t,) = run(env, task, engine)
    assert t.reward == 1.0 and t.finish_reason == "stop"
    check_alignment(t, engine)
    tools = env.chat_format(
        [{"type": "function", "function": {"name": x["name"], "description": x["description"],
                                           "parameters": x["parameters"]}}
         for x in task.data["responses_create_params"]["tools"]]
    ).tools  # fmt: skip
    whole = rendered_ids(qwen_tok, t, tools)
    assert list(t.token_ids) == whole[: len(t.token_ids)]
    assert qwen_tok.decode(whole[len(t.token_ids) :]).strip() == ""
    assert "<tool_response>" in qwen_tok.decode(list(t.token_ids))


def test_session_state_is_kept_across_tool_calls_and_apart_between_samples(tok, session_state):
    """Two samples of one row run at once, each in its own session: the counter each one
    reads back is its own, and the server's verify rewards only the right count."""
    env = make_env(tok, session_state.url, session_state.rows)
    task = env.tasks("train", seed=0)[1]  # add 4 then add 5 then get the count; starts at 6, expects 15
    rid = f"{env.name}/{task.id}"
    engine = ReplayEngine({
        f"{rid}/s0/t0": [call("increment_counter", count=4)],
        f"{rid}/s0/t1": [call("increment_counter", count=5)],
        f"{rid}/s0/t2": [call("get_counter_value")],
        f"{rid}/s0/t3": ["The count is 15."],
        f"{rid}/s1/t0": [call("increment_counter", count=4) + call("get_counter_value")],
        f"{rid}/s1/t1": ["The count is 10."],
    }, tokenizer=tok, delay_s=0.01)  # fmt: skip
    right, wrong = run(env, task, engine, n=2)
    assert (right.sample_index, wrong.sample_index) == (0, 1)
    assert right.reward == 1.0 and wrong.reward == 0.0
    reads = [[json.loads(u.text) for u in t.turns if u.tool == "get_counter_value"] for t in (right, wrong)]
    assert reads == [[{"count": 15}], [{"count": 10}]]
    assert right.metrics["tool_calls"] == 3 and wrong.metrics["tool_calls"] == 2
    for t in (right, wrong):
        check_alignment(t)
        check_training_fields(t)


def test_math_with_judge_rewards_are_the_servers(tok, math_judge):
    env = make_env(tok, math_judge.url, math_judge.rows)
    task = env.tasks("train", seed=0)[0]  # expected answer 32
    rid = f"{env.name}/{task.id}"
    engine = ReplayEngine({
        f"{rid}/s0/t0": ["So there are \\boxed{32} such numbers."],
        f"{rid}/s1/t0": ["I get \\boxed{31}."],
        # The reasoning goes into a reasoning item, which the verifier does not read.
        f"{rid}/s2/t0": ["<think>Is it \\boxed{31}? No.</think>The answer is \\boxed{32}."],
    }, tokenizer=tok)  # fmt: skip
    trajectories = run(env, task, engine, n=3)
    assert [t.reward for t in trajectories] == [1.0, 0.0, 1.0]
    assert [t.metrics["verify_library_reward"] for t in trajectories] == [1.0, 0.0, 1.0]
    assert verify_record(trajectories[0])["extracted_answer"] == "32"
    metrics = asyncio.run(env.aggregate_metrics(trajectories))
    assert metrics["agent_metrics"]["mean/reward"] == pytest.approx(2 / 3)
    assert len(metrics["group_level_metrics"]) == 1


def test_reward_components_are_the_servers_and_sum_to_the_reward(tok, multireward):
    """The server wants exactly one get_weather call and no prose; it has no get_weather route,
    so the call's answer is its 404, which the policy reads like any other answer."""
    env = make_env(tok, multireward.url, multireward.rows)
    task = env.tasks("train", seed=0)[0]  # expects get_weather(city="San Francisco")
    rid = f"{env.name}/{task.id}"
    engine = ReplayEngine({
        f"{rid}/s0/t0": [call("get_weather", city="San Francisco")],
        f"{rid}/s0/t1": ["Here is the weather."],
        f"{rid}/s1/t0": [call("get_weather", city="Paris")],
        f"{rid}/s1/t1": ["Paris."],
    }, tokenizer=tok)  # fmt: skip
    right, wrong = run(env, task, engine, n=2)
    assert right.reward_components == {"correctness": 1.0, "schema_valid": 1.0, "format": 0.0}
    assert wrong.reward_components == {"correctness": 0.0, "schema_valid": 1.0, "format": 0.0}
    assert (right.reward, wrong.reward) == (2.0, 1.0)
    assert right.turns[2].error == f"POST {multireward.url}/get_weather answered 404"
    assert right.metrics["verify_correctness"] == 1.0 and right.metrics["tool_errors"] == 1
    # One turn only: the call is the whole response (not sent: the turn limit came first).
    env = make_env(tok, multireward.url, multireward.rows, max_turns=1)
    (only,) = run(env, task, ReplayEngine([call("get_weather", city="San Francisco")], tokenizer=tok))
    assert only.finish_reason == "turn_limit" and only.metrics["tool_calls"] == 0
    assert only.reward_components == {"correctness": 1.0, "schema_valid": 1.0, "format": 1.0}
    assert only.reward == 3.0


def test_verify_answers_are_read_strictly():
    sent = {"responses_create_params": {"input": "x"}, "expected": 1}
    good = read_verdict({**sent, "reward": 1.5, "reward_components": {"a": 1.0, "b": 0.5}, "score": 0.5}, sent,
                        where="POST u/verify")  # fmt: skip
    assert (good.reward, good.components, good.reward_error, good.metrics) == (
        1.5, {"a": 1.0, "b": 0.5}, None, {"verify_score": 0.5})  # fmt: skip
    bad_sum = read_verdict({"reward": 2.0, "reward_components": {"a": 1.0}}, sent, where="POST u/verify")
    assert bad_sum.reward == 0.0 and "not the sum of reward_components" in bad_sum.reward_error
    for answer in ({"reward": None}, {"reward": "1"}, {"reward": float("nan")}, {}, {"reward": 10**400}):
        v = read_verdict(answer, sent, where="POST u/verify")
        assert v.reward == 0.0 and "without a finite number as reward" in v.reward_error
    # A JSON integer past float's range raised OverflowError out of the episode, ending the stage.
    huge = read_verdict({"reward": 1.0, "reward_components": {"a": 10**400}, "score": 10**400}, sent, where="v")
    assert huge.reward == 0.0 and "must map names to finite numbers" in huge.reward_error and huge.metrics == {}
    judged = read_verdict({"reward": 0.0, "_ng_failure_class": "judge_failed"}, sent, where="POST u/verify")
    assert judged.reward == 0.0 and "_ng_failure_class='judge_failed'" in judged.reward_error
    assert judged.metrics == {"verify_failed": 1.0}


def test_split_policy_text_separates_reasoning_message_and_calls():
    text = "<think>plan</think>Calling.\n" + call("f", x=1) + "<tool_call>{oops</tool_call>"
    reasoning, message, calls = split_policy_text(text)
    assert reasoning == "plan"
    assert message == "Calling.\n<tool_call>{oops</tool_call>"  # the malformed block stays text
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [("f", {"x": 1}, True), (None, None, False)]
    assert split_policy_text("a</think>b", think_tags=False)[:2] == ("", "a</think>b")


def test_invalid_and_failing_tool_calls_are_observations(tok, session_state):
    """A malformed call and an undeclared tool are answered here (never sent) and counted; a
    call the server refuses (422) comes back as the server's answer, named in the audit turn."""
    env = make_env(tok, session_state.url, session_state.rows, invalid_call_penalty=0.5)
    task = env.tasks("train", seed=0)[0]
    script = ["<tool_call>{oops</tool_call>", call("delete_counter"), call("increment_counter", count="many"),
              "Done."]  # fmt: skip
    engine = ReplayEngine(script, tokenizer=tok)
    (t,) = run(env, task, engine)
    tools = [u for u in t.turns if u.role == "tool"]
    assert "not valid JSON" in tools[0].error and "unknown tool 'delete_counter'" in tools[1].error
    assert tools[2].error == f"POST {session_state.url}/increment_counter answered 422"
    assert "int_parsing" in tools[2].text  # the server's own validation message reaches the policy
    assert t.metrics["invalid_tool_calls"] == 2 and t.metrics["tool_errors"] == 1
    # The counter never moved from 3, the server says 0 for "expected 6", and the penalty applies.
    assert t.reward_components == {"verify": 0.0, "invalid_tool_call": -0.5} and t.reward == -0.5
    check_alignment(t, engine)


def test_turn_limit_ends_the_episode_and_it_is_still_verified(tok, single_tool, tmp_path):
    env = make_env(tok, single_tool.url, single_tool.rows, max_turns=2)
    env.set_episode_dir(str(tmp_path / "episodes"))  # ignored: a server session cannot be resumed
    task = env.tasks("train", seed=0)[0]
    engine = ReplayEngine([call("get_weather", city="SF")] * 2, tokenizer=tok)
    (t,) = run(env, task, engine)
    assert t.finish_reason == "turn_limit" and t.metrics["turns"] == 2 and t.metrics["tool_calls"] == 1
    assert t.metrics["verified"] == 1 and t.reward == 1.0
    assert not (tmp_path / "episodes").exists()


def test_a_cut_episode_is_verified_only_with_score_truncated(tok, single_tool):
    cut = Completion(text="The weather in", finish="length")
    env = make_env(tok, single_tool.url, single_tool.rows)
    (t,) = run(env, env.tasks("train", seed=0)[0], ReplayEngine([cut], tokenizer=tok))
    assert t.finish_reason == "length" and t.reward == 0.0
    assert t.metrics["truncated"] == 1 and t.metrics["verified"] == 0 and verify_record(t) is None
    cfg = EnvConfig(kind="nemo_gym", n_eval=0, score_truncated=True,
                    options={"url": single_tool.url, "rows": single_tool.rows})  # fmt: skip
    env = NemoGymEnv(cfg, validate_env_config(cfg), tokenizer=tok)
    (t,) = run(env, env.tasks("train", seed=0)[0], ReplayEngine([cut], tokenizer=tok))
    assert t.reward == 1.0 and t.metrics["verified"] == 1


def test_the_hydra_file_composes_to_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ptrain.config.env import register_env_configs

    register_env_configs()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: nemo_gym\n  - _self_\nhydra:\n  searchpath: [file://{ROOT / 'conf'}]\n"
    )
    overrides = ["envs.nemo_gym.options.url=http://127.0.0.1:8001", f"envs.nemo_gym.options.rows={rows}"]
    with initialize_config_dir(str(tmp_path), version_base=None):
        node = OmegaConf.select(compose(config_name="main", overrides=overrides), "envs.nemo_gym")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    opts = validate_env_config(cfg)
    assert cfg.kind == "nemo_gym" and opts == NemoGymOptions(url="http://127.0.0.1:8001", rows=str(rows))


# ----------------------------------------------------------------------------- re-verifying recorded rollouts


def reverify(server: Server, *paths: str, rows: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ptrain.envs.nemo_gym", "reverify", "--url", server.url, "--concurrency", "1"]
    cmd += ["--rows", server.rows] if rows else []
    return subprocess.run(cmd + list(paths), capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("fixture", ["single_tool", "session_state", "math_judge", "multireward"])
def test_reverify_reproduces_the_recorded_rewards(fixture, request, tmp_path):
    server: Server = request.getfixturevalue(fixture)
    proc = reverify(server, server.rollouts)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    results = [json.loads(x) for x in lines[:-1]]
    with open(server.rollouts) as f:
        rollouts = [x for x in f if x.strip()]
    recorded = [json.loads(x)["reward"] for x in rollouts]
    rewards = [r["reward"] for r in results]
    cut = []
    if fixture == "math_judge":
        # math-verify cuts a sympy comparison at 5 s of wall time inside the server (not
        # configurable); recorded row 2 compares (1 +- sqrt(3))**4033 forms, 3.2 s of CPU here,
        # so on a CPU shared with other jobs it can be cut and score 0. Such a row is verified
        # again on its own; if its verify still took over 5 s and scored 0, the test says so
        # (xfail) after every other row has been checked.
        for i in [i for i, (a, b) in enumerate(zip(rewards, recorded)) if a != b]:
            for _ in range(2):
                one = tmp_path / f"row{i}.jsonl"
                one.write_text(rollouts[i])
                again = json.loads(reverify(server, str(one)).stdout.splitlines()[0])
                if again["reward"] == recorded[i]:
                    rewards[i] = again["reward"]
                    break
            else:
                if again["reward"] == 0.0 and again["verify_s"] >= 5.0:
                    cut.append((i + 1, again["verify_s"]))
                    rewards[i] = recorded[i]
    assert rewards == recorded
    assert all(r["tool_answers_differ"] == 0 for r in results)
    key, value = lines[-1].split()
    assert key == "mean_reward" and float(value) == pytest.approx(sum(r["reward"] for r in results) / len(results))
    if cut:
        pytest.xfail(f"rows {cut} (line, verify seconds) scored 0 after math-verify's 5 s limit on this busy CPU")


def test_reverify_without_the_task_fields_names_the_refusal(session_state):
    """The recorded session rows lack initial_count: without --rows the seed is refused (422),
    and every row says so; the exit code is 1."""
    proc = reverify(session_state, session_state.rollouts, rows=False)
    assert proc.returncode == 1
    lines = proc.stdout.strip().splitlines()
    assert all("seed_session answered 422" in json.loads(x)["error"] for x in lines[:-1])
    assert lines[-1] == "mean_reward nan"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--connect-timeout", "-1"], "--connect-timeout must be a number of seconds > 0, got -1.0"),
        (["--verify-timeout", "nan"], "--verify-timeout must be a number of seconds > 0, got nan"),
        (["--timeout", "0"], "--timeout must be a number of seconds > 0, got 0.0"),
        (["--url", "127.0.0.1:8000"], "--url must be the server's base URL, http://host:port (no route), got "),
        (["--url", "http://127.0.0.1:8000/verify"], "--url must be the server's base URL"),
        (["--url", "http://127.0.0.1:99999"], "--url must be the server's base URL"),
    ],
)
def test_reverify_refuses_bad_flags_before_sending_anything(tmp_path, capsys, flags, message):
    """A negative timeout timed out at once and read as 'the server is unreachable ... fix
    --url'; nan was a ValueError traceback from anyio."""
    from ptrain.envs.nemo_gym import main

    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(GOOD_ROW + "\n")
    with pytest.raises(SystemExit) as e:
        main(["reverify", "--url", "http://127.0.0.1:1", *flags, str(rollouts)])
    assert e.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad rows, bad servers


BAD_ROWS = [
    ("{not json", "not JSON"),
    (json.dumps({"question": "no params"}), "no 'responses_create_params'"),
    (json.dumps({"responses_create_params": {"tools": []}}), "has no 'input'"),
    (json.dumps({"responses_create_params": {"input": 7}}), "must be a string or a non-empty list"),
    (json.dumps({"responses_create_params": {"input": [{"role": "robot", "content": "hi"}]}}), "role must be one of"),
    (json.dumps({"responses_create_params": {"input": "hi", "tools": [{"type": "web_search"}]}}),
     "only function tools"),
    (json.dumps({"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}}), "only text parts"),
]  # fmt: skip
GOOD_ROW = json.dumps({"responses_create_params": {"input": "What is 2 + 2?"}, "expected_answer": "4"})


@pytest.mark.parametrize("line,problem", BAD_ROWS)
def test_a_malformed_row_fails_naming_file_line_and_problem(tok, tmp_path, line, problem):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n" + line + "\n")
    with pytest.raises(RowError) as e:
        make_env(tok, "http://127.0.0.1:9", str(rows))
    assert f"{rows}:2: " in str(e.value) and problem in str(e.value) and "bad_rows=skip" in str(e.value)


def test_a_row_that_is_not_utf8_is_a_bad_row_named_by_line(tok, tmp_path):
    """It was a UnicodeDecodeError that named no file: ptrain: error: 'utf-8' codec can't ..."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(GOOD_ROW.encode() + b"\n\x89PNG\r\n" + GOOD_ROW.encode() + b"\n")
    with pytest.raises(RowError, match=rf"{rows}:2: not UTF-8 text .*bad_rows=skip"):
        make_env(tok, "http://127.0.0.1:9", str(rows))
    env = make_env(tok, "http://127.0.0.1:9", str(rows), bad_rows="skip")
    assert [b.line for b in env.bad_rows] == [2] and len(env.tasks("train", seed=0)) == 2


def test_malformed_rows_can_be_skipped_and_are_counted(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join([GOOD_ROW] + [line for line, _ in BAD_ROWS] + [GOOD_ROW]) + "\n")
    env = make_env(tok, "http://127.0.0.1:9", str(rows), bad_rows="skip")
    assert [b.line for b in env.bad_rows] == list(range(2, 2 + len(BAD_ROWS)))
    tasks = env.tasks("train", seed=0)
    assert len(tasks) == 2 and tasks[0].data["expected_answer"] == "4"
    assert tasks[0].messages == ({"role": "user", "content": "What is 2 + 2?"},)


def test_held_out_rows_come_first_and_must_leave_some_to_train(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"responses_create_params": {"input": f"q{i}"}}) for i in range(3)) + "\n")
    env = make_env(tok, "http://127.0.0.1:9", str(rows), n_eval=1)
    assert [t.messages[0]["content"] for t in env.tasks("eval", seed=0)] == ["q0"]
    assert [t.messages[0]["content"] for t in env.tasks("train", seed=0)] == ["q1", "q2"]
    with pytest.raises(RowError, match="has 3 playable rows, and the first n_eval=3 are held out"):
        make_env(tok, "http://127.0.0.1:9", str(rows), n_eval=3)


def test_options_are_checked_before_anything_runs(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n")
    cases = [
        ({"rows": str(rows)}, "options.url': the resources server's base URL is required"),
        ({"url": "127.0.0.1:8000", "rows": str(rows)}, "must be http://host:port"),
        ({"url": "http://127.0.0.1:8000/verify", "rows": str(rows)}, "without a route"),
        # Each episode failed at its first request (httpx: InvalidURL), naming no key.
        ({"url": "http://127.0.0.1:99999", "rows": str(rows)}, "options.url': its port is not a number in 0..65535"),
        ({"url": "http://:8000", "rows": str(rows)}, "must be http://host:port"),
        ({"url": "http://127.0.0.1:8000"}, "options.rows'"),
        ({"url": "http://127.0.0.1:8000", "rows": str(tmp_path / "none.jsonl")}, "no file"),
        ({"url": "http://127.0.0.1:8000", "rows": str(rows), "max_turns": 0}, "options.max_turns'"),
        ({"url": "http://127.0.0.1:8000", "rows": str(rows), "bad_rows": "ignore"}, "options.bad_rows'"),
        ({"url": "http://127.0.0.1:8000", "rows": str(rows), "max_steps": 3}, "options.max_steps': not an option"),
    ]
    for options, message in cases:
        with pytest.raises(EnvConfigError) as e:
            validate_env_config(EnvConfig(kind="nemo_gym", options=options))
        assert message in str(e.value), (options, str(e.value))
    assert isinstance(validate_env_config(EnvConfig(kind="nemo_gym", options={
        "url": "http://127.0.0.1:8000", "rows": str(rows)})), NemoGymOptions)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_server_is_an_episode_error_naming_the_url(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n")
    url = f"http://127.0.0.1:{free_port()}"
    env = make_env(tok, url, str(rows), connect_timeout_s=2.0)
    (t,) = run(env, env.tasks("train", seed=0)[0], ReplayEngine(["4"], tokenizer=tok))
    assert t.finish_reason == "error" and t.reward == 0.0
    assert f"POST {url}/seed_session" in t.error and "unreachable" in t.error
    assert t.metrics["verified"] == 0 and env.stats["errors"] == 1


def test_a_server_that_never_answers_times_out_naming_the_option(tok, tmp_path):
    """A listener that accepts and never answers: the seed times out after request_timeout_s."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = make_env(tok, url, str(rows), request_timeout_s=0.5)
        started = time.monotonic()
        (t,) = run(env, env.tasks("train", seed=0)[0], ReplayEngine(["4"], tokenizer=tok))
        assert time.monotonic() - started < 10
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        silent.close()
    assert t.finish_reason == "error"
    assert t.error == f"POST {url}/seed_session: no answer within 0.5 s (envs.nemo_gym.options.request_timeout_s)"


def test_a_refused_seed_names_the_status_and_the_servers_reason(tok, session_state, tmp_path):
    rows = tmp_path / "rows.jsonl"  # a session row without its initial_count
    rows.write_text(json.dumps({"responses_create_params": {"input": "add 1"}, "expected_count": 1}) + "\n")
    env = make_env(tok, session_state.url, str(rows))
    (t,) = run(env, env.tasks("train", seed=0)[0], ReplayEngine(["1"], tokenizer=tok))
    assert t.finish_reason == "error"
    assert t.error.startswith(f"POST {session_state.url}/seed_session answered 422") and "initial_count" in t.error


class _LoopbackServer(ThreadingHTTPServer):
    """The standard library's threading server with a listen backlog like uvicorn's (2048)
    rather than its 5: a batch opens a connection per episode at once, and a full accept
    queue on a loaded machine can stall or drop some of them before a handler sees them."""

    request_queue_size = 2048


class _MisbehavingServer(BaseHTTPRequestHandler):
    """A resources server on loopback that answers each row as its "misbehave" field says."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    received: collections.Counter = collections.Counter()
    """(route, misbehave) -> requests received, over every server of this class."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        how = body.get("misbehave", "") if isinstance(body, dict) else ""
        route = self.path
        self.received[route, how] += 1
        if route == "/seed_session" and how == "seed_drop_first" and self.received[route, how] == 1:
            self.connection.shutdown(socket.SHUT_RDWR)  # closed unanswered, as a server restarting does
            self.close_connection = True
            return None
        if route == "/deep":  # a tool whose reply nests past what the JSON parser takes
            return self._answer(b"[" * 100_000 + b"]" * 100_000)
        if route == "/seed_session" and how == "seed_truncated_json":
            return self._answer(b'{"session": ')
        if route == "/seed_session" and how == "seed_deep_json":
            return self._answer(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
        if route == "/verify" and how == "verify_drop":  # the connection drops halfway through the body
            self.send_response(200)
            self.send_header("content-length", "100")
            self.end_headers()
            self.wfile.write(b'{"reward"')
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return None
        if route == "/verify" and how == "verify_overflow":  # finite components whose sum is not
            return self._answer(json.dumps({"reward": 1.0, "reward_components": {"a": 1e308, "b": 1e308}}).encode())
        if route == "/verify" and how == "verify_no_reward":
            return self._answer(b'{"passed": true}')
        return self._answer(b'{"reward": 1.0}' if route == "/verify" else b"{}")

    def _answer(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_server_that_answers_garbage_or_drops_the_connection_fails_only_those_episodes(tok, tmp_path):
    """A batch of rows against a real HTTP server on loopback that answers some of them with
    truncated JSON, JSON nested past the parser's limit, a dropped connection, components that
    overflow or no reward. Each is its own failed (or zero-reward) episode with the reason, and
    the rest of the batch is verified. Before, the nested JSON (RecursionError) and the
    overflowing components (OverflowError) escaped the episode: the whole group failed, and an
    evaluation (asyncio.gather over the rows) died with them."""
    tools = [{"type": "function", "name": "deep", "parameters": {"type": "object", "properties": {}}}]
    cases = ["ok", "seed_truncated_json", "seed_deep_json", "verify_drop", "verify_overflow", "verify_no_reward",
             "tool_deep_json"]  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"responses_create_params": {"input": f"row {how}",
                                        **({"tools": tools} if how == "tool_deep_json" else {})},
                                        "misbehave": how}) + "\n" for how in cases))  # fmt: skip
    _MisbehavingServer.received.clear()
    server = _LoopbackServer(("127.0.0.1", 0), _MisbehavingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        # The tool's 200,000 characters are cut to 100 before they reach the episode's tokens.
        env = make_env(tok, url, str(rows), request_timeout_s=10.0, max_tool_output_chars=100)
        tasks = env.tasks("train", seed=0)
        tool_task = f"nemo_gym/{tasks[cases.index('tool_deep_json')].id}"
        engine = ReplayEngine({None: ["4"] * 20, **{f"{tool_task}/s{j}/t0": call("deep") for j in range(2)}},
                              tokenizer=tok)  # fmt: skip

        async def batch():
            return await asyncio.gather(
                *(env.rollout(t, engine, SamplingParams(max_new_tokens=64, n=2)) for t in tasks)
            )

        results = dict(zip(cases, asyncio.run(batch())))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    for how, ts in results.items():
        assert len(ts) == 2, how
    for how in ("ok", "tool_deep_json"):  # a tool reply is an observation, JSON or not
        assert all(t.error is None and t.metrics["verified"] == 1 and t.reward == 1.0 for t in results[how]), how
    (tool_turn,) = [u for u in results["tool_deep_json"][0].turns if u.role == "tool"]
    assert tool_turn.tool == "deep" and tool_turn.text.startswith("[[[[")
    failed = {
        "seed_truncated_json": f"POST {url}/seed_session answered 200 with a body that is not JSON (JSONDecodeError: ",
        "seed_deep_json": f"POST {url}/seed_session answered 200 with a body that is not JSON (RecursionError: ",
        "verify_drop": f"POST {url}/verify: the request failed (RemoteProtocolError: peer closed connection",
    }
    for how, reason in failed.items():
        for t in results[how]:
            assert t.finish_reason == "error" and t.reward == 0.0 and t.metrics["verified"] == 0, how
            assert t.error.startswith(reason), (how, t.error)
    for how, reason in (("verify_overflow", f"POST {url}/verify: reward_components {{'a': 1e+308, 'b': 1e+308}} "
                         "sum past the float range; they cannot sum to reward 1.0"),
                        ("verify_no_reward", f"POST {url}/verify answered without a finite number as reward")):  # fmt: skip
        for t in results[how]:  # verified, and scored 0 with the reason
            assert t.error is None and t.reward == 0.0 and t.metrics["verified"] == 1, how
            assert t.reward_error.startswith(reason), (how, t.reward_error)
    assert env.stats["errors"] == 2 * len(failed)
    assert _MisbehavingServer.received["/verify", "verify_drop"] == 2  # a broken /verify is not sent again


def test_a_seed_whose_connection_breaks_unanswered_is_sent_once_more(tok, tmp_path):
    """A seed starts the session afresh, so a /seed_session the server closes without an answer
    (a worker restarting, a connection reset under load) is sent a second time; the episode is
    seeded, played and verified as if nothing happened."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"responses_create_params": {"input": "row"}, "misbehave": "seed_drop_first"}) + "\n")
    _MisbehavingServer.received.clear()
    server = _LoopbackServer(("127.0.0.1", 0), _MisbehavingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = make_env(tok, f"http://127.0.0.1:{server.server_address[1]}", str(rows), request_timeout_s=10.0)
        (t,) = run(env, env.tasks("train", seed=0)[0], ReplayEngine(["4"], tokenizer=tok))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert t.error is None and t.metrics["verified"] == 1 and t.reward == 1.0
    assert _MisbehavingServer.received["/seed_session", "seed_drop_first"] == 2


def test_an_unforeseen_failure_reading_an_answer_fails_only_its_episode(tok, tmp_path, monkeypatch):
    """Past the checks of the HTTP layer and of read_verdict, anything an exchange raises (here a
    verdict reader that indexes a field the answer lacks) ends that episode with its class and
    message, and the other rows of the batch are still verified."""
    import ptrain.envs.nemo_gym as nemo_gym

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"responses_create_params": {"input": f"row {how}"}, "misbehave": how}) + "\n"
                            for how in ("ok", "verify_no_reward")))  # fmt: skip
    read = nemo_gym.read_verdict

    def strict_read(answer, sent, **kw):
        answer["reward"]  # noqa: B018 - a reader that assumes the field
        return read(answer, sent, **kw)

    monkeypatch.setattr(nemo_gym, "read_verdict", strict_read)
    server = _LoopbackServer(("127.0.0.1", 0), _MisbehavingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env = make_env(tok, url, str(rows))
        engine = ReplayEngine(["4"] * 4, tokenizer=tok)

        async def batch():
            return await asyncio.gather(*(env.rollout(t, engine, SamplingParams(max_new_tokens=16)) for t in
                                          env.tasks("train", seed=0)))  # fmt: skip

        (ok,), (bad,) = asyncio.run(batch())
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert ok.error is None and ok.reward == 1.0 and ok.metrics["verified"] == 1
    assert bad.finish_reason == "error" and bad.reward == 0.0 and bad.metrics["verified"] == 0
    assert bad.error == f"the episode against {url} failed unexpectedly (KeyError: 'reward')"
    assert env.stats["errors"] == 1


# ----------------------------------------------------------------------------- a real engine


@pytest.mark.slow
def test_one_episode_on_a_local_engine_with_a_tiny_model(tok, single_tool):
    """A random tiny model writes garbage; the protocol holds: seeded, verified by the server,
    token ids as sampled with the engine's log-probs, training fields contiguous."""
    from flax import nnx

    from ptrain.config.model import ModelConfig
    from ptrain.models import Decoder
    from ptrain.rollout.local import LocalEngine

    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                      max_seq_len=1024, tie_embeddings=False)  # fmt: skip
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    # A constant direction in every embedding that the head reads for <|im_end|> only: about
    # half of the sampled tokens end the turn, so the episode ends by itself and is verified.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model.embed[...] = model.embed[...].at[:, 0].set(4.0)
    model.lm_head[...] = model.lm_head[...].at[0, :].set(0.0).at[0, im_end].set(1.1)
    env = make_env(tok, single_tool.url, single_tool.rows, max_turns=3, max_episode_tokens=1024)
    task = env.tasks("train", seed=0)[0]
    engine = LocalEngine(model, max_running_requests=2, context_length=1024, eos_token_ids=[tok.eos_token_id],
                         decode_steps=4, prefill_chunk=512)  # fmt: skip
    try:
        (t,) = run(env, task, engine, max_new_tokens=32, sampling_seed=1)
    finally:
        engine.close()
    assert t.error is None and t.finish_reason == "stop" and t.metrics["verified"] == 1
    assert t.reward == 1.0  # example_single_tool_call's verifier rewards every episode
    check_alignment(t)
    check_training_fields(t)
    assert t.tokens.output == sum(t.loss_mask) > 0
    assert all(lp <= 0.0 and math.isfinite(lp) for lp, m in zip(t.logprobs, t.loss_mask) if m)
    assert any(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
    assert t.weight_versions == ("default",)
