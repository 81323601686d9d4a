"""The same SFT steps (full and LoRA) on one device and on a 2 x 2 x 2 (data, fsdp, tensor) mesh of 8
host devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ptrain.parallel import logical_to_spec

HERE = os.path.dirname(__file__)


@pytest.mark.multidevice
def test_eight_host_devices_match_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "multidevice_steps.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got["one_device"], got["data2_fsdp2_tensor2"], rtol=2e-5)
    specs = got["placements"]
    # the params really are spread: some over fsdp, some over tensor
    assert any("fsdp" in s for s in specs.values()), specs
    assert any("tensor" in s for s in specs.values()), specs
    # LoRA on the same mesh: the same losses, adapters sharded by the axes of their weights
    np.testing.assert_allclose(got["lora_one_device"], got["lora_data2_fsdp2_tensor2"], rtol=2e-5)
    assert got["lora_one_device"][-1] < got["lora_one_device"][0]
    lora = got["lora_placements"]
    assert all(k.endswith(("/a", "/b")) for k in lora), lora  # the trainable state is the adapters alone
    assert any("fsdp" in s for k, s in lora.items() if k.endswith("/a")), lora  # A keeps the input axis
    assert any("tensor" in s for k, s in lora.items() if k.endswith("/b")), lora  # B keeps the output axis


class FakeMesh:
    shape = {"data": 2, "fsdp": 2, "tensor": 4, "expert": 1}


def test_logical_rules_use_each_mesh_axis_once_and_only_where_it_divides():
    assert tuple(logical_to_spec(("embed", "mlp"), (64, 128), FakeMesh())) == ("fsdp", "tensor")
    # heads=6 is not divisible by tensor=4: that dimension stays replicated
    assert tuple(logical_to_spec(("embed", "heads", "head_dim"), (64, 6, 8), FakeMesh())) == ("fsdp", None, None)
    # a mesh axis is never used twice in one array
    assert tuple(logical_to_spec(("mlp", "heads"), (8, 8), FakeMesh())) == ("tensor", None)
    assert tuple(logical_to_spec((None, "vocab"), (3, 64), FakeMesh())) == (None, "tensor")
