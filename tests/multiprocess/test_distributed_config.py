"""The `distributed` group: where the process count and rank come from, and the mistakes that
stop a run before JAX starts (each naming the key or variable and the fix). No JAX here."""

import pytest

from ptrain import compose
from ptrain.config import ConfigError
from ptrain.config.distributed import DistributedConfig, detect_launcher

RANKS = {"PTRAIN_COORDINATOR": "127.0.0.1:12355", "PTRAIN_NUM_PROCESSES": "2", "PTRAIN_PROCESS_ID": "1"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """The test machine may itself run under Slurm or mpirun: start from a plain environment."""
    for var in (*RANKS, "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)


def test_all_null_is_one_process():
    plan = DistributedConfig().resolve({})
    assert (plan.mode, plan.num_processes, plan.process_id) == ("single", 1, 0)


def test_the_launcher_variables_fill_null_keys_and_the_config_wins_over_them():
    plan = DistributedConfig().resolve(RANKS)
    assert (plan.mode, plan.coordinator_address, plan.num_processes, plan.process_id) == (
        "explicit",
        "127.0.0.1:12355",
        2,
        1,
    )
    plan = DistributedConfig(process_id=0, coordinator_address="10.0.0.1:999").resolve(RANKS)
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("10.0.0.1:999", 2, 0)
    # num_processes=1 forces one process whatever the environment says
    assert DistributedConfig(num_processes=1).resolve(RANKS).mode == "single"


def test_a_slurm_step_or_mpirun_is_left_to_jax_and_a_one_task_script_is_not():
    slurm = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4"}
    plan = DistributedConfig().resolve(slurm)
    assert (plan.mode, plan.num_processes) == ("auto", 4) and "Slurm" in plan.launcher
    # a batch script of a many-task allocation, outside any srun step, is one process
    assert DistributedConfig().resolve({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4"}).mode == "single"
    assert DistributedConfig().resolve(dict(slurm, SLURM_NTASKS="1")).mode == "single"
    assert detect_launcher({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"})[1] == 2
    # explicit values win over the launcher
    assert DistributedConfig(num_processes=1).resolve(slurm).mode == "single"


def test_a_tpu_slice_on_gke_and_a_kubernetes_jobset_are_left_to_jax():
    tpu = DistributedConfig().resolve({"TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3", "TPU_WORKER_ID": "2"})
    assert (tpu.mode, tpu.num_processes) == ("auto", 4) and "TPU" in tpu.launcher
    assert DistributedConfig().resolve({"TPU_WORKER_HOSTNAMES": "w-0"}).mode == "single"  # one host
    jobset = DistributedConfig().resolve({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOBSET_NAME": "train"})
    assert (jobset.mode, jobset.num_processes) == ("auto", None) and "JobSet" in jobset.launcher
    assert DistributedConfig().resolve({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).mode == "single"  # a lone pod


def test_a_submitit_local_job_of_several_tasks_gets_its_ranks_and_a_loopback_coordinator():
    task = {"SUBMITIT_LOCAL_JOB_ID": "19269", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1"}
    plan = DistributedConfig().resolve(task)
    assert (plan.mode, plan.num_processes, plan.process_id) == ("explicit", 2, 1)
    assert plan.coordinator_address == f"127.0.0.1:{61440 + 19269 % 4096}"  # the same for every task of the job
    assert DistributedConfig().resolve(dict(task, SUBMITIT_LOCAL_NTASKS="1")).mode == "single"
    assert DistributedConfig(num_processes=1).resolve(task).mode == "single"  # the config wins


@pytest.mark.parametrize(
    "cfg, environ, key, fix",
    [
        (dict(num_processes=2, process_id=2, coordinator_address="h:1"), {}, "distributed.process_id", "0..1"),
        (dict(num_processes=2, process_id=-1, coordinator_address="h:1"), {}, "distributed.process_id", "0..1"),
        (dict(num_processes=2), {}, "distributed.coordinator_address", "distributed.process_id=..."),
        (dict(num_processes=2, coordinator_address="h:1"), {}, "distributed.process_id", "PTRAIN_PROCESS_ID"),
        (dict(process_id=1), {}, "distributed.num_processes", "distributed.num_processes=N"),
        (dict(coordinator_address="h:1"), {}, "distributed.num_processes", "for a one-process run"),
        (dict(num_processes=0), {}, "distributed.num_processes", ">= 1"),
        (
            dict(num_processes=2, process_id=0, coordinator_address="h"),
            {},
            "distributed.coordinator_address",
            "host:port",
        ),  # fmt: skip
        ({}, {"PTRAIN_NUM_PROCESSES": "two"}, "distributed.num_processes", "PTRAIN_NUM_PROCESSES to a number"),
        ({}, dict(RANKS, PTRAIN_PROCESS_ID="5"), "distributed.process_id", "$PTRAIN_PROCESS_ID"),
        ({}, {"PTRAIN_PROCESS_ID": "0"}, "distributed.num_processes", "unset $PTRAIN_PROCESS_ID"),
    ],
)
def test_values_that_cannot_start_a_job_name_the_key_and_the_fix(cfg, environ, key, fix):
    with pytest.raises(ValueError) as e:
        DistributedConfig(**cfg).resolve(environ)
    assert f"config key '{key}'" in str(e.value) and fix in str(e.value)


def test_compose_refuses_them_before_any_compute(monkeypatch):
    with pytest.raises(ConfigError, match="'distributed.process_id': 3 is not a rank of 2"):
        compose("sft_arithmetic", ["distributed.num_processes=2", "distributed.process_id=3",
                                   "distributed.coordinator_address=127.0.0.1:1"])  # fmt: skip
    monkeypatch.setenv("PTRAIN_NUM_PROCESSES", "2")
    with pytest.raises(ConfigError, match="'distributed.coordinator_address'"):
        compose("sft_arithmetic", ["train.eval_generate=0"])


STAGES = "stages=[{name: sft, kind: sft}, {name: grpo, kind: grpo}]"
FLEET = ["train.eval_generate=0", "rollout=sglang", "rollout.urls=[http://h:1]", STAGES]


@pytest.mark.parametrize(
    "recipe, overrides, key",
    [
        ("sft_arithmetic", [], "train.eval_generate"),  # the exact-match evaluation samples in one process
        ("sft_grpo_arithmetic", ["train.eval_generate=0", STAGES], "rollout.kind"),  # the embedded engine
        ("eval", [], "rollout.kind"),
        ("sft_grpo_arithmetic", [*FLEET, "algo.grpo.mode=async"], "algo.grpo.mode"),
        ("sft_grpo_arithmetic", [*FLEET, "model.lora.rank=4"], "model.lora.rank"),
        ("sft_grpo_arithmetic", [*FLEET[1:], "train.eval_generate=4"], "train.eval_generate"),
        ("sft_dpo_arithmetic", ["train.eval_generate=0"], "algo.dpo.policy_pairs"),
    ],
)
def test_what_does_not_run_as_several_processes_yet_is_refused(monkeypatch, recipe, overrides, key):
    for var, value in RANKS.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        compose(recipe, overrides)
    assert f"config key '{key}'" in str(e.value) and "2 processes" in str(e.value)
    if key == "rollout.kind":
        assert "rollout=sglang" in str(e.value) and "one process" in str(e.value)
    compose(recipe, overrides + ["distributed.num_processes=1"])  # the same as one process is fine


def test_sync_grpo_from_a_fleet_composes_as_several_processes(monkeypatch):
    for var, value in RANKS.items():
        monkeypatch.setenv(var, value)
    run = compose("sft_grpo_arithmetic", FLEET)
    assert [s.kind for s in run.stages] == ["sft", "grpo"] and run.rollout.kind == "sglang"
    run = compose("sft_grpo_arithmetic", FLEET[:-1])  # with the recipe's eval stage: from the fleet too
    assert [s.kind for s in run.stages] == ["sft", "grpo", "eval"]


def test_sft_and_dpo_from_data_compose_as_several_processes(monkeypatch):
    for var, value in RANKS.items():
        monkeypatch.setenv(var, value)
    run = compose("sft_dpo_arithmetic", ["train.eval_generate=0", "algo.dpo.policy_pairs=0"])
    assert [s.kind for s in run.stages] == ["sft", "dpo"]
    assert run.distributed.num_processes is None  # the config keeps what was given; the plan reads the rest
