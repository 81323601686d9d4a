"""SGLang wire translation: request parsing, response objects, and SGLang's own schema on both.

No engine here: samples are built by hand, and every body and answer goes through the schema
checks of `sglang_schema` (SGLang's generated `api_types.py`) and the `ast` read of
`io_struct.py`, so the server's field names and defaults cannot drift from SGLang's.
"""

from __future__ import annotations

import math

import pytest

from ptrain.rollout import sglang_wire as wire
from ptrain.rollout.protocol import (
    SAMPLING_KEYS,
    SGLANG_ONLY_KEYS,
    FinishReason,
    RequestError,
    Sample,
    WeightSpan,
)
from tests.rollout import sglang_schema as schema

# ---- the harness on hand-written SGLang examples ----

GOOD_REQUESTS = [
    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    {"text": "hello", "stream": True},
    {"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 2}], "rid": ["a", "b"]},
    {"text": ["a", "b"], "return_logprob": [True, False], "logprob_start_len": 0, "return_text_in_logprobs": True},
    {"input_ids": [5], "sampling_params": {"stop": ["\n"], "stop_token_ids": [2], "sampling_seed": 7}},
]


@pytest.mark.parametrize("body", GOOD_REQUESTS)
def test_schema_accepts_sglang_requests(body):
    schema.check_generate_request(body)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": "1 2 3"}, "invalid type"),
        ({"input_ids": [1], "stream": "yes"}, "expected a boolean"),
        ({"input_ids": [1], "sampling_params": {"max_new_token": 4}}, "unknown field `max_new_token`"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "expected f64"),
        ([1, 2], "expected struct GenerateRequest"),
    ],
)
def test_schema_rejects_with_sglang_message(body, message):
    with pytest.raises(AssertionError, match=message):
        schema.check_generate_request(body)


def test_schema_accepts_a_hand_written_sglang_response_and_rejects_a_broken_one():
    item = {
        "text": "hi",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": 0.5,
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, "x"]],
        },
    }
    schema.check_generate_response(item)
    schema.check_generate_response([item, item], count=2)
    bad = {**item, "meta_info": {**item["meta_info"], "output_token_logprobs": [[-0.1, 5]]}}
    with pytest.raises(AssertionError, match="3-element tuple"):
        schema.check_generate_response(bad)
    invented = {**item, "meta_info": {**item["meta_info"], "my_field": 1}}
    with pytest.raises(AssertionError, match="my_field"):
        schema.check_generate_response(invented)
    with pytest.raises(AssertionError, match="finish_reason"):
        schema.check_generate_response({**item, "meta_info": {**item["meta_info"], "finish_reason": {"type": "x"}}})


# ---- field tables against io_struct.py (ast) and the generated schema ----


def test_generate_fields_cover_sglangs_with_its_defaults():
    ours = {**wire.IMPLEMENTED_FIELDS, **wire.NO_EFFECT_FIELDS, **wire.DEFAULT_ONLY_FIELDS}
    assert len(ours) == len(wire.IMPLEMENTED_FIELDS) + len(wire.NO_EFFECT_FIELDS) + len(wire.DEFAULT_ONLY_FIELDS)
    theirs = schema.io_struct_fields("GenerateReqInput")
    assert sorted(set(theirs) - set(ours)) == [], "GenerateReqInput fields the server does not classify"
    assert sorted(set(ours) - set(theirs)) == [], "fields the server knows that GenerateReqInput lacks"
    assert {k: ours[k] for k in theirs} == theirs
    assert set(schema.struct_fields("GenerateRequest")) <= set(ours)


def test_sampling_keys_are_sglangs():
    fields = set(schema.struct_fields("SamplingParams"))
    assert fields == set(SAMPLING_KEYS) | set(SGLANG_ONLY_KEYS)
    defaults = schema.api_types().SamplingParams()
    for key, default in SGLANG_ONLY_KEYS.items():
        assert getattr(defaults, key) == default, key


@pytest.mark.parametrize(
    "cls, ours",
    [
        ("UpdateWeightFromDiskReqInput", wire.UPDATE_WEIGHTS_FIELDS),
        ("LoadLoRAAdapterReqInput", wire.LOAD_LORA_FIELDS),
        ("UnloadLoRAAdapterReqInput", wire.UNLOAD_LORA_FIELDS),
        ("PauseGenerationReqInput", wire.PAUSE_FIELDS),
        ("ContinueGenerationReqInput", wire.CONTINUE_FIELDS),
        ("AbortReq", wire.ABORT_FIELDS),
    ],
)
def test_control_bodies_have_sglangs_fields_and_defaults(cls, ours):
    theirs = dict(schema.io_struct_fields(cls))
    if cls == "UpdateWeightFromDiskReqInput":
        assert theirs["model_path"] is ...  # required there; the server answers 400 without it
        theirs["model_path"] = None
    if cls == "AbortReq":
        assert theirs["rid"] is None  # AbortReq.__post_init__ turns it into ""
        theirs["rid"] = ""
    for key in ("lora_name", "lora_path"):
        if cls.endswith("LoRAAdapterReqInput") and key in theirs:
            assert theirs[key] is ...  # required there; the server answers 400 without it
            theirs[key] = None
    assert ours == theirs


def test_lora_path_is_one_adapter_a_prompt():
    body = {"input_ids": [[1], [2], [3]], "sampling_params": {"n": 2}, "lora_path": [None, "a", "b"]}
    schema.check_generate_request(body)
    assert [r.lora_path for r in wire.parse_generate(body).requests] == [None, "a", "b"]
    assert [r.lora_path for r in wire.parse_generate({**body, "lora_path": "a"}).requests] == ["a"] * 3
    assert wire.parse_generate({"input_ids": [1], "lora_path": "a"}).requests[0].lora_path == "a"
    assert wire.parse_generate({"input_ids": [1], "lora_path": []}).requests[0].lora_path is None


# ---- request parsing ----


def _tok(text: str) -> list[int]:
    return [ord(c) % 50 + 1 for c in text]


def test_single_prompt_is_one_request():
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "rid": "x"}
    schema.check_generate_request(body)
    p = wire.parse_generate(body)
    assert p.single and p.n == 1 and not p.stream
    (r,) = p.requests
    assert r.input_ids == (1, 2, 3) and r.rid == "x" and r.sampling.max_new_tokens == 4
    assert r.sampling.temperature == 0.0 and r.return_prompt_logprobs_from is None


def test_batch_with_n_names_each_prompt_and_answers_with_a_list():
    body = {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 3}, "rid": "g"}
    schema.check_generate_request(body)
    p = wire.parse_generate(body)
    assert not p.single and p.n == 3
    assert [r.rid for r in p.requests] == ["g_0", "g_1"]
    assert [r.sampling.n for r in p.requests] == [3, 3]
    one = wire.parse_generate({"input_ids": [1], "sampling_params": {"n": 2}})
    assert not one.single and len(one.requests) == 1  # a single prompt with n > 1 answers with a list


def test_text_prompts_tokenise_and_logprob_settings_are_per_prompt():
    body = {"text": ["ab", "c"], "return_logprob": [True, False], "logprob_start_len": [0, -1]}
    schema.check_generate_request(body)
    p = wire.parse_generate(body, tokenize=_tok)
    assert [r.input_ids for r in p.requests] == [tuple(_tok("ab")), tuple(_tok("c"))]
    assert [r.return_prompt_logprobs_from for r in p.requests] == [0, None]
    assert p.return_logprob == (True, False) and p.logprob_start_len == (0, -1)


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "exactly one of 'text'"),
        ({"text": "a", "input_ids": [1]}, "exactly one of 'text'"),
        ({"input_ids": []}, "input_ids: is empty"),
        ({"input_ids": [[1], []]}, r"input_ids\[1\]: is empty"),
        ({"input_ids": [1, "2"]}, "input_ids: must be a list of integer token ids"),
        ({"input_ids": "12"}, "input_ids: must be a list"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "n: must be >= 1"),
        ({"input_ids": [1], "sampling_params": {"top_q": 1}}, r"unknown key\(s\) \['top_q'\]"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "does not implement"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens: must be an integer"),
        ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params: must be an object"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "n must be equal"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "has 1 entries for 2 prompts"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"temperature": -1}]}, r"sampling_params\[1\].temperature"),
        ({"input_ids": [[1], [2]], "sampling_params": {"n": 2}, "return_logprob": [True, True]}, "n > 1"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "not below the prompt's 2 tokens"),
        ({"input_ids": [1], "logprob_start_len": -2, "return_logprob": True}, "must be -1"),
        ({"input_ids": [1], "stream": 1}, "stream: must be true or false"),
        ({"input_ids": [1], "rid": ""}, "rid: is empty"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid: has 1 ids for 2 prompts"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "duplicate request ids"),
        ({"input_ids": [1], "image_data": "cat.png"}, "image_data: this server does not implement it"),
        (
            {"input_ids": [1], "lora_id": "abc"},
            "lora_id: this server does not implement it.*name the adapter in lora_path",
        ),
        ({"input_ids": [[1], [2]], "lora_path": ["a"]}, "lora_path: has 1 entries for 2 prompts"),
        ({"input_ids": [[1], [2]], "lora_path": ["a", 3]}, r"lora_path\[1\]: must be the name of a loaded LoRA"),
        ({"input_ids": [1], "top_logprobs_num": 21}, r"top_logprobs_num: must be an integer in \[0, 20\]"),
        ({"input_ids": [1], "token_ids_logprob": [5]}, "token_ids_logprob: chosen-token log-probs"),
        ({"text": "a"}, "no tokenizer"),
        ([{"input_ids": [1]}], "must be a JSON object"),
    ],
)
def test_bad_requests_name_the_field(body, message):
    with pytest.raises(RequestError, match=message):
        wire.parse_generate(body)


def test_defaults_and_unknown_top_level_keys_pass_as_in_sglang():
    body = {"input_ids": [1], "image_data": None, "return_hidden_states": False, "lora_path": [], "my_key": 1}
    p = wire.parse_generate(body)
    assert p.ignored_fields == ("my_key",)
    schema.check_generate_request(body)


def test_every_accepted_request_also_passes_sglangs_schema():
    for body in GOOD_REQUESTS:
        body = {**body}
        if isinstance(body.get("sampling_params"), dict):
            body["sampling_params"] = {k: v for k, v in body["sampling_params"].items() if k != "stop"}
        wire.parse_generate(body, tokenize=_tok)
        schema.check_generate_request(body)


# ---- response objects ----


def _sample(**kw) -> Sample:
    base = dict(
        rid="r",
        index=0,
        prompt_ids=(1, 2, 3),
        output_ids=(7, 8),
        logprobs=(-0.5, -1.5),
        sampling_logprobs=(-0.4, -1.0),
        finish_reason=FinishReason("length", length=2),
        weight_version="v1",
        cached_tokens=2,
        e2e_latency_s=0.25,
    )
    base.update(kw)
    return Sample(**base)


def test_item_has_sglangs_fields_and_logprob_triples():
    s = _sample(prompt_logprobs=(-2.0, -3.0))
    item = wire.generate_item(
        s, text="xy", return_logprob=True, logprob_start_len=0, token_texts=lambda ids: [f"t{i}" for i in ids]
    )
    schema.check_generate_response(item)
    meta = item["meta_info"]
    assert item["text"] == "xy" and item["output_ids"] == [7, 8]
    assert meta["output_token_logprobs"] == [[-0.5, 7, "t7"], [-1.5, 8, "t8"]]
    assert meta["input_token_logprobs"] == [[None, 1, "t1"], [-2.0, 2, "t2"], [-3.0, 3, "t3"]]
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 2, 2)
    assert meta["weight_version"] == "v1" and meta["e2e_latency"] == 0.25 and meta["id"] == "r"


def test_prompt_logprobs_from_a_later_position_and_no_text_without_tokenizer():
    s = _sample(prompt_logprobs=(-3.0,))
    item = wire.generate_item(s, text=None, return_logprob=True, logprob_start_len=1)
    schema.check_generate_response(item)
    assert "text" not in item
    assert item["meta_info"]["input_token_logprobs"] == [[None, 2, None], [-3.0, 3, None]]


def test_n_samples_of_a_batch_are_prompt_major_and_ids_name_each_sample():
    items = [[wire.generate_item(_sample(rid=f"p{i}", index=j), text="") for j in range(3)] for i in range(2)]
    body = wire.order_items(items, single=False)
    schema.check_generate_response(body, count=6)
    assert [x["meta_info"]["id"] for x in body] == ["p0", "p0-1", "p0-2", "p1", "p1-1", "p1-2"]
    one = wire.order_items([[wire.generate_item(_sample(), text="")]], single=True)
    assert isinstance(one, dict)


def test_weight_spans_and_non_finite_logprobs():
    s = _sample(
        logprobs=(-math.inf, -1.0),
        weight_versions=(WeightSpan("v0", 0, 1), WeightSpan("v1", 1, 2)),
        finish_reason=FinishReason("stop", matched=8),
    )
    item = wire.generate_item(s, text="", return_logprob=True)
    schema.check_generate_response(item)
    meta = item["meta_info"]
    assert meta["output_token_logprobs"][0][0] is None
    assert meta["weight_versions"] == [{"version": "v0", "start": 0, "end": 1}, {"version": "v1", "start": 1, "end": 2}]
    assert meta["finish_reason"] == {"type": "stop", "matched": 8}


def test_a_client_reads_a_sample_back():
    s = _sample(prompt_logprobs=(-2.0, -3.0), weight_versions=(WeightSpan("v1", 0, 2),))
    item = wire.generate_item(s, text="xy", return_logprob=True, logprob_start_len=0)
    back = wire.sample_from_item(item, s.prompt_ids)
    assert back.output_ids == s.output_ids and back.logprobs == s.logprobs
    assert back.finish_reason == s.finish_reason and back.weight_version == "v1"
    assert back.prompt_logprobs == s.prompt_logprobs and back.cached_tokens == 2
    assert back.weight_versions == s.weight_versions
    aborted = wire.generate_item(_sample(finish_reason=FinishReason("abort", message="stop now")), text="")
    assert wire.sample_from_item(
        {**aborted, "meta_info": {**aborted["meta_info"], "output_token_logprobs": [[-1.0, 7, None], [-2.0, 8, None]]}},
        (1,),
    ).finish_reason == FinishReason("abort", message="stop now")
    with pytest.raises(ValueError, match="return_logprob"):
        wire.sample_from_item(wire.generate_item(s, text=""), s.prompt_ids)
