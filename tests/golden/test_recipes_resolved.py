"""Every recipe composes at every scale, and its resolved config is checked in
(tests/golden/recipes/<name>.yaml for the recipe as written, <name>@<scale>.yaml for each of its
`scales`), so that any change to a recipe or a default shows up in review.

Re-pin after an intended change with:  PTRAIN_REPIN=1 python -m pytest tests/golden -q
"""

import os

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ptrain.config import register_configs, to_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINNED = os.path.join(os.path.dirname(__file__), "recipes")
RECIPES = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".yaml"))

register_configs()


def scales_of(name: str) -> list[str]:
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"recipe={name}"])
    return ["tiny", *sorted(cfg.scales)]


# A published scale needs the launch's paths and URLs (tests/config checks it names them).
CASES = [(name, scale) for name in RECIPES for scale in scales_of(name) if scale != "published"]
# Values a recipe leaves to its launch (`???`), given as a user would.
LAUNCH = {"continuous": ["continuous.inbox=inbox"]}


@pytest.mark.parametrize("name, scale", CASES)
def test_resolved_recipe_matches_the_pinned_copy(name, scale):
    overrides = [f"recipe={name}", f"scale={scale}", *LAUNCH.get(name, [])]
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run = to_run_config(cfg, overrides)
    text = OmegaConf.to_yaml(OmegaConf.structured(run))
    path = os.path.join(PINNED, f"{name}.yaml" if scale == "tiny" else f"{name}@{scale}.yaml")
    if os.environ.get("PTRAIN_REPIN") or not os.path.exists(path):
        os.makedirs(PINNED, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        if not os.environ.get("PTRAIN_REPIN"):
            pytest.fail(f"{path} did not exist; it has been written now. Review it and commit it.")
    with open(path) as f:
        pinned = f.read()
    assert text == pinned, (
        f"the resolved config of recipe '{name}' at scale {scale} changed. If the change is intended (a recipe or a default was "
        f"edited on purpose), re-pin with PTRAIN_REPIN=1 python -m pytest tests/golden and commit "
        f"{os.path.relpath(path, ROOT)} with the change."
    )
