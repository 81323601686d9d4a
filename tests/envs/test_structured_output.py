"""structured_output: the JSON parser's bounds (length, nesting, NaN, duplicate keys, huge
integers), the schema validator on good and bad values of every type, the value match, answer
extraction (fences, reasoning), generated tasks (their own values validate; deterministic,
disjoint), rewards through a replayed rollout, options errors and the Hydra file."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from ptrain.config.env import EnvConfig, EnvConfigError, register_env_configs, validate_env_config
from ptrain.config.env_verifiable import STRUCTURED_FIELDS, STRUCTURED_TYPES, StructuredOutputOptions
from ptrain.data.tokenizer import build_tokenizer
from ptrain.envs.registry import make_env
from ptrain.envs.structured_output import (
    FIELDS,
    answer_text,
    judge_structured_output,
    make_record,
    parse_json_object,
    schema_error,
    value_error,
)
from ptrain.rollout.protocol import SamplingParams
from ptrain.rollout.replay import ReplayEngine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "price": {"type": "number"},
        "in_stock": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
GOOD = {
    "name": "Alice",
    "age": 31,
    "price": 12.5,
    "in_stock": True,
    "color": "red",
    "tags": ["a", "b"],
    "address": {"city": "Oslo", "zip": "01234"},
}
DATA = {
    "schema": SCHEMA,
    "expected": {"name": "Alice", "age": 31, "address": {"city": "Oslo", "zip": "01234"}},
    "max_answer_chars": 4096,
}


def test_validator_accepts_good_values():
    assert schema_error(GOOD, SCHEMA) is None
    minimal = {"name": "A", "age": 1, "address": {"city": "x", "zip": "y"}}
    assert schema_error(minimal, SCHEMA) is None  # optional properties may be left out
    assert schema_error({**GOOD, "age": 31.0}, SCHEMA) is None  # JSON Schema: 31.0 is an integer
    assert schema_error({**GOOD, "price": 12}, SCHEMA) is None  # an integer is a number
    assert schema_error({**GOOD, "age": 10**400}, SCHEMA) is None  # any size


@pytest.mark.parametrize(
    "change, where",
    [
        ({"name": 5}, "$.name"),
        ({"name": None}, "$.name"),
        ({"age": "31"}, "$.age"),
        ({"age": 31.5}, "$.age"),
        ({"age": True}, "$.age"),  # a boolean is not a number
        ({"price": "12.5"}, "$.price"),
        ({"price": False}, "$.price"),
        ({"in_stock": 1}, "$.in_stock"),
        ({"in_stock": "true"}, "$.in_stock"),
        ({"color": "purple"}, "$.color"),
        ({"color": "RED"}, "$.color"),
        ({"tags": "a"}, "$.tags"),
        ({"tags": ["a", 1]}, r"$.tags[1]"),
        ({"tags": []}, "$.tags"),  # minItems 1
        ({"address": "Oslo"}, "$.address"),
        ({"address": {"city": "Oslo"}}, "$.address"),  # nested required key missing
        ({"address": {"city": "Oslo", "zip": "1", "extra": 1}}, "$.address"),  # nested extra key
        ({"address": {"city": "Oslo", "zip": 1234}}, "$.address.zip"),
        ({"nickname": "Al"}, "$"),  # additionalProperties: false
    ],
)
def test_validator_refuses_bad_values(change, where):
    err = schema_error({**GOOD, **change}, SCHEMA)
    assert err is not None and err.startswith(where), err


def test_validator_refuses_missing_required_and_non_objects():
    bad = dict(GOOD)
    del bad["age"]
    assert "missing required key(s) ['age']" in schema_error(bad, SCHEMA)
    for value in ([], "x", 1, None, True):
        assert schema_error(value, SCHEMA) is not None


def test_validator_refuses_schemas_outside_its_subset():
    with pytest.raises(ValueError, match="unsupported keyword"):
        schema_error({}, {"type": "object", "patternProperties": {}})
    with pytest.raises(ValueError, match="unsupported type"):
        schema_error(None, {"type": "null"})


def test_parser_bounds():
    assert parse_json_object('{"a": 1}', 100) == {"a": 1}
    for text in (
        "",
        "not json",
        "[1, 2]",
        '"a string"',
        "42",
        '{"a": NaN}',
        '{"a": Infinity}',
        '{"a": -Infinity}',
        '{"a": 1, "a": 2}',  # duplicate key
        '{"a": {"b": 1, "b": 1}}',
        '{"a": 1',
        '{"a": 1} trailing',
        "{'a': 1}",  # not JSON quotes
        '{"a": ' + "1" * 5000 + "}",  # an integer past Python's digit limit
    ):
        with pytest.raises(ValueError):
            parse_json_object(text, 100_000)
    with pytest.raises(ValueError, match="more than 16"):
        parse_json_object('{"a": "' + "x" * 20 + '"}', 16)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 200_000 + "]" * 200_000,
        '{"a":' * 100_000 + "1" + "}" * 100_000,
        '{"a": [' * 50_000 + "]}" * 50_000,
    ],
)
def test_deeply_nested_json_scores_zero_without_crashing(text):
    with pytest.raises(ValueError):
        parse_json_object(text, 10**7)
    assert judge_structured_output(text, {**DATA, "max_answer_chars": 10**7}) == 0.0


def test_value_match():
    assert value_error(GOOD, DATA["expected"]) is None
    assert value_error({**GOOD, "age": 31.0}, DATA["expected"]) is None
    assert "$.name" in value_error({**GOOD, "name": "Bob"}, DATA["expected"])
    assert "$.address.city" in value_error({**GOOD, "address": {"city": "Lima", "zip": "01234"}}, DATA["expected"])
    missing = {k: v for k, v in GOOD.items() if k != "name"}
    assert "missing" in value_error(missing, DATA["expected"])
    assert value_error({"tags": ["a", "b"]}, {"tags": ["a", "b"]}) is None
    assert value_error({"tags": ["b", "a"]}, {"tags": ["a", "b"]}) is not None  # order counts
    assert value_error({"ok": 1}, {"ok": True}) is not None  # 1 is not true
    assert value_error({"n": True}, {"n": 1}) is not None


def test_judge():
    assert judge_structured_output(json.dumps(GOOD), DATA) == 1.0
    assert judge_structured_output(json.dumps({**GOOD, "name": "Bob"}), DATA) == 0.0  # valid, wrong value
    assert judge_structured_output(json.dumps({**GOOD, "extra": 1}), DATA) == 0.0  # right values, extra key
    assert judge_structured_output(json.dumps({**GOOD, "age": "31"}), DATA) == 0.0  # wrong type
    assert judge_structured_output("", DATA) == 0.0
    assert judge_structured_output(json.dumps(GOOD) + " " * 5000, DATA) == 0.0  # over max_answer_chars


def test_answer_text():
    assert answer_text('{"a": 1}') == '{"a": 1}'
    assert answer_text('Here:\n```json\n{"a": 1}\n```\nDone.') == '{"a": 1}'
    assert answer_text('```\n{"a": 1}\n```') == '{"a": 1}'
    assert answer_text('```{"a": 1}```') == '{"a": 1}'
    assert answer_text('```json\n{"a": 0}\n```\nfixed:\n```json\n{"a": 1}\n```') == '{"a": 1}'
    assert answer_text('<think>```json\n{"a": 0}\n```</think>\n{"a": 1}') == '{"a": 1}'
    assert answer_text('Sure! {"a": 1}') == 'Sure! {"a": 1}'  # prose around bare JSON is not stripped


def test_fields_match_the_config_vocabulary():
    names = [n for t in STRUCTURED_TYPES for n in STRUCTURED_FIELDS[t]]
    assert sorted(names) == sorted(FIELDS) and len(set(names)) == len(names)
    rng = random.Random(0)
    for kind, names in STRUCTURED_FIELDS.items():
        for name in names:
            schema, value = FIELDS[name](rng)
            assert schema_error(value, schema) is None
            want = {"enum": "string"}.get(kind, kind)
            assert schema["type"] == want, (name, schema)


def test_generated_records_validate_with_their_own_values():
    rng = random.Random(3)
    o = StructuredOutputOptions()
    for _ in range(300):
        r = make_record(rng, o)
        props = r["schema"]["properties"]
        assert o.min_properties <= len(props) <= o.max_properties
        assert set(r["schema"]["required"]) <= set(r["expected"]) <= set(props)
        assert schema_error(r["expected"], r["schema"]) is None
        assert judge_structured_output(json.dumps(r["expected"]), {**r, "max_answer_chars": 4096}) == 1.0


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=300)


def test_tasks_deterministic_disjoint_and_show_schema_and_values(tok):
    cfg = EnvConfig(kind="structured_output", n_train=200, n_eval=40)
    a, b = make_env(cfg, tokenizer=tok), make_env(cfg, tokenizer=tok)
    train, held = a.tasks("train", seed=1), a.tasks("eval", seed=1)
    assert [t.data for t in train] == [t.data for t in b.tasks("train", seed=1)]
    assert [t.data for t in train] != [t.data for t in a.tasks("train", seed=2)]
    assert len(train) == 200 and len(held) == 40
    key = lambda t: json.dumps([t.data["schema"], t.data["expected"]], sort_keys=True)  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in held} and len({key(t) for t in train}) == 200
    for t in train[:20]:
        text = t.messages[0]["content"]
        assert json.dumps(t.data["schema"], indent=2) in text
        assert all(f"- {k}: {json.dumps(v)}" in text for k, v in t.data["expected"].items())
    types = {s["type"] for t in train for s in t.data["schema"]["properties"].values()}
    assert types == {"string", "integer", "number", "boolean", "array", "object"}
    assert any(not t.data["schema"]["required"] or len(t.data["expected"]) < len(t.data["schema"]["properties"])
               for t in train)  # fmt: skip
    c = make_env(EnvConfig(kind="structured_output", n_train=300, n_eval=40), tokenizer=tok)
    assert [t.data for t in c.tasks("eval", seed=1)] == [t.data for t in held]


def test_rewards_through_a_replayed_rollout(tok):
    opts = {"format_reward": 0.1, "correct_reward": 0.9}
    cfg = EnvConfig(kind="structured_output", n_train=1, n_eval=0, reward_workers=1, options=opts)
    env = make_env(cfg, tokenizer=tok)
    try:
        task = env.task("train", 0, env.user("fill the schema"), DATA)
        answers = [
            "```json\n" + json.dumps(GOOD) + "\n```",
            json.dumps({**GOOD, "age": 32}),  # valid, a wrong value
            json.dumps({**GOOD, "extra": True}),  # an extra key
            "[" * 2000 + "]" * 2000,  # nested past the parser's recursion limit, within max_answer_chars
            "The name is Alice and the age is 31.",
            "",
        ]
        engine = ReplayEngine(answers, tokenizer=tok)
        out = asyncio.run(env.rollout(task, engine, SamplingParams(n=len(answers), max_new_tokens=8192)))
        assert [t.reward for t in out] == pytest.approx([1.0, 0.1, 0.1, 0.0, 0.0, 0.0])
        assert dict(out[0].reward_components) == pytest.approx({"format": 0.1, "correct": 0.9})
        assert [t.metrics["formatted"] for t in out] == [1, 1, 1, 0, 0, 0]
        assert [t.metrics["correct"] for t in out] == [1, 0, 0, 0, 0, 0]
        assert all(t.reward_error is None for t in out)
    finally:
        env.close()


@pytest.mark.parametrize(
    "options, key",
    [
        ({"types": []}, "types"),
        ({"types": ["date"]}, "types"),
        ({"types": ["string", "string"]}, "types"),
        ({"min_properties": 0}, "min_properties"),
        ({"min_properties": 4, "max_properties": 3}, "min_properties"),
        ({"max_properties": 11}, "min_properties"),
        ({"types": ["array"], "max_properties": 4}, "max_properties"),
        ({"optional_probability": 1.5}, "optional_probability"),
        ({"max_answer_chars": 10}, "max_answer_chars"),
        ({"correct_reward": -1.0}, "correct_reward"),
        ({"schema": {}}, "schema"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(EnvConfigError, match=rf"config key 'envs\.structured_output\.options\.{key}'"):
        validate_env_config(EnvConfig(kind="structured_output", options=options))


def test_hydra_file_composes_to_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_env_configs()
    conf = os.path.join(ROOT, "conf")
    (tmp_path / "main.yaml").write_text(
        f"defaults:\n  - env: structured_output\n  - _self_\nhydra:\n  searchpath: [file://{conf}]\n"
    )
    with initialize_config_dir(str(tmp_path), version_base=None):
        cfg_all = compose(config_name="main", overrides=["envs.structured_output.n_train=7"])
    node = OmegaConf.select(cfg_all, "envs.structured_output")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), node))
    assert cfg.kind == "structured_output" and cfg.n_train == 7
    assert validate_env_config(cfg) == StructuredOutputOptions()
