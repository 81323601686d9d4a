"""On-policy preference pairs: the stage's starting policy samples, the task's verifier grades.

For each of the first `algo.dpo.policy_pairs` training prompts the policy samples
`policy_samples` completions. Correct and incorrect completions of one prompt are zipped
into (chosen, rejected) pairs; a prompt the policy never gets right pairs the data's own
chosen answer with an incorrect sample; a prompt it always gets right gives no pair. The
rejected side thus shows the mistakes this policy makes, not scripted ones, which is
what lets preference optimisation fix them (iterative RPO, Pang et al. 2024, arXiv
2404.19733, builds its pairs this way).

With `policy_step_level` the rejected side stops after its first wrong line (Step-DPO).

The first `policy_eval_pairs` held-out prompts are sampled and graded the same way into
held-out pairs (`policy_pairs_eval.jsonl`), on which the stage measures implicit-reward
accuracy and margin: pairs drawn like the training pairs, so the held-out numbers measure
what training optimises (scripted pairs contrast other mistakes than this policy's).

The pairs are written once, as preference JSONL in chat form, into the stage folder
(`policy_pairs.jsonl`, with the settings and counts in `policy_pairs.json`): a resumed
stage reads the same pairs, so the saved data-iterator position stays valid, and users
can read what the policy got wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from ptrain.config import RunConfig
from ptrain.data.preference import preference_conversations
from ptrain.data.prompts import make_eval_prompts
from ptrain.data.report import BadRowReport
from ptrain.data.sources import open_split
from ptrain.data.tasks import check_answer, write_jsonl
from ptrain.parallel.multihost import on_primary
from ptrain.stages.heldout import complete, engine_weights, eval_engine

PAIRS_FILE = "policy_pairs.jsonl"
EVAL_PAIRS_FILE = "policy_pairs_eval.jsonl"
META_FILE = "policy_pairs.json"


def saved_pairs(path: str, eval_path: str | None, meta_path: str, settings: dict[str, Any]) -> dict | None:
    """The meta record of pairs a stage sampled earlier with the same settings (a resumed
    stage reads them back, so its data-iterator position stays valid); None when there are
    none yet. ValueError when they were sampled with other settings."""
    if not (os.path.isfile(path) and os.path.isfile(meta_path) and (eval_path is None or os.path.isfile(eval_path))):
        return None
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("settings") != settings:
        raise ValueError(
            f"{meta_path} holds pairs sampled with {meta.get('settings')}, but this run asks for {settings}; "
            f"use a new run_dir, or delete {path} and {meta_path} to sample again"
        )
    return meta


def save_pairs(path: str, pairs: list[dict], eval_path: str | None, held: list[dict], meta_path: str, meta: dict):
    """Write the pairs, then the meta record last (atomically): its presence marks them complete."""
    write_jsonl(pairs, path)
    if eval_path is not None:
        write_jsonl(held, eval_path)
    tmp = f"{meta_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, meta_path)


def _settings(run: RunConfig) -> dict[str, Any]:
    d = run.algo.dpo
    return {
        "prompts": d.policy_pairs,
        "samples": d.policy_samples,
        "temperature": d.policy_temperature,
        "max_new_tokens": d.policy_max_new_tokens,
        "step_level": d.policy_step_level,
        "eval_prompts": d.policy_eval_pairs,
        "seed": run.train.seed,
    }


def first_wrong_step(chosen: str, rejected: str) -> str:
    """`rejected` up to and including its first line that differs from `chosen`'s line at
    the same place (all of it when it is a prefix-extension of chosen)."""
    got, want = rejected.split("\n"), chosen.split("\n")
    for i, line in enumerate(got):
        if i >= len(want) or line != want[i]:
            return "\n".join(got[: i + 1])
    return rejected


def sample_completions(
    run: RunConfig, placed, weights, prompts, tokenizer, *, samples: int, temperature: float, max_new_tokens: int,
    seed: int,
) -> list[list[tuple[str, bool]]]:  # fmt: skip
    """`samples` (decoded completion, ended by a stop token) per prompt, from the rollout
    engine with `weights` (`engine_weights`); a prompt's samples share one prefill."""
    ids = [p.prompt_ids.tolist() for p in prompts]
    engine = eval_engine(run, placed, weights, longest_prompt=max(map(len, ids)), max_new_tokens=max_new_tokens)
    try:
        outs = complete(engine, ids, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                        samples=samples)  # fmt: skip
    finally:
        engine.close()
    return [[(o.text, o.finished) for o in group] for group in outs]


def build_pairs(
    rows: list[dict], tasks: list[dict], completions: list[list[tuple[str, bool]]], *, step_level: bool = False
) -> tuple[list[dict], dict[str, float]]:
    """Preference rows from graded samples, and counts of what happened per prompt.

    A sample is correct when it ended with a stop token and the verifier accepts it; one
    cut by the length cap is incorrect. Empty samples are no answer to contrast: dropped.
    """
    pairs, n_correct, n_samples = [], 0, 0
    counts = {"prompts": len(rows), "pairs_from_samples": 0, "pairs_with_data_chosen": 0, "prompts_all_correct": 0}
    for row, task, samples in zip(rows, tasks, completions):
        prompt, data_chosen, _ = preference_conversations(row)
        # what the verifier needs; the data's notes on its own rejected side ("fault") do not apply
        verifier_task = {k: v for k, v in task.items() if k != "fault"}
        graded = [(text, finished and check_answer(verifier_task, text)) for text, finished in samples]
        good = [text for text, ok in graded if ok]
        bad = [text for text, ok in graded if not ok and text.strip()]
        n_correct += len(good)
        n_samples += len(samples)
        if not bad:
            counts["prompts_all_correct"] += bool(good)
            continue
        if good:
            chosen_texts = good
            counts["pairs_from_samples"] += min(len(good), len(bad))
        else:
            chosen_texts = [data_chosen[-1]["content"]]
            counts["pairs_with_data_chosen"] += 1
        for c, r in zip(chosen_texts, bad):
            if step_level:
                r = first_wrong_step(c, r)
            pairs.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": c}],
                    "rejected": [{"role": "assistant", "content": r}],
                    "task": verifier_task,
                }
            )
    counts["pairs"] = len(pairs)
    counts["sample_accuracy"] = n_correct / max(n_samples, 1)
    return pairs, counts


def _sample_pairs(run, placed, weights, data_cfg, tokenizer, settings, split: str, limit: int):
    """(pairs, counts, bad-row report) from the first `limit` prompts of a split."""
    report = BadRowReport(
        source=f"{(data_cfg.train_path if split == 'train' else data_cfg.eval_path) or split} (policy_pairs prompts)",
        policy=data_cfg.bad_rows,
        keep_rows=data_cfg.report_rows,
    )
    prompts = [p for p in make_eval_prompts(data_cfg, tokenizer, split=split, limit=limit, report=report) if p.task]
    if report.bad:
        print(f"ptrain: {report.summary()}", flush=True)
    if not prompts:
        raise ValueError(
            f"algo.dpo.policy_pairs > 0 needs {split} rows with task metadata (a verifier to grade the "
            "samples); these rows have none: set algo.dpo.policy_pairs=0 to use their own pairs"
        )
    source = open_split(data_cfg, split)
    completions = sample_completions(
        run, placed, weights, prompts, tokenizer, samples=settings["samples"], temperature=settings["temperature"],
        max_new_tokens=settings["max_new_tokens"], seed=settings["seed"] + (0 if split == "train" else 1_000_003),
    )  # fmt: skip
    pairs, counts = build_pairs(
        [source[p.row] for p in prompts], [p.task for p in prompts], completions, step_level=settings["step_level"]
    )
    counts["bad_prompt_rows"] = report.bad
    return pairs, counts


def policy_pairs_data(run: RunConfig, stage_dir: str, placed, params, model_state, data_cfg, tokenizer):
    """(training data config, held-out data config or None), the training split pointing at
    on-policy pairs of the first `policy_pairs` training prompts and the held-out one at pairs
    sampled and graded the same way from the first `policy_eval_pairs` held-out prompts, so
    the held-out preference metrics measure what training optimises. Sampled now, or read
    back on resume. As several JAX processes, process 0 samples and writes them, and every
    process reads them."""
    settings = _settings(run)
    path, meta_path = os.path.join(stage_dir, PAIRS_FILE), os.path.join(stage_dir, META_FILE)
    eval_path = os.path.join(stage_dir, EVAL_PAIRS_FILE)
    n_eval = run.algo.dpo.policy_eval_pairs if data_cfg.eval_path is not None else 0

    def configs():
        train = dataclasses.replace(data_cfg, source="jsonl", train_path=path)
        held = dataclasses.replace(data_cfg, source="jsonl", eval_path=eval_path) if n_eval else None
        return train, held

    meta = saved_pairs(path, eval_path if n_eval else None, meta_path, settings)
    if meta is not None:
        print(f"ptrain: reusing {meta['counts']['pairs']} on-policy pairs from {path}", flush=True)
        return configs()

    t0 = time.time()
    weights = engine_weights(placed.state.replace(params=params, model_state=model_state))
    paths = (path, eval_path, meta_path)
    on_primary(lambda: _sample_and_save(run, placed, weights, data_cfg, tokenizer, settings, n_eval, paths, t0),
               "sampling the on-policy pairs", keep=(ValueError,))  # fmt: skip
    return configs()


def _sample_and_save(run, placed, weights, data_cfg, tokenizer, settings, n_eval: int, paths, t0: float) -> None:
    path, eval_path, meta_path = paths
    pairs, counts = _sample_pairs(run, placed, weights, data_cfg, tokenizer, settings, "train", settings["prompts"])
    if not pairs:
        raise ValueError(
            f"the starting policy answered all {counts['prompts']} sampled prompts correctly (or never "
            "produced a non-empty wrong answer), so there is nothing to prefer: raise "
            "algo.dpo.policy_temperature or algo.dpo.policy_pairs, or set it to 0"
        )
    meta = {"settings": settings, "counts": counts}
    held_pairs: list[dict] = []
    if n_eval:
        held_pairs, held_counts = _sample_pairs(run, placed, weights, data_cfg, tokenizer, settings, "eval", n_eval)
        if not held_pairs:
            raise ValueError(
                f"the starting policy answered all {held_counts['prompts']} held-out prompts correctly, so there "
                "are no held-out pairs to measure: set algo.dpo.policy_eval_pairs=0 to use the data's own"
            )
        meta["eval_counts"] = held_counts
    counts["seconds"] = round(time.time() - t0, 1)
    save_pairs(path, pairs, eval_path if n_eval else None, held_pairs, meta_path, meta)
    held = f"; {meta['eval_counts']['pairs']} held-out pairs -> {eval_path}" if n_eval else ""
    print(
        f"ptrain: sampled {settings['samples']} completions for each of {counts['prompts']} prompts in "
        f"{counts['seconds']} s: sample accuracy {counts['sample_accuracy']:.3f}, {counts['pairs']} pairs "
        f"({counts['pairs_from_samples']} from samples, {counts['pairs_with_data_chosen']} with the data's chosen "
        f"answer; {counts['prompts_all_correct']} prompts always right) -> {path}{held}",
        flush=True,
    )
