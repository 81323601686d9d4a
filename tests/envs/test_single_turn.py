"""Single-turn rollouts end to end: against a real LocalEngine on a tiny model (ids, mask and
log-probs exactly the engine's, token tiers from the prefix cache, a refused prompt) and
against the ReplayEngine (known completions, truncation, aborts, the request it sends);
reward code that raises, hangs, crashes or returns garbage scores 0 with a reason, is
counted, and leaves the other samples alone, from a worker thread; a slow environment does
not hold the others or the event loop. One tiny engine for the module."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from flax import nnx

from ptrain.config.env import EnvConfig
from ptrain.config.model import ModelConfig
from ptrain.data.tokenizer import build_tokenizer, stop_token_ids
from ptrain.envs.base import Task
from ptrain.envs.registry import make_env
from ptrain.envs.single_turn import SingleTurnEnv
from ptrain.models import Decoder
from ptrain.rollout.local import LocalEngine
from ptrain.rollout.protocol import GenerateRequest, SamplingParams
from ptrain.rollout.replay import Completion, ReplayEngine
from tests.envs.scripted_judges import scripted_judge

CTX = 64


class ScriptedEnv(SingleTurnEnv):
    """Its tasks ask for a word; scripted_judge grades the whole completion."""

    kind = "scripted"
    judge = staticmethod(scripted_judge)

    def make_tasks(self, seed):
        tasks = [self.task("train", i, self.user(f"Say ok {i}."), {"answer": "ok"}) for i in range(3)]
        return tasks, tasks[:1]

    def extract(self, task, text):
        return text.strip() or None


def scripted_env(tok, **cfg) -> ScriptedEnv:
    opts = SimpleNamespace(format_reward=0.0, correct_reward=1.0)
    return ScriptedEnv(EnvConfig(kind="arithmetic", name=cfg.pop("name", "scripted"), **cfg), opts, tokenizer=tok)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def engine(tok):
    cfg = ModelConfig(
        vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48, max_seq_len=CTX
    )
    eng = LocalEngine(
        Decoder(cfg, rngs=nnx.Rngs(0)), max_running_requests=8, context_length=CTX, eos_token_ids=[tok.eos_token_id]
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def arithmetic(tok):
    env = make_env(EnvConfig(kind="arithmetic", n_train=4, n_eval=1, score_truncated=True), tokenizer=tok)
    yield env
    env.close()


def test_local_engine_trajectories_are_the_engines_tokens(arithmetic, engine, tok):
    task = arithmetic.tasks("train", seed=0)[0]
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, sampling_seed=123)
    out = asyncio.run(arithmetic.rollout(task, engine, sampling))
    # The same request again (same seed: same samples) shows what the engine returned.
    request = GenerateRequest(arithmetic.prompt_ids(task), arithmetic.sampling_for(sampling), rid="check")
    samples = engine.submit(request).result()
    P = len(request.input_ids)
    assert len(out) == 4 and [t.sample_index for t in out] == [0, 1, 2, 3]
    for t, s in zip(out, samples):
        assert t.token_ids == s.prompt_ids + s.output_ids and t.prompt_length == P
        assert t.loss_mask == (0,) * P + (1,) * len(s.output_ids)
        assert t.logprobs[P:] == pytest.approx(s.logprobs) and t.logprobs[:P] == (0.0,) * P
        assert t.finish_reason == s.finish_reason.type
        assert t.weight_versions == (engine.weight_version,)
        assert t.tokens.prompt_uncached + t.tokens.prompt_cached == P and t.tokens.output == len(s.output_ids)
        assert t.turns[0].role == "policy" and (t.turns[0].start, t.turns[0].end) == (P, len(t.token_ids))
        assert t.turns[0].text == tok.decode(list(s.output_ids), skip_special_tokens=True)
        # The reward is the scorer's on that text (a random model: usually 0).
        assert t.reward == asyncio.run(arithmetic.score(task, t.turns[0].text)).reward
    # The check request reused the cached prompt; so does a second rollout of the task.
    assert samples[0].cached_tokens == P - 1
    again = asyncio.run(arithmetic.rollout(task, engine, SamplingParams(n=2, max_new_tokens=4)))
    assert all(t.tokens.prompt_cached == P - 1 and t.tokens.prompt_uncached == 1 for t in again)


def test_a_prompt_the_engine_refuses_is_an_error_trajectory(engine, tok):
    env = make_env(EnvConfig(kind="countdown", n_train=2, n_eval=0, reward_workers=1), tokenizer=tok)
    task = env.tasks("train", seed=0)[0]
    assert len(env.prompt_ids(task)) > CTX
    out = asyncio.run(env.rollout(task, engine, SamplingParams(n=2, max_new_tokens=8)))
    assert [t.finish_reason for t in out] == ["error", "error"]
    assert "context" in out[0].error and out[0].reward == 0.0 and sum(out[0].loss_mask) == 0
    assert env.stats["errors"] == 2


def test_known_completions_and_the_request_sent(tok):
    env = scripted_env(tok, max_new_tokens=5, reward_workers=1)
    try:
        task = env.tasks("train", seed=0)[0]
        engine = ReplayEngine(
            {
                f"scripted/{task.id}": [
                    "ok",
                    "no",
                    "ok ok ok ok ok ok ok ok",  # past max_new_tokens=5: truncated, not scored
                    Completion(text="ok", finish="abort"),
                ]
            },
            tokenizer=tok,
        )
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=4, max_new_tokens=100)))
        assert [t.reward for t in out] == [1.0, 0.0, 0.0, 0.0]
        assert [t.finish_reason for t in out] == ["stop", "stop", "length", "abort"]
        assert out[2].metrics["truncated"] == 1.0 and out[2].metrics["correct"] == 0.0
        assert out[3].metrics["aborted"] == 1.0
        assert [t.weight_versions for t in out] == [("replay",)] * 4
        (sent,) = engine.requests
        assert sent.rid == "scripted/train-0" and sent.sampling.max_new_tokens == 5  # the env's budget
        assert set(stop_token_ids(tok)) <= set(sent.sampling.stop_token_ids)
        assert sent.input_ids == env.prompt_ids(task)
        assert env.stats["truncated"] == 1 and env.stats["episodes"] == 4
    finally:
        env.close()


def test_truncated_samples_scored_when_asked(tok):
    # "ok" fits the budget, its end-of-turn token does not: finish length, text complete.
    budget = len(tok.encode("ok", add_special_tokens=False))
    env = scripted_env(tok, max_new_tokens=budget, score_truncated=True, reward_workers=1)
    try:
        task = env.tasks("train", seed=0)[0]
        (t,) = asyncio.run(env.rollout(task, ReplayEngine(["ok"], tokenizer=tok), SamplingParams()))
        assert t.finish_reason == "length" and t.reward == 1.0 and t.metrics["truncated"] == 1.0
    finally:
        env.close()


def test_reward_code_failures_score_zero_with_reasons_from_a_worker_thread(tok):
    env = scripted_env(tok, reward_timeout_s=2.0, reward_workers=2)
    try:
        task = env.tasks("train", seed=0)[0]
        answers = ["ok", "boom", "hang", "nan", "big", "words", "crash", "no", "ok"]
        result = {}

        def worker():
            start = time.monotonic()
            engine = ReplayEngine(answers, tokenizer=tok)
            result["out"] = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers))))
            result["wall"] = time.monotonic() - start

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
        out = result["out"]
        assert [t.reward for t in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        reasons = [t.reward_error for t in out]
        assert reasons[0] is None and reasons[7] is None and reasons[8] is None
        assert "RuntimeError: the verifier blew up" in reasons[1]
        assert "timeout after 2 s" in reasons[2]
        assert "nan" in reasons[3] and "outside [0, 1]" in reasons[4] and "not a number" in reasons[5]
        assert "worker process died" in reasons[6]
        assert [t.metrics["reward_error"] for t in out] == [0, 1, 1, 1, 1, 1, 1, 0, 0]
        assert env.stats["reward_errors"] == 6
        stats = env.runner.stats
        assert (stats["raised"], stats["timeout"], stats["crashed"], stats["bad_value"]) == (1, 1, 1, 2)
        assert result["wall"] < 30
    finally:
        env.close()


def test_a_slow_environment_holds_neither_the_others_nor_the_loop(tok):
    slow = scripted_env(tok, name="slow", reward_workers=1)
    fast = make_env(EnvConfig(kind="arithmetic", n_train=2, n_eval=0, reward_workers=1), tokenizer=tok)
    try:
        slow.warm_up()
        fast.warm_up()
        slow_task, fast_task = slow.tasks("train", seed=0)[0], fast.tasks("train", seed=0)[0]
        done: dict[str, float] = {}
        ticks = []

        async def timed(name, coro):
            out = await coro
            done[name] = time.monotonic()
            return out

        async def ticker():
            while len(done) < 2:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        async def main():
            start = time.monotonic()
            # More slow judgements than the loop's default executor has threads (6 here).
            slow_engine = ReplayEngine(["slow"] * 10, tokenizer=tok)
            fast_engine = ReplayEngine([f"Answer: {fast_task.data['answer']}"] * 2, tokenizer=tok)
            results = await asyncio.gather(
                timed("slow", slow.rollout(slow_task, slow_engine, SamplingParams(n=10))),
                timed("fast", fast.rollout(fast_task, fast_engine, SamplingParams(n=2))),
                ticker(),
            )
            return start, results

        start, (slow_out, fast_out, _) = asyncio.run(main())
        assert [t.reward for t in fast_out] == [1.0, 1.0] and [t.reward for t in slow_out] == [1.0] * 10
        assert done["fast"] - start < 1.0 < 3.5 < done["slow"] - start  # 10 x 0.4 s on one worker for slow
        assert len(ticks) > (done["slow"] - start) / 0.05 * 0.5  # the loop kept running
    finally:
        slow.close()
        fast.close()


def test_concurrent_rollouts_of_one_task_get_their_own_rids(tok):
    env = scripted_env(tok, reward_workers=1)
    try:
        task = env.tasks("train", seed=0)[0]
        engine = ReplayEngine({"scripted/train-0": ["ok", "no"]}, tokenizer=tok, delay_s=0.2)

        async def both():
            return await asyncio.gather(*(env.rollout(task, engine, SamplingParams()) for _ in range(2)))

        first, second = asyncio.run(both())
        assert sorted(r.rid for r in engine.requests) == ["scripted/train-0", "scripted/train-0#2"]
        assert sorted([first[0].reward, second[0].reward]) == [0.0, 1.0]
        assert not env._in_flight
    finally:
        env.close()


def test_tasks_are_cached_per_seed_and_named(tok):
    env = scripted_env(tok)
    assert env.tasks("train", seed=1) is env.tasks("train", seed=1)
    assert isinstance(env.tasks("eval", seed=1)[0], Task) and env.tasks("eval", seed=1)[0].env == "scripted"
