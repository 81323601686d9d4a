"""The continuous loop: environments keep arriving, each round trains a challenger from the
champion, and only a challenger that the gate passes becomes the champion.

    python -m ptrain recipe=continuous continuous.inbox=INBOX [run_dir=R] [overrides]

1. The recipe's stages before its GRPO stage make the base (or `model.hf_path` is it). Round
   0 evaluates the base on the recipe's environments: the first champion.
2. The loop watches INBOX (ptrain/continuous/inbox.py). A round starts when environments
   arrive, `continuous.every_s` after the last round, or when a live pass rate drops
   (`continuous.trigger`). Each new environment is built once before it is taken in (a file
   whose environment cannot be built is rejected like one that does not validate).
3. A round (R/rounds/<k>/, an ordinary run folder): the recipe's GRPO stage from the champion
   over every environment taken in so far, the new ones sharing 1 - `replay` of the tasks,
   with a KL anchor to the champion (`kl_anchor`); then an eval stage of the challenger on
   every environment's frozen held-out tasks, and one of the champion on environments it has
   not been scored on yet (its earlier scores are reused: same tasks, same sampling seeds).
4. The gate (ptrain/continuous/gate.py) compares them per environment and reads the
   tripwires; the decision, the evaluation table and the round's cost go to decision.json,
   then the champion pointer moves (if promoted) and the weights are pushed to
   `continuous.serve_urls`. The leaderboard and its figure are rebuilt from the decision files.

Every step is resumable: the state (R/continuous.json) records the round under way with its
plan, the round's stages resume from their checkpoints, and a decision already written is
applied again (pointer, push, leaderboard are idempotent). Ctrl-C or SIGTERM stops it; the
same command resumes. Launching again with nothing new trains nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from ptrain.checkpoint import write_json_atomic
from ptrain.config import ConfigError, RunConfig, StageConfig
from ptrain.config.continuous import ContinuousConfig
from ptrain.config.env import EnvConfig
from ptrain.continuous import gate, inbox, ledger

ROUND_STAGES = ("grpo", "eval_challenger", "eval_champion")


@dataclasses.dataclass
class LoopResult:
    """What a launch of the loop did."""

    run_dir: str
    rounds: list[dict]
    """The decision of each round this launch decided, in order."""
    champion: str
    """The champion's Hugging Face folder after the launch."""
    stopped: str
    """Why the launch ended: max_rounds, idle, or signal."""


class _Stop(Exception):
    """SIGTERM (or SIGINT) arrived: leave the loop at the next safe point."""


def run_loop(run: RunConfig, *, on_round: Callable[[dict], None] | None = None) -> LoopResult:
    """Run the continuous loop of `run` (continuous.enabled) in this process."""
    c = run.continuous
    if not c.enabled:
        raise ConfigError("config key 'continuous.enabled': the loop runs only for a continuous recipe; pass true")
    os.makedirs(run.run_dir, exist_ok=True)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM,)}
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        return ContinuousLoop(run, on_round).run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


class ContinuousLoop:
    """The loop over one run folder: its state, what starts a round, and the rounds."""

    def __init__(self, run: RunConfig, on_round: Callable[[dict], None] | None):
        self.run_cfg = run
        self.c: ContinuousConfig = run.continuous
        self.dir = run.run_dir
        self.state = ledger.load_state(self.dir)
        self.on_round = on_round
        self.decided: list[dict] = []
        self._tokenizer = None

    # ------------------------------------------------------------------ the loop

    def run(self) -> LoopResult:
        stopped = "signal"
        try:
            self._base()
            from omegaconf import OmegaConf

            # This launch's settings (serve_urls, prices, ...) are the run's from now on: rollback
            # and push read them here (after the base stages, which write their own).
            OmegaConf.save(OmegaConf.structured(self.run_cfg), os.path.join(self.dir, "config.yaml"))
            done = 0
            while True:
                plan = self.state["current"] or self._next_plan()
                if plan is None:
                    if self.c.until_idle:
                        print(f"ptrain: continuous: nothing new in {self.c.inbox}; stopping (until_idle)", flush=True)
                        stopped = "idle"
                        break
                    time.sleep(self.c.poll_s)
                    continue
                self._round(plan)
                done += plan["round"] > 0  # round 0 trains nothing: max_rounds counts training rounds
                if self.c.max_rounds is not None and done >= self.c.max_rounds:
                    stopped = "max_rounds"
                    break
        except (KeyboardInterrupt, _Stop):
            print("ptrain: continuous: stopped; launch the same command again to resume", flush=True)
        return LoopResult(self.dir, self.decided, self.state["champion"], stopped)

    def _save(self) -> None:
        ledger.save_state(self.dir, self.state)

    # ------------------------------------------------------------------ round 0

    def _base(self) -> None:
        """Make the base, take in the recipe's environments, decide round 0 (once)."""
        if self.state["champion"] is not None or self.state["current"] is not None:
            return  # made in an earlier launch (a round 0 under way resumes in the loop)
        run = self.run_cfg
        base_stages = run.stages[:-1]
        if base_stages:
            from ptrain.pipeline import run_stages

            base_run = dataclasses.replace(run, stages=base_stages, continuous=ContinuousConfig())
            result = run_stages(base_run)
            export = next((r.export for r in reversed(list(result.stages.values())) if r.export), None)
        else:
            export = run.model.hf_path
        if export is None:
            raise ConfigError(
                "config key 'stages': continuous post-training starts from a model folder: give the recipe a stage "
                "before its GRPO stage (e.g. SFT), or pass model=hf model.hf_path=DIR"
            )
        if not self.state["envs"]:
            for name, env in sorted(run.envs.items()):
                spec = _pinned(dataclasses.asdict(env), run.train.seed)
                self.state["envs"][name] = {"spec": spec, "sha256": inbox.spec_hash(spec), "round": 0, "file": None}
        if self.state["current"] is None:
            self.state["current"] = self._plan(0, export, new=sorted(self.state["envs"]), trigger="start")
            self._save()

    # ------------------------------------------------------------------ what starts a round

    def _next_plan(self) -> dict | None:
        arrivals = self._take_in()
        k = int(self.state["next_round"])
        champion = self.state["champion"]
        if arrivals:
            return self._commit_plan(self._plan(k, champion, new=arrivals, trigger="arrival: " + ", ".join(arrivals)))
        last = self.state["last_round_end"]
        if self.c.every_s is not None and last is not None and time.time() - last >= self.c.every_s:
            return self._commit_plan(self._plan(k, champion, new=[], trigger=f"timer: every {self.c.every_s:g} s"))
        dropped = self._live_drop()
        if dropped:
            return self._commit_plan(self._plan(k, champion, new=[], trigger=dropped))
        return None

    def _commit_plan(self, plan: dict) -> dict:
        self.state["current"] = plan
        self._save()
        return plan

    def _take_in(self) -> list[str]:
        """Validate and build the inbox's new environments; register the good ones (state and
        R/envs/<name>.yaml), reject the rest. Returns the names taken in."""
        known = {n: e["sha256"] for n, e in self.state["envs"].items()}
        new, rejected = inbox.scan(self.c.inbox, known)
        for path, reason in rejected:
            print(f"ptrain: continuous: rejected {path}: {reason}", flush=True)
        taken = []
        for arrival in new:
            spec = _pinned(arrival.spec, self.run_cfg.train.seed)
            problem = self._build_problem(spec)
            if problem:
                moved = inbox.reject(arrival.path, problem)
                print(f"ptrain: continuous: rejected {moved}: {problem}", flush=True)
                continue
            frozen = os.path.join(self.dir, "envs", f"{arrival.name}.yaml")
            os.makedirs(os.path.dirname(frozen), exist_ok=True)
            with open(frozen, "w") as f:
                f.write(json.dumps(spec, indent=2, default=str) + "\n")  # JSON is YAML
            self.state["envs"][arrival.name] = {
                "spec": spec,
                "sha256": arrival.sha256,
                "round": int(self.state["next_round"]),
                "file": arrival.path,
            }
            taken.append(arrival.name)
            print(f"ptrain: continuous: took in environment '{arrival.name}' from {arrival.path}", flush=True)
        return taken

    def _build_problem(self, spec: Mapping[str, Any]) -> str | None:
        """Why the environment of `spec` cannot run here (None: it builds and has held-out tasks)."""
        from ptrain.envs.mixture import env_task_seed
        from ptrain.envs.registry import close_envs, make_env

        try:
            cfg = inbox.env_config(spec)
            env = make_env(cfg, tokenizer=self._tokenizer_of(self.state["champion"]), sandbox=self.run_cfg.sandbox)
        except Exception as e:  # whatever a kind raises for a bad file, path or server
            return f"the environment could not be built: {type(e).__name__}: {e}"
        try:
            tasks = list(env.tasks("eval", seed=env_task_seed(env, 0)))
            if not tasks:
                return f"envs.{cfg.env_name}.n_eval: the environment has no held-out tasks; the gate needs some (n_eval >= 1)"
        except Exception as e:
            return f"the environment's tasks could not be made: {type(e).__name__}: {e}"
        finally:
            close_envs({cfg.env_name: env})
        return None

    def _tokenizer_of(self, model_dir: str):
        if self._tokenizer is None:
            from ptrain.stages.setup import tokenizer_for

            self._tokenizer = tokenizer_for(self.run_cfg, model_dir)
        return self._tokenizer

    def _live_drop(self) -> str | None:
        """The live trigger: an environment whose pass rate over its last `window` new lines
        fell `drop` below the champion's held-out score."""
        t = self.c.trigger
        if t.path is None or not os.path.isfile(t.path):
            return None
        rows = ledger.read_jsonl(t.path)
        held = {env: sum(s.values()) / max(len(s), 1) for env, s in self._champion_scores().items()}
        reason = gate.live_drop(rows[int(self.state.get("trigger_lines", 0)) :], held, window=t.window, drop=t.drop)
        if reason is not None:
            self.state["trigger_lines"] = len(rows)  # the next look starts after these lines
        return reason

    # ------------------------------------------------------------------ one round

    def _plan(self, k: int, champion: str, *, new: list[str], trigger: str) -> dict:
        names = sorted(self.state["envs"])
        return {
            "round": k,
            "champion": os.path.abspath(champion),
            "champion_round": self.state["champion_round"],
            "envs": names,
            "new": sorted(new),
            "targets": sorted(new) or names,
            "trigger": trigger,
            "seed": self.run_cfg.seed + k,
            "started": time.time(),
        }

    def _round(self, plan: dict) -> None:
        k = plan["round"]
        rdir = ledger.round_dir(self.dir, k)
        os.makedirs(rdir, exist_ok=True)
        decision_path = os.path.join(rdir, "decision.json")
        if not os.path.isfile(decision_path):
            cfg = self._round_config(plan, rdir)
            self._write_manifest(plan, rdir)
            print(f"ptrain: continuous: round {k} ({plan['trigger']}) from {plan['champion']} -> {rdir}", flush=True)
            from ptrain.pipeline import run_stages

            run_stages(cfg)
            write_json_atomic(decision_path, self._decide(plan, rdir))
        self._apply(plan, decision_path)

    def _round_config(self, plan: dict, rdir: str) -> RunConfig:
        """The round as an ordinary run: the recipe's GRPO stage from the champion and the eval
        stages, over every environment taken in so far."""
        from omegaconf import OmegaConf

        from ptrain.config import to_run_config

        run = self.run_cfg
        k = plan["round"]
        saved = os.path.join(rdir, "config.yaml")
        if os.path.isfile(saved):  # a round under way resumes as it was planned, whatever this launch's overrides
            try:
                return to_run_config(OmegaConf.load(saved))
            except ConfigError as e:
                raise ConfigError(f"round {k}: its saved config {saved} no longer validates: {e}") from None
        envs = {n: inbox.env_config(self.state["envs"][n]["spec"]) for n in plan["envs"]}
        envs = _replay_weights(envs, set(plan["new"]), self.c.replay) if k > 0 else envs
        eval_seed = {"seed": int(run.train.seed)}  # every eval stage samples with the same seeds
        missing = [n for n in plan["envs"] if n not in self._champion_scores()]
        if k == 0:
            stages = [StageConfig(name="eval_champion", kind="eval", init=plan["champion"], train=eval_seed,
                                  algo=self._calibration(plan["envs"]), envs=plan["envs"])]  # fmt: skip
        else:
            template = run.stages[-1]
            algo = _deep_merge(template.algo, {"grpo": {"kl_coef": self.c.kl_anchor}})
            train = _deep_merge(template.train, {"eval_every": 0, "seed": None})
            grpo = dataclasses.replace(template, name="grpo", init=plan["champion"], algo=algo, train=train,
                                       envs=plan["envs"])  # fmt: skip
            stages = [grpo, StageConfig(name="eval_challenger", kind="eval", train=eval_seed,
                                        algo=self._calibration(plan["envs"]), envs=plan["envs"])]  # fmt: skip
            if missing:
                stages.append(StageConfig(name="eval_champion", kind="eval", init=plan["champion"], train=eval_seed,
                                          algo=self._calibration(missing), envs=missing))  # fmt: skip
        cfg = dataclasses.replace(run, run_dir=rdir, envs=envs, stages=stages, seed=plan["seed"],
                                  continuous=ContinuousConfig(), scale="tiny", scales={})  # fmt: skip
        cfg.train = dataclasses.replace(cfg.train, seed=None)  # the round's own stream (run seed + k)
        try:
            return to_run_config(OmegaConf.structured(cfg))
        except ConfigError as e:
            raise ConfigError(f"round {k}: {e}") from None

    def _calibration(self, names: list[str]) -> dict:
        """The eval stage's algo group: the judge's calibration set where the stage scores a
        judge environment (a judge may arrive in any round; stages without one skip it)."""
        judged = any(self.state["envs"][n]["spec"].get("kind") == "judge" for n in names)
        return {"eval": {"judge_calibration": self.c.judge_calibration}} if self.c.judge_calibration and judged else {}

    def _write_manifest(self, plan: dict, rdir: str) -> None:
        path = os.path.join(rdir, "manifest.json")
        if os.path.isfile(path):
            return
        manifest = {
            "round": plan["round"],
            "parent_champion": plan["champion"],
            "parent_round": plan["champion_round"],
            "trigger": plan["trigger"],
            "seed": plan["seed"],
            "envs": {n: {k: self.state["envs"][n][k] for k in ("spec", "sha256", "round")} for n in plan["envs"]},
            "new_envs": plan["new"],
            "targets": plan["targets"],
            "config": os.path.join(rdir, "config.yaml"),
            "rerun": f"python -m ptrain.continuous rerun {self.dir} {plan['round']} OUT_DIR",
        }
        write_json_atomic(path, manifest)

    def _champion_scores(self) -> dict[str, dict[str, float]]:
        """The current champion's per-task held-out scores by environment (from the eval stages
        that scored it)."""
        out: dict[str, dict[str, float]] = {}
        for sdir in self.state["champion_evals"]:
            out.update(_scores(sdir, self._decoding()))
        return out

    def _champion_metrics(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for sdir in self.state["champion_evals"]:
            out.update(_env_metrics(sdir))
        return out

    def _judge_agreements(self, stages: str) -> dict[str, float]:
        """The judge's calibration agreement when the champion was scored (in an earlier round,
        or in this one when the judge has just arrived) and now, and the drop ({} without a
        judge in the loop, or before both were measured)."""
        key = "eval/judge_calibration/agreement"
        done = [
            os.path.join(d, "DONE.json") for d in (*self.state["champion_evals"], os.path.join(stages, "eval_champion"))
        ]
        before = next((a for a in (_read(p).get(key) for p in done if os.path.isfile(p)) if a is not None), None)
        now_path = os.path.join(stages, "eval_challenger", "DONE.json")
        now = _read(now_path).get(key) if os.path.isfile(now_path) else None
        if before is None or now is None:
            return {}
        return {"champion": float(before), "challenger": float(now), "drop": float(before) - float(now)}

    def _decoding(self) -> str:
        return "sampled" if self.run_cfg.algo.eval.samples > 0 else "greedy"

    def _decide(self, plan: dict, rdir: str) -> dict:
        import jax

        from ptrain.config.cost import cpu_cores

        k, c, run = plan["round"], self.c, self.run_cfg
        stages = os.path.join(rdir, "stages")
        hour_usd = run.cost.machine_hour_usd(jax.default_backend(), jax.device_count(), cpu_cores())
        eval_dirs = [os.path.join(stages, s) for s in ("eval_challenger", "eval_champion")]
        eval_dirs = [d for d in eval_dirs if os.path.isfile(os.path.join(d, "DONE.json"))]
        evals = [_read(os.path.join(d, "DONE.json")) for d in eval_dirs]
        rl = ledger.stage_seconds(os.path.join(stages, "grpo", "metrics.jsonl"))
        ledger_row = ledger.round_cost(run.cost, hour_usd, rl, evals)
        base = {
            "round": k,
            "started": plan["started"],
            "finished": time.time(),
            "trigger": plan["trigger"],
            "targets": plan["targets"],
            "new_envs": plan["new"],
            "parent": plan["champion"],
            "cost_usd": ledger_row["cost_usd"],
            "tokens": ledger_row["tokens"],
            "machine_hour_usd": hour_usd,
        }
        if k == 0:
            scores = _scores(os.path.join(stages, "eval_champion"), self._decoding())
            envs = {n: {"champion": _mean(s), "challenger": _mean(s), "delta": 0.0, "ci_low": 0.0, "ci_high": 0.0,
                        "n": len(s), "champion_after": _mean(s)} for n, s in scores.items()}  # fmt: skip
            return {**base, "envs": envs, "tripwires": [], "decision": "promoted",
                    "reasons": ["round 0: the base is the first champion"], "champion": plan["champion"],
                    "champion_evals": [os.path.join(stages, "eval_champion")], "reward_gain_per_usd": 0.0}  # fmt: skip
        old_scores = {**self._champion_scores(), **_scores(os.path.join(stages, "eval_champion"), self._decoding())}
        new_scores = _scores(os.path.join(stages, "eval_challenger"), self._decoding())
        comparisons = [
            gate.paired_bootstrap(
                old_scores[n],
                new_scores[n],
                env=n,
                confidence=c.confidence,
                samples=c.bootstrap_samples,
                seed=plan["seed"],
            )  # fmt: skip
            for n in plan["envs"]
        ]
        old_metrics = {**self._champion_metrics(), **_env_metrics(os.path.join(stages, "eval_champion"))}
        new_metrics = _env_metrics(os.path.join(stages, "eval_challenger"))
        kl = _late_kl(os.path.join(stages, "grpo", "metrics.jsonl")) if c.kl_anchor > 0 else None
        readings = gate.tripwires(old_metrics, new_metrics, c.tripwires, kl=kl)
        judge = self._judge_agreements(stages)
        decision, reasons = gate.decide(comparisons, plan["targets"], readings, margin=c.margin, improve=c.improve,
                                        judge_drop=judge.get("drop"), judge_limit=c.judge_drop)  # fmt: skip
        promoted = decision == "promoted"
        gain = sum(x.delta for x in comparisons) / len(comparisons)
        total = ledger_row["cost_usd"]["total"]
        envs = {x.env: {**x.as_dict(), "champion_after": x.challenger if promoted else x.champion} for x in comparisons}
        champion_evals = [os.path.join(stages, "eval_challenger")] if promoted else self.state["champion_evals"] + (
            [os.path.join(stages, "eval_champion")] if os.path.isdir(os.path.join(stages, "eval_champion")) else [])  # fmt: skip
        return {
            **base,
            "envs": envs,
            "tripwires": [dataclasses.asdict(t) for t in readings],
            "judge": judge,
            "decision": decision,
            "reasons": reasons,
            "champion": os.path.join(stages, "grpo", "export") if promoted else plan["champion"],
            "champion_evals": champion_evals,
            "reward_gain_per_usd": gain / total if promoted and total > 0 else 0.0,
        }

    def _apply(self, plan: dict, decision_path: str) -> None:
        """Make a written decision current: champion pointer, push, state, leaderboard (each
        idempotent, so a kill anywhere in here is mended by the next launch)."""
        k = plan["round"]
        decision = _read(decision_path)
        ledger.set_champion(self.dir, decision["champion"])
        if decision["decision"] == "promoted" and self.c.serve_urls:
            decision["push"] = push_weights(self.c.serve_urls, decision["champion"], f"round-{k}")
            write_json_atomic(decision_path, decision)
        self.state.update(
            champion=decision["champion"],
            champion_round=k if decision["decision"] == "promoted" else self.state["champion_round"],
            champion_evals=decision["champion_evals"],
            current=None,
            next_round=k + 1,
            last_round_end=decision["finished"],
        )
        self._save()
        rows = ledger.write_leaderboard(self.dir)
        manifest_path = os.path.join(ledger.round_dir(self.dir, k), "manifest.json")
        if os.path.isfile(manifest_path):
            manifest = _read(manifest_path)
            manifest.update(evaluation=decision["envs"], tripwires=decision["tripwires"], cost_usd=decision["cost_usd"],
                            tokens=decision["tokens"], decision=decision["decision"], reasons=decision["reasons"])  # fmt: skip
            write_json_atomic(manifest_path, manifest)
        try:
            ledger.plot_leaderboard(self.dir)
        except ImportError:  # matplotlib is a dependency; a stripped install still trains
            pass
        row = rows[-1] if rows else decision
        self.decided.append(row)
        print(
            f"ptrain: continuous: round {k} {decision['decision']}"
            + (f" ({'; '.join(decision['reasons'])})" if decision["reasons"] else "")
            + f"; champion {decision['champion']}; cost ${decision['cost_usd']['total']:.4f}",
            flush=True,
        )
        if self.on_round is not None:
            self.on_round(row)


# ------------------------------------------------------------------------------ helpers


def push_weights(urls: list[str], folder: str, version: str) -> list[dict]:
    """A versioned, verified push of `folder` to every server (/update_weights_from_disk, then
    /model_info must report `version`). Returns each server's outcome; a failure is reported,
    not raised: the champion pointer is the record, a server that missed it can be pushed again
    (`python -m ptrain.continuous push R`)."""
    import asyncio

    import httpx

    from ptrain.rollout.weight_sync import push_to_workers

    async def go():
        async with httpx.AsyncClient() as client:
            return await push_to_workers(client, urls, folder, version, mode="drain", timeout_s=300.0)

    outcomes = asyncio.run(go())
    for o in outcomes:
        if not o.ok:
            print(f"ptrain: continuous: push of {version} to {o.url} failed: {o.error}", flush=True)
    return [{"url": o.url, "ok": o.ok, "version": o.version_seen, "error": o.error, "seconds": o.seconds}
            for o in outcomes]  # fmt: skip


def _pinned(spec: Mapping[str, Any], train_seed: int | None) -> dict[str, Any]:
    """The spec with its task seed fixed (derived as the stages derive it, from the base run's
    train seed and the name), so that every round builds the same held-out tasks."""
    from ptrain.envs.mixture import env_task_seed

    out = dict(spec)
    if out.get("seed") is None:
        out["seed"] = env_task_seed(_Named(out["name"]), int(train_seed or 0))
    return out


@dataclasses.dataclass
class _Named:
    name: str
    seed: int | None = None


def _replay_weights(envs: dict[str, EnvConfig], new: set[str], replay: float) -> dict[str, EnvConfig]:
    """Weights giving the new environments 1 - replay of the tasks and the old ones replay,
    each group split by the environments' own weights."""
    old = set(envs) - new
    if not new or not old:
        return envs
    out = {}
    for group, share in ((new, 1.0 - replay), (old, replay)):
        if share <= 0:
            share = 1e-6  # an environment left in the mix needs a weight > 0; replay=0 leaves it almost out
        total = sum(envs[n].weight for n in group)
        for n in group:
            out[n] = dataclasses.replace(envs[n], weight=share * envs[n].weight / total)
    return out


def _deep_merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(a))
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _scores(stage_dir: str, decoding: str) -> dict[str, dict[str, float]]:
    path = os.path.join(stage_dir, "scores.json")
    if not os.path.isfile(path):
        return {}
    return _read(path).get(decoding, {})


def _env_metrics(stage_dir: str) -> dict[str, dict[str, float]]:
    """Per environment, the greedy held-out metrics of an eval stage's DONE.json."""
    path = os.path.join(stage_dir, "DONE.json")
    if not os.path.isfile(path):
        return {}
    out: dict[str, dict[str, float]] = {}
    for key, value in _read(path).items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and isinstance(value, int | float):
            out.setdefault(parts[1], {})[parts[2]] = float(value)
    return out


def _late_kl(metrics_path: str) -> float | None:
    """Mean KL to the reference (the champion) over the last quarter of an RL stage's steps."""
    kls = [float(r["train/kl_loss"]) for r in ledger.read_jsonl(metrics_path) if "train/kl_loss" in r]
    if not kls:
        return None
    tail = kls[-max(1, len(kls) // 4) :]
    return sum(tail) / len(tail)


def _mean(scores: Mapping[str, float]) -> float:
    return sum(scores.values()) / max(len(scores), 1)


# ------------------------------------------------------------------------------ rollback, rerun


def rollback(run_dir: str, *, push: bool = True, urls: list[str] | None = None) -> str:
    """The champion before the current one becomes current again (pointer, state, a line in
    R/rollbacks.jsonl) and is pushed to `urls` (default: continuous.serve_urls of the run's
    last launch). Returns its folder."""
    state = ledger.load_state(run_dir)
    if state["champion"] is None:
        raise ValueError(f"{run_dir}: no continuous run here (no {ledger.STATE} with a champion)")
    if state["current"] is not None:
        raise ValueError(
            f"{run_dir}: round {state['current']['round']} is under way from {state['current']['champion']}; let "
            "it finish (launch the loop again), then roll back"
        )
    rounds = {d["round"]: d for d in ledger.decisions(run_dir)}
    made = rounds.get(state["champion_round"])
    if made is None or state["champion_round"] == 0:
        raise ValueError(f"{run_dir}: the champion is the base (round 0); there is no earlier champion to roll back to")
    parent = made["parent"]
    parent_round = next((d["round"] for d in rounds.values() if d["decision"] == "promoted" and d["champion"] == parent),
                        0)  # fmt: skip
    state.update(champion=parent, champion_round=parent_round, champion_evals=rounds[parent_round]["champion_evals"])
    ledger.save_state(run_dir, state)
    ledger.set_champion(run_dir, parent)
    record: dict[str, Any] = {"from": made["champion"], "from_round": made["round"], "to": parent,
                              "to_round": parent_round}  # fmt: skip
    urls = serve_urls(run_dir) if urls is None else urls
    if push and urls:
        n = len(ledger.read_jsonl(os.path.join(run_dir, ledger.ROLLBACKS))) + 1
        record["push"] = push_weights(urls, parent, f"rollback-{n}-round-{parent_round}")
    ledger.log_rollback(run_dir, record)
    print(f"ptrain: continuous: rolled back to round {parent_round}'s champion {parent}", flush=True)
    return parent


def serve_urls(run_dir: str) -> list[str]:
    from omegaconf import OmegaConf

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return []
    return list(OmegaConf.load(path).get("continuous", {}).get("serve_urls", []) or [])


def rerun(run_dir: str, round_index: int, out_dir: str) -> str:
    """Run a round's stages again from its saved config.yaml into `out_dir`; returns out_dir."""
    from omegaconf import OmegaConf

    from ptrain.config import to_run_config
    from ptrain.pipeline import run_stages

    path = os.path.join(ledger.round_dir(run_dir, round_index), "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such round config; `ls {run_dir}/rounds` lists the rounds")
    cfg = to_run_config(OmegaConf.load(path))
    run_stages(dataclasses.replace(cfg, run_dir=out_dir))
    return out_dir
