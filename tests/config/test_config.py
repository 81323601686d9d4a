"""Config composition and validation: good configs resolve; every mistake names its key."""

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from ptrain.config import ConfigError, RunConfig, register_configs, stage_config, to_run_config

register_configs()


def composed(*overrides):
    with initialize_config_module(config_module="ptrain.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_compose_into_typed_config():
    run = to_run_config(composed())
    assert isinstance(run, RunConfig)
    assert run.model.d_model == 256 and run.data.source == "generated"
    assert [s.kind for s in run.stages] == ["sft"]


def test_overrides_reach_the_typed_config():
    run = to_run_config(composed("optim.lr=1e-3", "train.steps=7", "model=tiny_moe"))
    assert run.optim.lr == 1e-3 and run.train.steps == 7 and run.model.n_experts == 8


def test_stage_overrides_merge_over_top_level_nodes():
    run = to_run_config(composed("train.steps=7"))
    run.stages[0].optim = {"lr": 5e-5}
    run.stages[0].train = {"steps": 3}
    cfg = stage_config(run, run.stages[0])
    assert cfg.optim.lr == 5e-5 and cfg.train.steps == 3 and cfg.optim.schedule == run.optim.schedule


def test_a_grpo_stage_on_the_defaults_validates():
    """No GRPO option set: the default response length leaves room for a prompt in the
    default train.seq_len."""
    run = to_run_config(composed("stages=[{name: g, kind: grpo}]", "env=arithmetic"))
    assert run.algo.grpo.max_new_tokens < run.train.seq_len


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim.lr=-1"], "optim.lr"),
        (["optim.schedule=triangle"], "optim.schedule"),
        (["train.steps=0"], "train.steps"),
        (["train.global_batch_size=10", "train.grad_accum=4"], "train.global_batch_size"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["model.dtype=float16"], "model.dtype"),
        (["algo.sft.aggregation=median"], "algo.sft.aggregation"),
        (["algo.sft.aggregation=sum", "algo.sft.norm_constant=-100"], "algo.sft.norm_constant"),
        (["logging.log_every=0"], "logging.log_every"),
        (["stages=[{name: '..', kind: sft}]"], "stages[0].name"),
        (["algo.dpo.beta=0"], "algo.dpo.beta"),
        (["algo.dpo.dpop_lambda=-1"], "algo.dpo.dpop_lambda"),
        (["algo.dpo.policy_pairs=-1"], "algo.dpo.policy_pairs"),
        (["algo.dpo.policy_samples=0"], "algo.dpo.policy_samples"),
        (["algo.dpo.policy_temperature=-0.5"], "algo.dpo.policy_temperature"),
        (["algo.dpo.policy_temperature=0", "algo.dpo.policy_samples=4"], "algo.dpo.policy_samples"),
        (["algo.dpo.policy_max_new_tokens=0"], "algo.dpo.policy_max_new_tokens"),
        (["data.source=jsonl"], "data.train_path"),
        (["data.source=jsonl", "data.train_path=/nonexistent/train.jsonl"], "data.train_path"),
        (["data.bad_rows=ignore"], "data.bad_rows"),
        (["stages=[{name: a, kind: ppo}]"], "stages[0].kind"),
        (["stages=[{name: a, kind: sft}, {name: a, kind: sft}]"], "stages"),
        (["stages=[{name: a, kind: sft, init: /no/such/folder}]"], "stages[0].init"),
        (["stages=[{name: a, kind: dpo}]"], "data.format"),
        (["stages=[{name: a, kind: sft, reward_model: /rm}]"], "stages[0].reward_model"),
        (["mesh.rules=[[batch,[data]]]"], "mesh.rules[0]"),
        (["mesh.rules=[[embed,fsdp],[mlp,model]]"], "mesh.rules[1]"),
        (["mesh.rules=[embed]"], "mesh.rules[0]"),
        (["env=arithmetic", "stages=[{name: g, kind: grpo, reward_model: ' '}]"], "stages[0].reward_model"),
        (["model.hf_path=/no/such/model"], "model.hf_path"),
        (["checkpoint.keep=0"], "checkpoint.keep"),
        (["algo.grpo.temperature=inf"], "algo.grpo.temperature"),
        (["env=arithmetic", "stages=[{name: g, kind: grpo, envs: [arithmetic, arithmetic]}]"], "stages[0].envs"),
        (["algo.grpo.kl_coef=inf"], "algo.grpo.kl_coef"),
        (["algo.grpo.invalid_tool_call_advantage=nan"], "algo.grpo.invalid_tool_call_advantage"),
        (
            [
                "stages=[{name: g, kind: grpo}]",
                "env=arithmetic",
                "algo.grpo.max_new_tokens=32",
                "rollout.context_length=32",
            ],
            "rollout.context_length",
        ),
        (
            [
                "stages=[{name: g, kind: grpo}]",
                "env=arithmetic",
                "algo.grpo.max_new_tokens=32",
                "rollout.max_running_requests=4",
            ],
            "algo.grpo.group_size",
        ),  # fmt: skip
        (
            [
                "stages=[{name: g, kind: grpo}]",
                "env=arithmetic",
                "algo.grpo.max_new_tokens=32",
                "algo.eval.samples=128",
            ],
            "algo.eval.samples",
        ),  # fmt: skip
    ],
)
def test_impossible_values_name_their_key(overrides, key):
    with pytest.raises((ConfigError, FileNotFoundError)) as e:
        to_run_config(composed(*overrides))
    assert key in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optim.lr=fast"], "lr"),
        (["train.steps=many"], "steps"),
    ],
)
def test_wrong_types_name_their_key(overrides, key):
    with pytest.raises((ConfigError, ConfigCompositionException)) as e:
        to_run_config(composed(*overrides))
    assert key in str(e.value) or key in str(e.value.__cause__), str(e.value)


def test_unknown_key_is_rejected_at_composition():
    with pytest.raises(ConfigCompositionException) as e:
        composed("optim.learning_rate=1e-3")
    assert "learning_rate" in str(e.value) + str(e.value.__cause__)


def test_a_reward_model_stage_refuses_policy_pairs(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(ConfigError, match=r"stage 'r': config key 'algo.dpo.policy_pairs': a reward-model stage"):
        to_run_config(composed("data.format=preference", "data.source=jsonl", f"data.train_path={pairs}",
                               "algo.dpo.policy_pairs=4", "stages=[{name: r, kind: rm}]"))  # fmt: skip


def test_unknown_key_in_a_stage_override_names_the_stage():
    run = to_run_config(composed())
    run.stages[0].optim = {"learning_rate": 1e-3}
    with pytest.raises(ConfigError) as e:
        stage_config(run, run.stages[0])
    assert "learning_rate" in str(e.value) and "stage 'sft'" in str(e.value)


def test_mesh_must_fit_the_devices_and_the_batch():
    from ptrain.config.run import check_mesh_fits

    run = to_run_config(composed("mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2", "train.global_batch_size=10"))
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        check_mesh_fits(run, 8)
    with pytest.raises(ConfigError, match="mesh"):
        check_mesh_fits(run, 4)
    run.train.global_batch_size = 16
    assert check_mesh_fits(run, 8) == (2, 2, 1, 2, 1)  # data, fsdp, context, tensor, expert
    run = to_run_config(composed("mesh.context=4", "train.seq_len=130", "train.global_batch_size=8"))
    with pytest.raises(ConfigError, match=r"train.seq_len.*multiple of 4"):
        check_mesh_fits(run, 8)
    run.train.seq_len = 128
    assert check_mesh_fits(run, 8) == (2, 1, 4, 1, 1)


def test_overrides_a_stage_replaces_are_pointed_out():
    """`train.steps=2` on the command line does not reach a stage that sets train.steps
    itself; the CLI says so, with the override that would."""
    from ptrain.config import RunConfig
    from ptrain.config.run import shadowed_overrides
    from ptrain.config.stages import StageConfig

    run = RunConfig(
        stages=[
            StageConfig(name="sft", train={"steps": 150}),
            StageConfig(name="dpo", kind="dpo", init="previous", algo={"dpo": {"beta": 0.1}}),
        ]
    )
    notes = shadowed_overrides(
        run, ["train.steps=2", "algo.dpo.beta=0.5", "optim.lr=1e-3", "model.d_model=64", "++train.seq_len=64"]
    )
    assert notes == [
        "stage 'sft' sets train.steps=150 itself, which takes precedence over 'train.steps=2'; "
        "pass stages.0.train.steps=... to change it there",
        "stage 'dpo' sets algo.dpo.beta=0.1 itself, which takes precedence over 'algo.dpo.beta=0.5'; "
        "pass stages.1.algo.dpo.beta=... to change it there",
    ]


def test_a_list_key_given_without_brackets_shows_the_bracketed_form():
    """`rollout.urls=http://10.0.0.1:30000`: Hydra itself refuses it ("str is not a
    ListConfig"); the CLI checks first and names the key, the type and what to pass."""
    from ptrain.config.run import check_list_overrides

    with pytest.raises(ConfigCompositionException) as e:  # what Hydra alone says
        composed("rollout=sglang", "rollout.urls=http://10.0.0.1:30000")
    assert "rollout.urls=[" not in str(e.value) + str(e.value.__cause__)

    with pytest.raises(ConfigError) as e:
        check_list_overrides(["recipe=sft_grpo_arithmetic", "rollout=sglang", "rollout.urls=http://10.0.0.1:30000"])
    assert str(e.value) == (
        "config key 'rollout.urls': must be a list, got the single value 'http://10.0.0.1:30000'; pass "
        '"rollout.urls=[http://10.0.0.1:30000]" (in quotes, so the shell leaves the brackets alone)'
    )
    with pytest.raises(ConfigError) as e:  # two without brackets: Hydra's "Ambiguous value"
        check_list_overrides(["rollout.urls=http://a:1,http://b:2"])
    assert '"rollout.urls=[http://a:1,http://b:2]" for one list' in str(e.value)
    assert '"rollout.urls=[http://a:1],[http://b:2]" to sweep over lists' in str(e.value)
    with pytest.raises(ConfigError, match=r'pass "algo.eval.pass_k=\[4\]"'):  # every list field, not only urls
        check_list_overrides(["algo.eval.pass_k=4"])
    # What is fine, or not ours to judge, passes through to Hydra.
    check_list_overrides(
        ["-m", "--cfg", "job", "rollout=sglang", "rollout.urls=[http://a:1]", "rollout.urls=[http://a:1],[http://b:2]",
         "rollout.router_url=http://r:1", "rollout.urls=${oc.env:URLS}", "~rollout.urls", "rollout.urls=[broken"]
    )  # fmt: skip


def test_max_staleness_is_refused_in_sync_mode_and_defaults_to_one_in_async_mode():
    """The default (null) cannot be mistaken for a user's value: setting max_staleness, even to
    the async default, in sync mode is an error naming both keys; async resolves null to 1."""
    from ptrain.config.grpo import DEFAULT_MAX_STALENESS, staleness_bound
    from ptrain.stages.grpo import groups_ahead

    grpo = ["stages=[{name: g, kind: grpo}]", "env=arithmetic", "algo.grpo.prompts_per_step=4"]
    for value in (1, 4):
        with pytest.raises(ConfigError) as e:
            to_run_config(composed(*grpo, "algo.grpo.mode=sync", f"algo.grpo.max_staleness={value}"))
        assert str(e.value) == (
            f"stage 'g': config key 'algo.grpo.max_staleness': only applies to mode=async (how many weight versions "
            f"a sample may lag), but mode is 'sync', where every sample is on-policy; drop "
            f"algo.grpo.max_staleness={value}, or pass algo.grpo.mode=async"
        )
    sync = to_run_config(composed(*grpo)).algo.grpo
    assert sync.max_staleness is None and groups_ahead(sync) == 0
    default = to_run_config(composed(*grpo, "algo.grpo.mode=async")).algo.grpo
    assert default.max_staleness is None and staleness_bound(default) == DEFAULT_MAX_STALENESS == 1
    assert groups_ahead(default) == 4
    set_ = to_run_config(composed(*grpo, "algo.grpo.mode=async", "algo.grpo.max_staleness=3")).algo.grpo
    assert staleness_bound(set_) == 3 and groups_ahead(set_) == 12
    zero = to_run_config(composed(*grpo, "algo.grpo.mode=async", "algo.grpo.max_staleness=0")).algo.grpo
    assert staleness_bound(zero) == 0 and groups_ahead(zero) == 4
    with pytest.raises(ConfigError, match="algo.grpo.max_staleness': must be null or >= 0, got -1"):
        to_run_config(composed(*grpo, "algo.grpo.mode=async", "algo.grpo.max_staleness=-1"))


def test_a_moving_curriculum_target_needs_its_start_and_env_data_names_real_environments():
    with pytest.raises(ConfigError, match="pass_rate_target_end': a moving target needs its start"):
        to_run_config(composed("algo.grpo.pass_rate_target_end=0.2"))
    with pytest.raises(ConfigError, match="pass_rate_target_end': must be null or in"):
        to_run_config(composed("algo.grpo.pass_rate_target=0.8", "algo.grpo.pass_rate_target_end=2"))
    moving = to_run_config(composed("algo.grpo.pass_rate_target=0.8", "algo.grpo.pass_rate_target_end=0.2"))
    assert moving.algo.grpo.pass_rate_target_end == 0.2
    with pytest.raises(ConfigError, match=r"data.envs.envs': names \['nope'\]"):
        to_run_config(composed("data.source=envs", "data.envs.envs=[nope]"))
    with pytest.raises(ConfigError, match="data.reasoning.strip"):
        to_run_config(composed("data.reasoning.strip=1.5"))


def _recipes_with_a_published_scale() -> list[str]:
    from importlib import resources

    from ptrain.config.recipes import available_recipes

    folder = resources.files("ptrain.conf") / "recipe"
    return [r for r in available_recipes() if "\n  published:" in (folder / f"{r}.yaml").read_text()]


@pytest.mark.parametrize("recipe", _recipes_with_a_published_scale())
def test_every_published_scale_composes_and_its_launch_names_the_model(recipe):
    """A published scale composes with nothing present; validating it names what the launch
    must give, the model first, and the recipe's header shows a launch line that gives it."""
    from importlib import resources

    args = [f"recipe={recipe}", "scale=published"]
    with pytest.raises(ConfigError) as e:
        to_run_config(composed(*args), args)
    assert "no value given" in str(e.value) and "model.hf_path=..." in str(e.value)
    header = (resources.files("ptrain.conf") / "recipe" / f"{recipe}.yaml").read_text()
    assert f"recipe={recipe} scale=published model.hf_path=" in header


def _published_launch(header: str, recipe: str) -> list[str]:
    """The overrides of the header's launch line that runs the published scale, its `\\`
    continuations joined."""
    import shlex

    lines = [line.lstrip("#").strip() for line in header.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if f"recipe={recipe} scale=published model.hf_path=" in line)
    text = ""
    for line in lines[start:]:
        text += " " + line.split("python -m ptrain", 1)[-1].rstrip("\\").strip()
        if not line.endswith("\\"):
            break
    # N stands for a count the user chooses (train.steps=N)
    return [w[:-1] + "1" if w.endswith("=N") else w for w in shlex.split(text) if "=" in w]


# nemotron_like's launch line is a pattern over its six environments (envs.<name>.options.url=...);
# test_nemotron_like_published_scale_names_every_value_its_launch_must_give covers what it must give.
@pytest.mark.parametrize("recipe", [r for r in _recipes_with_a_published_scale() if r != "nemotron_like"])
def test_every_published_launch_line_in_a_header_composes_with_nothing_left_to_give(recipe):
    """The header's published launch, placeholders as written (DIR, http://HOST:PORT, X.jsonl):
    Hydra takes every override as written ("+" where a key is only the scale's) and no value
    is left at ??? (files are not read here; a launch checks them)."""
    from importlib import resources

    from omegaconf import OmegaConf

    from ptrain.config.run import apply_scale

    header = (resources.files("ptrain.conf") / "recipe" / f"{recipe}.yaml").read_text()
    args = _published_launch(header, recipe)
    assert f"recipe={recipe}" in args and "scale=published" in args
    merged = apply_scale(OmegaConf.merge(OmegaConf.structured(RunConfig), composed(*args)), args)
    assert not OmegaConf.missing_keys(merged), f"{recipe}: the launch line leaves {OmegaConf.missing_keys(merged)}"


def test_nemotron_like_published_scale_names_every_value_its_launch_must_give():
    """Nano's settings compose without the model, the fleet or the data present; validating
    them names each missing value, with "+" where the key is one only the scale adds."""
    args = ["recipe=nemotron_like", "scale=published"]
    cfg = composed(*args)
    assert cfg.scales.published.algo.grpo.prompts_per_step == 128
    # Nano's 262,144-token SFT rows split over 8 devices of the context axis
    assert cfg.scales.published.mesh.context == 8 and cfg.scales.published.train.seq_len % 8 == 0
    with pytest.raises(ConfigError) as e:
        to_run_config(cfg, args)
    msg = str(e.value)
    for key in (
        "model.hf_path=...",
        "data.train_path=...",
        "+envs.math.options.url=...",
        "+envs.code.options.rows=",
        "+envs.rlhf.options.judge_url=",
        "+envs.rlhf.options.path=",
    ):
        assert key in msg
    assert "+model.hf_path" not in msg
