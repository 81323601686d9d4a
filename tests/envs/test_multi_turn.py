"""The multi-turn tool loop: template deltas equal whole-conversation renders (embedded,
Qwen2.5 and Qwen3 templates), tool-call parsing, token ids / loss mask / log-probs aligned
with the audit turns, invalid calls counted and penalised, turn and token limits,
concurrent samples, checkpoints that resume without re-running tool calls, the audit log,
and one end-to-end run on a real LocalEngine with a tiny random model."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from ptrain.config.env import EnvConfig
from ptrain.config.env_multi_turn import LongHorizonOptions, ToolUseOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.audit import AuditLog, read_audit
from ptrain.envs.base import Task, Trajectory
from ptrain.envs.episode import STATE_VERSION, EpisodeStore
from ptrain.envs.long_horizon import LongHorizonEnv
from ptrain.envs.multi_turn import TOOLS_SYSTEM_PROMPT, ChatFormat, ChatTemplateError, parse_tool_calls
from ptrain.envs.safety import RewardRunner
from ptrain.envs.tool_use import ToolUseEnv
from ptrain.envs.tools import CalculatorTool
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine, rescore
from ptrain.sandbox import SandboxUnavailableError

sys.path.insert(0, os.path.dirname(__file__))
from chat_templates import QWEN3, QWEN25  # noqa: E402

TOOLS = ["calculator", "read_file", "write_file", "list_files"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


def with_template(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


@pytest.fixture(scope="module", params=["embedded", "qwen25", "qwen3"])
def any_tok(request, tok):
    return tok if request.param == "embedded" else with_template(tok, {"qwen25": QWEN25, "qwen3": QWEN3}[request.param])


@pytest.fixture(scope="module")
def runner():
    """One reward-worker pool for the module's environments (each would start its own)."""
    with RewardRunner(workers=2, timeout_s=10.0) as pool:
        yield pool


def tool_env(tok, runner, **options) -> ToolUseEnv:
    opts = ToolUseOptions(tools=list(options.pop("tools", TOOLS)), families=["calculator"], **options)
    opts.validate("envs.tool_use.options")
    return ToolUseEnv(EnvConfig(kind="tool_use", n_train=4, n_eval=2), opts, tokenizer=tok, runner=runner)


def task(env, answer="42", files=None) -> Task:
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 6 * 7?"}]
    return env.task("train", 0, msgs, {"answer": answer, "tool": "calculator", "files": files or {}})


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def rollout(env, t, engine, **sp) -> list[Trajectory]:
    sp.setdefault("max_new_tokens", 512)
    return asyncio.run(env.rollout(t, engine, SamplingParams(**sp)))


# ---------------------------------------------------------------------------------------- rendering

SCHEMAS = [CalculatorTool().schema()]
CONV = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 6 * 7?"}]
ANSWER = "Let me compute it.\n" + call("calculator", expression="6 * 7")


@pytest.mark.parametrize(
    "new",
    [
        [{"role": "tool", "name": "calculator", "content": "42"}],
        [
            {"role": "tool", "name": "calculator", "content": "42"},
            {"role": "tool", "name": "read_file", "content": "a\nb"},
        ],
        [{"role": "user", "content": "Now add 5."}],
    ],
    ids=["one_tool", "two_tools", "user"],
)
def test_delta_equals_the_template_render_of_the_whole_conversation(any_tok, new):
    fmt = ChatFormat(any_tok, SCHEMAS)
    prompt = fmt.prompt_ids(CONV)
    answer_ids = fmt.encode(ANSWER) + [fmt.end_of_turn_ids[0]]
    delta, spans = fmt.delta_ids(new)
    whole = any_tok.apply_chat_template(
        fmt.with_tools(CONV) + [{"role": "assistant", "content": ANSWER}, *new],
        tools=SCHEMAS if fmt.tools_in_template else None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert prompt + answer_ids + delta == list(whole)
    # The spans partition the delta in message order, each holding its message's content.
    assert spans[0][0] == 0 and spans[-1][1] == len(delta)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for m, (a, b) in zip(new, spans):
        assert m["content"] in any_tok.decode(delta[a:b])


def test_template_variables_reach_every_render(tok):
    """Qwen3 with enable_thinking=false opens each assistant turn with an empty think block:
    the first prompt and every delta's generation prompt carry it. Qwen3's render of a whole
    conversation drops that block from past turns; the episode keeps the ids the policy was
    given (it is never re-rendered), so the two differ by exactly that block."""
    qwen3 = with_template(tok, QWEN3)
    fmt = ChatFormat(qwen3, SCHEMAS, {"enable_thinking": False})
    prompt = fmt.prompt_ids(CONV)
    assert qwen3.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    new = [{"role": "tool", "name": "calculator", "content": "42"}]
    delta, _ = fmt.delta_ids(new)
    assert qwen3.decode(delta).endswith("<think>\n\n</think>\n\n")
    answer = fmt.encode(ANSWER) + [fmt.end_of_turn_ids[0]]
    conv = CONV + [{"role": "assistant", "content": ANSWER}, *new]
    whole = qwen3.apply_chat_template(
        conv, tools=SCHEMAS, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    episode = qwen3.decode(prompt + answer + delta)
    assert episode != whole and episode.replace("<think>\n\n</think>\n\n", "", 1) == whole


def test_tools_go_through_the_template_or_into_the_system_message(tok):
    qwen = ChatFormat(with_template(tok, QWEN25), SCHEMAS)
    assert qwen.tools_in_template and qwen.with_tools(CONV) == CONV
    assert '"name": "calculator"' in qwen.prompt_text(CONV) and "<tools>" in qwen.prompt_text(CONV)
    embedded = ChatFormat(tok, SCHEMAS)  # the embedded ChatML template ignores tools=
    assert not embedded.tools_in_template
    system = embedded.with_tools(CONV)[0]["content"]
    assert system.startswith("You add numbers.\n\n# Tools") and json.dumps(SCHEMAS[0]) in system
    bare = embedded.with_tools(CONV[1:])
    assert bare[0]["role"] == "system" and bare[0]["content"].startswith(TOOLS_SYSTEM_PROMPT[:20])
    assert embedded.end_of_turn_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)


def test_a_template_without_tool_turns_is_refused_at_start(tok):
    strict = with_template(
        tok,
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('roles must be user/assistant') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    with pytest.raises(ChatTemplateError, match="cannot render"):
        ChatFormat(strict, SCHEMAS).check(["tool"])


# ---------------------------------------------------------------------------------------- parsing


def test_parse_tool_calls():
    text = (
        "thinking " + call("calculator", expression="1+1") + " then "
        '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a\\"}"}</tool_call>'
        '<tool_call>{"name": "list_files"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        "<tool_call>[1, 2]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "x", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:3]] == [
        ("calculator", {"expression": "1+1"}),
        ("read_file", {"path": "a"}),
        ("list_files", {}),
    ]
    assert all(c.error is None for c in calls[:3])
    errors = [c.error for c in calls[3:]]
    assert "not valid JSON" in errors[0] and "JSON object" in errors[1] and '"name"' in errors[2]
    assert "must be a JSON object" in errors[3] and "never closed" in errors[4]
    assert parse_tool_calls("no calls here") == []


# ---------------------------------------------------------------------------------------- the loop


def check_alignment(t: Trajectory, fmt: ChatFormat, engine: ReplayEngine | None = None):
    """Policy spans carry mask 1 and the engine's log-probs, everything else mask 0 and
    log-prob 0; the spans tile the response; each policy span is the engine's output."""
    n = len(t.token_ids)
    assert len(t.loss_mask) == len(t.logprobs) == n
    pos = t.prompt_length
    policy = set()
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
        policy_turns = [u for u in t.turns if u.role == "policy"]
        prompts = [r.input_ids for r in engine.requests]
        assert len(prompts) == len(policy_turns)
        for turn, p in zip(policy_turns, prompts):
            assert tuple(t.token_ids[: turn.start]) == p  # each request is the episode so far


def test_tool_calls_malformed_and_unknown_calls_and_the_final_answer(tok, runner):
    env = tool_env(tok, runner, invalid_call_penalty=0.5)
    t = task(env)
    lp = [-0.5, -0.25]
    script = [
        Completion(text="I will compute.\n" + call("calculator", expression="6 * 7")),
        Completion(text="<tool_call>{oops</tool_call>"),
        Completion(text=call("web_search", query="6*7") + call("calculator", expr="6*7")),
        Completion(text="It is 42.\nAnswer: 42"),
    ]
    ids0 = tok.encode(script[0].text, add_special_tokens=False) + [env.format.end_of_turn_ids[0]]
    script[0] = Completion(output_ids=ids0, finish="stop", logprobs=[lp[i % 2] for i in range(len(ids0))])
    engine = ReplayEngine(script, tokenizer=tok)
    (traj,) = rollout(env, t, engine)
    assert traj.finish_reason == "stop"
    roles = [u.role for u in traj.turns]
    assert roles == ["policy", "tool", "policy", "tool", "policy", "tool", "tool", "policy"]
    tools = [u for u in traj.turns if u.role == "tool"]
    assert tools[0].tool == "calculator" and tools[0].text == "42" and tools[0].arguments == {"expression": "6 * 7"}
    assert tools[0].error is None
    assert "not valid JSON" in tools[1].error and tools[1].text.startswith("error: ")
    assert "unknown tool 'web_search'" in tools[2].error and "calculator" in tools[2].error
    assert "unknown argument" in tools[3].error
    assert traj.metrics["invalid_tool_calls"] == 3 and traj.metrics["tool_calls"] == 4 and traj.metrics["turns"] == 4
    assert traj.reward_components == {"correct": 1.0, "invalid_tool_call": -0.5} and traj.reward == 0.5
    check_alignment(traj, env.format, engine)
    first = traj.turns[0]
    assert traj.logprobs[first.start : first.end] == tuple(lp[i % 2] for i in range(len(ids0)))
    # The ids are exactly the template's render of the conversation as text.
    conv = list(t.messages) + [
        {"role": "assistant", "content": tok.decode(ids0[:-1])},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "<tool_call>{oops</tool_call>"},
        {"role": "tool", "content": tools[1].text},
        {"role": "assistant", "content": call("web_search", query="6*7") + call("calculator", expr="6*7")},
        {"role": "tool", "content": tools[2].text},
        {"role": "tool", "content": tools[3].text},
    ]
    rendered = env.format.prompt_ids(conv)  # whole conversation + the last assistant header
    assert list(traj.token_ids[: traj.turns[-1].start]) == rendered
    # Token accounting: the replay engine's prefix cache covers each previous request.
    assert traj.tokens.output == sum(traj.loss_mask)
    assert traj.tokens.prompt_cached + traj.tokens.prompt_uncached == sum(len(r.input_ids) for r in engine.requests)
    assert traj.tokens.prompt_cached >= sum(len(r.input_ids) for r in engine.requests[:-1])
    assert traj.weight_versions == ("replay",)


def test_turn_limit_stops_an_agent_that_keeps_calling(tok, runner):
    env = tool_env(tok, runner, max_turns=2)
    engine = ReplayEngine([call("calculator", expression="1+1")] * 2, tokenizer=tok)
    (traj,) = rollout(env, task(env), engine)
    assert traj.finish_reason == "turn_limit"
    assert [u.role for u in traj.turns] == ["policy", "tool", "policy"]  # the last turn's call is not run
    assert traj.metrics["tool_calls"] == 1 and traj.reward == 0.0
    check_alignment(traj, env.format, engine)


def test_token_limit_cuts_the_turn_budget_and_ends_the_episode(tok, runner):
    env = tool_env(tok, runner)
    prompt = len(env.format.prompt_ids(task(env).messages))
    env.options = dataclasses.replace(env.options, max_episode_tokens=prompt + 40)
    long = call("calculator", expression="1+1") + " and more words " * 10
    engine = ReplayEngine([call("calculator", expression="1+1"), long], tokenizer=tok)
    (traj,) = rollout(env, task(env), engine)
    assert traj.finish_reason == "token_limit"
    assert len(traj.token_ids) <= prompt + 40
    assert engine.requests[-1].sampling.max_new_tokens == prompt + 40 - len(engine.requests[-1].input_ids)
    check_alignment(traj, env.format)


def test_a_sample_cut_at_max_new_tokens_ends_the_episode_with_length(tok, runner):
    env = tool_env(tok, runner)
    engine = ReplayEngine([Completion(text="a long ramble", finish="length")], tokenizer=tok)
    (traj,) = rollout(env, task(env), engine)
    assert traj.finish_reason == "length" and traj.reward == 0.0 and len(traj.turns) == 1
    check_alignment(traj, env.format)


def test_refused_request_is_an_error_trajectory(tok, runner):
    env = tool_env(tok, runner)
    (traj,) = rollout(env, task(env), ReplayEngine([], tokenizer=tok))
    assert traj.finish_reason == "error" and "refused" in traj.error and traj.reward == 0.0


def test_samples_run_concurrently_and_a_slow_tool_blocks_only_its_episode(tok, runner):
    try:
        env = tool_env(tok, runner, tools=["calculator", "python"], tool_timeout_s=5.0)
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox backend isolates here: {e}")
    base = f"{env.name}/train-0"
    engine = ReplayEngine(
        {
            f"{base}/s0/t0": [call("python", code="import time; time.sleep(1.5); print(1)")],
            f"{base}/s0/t1": ["Answer: 1"],
            f"{base}/s1/t0": [call("calculator", expression="6*7")],
            f"{base}/s1/t1": ["Answer: 42"],
        },
        tokenizer=tok,
    )
    trajs = rollout(env, task(env), engine, n=2)
    assert [t.reward for t in trajs] == [0.0, 1.0]
    order = [r.rid for r in engine.requests]
    assert order.index(f"{base}/s1/t1") < order.index(f"{base}/s0/t1")  # sample 1 did not wait for the sleep
    assert trajs[0].turns[1].text == "1\n" and trajs[0].turns[1].exit_code == 0


class CountingCalculator(CalculatorTool):
    calls = 0

    async def run(self, args, context):
        type(self).calls += 1
        return await super().run(args, context)


class CrashAt(ReplayEngine):
    """A replay engine whose k-th request raises, as a crashed process would stop the run."""

    def __init__(self, *a, crash_at: int, **kw):
        super().__init__(*a, **kw)
        self.crash_at, self.seen = crash_at, 0

    def submit(self, request, on_update=None):
        self.seen += 1
        if self.seen == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().submit(request, on_update)


def test_resume_after_a_crash_does_not_redo_recorded_tool_calls(tok, runner, tmp_path):
    script = [
        call("write_file", path="notes.txt", content="six times seven") + call("calculator", expression="6*7"),
        call("calculator", expression="40+2"),
        call("read_file", path="notes.txt"),
        "Answer: 42",
    ]
    # The reference: one uninterrupted run.
    env = tool_env(tok, runner, episode_dir=str(tmp_path / "ref"))
    env.tools["calculator"] = CountingCalculator()
    CountingCalculator.calls = 0
    (ref,) = rollout(env, task(env), ReplayEngine(script, tokenizer=tok))
    assert CountingCalculator.calls == 2

    folder = str(tmp_path / "episodes")
    env = tool_env(tok, runner, episode_dir=folder)
    env.tools["calculator"] = CountingCalculator()
    CountingCalculator.calls = 0
    with pytest.raises(RuntimeError, match="simulated crash"):  # the 3rd policy turn never comes
        rollout(env, task(env), CrashAt(script, tokenizer=tok, crash_at=3))
    assert CountingCalculator.calls == 2
    saved = EpisodeStore(folder).load(env.name, "train-0", 0)
    assert not saved.done and saved.policy_turns == 2 and saved.tool_calls == 3

    env = tool_env(tok, runner, episode_dir=folder)  # a fresh process: new env, same folder
    env.tools["calculator"] = CountingCalculator()
    CountingCalculator.calls = 0
    engine = ReplayEngine(script[2:], tokenizer=tok)
    (resumed,) = rollout(env, task(env), engine)
    assert CountingCalculator.calls == 0  # turns 1 and 2's calls were not redone
    assert env.stats["resumed"] == 1 and len(engine.requests) == 2
    assert resumed.turns[-2].text == "six times seven"  # the workspace came back from the checkpoint
    assert resumed.token_ids == ref.token_ids and resumed.loss_mask == ref.loss_mask
    assert [dataclasses.replace(u, duration_s=0) for u in resumed.turns] == [
        dataclasses.replace(u, duration_s=0) for u in ref.turns
    ]
    assert resumed.reward == ref.reward == 1.0

    # A finished episode comes back as recorded, with no engine call at all.
    env = tool_env(tok, runner, episode_dir=folder)
    engine = ReplayEngine([], tokenizer=tok)
    (again,) = rollout(env, task(env), engine)
    assert engine.requests == [] and again.token_ids == resumed.token_ids and again.reward == resumed.reward


def test_a_damaged_checkpoint_names_the_file(tok, runner, tmp_path):
    folder = tmp_path / "episodes"
    env = tool_env(tok, runner, episode_dir=str(folder))
    path = env.store.path(env.name, "train-0", 0)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{half a state")
    with pytest.raises(ValueError, match="delete it"):
        rollout(env, task(env), ReplayEngine(["Answer: 42"], tokenizer=tok))


def test_audit_records_hold_every_tool_call_and_replay(tok, runner, tmp_path):
    env = tool_env(tok, runner)
    script = [call("calculator", expression="6*7") + call("read_file", path="missing.txt"), "Answer: 42"]
    (traj,) = rollout(env, task(env), ReplayEngine(script, tokenizer=tok))
    path = str(tmp_path / "audit.jsonl")
    with AuditLog(path) as audit:  # what the stage does with every trajectory
        audit.write(traj, step=3)
    (record,) = list(read_audit(path))
    assert record["task_id"] == "train-0" and record["reward"] == 1.0 and record["step"] == 3
    calc, missing = record["turns"][1], record["turns"][2]
    assert calc["tool"] == "calculator" and calc["arguments"] == {"expression": "6*7"} and calc["text"] == "42"
    assert "duration_s" in calc and "error" not in calc
    assert missing["tool"] == "read_file" and "no file" in missing["error"] and missing["text"].startswith("error:")
    assert record["tokens"]["output"] == sum(traj.loss_mask) and record["metrics"]["tool_calls"] == 2
    # Replaying the recorded policy turns through the environment reproduces the episode.
    (replayed,) = rescore(tool_env(tok, runner), [record], tasks=[task(env)])
    assert replayed.token_ids == traj.token_ids and replayed.reward == traj.reward


def test_reward_code_that_fails_scores_zero_with_a_reason(tok, runner, monkeypatch):
    env = tool_env(tok, runner)
    import ptrain.envs.tool_use as tool_use

    monkeypatch.setattr(tool_use, "judge_answer", _raising_judge)
    (traj,) = rollout(env, task(env), ReplayEngine(["Answer: 42"], tokenizer=tok))
    assert traj.reward == 0.0 and "judge exploded" in traj.reward_error
    assert env.stats["reward_errors"] == 1


def _raising_judge(reply, expected):
    raise RuntimeError("judge exploded")


# ---------------------------------------------------------------------------------------- a real engine


@pytest.mark.slow
def test_end_to_end_on_a_local_engine_reuses_the_prefix_cache(tok, runner):
    """A random tiny model (biased to end its turns often) plays long_horizon: the loop's
    invariants hold and every turn after the first is served mostly from the prefix cache."""
    from flax import nnx

    from ptrain.config.model import ModelConfig
    from ptrain.models import Decoder
    from ptrain.rollout.local import LocalEngine

    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                      max_seq_len=512, tie_embeddings=False)  # fmt: skip
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # A constant direction in every embedding and a head that reads it for <|im_end|> only:
    # about half of the sampled tokens end the turn, so episodes have several turns.
    model.embed[...] = model.embed[...].at[:, 0].set(4.0)
    model.lm_head[...] = model.lm_head[...].at[0, :].set(0.0).at[0, im_end].set(1.1)
    opts = LongHorizonOptions(steps=3, max_turns=5, max_episode_tokens=512)
    env = LongHorizonEnv(EnvConfig(kind="long_horizon", n_train=1, n_eval=1), opts, tokenizer=tok, runner=runner)
    (t,) = env.tasks("train", seed=0)
    engine = LocalEngine(model, max_running_requests=8, context_length=512, eos_token_ids=[tok.eos_token_id],
                         decode_steps=4, prefill_chunk=128)  # fmt: skip
    try:
        trajs = asyncio.run(env.rollout(t, engine, SamplingParams(n=4, max_new_tokens=6, sampling_seed=3)))
    finally:
        engine.close()
    assert len(trajs) == 4 and len({tr.token_ids for tr in trajs}) > 1
    multi = 0
    for tr in trajs:
        check_alignment(tr, env.format)
        policy = [u for u in tr.turns if u.role == "policy"]
        assert tr.tokens.output == sum(tr.loss_mask) == sum(u.end - u.start for u in policy)
        assert all(lp <= 0.0 for lp, m in zip(tr.logprobs, tr.loss_mask) if m)
        assert tr.finish_reason in ("stop", "length", "turn_limit")
        for u in tr.turns:
            if u.role == "env":
                ids, _ = env.format.delta_ids([{"role": "user", "content": u.text}])
                assert list(tr.token_ids[u.start : u.end]) == ids
        if len(policy) >= 2:
            multi += 1
            prompts = [u.start for u in policy]
            total = sum(prompts)
            assert tr.tokens.prompt_cached + tr.tokens.prompt_uncached == total
            # Turn k's request extends turn k-1's prompt + output: at least that prompt is cached.
            assert tr.tokens.prompt_cached >= sum(prompts[:-1])
            assert tr.tokens.prompt_uncached < total / 2
    assert multi >= 1


def test_a_damaged_episode_file_is_named_with_the_fix(tmp_path):
    """A JSON list or an object without the token fields raised AttributeError / TypeError
    from the dataclass; now, as for a file that is not JSON, the error names it."""
    store = EpisodeStore(str(tmp_path))
    path = Path(store.path("tool_use", "train-0", 0))
    path.parent.mkdir(parents=True)
    for text, match in (
        ("{broken", "is not valid JSON"),
        ("[1, 2]", "a JSON list, not an episode state; delete it"),
        (json.dumps({"version": STATE_VERSION, "env": "tool_use"}), r"missing field\(s\) \['task_id', 'sample_index'"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            store.load("tool_use", "train-0", 0)
