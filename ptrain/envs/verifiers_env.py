"""verifiers 0.4 tasksets as ptrain environments (`env=verifiers`, ptrain/config/env_verifiers.py).

A verifiers taskset (Prime Intellect's environment library: `vf.Taskset` of `vf.Task`s with
`@vf.reward` methods) runs in-process through verifiers' own `SingleAgentEnv`: its harness (the
`null` chat loop by default) talks to verifiers' interception server, whose train client renders
the chat to token ids with the policy's tokenizer and samples them from the stage's engine
through vLLM's token route, `POST /inference/v1/generate` (ptrain.serve.vllm_api), on a loopback
server this environment starts over the engine. So the tokens, the sampled mask and the
log-probs are the engine's own (log p under the tempered softmax, `ptrain.rollout.protocol`).

    tasks(split)   the taskset's tasks in load() order: eval = the first n_eval, train = the
                   next n_train (a taskset needs that many; an infinite one is cut there)
    rollout        n episodes of one task (verifiers' `slots(task, n)`), sample j seeded with
                   sample_seed(sampling_seed, j); each trace's one branch -> a Trajectory:
                   token_ids = branch.token_ids, loss_mask = branch.sampled_mask, logprobs =
                   branch.logprobs (0 off the mask), reward = trace.reward and its components
                   score x weight per `@vf.reward`; verifiers errors -> reward_error (reward 0).

A multi-turn trace whose re-rendered history differs from the sampled tokens splits into
several branches (verifiers' "bridging" fails); such an episode is kept out of training
(`masked`, failure_kind `branched`), since ptrain trains one token sequence per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from ptrain.envs.base import Task, TaskSplits, TokenCounts, Trajectory
from ptrain.rollout.protocol import TOP_K_OFF, SamplingParams

log = logging.getLogger("ptrain.envs.verifiers")

SERVED_NAME = "ptrain-policy"
INSTALL = 'pip install ".[verifiers]" (verifiers 0.4 and uv)'


def sample_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of sample `index` of a group seeded `seed` (distinct per sample)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * 7_919) % (2**31 - 1)


def _import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"the verifiers environment kind needs verifiers 0.4: {INSTALL} ({e})") from None
    return vf


class VerifiersEnv(TaskSplits):
    """A verifiers taskset played by the stage's engine (module docstring)."""

    def __init__(self, cfg, options, *, tokenizer, sandbox=None):
        self.cfg, self.options, self.tokenizer = cfg, options, tokenizer
        self.name = cfg.name or cfg.kind
        self.vf = _import_verifiers()
        if options.taskset_path and options.taskset_path not in sys.path:
            sys.path.insert(0, os.path.abspath(options.taskset_path))
        from verifiers.v1.utils.loaders import load_environment

        config = {
            "taskset": {**options.taskset_args, "id": options.taskset},
            "agent": {"harness": {"id": options.harness}, "runtime": {"type": options.runtime}},
        }
        try:
            self.env = load_environment(self.vf.SingleAgentEnvConfig.model_validate(config))
        except (ImportError, ValueError) as e:
            raise ValueError(
                f"environment {self.name!r}: verifiers cannot load taskset {options.taskset!r}: {e}; install its "
                "package (or set options.taskset_path to the folder of its module)"
            ) from None
        self._vf_tasks: list[Any] | None = None
        self._servers: dict[int, tuple[contextlib.ExitStack, str]] = {}
        self._lock = threading.Lock()
        self._renderer_dir: tempfile.TemporaryDirectory | None = None
        self.stats = {"episodes": 0, "errors": 0, "branched": 0}

    # ---- tasks ----

    def _taskset(self) -> list[Any]:
        if self._vf_tasks is None:
            want = self.cfg.n_eval + self.cfg.n_train
            tasks = []
            for task in self.env.taskset:
                tasks.append(task)
                if len(tasks) >= want:
                    break
            if len(tasks) <= self.cfg.n_eval:
                raise ValueError(
                    f"environment {self.name!r}: taskset {self.options.taskset!r} has {len(tasks)} tasks, no more "
                    f"than n_eval={self.cfg.n_eval}; lower n_eval so that some are left to train on"
                )
            self._vf_tasks = tasks
        return self._vf_tasks

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        tasks = self._taskset()
        n_eval = self.cfg.n_eval
        held = [self._task("eval", i, i, t) for i, t in enumerate(tasks[:n_eval])]
        train = [self._task("train", i, n_eval + i, t) for i, t in enumerate(tasks[n_eval:])]
        return train, held

    def _task(self, split: str, index: int, position: int, vf_task: Any) -> Task:
        data = vf_task.data
        messages = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            messages.extend(
                m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in data.prompt
            )
        return self.task(split, index, messages, {"vf_position": position, "vf_id": data.id or data.name})

    # ---- the engine's HTTP face ----

    def _renderer_path(self) -> str:
        """A folder with the policy's tokenizer, for verifiers' renderer (it loads by path)."""
        path = getattr(self.tokenizer, "name_or_path", None)
        if path and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            return path
        if self._renderer_dir is None:
            self._renderer_dir = tempfile.TemporaryDirectory(prefix="ptrain-vf-tokenizer-")
            self.tokenizer.save_pretrained(self._renderer_dir.name)
        return self._renderer_dir.name

    def _url(self, engine) -> str:
        """The base URL of a loopback server over `engine` (started on first use, one per engine)."""
        with self._lock:
            known = self._servers.get(id(engine))
            if known is not None:
                return known[1]
            from ptrain.serve.in_process import serving
            from ptrain.serve.server import make_app

            stack = contextlib.ExitStack()
            app = make_app(engine, self.tokenizer, served_model_name=SERVED_NAME)
            url = stack.enter_context(serving(app))
            self._servers[id(engine)] = (stack, url)
            return url

    def close(self) -> None:
        with self._lock:
            for stack, _ in self._servers.values():
                stack.close()
            self._servers.clear()
        if self._renderer_dir is not None:
            self._renderer_dir.cleanup()
            self._renderer_dir = None

    # ---- episodes ----

    def _context(self, url: str, sampling: SamplingParams, index: int, max_tokens: int):
        """verifiers' model context of sample `index`: its train client on our server, the stage's
        sampling in vLLM's names (stop ids are the renderer's own: its end-of-turn tokens)."""
        vf = self.vf
        extra: dict[str, Any] = {}
        if 0 < sampling.top_k < TOP_K_OFF:
            extra["top_k"] = sampling.top_k
        if sampling.min_p:
            extra["min_p"] = sampling.min_p
        seed = sample_seed(sampling.sampling_seed, index)
        if seed is not None:
            extra["seed"] = seed
        client: dict[str, Any] = {"base_url": url + "/v1", "renderer_model_name": self._renderer_path()}
        if self.options.renderer is not None:
            client["renderer"] = self.options.renderer
        return vf.ModelContext(
            model=SERVED_NAME,
            client=vf.TrainClientConfig(**client),
            sampling=vf.SamplingConfig(
                temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens, **extra
            ),
        )

    async def rollout(self, task: Task, engine, sampling: SamplingParams) -> list[Trajectory]:
        vf_task = self._taskset()[int(task.data["vf_position"])]
        url = await asyncio.to_thread(self._url, engine)
        max_tokens = self.cfg.max_new_tokens or sampling.max_new_tokens
        n = sampling.n
        before = str(getattr(engine, "weight_version", ""))
        async with self.env.serving():
            slots = self.env.slots(vf_task, n)
            runs = [
                asyncio.wait_for(
                    self.env.run_slot(slot, self._context(url, sampling, j, max_tokens)),
                    self.options.episode_timeout_s,
                )
                for j, slot in enumerate(slots)
            ]
            episodes = await asyncio.gather(*runs, return_exceptions=True)
        # The token route does not say which weights sampled each token: the versions the
        # engine served while the episodes ran (one, unless the weights changed meanwhile).
        versions = tuple(dict.fromkeys(v for v in (before, str(getattr(engine, "weight_version", ""))) if v))
        return [
            dataclasses.replace(self._trajectory(task, j, ep), weight_versions=versions)
            for j, ep in enumerate(episodes)
        ]

    def _failed(self, task: Task, j: int, error: str, tokens: Sequence[int] = ()) -> Trajectory:
        self.stats["errors"] += 1
        ids = tuple(tokens) or tuple(self._prompt_ids(task))
        return Trajectory(
            task=task,
            sample_index=j,
            token_ids=ids,
            prompt_length=len(ids),
            loss_mask=(0,) * len(ids),
            logprobs=(0.0,) * len(ids),
            reward=0.0,
            finish_reason="error",
            error=error,
            reward_error=error,
        )

    def _prompt_ids(self, task: Task) -> list[int]:
        try:
            return list(self.tokenizer.apply_chat_template(list(task.messages), add_generation_prompt=True))
        except Exception:
            return [0]

    def _trajectory(self, task: Task, j: int, episode: Any) -> Trajectory:
        self.stats["episodes"] += 1
        if isinstance(episode, BaseException):
            what = "timed out" if isinstance(episode, asyncio.TimeoutError) else f"failed: {episode!r}"
            return self._failed(task, j, f"the verifiers episode {what}")
        trace = episode.traces[0]
        branches = trace.branches
        if not branches:
            errors = "; ".join(e.message for e in trace.errors) or f"stop condition {trace.stop_condition}"
            return self._failed(task, j, f"the verifiers episode sampled nothing: {errors}")
        branch = branches[-1]
        ids = list(branch.token_ids)
        mask = [int(bool(m)) for m in branch.sampled_mask]
        lps = list(branch.logprobs)
        logprobs = tuple(float(lp) if m else 0.0 for lp, m in zip(lps, mask))
        prompt_length = mask.index(1) if 1 in mask else len(ids)
        components, reward_error = {}, None
        for name, r in trace.rewards.items():
            if r is None or r.score is None:
                reward_error = f"reward {name!r} was not computed"
                continue
            components[name] = float(r.score) * float(r.weight)
        if trace.errors:
            reward_error = "; ".join(f"{e.type}: {e.message}" for e in trace.errors)
        reward = 0.0 if reward_error else float(trace.reward)
        if reward_error:
            self.stats["errors"] += 1
        masked, failure = False, None
        if len(branches) > 1:
            self.stats["branched"] += 1
            masked, failure = True, "branched"
            reward_error = reward_error or (
                f"the episode split into {len(branches)} token sequences (a re-rendered turn differed from the "
                "sampled one); not trained on"
            )
        truncated = bool(getattr(branch, "is_truncated", False)) or trace.is_truncated
        return Trajectory(
            task=task,
            sample_index=j,
            token_ids=tuple(ids),
            prompt_length=prompt_length,
            loss_mask=tuple(mask),
            logprobs=logprobs,
            reward=reward,
            reward_components={} if reward_error else components,
            finish_reason="length" if truncated else "stop",
            reward_error=reward_error,
            masked=masked,
            failure_kind=failure,
            metrics={"turns": float(trace.num_turns), "branches": float(len(branches))},
            tokens=TokenCounts(prompt_uncached=len(ids) - sum(mask), output=sum(mask)),
        )
