"""Device mesh from MeshConfig, and multi-host start-up."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from ptrain.config import ConfigError
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
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(device_array(cfg, devices), MESH_AXES, axis_types=axis_types)


def device_array(cfg: MeshConfig, devices) -> np.ndarray:
    """The devices laid out in the mesh's shape.

    TPU Multislice (devices of several slices, told apart by `slice_index`): a hybrid mesh.
    Slices are joined by the data-centre network (DCN), far slower than the inter-chip links
    (ICI) inside a slice, so only the outer `data` axis crosses slices, split into
    (slices x data / slices), and every other axis stays inside one slice, laid out there by
    its physical topology (mesh_utils.create_hybrid_device_mesh, as MaxText does)."""
    shape = resolve_mesh_shape(cfg, len(devices))
    # GPU and CPU devices carry a slice_index too (one per host): only TPU slices are joined by DCN
    slices = len({getattr(d, "slice_index", 0) for d in devices}) if devices[0].platform == "tpu" else 1
    if slices > 1:
        if shape[0] % slices:
            raise ConfigError(
                f"config key 'mesh.data': {shape[0]} does not split over the {slices} TPU slices of this job; only the data "
                f"axis crosses slices (their DCN links are slow for the others), so pass a mesh.data that is a "
                f"multiple of {slices} (the other axes then stay inside one slice)"
            )
        from jax.experimental import mesh_utils

        ici = (shape[0] // slices, *shape[1:])
        dcn = (slices,) + (1,) * (len(shape) - 1)
        try:
            return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        except NotImplementedError:  # mesh_utils' answer when an axis size is no product of torus dimensions
            return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    if len({d.process_index for d in devices}) > 1 and devices[0].platform != "tpu":
        # Several processes (hosts): process-major order, so the outer axes (data first) cross
        # processes and the inner ones (fsdp, context, tensor, expert) stay on one host's fast links
        # where they fit. Device ids say nothing of the order (a second CPU process's start
        # at 2048); TPU pods keep mesh_utils, which knows their physical topology.
        return np.asarray(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
    try:
        from jax.experimental import mesh_utils

        return mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # irregular device sets (e.g. CPU host devices): plain reshape is fine
        return np.asarray(devices).reshape(shape)


def maybe_initialize_distributed() -> None:
    """Join a multi-process job described by the PTRAIN_* variables or a launcher (the
    `distributed` config group's fallbacks, ptrain.config.distributed); nothing for one
    process. Runs take the group from their config: ptrain.parallel.multihost.initialize."""
    from ptrain.config.distributed import DistributedConfig
    from ptrain.parallel.multihost import initialize

    initialize(DistributedConfig())
