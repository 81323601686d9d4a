"""The GRPO stage (and its relatives: Dr. GRPO, DAPO, GSPO, CISPO, RLOO): RL with verifiable rewards.

One rollout batch = `prompts_per_step` tasks drawn from the stage's environments (mixed by
weight) x `group_size` samples each, sampled by the rollout engine, scored by the
environments. Then:

  rewards -> (overlong shaping) -> group-relative advantages -> policy_batch rows
          -> epochs x mini_batches optimizer steps of the pure policy objective
             (ptrain.train.policy_objective; the same jitted step as SFT and DPO)
          -> the new weights to the engine (a weight version per optimizer step)

`train.steps` counts optimizer steps; a rollout batch lasts epochs x mini_batches of them.

Modes (`algo.grpo.mode`):
  sync   generate, then train: every sample comes from the weights being trained.
  async  the collector keeps generating the next batches while this one trains (AReaL,
         PipelineRL); a sample more than max_staleness versions older than the weights it
         would train is dropped. With partial_rollouts the engine swaps weights in place
         mid-sample; the loss's decoupled importance weight (engine vs proximal log-probs,
         ptrain/train/policy_objective.py) keeps the clip unbiased either way.

The driver stays thin: the rollout side is `RolloutBatches` (the loop's Batches protocol:
its after-step hook pushes weights), the update side `Algorithm` (objective, denominator).

As several JAX processes (sampling from a fleet): process 0 collects and scores each rollout
batch (in async mode its collector alone runs ahead) and broadcasts its rows; every process
trains on them, and writes its share of each weight version, which process 0 then pushes
(ptrain.rollout.fleet_push; LoRA adapters are gathered to every host and written by process 0).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from typing import Any

import jax
import numpy as np

from ptrain.config import RunConfig
from ptrain.config.cost import cpu_cores
from ptrain.config.grpo import staleness_bound
from ptrain.data.buckets import bucket_length, to_bucket
from ptrain.envs.base import is_correct
from ptrain.parallel import batch_devices
from ptrain.parallel.multihost import broadcast_from_primary, is_primary, on_primary
from ptrain.rollout.protocol import EngineUnavailable, SamplingParams
from ptrain.stages.grpo.batch import measured_advantages, policy_batch
from ptrain.stages.grpo.collector import Group, RolloutCollector
from ptrain.stages.loop import Algorithm, train_evaluate_export
from ptrain.stages.setup import Stage, setup_stage, tokenizer_for
from ptrain.train.policy_objective import (
    finalize_policy_metrics,
    make_policy_objective,
    policy_denominator,
    policy_logprobs,
)
from ptrain.train.state import TrainState


def shaped_rewards(groups: list[Group], cfg) -> np.ndarray:
    """[n_groups, G] rewards after DAPO's soft overlong penalty: in the last overlong_buffer
    tokens before max_new_tokens the reward falls linearly by up to overlong_penalty."""
    r = np.array([[t.reward for t in g.trajectories] for g in groups], np.float32)
    if cfg.overlong_buffer > 0:
        limit, buf = cfg.max_new_tokens, cfg.overlong_buffer
        for i, g in enumerate(groups):
            for j, t in enumerate(g.trajectories):
                over = t.tokens.output - (limit - buf)
                if over > 0:
                    r[i, j] -= cfg.overlong_penalty * min(over / buf, 1.0)
    return r


def groups_ahead(cfg) -> int:
    """Groups the collector keeps started or finished but not yet taken: max_staleness
    rollout batches in async mode (at least one), none in sync mode.

    A group is tagged with the weight version it started on, and the collector keeps this
    pipeline full, so a group spends about ahead / prompts_per_step optimizer steps in it
    before it is taken. max_staleness batches ahead therefore arrive within the bound; one
    batch more ages every group one version past it, and about one group in two would be
    dropped and sampled again (measured: 8 of 16 per step, tools/bench_grpo.py)."""
    return max(staleness_bound(cfg), 1) * cfg.prompts_per_step if cfg.mode == "async" else 0


class RolloutBatches:
    """The loop's batches for an RL stage: rollout batches split into optimizer steps."""

    def __init__(self, stage: Stage, collector: RolloutCollector, engine, *, costs, hour_usd: float):
        self.stage = stage
        self.cfg = stage.run.algo.grpo
        self.collector = collector
        self.engine = engine
        self.costs = costs
        self.hour_usd = hour_usd
        """What one wall-clock hour of the machine costs (cost.machine_hour_usd)."""
        self.rows = self.cfg.prompts_per_step * self.cfg.group_size
        # What a packed batch's row count must divide by: every mini-batch splits into grad_accum
        # micro-batches over the data-parallel devices.
        self.row_multiple = self.cfg.mini_batches * stage.run.train.grad_accum * batch_devices(stage.placed.mesh)
        self.queue: deque[dict] = deque()
        self._t_batch = self._t_last_take = time.time()
        self.step_metrics: deque[dict] = deque()
        self.next_metrics: dict = {}
        self.version = 0
        self.state: TrainState | None = None
        self.cost_usd = 0.0
        self.reward_start: float | None = None
        t = stage.run.train
        self._old_logp = jax.jit(
            lambda params, model_state, batch: policy_logprobs(
                stage.placed.model_def, params, model_state, batch, temperature=self.cfg.temperature,
                vocab_chunk=t.vocab_chunk,
            )
        )  # fmt: skip
        self.seed = collector.seed

    # ------------------------------------------------------------------ loop protocol

    def begin(self, step: int, state: TrainState) -> None:
        """Before the first step (fresh or resumed): bring the engine to these weights."""
        self.state, self.version = state, step
        self._push(state, step, "abort")
        self.collector.set_version(step)
        if self.cfg.mode == "async" and is_primary():  # the other processes get each batch from it
            self.collector.start()

    def _push(self, state: TrainState, step: int, mode: str) -> None:
        """Bring the engine to `state`'s policy: its adapters alone when the engine serves them
        (adapter-sized: the in-process engine's policy slot, or the fleet's versioned adapter),
        else the whole (merged) weights."""
        version = str(step)
        error = None
        try:
            if getattr(self.engine, "default_lora", None) == POLICY_ADAPTER:  # an engine serving the adapters
                self.engine.update_lora(POLICY_ADAPTER, state.params, state.lora, weight_version=version, mode=mode)
            else:
                self.engine.update_weights(
                    state.merged_params(), state.model_state or None, weight_version=version, mode=mode
                )
        except EngineUnavailable as e:  # a fleet that refused or lost the version: process 0 alone sees it
            if jax.process_count() == 1:
                raise
            error = e
        if jax.process_count() > 1:
            # Every process stops at this step, or none: the others would wait for a batch.
            message = broadcast_from_primary(None if error is None else str(error))
            if error is not None:
                raise error
            if message is not None:
                raise EngineUnavailable(message)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.queue:
            self._rollout()
        self._t_batch = time.time()
        return self.queue.popleft()

    def after_step(self, step: int, state: TrainState, metrics: dict) -> None:
        self.state, self.version = state, step
        # The engine needs these weights next, so waiting for the step here costs nothing
        # and splits the time honestly: training up to now, sampling after.
        jax.block_until_ready(state.params)
        self.step_metrics.append(dict(self.next_metrics, **{"time/train_s": time.time() - self._t_batch}))
        self.next_metrics = {}
        t0 = time.time()
        if self.cfg.mode == "async":
            mode = "in_place" if self.cfg.partial_rollouts else "drain"
        else:
            mode = "drain"
            if self.queue:  # more optimizer steps on this rollout batch before the next sampling
                return
        self._push(state, step, mode)
        self.collector.set_version(step)
        self.step_metrics[-1] = dict(self.step_metrics[-1], **{"time/weight_sync_s": time.time() - t0})

    def finalize(self, m: dict) -> dict:
        """Host metrics of the oldest step not yet logged (the loop drains steps in order)."""
        host = finalize_policy_metrics(m, self.stage.run.train.grad_accum)
        host.update(self.step_metrics.popleft() if self.step_metrics else {})
        return host

    def get_state(self) -> dict[str, Any]:
        return {"collector": self.collector.get_state(), "version": self.version, "cost_usd": self.cost_usd,
                "group_size": self.cfg.group_size}  # fmt: skip

    def set_state(self, state: dict[str, Any]) -> None:
        self._check_resumable(state)
        try:
            self.collector.set_state(state["collector"])
            self.version = int(state.get("version", 0))
            self.cost_usd = float(state.get("cost_usd", 0.0))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            from ptrain.checkpoint import CheckpointError

            raise CheckpointError(
                f"the checkpoint in {os.path.join(self.stage.dir, 'checkpoints')} that the stage resumes from holds "
                f"no GRPO rollout state ({type(e).__name__}: {e}): a stage of another kind wrote it under this "
                "name, or it is damaged; rename the stage, or delete that folder to restart it"
            ) from None

    def _check_resumable(self, state: Any) -> None:
        """A changed algo.grpo.group_size is refused when the checkpoint holds finished groups
        (async mode): they have the old number of samples, and a rollout batch of them would
        not be prompts_per_step x group_size rows (a larger group_size silently trains on a
        padded batch of the old groups, a smaller one fails in policy_batch). Tasks still
        running restart with the new group_size, and a changed prompts_per_step only changes
        how many groups a batch takes, so those resume as they are."""
        try:
            ready = state["collector"].get("ready") or []
            sizes = sorted({len(g["trajectories"]) for g in ready})
        except (KeyError, TypeError, AttributeError):
            return  # not a GRPO rollout state: set_state names the folder
        new = self.cfg.group_size
        if not sizes or sizes == [new]:
            return
        from ptrain.config import ConfigError

        old = state.get("group_size") if isinstance(state.get("group_size"), int) else sizes[0]
        raise ConfigError(
            f"config key 'algo.grpo.group_size': the checkpoint in {os.path.join(self.stage.dir, 'checkpoints')} "
            f"that this stage resumes from holds {len(ready)} finished rollout groups of {old} samples each "
            f"(algo.grpo.group_size={old} when it was saved), which a rollout batch of group_size={new} cannot "
            f"train on; restore algo.grpo.group_size={old} to resume this run, or start the changed run in a new "
            "run_dir"
        )

    # ------------------------------------------------------------------ one rollout batch

    def _collect(self, n: int) -> list[Group]:
        if self.cfg.mode == "async":
            return self.collector.take(n, version=self.version, max_staleness=staleness_bound(self.cfg))
        return self.collector.collect(n, version=self.version)

    def _rollout(self) -> None:
        """One rollout batch into the queue. As several JAX processes, process 0 samples and
        scores it (the fleet serves it once) and every process gets the same rows and metrics,
        or the same EngineUnavailable, so that they stop or train in lockstep."""

        def sample() -> tuple[dict, dict]:
            before = self.collector.get_state()
            try:
                return self._rollout_batch()
            except EngineUnavailable:
                # Put the task order back where it was, so that a checkpoint saved now resumes
                # with the same tasks (in async mode unfinished groups are in the state anyway).
                if self.cfg.mode == "sync":
                    self.collector.set_state(before)
                raise

        batch, self.next_metrics = on_primary(sample, "sampling a rollout batch", keep=(EngineUnavailable,))
        if self.cfg.epochs > 1 or self.cfg.mini_batches > 1:
            batch["old_logp"] = np.asarray(self._old_logp(self.state.model_params(), self.state.model_state, batch))
        self._split(batch)

    def _rollout_batch(self) -> tuple[dict, dict]:
        """Sample and score one rollout batch: (its policy rows, its metrics)."""
        cfg = self.cfg
        t0 = time.time()
        stats0 = dict(self.collector.stats)
        groups, dropped_zero_std, rounds = [], 0, 0
        seen: list[Group] = []
        while len(groups) < cfg.prompts_per_step and rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
            got = self._collect(cfg.prompts_per_step - len(groups) if rounds else cfg.prompts_per_step)
            rounds += 1
            seen += got
            for g in got:
                rewards = [t.reward for t in g.trajectories if not t.masked]  # a masked reward is no measurement
                if cfg.dynamic_sampling and len(set(rewards)) <= 1:
                    dropped_zero_std += 1
                    continue
                groups.append(g)
        failed = [t.error if t.error is not None else f"masked by its environment: {t.reward_error}"
                  for g in seen for t in g.trajectories if t.error is not None or t.masked]  # fmt: skip
        if failed and len(failed) == sum(len(g.trajectories) for g in seen):
            # A batch of nothing but failures (or masked samples) trains on nothing, and so would the
            # next ones: stop resumably (the task order is put back) instead of finishing an empty stage.
            raise EngineUnavailable(
                f"every one of the {len(failed)} samples of this rollout batch failed, so it has nothing to "
                f"train on; the first: {failed[0]}"
            )
        if not groups:  # every group was degenerate: train on them (zero advantages) rather than stall
            groups = seen[: cfg.prompts_per_step]
        record = getattr(self.collector.tasks, "record", None)  # a pass-rate curriculum learns from every group
        if record is not None:
            for g in seen:
                record(g.task, float(np.mean([is_correct(t) for t in g.trajectories])))
        t_gen = time.time() - t0

        rewards = shaped_rewards(groups, cfg)
        invalid = np.array([[t.metrics.get("invalid_tool_calls", 0) > 0 for t in g.trajectories] for g in groups])
        masked = np.array([[t.masked for t in g.trajectories] for g in groups], bool)
        # cfg is an AdvantageConfig (algo.grpo extends it): baseline, normalize_std, invalid_tool_call_advantage.
        # Masked samples (no valid reward) stay out of their group's baseline and get no row.
        adv, adv_aux = measured_advantages(rewards, masked, cfg=cfg, invalid_BxG=invalid)
        trajectories = [t for g in groups for t in g.trajectories]
        flat_adv = np.asarray(adv).reshape(-1)
        run = self.stage.run
        seq_len = run.train.seq_len
        if cfg.pack_rows:
            longest = max((min(len(t.token_ids) - 1, seq_len) for t in trajectories if not t.masked), default=0)
            length = bucket_length(longest, seq_len, run.mesh.context) if cfg.bucket_lengths else seq_len
            batch, counts = policy_batch(trajectories, flat_adv, rows=self.rows, seq_len=length, pack=True,
                                         multiple=self.row_multiple, mask_truncated=cfg.overlong_filter)  # fmt: skip
        else:
            batch, counts = policy_batch(trajectories, flat_adv, rows=self.rows, seq_len=seq_len,
                                         mask_truncated=cfg.overlong_filter)  # fmt: skip
            if cfg.bucket_lengths:
                batch = to_bucket(batch, seq_len, run.mesh.context)
        counts["row_length"] = float(batch["input_ids"].shape[1])
        counts["rows"] = float(batch["input_ids"].shape[0])
        if self.collector.audit is not None:
            self.collector.audit.write(
                {"record": "train_batch", "version": self.version, "groups": [g.index for g in groups],
                 "tasks": [g.task.id for g in groups], "group_versions": [g.version for g in groups]}
            )  # fmt: skip
        metrics = self._metrics(groups, trajectories, rewards, adv_aux, counts, seen, dropped_zero_std, stats0, t_gen)
        return batch, metrics

    def _split(self, batch: dict) -> None:
        cfg = self.cfg
        rows = len(batch["input_ids"])  # fewer than self.rows when packed
        size = rows // cfg.mini_batches
        for epoch in range(cfg.epochs):
            # Seeded by the version the batch trains from, so a resumed stage splits alike.
            rng = np.random.default_rng([self.seed, self.version, epoch])
            order = rng.permutation(rows) if cfg.mini_batches > 1 else np.arange(rows)
            for k in range(cfg.mini_batches):
                idx = order[k * size : (k + 1) * size]
                self.queue.append({key: v[idx] for key, v in batch.items()})

    def _metrics(self, groups, trajectories, rewards, adv_aux, counts, seen, dropped_zero_std, stats0, t_gen) -> dict:
        m: dict[str, float] = {}
        lengths = np.array([t.tokens.output for t in trajectories], np.float32)
        correct = np.array([float(is_correct(t)) for t in trajectories])
        measured = np.array([not t.masked for t in trajectories])
        m["reward/mean"] = float(rewards.reshape(-1)[measured].mean()) if measured.any() else 0.0
        m["reward/std"] = float(adv_aux.reward_std)
        m["frac_zero_std_groups"] = float(adv_aux.frac_zero_std)
        m["pass_rate"] = float(correct.mean())
        # Lengths of the answers given: a failed sample (an env or engine error) gave none.
        answered = np.array([t.error is None for t in trajectories])
        if answered.any():
            m["response_length/mean"] = float(lengths[answered].mean())
            m["response_length/max"] = float(lengths[answered].max())
            cut = [t.finish_reason in ("length", "token_limit") for t in trajectories]
            m["truncated_frac"] = float(np.mean(np.asarray(cut)[answered]))
        if (correct > 0).any():
            m["response_length/correct"] = float(lengths[correct > 0].mean())
        if (answered & (correct == 0)).any():
            m["response_length/wrong"] = float(lengths[answered & (correct == 0)].mean())
        m["reward_errors"] = float(sum(t.reward_error is not None for t in trajectories))
        m["env_errors"] = float(sum(t.error is not None for t in trajectories))
        m["masked_samples"] = float(sum(t.masked for t in trajectories))
        m["dropped_zero_std_groups"] = float(dropped_zero_std)
        m["dropped_stale_groups"] = float(self.collector.stats["dropped_stale"] - stats0["dropped_stale"])
        m["staleness/mean"] = float(np.mean([self.version - g.version for g in groups]))
        m["staleness/max"] = float(max(self.version - g.version for g in groups))
        m["clipped_trajectories"] = counts["clipped_trajectories"]
        m["row_length"] = counts["row_length"]
        m["rows"] = counts["rows"]
        for key, value in getattr(self.collector.tasks, "stats", {}).items():
            m[f"curriculum/{key}"] = float(value)
        target = getattr(self.collector.tasks, "current_target", lambda: None)()
        if target is not None:
            m["curriculum/pass_rate_target"] = float(target)
        by_env: dict[str, list] = {}
        for t in trajectories:
            by_env.setdefault(t.task.env, []).append(t)
        for env, ts in by_env.items():
            m[f"masked_samples/{env}"] = float(sum(t.masked for t in ts))
            for kind in sorted({t.failure_kind for t in ts} - {None}):
                m[f"failure_kind/{env}/{kind}"] = float(sum(t.failure_kind == kind for t in ts))
            ts = [t for t in ts if not t.masked] or ts  # reward statistics of measured samples
            r = np.array([t.reward for t in ts], np.float32)
            m[f"reward/{env}/mean"] = float(r.mean())
            m[f"reward/{env}/std"] = float(r.std())
            names = sorted({k for t in ts for k in t.reward_components})
            for name in names:
                m[f"reward/{env}/{name}"] = float(np.mean([t.reward_components.get(name, 0.0) for t in ts]))
        tok_unc = sum(t.tokens.prompt_uncached for t in trajectories)
        tok_cached = sum(t.tokens.prompt_cached for t in trajectories)
        tok_out = sum(t.tokens.output for t in trajectories)
        m["tokens/prompt_uncached"] = float(tok_unc)
        m["tokens/prompt_cached"] = float(tok_cached)
        m["tokens/output"] = float(tok_out)
        m["cached_token_ratio"] = tok_cached / max(tok_unc + tok_cached, 1)
        now = time.time()
        wall = now - self._t_last_take  # one whole RL step: sampling, scoring, training, sync
        if self.cfg.mode == "async":
            # Generation runs in the background: what the trainer waited, and the producer's
            # rate over the wall time since the previous batch was taken.
            m["time/rollout_wait_s"] = t_gen
            m["generate_tokens_per_s"] = tok_out / max(wall, 1e-9)
        else:
            m["time/generate_s"] = t_gen
            m["generate_tokens_per_s"] = tok_out / max(t_gen, 1e-9)
        self._t_last_take = now
        cost = self.costs.tokens_usd(tok_unc, tok_cached, tok_out) + self.hour_usd * wall / 3600
        self.cost_usd += cost
        m["time/rl_step_s"] = wall
        m["cost/step_usd"] = cost
        m["cost/total_usd"] = self.cost_usd
        if self.reward_start is None:
            self.reward_start = m["reward/mean"]
        gained = m["reward/mean"] - self.reward_start
        m["reward_gained_per_usd"] = gained / self.cost_usd if self.cost_usd > 0 else 0.0
        return m


def scored_by_reward_model(run: RunConfig, envs: dict, tokenizer) -> dict:
    """The stage's environments with stages[i].reward_model scoring their episodes."""
    from ptrain.envs.registry import close_envs
    from ptrain.envs.reward_model import RewardModelScored, RewardModelScorer

    try:
        scorer = RewardModelScorer(run.stage.reward_model, tokenizer, max_tokens=run.train.seq_len,
                                   what=f"stages.{run.stage.name}.reward_model")  # fmt: skip
    except Exception:
        close_envs(envs)
        raise
    print(f"ptrain: stage '{run.stage.name}' is rewarded by the reward model at {run.stage.reward_model}", flush=True)
    return {name: RewardModelScored(env, scorer) for name, env in envs.items()}


def run_grpo_stage(run: RunConfig, stage_dir: str, init_path: str | None) -> dict:
    """Run (or resume) one GRPO-family stage; returns its summary after export."""
    from ptrain.data.report import BadRowReport
    from ptrain.envs.audit import AuditLog
    from ptrain.envs.curriculum import Curriculum
    from ptrain.envs.mixture import EnvMixture
    from ptrain.envs.registry import close_envs, make_env
    from ptrain.stages.env_metrics import env_evaluator

    t_start = time.time()
    cfg = run.algo.grpo
    tokenizer = tokenizer_for(run, init_path)
    stage = setup_stage(run, stage_dir, init_path, tokenizer, kind="grpo", t_start=t_start,
                        with_reference=cfg.kl_coef > 0, frozen=("router",) if cfg.freeze_router else ())  # fmt: skip
    from ptrain.config.seeds import component_seed

    configs = [run.envs[n] for n in (run.stage.envs or sorted(run.envs))]
    envs = {e.env_name: make_env(e, tokenizer=tokenizer, sandbox=run.sandbox) for e in configs}
    if run.stage.reward_model is not None:
        envs = scored_by_reward_model(run, envs, tokenizer)
    seed = component_seed(run, "train.seed")
    tasks = EnvMixture(list(envs.values()), [e.weight for e in configs], seed=seed)
    if cfg.drop_solved or cfg.pass_rate_target is not None:
        tasks = Curriculum(tasks, drop_solved=cfg.drop_solved, target=cfg.pass_rate_target,
                           width=cfg.pass_rate_width, target_end=cfg.pass_rate_target_end,
                           schedule_draws=max(run.train.steps * cfg.prompts_per_step, 1), seed=seed)  # fmt: skip
    placed = stage.placed
    engine = policy_engine(run, placed, tokenizer=tokenizer, seed=seed, stage_dir=stage_dir)
    # SGLang's sampling_params object from the config's SamplingConfig group (n is the collector's).
    sampling = SamplingParams.from_dict(cfg.sampling_params())
    audit = AuditLog(os.path.join(stage_dir, "audit.jsonl"))
    ahead = groups_ahead(cfg)
    collector = RolloutCollector(envs, tasks, engine, sampling, group_size=cfg.group_size, seed=seed, ahead=ahead,
                                 audit=audit)  # fmt: skip
    hour_usd = run.cost.machine_hour_usd(jax.default_backend(), jax.device_count(), cpu_cores())
    batches = RolloutBatches(stage, collector, engine, costs=run.cost, hour_usd=hour_usd)
    loss_cfg = cfg
    if cfg.aggregation == "seq_mean_token_sum_norm" and cfg.norm_constant is None:
        # Dr. GRPO's constant is the row length; fixed at seq_len, as rows may be bucketed shorter.
        loss_cfg = dataclasses.replace(cfg, norm_constant=float(run.train.seq_len))
    algorithm = Algorithm(
        objective=make_policy_objective(
            placed.model_def,
            loss_cfg,
            vocab_chunk=run.train.vocab_chunk,
            aux_loss_coef=run.model.router_aux_loss_coef,
        ),  # fmt: skip
        denominator=policy_denominator(cfg.aggregation, packed=cfg.pack_rows),
        finalize=batches.finalize,
        tokens_in=lambda b: int(np.sum(b["segment_ids"] > 0)),
    )
    # The environments' held-out tasks (algo.eval; at most train.eval_generate of each unless
    # algo.eval.limit says) at the start, every train.eval_every steps and at the end.
    evaluators = [env_evaluator(run, envs, engine, sync_weights=False)] if run.train.eval_generate else []
    try:
        return train_evaluate_export(stage, algorithm, batches, report=BadRowReport(source="environments"),
                                     evaluators=evaluators)  # fmt: skip
    finally:
        collector.close()
        engine.close()
        close_envs(envs)
        audit.close()


POLICY_ADAPTER = "policy"
"""The adapter slot a LoRA stage's engine serves its policy from."""


BASE_VERSION = "base"
"""The weight version a LoRA stage's fleet serves its frozen base as (pushed once, at start)."""


def policy_engine(run, placed, *, tokenizer, seed: int, stage_dir: str):
    """The stage's rollout engine. A LoRA stage serves its adapters over the frozen base, so
    every sync moves only the adapters: in process from an adapter slot, and on a fleet
    (`rollout=sglang`) as a PEFT folder each worker loads under a versioned name, after the
    base itself is pushed once (the workers may have started from another checkpoint than
    this stage's base). Otherwise, and for adapters no engine applies per request (routed
    experts, the output head, an int8 base, whose dequantized weights only the trainer has),
    the engine holds the merged weights and every sync moves them whole."""
    from ptrain.models.lora import SERVABLE
    from ptrain.rollout.engines import make_engine

    state = placed.state
    spec = state.lora
    by_adapter = (
        spec is not None
        and run.rollout.kind in ("local", "sglang")
        and set(spec.targets) <= set(SERVABLE)
        and run.model.lora.base_dtype != "int8"
    )
    by_slot = by_adapter and run.rollout.kind == "local"
    params = state.base_params if by_adapter else state.merged_params()
    engine = make_engine(run, placed.model_def, params, state.model_state, mesh=placed.mesh, tokenizer=tokenizer,
                         seed=seed, stage_dir=stage_dir, lora=spec if by_slot else None)  # fmt: skip
    if by_slot:
        engine.load_lora(POLICY_ADAPTER, adapters=state.params, spec=spec)
    elif by_adapter:
        try:
            engine.update_weights(state.base_params, state.model_state or None, weight_version=BASE_VERSION,
                                  mode="abort")  # fmt: skip
        except BaseException:
            engine.close()
            raise
    if by_adapter:
        # The first sync (RolloutBatches.begin) pushes the adapters; _push sees this default.
        engine.set_default_lora(POLICY_ADAPTER)
    return engine
