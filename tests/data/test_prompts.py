"""Prompts: held-out prompts with their answers in fixed-shape batches, and the RL prompt iterator."""

import numpy as np

from ptrain.data import batch_prompts, make_eval_prompts, make_prompt_iterator
from ptrain.data.tasks import check_answer


def test_eval_prompts_carry_answers_and_batch(tokenizer, make_cfg):
    cfg = make_cfg()
    prompts = make_eval_prompts(cfg, tokenizer)
    assert len(prompts) == 24
    p = prompts[0]
    assert tokenizer.decode(p.prompt_ids).endswith("<|im_start|>assistant\n")
    assert check_answer(p.task, p.reference) and p.task["kind"] == "arithmetic"
    batches = list(batch_prompts(prompts, 5, tokenizer.pad_token_id, pad_to=32))
    assert len(batches) == 5 and all(b["prompt_ids"].shape == (5, 32) for b in batches)
    last = batches[-1]
    assert last["valid"].tolist() == [True, True, True, True, False] and len(last["prompts"]) == 4
    row = batches[0]["prompt_ids"][0]
    n = batches[0]["prompt_lens"][0]
    np.testing.assert_array_equal(row[32 - n :], prompts[0].prompt_ids)
    assert (row[: 32 - n] == tokenizer.pad_token_id).all()


def test_prompt_iterator_for_rl_shuffles_covers_and_resumes(tokenizer, make_cfg):
    cfg = make_cfg()
    it = make_prompt_iterator(cfg, tokenizer, batch_size=8, seed=5)
    epoch = [p for _ in range(15) for p in next(it)]  # 120 prompts / 8
    assert sorted(p.row for p in epoch) == list(range(120))
    assert [p.row for p in epoch] != list(range(120))
    assert all(p.task and p.task["answer"] for p in epoch)
    state = it.get_state()
    want = [p.row for p in next(it)]
    fresh = make_prompt_iterator(cfg, tokenizer, batch_size=8, seed=5)
    fresh.set_state(state)
    assert [p.row for p in next(fresh)] == want
