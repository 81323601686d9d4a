"""The embedded tokenizer: round trip, digits, chat template masks, determinism, offline loading."""

import filecmp
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptrain.data import build_tokenizer, load_tokenizer, tokenize_conversation
from ptrain.data.chat import prompt_ids
from ptrain.data.tokenizer import EOS, IM_END, IM_START, PAD

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 347 + 589?"},
    {"role": "assistant", "content": "7+9+0=16 c1 6\nAnswer: 936"},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "Answer: 4"},
]


def test_round_trip_and_specials(tokenizer):
    text = "Hello, world! 12345 + 6789 = 19134\n\tünïcode ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    for t in (EOS, IM_START, IM_END, PAD):
        assert len(tokenizer.encode(t, add_special_tokens=False)) == 1, t
    assert tokenizer.pad_token == PAD and tokenizer.eos_token == EOS
    assert 260 < len(tokenizer) <= 512


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("90817263", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == list("90817263")


def test_build_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_tokenizer(str(a))
    build_tokenizer(str(b))
    names = sorted(os.listdir(a))
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


def test_loads_offline_with_auto_tokenizer(tok_dir, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert tok.chat_template == tokenizer.chat_template
    text = tokenizer.apply_chat_template(CONV, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert load_tokenizer(tok_dir).pad_token_id == tokenizer.pad_token_id


def test_assistant_mask_covers_exactly_assistant_content(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONV)
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    assert spans == ["7+9+0=16 c1 6\nAnswer: 936" + IM_END, "Answer: 4" + IM_END]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CONV, tokenize=False)


def test_prompt_completion_mask_skips_prompt_assistant_turns(tokenizer):
    """With n_prompt=4 only the last assistant turn counts (prompt/completion rows)."""
    ids, mask = tokenize_conversation(tokenizer, CONV, n_prompt=4)
    assert tokenizer.decode(ids[mask.astype(bool)]) == "Answer: 4" + IM_END


def test_generation_prompt_is_a_token_prefix(tokenizer):
    """The eval prompt tokenises exactly like the start of the training sequence."""
    ids, mask = tokenize_conversation(tokenizer, CONV[:3])
    p = prompt_ids(tokenizer, CONV[:2])
    np.testing.assert_array_equal(ids[: len(p)], p)
    assert mask[: len(p)].sum() == 0 and mask[len(p)] == 1


def test_prefix_fallback_equals_generation_tags(tokenizer, tok_dir, tmp_path):
    """A template without {% generation %} gets the same mask from growing prefixes."""
    tok = load_tokenizer(tok_dir)
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids_a, mask_a = tokenize_conversation(tokenizer, CONV)
    ids_b, mask_b = tokenize_conversation(tok, CONV)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_array_equal(mask_a, mask_b)


def test_prefix_fallback_masks_no_header_when_the_assistant_speaks_first(tokenizer, tok_dir):
    """Without generation tags, an opening assistant turn is masked from its content on, as
    with them: the `<|im_start|>assistant` header before it is formatting, not a target."""
    tok = load_tokenizer(tok_dir)
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    conv = [{"role": "assistant", "content": "Hello there"}] + CONV
    ids_a, mask_a = tokenize_conversation(tokenizer, conv)
    ids_b, mask_b = tokenize_conversation(tok, conv)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_array_equal(mask_a, mask_b)
    assert mask_b[0] == 0


def test_template_that_rewrites_earlier_turns_is_a_row_problem(tok_dir):
    """Growing prefixes only locate assistant tokens when a turn renders the same whatever
    follows; a template that shortens past assistant turns (as Qwen3's drops their <think>
    blocks) is reported for the row instead of giving a shifted mask."""
    from ptrain.data import report as R
    from ptrain.data.chat import RowProblem

    tok = load_tokenizer(tok_dir)
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.chat_template = plain.replace(
        "message['content'] + '<|im_end|>' }}{{- '\\n' }}",
        "(message['content'] if loop.last else '...') + '<|im_end|>' }}{{- '\\n' }}",
    )
    assert tok.chat_template != plain
    with pytest.raises(RowProblem) as err:
        tokenize_conversation(tok, CONV)
    assert err.value.reason == R.TEMPLATE_ERROR and "generation" in err.value.problem


def test_saved_files_use_names_transformers_4_understands(tok_dir):
    """transformers 4.x (SGLang's pin) rejects tokenizer_class TokenizersBackend and a list-valued
    extra_special_tokens; the saved config uses the classic names (checked to load in 4.57)."""
    import json

    cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["additional_special_tokens"] == [IM_START, IM_END]
    assert not isinstance(cfg.get("extra_special_tokens"), list) and "backend" not in cfg
    special = json.load(open(os.path.join(tok_dir, "special_tokens_map.json")))
    assert special["eos_token"] == EOS and special["pad_token"] == PAD
    assert os.path.isfile(os.path.join(tok_dir, "chat_template.jinja"))


_PIECES = list("ab Z9 0+-=\n\t.é✓") + [" c1", "Answer: ", "  ", "\n\n", "<|im_end|>"]
_TEXT = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=12).map(
    lambda p: "".join(p) if "".join(p).strip() else "".join(p) + "x"
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), _TEXT), min_size=1, max_size=5),
    split=st.integers(0, 5),
)
def test_fast_chatml_path_equals_apply_chat_template(tokenizer, turns, split):
    """The batched Python render of the embedded template gives apply_chat_template's ids and masks."""
    from ptrain.data.chat import tokenize_conversations

    messages = [{"role": r, "content": c} for r, c in turns] + [{"role": "assistant", "content": "Answer: 1"}]
    n_prompt = min(split, len(messages) - 1)
    ((ids_fast, mask_fast),) = tokenize_conversations(tokenizer, [(messages, n_prompt)])
    ids, mask = tokenize_conversation(tokenizer, messages, n_prompt)
    np.testing.assert_array_equal(ids_fast, ids)
    np.testing.assert_array_equal(mask_fast, mask)
