"""lm-evaluation-harness tasks against a model served in process (`algo.eval.lm_eval`).

    metrics = run_lm_eval(engine, tokenizer, cfg, model_path=DIR)   # {"lm_eval/<task>/<metric>": value}

The engine is served with `python -m ptrain.serve`'s app (`make_app`) on a free loopback port
for the length of the run, and lm-eval's `local-completions` model talks to it as it talks to
any OpenAI-compatible server: generate_until tasks through `/v1/completions` text, and
loglikelihood tasks (multiple_choice, loglikelihood, loglikelihood_rolling) through echoed
prompt log-probs with `logprobs: 1`, whose top log-probs give lm-eval's is_greedy. It tokenises
with the server's own tokenizer (`tokenizer_backend=remote`: /tokenize, /tokenizer_info), so no
copy of the model folder is needed. Serving in process, rather than a `python -m ptrain.serve`
process, keeps one copy of the weights and the engine's compiled programs.

lm-eval is an optional dependency (pip install ".[lm_eval]"), imported here only.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from ptrain.config.grpo import LmEvalConfig
from ptrain.serve.in_process import serving

log = logging.getLogger("ptrain.serve")

SERVED_NAME = "ptrain-eval"
"""The model name lm-eval sends (the server answers any name with its model)."""


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `results` section -> `{"lm_eval/<task>/<metric>": value}`: lm-eval's keys are
    `<metric>,<filter>`; a filter other than "none" (e.g. gsm8k's strict-match) becomes a path
    segment, `<metric>/<filter>`. Values that are not finite numbers (an "N/A" stderr) are left out."""
    out: dict[str, float] = {}
    for task, values in sorted(results.items()):
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}/{filt}"
            out[f"lm_eval/{task}/{name}"] = float(value)
    return out


def task_manager(task_manager_class, include_path: str | None, tasks) -> Any:
    """lm-eval's TaskManager for `tasks`: over `include_path` alone when it holds every one of
    them (lm-eval indexes its own few thousand task YAMLs in about 10 s), else over both."""
    if include_path:
        local = task_manager_class(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    return task_manager_class(include_path=include_path)


def run_lm_eval(
    engine,
    tokenizer,
    cfg: LmEvalConfig,
    *,
    model_path: str | None = None,
    results_path: str | None = None,
) -> dict[str, float]:
    """Run cfg.tasks with lm-eval's `local-completions` model against `engine` (a LocalEngine)
    served in process with `tokenizer` (a Hugging Face tokenizer: the server's /tokenize);
    returns `metrics_of` lm-eval's results. `model_path`: the folder the engine's weights came
    from (what /model_info reports). `results_path`: also write lm-eval's results, per-task
    configs and versions there as JSON. Raises RuntimeError naming lm-eval's failure."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise RuntimeError(
            f'algo.eval.lm_eval.tasks needs lm-evaluation-harness ({e}); pip install "lm-eval[api]==0.4.13"'
        ) from None
    from ptrain.serve.server import make_app

    app = make_app(engine, tokenizer, served_model_name=SERVED_NAME, model_path=model_path)
    concurrent = max(1, int(getattr(engine, "max_running_requests", 1)) // cfg.batch_size)
    include = os.path.abspath(cfg.include_path) if cfg.include_path else None
    with serving(app) as url:
        model_args = {
            "model": SERVED_NAME,
            "base_url": f"{url}/v1/completions",
            "tokenizer_backend": "remote",
            "num_concurrent": concurrent,
            "max_retries": 1,  # loopback: a failure is an answer, not a network blip
            "max_length": int(engine.context_length),
        }
        log.info("lm-eval: tasks %s against %s (%d requests at once)", list(cfg.tasks), url, concurrent)
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=list(cfg.tasks),
            num_fewshot=cfg.num_fewshot,
            batch_size=cfg.batch_size,
            limit=cfg.limit,
            task_manager=task_manager(TaskManager, include, cfg.tasks),
            log_samples=False,
        )
    if out is None or "results" not in out:
        raise RuntimeError(f"lm-eval returned no results for tasks {list(cfg.tasks)}")
    if results_path:
        keep = {k: out[k] for k in ("results", "groups", "configs", "versions", "n-shot", "n-samples") if k in out}
        with open(results_path, "w") as f:
            json.dump(keep, f, indent=2, default=str)
    return metrics_of(out["results"])
