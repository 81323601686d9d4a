"""`algo.eval.lm_eval`: lm-evaluation-harness tasks of an eval stage. Bad values name their key
before any model loads; an eval stage may run lm-eval tasks without environments."""

import importlib.machinery
import importlib.util

import pytest

import ptrain.config.grpo as grpo_config
from ptrain import compose
from ptrain.config import ConfigError

TASKS = "algo.eval.lm_eval.tasks=[my_task]"
LM_EVAL_ONLY = ["stages=[{name: check, kind: eval}]", TASKS]


def pretend(monkeypatch, installed: bool) -> None:
    """Validation asks importlib whether lm_eval is installed; answer as told (it is an optional extra)."""
    real = importlib.util.find_spec
    spec = importlib.machinery.ModuleSpec("lm_eval", None) if installed else None
    monkeypatch.setattr(grpo_config.importlib.util, "find_spec", lambda n, *a: spec if n == "lm_eval" else real(n, *a))


@pytest.fixture
def lm_eval_installed(monkeypatch):
    pretend(monkeypatch, installed=True)


def test_the_defaults_run_no_lm_eval_and_an_eval_stage_may_run_it_alone(lm_eval_installed):
    assert compose(None).algo.eval.lm_eval.tasks == []
    run = compose(None, [*LM_EVAL_ONLY, "algo.eval.lm_eval.limit=10", "algo.eval.lm_eval.num_fewshot=0"])
    assert run.algo.eval.lm_eval.tasks == ["my_task"] and run.algo.eval.lm_eval.limit == 10
    with pytest.raises(ConfigError, match="or lm-eval tasks with algo.eval.lm_eval.tasks"):
        compose(None, ["stages=[{name: check, kind: eval}]"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.eval.lm_eval.limit=0", "'algo.eval.lm_eval.limit': must be null (every document) or >= 1, got 0"),
        ("algo.eval.lm_eval.num_fewshot=-1", "'algo.eval.lm_eval.num_fewshot': must be null"),
        ("algo.eval.lm_eval.batch_size=0", "'algo.eval.lm_eval.batch_size': must be >= 1, got 0"),
        ("algo.eval.lm_eval.include_path=/no/such/tasks", "'algo.eval.lm_eval.include_path': '/no/such/tasks' is not"),
        ("algo.eval.lm_eval.tasks=['']", "'algo.eval.lm_eval.tasks': every task must be a non-empty name"),
    ],
)
def test_impossible_values_name_their_key(lm_eval_installed, override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compose(None, [*LM_EVAL_ONLY, override])


def test_tasks_without_lm_eval_installed_say_how_to_install_it(monkeypatch):
    pretend(monkeypatch, installed=False)
    with pytest.raises(ConfigError, match=r"'algo.eval.lm_eval.tasks': lm-evaluation-harness is not installed; pip"):
        compose(None, LM_EVAL_ONLY)
    compose(None)  # without tasks lm-eval is not needed
