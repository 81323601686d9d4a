"""Bad rows: each kind is counted with its row numbers; skip reports, fail raises naming file and row."""

import json

import pytest

from ptrain.data import BadRowError, JsonlSource, make_sft_iterator, tokenize_sft_rows
from ptrain.data import report as R

GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Answer: 4"}]}
GOOD_PC = {"prompt": "What is 3 + 3?", "completion": "Answer: 6"}
LONG = {"messages": [{"role": "user", "content": "count " * 200}, {"role": "assistant", "content": "Answer: 1"}]}
LONG_ANSWER = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok " * 200}]}

# (raw line, expected reason or None for a good row)
TABLE = [
    (json.dumps(GOOD), None),
    ("{oops", R.INVALID_JSON),
    (json.dumps({"text": "no messages"}), R.MISSING_FIELD),
    (json.dumps({"messages": [{"content": "no role"}]}), R.MISSING_FIELD),
    (json.dumps({"prompt": "only a prompt"}), R.MISSING_FIELD),
    (
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
        R.UNKNOWN_ROLE,
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}),
        R.EMPTY_ASSISTANT,
    ),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), R.EMPTY_ASSISTANT),
    (
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}),
        R.EMPTY_ASSISTANT,
    ),
    (json.dumps({"prompt": "q", "completion": " "}), R.EMPTY_ASSISTANT),
    (json.dumps({"messages": "just a string"}), R.WRONG_TYPE),
    (json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}), R.WRONG_TYPE),
    (json.dumps({"prompt": ["not a message"], "completion": "x"}), R.WRONG_TYPE),
    (json.dumps(GOOD_PC), None),
    (json.dumps(LONG), R.TOO_LONG),
    (json.dumps(GOOD), None),
    (json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}), R.MISSING_FIELD),
]


@pytest.fixture()
def bad_file(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(line for line, _ in TABLE) + "\n")
    return str(path)


def test_every_kind_is_counted_with_row_numbers(bad_file, tokenizer):
    rows, rep = tokenize_sft_rows(
        JsonlSource(bad_file),
        tokenizer,
        fmt="auto",
        seq_len=64,
        truncate=False,
        bad_rows="skip",
        max_bad_fraction=1.0,
        name=bad_file,
    )
    expected: dict[str, list[int]] = {}
    for i, (_, reason) in enumerate(TABLE):
        if reason:
            expected.setdefault(reason, []).append(i)
    assert rep.rows == expected
    assert rep.counts == {k: len(v) for k, v in expected.items()}
    assert rep.total == len(TABLE) and rep.good == 3 and list(rows.rows) == [0, 13, 15]
    text = rep.summary()
    for reason in expected:
        assert reason in text
    assert "mixed.jsonl row 1 (line 2)" in text
    metrics = rep.as_metrics()
    assert metrics["data/bad_rows"] == sum(rep.counts.values())
    assert metrics["data/bad_rows/empty_assistant"] == 4


def test_fail_names_file_row_and_problem(bad_file, tokenizer):
    with pytest.raises(BadRowError) as e:
        tokenize_sft_rows(JsonlSource(bad_file), tokenizer, fmt="auto", seq_len=64, truncate=False, bad_rows="fail")
    msg = str(e.value)
    assert "mixed.jsonl row 1 (line 2)" in msg and "invalid_json" in msg and "data.bad_rows=skip" in msg


def test_too_many_bad_rows_fails_even_when_skipping(bad_file, tokenizer):
    with pytest.raises(BadRowError, match="max_bad_fraction"):
        tokenize_sft_rows(
            JsonlSource(bad_file),
            tokenizer,
            fmt="auto",
            seq_len=64,
            truncate=False,
            bad_rows="skip",
            max_bad_fraction=0.5,
        )


def test_format_forced_to_chat_rejects_prompt_completion_rows(tokenizer, tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD_PC) + "\n")
    _, rep = tokenize_sft_rows(
        JsonlSource(str(path)), tokenizer, fmt="chat", seq_len=64, truncate=True, max_bad_fraction=1.0
    )
    assert rep.rows == {R.MISSING_FIELD: [1]}


def test_truncation_on_cuts_and_off_rejects(tokenizer, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD, LONG_ANSWER, LONG)) + "\n")
    rows, rep = tokenize_sft_rows(
        JsonlSource(str(path)), tokenizer, fmt="auto", seq_len=32, truncate=True, max_bad_fraction=1.0
    )
    # The long answer is cut to 33 tokens (32 next-token pairs); the long prompt leaves no target.
    assert rep.truncated == 1 and rep.rows == {R.NO_TARGET: [2]}
    assert rows.lengths().tolist()[1] == 33
    rows, rep = tokenize_sft_rows(
        JsonlSource(str(path)), tokenizer, fmt="auto", seq_len=32, truncate=False, max_bad_fraction=1.0
    )
    assert rep.rows == {R.TOO_LONG: [1, 2]} and rep.truncated == 0


def test_a_row_the_chat_template_rejects_is_counted_not_fatal(tok_dir, tmp_path):
    """Templates that raise_exception (Llama 2, Mistral, Gemma: roles must alternate) reject one
    row; the rest of its chunk still tokenises and the row is reported with its number."""
    from ptrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    guard = (
        "{%- for message in messages %}{%- if message['role'] == 'user' and loop.index0 % 2 == 1 %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}{%- endfor %}"
    )
    tok.chat_template = guard + tok.chat_template
    two_users = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"},
        ]
    }
    path = tmp_path / "alt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD, two_users, GOOD, GOOD)) + "\n")
    rows, rep = tokenize_sft_rows(
        JsonlSource(str(path)), tok, fmt="auto", seq_len=64, truncate=True, max_bad_fraction=0.5
    )
    assert len(rows) == 3 and rep.rows == {R.TEMPLATE_ERROR: [1]}
    assert "roles must alternate" in rep.summary()
    with pytest.raises(BadRowError, match="row 1.*template_error"):
        tokenize_sft_rows(JsonlSource(str(path)), tok, fmt="auto", seq_len=64, truncate=True, bad_rows="fail")


def test_report_keeps_only_the_first_rows(tokenizer, tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(["{bad"] * 30 + [json.dumps(GOOD)] * 30) + "\n")
    _, rep = tokenize_sft_rows(
        JsonlSource(str(path)), tokenizer, fmt="auto", seq_len=64, truncate=True, max_bad_fraction=0.5, report_rows=4
    )
    assert rep.counts == {R.INVALID_JSON: 30} and rep.rows[R.INVALID_JSON] == [0, 1, 2, 3]
    assert "..." in rep.summary()


def test_iterator_exposes_report_and_never_yields_bad_rows(bad_file, tokenizer, make_cfg):
    cfg = make_cfg(source="jsonl", train_path=bad_file, max_bad_fraction=1.0, truncate=False, packing=False)
    it = make_sft_iterator(cfg, tokenizer, batch_size=3, seq_len=64)
    assert it.report.good == 3
    batch = next(it)
    # Exactly the three good rows, each one an unbroken segment with assistant targets.
    assert batch["input_ids"].shape == (3, 64)
    assert (batch["loss_mask"].sum(axis=1) > 0).all()
    texts = sorted(tokenizer.decode(r[s > 0]) for r, s in zip(batch["input_ids"], batch["segment_ids"]))
    assert any("What is 3 + 3?" in t for t in texts) and sum("What is 2 + 2?" in t for t in texts) == 2


def test_rl_prompt_iterator_counts_bad_rows_under_the_policy(bad_file, tokenizer, make_cfg):
    """The RL prompt iterator reports the rows it cannot turn into prompts, and applies
    bad_rows and max_bad_fraction to them, as the SFT iterator does."""
    from ptrain.data import make_prompt_iterator

    cfg = make_cfg(source="jsonl", train_path=bad_file, max_bad_fraction=1.0)
    rep = make_prompt_iterator(cfg, tokenizer, batch_size=2).report
    assert rep.total == len(TABLE) and rep.good + rep.bad == len(TABLE)
    assert rep.rows[R.INVALID_JSON] == [1] and rep.rows[R.UNKNOWN_ROLE] == [5]
    with pytest.raises(BadRowError, match="more than"):
        make_prompt_iterator(
            make_cfg(source="jsonl", train_path=bad_file, max_bad_fraction=0.1), tokenizer, batch_size=2
        )
    with pytest.raises(BadRowError, match="row 1 .*invalid_json"):
        make_prompt_iterator(make_cfg(source="jsonl", train_path=bad_file, bad_rows="fail"), tokenizer, batch_size=2)


def test_stats_cli_reports_bad_rows_and_shows_the_trained_part(tmp_path, tok_dir, capsys):
    from ptrain.data.stats import main

    path = tmp_path / "u.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in (GOOD_PC, {"messages": [{"role": "user", "content": "x"}]}, GOOD)) + "\n"
    )
    main(["--train-path", str(path), "--batch-size", "2", "--batches", "2", "--seq-len", "64", "--tokenizer", tok_dir])
    out = capsys.readouterr().out
    assert "2 of 3 rows used" in out and "empty_assistant: 1 (rows [1])" in out
    assert "What is 3 + 3?<|im_end|>\n<|im_start|>assistant\n[[Answer: 6<|im_end|>]]" in out
