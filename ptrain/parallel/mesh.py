"""Device mesh from MeshConfig, and multi-host start-up."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from ptrain.config.choices import MESH_AXES
from ptrain.config.mesh import MeshConfig
from ptrain.config.run import resolve_mesh_shape


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A mesh with the axes of choices.MESH_AXES (data, fsdp, context, tensor, expert) over
    all devices, in Auto axis mode.

    Auto (not Explicit) axes: the model is written with logical names and jit shardings,
    the classic GSPMD style; `jax.make_mesh` would default to Explicit axes.
    """
    devices = jax.devices() if devices is None else devices
    shape = resolve_mesh_shape(cfg, len(devices))
    if len({d.process_index for d in devices}) > 1 and devices[0].platform != "tpu":
        # Several processes (hosts): process-major order, so the outer axes (data first) cross
        # processes and the inner ones (fsdp, context, tensor, expert) stay on one host's fast links
        # where they fit. Device ids say nothing of the order (a second CPU process's start
        # at 2048); TPU pods keep mesh_utils, which knows their physical topology.
        dev_array = np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
    else:
        try:
            from jax.experimental import mesh_utils

            dev_array = mesh_utils.create_device_mesh(shape, devices=devices)
        except Exception:  # irregular device sets (e.g. CPU host devices): plain reshape is fine
            dev_array = np.asarray(devices).reshape(shape)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(dev_array, MESH_AXES, axis_types=axis_types)


def maybe_initialize_distributed() -> None:
    """Join a multi-process job described by the PTRAIN_* variables or a launcher (the
    `distributed` config group's fallbacks, ptrain.config.distributed); nothing for one
    process. Runs take the group from their config: ptrain.parallel.multihost.initialize."""
    from ptrain.config.distributed import DistributedConfig
    from ptrain.parallel.multihost import initialize

    initialize(DistributedConfig())
