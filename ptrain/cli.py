"""Hydra entry point: compose conf/ + recipes/, validate into a RunConfig, run it with
`ptrain.api.run` (the CLI is one thin user of the Python API; it adds sweeps, `--cfg job`,
one-line errors and exit codes).

Config mistakes (unknown keys, wrong types, impossible values, missing files) end the
process within seconds with one message that names the key and what to pass, before
any JAX compute starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ptrain.config import ConfigError, register_configs, to_run_config
from ptrain.config.recipes import check_recipe, recipes_named
from ptrain.config.run import BASE_SCALE, RunConfig, check_list_overrides, shadowed_overrides
from ptrain.runtime import tune_xla_cpu

log = logging.getLogger("ptrain")

register_configs()


def _multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # not under Hydra (tests call _run directly)
        return False


def _optuna_sweep() -> bool:
    """Whether Hydra's optuna sweeper runs this job: its trials need one number back."""
    try:
        return _multirun() and "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()
    except ValueError:
        return False


def _job_result(run: RunConfig, summary: dict) -> Any:
    """What a job returns to Hydra: its final metrics, or under the optuna sweeper the
    objective's value alone (a search needs one number per trial)."""
    if not _optuna_sweep():
        return summary
    key = run.objective
    if key not in summary:
        have = ", ".join(sorted(k for k, v in summary.items() if isinstance(v, (int, float))))
        _stop_search(
            f"'{key}' is not a final metric of the last stage '{run.stages[-1].name}' (the run is kept in "
            f"{run.run_dir}); pass one of {have}"
        )
    return float(summary[key])


def _check_search(run: RunConfig) -> None:
    """Before a trial trains: the search has a number to read and a direction to move it."""
    if run.continuous.enabled:
        _stop_search("a continuous run is a loop of rounds, not a trial with one final number; search over a "
                     "recipe whose stages end (its GRPO settings, then set them in the continuous recipe)")  # fmt: skip
    if not run.objective:
        _stop_search(
            f"recipe '{run.name}' declares none, and hydra/sweeper=optuna needs one number from each job; pass "
            "objective=<a final metric of the last stage> (e.g. objective=eval/sampled/accuracy, a key of its "
            "metrics.jsonl) and hydra.sweeper.direction=maximize or minimize"
        )
    last = run.stages[-1]
    parts = run.objective.split("/")
    if last.kind in ("eval", "grpo") and len(parts) >= 3 and parts[0] == "eval":
        envs = sorted(last.envs or run.envs)
        named = parts[1]
        if named != "sampled" and not named.startswith("budget_") and named not in envs:
            _stop_search(
                f"'{run.objective}' names environment '{named}', which the last stage '{last.name}' does not "
                f"evaluate; its environments are {envs} (e.g. objective=eval/{envs[0] if envs else 'ENV'}/"
                "sampled/accuracy), or drop the environment for the mean over all: eval/sampled/accuracy"
            )
    if not any(o.split("=", 1)[0] == "hydra.sweeper.direction" for o in HydraConfig.get().overrides.hydra):
        _stop_search(
            f"'{run.objective}' is searched without a direction, and optuna's default minimises it; pass "
            "hydra.sweeper.direction=maximize (accuracies, rewards) or hydra.sweeper.direction=minimize (losses)"
        )


def _stop_search(problem: str) -> None:
    """A search whose objective is wrong would fail every trial alike: stop it at the first."""
    print(f"ptrain: config error: config key 'objective': {problem}", file=sys.stderr, flush=True)
    _exit(2)


class TrialFailed(RuntimeError):
    """A trial of a search that ended with one of ptrain's errors: raised (not returned) so
    that the sweeper records the trial as failed with this message and samples the next."""


def _fail(kind: str, e: BaseException, code: int) -> dict:
    """A mistake the user fixes in the command, config or data: one message, no traceback
    (HYDRA_FULL_ERROR=1 shows it, as for Hydra's own errors). In a sweep the job's result
    is the error, so the other jobs still run and the summary lists it. In a search, a trial
    whose settings are not a valid config stops the search (the space holds invalid points:
    narrow it), and any other failure fails that trial alone."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise e
    message = f"ptrain: {kind}: {e}"
    if _optuna_sweep():
        if kind == "config error":
            print(f"{message} (in a trial of the search, with overrides {_trial_overrides()}); every point of "
                  "the search space must be a valid config: narrow the space, then search again", file=sys.stderr,
                  flush=True)  # fmt: skip
            _exit(2)
        print(message, file=sys.stderr, flush=True)
        raise TrialFailed(message) from None
    print(message, file=sys.stderr, flush=True)
    if _multirun():
        return {"error": message}
    _exit(code)


def _trial_overrides() -> str:
    try:
        return " ".join(HydraConfig.get().overrides.task)
    except ValueError:
        return "?"


def _exit(code: int) -> None:
    if "jax" in sys.modules:  # a run that got as far as JAX may be one of several processes
        from ptrain.parallel.multihost import exit_now

        exit_now(code)  # not through jax.distributed's shutdown barrier, which would wait for the others
    sys.exit(code)


def _run(cfg: DictConfig) -> dict:
    # Orbax and Grain log every save and read at INFO through absl; keep the console for our lines.
    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra
        overrides = []
    try:
        run = to_run_config(cfg, overrides)
    except (ConfigError, FileNotFoundError) as e:
        return _fail("config error", e, 2)
    if _optuna_sweep():
        _check_search(run)
    if _multirun():
        run.run_dir = HydraConfig.get().runtime.output_dir  # one folder per sweep job
    try:
        for note in shadowed_overrides(run, list(HydraConfig.get().overrides.task)):
            print(f"ptrain: note: {note}", file=sys.stderr, flush=True)
    except ValueError:  # not under Hydra
        pass
    # Before any JAX backend starts; it adds nothing for MoE or bfloat16 models, which the
    # flag slows (ptrain/runtime.py, docs/performance.md).
    tune_xla_cpu(compute_dtype=run.model.dtype, moe=run.model.is_moe)
    from ptrain.api import run as run_api
    from ptrain.checkpoint import CheckpointError  # jax imports only after the config is known good
    from ptrain.sandbox import SandboxUnavailableError
    from ptrain.stages.loop import StageStopped, TrainingDiverged

    try:
        if run.continuous.enabled:
            from ptrain.continuous import run_config

            result = run_config(run)
            return {"rounds": len(result.rounds), "champion": result.champion, "stopped": result.stopped}
        return _job_result(run, run_api(run).last.summary)
    except (ConfigError, FileNotFoundError) as e:  # checks that need the devices or the files
        return _fail("config error", e, 2)
    except StageStopped as e:  # checkpointed and stopped: the rollout engine could not sample
        return _fail("stopped", e, 1)
    except (CheckpointError, TrainingDiverged, ValueError) as e:  # bad data, model folders, checkpoints
        return _fail("error", e, 1)
    except SandboxUnavailableError as e:  # an environment runs code and nothing here isolates it
        return _fail("error", e, 1)
    except Exception:
        import jax

        if jax.distributed.is_initialized() and jax.process_count() > 1 and not _multirun():
            traceback.print_exc()  # then out at once: see _exit
            _exit(1)
        raise


@hydra.main(config_path="pkg://ptrain.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Any:
    return _run(cfg)


def _print_scaled_job(argv: list[str]) -> bool:
    """`--cfg job` with `scale=NAME`: Hydra prints its composition before the recipe's scale
    is merged (ptrain/config/run.py apply_scale), so print the merged config instead. Values
    a launch must give stay `???`; nothing is validated, as with Hydra's own print."""
    flags = [i for i, a in enumerate(argv) if a in ("--cfg", "-c")]
    if not flags or argv[flags[0] + 1 : flags[0] + 2] != ["job"]:
        return False
    overrides = [a for i, a in enumerate(argv) if not a.startswith("-") and i - 1 not in flags]
    scale = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "scale"), BASE_SCALE)
    if scale == BASE_SCALE:
        return False
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ptrain.config.run import apply_scale

    try:
        with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        merged = apply_scale(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg), overrides)
    except (HydraException, OmegaConfBaseException) as e:
        # Hydra's first line names the key; its second, when a key is new, says to add "+"
        lines = str(e).strip().splitlines()
        raise ConfigError(" ".join(lines[:2] if len(lines) > 1 and "+" in lines[1] else lines[:1])) from None
    print(OmegaConf.to_yaml(merged), end="")
    return True


def main() -> None:
    # Hydra refuses a list-typed key given without brackets before _run sees it, with a
    # message that shows neither the type nor the form to pass: say both first.
    try:
        check_list_overrides(sys.argv[1:])
        for name in recipes_named(sys.argv[1:]):
            check_recipe(name)  # Hydra's own message is its whole search path
        if _print_scaled_job(sys.argv[1:]):
            return
    except ConfigError as e:
        _fail("config error", e, 2)
    _hydra_main()


class SweepSummary(Callback):
    """After a multirun, print one line per job: its overrides and final metrics."""

    def __init__(self) -> None:
        self.jobs: list[tuple[list[str], Any]] = []

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        try:
            value = job_return.return_value
        except TrialFailed as e:
            value = {"error": str(e)}
        except Exception as e:  # the job raised: keep the error for the summary
            value = {"error": f"{type(e).__name__}: {e}"}
        self.jobs.append((list(job_return.overrides or []), value))
        self._end_a_failing_search(getattr(job_return, "hydra_cfg", None))

    def _end_a_failing_search(self, hydra_cfg: Any) -> None:
        """Where optuna would end a search with a traceback, end it with the reasons: at the
        first failed trial under its default max_failure_rate of 0 (it re-raises that trial's
        error), or when every trial failed ("No trials are completed yet"). Only with Hydra's
        in-process launcher, where this callback sees every trial."""
        select = lambda key: OmegaConf.select(hydra_cfg, key) if hydra_cfg is not None else None  # noqa: E731
        trials = select("hydra.sweeper.n_trials")
        if not trials or "BasicLauncher" not in str(select("hydra.launcher._target_")):
            return  # not a search, or trials in other processes
        failed = [isinstance(v, dict) and "error" in v for _, v in self.jobs]
        if not failed[-1]:
            return
        if all(failed) and len(failed) >= trials:
            why = f"every one of the search's {trials} trials failed (above), so it has no best trial"
        elif not select("hydra.sweeper.max_failure_rate"):
            why = ("a trial failed (above), and optuna stops a search at its first failed trial "
                   "(hydra.sweeper.max_failure_rate=0.0, its default); pass hydra.sweeper.max_failure_rate=1.0 "
                   "to go on past failed trials")  # fmt: skip
        else:
            return
        self.report(select("hydra.sweep.dir"))
        print(f"ptrain: {why}; fix what the messages name, then search again", file=sys.stderr, flush=True)
        sys.exit(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.jobs:
            return
        failed = self.report(config.hydra.sweep.dir)
        if failed:
            print(f"ptrain: {failed} of {len(self.jobs)} sweep jobs failed (above)", file=sys.stderr, flush=True)
            sys.exit(1)

    def report(self, sweep_dir: str) -> int:
        """Print the table and write sweep_summary.jsonl; the number of failed jobs."""
        table = os.path.join(sweep_dir, "sweep_summary.jsonl")
        lines = [f"\nSweep summary ({len(self.jobs)} jobs, folders under {sweep_dir}; {table}):"]
        failed = 0
        os.makedirs(sweep_dir, exist_ok=True)
        with open(table, "w") as f:
            for i, (overrides, value) in enumerate(self.jobs):
                shown = value
                if isinstance(value, dict):
                    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in value.items()}
                    failed += "error" in value
                lines.append(f"  job{i}  {' '.join(overrides)}  ->  {json.dumps(shown, default=str)}")
                f.write(json.dumps({"job": i, "overrides": overrides, "result": value}, default=str) + "\n")
        print("\n".join(lines), flush=True)
        return failed
