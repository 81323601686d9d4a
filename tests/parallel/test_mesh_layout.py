"""How devices are laid out in the mesh: TPU Multislice gets a hybrid mesh whose data axis
alone crosses slices; several CPU or GPU processes (one slice_index per host) get a
process-major order. The devices are stand-ins carrying the attributes JAX's devices have
(the layout reads nothing else), so the test runs on one CPU."""

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from ptrain.config import ConfigError, MeshConfig
from ptrain.parallel.mesh import device_array


@dataclass(frozen=True)
class Device:
    id: int
    process_index: int
    slice_index: int = 0
    platform: str = "cpu"
    device_kind: str = "cpu"
    coords: tuple[int, int, int] = (0, 0, 0)
    """A TPU chip's place in its slice's torus (what mesh_utils lays a slice out by)."""
    core_on_chip: int = 0


def ids(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(array)


def slice_of(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.slice_index)(array)


def test_multislice_puts_only_the_data_axis_across_slices():
    # 2 slices x 2 hosts x 4 chips, each slice a 2x2x2 torus; a slice's device ids are contiguous
    devices = [
        Device(i, process_index=i // 4, slice_index=i // 8, platform="tpu", device_kind="TPU test",
               coords=(i % 2, i // 2 % 2, i // 4 % 2))
        for i in range(16)
    ]  # fmt: skip
    layout = device_array(MeshConfig(data=4, fsdp=2, tensor=2), devices)
    assert layout.shape == (4, 2, 1, 2, 1)
    slices = slice_of(layout)
    assert (slices[:2] == 0).all() and (slices[2:] == 1).all()  # the outer half of data is the slice
    # every group that shares a data index (the fsdp x tensor block) lies inside one slice
    assert all(len(np.unique(slices[d])) == 1 for d in range(4))
    assert sorted(ids(layout).ravel()) == list(range(16))
    # on 2x4 tori, fsdp 2 x tensor 2 must split the torus dimension of 4: still laid out
    flat = [dataclasses.replace(d, coords=(d.id % 2, d.id // 2 % 4, 0)) for d in devices]
    assert slice_of(device_array(MeshConfig(data=4, fsdp=2, tensor=2), flat))[:2].max() == 0
    with pytest.raises(ConfigError, match=r"'mesh.data': 1 does not split over the 2 TPU slices.*multiple of 2"):
        device_array(MeshConfig(data=1, fsdp=16), devices)


def test_several_processes_without_slices_are_ordered_process_major():
    # a second CPU process's device ids start far from the first's; GPU and CPU devices carry a
    # slice_index per host, which is no TPU slice and must not make a hybrid mesh
    devices = [Device(2048 + i, process_index=1, slice_index=1) for i in range(4)]
    devices += [Device(i, process_index=0, slice_index=0) for i in range(4)]
    layout = device_array(MeshConfig(data=2, fsdp=4), devices)
    assert ids(layout).reshape(2, 4).tolist() == [[0, 1, 2, 3], [2048, 2049, 2050, 2051]]
