"""One top-level `seed` drives everything random in a run; each component's seed derives from it.

The seeded components and their own config keys:

    model.seed            initial weights of the embedded (built-from-config) model
    data.shuffle_seed     order of the training rows and of the packing bins
    data.generated.seed   the embedded task's problems (and the slips of its rejected answers)
    train.seed            the train state's RNG and the sampling of on-policy DPO pairs

A component key left at null (the default) takes

    derive_seed(seed, key) = SeedSequence([seed, int.from_bytes(key.encode(), "little")])
                             .generate_state(1)[0] >> 1

a 31-bit integer (numpy's SeedSequence hashes its entropy into well-mixed words, the
same on every platform). Every component thus draws from its own stream, and two
top-level seeds give unrelated values for all of them. A component key set explicitly
is kept as given, so `seed=3 data.shuffle_seed=0` changes everything but the data
order. `to_run_config` resolves the keys once, so a run's config.yaml and checkpoints
hold the concrete values, and a stage's own override of a key wins like any other.

The embedded tokenizer is not seeded: it is trained on fixed text so that every run of
every seed shares one vocabulary (ptrain.data.tokenizer).
"""

from __future__ import annotations

from typing import Any

import numpy as np

DEFAULT_SEED = 0
"""The top-level seed of a RunConfig nobody set, and of component configs used on their own."""

SEEDED_KEYS = ("model.seed", "data.shuffle_seed", "data.generated.seed", "train.seed")
"""Config keys of the component seeds that `resolve_seeds` derives from the top-level seed."""


def derive_seed(seed: int, key: str) -> int:
    """The seed of component `key` (a config key such as 'data.shuffle_seed') under top-level `seed` >= 0."""
    if seed < 0:
        raise ValueError(f"config key 'seed': must be >= 0, got {seed}")
    entropy = [int(seed), int.from_bytes(key.encode("utf-8"), "little")]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0] >> 1)


def seed_or_default(value: int | None, key: str) -> int:
    """`value`, or when it is None the seed `key` derives from DEFAULT_SEED: what a component
    config built on its own (a DataConfig in a script) means by null."""
    return derive_seed(DEFAULT_SEED, key) if value is None else int(value)


def _owner(run: Any, key: str) -> tuple[Any, str]:
    """(the config node holding `key`, the field name): ('data.generated.seed') -> (run.data.generated, 'seed')."""
    *path, field = key.split(".")
    node = run
    for part in path:
        node = getattr(node, part)
    return node, field


def component_seed(run: Any, key: str) -> int:
    """The seed of component `key` in a RunConfig: its own value, or derived from `run.seed`
    when null (a RunConfig built in code rather than by `to_run_config`)."""
    node, field = _owner(run, key)
    value = getattr(node, field)
    return derive_seed(run.seed, key) if value is None else int(value)


def resolve_seeds(run: Any) -> None:
    """Fill every null component seed of a RunConfig in place, derived from `run.seed`."""
    for key in SEEDED_KEYS:
        node, field = _owner(run, key)
        setattr(node, field, component_seed(run, key))
