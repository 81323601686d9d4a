"""SFT pipeline: batch contract, packing invariants, epochs, exact resume, eval passes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptrain.config.data import GeneratedTaskConfig
from ptrain.data import (
    CONTRACT_KEYS,
    make_sft_iterator,
    pack_examples,
    sft_examples,
    shifted_examples,
    unpacked_batch,
    write_generated,
)

B, L = 4, 128


def _check_contract(batch, tokenizer):
    """Shapes, dtypes, and the invariants that make packed rows equal separate examples."""
    assert set(batch) == set(CONTRACT_KEYS)
    for k in CONTRACT_KEYS:
        assert batch[k].shape == (B, L), k
        assert batch[k].dtype == (np.float32 if k == "loss_mask" else np.int32), k
    seg, pos, inp, tgt, mask = (batch[k] for k in ("segment_ids", "positions", "input_ids", "target_ids", "loss_mask"))
    assert ((mask == 0) | (mask == 1)).all()
    assert (mask[seg == 0] == 0).all() and (inp[seg == 0] == 0).all()
    for r in range(B):
        ids = [s for s in np.unique(seg[r]) if s > 0]
        assert ids == list(range(1, len(ids) + 1))
        for s in ids:
            cols = np.flatnonzero(seg[r] == s)
            assert (np.diff(cols) == 1).all(), "a segment must be contiguous"
            np.testing.assert_array_equal(pos[r, cols], np.arange(len(cols)))
            # Targets are the next input token inside the segment; the segment's last target
            # is the example's own next token, never the first token of the next segment.
            np.testing.assert_array_equal(tgt[r, cols[:-1]], inp[r, cols[1:]])
            assert inp[r, cols[0]] == tokenizer.convert_tokens_to_ids("<|im_start|>")
            assert tgt[r, cols[-1]] in (
                tokenizer.convert_tokens_to_ids("<|im_end|>"),
                tokenizer.convert_tokens_to_ids("\u010a"),
            )  # the turn's final "\n"
        # padding only at the end of a row
        real = np.flatnonzero(seg[r] > 0)
        assert real.size == 0 or real[-1] == real.size - 1


@pytest.mark.parametrize("packing", [True, False])
def test_batch_contract_and_packing_invariants(packing, tokenizer, make_cfg):
    it = make_sft_iterator(make_cfg(packing=packing), tokenizer, batch_size=B, seq_len=L, seed=0)
    most = 0
    for _ in range(5):
        batch = next(it)
        _check_contract(batch, tokenizer)
        n_segments = batch["segment_ids"].max(axis=1)
        assert (n_segments >= 1).all()
        most = max(most, n_segments.max())
    assert most == 1 if not packing else most >= 2, "128 tokens hold two ~60-token examples"


def test_loss_mask_covers_only_assistant_targets(tokenizer, make_cfg):
    batch = next(make_sft_iterator(make_cfg(), tokenizer, batch_size=B, seq_len=L, seed=0))
    r = 0
    cols = np.flatnonzero((batch["segment_ids"][r] == 1) & (batch["loss_mask"][r] > 0))
    text = tokenizer.decode(batch["target_ids"][r, cols])
    assert text.endswith("<|im_end|>") and "Answer: " in text and "What is" not in text


def _collect(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in CONTRACT_KEYS:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("packing", [True, False])
def test_resume_is_exact_mid_epoch_and_across_epochs(packing, tokenizer, make_cfg):
    """Save the state after k batches, restore into a fresh iterator, get the same next batches.

    120 rows at 4 rows per batch (unpacked) is 30 batches per epoch; with packing about
    15. k runs over the first epoch, the boundary and into the third epoch.
    """
    cfg = make_cfg(packing=packing)
    ref_it = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=7)
    reference = _collect(ref_it, 70)
    per_epoch = 30 if not packing else None
    points = [0, 3, 29, 30, 31, 61] if not packing else [0, 5, 14, 15, 16, 33, 47]
    for k in points:
        it = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=7)
        _collect(it, k)
        state = it.get_state()
        fresh = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=7)
        fresh.set_state(state)
        _assert_same(_collect(fresh, 8), reference[k : k + 8])
        if per_epoch:
            assert fresh.epoch == (k + 7) // per_epoch


def test_epochs_reshuffle_and_cover_every_example_once(tokenizer, make_cfg):
    cfg = make_cfg(packing=False)
    it = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=1)
    epochs = []
    for _ in range(2):
        rows = []
        for _ in range(30):
            b = next(it)
            rows += [tuple(r[s > 0]) for r, s in zip(b["input_ids"], b["segment_ids"])]
        epochs.append(rows)
    assert it.epoch == 1
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == 120
    assert epochs[0] != epochs[1], "each epoch has its own order"


def test_num_epochs_ends_the_iterator(tokenizer, make_cfg):
    cfg = make_cfg(packing=False, num_epochs=2)
    assert len(list(make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L))) == 60


def test_seed_changes_order(tokenizer, make_cfg):
    a = next(make_sft_iterator(make_cfg(), tokenizer, batch_size=B, seq_len=L, seed=0))
    b = next(make_sft_iterator(make_cfg(), tokenizer, batch_size=B, seq_len=L, seed=1))
    assert not np.array_equal(a["input_ids"], b["input_ids"])


@pytest.mark.parametrize("packing", [True, False])
def test_eval_pass_is_finite_ordered_complete_and_padded(packing, tokenizer, make_cfg):
    cfg = make_cfg(packing=packing)
    batches = list(make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, split="eval"))
    assert batches == [] or all(b["input_ids"].shape == (B, L) for b in batches)
    for b in batches:
        _check_contract(b, tokenizer)
    examples, rep = sft_examples(cfg, tokenizer, seq_len=L, split="eval")
    got = sorted(
        tuple(r[s == k])
        for b in batches
        for r, s in zip(b["input_ids"], b["segment_ids"])
        for k in range(1, s.max() + 1)
    )
    want = sorted(tuple(examples[i]["tokens"][:-1]) for i in range(len(examples)))
    assert got == want and rep.total == 24
    again = list(make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, split="eval"))
    _assert_same(batches, again)


def test_shards_are_disjoint_and_cover_the_data(tokenizer, make_cfg):
    cfg = make_cfg(packing=False, shuffle=False, num_epochs=1)
    seen = []
    for shard in range(2):
        for b in make_sft_iterator(cfg, tokenizer, batch_size=2, seq_len=L, shard_index=shard, shard_count=2):
            seen += [tuple(r[s > 0]) for r, s in zip(b["input_ids"], b["segment_ids"])]
    assert len(seen) == 120 and len(set(seen)) == 120


def test_pack_examples_matches_unpacked(tokenizer, make_cfg):
    """The helper pair the model test uses: every example sits at its placement unchanged."""
    examples = shifted_examples(make_cfg(), tokenizer, seq_len=L, n=9)
    packed, placements = pack_examples(examples, L)
    unpacked = unpacked_batch(examples, L)
    assert packed["input_ids"].shape[0] < len(examples) and unpacked["input_ids"].shape == (9, L)
    for k, (row, seg, start) in enumerate(placements):
        n = len(examples[k]["input_ids"])
        cols = np.flatnonzero(packed["segment_ids"][row] == seg)
        np.testing.assert_array_equal(cols, np.arange(start, start + n))
        for key in CONTRACT_KEYS:
            want = unpacked[key][k, :n] if key != "segment_ids" else np.ones(n)
            np.testing.assert_array_equal(packed[key][row, cols] if key != "segment_ids" else np.ones(n), want)
        assert (unpacked["segment_ids"][k, n:] == 0).all()


def test_written_files_train_identically(tokenizer, make_cfg, tmp_path):
    cfg = make_cfg()
    on_disk = write_generated(cfg, str(tmp_path))
    assert on_disk.source == "jsonl" and on_disk.train_path.endswith("train.jsonl")
    a = _collect(make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=3), 3)
    b = _collect(make_sft_iterator(on_disk, tokenizer, batch_size=B, seq_len=L, seed=3), 3)
    _assert_same(a, b)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_table_sources_train_like_jsonl(kind, tokenizer, make_cfg, tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    on_disk = write_generated(make_cfg(), str(tmp_path))
    table = pa.Table.from_pylist([json.loads(line) for line in open(on_disk.train_path)])
    path = str(tmp_path / f"train.{kind}")
    if kind == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    table_cfg = make_cfg(source=kind, train_path=path)
    a = _collect(make_sft_iterator(on_disk, tokenizer, batch_size=B, seq_len=L, seed=3), 3)
    b = _collect(make_sft_iterator(table_cfg, tokenizer, batch_size=B, seq_len=L, seed=3), 3)
    _assert_same(a, b)


def test_grain_checkpoint_handler_round_trip(tokenizer, make_cfg, tmp_path):
    """The iterator saves and restores through Grain's Orbax handler (what checkpoints use)."""
    import grain
    from etils import epath

    cfg = make_cfg()
    it = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=2)
    _collect(it, 4)
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path), item=it)
    expected = _collect(it, 3)
    fresh = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=2)
    handler.restore(epath.Path(tmp_path), item=fresh)
    _assert_same(_collect(fresh, 3), expected)


@pytest.mark.slow
def test_worker_processes_are_deterministic_and_resume(tokenizer, make_cfg):
    """With Grain worker processes (each packs its own slice, so the order differs from the
    in-process pipeline) the batches are still a function of the seed, and resume exactly."""
    cfg = make_cfg(generated=GeneratedTaskConfig(n_train=60, n_eval=8), num_workers=2)
    a = _collect(make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=0), 6)
    it = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=0)
    b = _collect(it, 3)
    state = it.get_state()
    _assert_same(a[:3], b)
    fresh = make_sft_iterator(cfg, tokenizer, batch_size=B, seq_len=L, seed=0)
    fresh.set_state(state)
    _assert_same(a[3:], _collect(fresh, 3))


def test_resume_on_changed_data_is_refused(tokenizer, make_cfg, tmp_path):
    """A checkpointed iterator state restored onto other examples (a row appended or edited)
    would repeat and skip rows silently; it raises, naming both counts. The same data resume,
    and a state without the fingerprint (older checkpoints) still loads."""
    import json

    from ptrain.data import DataChangedError, clear_cache

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": f"Answer: {i + 1}"},
            ]
        }
        for i in range(12)
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(source="jsonl", train_path=str(path), packing=False)
    it = make_sft_iterator(cfg, tokenizer, batch_size=2, seq_len=32, seed=1)
    _collect(it, 3)
    state = it.get_state()
    assert state["ptrain_examples"]["count"] == 12
    json.dumps(state)  # it travels in the checkpoint's JSON item
    make_sft_iterator(cfg, tokenizer, batch_size=2, seq_len=32, seed=1).set_state(state)
    for change in ("append", "edit"):
        changed = rows + rows[:1] if change == "append" else [rows[1]] + rows[1:]
        path.write_text("".join(json.dumps(r) + "\n" for r in changed))
        clear_cache()
        fresh = make_sft_iterator(cfg, tokenizer, batch_size=2, seq_len=32, seed=1)
        with pytest.raises(DataChangedError, match="12 examples, fingerprint"):
            fresh.set_state(state)
        old = {k: v for k, v in state.items() if k != "ptrain_examples"}
        fresh.set_state(old)


def test_preference_format_in_an_sft_stage_is_refused(tokenizer, make_cfg):
    with pytest.raises(ValueError, match="DPO stages"):
        make_sft_iterator(make_cfg(format="preference"), tokenizer, batch_size=B, seq_len=L)


@pytest.mark.parametrize("packing", [True, False])
def test_truncated_examples_fill_a_row_exactly(packing, tokenizer, make_cfg, tmp_path):
    """An example cut at seq_len fills its row: seq_len inputs, and its last target is the
    real next token of the conversation (seq_len + 1 tokens were kept), not padding."""
    import json

    from ptrain.data.chat import tokenize_conversation

    seq = 32
    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": " ".join(map(str, range(40)))}]
    path = tmp_path / "long.jsonl"
    path.write_text((json.dumps({"messages": msgs}) + "\n") * 3)
    cfg = make_cfg(source="jsonl", train_path=str(path), packing=packing)
    batch = next(make_sft_iterator(cfg, tokenizer, batch_size=2, seq_len=seq))
    full, _ = tokenize_conversation(tokenizer, msgs)
    assert (batch["segment_ids"] == 1).all()
    np.testing.assert_array_equal(batch["positions"][0], np.arange(seq))
    np.testing.assert_array_equal(batch["input_ids"][0], full[:seq])
    np.testing.assert_array_equal(batch["target_ids"][0], full[1 : seq + 1])


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(2, 17), min_size=1, max_size=30), packing=st.booleans(), batch=st.integers(1, 4))
def test_any_lengths_pack_into_whole_examples(lengths, packing, batch):
    """Examples of 2..17 tokens (16 = seq_len + 1 fills a row) come out whole, each once, in one
    eval pass, with targets that never leave their segment."""
    from ptrain.config.data import DataConfig
    from ptrain.data.chat import TokenizedRows
    from ptrain.data.sft import sft_batches

    seq = 16
    rng = np.random.default_rng(len(lengths))
    examples = [(rng.integers(1, 400, n).astype(np.int32), (rng.random(n) < 0.7).astype(np.int8)) for n in lengths]
    rows = TokenizedRows([(t, m) for t, m in examples], list(range(len(examples))))
    cfg = DataConfig(packing=packing)
    ds, _ = sft_batches(rows, cfg, batch_size=batch, seq_len=seq, seed=0, train=False)
    seen = []
    for b in ds:
        seg, inp, tgt, pos, mask = (b[k] for k in ("segment_ids", "input_ids", "target_ids", "positions", "loss_mask"))
        assert seg.shape == (batch, seq)
        for r in range(batch):
            for s in range(1, seg[r].max() + 1):
                cols = np.flatnonzero(seg[r] == s)
                np.testing.assert_array_equal(pos[r, cols], np.arange(len(cols)))
                seen.append((tuple(inp[r, cols]) + (int(tgt[r, cols[-1]]),), tuple(mask[r, cols])))
    want = [(tuple(t.tolist()), tuple(m[1:].astype(np.float32).tolist())) for t, m in examples if len(t) <= seq + 1]
    assert sorted(seen) == sorted(want)
