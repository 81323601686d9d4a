"""On-policy preference pairs from environments, in Nemotron 3 Nano's three categories.

Nano's DPO stage (arXiv 2512.20848 App. C) samples its policy on math and STEM tasks, with
and without tools declared, and pairs the samples so that DPO removes tool hallucination
without losing accuracy:

  no_tools        a task of an environment that declares no tools: correctness decides
  with_tools      a task of a tool environment (multi-turn): correctness decides
  hallucination   a task of an environment that declares no tools, whose sample calls a
                  tool anyway: that sample is rejected whatever it answered

For each of the first `algo.dpo.env_pairs` tasks drawn from the stage's environments (by
weight, as an RL stage draws them) the policy samples `policy_samples` episodes through the
environment's own rollout, which grades them. Good samples (correct, finished, no tool call
where none is declared) are zipped with bad ones into (chosen, rejected) pairs, the bad
samples that call an undeclared tool first (a task with fewer good samples than bad ones
then spends its pairs on the hallucinations); a task the policy never gets right pairs the
environment's demonstration with a bad sample when the environment can write one. Held-out
pairs come the same way from the first `policy_eval_pairs` held-out tasks of each
environment.

Pairs are written once into the stage folder (`env_pairs.jsonl`, `env_pairs_eval.jsonl`,
counts and settings in `env_pairs.json`) as preference JSONL in chat form; a resumed stage
reads them back. A multi-turn episode's turns become messages: the policy's as assistant
turns, tool results as tool turns, the environment's as user turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

from ptrain.config import RunConfig
from ptrain.envs.base import is_correct
from ptrain.envs.demonstrations import episode_messages, prompt_messages
from ptrain.parallel.multihost import on_primary
from ptrain.stages.env_metrics import calls_a_tool, declares_tools
from ptrain.stages.policy_pairs import save_pairs, saved_pairs

PAIRS_FILE = "env_pairs.jsonl"
EVAL_PAIRS_FILE = "env_pairs_eval.jsonl"
META_FILE = "env_pairs.json"
CATEGORIES = ("no_tools", "with_tools", "hallucination")


def good_sample(t, *, tool_free: bool) -> bool:
    return (
        t.error is None
        and t.finish_reason not in ("length", "token_limit", "error", "abort")
        and is_correct(t)
        and not (tool_free and calls_a_tool(t))
    )


def task_pairs(env, task, samples, *, tool_free: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Pairs of one task's graded samples, and per-category counts (module docstring)."""
    good = [t for t in samples if good_sample(t, tool_free=tool_free)]
    bad = [t for t in samples if not good_sample(t, tool_free=tool_free) and any(m["content"].strip()
           for m in episode_messages(t))]  # fmt: skip
    if tool_free:  # the tool-calling samples are rejected first: removing them is what the stage is for
        bad.sort(key=lambda t: not calls_a_tool(t))
    counts = dict.fromkeys((*CATEGORIES, "with_demonstration"), 0)
    if not bad:
        return [], counts
    chosen = [episode_messages(t) for t in good]
    if not chosen:
        demo = getattr(env, "demonstration", None)
        if demo is None:
            return [], counts
        chosen = [list(demo(task))]
        counts["with_demonstration"] += 1
    pairs = []
    for c, r in zip(chosen, bad):
        category = "hallucination" if tool_free and calls_a_tool(r) else "no_tools" if tool_free else "with_tools"
        counts[category] += 1
        pairs.append(
            {
                "prompt": prompt_messages(env, task),
                "chosen": c,
                "rejected": episode_messages(r),
                "env": env.name,
                "task": task.id,
                "category": category,
            }
        )
    return pairs, counts


def _settings(run: RunConfig) -> dict[str, Any]:
    d = run.algo.dpo
    return {
        "tasks": d.env_pairs,
        "samples": d.policy_samples,
        "temperature": d.policy_temperature,
        "max_new_tokens": d.policy_max_new_tokens,
        "eval_tasks": d.policy_eval_pairs,
        "envs": sorted(run.stage.envs or run.envs),
        "seed": run.train.seed,
    }


async def _sample(envs_tasks, engine, sampling, seed: int):
    coros = [
        env.rollout(task, engine, dataclasses.replace(sampling, sampling_seed=seed + i))
        for i, (env, task) in enumerate(envs_tasks)
    ]
    return await asyncio.gather(*coros)


def sample_pairs(envs_tasks, engine, sampling, seed: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Pairs (and counts) of (environment, task) pairs sampled through the environments."""
    results = asyncio.run(_sample(envs_tasks, engine, sampling, seed))
    pairs: list[dict[str, Any]] = []
    counts: dict[str, float] = dict.fromkeys(("tasks", "samples", "correct", "tool_calls_undeclared"), 0)
    counts.update(dict.fromkeys((*CATEGORIES, "with_demonstration"), 0))
    free_samples = 0
    for (env, task), samples in zip(envs_tasks, results):
        tool_free = not declares_tools(env)
        got, c = task_pairs(env, task, samples, tool_free=tool_free)
        pairs.extend(got)
        for k, v in c.items():
            counts[k] += v
        counts["tasks"] += 1
        counts["samples"] += len(samples)
        counts["correct"] += sum(map(is_correct, samples))
        if tool_free:
            free_samples += len(samples)
            counts["tool_calls_undeclared"] += sum(map(calls_a_tool, samples))
    counts["pairs"] = len(pairs)
    counts["sample_accuracy"] = counts["correct"] / max(counts["samples"], 1)
    counts["hallucination_rate"] = counts["tool_calls_undeclared"] / max(free_samples, 1)
    return pairs, counts


def env_pairs_data(run: RunConfig, stage_dir: str, policy, data_cfg, tokenizer):
    """(training data config, held-out data config or None) pointing at the stage's
    environment pairs; sampled now with the starting weights, or read back on resume.
    policy() gives (placed, params, model_state) to sample with; it is called only when the
    pairs are not on disk already. As several JAX processes, process 0 samples and writes them,
    and every process reads them."""
    from ptrain.stages.heldout import engine_weights

    settings = _settings(run)
    path, eval_path, meta_path = (os.path.join(stage_dir, f) for f in (PAIRS_FILE, EVAL_PAIRS_FILE, META_FILE))
    n_eval = settings["eval_tasks"]

    def configs():
        train = dataclasses.replace(data_cfg, source="jsonl", format="preference", train_path=path, eval_path=None)
        held = dataclasses.replace(train, eval_path=eval_path) if n_eval else None
        return train, held

    meta = saved_pairs(path, eval_path if n_eval else None, meta_path, settings)
    if meta is not None:
        print(f"ptrain: reusing {meta['counts']['pairs']} environment pairs from {path}", flush=True)
        return configs()

    t0 = time.time()
    placed, params, model_state = policy()
    weights = engine_weights(placed.state.replace(params=params, model_state=model_state))
    on_primary(lambda: _sample_and_save(run, placed, weights, tokenizer, settings, (path, eval_path, meta_path), t0),
               "sampling the environment pairs", keep=(ValueError,))  # fmt: skip
    return configs()


def _sample_and_save(run, placed, weights, tokenizer, settings, paths, t0: float) -> None:
    from ptrain.config.seeds import component_seed
    from ptrain.envs.mixture import EnvMixture, env_task_seed
    from ptrain.envs.registry import close_envs, make_env
    from ptrain.rollout.protocol import SamplingParams
    from ptrain.stages.heldout import eval_engine

    path, eval_path, meta_path = paths
    n_eval = settings["eval_tasks"]
    configs_ = [run.envs[n] for n in settings["envs"]]
    envs = {e.env_name: make_env(e, tokenizer=tokenizer, sandbox=run.sandbox) for e in configs_}
    seed = component_seed(run, "train.seed")
    max_len = placed.model_def.bind(*weights).cfg.max_seq_len
    engine = eval_engine(run, placed, weights, longest_prompt=max_len, max_new_tokens=0)
    sampling = SamplingParams(max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"],
                              n=settings["samples"])  # fmt: skip
    try:
        mixture = EnvMixture(list(envs.values()), [e.weight for e in configs_], seed=seed)
        pairs, counts = sample_pairs(mixture.next_tasks(settings["tasks"]), engine, sampling, seed)
        meta: dict[str, Any] = {"settings": settings, "counts": counts}
        if n_eval:
            held = [
                (env, t)
                for env in envs.values()
                for t in list(env.tasks("eval", seed=env_task_seed(env, seed)))[:n_eval]
            ]
            held_pairs, meta["eval_counts"] = sample_pairs(held, engine, sampling, seed + 1_000_003)
    finally:
        engine.close()
        close_envs(envs)
    if not pairs:
        raise ValueError(
            f"the starting policy left nothing to prefer on {counts['tasks']} tasks (every sample good, or no good "
            "sample and no demonstration): raise algo.dpo.policy_temperature or algo.dpo.env_pairs"
        )
    if n_eval and not held_pairs:
        raise ValueError(
            "no held-out pairs: the starting policy left nothing to prefer on the held-out tasks; set "
            "algo.dpo.policy_eval_pairs=0 to train without held-out preference metrics"
        )
    counts["seconds"] = round(time.time() - t0, 1)
    save_pairs(path, pairs, eval_path if n_eval else None, held_pairs if n_eval else [], meta_path, meta)
    cats = ", ".join(f"{counts[c]:.0f} {c}" for c in CATEGORIES)
    print(
        f"ptrain: sampled {settings['samples']} episodes of each of {counts['tasks']:.0f} tasks in {counts['seconds']} s: "
        f"sample accuracy {counts['sample_accuracy']:.3f}, undeclared tool calls {counts['hallucination_rate']:.3f}; "
        f"{counts['pairs']} pairs ({cats}; {counts['with_demonstration']:.0f} with a demonstration) -> {path}",
        flush=True,
    )
