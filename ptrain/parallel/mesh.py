"""Device mesh from MeshConfig, and multi-host start-up."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from ptrain.config.choices import MESH_AXES
from ptrain.config.mesh import MeshConfig
from ptrain.config.run import resolve_mesh_shape


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A 4-axis mesh (data, fsdp, tensor, expert) over all devices, in Auto axis mode.

    Auto (not Explicit) axes: the model is written with logical names and jit shardings,
    the classic GSPMD style; `jax.make_mesh` would default to Explicit axes.
    """
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(cfg, len(devices))
    try:
        from jax.experimental import mesh_utils

        dev_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # irregular device sets (e.g. CPU host devices): plain reshape is fine
        dev_array = np.asarray(devices).reshape(shape)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(dev_array, MESH_AXES, axis_types=axis_types)


def maybe_initialize_distributed() -> None:
    """Call jax.distributed.initialize() when launched as one process of many.

    Cloud TPU and SLURM/GPU launchers set the variables jax reads itself; a manual
    launch sets PTRAIN_COORDINATOR, PTRAIN_NUM_PROCESSES and PTRAIN_PROCESS_ID.
    """
    if os.environ.get("PTRAIN_COORDINATOR"):
        jax.distributed.initialize(
            coordinator_address=os.environ["PTRAIN_COORDINATOR"],
            num_processes=int(os.environ["PTRAIN_NUM_PROCESSES"]),
            process_id=int(os.environ["PTRAIN_PROCESS_ID"]),
        )
    elif os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()
