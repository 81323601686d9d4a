"""HF folder IO without torch: config mapping, sharded files, clear errors, Orbax convert."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain.config.model import ModelConfig
from ptrain.models import Decoder, config_from_hf, config_to_hf, load_hf, save_hf
from ptrain.models.safetensors_io import SafetensorsFile, save_file

CFG = ModelConfig(
    family="qwen2",
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    qk_norm=False,
    qkv_bias=True,
    tie_embeddings=False,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "m")
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    save_hf(model, path, max_shard_bytes=20_000)
    return path, model


def _logits(model, ids):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids))


def test_config_round_trip_and_sharded_layout(folder):
    path, model = folder
    files = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in files and "model-00001-of-" in files[1] and "config.json" in files
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["model_type"] == "qwen2"
    back = config_from_hf(hf, dtype=CFG.dtype)
    assert dataclasses.replace(back, init_std=CFG.init_std, max_seq_len=CFG.max_seq_len) == CFG
    loaded = load_hf(path)
    ids = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(model, ids))


def test_bfloat16_files_load_into_float32_master_weights(folder, tmp_path):
    _, model = folder
    save_hf(model, str(tmp_path), dtype="bfloat16")
    f = SafetensorsFile(str(tmp_path / "model.safetensors"))
    assert f.info("model.embed_tokens.weight")[0] == "BF16"
    loaded = load_hf(str(tmp_path))
    assert loaded.embed[...].dtype == jnp.float32
    np.testing.assert_allclose(loaded.embed[...], model.embed[...], rtol=1e-2, atol=1e-3)


def _copy_with(path, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if edit_config:
        edit_config(hf)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    tensors = {}
    for fn in os.listdir(path):
        if fn.endswith(".safetensors"):
            sf = SafetensorsFile(os.path.join(path, fn))
            tensors.update({k: np.array(sf.get(k)) for k in sf.keys()})
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "edit_tensors,edit_config,match",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
            None,
            r"model\.layers\.1\.self_attn\.k_proj\.weight \[16, 32\]",
        ),
        (
            lambda t: t.update({"model.norm.weight": np.zeros((31,), np.float32)}),
            None,
            r"'model\.norm\.weight': shape \[31\] in the checkpoint, expected \[32\]",
        ),
        (lambda t: t.update({"model.norm.weight": np.zeros((32,), np.int32)}), None, r"model\.norm\.weight.*dtype I32"),
        (
            lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros((32,), np.float32)}),
            None,
            r"does not explain.*o_proj\.bias",
        ),
        (None, lambda c: c.update(model_type="gpt2"), r"model_type 'gpt2' is not supported"),
        (None, lambda c: c.update(model_type="deepseek_v3"), r"multi-head latent attention"),
        (None, lambda c: c.update(hidden_act="gelu"), r"hidden_act 'gelu'"),
        (
            None,
            lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
            r"rope scaling type 'yarn'",
        ),
    ],
)
def test_bad_checkpoints_fail_naming_the_problem(folder, tmp_path, edit_tensors, edit_config, match):
    path, _ = folder
    bad = _copy_with(path, str(tmp_path / "bad"), edit_tensors, edit_config)
    with pytest.raises(ValueError, match=match):
        load_hf(bad)


@pytest.mark.parametrize(
    "damage, match",
    [
        ("truncate", r"tensor .* needs bytes .* the file is truncated"),
        ("header", r"safetensors header is not valid JSON"),
        ("config", r"config.json is not valid JSON"),
        ("no_hidden_size", r"lacks hidden_size"),
    ],
)
def test_damaged_files_fail_naming_file_and_cause(folder, tmp_path, damage, match):
    """A cut-off download, a garbled header or config, a config without its sizes: each names
    the file (and the tensor) instead of failing later as a reshape or decode error."""
    path, _ = folder
    bad = _copy_with(
        path,
        str(tmp_path / "bad"),
        edit_config=(lambda c: c.pop("hidden_size")) if damage == "no_hidden_size" else None,
    )
    weights = os.path.join(bad, "model.safetensors")
    if damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) - 100)
    elif damage == "header":
        with open(weights, "r+b") as f:
            f.seek(8)
            f.write(b"\xff\xfe\x00garbage")
    elif damage == "config":
        with open(os.path.join(bad, "config.json"), "a") as f:
            f.write("}{")
    with pytest.raises(ValueError, match=match):
        load_hf(bad)


def test_legacy_rope_type_key_survives_a_save(folder):
    """`rope_scaling={type: linear}` (the pre-4.45 key) is written as rope_type, so the saved
    folder reloads with its scaling instead of none."""
    legacy = dataclasses.replace(CFG, rope_scaling={"type": "linear", "factor": 2.0})
    hf = json.loads(json.dumps(config_to_hf(legacy)))
    assert hf["rope_parameters"]["rope_type"] == "linear" and "type" not in hf["rope_parameters"]
    assert config_from_hf(hf).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(CFG)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(FileNotFoundError, match="pickled weights"):
        load_hf(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(str(tmp_path / "missing"))


def test_convert_hf_orbax_round_trip(folder, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    import convert

    path, model = folder
    convert.hf_to_orbax(path, str(tmp_path / "orbax"), scan_layers=True)
    convert.orbax_to_hf(str(tmp_path / "orbax"), str(tmp_path / "back"))
    back = load_hf(str(tmp_path / "back"))
    ids = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    np.testing.assert_array_equal(_logits(back, ids), _logits(model, ids))


MOE = dict(
    vocab_size=64,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=48,
    tie_embeddings=False,
    n_experts=4,
    top_k=2,
    d_ff_expert=16,
    moe_implementation="ragged_dot",
)


def test_qwen3_moe_mixed_layers_import_and_export(tmp_path):
    """mlp_only_layers / decoder_sparse_step map to dense_layers / moe_layer_step and back;
    the dense layers' tensors are plain mlp.{gate,up,down}_proj in a saved folder."""
    cfg = ModelConfig(family="qwen3_moe", **MOE, dense_layers=[0], moe_layer_step=2)  # D M D M
    hf = config_to_hf(cfg)
    assert hf["mlp_only_layers"] == [0] and hf["decoder_sparse_step"] == 2
    back = config_from_hf(json.loads(json.dumps(hf)), moe_implementation="ragged_dot")
    assert (back.dense_layers, back.moe_layer_step) == ([0], 2)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    save_hf(model, str(tmp_path))
    names = set(SafetensorsFile(str(tmp_path / "model.safetensors")).keys())
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight"} <= names
    assert {"model.layers.1.mlp.gate.weight", "model.layers.3.mlp.experts.3.down_proj.weight"} <= names
    assert not any(n.startswith(("model.layers.0.mlp.gate.", "model.layers.2.mlp.experts")) for n in names)
    ids = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    np.testing.assert_array_equal(
        _logits(load_hf(str(tmp_path), moe_implementation="ragged_dot"), ids), _logits(model, ids)
    )
    # first_k_dense has no qwen3_moe key: those layers are written into mlp_only_layers
    assert config_to_hf(dataclasses.replace(cfg, first_k_dense=2))["mlp_only_layers"] == [0, 1]


def test_existing_layouts_keep_their_parameter_paths():
    """Checkpoints of dense and first-k-dense models (Orbax, goldens) name these groups."""
    deepseek = ModelConfig(family="dots1", **MOE, router="sigmoid", first_k_dense=1)
    assert set(nnx.state(nnx.eval_shape(lambda: Decoder(deepseek, rngs=nnx.Rngs(0)))).keys()) == {
        "embed",
        "dense_blocks",
        "moe_blocks",
        "final_norm",
        "lm_head",
    }
    assert config_to_hf(deepseek)["first_k_dense_replace"] == 1
    # a leading dense_layers entry is the same layout, written the dots1 way
    assert config_to_hf(dataclasses.replace(deepseek, first_k_dense=0, dense_layers=[0]))["first_k_dense_replace"] == 1


@pytest.mark.parametrize(
    "family, fields, match",
    [
        ("mixtral", dict(qk_norm=False, dense_layers=[1]), r"mixtral takes .* no shared experts or dense layers"),
        ("mixtral", dict(qk_norm=False, first_k_dense=1), r"mixtral takes .* no shared experts or dense layers"),
        ("dots1", dict(router="sigmoid", dense_layers=[2]), r"dots1 / deepseek_v3 can only make the first layers"),
        ("dots1", dict(router="sigmoid", moe_layer_step=2), r"dots1 / deepseek_v3 can only make the first layers"),
    ],
)
def test_layer_patterns_a_family_cannot_express_are_refused_on_export(family, fields, match):
    with pytest.raises(ValueError, match=match):
        config_to_hf(ModelConfig(family=family, **MOE, **fields))


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 must be an integer >= 1"),
        (dict(decoder_sparse_step="2"), r"decoder_sparse_step='2' must be an integer"),
        (dict(mlp_only_layers="0,1"), r"mlp_only_layers='0,1' must be a list of layer indices"),
        (dict(mlp_only_layers=[4]), r"model\.dense_layers=\[4\] must hold layer indices in \[0, n_layers=4\)"),
    ],
)
def test_bad_qwen3_moe_layer_keys_fail_naming_the_key(edit, match):
    hf = {**config_to_hf(ModelConfig(family="qwen3_moe", **MOE)), **edit}
    with pytest.raises(ValueError, match=match):
        Decoder(config_from_hf(hf), rngs=nnx.Rngs(0))


_PLACEMENT = textwrap.dedent("""
    import os, sys, json
    import jax, numpy as np
    from jax.sharding import AxisType
    from ptrain.models import load_hf
    path = sys.argv[1]
    mesh = jax.make_mesh((2, 2, 2, 1), ("data", "fsdp", "tensor", "expert"), axis_types=(AxisType.Auto,) * 4)
    m = load_hf(path, mesh=mesh)
    ref = load_hf(path)
    q = m.dense_blocks[0].attn.q[...]
    out = {"q_spec": list(q.sharding.spec), "n_shards": len(q.addressable_shards),
           "shard_shape": list(q.addressable_shards[0].data.shape),
           "embed_spec": list(m.embed[...].sharding.spec),
           "equal": bool(np.array_equal(np.asarray(q), np.asarray(ref.dense_blocks[0].attn.q[...])))}
    ids = np.array([[1, 2, 3, 4]], np.int32)
    out["logits_equal"] = bool(np.allclose(np.asarray(jax.jit(lambda x: m(x))(ids)), np.asarray(ref(ids)), atol=1e-5))
    print(json.dumps(out))
""")


@pytest.mark.multidevice
def test_load_places_each_tensor_sharded_on_8_devices(folder):
    path, _ = folder
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", _PLACEMENT, path], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # q [D=32, H=4, Dh=8]: embed over fsdp, heads over tensor -> each device holds [16, 2, 8]
    assert out["q_spec"] == ["fsdp", "tensor", None], out
    assert out["embed_spec"] == ["tensor", "fsdp"], out
    assert out["n_shards"] == 8 and out["shard_shape"] == [16, 2, 8]
    assert out["equal"] and out["logits_equal"]
