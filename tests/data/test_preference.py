"""Preference pairs: batch layout, completion-only masks, bad pairs, resume, one-pass precompute."""

import json

import numpy as np
import pytest

from ptrain.data import JsonlSource, make_preference_iterator, make_preference_pass, preference_examples
from ptrain.data import report as R
from ptrain.data.preference import tokenize_preference_rows
from ptrain.data.tasks import check_answer

B, L = 4, 128
SIDE_KEYS = ("input_ids", "target_ids", "loss_mask", "segment_ids", "positions")


def _pref_cfg(make_cfg, **kw):
    return make_cfg(format="preference", **kw)


def test_batch_layout_and_masks(tokenizer, make_cfg):
    it = make_preference_iterator(_pref_cfg(make_cfg), tokenizer, batch_size=B, seq_len=L, seed=0)
    batch = next(it)
    assert set(batch) == {f"{s}_{k}" for s in ("chosen", "rejected") for k in SIDE_KEYS} | {"pair_index"}
    assert batch["pair_index"].shape == (B,) and batch["pair_index"].dtype == np.int32
    pairs, _ = preference_examples(_pref_cfg(make_cfg), tokenizer, seq_len=L)
    for r in range(B):
        texts = {}
        for side in ("chosen", "rejected"):
            seg, mask = batch[f"{side}_segment_ids"][r], batch[f"{side}_loss_mask"][r]
            n = int(seg.sum())
            assert (seg[:n] == 1).all() and (seg[n:] == 0).all() and (mask[n:] == 0).all()
            np.testing.assert_array_equal(batch[f"{side}_positions"][r, :n], np.arange(n))
            np.testing.assert_array_equal(batch[f"{side}_target_ids"][r, : n - 1], batch[f"{side}_input_ids"][r, 1:n])
            texts[side] = tokenizer.decode(batch[f"{side}_target_ids"][r][mask > 0])
            assert texts[side].endswith("<|im_end|>") and "What is" not in texts[side]
            # the prompt tokens are identical on both sides
        k = int(np.argmax(batch["chosen_loss_mask"][r]))
        np.testing.assert_array_equal(batch["chosen_input_ids"][r, :k], batch["rejected_input_ids"][r, :k])
        assert texts["chosen"] != texts["rejected"]
        row = pairs[int(batch["pair_index"][r])]
        np.testing.assert_array_equal(
            row["chosen"]["tokens"][:-1][:L], batch["chosen_input_ids"][r, : len(row["chosen"]["tokens"]) - 1]
        )


def test_generated_pairs_chosen_correct_rejected_wrong(tokenizer, make_cfg):
    batch = next(make_preference_iterator(_pref_cfg(make_cfg), tokenizer, batch_size=B, seq_len=L, seed=0))
    from ptrain.data.sources import generated_records

    records = generated_records(_pref_cfg(make_cfg), "train")
    pairs, _ = preference_examples(_pref_cfg(make_cfg), tokenizer, seq_len=L)
    for r in range(B):
        task = records[pairs[int(batch["pair_index"][r])]["row"]]["task"]
        chosen = tokenizer.decode(batch["chosen_target_ids"][r][batch["chosen_loss_mask"][r] > 0])
        rejected = tokenizer.decode(batch["rejected_target_ids"][r][batch["rejected_loss_mask"][r] > 0])
        assert check_answer(task, chosen) and not check_answer(task, rejected)


def test_bad_pairs_are_counted(tokenizer, tmp_path):
    good = {"prompt": "What is 1 + 1?", "chosen": "Answer: 2", "rejected": "Answer: 3"}
    table = [
        (good, None),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, R.IDENTICAL_PAIR),
        ({"prompt": "q", "chosen": "", "rejected": "x"}, R.EMPTY_COMPLETION),
        (
            {"prompt": "q", "chosen": [{"role": "user", "content": "not an answer"}], "rejected": "x"},
            R.EMPTY_COMPLETION,
        ),
        ({"prompt": "q", "chosen": "a"}, R.MISSING_FIELD),
        ({"chosen": "a", "rejected": "b"}, R.MISSING_FIELD),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, R.WRONG_TYPE),
        ({"prompt": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"}, R.UNKNOWN_ROLE),
        ({"prompt": "q " * 100, "chosen": "a", "rejected": "b"}, R.TOO_LONG),
        (good, None),
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r, _ in table) + "\n")
    pairs, rep = tokenize_preference_rows(
        JsonlSource(str(path)), tokenizer, seq_len=64, truncate=False, max_bad_fraction=1.0
    )
    expected: dict[str, list[int]] = {}
    for i, (_, reason) in enumerate(table):
        if reason:
            expected.setdefault(reason, []).append(i)
    assert rep.rows == expected and len(pairs) == 2
    with pytest.raises(R.BadRowError, match="pairs.jsonl row 1 .*identical_pair"):
        tokenize_preference_rows(JsonlSource(str(path)), tokenizer, seq_len=64, truncate=False, bad_rows="fail")


def test_pair_made_identical_by_truncation_is_counted(tokenizer, tmp_path):
    """Chosen and rejected that differ only past seq_len tokenise to the same truncated
    sequence: no preference is left, so the pair is reported, not trained on."""
    shared = "step " * 40
    rows = [
        {"prompt": "q", "chosen": shared + "Answer: 2", "rejected": shared + "Answer: 3"},
        {"prompt": "What is 1 + 1?", "chosen": "Answer: 2", "rejected": "Answer: 3"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs, rep = tokenize_preference_rows(
        JsonlSource(str(path)), tokenizer, seq_len=32, truncate=True, max_bad_fraction=1.0
    )
    assert len(pairs) == 1 and rep.rows == {R.IDENTICAL_PAIR: [0]}
    assert "seq_len=32" in rep.summary()


def test_resume_is_exact(tokenizer, make_cfg):
    cfg = _pref_cfg(make_cfg)
    reference = [
        next(it)
        for it in [make_preference_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=4)]
        for _ in range(40)
    ]
    for k in (0, 7, 30, 31):  # 120 pairs / 4 = 30 batches per epoch
        it = make_preference_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=4)
        for _ in range(k):
            next(it)
        fresh = make_preference_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=4)
        fresh.set_state(it.get_state())
        for j in range(k, min(k + 5, 40)):
            got = next(fresh)
            for key in got:
                np.testing.assert_array_equal(got[key], reference[j][key])
        assert fresh.epoch == (min(k + 5, 40) - 1) // 30


def test_one_pass_covers_each_pair_once(tokenizer, make_cfg):
    cfg = _pref_cfg(make_cfg)
    batches = list(make_preference_pass(cfg, tokenizer, batch_size=7, seq_len=L))
    index = np.concatenate([b["pair_index"] for b in batches])
    assert len(batches) == 18 and index[:120].tolist() == list(range(120)) and (index[120:] == -1).all()
    assert batches[-1]["chosen_segment_ids"][120 % 7 :].sum() == 0
    ev = list(make_preference_iterator(cfg, tokenizer, batch_size=B, seq_len=L, split="eval"))
    assert sum(int((b["pair_index"] >= 0).sum()) for b in ev) == 24
