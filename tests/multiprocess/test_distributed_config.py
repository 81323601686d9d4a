"""The `distributed` group: where the process count and rank come from, and the mistakes that
stop a run before JAX starts (each naming the key or variable and the fix). No JAX here."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ptrain import compose
from ptrain.config import ConfigError
from ptrain.config.distributed import (
    DistributedConfig,
    _metadata_workers,
    detect_launcher,
    gce_tpu_workers,
    tpu_chips_on_pci,
)

RANKS = {"PTRAIN_COORDINATOR": "127.0.0.1:12355", "PTRAIN_NUM_PROCESSES": "2", "PTRAIN_PROCESS_ID": "1"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """The test machine may itself run under Slurm or mpirun: start from a plain environment."""
    for var in (*RANKS, "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri",
                "TPU_SKIP_MDS_QUERY", "MEGASCALE_NUM_SLICES"):  # fmt: skip
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


class _Metadata(BaseHTTPRequestHandler):
    """Compute Engine's metadata server on loopback: the slice's workers, to a request that
    carries the Metadata-Flavor header (the real server refuses others with 403)."""

    workers = "w-0,w-1,w-2,w-3"
    asked: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        type(self).asked.append(self.path)
        found = self.path == "/computeMetadata/v1/instance/attributes/worker-network-endpoints" and self.workers
        status = 403 if self.headers.get("Metadata-Flavor") != "Google" else 200 if found else 404
        body = self.workers.encode() if status == 200 else b"no"
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _pci(root, *functions) -> str:
    """A sysfs PCI device folder holding (vendor, device) functions."""
    for i, (vendor, device) in enumerate(functions):
        (root / f"0000:00:{i:02x}.0").mkdir(parents=True)
        (root / f"0000:00:{i:02x}.0" / "vendor").write_text(vendor + "\n")
        (root / f"0000:00:{i:02x}.0" / "device").write_text(device + "\n")
    return str(root)


def test_a_tpu_vm_slice_on_compute_engine_is_found_through_its_metadata_server(tmp_path, monkeypatch):
    """A host with TPU chips on its PCI bus asks the metadata server for its slice's workers;
    a host without (every other machine, including Compute Engine VMs, whose gVNIC shares
    Google's vendor id) never asks, and takes no network time."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {"GCE_METADATA_IP": f"127.0.0.1:{server.server_address[1]}"}
        gvnic = ("0x1ae0", "0x0042")
        tpu_v5e = _pci(tmp_path / "tpu", gvnic, *[("0x1ae0", "0x0063")] * 4)
        assert tpu_chips_on_pci(tpu_v5e) == 4 and tpu_chips_on_pci(str(tmp_path / "absent")) == 0
        launcher, count = detect_launcher(env, pci_root=tpu_v5e)
        assert count == 4 and launcher == "TPU VM slice on Compute Engine (4 hosts in its metadata)"
        assert detect_launcher(dict(env, MEGASCALE_NUM_SLICES="2"), pci_root=tpu_v5e)[1] == 8  # Multislice
        monkeypatch.setattr("ptrain.config.distributed.PCI_DEVICES", tpu_v5e)
        plan = DistributedConfig().resolve(env)
        assert (plan.mode, plan.num_processes) == ("auto", 4) and "Compute Engine" in plan.launcher
        _Metadata.asked.clear()
        assert detect_launcher(dict(env, TPU_SKIP_MDS_QUERY=""), pci_root=tpu_v5e) == (
            None,
            None,
        )  # set, as JAX reads it
        assert detect_launcher(env, pci_root=_pci(tmp_path / "vm", gvnic, ("0x10de", "0x2335"))) == (None, None)
        assert _Metadata.asked == []  # neither asked the server
        for workers in ("w-0", ""):  # a single-host TPU VM; a VM outside any slice (404)
            monkeypatch.setattr(_Metadata, "workers", workers)
            _metadata_workers.cache_clear()  # asked once per process: this test changes the answer
            assert DistributedConfig().resolve(env).mode == "single"
        monkeypatch.setattr(_Metadata, "workers", "w-0")  # a Multislice of one-host slices
        _metadata_workers.cache_clear()
        assert detect_launcher(dict(env, MEGASCALE_NUM_SLICES="2"), pci_root=tpu_v5e)[1] == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    # no metadata server at all (a TPU host off Compute Engine): one process, within the timeout
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert gce_tpu_workers({"GCE_METADATA_IP": f"127.0.0.1:{port}"}, timeout_s=2.0) == 0


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


def test_every_stage_composes_as_several_processes(monkeypatch):
    """The embedded engine too: it samples in process 0 (ptrain.rollout.engines.PrimaryEngine)."""
    for var, value in RANKS.items():
        monkeypatch.setenv(var, value)
    for recipe in ("sft_arithmetic", "sft_grpo_arithmetic", "eval", "sft_dpo_arithmetic", "rlhf_rm_arithmetic"):
        run = compose(recipe, [])
        assert run.rollout.kind == "local", recipe


def test_grpo_from_a_fleet_composes_as_several_processes(monkeypatch):
    for var, value in RANKS.items():
        monkeypatch.setenv(var, value)
    run = compose("sft_grpo_arithmetic", FLEET)
    assert [s.kind for s in run.stages] == ["sft", "grpo"] and run.rollout.kind == "sglang"
    grpo = "{name: grpo, kind: grpo, train: {eval_generate: 4}}"
    run = compose("sft_grpo_arithmetic", [*FLEET[:-1], f"stages=[{{name: sft, kind: sft}}, {grpo}]",
                                          "algo.grpo.mode=async", "model.lora.rank=4"])  # fmt: skip
    assert run.algo.grpo.mode == "async" and run.model.lora.rank == 4 and run.stages[1].train["eval_generate"] == 4
    run = compose("sft_grpo_arithmetic", FLEET[:-1])  # with the recipe's eval stage: from the fleet too
    assert [s.kind for s in run.stages] == ["sft", "grpo", "eval"]


def test_sft_and_dpo_compose_as_several_processes(monkeypatch):
    """From data, or sampling with the embedded engine in process 0 (on-policy pairs, the
    exact-match evaluation)."""
    for var, value in RANKS.items():
        monkeypatch.setenv(var, value)
    run = compose("sft_dpo_arithmetic", ["train.eval_generate=0", "algo.dpo.policy_pairs=0"])
    assert [s.kind for s in run.stages] == ["sft", "dpo"]
    run = compose("sft_dpo_arithmetic", [])
    assert run.train.eval_generate > 0 and run.algo.dpo.policy_pairs > 0
    assert run.distributed.num_processes is None  # the config keeps what was given; the plan reads the rest
