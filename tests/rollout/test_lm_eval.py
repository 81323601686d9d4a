"""lm-evaluation-harness 0.4.13 against `python -m ptrain.serve`, given nothing but the server's
URL: its `local-completions` model runs a generate_until task and a multiple_choice task (both
local YAML over a local JSONL, no hub) through /v1/completions, tokenising through the server's
/tokenize. The multiple-choice accuracy, and every choice's log-likelihood, equal lm-eval's own
`hf` backend on the same model folder in transformers. Then the eval stage's option
(`algo.eval.lm_eval`): the same task from `python -m ptrain`, on a server in process."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.rollout.conftest import MAX_RUNNING
from tests.rollout.test_serve_process import ROOT, start_server

lm_eval = pytest.importorskip("lm_eval", reason='lm-eval is an optional extra: pip install ".[lm_eval]"')
pytestmark = pytest.mark.slow

GEN, MC = "ptrain_arith_gen", "ptrain_arith_mc"
ROWS = [
    {"question": f"{a}+{b}", "answer": str(a + b), "choices": [str(a + b + d) for d in (0, 1, 10)], "gold": 0}
    for a, b in [(1, 2), (3, 4), (12, 7), (5, 5), (20, 3), (8, 9)]
]
COMMON = """
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
"""
TASKS = {
    GEN: """task: {name}
output_type: generate_until
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""",
    MC: """task: {name}
output_type: multiple_choice
doc_to_choice: choices
doc_to_target: gold
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    """Both tasks as lm-eval YAMLs (an --include_path folder) over one local JSONL file."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    data = folder / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    for name, body in TASKS.items():
        (folder / f"{name}.yaml").write_text(body.format(name=name) + COMMON.format(data=data))
    return str(folder)


@pytest.fixture(scope="module")
def server(served_model_dir, tmp_path_factory):
    srv = start_server(served_model_dir, str(tmp_path_factory.mktemp("serve") / "server.log"))
    yield srv
    if srv.proc.poll() is None:
        srv.proc.terminate()
        srv.proc.wait(60)


def evaluate(model: str, model_args: dict, task_dir: str, tasks: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),  # lm-eval's index: 10 s
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def served_results(server, task_dir) -> dict:
    """Both tasks through the server, configured as a user would: the URL, nothing else."""
    return evaluate("local-completions", {"base_url": f"{server.url}/v1/completions"}, task_dir, [GEN, MC])


def choice_logliks(results: dict) -> list[list[float]]:
    """Each document's log-likelihood of each choice, in document order."""
    samples = sorted(results["samples"][MC], key=lambda s: s["doc_id"])
    return [[r[0] for r in s["filtered_resps"]] for s in samples]


def test_lm_eval_uses_the_servers_own_tokenizer(server):
    from lm_eval.utils import check_remote_tokenizer_support

    assert check_remote_tokenizer_support(f"{server.url}/v1/completions")


def test_generate_until_and_multiple_choice_tasks_run_against_the_server(served_results, server):
    res = served_results["results"]
    assert 0.0 <= res[GEN]["exact_match,none"] <= 1.0 and 0.0 <= res[MC]["acc,none"] <= 1.0
    assert served_results["n-samples"][GEN]["effective"] == served_results["n-samples"][MC]["effective"] == len(ROWS)
    gens = [s["filtered_resps"][0] for s in served_results["samples"][GEN]]
    assert all(isinstance(g, str) and "\n" not in g for g in gens), gens
    logliks = choice_logliks(served_results)
    assert all(len(ls) == 3 and all(math.isfinite(x) and x < 0 for x in ls) for ls in logliks)
    assert server.proc.poll() is None, server.log()


def test_multiple_choice_accuracy_equals_lm_evals_hf_backend(served_results, served_model_dir, task_dir):
    pytest.importorskip("torch")
    hf = evaluate("hf", {"pretrained": served_model_dir, "device": "cpu", "dtype": "float32"}, task_dir, [MC])
    assert served_results["results"][MC]["acc,none"] == hf["results"][MC]["acc,none"]
    served, reference = choice_logliks(served_results), choice_logliks(hf)
    assert len(served) == len(reference) == len(ROWS)
    for mine, theirs in zip(served, reference):
        assert mine == pytest.approx(theirs, abs=1e-4), (served, reference)


def test_an_eval_stage_runs_lm_eval_tasks_on_its_own_engine(served_results, served_model_dir, task_dir, tmp_path):
    """`algo.eval.lm_eval` as a user launches it: an eval stage with lm-eval tasks and no
    environments serves its model in process (ptrain.serve.lm_harness) and reports the metrics."""
    args = [
        "stages=[{name: check, kind: eval}]",
        "model=hf",
        f"model.hf_path={served_model_dir}",
        f"algo.eval.lm_eval.tasks=[{MC}]",
        f"algo.eval.lm_eval.include_path={task_dir}",
        "algo.eval.lm_eval.batch_size=2",
        f"rollout.max_running_requests={MAX_RUNNING}",
        "logging.console=false",
        f"run_dir={tmp_path}",
    ]
    out = subprocess.run([sys.executable, "-m", "ptrain", *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    stage = tmp_path / "stages" / "check"
    done = json.load(open(stage / "DONE.json"))
    assert done[f"eval/lm_eval/{MC}/acc"] == served_results["results"][MC]["acc,none"], done
    assert f"eval/lm_eval/{MC}/acc_stderr" in done
    metrics = [json.loads(line) for line in open(stage / "metrics.jsonl")]
    assert metrics[-1][f"eval/lm_eval/{MC}/acc"] == done[f"eval/lm_eval/{MC}/acc"]
    saved = json.load(open(stage / "lm_eval.json"))
    assert saved["results"][MC]["acc,none"] == done[f"eval/lm_eval/{MC}/acc"]
