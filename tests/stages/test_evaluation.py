"""Batched completion for evaluation and on-policy sampling: padding to one program keeps
each prompt's greedy completion what it is alone."""

from flax import nnx

from ptrain.config import ModelConfig
from ptrain.data.tokenizer import build_tokenizer, stop_token_ids
from ptrain.models import Decoder
from ptrain.models.generate import generate
from ptrain.stages.evaluation import complete


def test_complete_matches_one_prompt_at_a_time_and_reports_how_each_ended():
    tok = build_tokenizer(vocab_size=300)
    cfg = ModelConfig(
        vocab_size=len(tok), d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=64
    )
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    prompts = [tok.encode(t) for t in ("What is 12 + 30?", "7 - 3", "99 + 1 = ?")]
    outs = complete(model, prompts, tok, max_new_tokens=6, batch_size=2)  # 2 calls, the second padded
    assert len(outs) == 3
    for p, o in zip(prompts, outs):
        alone = generate(
            model,
            [p],
            max_new_tokens=6,
            stop_tokens=stop_token_ids(tok),
            pad_id=tok.pad_token_id or 0,
            prompt_bucket=16,
        )
        n = int(alone.lengths_B[0])
        assert o.length == n and 1 <= n <= 6
        assert o.text == tok.decode(alone.tokens_BxN[0, :n].tolist(), skip_special_tokens=True)
        assert o.finished == (alone.finish_reasons[0] == "stop")
