"""Packing is invisible to the loss: packed rows give each example the per-token losses it
gets alone, because attention and RoPE positions restart in every segment."""

import jax
import numpy as np
from flax import nnx

from ptrain.config import DataConfig
from ptrain.config.data import GeneratedTaskConfig
from ptrain.data.sft import pack_examples, shifted_examples, unpacked_batch
from ptrain.data.tokenizer import build_tokenizer
from ptrain.losses.sft import sft_token_losses
from ptrain.models import Decoder
from tests.train.helpers import tiny_model_config


def test_packed_and_unpacked_batches_give_the_same_per_token_losses(tmp_path):
    tok = build_tokenizer(str(tmp_path / "tok"))
    cfg = DataConfig(generated=GeneratedTaskConfig(n_train=40, n_eval=4))
    seq_len = 192
    examples = shifted_examples(cfg, tok, seq_len=seq_len, n=9)
    packed, placements = pack_examples(examples, seq_len)
    single = unpacked_batch(examples, seq_len)
    assert packed["input_ids"].shape[0] < len(examples)  # several examples really share rows

    model = Decoder(tiny_model_config(vocab_size=len(tok), max_seq_len=256), rngs=nnx.Rngs(1))

    @jax.jit
    def per_token(batch):
        logits = model(batch["input_ids"], batch["positions"], batch["segment_ids"])
        return sft_token_losses(logits, batch["target_ids"])

    lp, lu = np.asarray(per_token(packed)), np.asarray(per_token(single))
    for k, ex in enumerate(examples):
        n = len(ex["input_ids"])
        r, _, col = placements[k]
        mask = ex["loss_mask"] > 0
        np.testing.assert_allclose(lp[r, col : col + n][mask], lu[k, :n][mask], rtol=2e-5, atol=2e-5)
