"""Completion for evaluation and on-policy sampling through the rollout engine: each prompt's
greedy completion is what the static generator gives it alone, with ids and log-probs."""

import numpy as np
from flax import nnx

from ptrain.config import ModelConfig
from ptrain.data.tokenizer import build_tokenizer, stop_token_ids
from ptrain.models import Decoder
from ptrain.models.generate import generate
from ptrain.rollout.local import LocalEngine
from ptrain.stages.heldout import complete


def test_complete_matches_one_prompt_at_a_time_and_reports_how_each_ended():
    tok = build_tokenizer(vocab_size=300)
    cfg = ModelConfig(
        vocab_size=len(tok), d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=64
    )
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    prompts = [tok.encode(t) for t in ("What is 12 + 30?", "7 - 3", "99 + 1 = ?")]
    with LocalEngine(model, max_running_requests=2, context_length=32) as engine:  # 3 prompts on 2 rows
        outs = complete(engine, prompts, tok, max_new_tokens=6)
        twice = complete(engine, prompts[:1], tok, max_new_tokens=6, temperature=1.0, samples=2, seed=3)
    assert len(outs) == 3 and all(len(o) == 1 for o in outs)
    for p, (o,) in zip(prompts, outs):
        alone = generate(model, [p], max_new_tokens=6, stop_tokens=stop_token_ids(tok), pad_id=tok.pad_token_id or 0)
        n = int(alone.lengths_B[0])
        assert o.length == n and 1 <= n <= 6 and list(o.token_ids) == alone.tokens_BxN[0, :n].tolist()
        assert o.text == tok.decode(alone.tokens_BxN[0, :n].tolist(), skip_special_tokens=True)
        assert o.finished == (alone.finish_reasons[0] == "stop")
        np.testing.assert_allclose(o.logprobs, alone.logprobs_BxN[0, :n], atol=1e-4)
    assert len(twice[0]) == 2 and all(c.length >= 1 for c in twice[0])
