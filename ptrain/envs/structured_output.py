"""The `structured_output` environment: a JSON object that follows a given JSON schema exactly.

A scaled-down, locally generated stand-in for Nemotron 3 Nano's structured-output environment
(NeMo Gym's `structured_outputs_json`, whose reward is schema adherence only). Each task shows
a JSON schema of 2 to 6 top-level properties and the values some of them must hold:

    Write a JSON object for a product record that conforms to this JSON schema:
    ```json
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": false}
    ```
    Use these values:
    - name: "Alice"
    - age: 31

The property types (options.types, STRUCTURED_FIELDS in ptrain/config/env_verifiable.py) are
string, integer, number, boolean, enum (a string from a list), array (of strings) and object
(nested one level, its properties all required and scalar). Every object of a schema has
`additionalProperties: false`. A property is optional with options.optional_probability;
required properties always get a value in the prompt, optional ones half the time.

The answer is the JSON object, bare or in the completion's last ``` code block (a `json` tag
on its opening line is dropped), after any reasoning closed by </think>. It is refused
unparsed when longer than options.max_answer_chars. Parsing is `json.loads` with NaN and
Infinity refused, duplicate keys refused, and RecursionError (deeply nested input) or
ValueError (a huge integer) caught: such an answer scores 0.

Reward: `format` for an answer that parses as a JSON object; `correct` (1 or 0) when the
object validates against the schema (`schema_error`: types, required keys, no other keys, enum
members, array item types; integer accepts a number with no fractional part, as JSON Schema
does; booleans are never numbers) and every value the prompt gave is there, equal to it.

`demonstration(task)` writes the object with every given value, properties in the schema's
order (optional ones without a given value left out), after one line of reasoning that names
the record and its required properties.

The validator is written for the subset of JSON Schema this module generates (type,
properties, required, additionalProperties, items, enum, minItems, maxItems) and raises
ValueError on any other keyword, so that a schema it cannot check is an error, not a pass.

The split key is the schema with the given values: no task is in both train and eval, and the
eval tasks are drawn first, so the held-out split does not change with n_train.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

from ptrain.config.env_verifiable import STRUCTURED_FIELDS
from ptrain.envs.base import Task
from ptrain.envs.instruction_following import final_response
from ptrain.envs.single_turn import SingleTurnEnv, draw_distinct

SUPPORTED_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "enum", "minItems", "maxItems"}
)
"""The JSON Schema keywords `schema_error` checks; any other one is a ValueError."""

FIRST_NAMES = ("Alice", "Bob", "Chen", "Dana", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Luis")
LAST_NAMES = ("Smith", "Garcia", "Tanaka", "Okafor", "Novak", "Silva", "Larsen", "Kim", "Moreau", "Rossi")
CITIES = ("Oslo", "Lima", "Nairobi", "Osaka", "Porto", "Quebec", "Tallinn", "Hanoi", "Perth", "Cusco", "Bergen")
COUNTRIES = ("Norway", "Peru", "Kenya", "Japan", "Portugal", "Canada", "Estonia", "Vietnam", "Chile", "Ghana")
TITLES = ("The Silent River", "Paper Moons", "A House of Glass", "North of Nowhere", "Salt and Cedar", "Blue Hour")
STREETS = ("Maple", "Harbor", "Station", "Orchard", "Mill", "Church", "Bridge", "Lake")
WORDS = ("fast", "new", "eco", "sale", "vintage", "local", "handmade", "organic", "compact", "premium")
LANGUAGES = ("English", "Spanish", "French", "German", "Japanese", "Swahili", "Hindi", "Portuguese", "Korean")
INGREDIENTS = ("flour", "sugar", "butter", "eggs", "salt", "milk", "yeast", "honey", "oats", "cinnamon")
ENUMS = {
    "color": ("red", "green", "blue", "yellow", "black", "white", "orange"),
    "status": ("active", "inactive", "pending", "archived", "suspended"),
    "priority": ("low", "medium", "high", "urgent"),
    "size": ("XS", "S", "M", "L", "XL"),
}
"""Enum properties: the values their enum lists are drawn from."""
NOUNS = ("customer", "product", "order", "library book", "event", "device", "listing", "shipment")
"""What the record is said to describe (the wording only; it does not change the schema)."""

Spec = tuple[dict[str, Any], Any]
"""(a property's schema, the value the prompt gives for it)."""


def _money(rng: random.Random) -> float:
    return round(rng.randint(50, 99999) / 100, 2)


def _tenth(rng: random.Random, lo: int, hi: int) -> float:
    return round(rng.randint(lo * 10, hi * 10) / 10, 1)


def _string(make: Callable[[random.Random], str]) -> Callable[[random.Random], Spec]:
    return lambda rng: ({"type": "string"}, make(rng))


def _integer(lo: int, hi: int) -> Callable[[random.Random], Spec]:
    return lambda rng: ({"type": "integer"}, rng.randint(lo, hi))


def _number(make: Callable[[random.Random], float]) -> Callable[[random.Random], Spec]:
    return lambda rng: ({"type": "number"}, make(rng))


def _boolean(rng: random.Random) -> Spec:
    return {"type": "boolean"}, rng.random() < 0.5


def _enum(name: str) -> Callable[[random.Random], Spec]:
    def make(rng: random.Random) -> Spec:
        values = rng.sample(ENUMS[name], rng.randint(3, len(ENUMS[name])))
        return {"type": "string", "enum": values}, rng.choice(values)

    return make


def _array(pool: tuple[str, ...]) -> Callable[[random.Random], Spec]:
    def make(rng: random.Random) -> Spec:
        schema: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
        if rng.random() < 0.5:
            schema["minItems"] = 1
        return schema, rng.sample(pool, rng.randint(1, 3))

    return make


def _object(**fields: Callable[[random.Random], Spec]) -> Callable[[random.Random], Spec]:
    def make(rng: random.Random) -> Spec:
        specs = {name: f(rng) for name, f in fields.items()}
        schema = {
            "type": "object",
            "properties": {name: s for name, (s, _) in specs.items()},
            "required": list(specs),
            "additionalProperties": False,
        }
        return schema, {name: v for name, (_, v) in specs.items()}

    return make


def _person(rng: random.Random) -> str:
    return rng.choice(FIRST_NAMES)


def _email(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES).lower()}.{rng.choice(LAST_NAMES).lower()}@example.com"


FIELDS: dict[str, Callable[[random.Random], Spec]] = {
    # string
    "name": _string(_person),
    "city": _string(lambda rng: rng.choice(CITIES)),
    "title": _string(lambda rng: rng.choice(TITLES)),
    "email": _string(_email),
    "country": _string(lambda rng: rng.choice(COUNTRIES)),
    "sku": _string(lambda rng: f"SKU-{rng.randint(1000, 9999)}"),
    # integer
    "age": _integer(18, 90),
    "quantity": _integer(0, 500),
    "year": _integer(1950, 2030),
    "floor": _integer(-2, 40),
    "page_count": _integer(40, 900),
    # number
    "price": _number(_money),
    "rating": _number(lambda rng: _tenth(rng, 0, 5)),
    "weight_kg": _number(lambda rng: _tenth(rng, 0, 120)),
    "temperature_c": _number(lambda rng: _tenth(rng, -30, 45)),
    # boolean
    "in_stock": _boolean,
    "is_verified": _boolean,
    "is_public": _boolean,
    "has_parking": _boolean,
    # enum
    "color": _enum("color"),
    "status": _enum("status"),
    "priority": _enum("priority"),
    "size": _enum("size"),
    # array of strings
    "tags": _array(WORDS),
    "languages": _array(LANGUAGES),
    "ingredients": _array(INGREDIENTS),
    # object, nested one level
    "address": _object(
        street=_string(lambda rng: f"{rng.randint(1, 300)} {rng.choice(STREETS)} Street"),
        city=_string(lambda rng: rng.choice(CITIES)),
        zip=_string(lambda rng: f"{rng.randint(0, 99999):05d}"),
    ),
    "dimensions": _object(
        width=_number(lambda rng: _tenth(rng, 1, 200)),
        height=_number(lambda rng: _tenth(rng, 1, 200)),
        depth=_number(lambda rng: _tenth(rng, 1, 200)),
    ),
    "owner": _object(name=_string(_person), age=_integer(18, 90)),
    "location": _object(
        latitude=_number(lambda rng: round(rng.uniform(-90, 90), 4)),
        longitude=_number(lambda rng: round(rng.uniform(-180, 180), 4)),
    ),
}
"""Property name -> a draw of (its schema, a value); the names are STRUCTURED_FIELDS's."""


# ----------------------------------------------------------------------------- parsing and checking


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json_object(text: str, max_chars: int) -> dict[str, Any]:
    """The JSON object in `text`; ValueError when it is longer than max_chars (not parsed), not
    JSON, nested too deeply to parse, holds NaN/Infinity or a duplicate key, or is not an object."""
    if len(text) > max_chars:
        raise ValueError(f"answer of {len(text)} characters, more than {max_chars}")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def answer_text(text: str) -> str:
    """The answer part of a completion: the last ``` code block (its opening line's language tag
    dropped) of the response after any </think>, else the whole response; stripped."""
    response = final_response(text)
    close = response.rfind("```")
    if close > 0:
        start = response.rfind("```", 0, close)
        if start >= 0:
            body = response[start + 3 : close]
            newline = body.find("\n")
            if newline >= 0 and not body[:newline].strip().startswith(("{", "[")):
                body = body[newline + 1 :]
            return body.strip()
    return response


def _is_number(value: Any) -> bool:
    """A JSON number: an int (any size) or a finite float, never a boolean."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _same(a: Any, b: Any) -> bool:
    """JSON equality: numbers by value (never booleans), lists item by item, objects key by key."""
    if isinstance(b, bool) or isinstance(a, bool):
        return a is b
    if _is_number(b):
        return _is_number(a) and a == b
    if isinstance(b, str):
        return isinstance(a, str) and a == b
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    return a is None and b is None


def schema_error(value: Any, schema: dict[str, Any], path: str = "$") -> str | None:
    """What is wrong with `value` under `schema` (the SUPPORTED_KEYWORDS subset of JSON Schema),
    naming where; None when it validates. ValueError for a schema keyword outside the subset."""
    unknown = sorted(set(schema) - SUPPORTED_KEYWORDS)
    if unknown:
        raise ValueError(f"schema at {path} uses unsupported keyword(s) {unknown}")
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return f"{path}: {value!r} is not one of {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return f"{path}: expected an object, got {type(value).__name__}"
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{path}: missing required key(s) {missing}"
        if schema.get("additionalProperties", True) is False:
            extra = sorted(k for k in value if k not in props)
            if extra:
                return f"{path}: key(s) {extra} are not in the schema"
        for k, v in value.items():
            if k in props:
                err = schema_error(v, props[k], f"{path}.{k}")
                if err:
                    return err
        return None
    if kind == "array":
        if not isinstance(value, list):
            return f"{path}: expected an array, got {type(value).__name__}"
        if len(value) < schema.get("minItems", 0):
            return f"{path}: {len(value)} item(s), fewer than minItems {schema['minItems']}"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return f"{path}: {len(value)} item(s), more than maxItems {schema['maxItems']}"
        if "items" in schema:
            for i, item in enumerate(value):
                err = schema_error(item, schema["items"], f"{path}[{i}]")
                if err:
                    return err
        return None
    if kind == "string":
        ok = isinstance(value, str)
    elif kind == "integer":
        ok = _is_number(value) and (isinstance(value, int) or value.is_integer())
    elif kind == "number":
        ok = _is_number(value)
    elif kind == "boolean":
        ok = isinstance(value, bool)
    else:
        raise ValueError(f"schema at {path} has unsupported type {kind!r}")
    return None if ok else f"{path}: expected {kind}, got {type(value).__name__} {value!r}"


def value_error(value: dict[str, Any], expected: dict[str, Any], path: str = "$") -> str | None:
    """Which given value `value` lacks or holds differently (nested objects key by key); None
    when it has every one."""
    for k, want in expected.items():
        if k not in value:
            return f"{path}.{k}: missing; the prompt gave {want!r}"
        got = value[k]
        if isinstance(want, dict):
            if not isinstance(got, dict):
                return f"{path}.{k}: expected an object"
            err = value_error(got, want, f"{path}.{k}")
            if err:
                return err
        elif not _same(got, want):
            return f"{path}.{k}: {got!r}, the prompt gave {want!r}"
    return None


def judge_structured_output(answer: str, data: dict[str, Any]) -> float:
    """1.0 when `answer` parses as a JSON object (within data["max_answer_chars"]) that
    validates against data["schema"] and holds every value of data["expected"]; else 0.0."""
    try:
        value = parse_json_object(answer, data.get("max_answer_chars", 4096))
    except ValueError:
        return 0.0
    if schema_error(value, data["schema"]) is not None:
        return 0.0
    return 1.0 if value_error(value, data["expected"]) is None else 0.0


# ----------------------------------------------------------------------------- tasks


def make_record(rng: random.Random, o: Any) -> dict[str, Any]:
    """One task's schema and given values, drawn with options `o`: a dict with noun, schema and
    expected (the values the prompt gives, by property)."""
    k = rng.randint(o.min_properties, o.max_properties)
    left = {t: list(STRUCTURED_FIELDS[t]) for t in o.types}
    names: list[str] = []
    while len(names) < k:
        kind = rng.choice(sorted(t for t, v in left.items() if v))
        names.append(left[kind].pop(rng.randrange(len(left[kind]))))
    properties, required, expected = {}, [], {}
    for name in names:
        schema, value = FIELDS[name](rng)
        properties[name] = schema
        if rng.random() >= o.optional_probability:
            required.append(name)
            expected[name] = value
        elif rng.random() < 0.5:
            expected[name] = value
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"noun": rng.choice(NOUNS), "schema": schema, "expected": expected}


def prompt_text(noun: str, schema: dict[str, Any], expected: dict[str, Any]) -> str:
    """The prompt of one task: the schema, the values to use and the answer format."""
    if expected:
        lines = "\n".join(f"- {name}: {json.dumps(v)}" for name, v in expected.items())
        values = f"Use these values:\n{lines}\n"
        if len(expected) < len(schema["properties"]):
            values += "Leave out the other properties or give them any value the schema allows.\n"
    else:
        values = "Any values the schema allows will do.\n"
    return (
        f"Write a JSON object for a {noun} record that conforms to this JSON schema:\n"
        f"```json\n{json.dumps(schema, indent=2)}\n```\n{values}"
        "Reply with only the JSON object, optionally inside a ```json code block."
    )


class StructuredOutputEnv(SingleTurnEnv):
    """JSON objects that must follow a generated schema (options: StructuredOutputOptions)."""

    kind = "structured_output"
    judge = staticmethod(judge_structured_output)

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        o = self.options
        rng = random.Random(seed)
        need = self.cfg.n_train + self.cfg.n_eval
        drawn = draw_distinct(
            lambda: {**make_record(rng, o), "max_answer_chars": o.max_answer_chars},
            lambda r: json.dumps([r["schema"], r["expected"]], sort_keys=True),
            need,
            lambda found: (
                f"envs.{self.name}: found only {found} of {need} distinct schemas with types {o.types}; "
                "add types, widen the property range or lower n_train / n_eval"
            ),
        )

        def make(split: str, rows: list[dict[str, Any]]) -> list[Task]:
            return [
                self.task(split, i, self.user(prompt_text(r["noun"], r["schema"], r["expected"])), r)
                for i, r in enumerate(rows)
            ]

        return make("train", drawn[self.cfg.n_eval :]), make("eval", drawn[: self.cfg.n_eval])

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The turns a correct policy writes for `task` (after task.messages): one assistant
        turn, `<think>` what the record needs `</think>` the JSON object (bare, one line)."""
        d = task.data
        schema, expected = d["schema"], d["expected"]
        missing = [k for k in schema.get("required", []) if k not in expected]
        if missing:
            raise ValueError(
                f"env {self.name} task {task.id}: required properties {missing} have no given value, so no "
                "demonstration can be written from the task; give every required property a value"
            )
        value = {k: expected[k] for k in schema["properties"] if k in expected}
        answer = json.dumps(value)
        if judge_structured_output(answer, dict(d)) != 1.0:
            raise ValueError(
                f"env {self.name} task {task.id}: the given values {answer:.200} do not validate against the "
                "task's schema; the task is inconsistent"
            )
        required = schema.get("required", [])
        optional = [k for k in value if k not in required]
        reasoning = f"The {d['noun']} record needs {', '.join(required) or 'no property'}"
        if optional:
            reasoning += f", and the prompt also gives {', '.join(optional)}"
        reasoning += ". Only schema keys, with the given values."
        return [{"role": "assistant", "content": f"<think>{reasoning}</think>{answer}"}]

    def extract(self, task: Task, text: str) -> str | None:
        answer = answer_text(text)
        try:
            parse_json_object(answer, self.options.max_answer_chars)
        except ValueError:
            return None
        return answer
