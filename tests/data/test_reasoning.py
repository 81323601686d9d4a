"""Nano's SFT transforms: reasoning off and thinking budgets, on rows and through the SFT pipeline."""

import json

import numpy as np
import pytest

from ptrain.config.data import DataConfig, ReasoningConfig, validate_data_config
from ptrain.data.reasoning import (
    ReasoningControls,
    budget_tag,
    reasoning_budget,
    reasoning_off,
    split_reasoning,
)
from ptrain.data.sft import sft_examples
from ptrain.data.sources import ListSource

REASONING = "12 + 30: units 2 + 0 = 2, tens 1 + 3 = 4, so 42"


def convo(reasoning: str = REASONING, answer: str = "Answer: 42") -> list[dict]:
    return [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": f"<think>{reasoning}</think>{answer}"},
    ]


def test_split_reasoning_finds_the_closed_block_only():
    assert split_reasoning("<think>a b</think>c") == ("", "a b", "c")
    assert split_reasoning("x<think></think>y") == ("x", "", "y")
    assert split_reasoning("<think>never closed") is None
    assert split_reasoning("no reasoning at all") is None


def test_reasoning_off_keeps_the_answer_and_the_prompt():
    out = reasoning_off(convo())
    assert out[-1]["content"] == "<think></think>Answer: 42"
    assert out[:2] == convo()[:2]
    assert reasoning_off([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) is None


def test_budget_cuts_reasoning_to_n_tokens_and_states_n_in_the_user_turn(tokenizer):
    rng = np.random.default_rng(0)
    full = tokenizer.encode(REASONING, add_special_tokens=False)
    for _ in range(20):
        out = reasoning_budget(convo(), tokenizer, rng)
        user, answer = out[1]["content"], out[-1]["content"]
        n = int(user.rsplit(": ", 1)[1].rstrip("}"))
        assert user == "What is 12 + 30?" + budget_tag(n)
        assert 1 <= n < len(full)
        head, cut, tail = split_reasoning(answer)
        assert tail == "Answer: 42" and head == ""
        assert tokenizer.encode(cut, add_special_tokens=False) == full[:n]
    assert out[0] == convo()[0]  # the system turn is not where the budget goes


def test_budget_needs_two_reasoning_tokens_and_a_user_turn(tokenizer):
    rng = np.random.default_rng(0)
    assert reasoning_budget(convo(reasoning="4"), tokenizer, rng) is None
    assert reasoning_budget([{"role": "assistant", "content": "<think>a long one</think>b"}], tokenizer, rng) is None


def test_controls_pick_rows_by_seed_and_index_at_the_given_shares(tokenizer):
    rows = ListSource([{"messages": convo()} for _ in range(4000)])
    rc = ReasoningControls(rows, tokenizer, strip=0.10, budget=0.03, seed=7)
    picks = [rc.choice(i)[0] for i in range(len(rows))]
    assert abs(picks.count("off") / 4000 - 0.10) < 0.015
    assert abs(picks.count("budget") / 4000 - 0.03) < 0.01
    again = ReasoningControls(rows, tokenizer, strip=0.10, budget=0.03, seed=7)
    assert [again[i] for i in range(50)] == [rc[i] for i in range(50)]
    other = ReasoningControls(rows, tokenizer, strip=0.10, budget=0.03, seed=8)
    assert [other.choice(i)[0] for i in range(400)] != picks[:400]
    for i, what in enumerate(picks[:300]):
        content = rc[i]["messages"][-1]["content"]
        if what == "off":
            assert content == "<think></think>Answer: 42"
        elif what == "keep":
            assert content == convo()[-1]["content"]
        else:
            assert "thinking token budget" in rc[i]["messages"][1]["content"]
    assert rows[0] == {"messages": convo()}  # the source rows are not modified


def test_controls_leave_rows_they_cannot_read_for_the_row_checks(tokenizer):
    rows = ListSource([{"messages": "not a list"}, {"prompt": "p", "completion": "c"}])
    rc = ReasoningControls(rows, tokenizer, strip=1.0, budget=0.0, seed=0)
    assert rc[0] == rows[0] and rc[1] == rows[1]
    with pytest.raises(ValueError, match="sum <= 1"):
        ReasoningControls(rows, tokenizer, strip=0.8, budget=0.3, seed=0)


def test_config_rejects_shares_that_cannot_work():
    with pytest.raises(ValueError, match="data.reasoning.strip"):
        validate_data_config(DataConfig(reasoning=ReasoningConfig(strip=-0.1)))
    with pytest.raises(ValueError, match="above 1"):
        validate_data_config(DataConfig(reasoning=ReasoningConfig(strip=0.6, budget=0.5)))


def test_sft_pipeline_trains_on_transformed_rows_and_holds_out_the_originals(tmp_path, tokenizer):
    rows = [{"messages": convo()} for _ in range(64)]
    for split in ("train", "eval"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = DataConfig(source="jsonl", train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl"))
    off = DataConfig(**{**plain.__dict__, "reasoning": ReasoningConfig(strip=1.0)})
    base, _ = sft_examples(plain, tokenizer, seq_len=128)
    cut, _ = sft_examples(off, tokenizer, seq_len=128)
    assert all(len(cut[i]["tokens"]) < len(base[i]["tokens"]) for i in range(len(cut)))
    text = tokenizer.decode(cut[0]["tokens"])
    assert "<think></think>Answer: 42" in text and REASONING not in text
    held, _ = sft_examples(off, tokenizer, seq_len=128, split="eval")
    assert REASONING in tokenizer.decode(held[0]["tokens"])
