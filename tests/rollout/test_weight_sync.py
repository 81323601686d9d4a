"""Weight export for the fleet, on a real tiny model: the folder loads like a save_hf folder
(float32 byte for byte, bfloat16 as the rounded weights), the manifest catches damage, shards
written by two "hosts" in parallel make the same folder, a version folder appears only when
complete (an export SIGKILLed halfway leaves nothing a worker could load), pruning keeps
the newest versions, and two runs sharing a rollout.weight_dir keep to their own versions."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from ptrain.models import Decoder, load_hf, save_hf
from ptrain.models.safetensors_io import open_folder
from ptrain.rollout.protocol import EngineUnavailable
from ptrain.rollout.weight_sync import (
    WeightSyncError,
    export_weights,
    list_versions,
    prune_versions,
    read_manifest,
    version_folder,
)
from ptrain.train.state import split_model
from tests.rollout.conftest import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = dataclasses.replace(TINY, vocab_size=300)


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def parts(model):
    _, params, model_state = split_model(model)
    return params, model_state


def tensors(folder: str) -> dict[str, np.ndarray]:
    files = open_folder(folder)
    return {name: np.array(f.get(name)) for name, f in files.items()}


def test_float32_export_equals_save_hf_and_loads_back(model, parts, tmp_path):
    params, model_state = parts
    result = export_weights(CFG, params, model_state, str(tmp_path / "w"), "1", dtype="float32")
    assert result.path == version_folder(str(tmp_path / "w"), "1") and os.path.isdir(result.path)
    save_hf(model, str(tmp_path / "ref"))
    ours, ref = tensors(result.path), tensors(str(tmp_path / "ref"))
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype and np.array_equal(ours[name], ref[name]), name
    manifest = read_manifest(result.path, check_data=True)
    assert manifest["version"] == "1" and manifest["dtype"] == "float32"
    assert set(manifest["tensors"]) == set(ref) and manifest["total_bytes"] == result.bytes
    loaded = split_model(load_hf(result.path))[1]
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_export_holds_the_rounded_weights(parts, tmp_path):
    params, model_state = parts
    result = export_weights(CFG, params, model_state, str(tmp_path), "7", dtype="bfloat16")
    ours = tensors(result.path)
    ref = tensors(export_weights(CFG, params, model_state, str(tmp_path), "8", dtype="float32").path)
    for name, arr in ours.items():
        assert arr.dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(arr, ref[name].astype(ml_dtypes.bfloat16))
    assert result.bytes * 2 == read_manifest(version_folder(str(tmp_path), "8"))["total_bytes"]


def test_sharded_export_has_an_index_and_loads(parts, tmp_path):
    params, model_state = parts
    result = export_weights(CFG, params, model_state, str(tmp_path), "s", dtype="float32", max_shard_bytes=40_000)
    assert len(result.files) > 2 and os.path.isfile(os.path.join(result.path, "model.safetensors.index.json"))
    read_manifest(result.path, check_data=True)
    loaded = split_model(load_hf(result.path))[1]
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_hosts_write_their_own_shards_into_one_folder(parts, tmp_path):
    params, model_state = parts
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def host(i: int) -> None:
        try:
            results[i] = export_weights(
                CFG, params, model_state, str(tmp_path / "multi"), "3", dtype="float32", max_shard_bytes=60_000,
                process_index=i, process_count=2, barrier=lambda _name: barrier.wait(60),
            )  # fmt: skip
        except BaseException as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    folder = results[0].path
    manifest = read_manifest(folder, check_data=True)
    shards = sorted(manifest["files"])
    assert results[0].bytes + results[1].bytes == manifest["total_bytes"] and len(shards) >= 2
    assert not [n for n in os.listdir(folder) if n.startswith("host-")], "per-host manifests must be merged away"
    single = tensors(export_weights(CFG, params, model_state, str(tmp_path / "one"), "3", dtype="float32").path)
    multi = tensors(folder)
    assert sorted(multi) == sorted(single)
    for name in single:
        np.testing.assert_array_equal(multi[name], single[name])


def test_the_manifest_catches_a_damaged_folder(parts, tmp_path):
    params, model_state = parts
    folder = export_weights(CFG, params, model_state, str(tmp_path), "1", dtype="float32").path
    manifest = read_manifest(folder)
    name, entry = next(iter(manifest["tensors"].items()))
    path = os.path.join(folder, entry["file"])
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    with open(path, "r+b") as f:  # flip one byte of the first tensor
        f.seek(8 + header_len + entry["data_offsets"][0])
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    read_manifest(folder)  # sizes and headers still agree
    with pytest.raises(WeightSyncError, match=f"{name} has sha256"):
        read_manifest(folder, check_data=True)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(WeightSyncError, match="the manifest says"):
        read_manifest(folder)
    os.remove(os.path.join(folder, "manifest.json"))
    with pytest.raises(WeightSyncError, match="not a complete ptrain weight export"):
        read_manifest(folder)


def test_bad_versions_and_dtypes_are_refused_before_writing(parts, tmp_path):
    params, model_state = parts
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(WeightSyncError, match="cannot name a folder"):
            export_weights(CFG, params, model_state, str(tmp_path), bad)
    with pytest.raises(WeightSyncError, match="pass one of"):
        export_weights(CFG, params, model_state, str(tmp_path), "1", dtype="float16")
    assert not os.listdir(tmp_path)


def test_a_weight_dir_that_cannot_be_written_stops_the_stage_naming_it(parts, tmp_path):
    """A full disk midway (simulated from on_tensor) or a weight_dir under a file: a
    WeightSyncError naming the folder and the fix, which a stage treats as an engine that
    cannot sample (a resumable checkpoint, then a stop), with no half-written folder left."""
    params, model_state = parts
    weight_dir = str(tmp_path / "weights")

    def disk_full(name):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WeightSyncError, match=r"weights: writing weight version 3 failed \(No space left on device\)"):
        export_weights(CFG, params, model_state, weight_dir, "3", dtype="float32", on_tensor=disk_full)
    assert os.listdir(weight_dir) == []
    (tmp_path / "a_file").write_text("")
    with pytest.raises(WeightSyncError, match="point rollout.weight_dir at a writable folder") as e:
        export_weights(CFG, params, model_state, str(tmp_path / "a_file" / "weights"), "3")
    assert isinstance(e.value, EngineUnavailable)


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from flax import nnx
    from ptrain.models import Decoder
    from ptrain.rollout.weight_sync import export_weights
    from ptrain.train.state import split_model
    from tests.rollout.test_weight_sync import CFG
    _, params, state = split_model(Decoder(CFG, rngs=nnx.Rngs(5)))
    written = []

    def die_halfway(name):
        written.append(name)
        if len(written) == 6:
            os.kill(os.getpid(), signal.SIGKILL)

    export_weights(CFG, params, state, sys.argv[1], sys.argv[2], dtype="float32", on_tensor=die_halfway)
    """
)


def test_an_export_killed_halfway_leaves_no_version_and_the_next_one_succeeds(parts, tmp_path):
    params, model_state = parts
    weight_dir = str(tmp_path / "weights")
    export_weights(CFG, params, model_state, weight_dir, "4", dtype="float32")
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT.format(root=ROOT), weight_dir, "5"], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    partial = os.path.join(weight_dir, ".v5.partial")
    assert os.path.isdir(partial) and os.listdir(partial), "the killed export should have started writing"
    assert not os.path.exists(version_folder(weight_dir, "5"))
    assert [v for _, v, _ in list_versions(weight_dir)] == ["4"]
    result = export_weights(CFG, params, model_state, weight_dir, "5", dtype="float32")
    read_manifest(result.path, check_data=True)
    assert not os.path.exists(partial)


def test_reexporting_a_version_replaces_it_and_pruning_keeps_the_newest(parts, tmp_path):
    params, model_state = parts
    weight_dir = str(tmp_path)
    for v in ("1", "2", "3"):
        export_weights(CFG, params, model_state, weight_dir, v, dtype="bfloat16")
    other = jax.tree.map(lambda x: x + 1, params)
    again = export_weights(CFG, other, model_state, weight_dir, "2", dtype="float32")
    assert read_manifest(again.path)["dtype"] == "float32"
    os.makedirs(os.path.join(weight_dir, ".v9.partial"))  # a dead export of another version
    assert prune_versions(weight_dir, keep=2, current="2") == ["1"]
    assert sorted(v for _, v, _ in list_versions(weight_dir)) == ["2", "3"]
    assert not [n for n in os.listdir(weight_dir) if n.startswith(".")]


def test_two_runs_on_one_weight_dir_never_replace_or_prune_each_others_versions(parts, tmp_path):
    """Two runs with the same rollout.weight_dir, exporting and pruning after every step as
    FleetEngine.update_weights does. Into the one folder, run B's prune deleted run A's newest
    versions (A's current one too) and B's v3 replaced A's v3; each now writes under its own
    folder of that root, and a resumed run (same stage folder) finds its own again."""
    from ptrain.config import RunConfig
    from ptrain.rollout.engines import fleet_weight_dir

    params, model_state = parts
    root = str(tmp_path / "shm")
    runs = {}
    for name in ("a", "b"):
        run = RunConfig(name=name, run_dir=str(tmp_path / "runs" / name))
        run.rollout.weight_dir = root
        runs[name] = (run, os.path.join(run.run_dir, "stages", "grpo"))
    dirs = {name: fleet_weight_dir(run, stage) for name, (run, stage) in runs.items()}
    assert dirs["a"] != dirs["b"] and all(os.path.dirname(d) == root for d in dirs.values())
    assert os.path.basename(dirs["a"]).startswith("a-grpo-")
    run_a, stage_a = runs["a"]
    resumed = RunConfig(name="a", run_dir=run_a.run_dir)  # the same run launched again
    resumed.rollout.weight_dir = root + "/"
    assert fleet_weight_dir(resumed, stage_a + "/") == dirs["a"]
    assert fleet_weight_dir(RunConfig(run_dir=run_a.run_dir), stage_a) == os.path.join(stage_a, "weights")

    weights = {"a": params, "b": jax.tree.map(lambda x: x + 1, params)}
    for v in ("1", "2", "3"):  # A runs three steps, then B three more alongside it
        export_weights(CFG, weights["a"], model_state, dirs["a"], v, dtype="float32")
        prune_versions(dirs["a"], keep=2, current=v)
    for v in ("1", "2", "3"):
        export_weights(CFG, weights["b"], model_state, dirs["b"], v, dtype="float32")
        assert prune_versions(dirs["b"], keep=2, current=v) == ([] if v != "3" else ["1"])

    def digests(folder):
        return {k: e["sha256"] for k, e in read_manifest(folder, check_data=True)["tensors"].items()}

    for name in ("a", "b"):
        assert sorted(v for _, v, _ in list_versions(dirs[name])) == ["2", "3"]
        want = digests(export_weights(CFG, weights[name], model_state, str(tmp_path / f"ref-{name}"), "0",
                                      dtype="float32").path)  # fmt: skip
        for v in ("2", "3"):
            assert digests(version_folder(dirs[name], v)) == want, (name, v)  # its own weights, not the other's
    assert list_versions(root) == []  # nothing at the root that a run would prune


def test_bench_weight_sync_runs_on_the_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_weight_sync.py", "--models", "tiny", "--repeat", "1", "--workers", "0",
         "--weight-dir", str(tmp_path / "w"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    tiny = report["results"]["tiny"]
    assert tiny["bytes"] > 0 and tiny["export_gbps"] > 0 and tiny["disk_gbps"] > 0
    assert report["facts"]["cpu"] and report["qwen3_30b_a3b"]["export_s"] > 0
    assert "Qwen3-30B-A3B" in proc.stdout


def test_bench_weight_sync_compares_the_adapter_push_with_the_full_push(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_weight_sync.py", "--models", "tiny", "--repeat", "1", "--workers", "1",
         "--lora", "4", "--weight-dir", str(tmp_path / "w"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tiny = json.loads(out.read_text())["results"]["tiny"]
    assert 0 < tiny["lora_bytes"] < tiny["bytes"] and tiny["lora_bytes_ratio"] < 0.1
    assert tiny["lora_push_wall_s"] > 0 and tiny["push_wall_s"] > 0 and tiny["lora_seconds_ratio"] > 0
    assert "LoRA rank 4 adapter push" in proc.stdout and "ratio" in proc.stdout


def test_an_export_without_checksums_still_checks_sizes_and_headers(parts, tmp_path):
    params, model_state = parts
    folder = export_weights(CFG, params, model_state, str(tmp_path), "1", dtype="float32", checksums=False).path
    manifest = read_manifest(folder)
    assert manifest["checksums"] is None and all(e["sha256"] is None for e in manifest["tensors"].values())
    with pytest.raises(WeightSyncError, match="without checksums"):
        read_manifest(folder, check_data=True)
