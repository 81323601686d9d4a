"""Named choices have one home: the config rejects a bad one naming the key and listing the
options, and every option the config accepts is one the code that acts on it implements."""

import pytest
from hydra import compose, initialize_config_module

from ptrain.config import STAGE_KINDS, ConfigError, ModelConfig, OptimConfig, register_configs, to_run_config
from ptrain.config import choices as C
from ptrain.config.stages import STAGES
from ptrain.stages import DRIVERS, stage_driver

register_configs()


def composed(*overrides):
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, key, options",
    [
        ("optim.name=adagrad", "optim.name", C.OPTIMIZERS),
        ("optim.schedule=triangle", "optim.schedule", C.SCHEDULES),
        ("model.dtype=float16", "model.dtype", C.COMPUTE_DTYPES),
        ("model.param_dtype=float64", "model.param_dtype", C.PARAM_DTYPES),
        ("model.remat=some", "model.remat", C.REMAT_MODES),
        ("model.router=topk", "model.router", C.ROUTERS),
        ("algo.sft.aggregation=median", "algo.sft.aggregation", C.SFT_AGGREGATIONS),
        ("algo.dpo.kind=kto", "algo.dpo.kind", C.PREFERENCE_KINDS),
        ("data.bad_rows=ignore", "data.bad_rows", C.BAD_ROW_POLICIES),
        ("stages=[{name: a, kind: ppo}]", "stages[0].kind", STAGE_KINDS),
    ],
)
def test_a_bad_choice_names_the_key_and_lists_the_options(override, key, options):
    with pytest.raises(ConfigError) as e:
        to_run_config(composed(override))
    assert f"'{key}'" in str(e.value) and all(o in str(e.value) for o in options), str(e.value)


def test_label_smoothing_is_checked_against_the_kinds_that_take_it():
    with pytest.raises(ConfigError, match="'algo.dpo.label_smoothing'.*sigmoid"):
        to_run_config(composed("algo.dpo.kind=ipo", "algo.dpo.label_smoothing=0.1"))
    with pytest.raises(ConfigError, match="'algo.dpo.label_smoothing'"):
        to_run_config(composed("algo.dpo.kind=robust", "algo.dpo.label_smoothing=0.5"))
    assert to_run_config(composed("algo.dpo.kind=robust", "algo.dpo.label_smoothing=0.2")).algo.dpo.kind == "robust"


def test_every_optimizer_and_schedule_the_config_accepts_is_built():
    from ptrain.train.optim import make_optimizer

    for name in C.OPTIMIZERS:
        for schedule in C.SCHEDULES:
            tx, lr = make_optimizer(OptimConfig(name=name, schedule=schedule, warmup_steps=2), 10)
            assert callable(tx.update) and float(lr(5)) > 0


def test_the_decoder_accepts_exactly_the_configs_numerics():
    from ptrain.models.decoder import validate_config

    base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=48)
    for dtype in C.COMPUTE_DTYPES:
        for remat in C.REMAT_MODES:
            validate_config(ModelConfig(**base, dtype=dtype, remat=remat))
    with pytest.raises(ValueError, match="model.dtype"):
        validate_config(ModelConfig(**base, dtype="float16"))


def test_every_preference_kind_the_config_accepts_is_a_loss():
    from ptrain.losses import PREFERENCE_KINDS

    assert PREFERENCE_KINDS == C.PREFERENCE_KINDS
    assert set(C.REFERENCE_FREE_KINDS) <= set(C.PREFERENCE_KINDS)


def test_stage_kinds_come_from_the_registry_and_every_driver_imports():
    assert STAGE_KINDS == tuple(STAGES) == tuple(DRIVERS)
    for kind in STAGE_KINDS:
        assert callable(stage_driver(kind))
    with pytest.raises(ValueError, match="unknown stage kind 'ppo'"):
        stage_driver("ppo")


def test_the_config_module_tree_stays_free_of_jax():
    """The CLI validates a config before JAX starts; importing the config must not start it."""
    import subprocess
    import sys

    code = "import sys, ptrain.config, ptrain.config.choices, ptrain.config.seeds; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_mesh_shape_is_resolved_once_with_the_key_named():
    from ptrain.config import MeshConfig
    from ptrain.config.run import resolve_mesh_shape
    from ptrain.parallel import make_mesh

    assert resolve_mesh_shape(MeshConfig(fsdp=2), 8) == (4, 2, 1, 1, 1)
    assert resolve_mesh_shape(MeshConfig(context=4), 8) == (2, 1, 4, 1, 1)
    with pytest.raises(ConfigError, match="config key 'mesh'"):
        make_mesh(MeshConfig(tensor=3))
