"""tool_use: generated tasks whose answers are right (checked by independent computations),
tools declared to the policy, scripted episodes of every family scored 1, the judge, config."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys

import pytest
import yaml

from ptrain.config.env import EnvConfig, EnvConfigError, validate_env_config
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.registry import make_env
from ptrain.envs.safety import RewardRunner
from ptrain.envs.tool_use import SYSTEM_PROMPT, ToolUseEnv, judge_answer
from ptrain.envs.tools import TOOL_NAMES, bundled_corpus, calculate
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine
from ptrain.sandbox import SandboxUnavailableError

sys.path.insert(0, os.path.dirname(__file__))
from chat_templates import QWEN25  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=512)


@pytest.fixture(scope="module")
def runner():
    with RewardRunner(workers=1, timeout_s=10.0) as pool:
        yield pool


def build(tok, runner=None, **options) -> ToolUseEnv:
    cfg = EnvConfig(kind="tool_use", n_train=16, n_eval=8, options=options)
    try:
        env = make_env(cfg, tokenizer=tok)
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox backend isolates here: {e}")
    if runner is not None:
        env._runner, env._owns_runner = runner, False
    return env


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tasks_are_deterministic_disjoint_and_cycle_through_the_families(tok):
    env = build(tok)
    train, held = env.tasks("train", seed=0), env.tasks("eval", seed=0)
    assert len(train) == 16 and len(held) == 8
    assert [t.data["family"] for t in train[:4]] == ["calculator", "file", "search", "python"]
    again = build(tok).tasks("train", seed=0)
    assert [(t.messages, t.data) for t in again] == [(t.messages, t.data) for t in train]
    other = build(tok).tasks("train", seed=1)
    assert [t.messages for t in other] != [t.messages for t in train]
    questions = {t.messages[1]["content"] for t in train}
    assert not questions & {t.messages[1]["content"] for t in held if t.data["family"] != "search"}
    for t in train + held:
        assert t.messages[0] == {"role": "system", "content": SYSTEM_PROMPT} and t.env == "tool_use"


def _primes(n):
    return sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n))


def _fib_mod(n, m):
    def pair(k):  # fast doubling: (F(k), F(k+1)) mod m
        if k == 0:
            return 0, 1
        a, b = pair(k // 2)
        c, d = a * ((2 * b - a) % m) % m, (a * a + b * b) % m
        return (d, (c + d) % m) if k % 2 else (c, d)

    return pair(n)[0]


def test_every_generated_answer_is_right(tok):
    env = build(tok)
    corpus = bundled_corpus()
    for t in env.tasks("train", seed=3) + env.tasks("eval", seed=3):
        q, answer = t.messages[1]["content"], t.data["answer"]
        family = t.data["family"]
        if family == "calculator":
            expr = q.removeprefix("What is ").split("?")[0]
            assert str(calculate(expr)) == answer
        elif family == "file":
            (path,) = [p for p in t.data["files"] if p.endswith(".csv")]
            item = q.split("total quantity of ")[1].split(" ordered")[0]
            rows = list(csv.DictReader(io.StringIO(t.data["files"][path])))
            assert str(sum(int(r["quantity"]) for r in rows if r["item"] == item)) == answer
        elif family == "search":
            doc = next(d for d in corpus.documents if d.title in q)
            assert answer in doc.text
        else:
            if "digits" in q:
                a, b = map(int, q.split("of ")[-1].rstrip("?").split("**"))
                assert str(sum(int(c) for c in str(a**b))) == answer
            elif "prime" in q:
                assert str(_primes(int(q.split("than ")[1].rstrip("?")))) == answer
            else:
                n = int(q.split("F(")[-1].split(")")[0])
                m = int(q.split("modulo ")[1].rstrip("?"))
                assert str(_fib_mod(n, m)) == answer


def test_tools_are_declared_to_the_policy(tok):
    env = build(tok)
    prompt = env.format.prompt_text(env.tasks("train", seed=0)[0].messages)
    for name in env.options.tools:
        assert f'"name": "{name}"' in prompt
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    qwen_tok = build_tokenizer(vocab_size=512)
    qwen_tok.chat_template = QWEN25
    qwen = build(qwen_tok)
    text = qwen.format.prompt_text(qwen.tasks("train", seed=0)[0].messages)
    assert qwen.format.tools_in_template and "# Tools" in text and text.count('"type": "function"') == 5


@pytest.mark.parametrize(
    "reply, expected, value",
    [
        ("The total is\nAnswer: 1,234", "1234", 1.0),
        ("Answer: 1234.", "1234", 1.0),
        ("Answer: 12 cm", "12", 1.0),
        ("Answer: 7\nwait, Answer: 8", "8", 1.0),
        ("Answer: 7\nwait, Answer: 8", "7", 0.0),
        ("Answer: The Wisosk River.", "Wisosk River", 1.0),
        ("answer 1234", "1234", 0.0),
        ("Answer: 1233", "1234", 0.0),
        ("Answer: Brizemtek", "Brizemtek", 1.0),
    ],
)
def test_judge(reply, expected, value):
    assert judge_answer(reply, expected) == value


def _script(t) -> list[str]:
    family, answer = t.data["family"], t.data["answer"]
    if family == "calculator":
        expr = t.messages[1]["content"].removeprefix("What is ").split("?")[0]
        first = call("calculator", expression=expr)
    elif family == "file":
        first = call("read_file", path=next(p for p in t.data["files"] if p.endswith(".csv")))
    elif family == "search":
        first = call("search", query=t.messages[1]["content"])
    else:
        first = call("python", code=f"print({answer})")
    return [first, f"Done.\nAnswer: {answer}"]


def test_a_scripted_episode_of_each_family_scores_one(tok, runner):
    env = build(tok, runner)
    tasks = env.tasks("train", seed=0)[:4]

    async def main():
        out = []
        for t in tasks:
            engine = ReplayEngine(_script(t), tokenizer=tok)
            out.append((await env.rollout(t, engine, SamplingParams(n=1, max_new_tokens=256)))[0])
        return out

    for t, traj in zip(tasks, asyncio.run(main())):
        assert traj.finish_reason == "stop", traj.turns
        assert traj.reward == 1.0 and traj.metrics["used_tool"] == 1.0, (t.data["family"], traj.turns)
        tool_turn = traj.turns[1]
        assert tool_turn.role == "tool" and tool_turn.error is None
        if t.data["family"] != "file":  # the file's quantities still need adding up
            assert t.data["answer"] in tool_turn.text


def test_a_wrong_or_missing_answer_scores_zero(tok, runner):
    env = build(tok, runner, invalid_call_penalty=0.25)
    t = env.tasks("train", seed=0)[0]

    def one(script):
        return asyncio.run(env.rollout(t, ReplayEngine(script, tokenizer=tok), SamplingParams(max_new_tokens=256)))[0]

    wrong = one(["Answer: 3"])
    assert wrong.reward == 0.0 and wrong.metrics["answered"] == 1.0 and wrong.metrics["used_tool"] == 0.0
    silent = one(["I do not know."])
    assert silent.reward == 0.0 and silent.metrics["answered"] == 0.0
    invalid = one(["<tool_call>{bad json</tool_call>", f"Answer: {t.data['answer']}"])
    assert invalid.reward_components == {"correct": 1.0, "invalid_tool_call": -0.25}


def test_bad_options_are_refused_with_the_key_named():
    for options, match in [
        ({"families": ["file"], "tools": ["calculator"]}, "lacks \\['read_file'\\]"),
        ({"tools": ["calculator", "web"]}, "options.tools"),
        ({"families": []}, "options.families"),
        ({"max_turns": 0}, "options.max_turns"),
        ({"invalid_call_penalty": -1.0}, "options.invalid_call_penalty"),
        ({"tool_timeout_s": 0.0}, "options.tool_timeout_s"),
        ({"toolz": []}, "options.toolz': not an option"),
        ({"corpus_path": "/nonexistent/corpus.jsonl"}, "options.corpus_path': no file '/nonexistent/corpus.jsonl'"),
    ]:
        with pytest.raises(EnvConfigError, match=match):
            validate_env_config(EnvConfig(kind="tool_use", options=options))


def test_the_config_file_builds_valid_options_and_the_tool_lists_agree():
    from ptrain.config.env_multi_turn import TOOL_NAMES as CONFIG_TOOL_NAMES

    assert CONFIG_TOOL_NAMES == TOOL_NAMES
    for kind in ("tool_use", "long_horizon", "terminal"):
        with open(os.path.join(REPO, "conf", "env", f"{kind}.yaml")) as f:
            node = yaml.safe_load(f)
        node.pop("defaults")
        opts = validate_env_config(EnvConfig(**node))
        assert type(opts).__name__.lower().startswith(kind.replace("_", ""))
