"""Runs a tiny GRPO stage as a user's process would (for test_grpo.py): the arguments are
Hydra overrides; the arithmetic kind scores with the letter-share reward of grpo_env.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hydra import compose, initialize_config_module  # noqa: E402

from ptrain.config import register_configs, to_run_config  # noqa: E402
from ptrain.pipeline import run_pipeline  # noqa: E402
from tests.stages.grpo_env import use_letter_share_env  # noqa: E402

if __name__ == "__main__":
    use_letter_share_env()
    register_configs()
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        run = to_run_config(compose(config_name="config", overrides=sys.argv[1:]))
    print(run_pipeline(run), flush=True)
