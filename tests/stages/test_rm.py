"""The reward-model stage (kind rm): the Bradley-Terry loss against hand-derived values, the
scored token against transformers' pooling rule, the objective's masking, the export as a
*ForSequenceClassification folder that transformers loads with our scores, the config
keys, and a tiny stage run end to end through ptrain.api on generated preference pairs.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ptrain
from ptrain.api import run_stage
from ptrain.config import ConfigError, DataConfig, GeneratedTaskConfig, ModelConfig, RunConfig, StageConfig
from ptrain.config.algo import RMAlgoConfig
from ptrain.config.run import stage_config
from ptrain.data.preference import make_preference_pass, preference_examples
from ptrain.data.tokenizer import build_tokenizer
from ptrain.models import Decoder, RewardModel, last_token_index, load_hf, load_hf_reward_model, save_hf
from ptrain.models.hf import reward_config_to_hf
from ptrain.pipeline import initial_weights
from ptrain.train.objectives import bradley_terry_loss, dpo_denominator, full_sequences, make_rm_objective
from ptrain.train.state import init_train_state, split_model


def softplus(x):
    return np.logaddexp(0.0, x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def tiny_decoder(family="llama", vocab_size=64, tie=False, seed=0):
    cfg = ModelConfig(
        family=family,
        vocab_size=vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=48,
        max_seq_len=256,
        qk_norm=family == "qwen3",
        tie_embeddings=tie,
    )
    return Decoder(cfg, rngs=nnx.Rngs(seed))


# ----------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("margin, coef", [(0.0, 0.0), (0.5, 0.0), (0.25, 0.01)])
def test_bradley_terry_loss_matches_a_numpy_reference(margin, coef):
    rng = np.random.default_rng(0)
    r_c = rng.normal(size=7).astype(np.float32) * 3
    r_r = rng.normal(size=7).astype(np.float32) * 3
    r_r[0] = r_c[0]  # a tie: loss log(1 + e^margin) + coef (2 r)^2, counted as wrong
    loss, aux = bradley_terry_loss(r_c, r_r, margin=margin, center_rewards_coef=coef)
    d = r_c.astype(np.float64) - r_r
    expected = softplus(-(d - margin)) + coef * (r_c.astype(np.float64) + r_r) ** 2
    np.testing.assert_allclose(loss, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux.margin, d, rtol=1e-6)
    np.testing.assert_array_equal(aux.accuracy, (d > 0).astype(np.float32))
    tie = np.log1p(np.exp(margin)) + coef * (2.0 * float(r_c[0])) ** 2
    assert aux.accuracy[0] == 0.0 and float(loss[0]) == pytest.approx(tie, rel=1e-6)

    # d/dr_c = -sigmoid(-(d - m)) + 2c(r_c + r_r);  d/dr_r = sigmoid(-(d - m)) + 2c(r_c + r_r)
    def total(a, b):
        return jnp.sum(bradley_terry_loss(a, b, margin=margin, center_rewards_coef=coef)[0])

    g_c, g_r = jax.grad(total, argnums=(0, 1))(jnp.asarray(r_c), jnp.asarray(r_r))
    center = 2 * coef * (r_c.astype(np.float64) + r_r)
    np.testing.assert_allclose(g_c, -sigmoid(-(d - margin)) + center, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_r, sigmoid(-(d - margin)) + center, rtol=1e-5, atol=1e-6)
    jitted = jax.jit(lambda a, b: bradley_terry_loss(a, b, margin=margin, center_rewards_coef=coef)[0])
    np.testing.assert_allclose(jitted(r_c, r_r), loss, rtol=1e-6)


def test_bradley_terry_loss_refuses_scores_that_are_not_vectors():
    with pytest.raises(ValueError, match=r"must both be \[B\]"):
        bradley_terry_loss(jnp.zeros((2, 1)), jnp.zeros((2, 1)))


# ----------------------------------------------------------------------------- the scored token


def hf_last_non_pad(ids_BxL: np.ndarray, pad: int) -> np.ndarray:
    """transformers' GenericForSequenceClassification: the rightmost token != pad_token_id."""
    return (np.arange(ids_BxL.shape[1]) * (ids_BxL != pad)).argmax(-1)


def test_the_scored_token_follows_the_transformers_rule():
    pad = 3
    # Our batches pad with id 0 and segment 0; transformers sees the same rows padded with pad.
    ours = np.array(
        [
            [5, 6, 7, 8, 0, 0, 0],  # right padding
            [5, 6, 7, 8, 9, 10, 11],  # no padding
            [5, 6, 7, 3, 3, 0, 0],  # ends in real pad-id tokens: transformers skips them too
            [0, 0, 0, 0, 0, 0, 0],  # an empty row (an eval batch's filler): index 0 there too
        ],
        np.int32,
    )
    seg = np.array([[1] * 4 + [0] * 3, [1] * 7, [1] * 5 + [0] * 2, [0] * 7], np.int32)
    theirs = np.where(seg > 0, ours, pad)
    got = np.asarray(last_token_index(jnp.asarray(ours), jnp.asarray(seg), pad))
    np.testing.assert_array_equal(got, hf_last_non_pad(theirs, pad))
    np.testing.assert_array_equal(got, [3, 6, 2, 0])
    # Without a pad id: the last real token.
    np.testing.assert_array_equal(last_token_index(jnp.asarray(ours), jnp.asarray(seg)), [3, 6, 4, 0])
    # Left padding (transformers handles both sides): the rightmost real token.
    left = np.array([[3, 3, 5, 6]], np.int32)
    np.testing.assert_array_equal(last_token_index(jnp.asarray(left), None, pad), hf_last_non_pad(left, pad))


def test_a_score_does_not_depend_on_the_padding_after_it():
    """Masking equals slicing: a row scored alone equals the same row right-padded with junk ids."""
    rm = RewardModel(tiny_decoder(), rngs=nnx.Rngs(1), pad_token_id=3)
    row = np.array([[5, 6, 7, 8, 9]], np.int32)
    alone = rm(jnp.asarray(row))
    padded = np.array([[5, 6, 7, 8, 9, 42, 17, 0]], np.int32)
    seg = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], np.int32)
    np.testing.assert_allclose(rm(jnp.asarray(padded), segment_ids=jnp.asarray(seg)), alone, rtol=1e-5, atol=1e-6)
    assert alone.shape == (1,) and alone.dtype == jnp.float32
    assert "lm_head" not in nnx.to_pure_dict(nnx.state(rm, nnx.Param))["model"]  # never read, so dropped


# ------------------------------------------------------------------------------- the objective


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    tok = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    cfg = DataConfig(format="preference", generated=GeneratedTaskConfig(n_train=6, n_eval=2))
    batch = next(iter(make_preference_pass(cfg, tok, batch_size=8, seq_len=128)))  # 6 pairs + 2 filler rows
    examples, _ = preference_examples(cfg, tok, seq_len=128)
    return tok, batch, examples


def test_full_sequences_are_the_tokenised_sides(pairs):
    """The reward model reads each side whole, its last token included (the one transformers scores)."""
    _, batch, examples = pairs
    seqs = full_sequences(batch)
    b = batch["chosen_input_ids"].shape[0]
    for i in range(6):
        for k, side in enumerate(("chosen", "rejected")):
            tokens = examples[int(batch["pair_index"][i])][side]["tokens"]
            n = len(tokens)
            np.testing.assert_array_equal(seqs["input_ids"][k * b + i, :n], tokens)
            assert (seqs["segment_ids"][k * b + i, :n] == 1).all() and (seqs["segment_ids"][k * b + i, n:] == 0).all()


def test_the_objective_averages_real_pairs_only(pairs):
    """Filler rows (pair_index -1) change nothing: the objective over the padded batch equals
    the one over its real pairs, and equals the reference loss of the scores."""
    tok, batch, _ = pairs
    rm = RewardModel(tiny_decoder(family="qwen3", vocab_size=len(tok), tie=True), rngs=nnx.Rngs(1), pad_token_id=3)
    model_def, params, rest = split_model(rm)
    state = init_train_state(params, optax.sgd(0.1), seed=0, model_state=rest)
    cfg = RMAlgoConfig(margin=0.5, center_rewards_coef=0.01)
    objective = jax.jit(make_rm_objective(model_def, cfg))
    real = {k: v[:6] for k, v in batch.items()}
    loss, m = objective(params, state, batch, dpo_denominator(batch))
    loss_real, m_real = objective(params, state, real, dpo_denominator(real))
    assert float(dpo_denominator(batch)) == 6
    assert float(loss) == pytest.approx(float(loss_real), rel=1e-5)
    for key in ("accuracy", "margin", "reward_mean", "reward_sq"):
        assert float(m[key]) == pytest.approx(float(m_real[key]), rel=1e-5, abs=1e-6)
    seqs = full_sequences(real)
    scores = np.asarray(rm(seqs["input_ids"], segment_ids=seqs["segment_ids"]), np.float64)
    r_c, r_r = scores[:6], scores[6:]
    expected = np.mean(softplus(-(r_c - r_r - 0.5)) + 0.01 * (r_c + r_r) ** 2)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(m["margin"]) == pytest.approx(np.mean(r_c - r_r), rel=1e-4, abs=1e-6)


# ----------------------------------------------------------------------------------- the export


def test_the_export_loads_in_transformers_with_our_scores(tmp_path):
    """An untied Llama: the folder holds model.* and score.weight but no lm_head; transformers'
    LlamaForSequenceClassification loads it with nothing missing or unexpected, and its
    logits on a right-padded batch are our scores; load_hf_reward_model reads it back."""
    import torch
    import transformers
    from safetensors import safe_open

    rm = RewardModel(tiny_decoder(family="llama"), rngs=nnx.Rngs(1), pad_token_id=3)
    path = str(tmp_path / "rm")
    save_hf(rm, path)  # a RewardModel is written as what it is

    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    assert cfg["num_labels"] == 1 and cfg["pad_token_id"] == 3
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("score.weight").shape == (1, 32)
    assert "score.weight" in names and "lm_head.weight" not in names
    assert all(n.startswith("model.") for n in names - {"score.weight"})

    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    lengths = [5, 8, 3]
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 64, (3, 8)).astype(np.int32)
    seg = (np.arange(8)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    ours = np.asarray(rm(jnp.asarray(ids), segment_ids=jnp.asarray(seg)))
    hf_ids = np.where(seg > 0, ids, 3)
    with torch.no_grad():
        logits = hf(torch.tensor(hf_ids, dtype=torch.long), attention_mask=torch.tensor(seg)).logits.numpy()
    assert logits.shape == (3, 1)
    np.testing.assert_allclose(logits[:, 0], ours, atol=1e-4)

    back = load_hf_reward_model(path)
    assert back.pad_token_id == 3
    np.testing.assert_allclose(back(jnp.asarray(ids), segment_ids=jnp.asarray(seg)), ours, atol=1e-6)
    with pytest.raises(ValueError, match="holds a reward model"):
        load_hf(path)


def test_a_dots1_reward_model_round_trips_through_ptrain(tmp_path, caplog):
    """transformers has no Dots1ForSequenceClassification; the folder is written anyway, with a
    warning that says so, and load_hf_reward_model reads it back with the same scores."""
    from ptrain.models import load_hf_reward_model, save_hf_reward_model

    cfg = ModelConfig(family="dots1", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=48, d_ff_expert=16, n_experts=4, top_k=2, n_shared_experts=1, max_seq_len=64,
                      router="sigmoid", qk_norm=True)  # fmt: skip
    rm = RewardModel(Decoder(cfg, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1), pad_token_id=3)
    assert reward_config_to_hf(cfg, pad_token_id=3)["architectures"] == ["Dots1ForSequenceClassification"]
    path = str(tmp_path / "rm")
    with caplog.at_level("WARNING", logger="ptrain.models.hf"):
        save_hf_reward_model(rm, path)
    assert "transformers has no Dots1ForSequenceClassification" in caplog.text
    ids = np.array([[5, 6, 7, 8, 3, 3], [9, 10, 11, 12, 13, 14]], np.int32)
    back = load_hf_reward_model(path)
    np.testing.assert_allclose(np.asarray(back(jnp.asarray(ids))), np.asarray(rm(jnp.asarray(ids))), atol=1e-5)


# ----------------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.rm.margin=-1", "algo.rm.margin"),
        ("algo.rm.margin=inf", "algo.rm.margin"),
        ("algo.rm.center_rewards_coef=-0.01", "algo.rm.center_rewards_coef"),
        ("algo.rm.center_rewards_coef=nan", "algo.rm.center_rewards_coef"),
    ],
)
def test_bad_rm_options_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        ptrain.compose(None, [override])


def test_an_rm_stage_reads_preference_data_and_is_looked_through_by_the_next_stage(tmp_path):
    run = RunConfig(run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"a rm stage reads data.format=preference"):
        stage_config(run, StageConfig(name="rm", kind="rm"))
    run.stages = [
        StageConfig(name="sft", kind="sft"),
        StageConfig(name="rm", kind="rm", data={"format": "preference"}),
        StageConfig(name="dpo", kind="dpo", data={"format": "preference"}),
    ]
    sft_export = os.path.join(str(tmp_path), "stages", "sft", "export")
    # The rm stage starts from the SFT policy; the stage after it too, not from the reward model.
    assert initial_weights(run, 1) == sft_export
    assert initial_weights(run, 2) == sft_export


# ---------------------------------------------------------------------------------- end to end

STEPS = 20
TINY_RM = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.d_ff=48",
    "model.max_seq_len=256",
    "data.format=preference",
    "data.generated.n_train=16",
    "data.generated.n_eval=8",
    "data.tokenizer_vocab_size=300",
    f"train.steps={STEPS}",
    "train.global_batch_size=8",
    "train.seq_len=128",
    f"train.eval_every={STEPS}",
    "train.eval_batches=1",
    "train.eval_generate=0",
    "optim.lr=3e-3",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "checkpoint.async_save=false",
    "logging.console=false",
    "logging.tensorboard=false",
]


def test_a_tiny_rm_stage_learns_its_pairs_and_exports_a_classifier_transformers_scores_alike(tmp_path):
    """ptrain.run_stage('rm') on 16 generated arithmetic pairs (chosen: the worked solution;
    rejected: the same with one slip), 20 steps of batch 8: the training loss falls from
    about log 2 and the training accuracy ends above chance. The export loads in transformers;
    on the held-out pairs, tokenised by the exported tokenizer's chat template, its logits
    equal the scores of load_hf_reward_model, and give the final held-out metrics the stage
    logged from its own trained state."""
    import torch
    import transformers

    result = run_stage("rm", None, TINY_RM, run_dir=str(tmp_path / "run"))
    assert result.done and result.kind == "rm"
    rows = [json.loads(line) for line in open(result.metrics_path)]
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == STEPS
    for key in ("accuracy", "margin", "reward_mean", "reward_std", "rewards_chosen", "rewards_rejected"):
        assert all(np.isfinite(r[f"train/{key}"]) for r in train), key
    first = np.mean([r["train/loss"] for r in train[:3]])
    last = np.mean([r["train/loss"] for r in train[-3:]])
    assert abs(train[0]["train/loss"] - np.log(2)) < 0.1  # the small initial head scores both sides alike
    assert last < 0.75 * first, (first, last)
    assert np.mean([r["train/accuracy"] for r in train[-5:]]) > 0.6
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, STEPS] and evals[-1]["eval/pairs"] == 8

    export = result.export
    cfg = json.load(open(os.path.join(export, "config.json")))
    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"] and cfg["num_labels"] == 1
    assert cfg["pad_token_id"] == tok.pad_token_id is not None
    assert cfg["ptrain_trained_tokens"] == 128 + 1  # train.seq_len next-token inputs, read whole

    held = [json.loads(line) for line in open(tmp_path / "run" / "data" / "preference_eval.jsonl")]
    convs = [row["prompt"] + row[side] for side in ("chosen", "rejected") for row in held]
    enc = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]
    width = max(map(len, enc))
    ids = np.full((len(enc), width), tok.pad_token_id, np.int32)
    mask = np.zeros((len(enc), width), np.int32)
    for i, e in enumerate(enc):
        ids[i, : len(e)], mask[i, : len(e)] = e, 1

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()[:, 0]
    ours = np.asarray(load_hf_reward_model(export)(jnp.asarray(ids), segment_ids=jnp.asarray(mask)))
    np.testing.assert_allclose(logits, ours, atol=1e-4)

    n = len(held)
    margin = logits[:n].astype(np.float64) - logits[n:]
    final = evals[-1]
    assert final["eval/margin"] == pytest.approx(np.mean(margin), abs=1e-4)
    assert final["eval/accuracy"] == pytest.approx(np.mean(margin > 0))
    assert final["eval/reward_mean"] == pytest.approx(np.mean(logits), abs=1e-4)
