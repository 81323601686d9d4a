"""How many JAX processes a run is, and which one this is (`distributed.*`).

Jax-free: the values are resolved and checked with the rest of the config, before any
backend starts; `ptrain.parallel.multihost.initialize` then hands them to
`jax.distributed.initialize`.

Where the values come from, first match wins, key by key:
  1. the config: `distributed.num_processes=2 distributed.process_id=0
     distributed.coordinator_address=host:port` (command line or recipe);
  2. the environment: PTRAIN_NUM_PROCESSES, PTRAIN_PROCESS_ID, PTRAIN_COORDINATOR (what
     `tools/launch_local.py` sets for each process it starts);
  3. a launcher, when all three are null: an srun step of a Slurm job with SLURM_NTASKS > 1,
     an Open MPI job (mpirun -np N with N > 1), a TPU slice of several hosts on GKE or on
     Compute Engine TPU VMs, or a Kubernetes JobSet, which `jax.distributed.initialize()`
     reads by itself; or a job of submitit's local executor with more than one task (Hydra's
     `hydra/launcher=submitit_local`), whose ranks come from its SUBMITIT_LOCAL_* variables
     and whose coordinator is on loopback (submitit on Slurm runs srun, which is the first);
  4. otherwise one process.
`distributed.num_processes=1` forces one process even under such a launcher.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VARS = {
    "coordinator_address": "PTRAIN_COORDINATOR",
    "num_processes": "PTRAIN_NUM_PROCESSES",
    "process_id": "PTRAIN_PROCESS_ID",
}
"""The environment variable each key falls back to when it is null."""


@dataclass
class DistributedConfig:
    coordinator_address: str | None = None
    """host:port where process 0 serves the coordination service, reachable from every
    process (e.g. 127.0.0.1:<free port> on one machine, the first node's name on Slurm);
    null: $PTRAIN_COORDINATOR, else the launcher's (item 3 of the module docstring)."""
    num_processes: int | None = None
    """Processes in the job (>= 1; one per host, or one per GPU); null: $PTRAIN_NUM_PROCESSES,
    else the launcher's, else 1. The mesh spans the devices of all of them."""
    process_id: int | None = None
    """This process's rank, 0 <= process_id < num_processes; process 0 writes the run's
    files (metrics, exports, DONE.json). null: $PTRAIN_PROCESS_ID, else the launcher's."""

    def resolve(self, environ: Mapping[str, str] = os.environ) -> DistributedPlan:
        """The effective setting: config keys, then PTRAIN_* variables, then a detected
        launcher. ValueError naming the key (or variable) and the fix for values that cannot
        start a job: a rank out of range, or some of the three given without the others."""
        given: dict[str, object] = {}
        source: dict[str, str] = {}  # for messages: "" from the config, " (from $VAR)" from the environment
        for key, var in ENV_VARS.items():
            value = getattr(self, key)
            if value is not None:
                given[key], source[key] = value, ""
            elif environ.get(var, "").strip():
                text = environ[var].strip()
                if key != "coordinator_address":
                    try:
                        value = int(text)
                    except ValueError:
                        raise ValueError(
                            f"config key 'distributed.{key}': ${var}={text!r} is not an integer; "
                            f"set {var} to a number, or unset it"
                        ) from None
                given[key], source[key] = value if key != "coordinator_address" else text, f" (from ${var})"
        if not given:
            local = submitit_local_plan(environ)
            if local is not None:
                return local
            launcher, count = detect_launcher(environ)
            if launcher is None:
                return DistributedPlan("single", num_processes=1, process_id=0)
            return DistributedPlan("auto", num_processes=count, launcher=launcher)
        n = given.get("num_processes")
        if n is None:
            have = " and ".join(f"${ENV_VARS[k]}" if source[k] else f"distributed.{k}" for k in given)
            raise ValueError(
                f"config key 'distributed.num_processes': {have} is set but not the number of processes; "
                f"pass distributed.num_processes=N (or set {ENV_VARS['num_processes']}), or unset {have} "
                "for a one-process run"
            )
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"config key 'distributed.num_processes': must be >= 1, got {n}{source['num_processes']}")
        pid = given.get("process_id")
        if n == 1 and (pid is None or source["process_id"]):
            return DistributedPlan("single", num_processes=1, process_id=0)  # whatever ranks a launcher set
        if pid is not None and (not isinstance(pid, int) or not 0 <= pid < n):
            raise ValueError(
                f"config key 'distributed.process_id': {pid}{source['process_id']} is not a rank of "
                f"{n} processes; pass 0..{n - 1} (process 0 hosts the coordinator)"
            )
        if n == 1:
            return DistributedPlan("single", num_processes=1, process_id=0)
        missing = [k for k in ("coordinator_address", "process_id") if k not in given]
        if missing:
            hint = " ".join(f"distributed.{k}=..." for k in missing)
            env = " / ".join(ENV_VARS[k] for k in missing)
            raise ValueError(
                f"config key 'distributed.{missing[0]}': a job of {n} processes{source['num_processes']} "
                f"needs every process's rank and the coordinator's host:port; pass {hint} (or set {env}); "
                "tools/launch_local.py sets all three for the processes it starts"
            )
        address = str(given["coordinator_address"])
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"config key 'distributed.coordinator_address': {address!r}{source['coordinator_address']} must "
                "be host:port, e.g. 127.0.0.1:12355 (process 0's machine and a free port)"
            )
        return DistributedPlan("explicit", num_processes=n, process_id=int(pid), coordinator_address=address)


@dataclass(frozen=True)
class DistributedPlan:
    """A resolved `distributed` setting."""

    mode: str
    """single (one process, no jax.distributed), explicit (the three values are known) or
    auto (jax.distributed.initialize() reads the launcher's environment)."""
    num_processes: int | None = None
    """Processes in the job; None when the launcher's environment does not say."""
    process_id: int | None = None
    """This process's rank; None under a launcher until JAX has read it."""
    coordinator_address: str | None = None
    launcher: str | None = None
    """The detected launcher, for messages (auto mode)."""


PCI_DEVICES = "/sys/bus/pci/devices"
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
"""PCI device ids of Cloud TPU chips (vendor Google), v3 to TPU7x: the list JAX checks before
it asks the metadata server. Google's other PCI functions (the gVNIC network card of every
Compute Engine VM) share the vendor id, so the vendor alone says nothing."""


def tpu_chips_on_pci(root: str = PCI_DEVICES) -> int:
    """TPU chips attached to this host, read from sysfs (0 where there is no sysfs)."""
    chips = 0
    try:
        functions = os.listdir(root)
    except OSError:
        return 0
    for function in functions:
        try:
            with open(os.path.join(root, function, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(root, function, "device")) as f:
                device = f.read().strip()
        except OSError:
            continue
        chips += vendor == GOOGLE_PCI_VENDOR and device in TPU_PCI_DEVICES
    return chips


def gce_tpu_workers(environ: Mapping[str, str] = os.environ, timeout_s: float = 5.0) -> int:
    """Hosts of this TPU VM's slice: the entries of the metadata attribute
    worker-network-endpoints (GCE_METADATA_IP overrides the server's address, as for JAX).
    0 when the server does not answer, or answers without the attribute: a TPU VM outside a
    slice, or a machine that is not on Compute Engine. Asked once per address and process
    (every stage resolves the config again)."""
    host = environ.get("GCE_METADATA_IP", "metadata.google.internal")
    return _metadata_workers(f"http://{host}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
                             timeout_s)  # fmt: skip


@functools.lru_cache(maxsize=8)
def _metadata_workers(url: str, timeout_s: float) -> int:
    import httpx

    try:
        reply = httpx.get(url, headers={"Metadata-Flavor": "Google"}, timeout=timeout_s)
    except httpx.HTTPError:
        return 0
    if reply.status_code != 200:
        return 0
    return len([w for w in reply.text.split(",") if w.strip()])


def detect_launcher(
    environ: Mapping[str, str] = os.environ, pci_root: str | None = None
) -> tuple[str | None, int | None]:
    """(launcher name, number of processes or None where the environment does not say) of a
    multi-process launch that `jax.distributed.initialize()` configures itself; (None, None)
    otherwise.

    Slurm counts only inside a job step (srun sets SLURM_STEP_NODELIST, which JAX reads), so
    a one-task script in a many-task allocation stays one process. Open MPI: JAX reads
    OMPI_MCA_orte_hnp_uri, which mpirun sets. A TPU slice of several hosts on GKE: the worker
    list GKE sets, one process per host. A Kubernetes JobSet: JAX finds the other pods through
    the Kubernetes API. TPU VMs of a slice on Compute Engine: only on a host with TPU chips
    on its PCI bus is the metadata server asked for the slice's workers (as JAX does), so no
    other machine waits on the network; several slices (Multislice, MEGASCALE_NUM_SLICES)
    multiply the count.
    """

    def count(var: str) -> int:
        try:
            return int(environ.get(var, "1"))
        except ValueError:
            return 1

    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_NODELIST") and count("SLURM_NTASKS") > 1:
        return f"Slurm (SLURM_NTASKS={count('SLURM_NTASKS')})", count("SLURM_NTASKS")
    if environ.get("OMPI_MCA_orte_hnp_uri") and count("OMPI_COMM_WORLD_SIZE") > 1:
        return f"Open MPI (OMPI_COMM_WORLD_SIZE={count('OMPI_COMM_WORLD_SIZE')})", count("OMPI_COMM_WORLD_SIZE")
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return f"TPU slice on GKE ({len(hosts)} hosts in TPU_WORKER_HOSTNAMES)", len(hosts)
    if environ.get("TPU_SKIP_MDS_QUERY") is None and tpu_chips_on_pci(pci_root or PCI_DEVICES):
        workers = gce_tpu_workers(environ)
        slices = count("MEGASCALE_NUM_SLICES")
        if workers and workers * slices > 1:  # several hosts, or a Multislice of one-host slices
            across = f" x {slices} slices" if slices > 1 else ""
            return f"TPU VM slice on Compute Engine ({workers} hosts{across} in its metadata)", workers * slices
    if environ.get("KUBERNETES_SERVICE_HOST") and environ.get("JOBSET_NAME"):
        # JAX asks the Kubernetes API for the JobSet's pods (pip install "jax[k8s]")
        return f"Kubernetes JobSet {environ['JOBSET_NAME']!r}", None
    return None, None


SUBMITIT_LOCAL_PORTS = (61440, 4096)
"""Coordinator ports of submitit local jobs: first + job id % count (JAX's own rule for Slurm),
so that the tasks of one job agree on it without talking and concurrent jobs rarely share one."""


def submitit_local_plan(environ: Mapping[str, str] = os.environ) -> DistributedPlan | None:
    """The explicit plan of a task of a submitit local job with more than one task (all on
    this machine), or None. JAX does not read submitit's variables, so the ranks come from
    them here, and the coordinator is process 0 on loopback."""
    try:
        n = int(environ.get("SUBMITIT_LOCAL_NTASKS", "1"))
        rank = int(environ.get("SUBMITIT_LOCAL_GLOBALID", "0"))
        job = int(environ.get("SUBMITIT_LOCAL_JOB_ID", "").split("_")[0] or "0")
    except ValueError:
        return None
    if not environ.get("SUBMITIT_LOCAL_JOB_ID") or n < 2:
        return None
    first, count = SUBMITIT_LOCAL_PORTS
    return DistributedPlan(
        "explicit",
        num_processes=n,
        process_id=rank,
        coordinator_address=f"127.0.0.1:{first + job % count}",
        launcher=f"submitit local (SUBMITIT_LOCAL_NTASKS={n})",
    )
