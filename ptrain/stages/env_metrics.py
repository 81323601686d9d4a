"""Evaluation of a policy on environments: reward, pass@k, lengths, tool use and tokens per env.

Used by RL stages every `train.eval_every` steps and by the `eval` stage kind. Each env's
"eval" tasks (the first `limit`) are sampled `samples` times; with samples = 1 and
temperature 0 the numbers are greedy pass@1.

pass@k is the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374): with n samples
of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over tasks. A sample
is correct when its `correct` reward component is 1 (else when its reward is > 0).

With `thinking_budgets`, each budget B is also evaluated greedily with B stated in the prompt
and `</think>` forced after B reasoning tokens (`budget_B/...`): Nano's accuracy-against-budget
curve.

Verbosity is split as Nemotron 3 Nano reports it: `reasoning_chars` (inside <think>...</think>)
and `answer_chars` (the rest) of the policy's turns. An environment that declares no tools
also reports `hallucinated_tool_calls`: the share of samples that call a tool anyway (a
`<tool_call>` block), the failure Nano's DPO stage removes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from ptrain.envs.base import Environment, Trajectory, is_correct
from ptrain.envs.mixture import env_task_seed
from ptrain.parallel.multihost import on_primary
from ptrain.rollout.protocol import EngineUnavailable, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN = "<think>", "</think>", "<tool_call>"


def policy_texts(t: Trajectory) -> list[str]:
    return [turn.text for turn in t.turns if turn.role == "policy"]


def reasoning_and_answer_chars(t: Trajectory) -> tuple[int, int]:
    """Characters of reasoning (inside <think>...</think>; an unclosed <think> runs to the end)
    and of answer (the rest) over the policy's turns."""
    reasoning = answer = 0
    for text in policy_texts(t):
        start = text.find(THINK_OPEN)
        end = text.find(THINK_CLOSE, max(start, 0))
        if start >= 0 and end >= 0:
            reasoning += end - start - len(THINK_OPEN)
            answer += len(text) - (end - start) - len(THINK_CLOSE)
        elif start >= 0:
            reasoning += len(text) - start - len(THINK_OPEN)
            answer += start
        elif end >= 0:  # the prompt opened the reasoning
            reasoning += end
            answer += len(text) - end - len(THINK_CLOSE)
        else:
            answer += len(text)
    return reasoning, answer


def calls_a_tool(t: Trajectory) -> bool:
    return any(TOOL_CALL_OPEN in text for text in policy_texts(t))


ABSTENTION = re.compile(
    r"\b(i (do not|don't|cannot|can't) (know|answer|help|solve|determine|say)|i('m| am) (not sure|unable to)|"
    r"not enough information|(could|can) you (please )?(clarify|specify|provide))\b",
    re.IGNORECASE,
)


def abstained(t: Trajectory) -> bool:
    """The episode's last policy turn gives no answer: nothing outside <think>...</think>, a
    refusal to answer ("I don't know", "I cannot answer"), or a clarifying question back.
    The hack Cursor reported of its Composer RL (questions instead of edits) reads as this."""
    if t.error is not None or t.finish_reason in ("length", "token_limit"):
        return False  # a failed or cut episode did not choose to stop short
    texts = policy_texts(t)
    if not texts:
        return True
    text = texts[-1]
    end = text.rfind(THINK_CLOSE)
    answer = (text[end + len(THINK_CLOSE) :] if end >= 0 else text.split(THINK_OPEN)[0]).strip()
    return not answer or bool(ABSTENTION.search(answer))


def summarize(
    trajectories_by_task: Sequence[Sequence[Trajectory]], ks: Sequence[int], *, declares_tools: bool = True
) -> dict[str, float]:
    """Metrics of one environment from its tasks' sample lists. A sample that failed (an
    environment or engine error) counts as a wrong answer, and is left out of the lengths, the
    cut share and the abstentions, which describe answers it never gave (`env_errors` counts it)."""
    flat = [t for ts in trajectories_by_task for t in ts]
    if not flat:
        return {}
    answered = [t for t in flat if t.error is None]
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    split = np.asarray([reasoning_and_answer_chars(t) for t in answered], np.float64).reshape(-1, 2)
    out: dict[str, float] = {
        "reward": float(np.mean([t.reward for t in flat])),
        "response_length": mean([t.tokens.output for t in answered]),
        "reasoning_chars": mean(split[:, 0]),
        "answer_chars": mean(split[:, 1]),
        "truncated_frac": mean([t.finish_reason in ("length", "token_limit") for t in answered]),
        "abstained": mean([abstained(t) for t in answered]),
        "reward_errors": float(sum(t.reward_error is not None for t in flat)),
        "env_errors": float(sum(t.error is not None for t in flat)),
        "tokens_prompt_uncached": float(sum(t.tokens.prompt_uncached for t in flat)),
        "tokens_prompt_cached": float(sum(t.tokens.prompt_cached for t in flat)),
        "tokens_output": float(sum(t.tokens.output for t in flat)),
    }
    if not declares_tools:
        out["hallucinated_tool_calls"] = float(np.mean([calls_a_tool(t) for t in flat]))
    for k in ks:
        vals = [pass_at_k(len(ts), sum(map(is_correct, ts)), k) for ts in trajectories_by_task if len(ts) >= k]
        if vals:
            out[f"pass@{k}"] = float(np.mean(vals))
    names = sorted({k for t in flat for k in t.reward_components})
    for name in names:
        out[f"reward_{name}"] = float(np.mean([t.reward_components.get(name, 0.0) for t in flat]))
    metric_names = sorted({k for t in flat for k in t.metrics})
    for name in metric_names:
        out[name] = float(np.mean([float(t.metrics.get(name, 0.0)) for t in flat]))
    return out


async def _rollouts(env: Environment, tasks, engine, sampling: SamplingParams, seed: int):
    coros = [env.rollout(t, engine, dataclasses.replace(sampling, sampling_seed=seed + i)) for i, t in enumerate(tasks)]
    return await asyncio.gather(*coros)


def declares_tools(env: Environment) -> bool:
    """Whether the environment may offer the policy tools: any but a single-turn kind (those
    answer in one turn and declare none). A wrapper (a reward model scoring the episodes)
    answers for the environment it wraps (`inner`)."""
    from ptrain.envs.single_turn import SingleTurnEnv

    return not isinstance(getattr(env, "inner", env), SingleTurnEnv)


def with_budget_prompt(task, budget: int):
    """The task with its last user turn stating a thinking budget, as Nano's template does."""
    from ptrain.data.reasoning import budget_tag

    messages = [dict(m) for m in task.messages]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is not None:
        messages[last]["content"] = str(messages[last].get("content", "")) + budget_tag(budget)
    return dataclasses.replace(task, messages=tuple(messages))


def think_end_ids(env: Environment) -> tuple[int, ...]:
    """The environment's tokenizer's ids of `</think>` (what the engine forces at a budget)."""
    tokenizer = getattr(env, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"environment {getattr(env, 'name', env)!r} has no tokenizer to encode </think> with, so no thinking "
            "budget can be forced; leave algo.eval.thinking_budgets empty for it"
        )
    return tuple(tokenizer.encode(THINK_CLOSE, add_special_tokens=False))


def evaluate_envs(
    envs: Mapping[str, Environment],
    engine,
    cfg,
    *,
    seed: int = 0,
    audit=None,
    strict: bool = False,
    by_task: dict[str, dict[str, dict[str, float]]] | None = None,
) -> dict[str, float]:
    """Greedy `<env>/<metric>` for every environment (pass@1, reward, lengths, tool use,
    tokens), with cfg.samples > 0 also `<env>/sampled/<metric>` over that many samples at
    cfg.temperature (reward, accuracy = avg@k, pass@k), and the means over environments.
    `seed`: the stage's train.seed (the environments' tasks are built as the RL stages build
    them: ptrain/envs/mixture.py env_task_seed) and the base of the sampling seeds.
    `cfg` is an algo.eval config; `audit` an AuditLog for every episode (record "eval").
    strict: ValueError when every episode of an environment failed (the engine refused every
    prompt, its server is unreachable): its numbers would be zeros that measure nothing.
    by_task: a dict to fill with each task's accuracy (the share of its samples that are
    correct), as by_task[decoding][env][task id], decoding "greedy", "sampled" or "budget_B":
    what a paired comparison of two models over the same tasks needs."""
    runs = [("", SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, n=1), (1,), None)]
    if cfg.samples > 0:
        sampled = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, n=cfg.samples)
        runs.append(("sampled/", sampled, tuple(k for k in cfg.pass_k if k <= cfg.samples), None))
    for budget in getattr(cfg, "thinking_budgets", ()):
        greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, n=1, thinking_budget=int(budget))
        runs.append((f"budget_{int(budget)}/", greedy, (1,), int(budget)))
    out: dict[str, float] = {}
    for name, env in envs.items():
        tasks = list(env.tasks("eval", seed=env_task_seed(env, seed)))
        tasks = tasks[: cfg.limit] if cfg.limit else tasks
        if not tasks:
            continue
        for prefix, sampling, ks, budget in runs:
            if budget is None:
                results = asyncio.run(_rollouts(env, tasks, engine, sampling, seed))
            else:
                sampling = dataclasses.replace(sampling, think_end_ids=think_end_ids(env))
                budgeted = [with_budget_prompt(t, budget) for t in tasks]
                results = asyncio.run(_rollouts(env, budgeted, engine, sampling, seed))
            if audit is not None:
                for ts in results:
                    audit.write_all(ts, record="eval", decoding=prefix.rstrip("/") or "greedy")
            flat = [t for ts in results for t in ts]
            failed = [t for t in flat if t.error is not None]
            if failed and not (strict and len(failed) == len(flat)):  # else the ValueError below says it
                # Counted as wrong answers: say so, or a refused request reads as a weak model.
                print(f"ptrain: eval: {len(failed)} of {len(flat)} {prefix.rstrip('/') or 'greedy'} episodes of "
                      f"environment '{name}' failed and count as wrong; the first: {failed[0].error}",
                      flush=True)  # fmt: skip
            if strict and flat and all(t.error is not None for t in flat):
                raise ValueError(
                    f"every one of the {len(flat)} {prefix.rstrip('/') or 'greedy'} episodes of environment "
                    f"'{name}' failed, the first with: {flat[0].error}"
                )
            if by_task is not None:
                scores = by_task.setdefault(prefix.rstrip("/") or "greedy", {}).setdefault(name, {})
                for task, ts in zip(tasks, results):
                    scores[task.id] = float(np.mean([is_correct(t) for t in ts])) if ts else 0.0
            # A sample its environment masked (NeMo Gym's mask_sample: the judge failed) measured
            # nothing: the means leave it out and `masked_samples` counts it.
            masked = sum(t.masked for ts in results for t in ts)
            summary = summarize([[t for t in ts if not t.masked] for ts in results], ks,
                                declares_tools=declares_tools(env))  # fmt: skip
            if masked:
                summary["masked_samples"] = float(masked)
            if prefix:
                summary["accuracy"] = float(np.mean([is_correct(t) for t in flat])) if flat else 0.0
            for key, value in summary.items():
                out[f"{name}/{prefix}{key}"] = value
    per_env = dict(out)
    budgets = tuple(f"budget_{int(b)}/pass@1" for b in getattr(cfg, "thinking_budgets", ()))
    for key in ("reward", "pass@1", "sampled/reward", "sampled/accuracy", *budgets):
        vals = [v for k, v in per_env.items() if k.split("/", 1)[1] == key]
        if vals:
            out[key] = float(np.mean(vals))
    return out


def env_evaluator(run, envs: Mapping[str, Environment], engine, *, sync_weights: bool = True):
    """An evaluator for the shared loop (`evaluate_envs` with run.algo.eval). sync_weights:
    first bring the engine to the state's weights (off where the stage keeps the engine
    current itself, as RL stages do after every step)."""

    from ptrain.config.seeds import component_seed

    cfg = run.algo.eval
    cfg = dataclasses.replace(cfg, limit=cfg.limit or run.train.eval_generate or None)
    seed = component_seed(run, "train.seed")

    def evaluate(state) -> dict[str, float]:
        if sync_weights:
            engine.update_weights(state.merged_params(), state.model_state or None, mode="abort")
        # As several JAX processes (from a fleet): process 0 samples and scores, the others get
        # its metrics, or its failure, so that they go on or stop in lockstep.
        return on_primary(lambda: evaluate_envs(envs, engine, cfg, seed=seed), "the held-out evaluation",
                          keep=(EngineUnavailable,))  # fmt: skip

    return evaluate
