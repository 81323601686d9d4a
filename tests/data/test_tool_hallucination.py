"""Calls to undeclared tools planted in SFT rows: which rows, what the call looks like, what
the metrics and the DPO stage read from it, and the SFT pipeline's training rows."""

import json

import numpy as np
import pytest

from ptrain.config.data import DataConfig, ReasoningConfig, validate_data_config
from ptrain.data.reasoning import ReasoningControls
from ptrain.data.sft import sft_examples
from ptrain.data.sources import ListSource
from ptrain.data.tool_hallucination import (
    QUERY_CHARS,
    UNDECLARED_TOOLS,
    ToolHallucination,
    row_declares_tools,
    undeclared_call,
)
from ptrain.envs.base import Task, Trajectory, Turn
from ptrain.stages.env_metrics import calls_a_tool

QUESTION = "What is 12 + 30? Show the columns, then give the answer on its own line."


def policy_turn(text: str) -> Trajectory:
    return Trajectory(
        task=Task(env="e", id="t", messages=()),
        sample_index=0,
        token_ids=(0, 1),
        prompt_length=1,
        loss_mask=(0, 1),
        logprobs=(0.0, -0.5),
        reward=1.0,
        turns=(Turn(role="policy", start=1, end=2, text=text),),
    )


def convo(content: str = "<think>units 2, tens 4</think>Answer: 42") -> list[dict]:
    return [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": content},
    ]


def test_the_call_goes_after_the_reasoning_and_before_the_unchanged_answer():
    out = undeclared_call(convo(), np.random.default_rng(0))
    content = out[-1]["content"]
    assert content.startswith("<think>units 2, tens 4</think><tool_call>\n")
    assert content.endswith("\n</tool_call>\nAnswer: 42")
    body = content.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    call = json.loads(body)
    assert call["name"] in UNDECLARED_TOOLS
    assert call["arguments"] == {"query": QUESTION[:QUERY_CHARS]}
    assert out[:2] == convo()[:2]  # the prompt is not touched
    assert convo()[-1]["content"] == "<think>units 2, tens 4</think>Answer: 42"  # nor the input


def test_a_turn_without_reasoning_opens_with_the_call():
    out = undeclared_call(convo("Answer: 42"), np.random.default_rng(1))
    assert out[-1]["content"].startswith("<tool_call>\n{") and out[-1]["content"].endswith("</tool_call>\nAnswer: 42")


def test_no_call_without_a_last_assistant_turn_after_a_user_turn():
    rng = np.random.default_rng(0)
    assert undeclared_call(convo()[:2], rng) is None
    assert undeclared_call([{"role": "assistant", "content": "a"}], rng) is None
    assert undeclared_call([], rng) is None


def test_the_planted_call_reads_as_a_hallucinated_one():
    """The eval metric (hallucinated_tool_calls) and the DPO stage's `hallucination` pairs
    look for the same opening tag the planted call writes."""
    text = undeclared_call(convo(), np.random.default_rng(0))[-1]["content"]
    assert calls_a_tool(policy_turn(text))
    assert not calls_a_tool(policy_turn(convo()[-1]["content"]))


def test_rows_that_declare_tools_are_left_alone():
    declared = convo()
    declared[0] = {"role": "system", "content": "# Tools\n<tools>\n{}\n</tools>"}
    assert row_declares_tools({"messages": declared})
    assert row_declares_tools({"messages": convo(), "tools": [{"name": "calculator"}]})
    assert not row_declares_tools({"messages": convo()})
    rows = ListSource([{"messages": declared}, {"messages": convo(), "tools": [{"name": "x"}]}])
    planted = ToolHallucination(rows, share=1.0, seed=0)
    assert planted[0] == rows[0] and planted[1] == rows[1]


def test_rows_are_drawn_by_seed_and_index_at_the_share_and_apart_from_the_reasoning_controls(tokenizer):
    rows = ListSource([{"messages": convo()} for _ in range(4000)])
    planted = ToolHallucination(rows, share=0.10, seed=7)
    drawn = [planted.chosen(i)[0] for i in range(len(rows))]
    assert abs(sum(drawn) / 4000 - 0.10) < 0.015
    for i in range(200):
        assert ("<tool_call>" in planted[i]["messages"][-1]["content"]) == drawn[i]
    assert [ToolHallucination(rows, share=0.10, seed=7)[i] for i in range(50)] == [planted[i] for i in range(50)]
    assert [ToolHallucination(rows, share=0.10, seed=8).chosen(i)[0] for i in range(400)] != drawn[:400]
    # The reasoning controls pick the same rows with or without the planted calls on top.
    controls = ReasoningControls(rows, tokenizer, strip=0.10, budget=0.03, seed=7)
    both = ToolHallucination(controls, share=0.10, seed=7)
    for i in range(300):
        what = controls.choice(i)[0]
        content = both[i]["messages"][-1]["content"]
        assert content.startswith("<think></think>") == (what == "off")
        assert ("<tool_call>" in content) == drawn[i]
    assert rows[0] == {"messages": convo()}
    assert len(both) == 4000 and both.where(3) == rows.where(3) and both.name == rows.name


def test_rows_it_cannot_read_are_left_for_the_row_checks():
    rows = ListSource([{"messages": "not a list"}, {"prompt": "p", "completion": "c"}, {"messages": [1, 2]}])
    planted = ToolHallucination(rows, share=1.0, seed=0)
    assert [planted[i] for i in range(3)] == [rows[i] for i in range(3)]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ToolHallucination(rows, share=1.5, seed=0)


def test_config_rejects_a_share_outside_zero_to_one():
    for bad in (-0.1, 1.2):
        with pytest.raises(ValueError, match="data.tool_hallucination"):
            validate_data_config(DataConfig(tool_hallucination=bad))
    validate_data_config(DataConfig(tool_hallucination=0.1, reasoning=ReasoningConfig(strip=0.1)))


def test_sft_pipeline_trains_on_planted_calls_and_holds_out_the_originals(tmp_path, tokenizer):
    rows = [{"messages": convo()} for _ in range(32)]
    for split in ("train", "eval"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = DataConfig(source="jsonl", train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl"))
    planted = DataConfig(**{**plain.__dict__, "tool_hallucination": 1.0})
    base, _ = sft_examples(plain, tokenizer, seq_len=256)
    called, _ = sft_examples(planted, tokenizer, seq_len=256)
    assert "<tool_call>" not in tokenizer.decode(base[0]["tokens"])
    assert all("<tool_call>" in tokenizer.decode(called[i]["tokens"]) for i in range(len(called)))
    held, _ = sft_examples(planted, tokenizer, seq_len=256, split="eval")
    assert all("<tool_call>" not in tokenizer.decode(held[i]["tokens"]) for i in range(len(held)))
