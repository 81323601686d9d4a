"""ptrain.TrainingClient: primitives over the stages' pure code.

The two loops at the end are the contract: a hand-written SFT loop and a hand-written
importance-sampling RL loop over the client reach, step for step, the losses the SFT and
GRPO stages log on the same batches.
"""

import copy
import json
import os

import numpy as np
import pytest

import ptrain
from ptrain.config.model import ModelConfig

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48, max_seq_len=64)


@pytest.fixture(scope="module")
def client():
    with ptrain.TrainingClient(CFG, seed=0) as c:
        yield c


def sequences(seed=0, lengths=(10, 7, 12)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]


def ce_data(seqs):
    return [ptrain.Datum(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1)}) for s in seqs]


def rl_data(seqs, logprobs, adv=0.5):
    return [
        ptrain.Datum(s[:-1], {"target_tokens": s[1:], "logprobs": lp, "advantages": np.full(len(s) - 1, adv)})
        for s, lp in zip(seqs, logprobs)
    ]


def test_forward_gives_target_logprobs_and_the_summed_losses(client):
    seqs = sequences()
    out = client.forward(ce_data(seqs), "cross_entropy")
    assert [lp.shape for lp in out.logprobs] == [(9,), (6,), (11,)]
    assert all(np.all(lp < 0) for lp in out.logprobs)
    assert out.loss == pytest.approx(-sum(lp.sum() for lp in out.logprobs), rel=1e-5)
    # On-policy (q = the policy's own log-probs): r = 1, so IS, PPO and GSPO are -sum A, CISPO and
    # DRO are -sum A logp.
    data = rl_data(seqs, out.logprobs)
    tokens = sum(len(s) - 1 for s in seqs)
    for name in ("importance_sampling", "ppo", "gspo"):
        assert client.forward(data, name).loss == pytest.approx(-0.5 * tokens, rel=1e-5), name
    assert client.forward(data, "cispo").loss == pytest.approx(0.5 * out.loss, rel=1e-5)
    assert client.forward(data, "dro", {"beta": 0.3}).loss == pytest.approx(0.5 * out.loss, rel=1e-5)
    # A sampler 0.5 nats less sure of every token: r = e^0.5 > 1.2 clips PPO's gain at 1.2.
    shifted = rl_data(seqs, [lp - 0.5 for lp in out.logprobs])
    assert client.forward(shifted, "importance_sampling").loss == pytest.approx(-0.5 * tokens * np.exp(0.5), rel=1e-5)
    assert client.forward(shifted, "ppo").loss == pytest.approx(-0.5 * tokens * 1.2, rel=1e-5)
    assert client.forward(shifted, "ppo", {"clip_high_threshold": 2.0}).loss == pytest.approx(
        -0.5 * tokens * np.exp(0.5), rel=1e-5
    )


def test_gradients_accumulate_until_the_optimizer_step():
    seqs = sequences(1, (9, 11, 6, 8))
    one = ptrain.TrainingClient(CFG, seed=3)
    two = ptrain.TrainingClient(CFG, seed=3)
    adam = ptrain.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=5.0)
    full = one.forward_backward(ce_data(seqs), "cross_entropy")
    one.optim_step(adam)
    a = two.forward_backward(ce_data(seqs[:2]), "cross_entropy")
    b = two.forward_backward(ce_data(seqs[2:]), "cross_entropy")
    two.optim_step(adam)
    assert a.loss + b.loss == pytest.approx(full.loss, rel=1e-5)
    for x, y in zip(jax_leaves(one.params), jax_leaves(two.params)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    after = one.forward(ce_data(seqs), "cross_entropy").loss
    assert after < full.loss
    assert one.step == two.step == 1


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_callable_loss_gets_the_same_gradient_as_the_named_one():
    seqs = sequences(2)
    named = ptrain.TrainingClient(CFG, seed=1)
    custom = ptrain.TrainingClient(CFG, seed=1)
    named.forward_backward(ce_data(seqs), "cross_entropy")
    out = custom.forward_backward(ce_data(seqs), lambda data, logprobs: (-sum(lp.sum() for lp in logprobs), {}))
    assert len(out.logprobs) == 3 and out.metrics["loss:sum"] == pytest.approx(out.loss)
    for c in (named, custom):
        c.optim_step({"learning_rate": 1e-2})
    for x, y in zip(jax_leaves(named.params), jax_leaves(custom.params)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_state_saves_and_resumes_exactly_and_weights_load_anywhere(tmp_path):
    seqs = sequences(4)
    a = ptrain.TrainingClient(CFG, seed=2)
    for _ in range(2):
        a.forward_backward(ce_data(seqs), "cross_entropy")
        a.optim_step({"learning_rate": 1e-2})
    a.forward_backward(ce_data(seqs), "cross_entropy")
    with pytest.raises(RuntimeError, match="call optim_step first"):
        a.save_state(tmp_path / "state")
    a.optim_step({"learning_rate": 1e-2})
    a.save_state(tmp_path / "state")
    with pytest.raises(FileExistsError, match="nothing was overwritten"):
        a.save_state(tmp_path / "state")
    b = ptrain.TrainingClient(CFG, seed=9)
    b.load_state(tmp_path / "state")
    assert b.step == 3
    for c in (a, b):
        c.forward_backward(ce_data(seqs), "cross_entropy")
        c.optim_step({"learning_rate": 1e-2})
    for x, y in zip(jax_leaves((a.params, a.opt_state)), jax_leaves((b.params, b.opt_state))):
        np.testing.assert_array_equal(x, y)

    a.save_weights(tmp_path / "hf")
    from_folder = ptrain.TrainingClient(str(tmp_path / "hf"))
    np.testing.assert_allclose(from_folder.forward(ce_data(seqs)).loss, a.forward(ce_data(seqs)).loss, rtol=1e-6)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        b.load_state(tmp_path / "missing")
    other = ptrain.TrainingClient(ModelConfig(**{**CFG.__dict__, "d_ff": 64}))
    with pytest.raises(ValueError, match="does not hold this model's state"):
        other.load_state(tmp_path / "state")


def test_samples_come_from_the_current_weights_with_the_trainers_logprobs():
    c = ptrain.TrainingClient(CFG, seed=5)
    prompt = [3, 4, 5, 6]
    (samples,) = c.sample([prompt], n=2, sampling_params={"max_new_tokens": 6, "sampling_seed": 1})
    assert len(samples) == 2 and all(len(s.output_ids) == 6 for s in samples)
    for s in samples:
        full = prompt + list(s.output_ids)
        out = c.forward([ptrain.Datum(full[:-1], {"target_tokens": full[1:], "weights": np.ones(len(full) - 1)})])
        np.testing.assert_allclose(out.logprobs[0][len(prompt) - 1 :], s.logprobs, atol=2e-5)
    c.forward_backward(ce_data([prompt + list(samples[0].output_ids)]), "cross_entropy")
    c.optim_step({"learning_rate": 0.5})
    (after,) = c.sample([prompt], n=2, sampling_params={"max_new_tokens": 6, "sampling_seed": 1})
    assert after[0].weight_version == "1"
    assert [s.logprobs for s in after] != [s.logprobs for s in samples]
    c.close()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda c, d: c.forward(d, "nope"), ValueError, "unknown loss_fn 'nope'"),
        (lambda c, d: c.forward(d, "ppo"), ValueError, r"needs loss_fn_inputs \['target_tokens', 'logprobs', 'adv"),
        (lambda c, d: c.forward(d, "dro"), ValueError, r"'dro' needs loss_fn_config=\{'beta': ...\}"),
        (lambda c, d: c.forward(d, "cross_entropy", {"beta": 1}), ValueError, r"\['beta'\] are not options"),
        (lambda c, d: c.forward([], "cross_entropy"), ValueError, "non-empty list of Datum"),
        (lambda c, d: c.forward(d[0], "cross_entropy"), ValueError, "non-empty list of Datum"),
        (lambda c, d: c.forward([("x", 1)]), TypeError, "pass ptrain.Datum"),
        (
            lambda c, d: c.forward([ptrain.Datum([1, 2], {"target_tokens": [1], "weights": [1.0]})]),
            ValueError,
            r"datum 0: loss_fn_inputs\['target_tokens'\] has shape \(1,\), expected \(2,\)",
        ),
        (
            lambda c, d: c.forward([ptrain.Datum([1, 99], {"target_tokens": [1, 2], "weights": [1.0, 1]})]),
            ValueError,
            r"outside the model's vocabulary \[0, 64\)",
        ),
        (
            lambda c, d: c.forward([ptrain.Datum(list(range(60)) * 2, {})]),
            ValueError,
            "needs loss_fn_inputs",
        ),
        (
            lambda c, d: c.forward([ptrain.Datum([1] * 70, {"target_tokens": [1] * 70, "weights": [1.0] * 70})]),
            ValueError,
            "70 tokens, more than the model's context of 64",
        ),
        (
            lambda c, d: c.forward([ptrain.Datum([1, 2], {"target_tokens": [1, 2], "weights": [1.0, np.nan]})]),
            ValueError,
            "NaN or infinite",
        ),
        (
            lambda c, d: c.forward([ptrain.Datum([1, 2], {"target_tokens": [1, 2], "weights": [1, 1], "x": [0, 0]})]),
            ValueError,
            r"\['x'\] are not inputs of 'cross_entropy'",
        ),
        (lambda c, d: c.optim_step({"lr": 1}), ValueError, r"\['lr'\] are unknown"),
        (lambda c, d: c.optim_step({"learning_rate": -1}), ValueError, "learning_rate must be >= 0"),
        (lambda c, d: c.sample([[]]), ValueError, "prompt 0 is empty"),
        (lambda c, d: c.sample([[1]], n=0), ValueError, "n must be an integer >= 1"),
        (lambda c, d: c.sample([[1]], sampling_params={"temprature": 1}), ValueError, "unknown key"),
    ],
)
def test_bad_input_is_refused_naming_the_problem_and_changes_nothing(client, call, error, message):
    import jax

    before = [np.asarray(x).copy() for x in jax.tree.leaves(client.params)]
    with pytest.raises(error, match=message):
        call(client, ce_data(sequences()))
    assert client._pending == 0 and client._grads is None
    for x, y in zip(before, jax.tree.leaves(client.params)):
        np.testing.assert_array_equal(x, np.asarray(y))


def test_a_missing_model_folder_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no config.json; pass a local Hugging Face model folder"):
        ptrain.TrainingClient(str(tmp_path))
    with pytest.raises(ValueError, match="set vocab_size"):
        ptrain.TrainingClient(ModelConfig(vocab_size=0))


# ------------------------------------------------------------------ the stages' losses

TINY_MODEL = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
    "model.d_ff=48", "model.max_seq_len=128", "data.tokenizer_vocab_size=300",
    "checkpoint.async_save=false", "logging.console=false", "logging.tensorboard=false",
    "optim.schedule=constant", "optim.weight_decay=0.01",
]  # fmt: skip


def stage_losses(stage_dir: str) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(stage_dir, "metrics.jsonl"))]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def adam_of(cfg) -> ptrain.AdamParams:
    o = cfg.optim
    return ptrain.AdamParams(o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.grad_clip)


def test_a_hand_written_sft_loop_reaches_the_sft_stages_losses(tmp_path):
    from ptrain.data import make_sft_iterator, write_generated
    from ptrain.stages.setup import tokenizer_for

    cfg = ptrain.compose(None, [*TINY_MODEL, "train.steps=3", "train.global_batch_size=4", "train.seq_len=64",
                                "train.eval_every=0", "train.eval_batches=0", "train.eval_generate=0",
                                "data.generated.n_train=64", "data.generated.n_eval=8", f"run_dir={tmp_path}"])  # fmt: skip
    result = ptrain.sft(cfg)
    expected = stage_losses(os.path.dirname(result.metrics_path))

    t = cfg.train
    tokenizer = tokenizer_for(cfg, None)
    data_cfg = write_generated(cfg.data, os.path.join(cfg.run_dir, "data"))
    batches = make_sft_iterator(data_cfg, tokenizer, batch_size=t.global_batch_size, seq_len=t.seq_len,
                                seed=data_cfg.shuffle_seed)  # fmt: skip
    client = ptrain.TrainingClient(os.path.join(cfg.run_dir, "base_model"))
    got = []
    for _ in range(t.steps):
        batch = next(batches)
        tokens = batch["loss_mask"].sum()
        data = []  # one datum per packed segment: attention never crosses them, positions restart
        for row in range(batch["input_ids"].shape[0]):
            seg = batch["segment_ids"][row]
            for s in np.unique(seg[seg > 0]):
                at = seg == s
                data.append(ptrain.Datum(batch["input_ids"][row][at],
                                         {"target_tokens": batch["target_ids"][row][at],
                                          "weights": batch["loss_mask"][row][at] / tokens}))  # fmt: skip
        got.append(client.forward_backward(data, "cross_entropy").loss)
        client.optim_step(adam_of(cfg))
    np.testing.assert_allclose(got, expected, rtol=2e-5)


def test_a_hand_written_importance_sampling_loop_reaches_the_grpo_stages_losses(tmp_path, monkeypatch):
    from ptrain.stages import grpo

    seen = []
    take = grpo.RolloutBatches.__next__

    def recording(self):
        batch = take(self)
        seen.append(copy.deepcopy(batch))
        return batch

    monkeypatch.setattr(grpo.RolloutBatches, "__next__", recording)
    cfg = ptrain.compose(None, [*TINY_MODEL, "stages=[{name: grpo, kind: grpo}]", "env=arithmetic",
                                "envs.arithmetic.n_train=32", "envs.arithmetic.n_eval=4", "train.steps=3",
                                "train.seq_len=64", "train.eval_every=0", "train.eval_generate=0",
                                "algo.grpo.prompts_per_step=2", "algo.grpo.group_size=4",
                                "algo.grpo.max_new_tokens=16", "optim.lr=3e-3", "rollout.max_running_requests=8",
                                "checkpoint.every_steps=3", f"run_dir={tmp_path}"])  # fmt: skip
    result = ptrain.grpo(cfg)
    expected = stage_losses(os.path.dirname(result.metrics_path))
    assert len(seen) == cfg.train.steps == len(expected)

    client = ptrain.TrainingClient(os.path.join(cfg.run_dir, "base_model"))
    got = []
    for batch in seen:
        tokens = batch["loss_mask"].sum()
        data = []
        for row in np.flatnonzero(batch["row_valid"]):
            n = int((batch["segment_ids"][row] > 0).sum())
            mask = batch["loss_mask"][row][:n]
            data.append(ptrain.Datum(batch["input_ids"][row][:n],
                                     {"target_tokens": batch["target_ids"][row][:n],
                                      "logprobs": batch["engine_logp"][row][:n],
                                      "advantages": batch["advantages"][row] * mask / tokens}))  # fmt: skip
        got.append(client.forward_backward(data, "importance_sampling").loss)
        client.optim_step(adam_of(cfg))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_lora_clients_share_one_base_and_train_only_their_adapters(tmp_path):
    """Two LoRA clients over one loaded base: each starts as the base exactly, trains its own
    adapters (the base arrays stay untouched), samples with them, and its merged export and
    saved state give back the same model."""
    import jax

    from ptrain.client import load_base
    from ptrain.config.lora import LoRAConfig

    base = load_base(CFG, seed=3)
    plain = ptrain.TrainingClient(CFG, seed=3)
    seqs = sequences(7)
    base_before = [np.asarray(x).copy() for x in jax.tree.leaves(base.params)]
    a = ptrain.TrainingClient(base, lora=LoRAConfig(rank=4, alpha=8.0, targets=["all-linear", "lm_head"]), seed=1)
    b = ptrain.TrainingClient(base, lora=LoRAConfig(rank=2, targets=["attention"]), seed=2)
    np.testing.assert_allclose(a.forward(ce_data(seqs)).loss, plain.forward(ce_data(seqs)).loss, rtol=1e-6)
    assert sum(x.size for x in jax.tree.leaves(a.params)) < sum(x.size for x in base_before) // 4

    losses = []
    for _ in range(4):
        losses.append(a.forward_backward(ce_data(seqs), "cross_entropy").loss)
        a.optim_step({"learning_rate": 2e-2})
    assert losses[-1] < losses[0]
    for before, after in zip(base_before, jax.tree.leaves(base.params)):
        np.testing.assert_array_equal(before, np.asarray(after))
    np.testing.assert_allclose(b.forward(ce_data(seqs)).loss, plain.forward(ce_data(seqs)).loss, rtol=1e-6)

    b.forward_backward(ce_data(seqs), "cross_entropy")
    b.optim_step({"learning_rate": 5e-2})
    prompt = seqs[0][:4]
    for client in (a, b):  # a: the output head is adapted, so it samples merged weights; b: an engine adapter
        (samples,) = client.sample([prompt], n=2, sampling_params={"max_new_tokens": 5, "sampling_seed": 1})
        for s in samples:
            full = prompt + list(s.output_ids)
            data = [ptrain.Datum(full[:-1], {"target_tokens": full[1:], "weights": np.ones(len(full) - 1)})]
            np.testing.assert_allclose(client.forward(data).logprobs[0][len(prompt) - 1 :], s.logprobs, atol=2e-5)
    b.close()

    a.save_weights(tmp_path / "merged")
    merged = ptrain.TrainingClient(str(tmp_path / "merged"))
    np.testing.assert_allclose(merged.forward(ce_data(seqs)).loss, a.forward(ce_data(seqs)).loss, rtol=1e-5)
    a.save_state(tmp_path / "state")
    c = ptrain.TrainingClient(base, lora=LoRAConfig(rank=4, alpha=8.0, targets=["all-linear", "lm_head"]), seed=9)
    c.load_state(tmp_path / "state")
    assert c.step == 4
    np.testing.assert_allclose(c.forward(ce_data(seqs)).loss, a.forward(ce_data(seqs)).loss, rtol=1e-6)
    with pytest.raises(ValueError, match="does not hold this model's state"):
        b.load_state(tmp_path / "state")
    a.close()
