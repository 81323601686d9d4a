"""SFT rows from environments: each a task's prompt and the environment's demonstration of a
correct response, so one set of environments gives both a multi-domain SFT mixture and the
RL stage that follows it (Nemotron 3 Nano's SFT covers the domains its RL then trains).

    train, held = demonstration_rows(envs, weights, n_train=2000, n_eval=16, seed=0)

Training rows are drawn through `EnvMixture` (by weight; an environment's tasks repeat past
its n_train), so the SFT mixture has the RL stage's domain ratios. Held-out rows are each
environment's first `n_eval` held-out tasks: the tasks the RL and eval stages hold out, never
trained on. Every row is chat JSONL: {"messages": prompt + demonstration, "env", "task"}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ptrain.envs.mixture import EnvMixture, env_task_seed


def prompt_messages(env, task) -> list[dict[str, Any]]:
    """The task's messages as the environment renders its prompt: a tool environment whose
    chat template ignores `tools=` declares its tools in the system message
    (`ChatFormat.with_tools`), and the SFT rows must show the model the same prompt."""
    fmt = getattr(env, "format", None)
    return list(fmt.with_tools(task.messages)) if fmt is not None else [dict(m) for m in task.messages]


_ROLE = {"policy": "assistant", "tool": "tool", "env": "user"}


def episode_messages(trajectory) -> list[dict[str, Any]]:
    """The turns of an episode after its prompt as chat messages (what preference pairs and
    reward models read)."""
    return [{"role": _ROLE[t.role], "content": t.text} for t in trajectory.turns]


def _row(env, task) -> dict[str, Any]:
    demo = getattr(env, "demonstration", None)
    if demo is None:
        raise ValueError(
            f"environment {env.name!r} cannot write demonstrations, so data.source=envs has no rows for it; "
            "leave it out with data.envs.envs=[names...], or use another data.source"
        )
    return {"messages": prompt_messages(env, task) + list(demo(task)), "env": env.name, "task": task.id}


def demonstration_rows(
    envs: Sequence[Any], weights: Sequence[float], *, n_train: int, n_eval: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) of the environments; see the module docstring."""
    mixture = EnvMixture(list(envs), list(weights), seed=seed)
    train = [_row(env, task) for env, task in mixture.next_tasks(n_train)]
    held = []
    for env in envs:
        tasks = env.tasks("eval", seed=env_task_seed(env, seed))
        held.extend(_row(env, task) for task in list(tasks)[:n_eval])
    return train, held
