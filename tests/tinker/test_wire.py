"""ptrain/tinker/wire.py against the tinker SDK's own encoders and decoders: what the SDK
writes decodes into the Datums it describes, and what the codec writes the SDK reads back."""

import json

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from ptrain.client import Datum, ForwardOutput  # noqa: E402
from ptrain.tinker import wire  # noqa: E402


def sdk_request(data, loss_fn="cross_entropy", config=None, forward_only=False) -> bytes:
    """The bytes tinker's training resource posts to /api/v1/forward_backward."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="run-1",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def sdk_datum(tokens, **inputs):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={k: types.TensorData.from_numpy(np.asarray(v)) for k, v in inputs.items()},
    )


def test_sdk_forward_backward_request_decodes_to_datums():
    data = [
        sdk_datum([5, 6, 7], target_tokens=np.array([6, 7, 8], np.int64), weights=np.array([0, 1, 1], np.float32)),
        sdk_datum([9, 10], target_tokens=np.array([10, 11], np.int64), weights=np.array([1, 1], np.float32)),
    ]
    call = wire.decode_forward_backward(sdk_request(data, config={"clip_low": 0.8, "mode": "token"}))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("run-1", 3, "cross_entropy", False)
    assert call.loss_fn_config == {"clip_low": pytest.approx(0.8), "mode": "token"}
    assert [list(d.tokens) for d in call.data] == [[5, 6, 7], [9, 10]]
    targets = call.data[0].loss_fn_inputs["target_tokens"]
    assert targets.dtype == np.int64 and targets.tolist() == [6, 7, 8]
    weights = call.data[0].loss_fn_inputs["weights"]
    assert weights.dtype == np.float32 and weights.tolist() == [0, 1, 1]


def test_several_text_chunks_concatenate_and_forward_only_is_kept():
    datum = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]
        ),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array([2, 3, 4]))},
    )
    call = wire.decode_forward_backward(sdk_request([datum], forward_only=True))
    assert list(call.data[0].tokens) == [1, 2, 3] and call.forward_only


def test_image_chunk_is_refused_with_a_clear_message():
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
        loss_fn_inputs={},
    )
    with pytest.raises(wire.WireError, match="text only"):
        wire.decode_forward_backward(sdk_request([datum]))


def test_malformed_bodies_raise_wire_errors():
    with pytest.raises(wire.WireError, match="ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff garbage")
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.decode_forward_backward(b"{nope", "application/json")
    misaligned = [sdk_datum([1, 2, 3], target_tokens=np.array([2, 3], np.int64))]
    with pytest.raises(wire.WireError, match="per-token inputs"):
        wire.decode_forward_backward(sdk_request(misaligned))


def test_sparse_tensor_becomes_dense():
    td = types.TensorData(
        data=[7, 9], dtype="int64", shape=[2, 3], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[2, 0]
    )
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"ids": td})
    call = wire.decode_forward_backward(sdk_request([datum]))
    assert call.data[0].loss_fn_inputs["ids"].tolist() == [[0, 0, 7], [9, 0, 0]]


def test_zstd_body_and_json_form():
    zstandard = pytest.importorskip("zstandard")
    body = sdk_request([sdk_datum([4, 5], target_tokens=np.array([5, 6], np.int64))])
    call = wire.decode_forward_backward(zstandard.ZstdCompressor().compress(body), content_encoding="zstd")
    assert list(call.data[0].tokens) == [4, 5]

    as_json = {
        "model_id": "run-2",
        "seq_id": 1,
        "forward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}},
                }
            ],
            "loss_fn": "cross_entropy",
        },
    }
    call = wire.decode_forward_backward(json.dumps(as_json).encode(), "application/json")
    assert (
        call.model_id == "run-2"
        and call.forward_only
        and call.data[0].loss_fn_inputs["target_tokens"].tolist() == [2, 3]
    )
    with pytest.raises(wire.WireError, match="image"):
        wire.decode_model_input_json({"chunks": [{"type": "image", "data": "", "format": "png"}]})


def test_encode_request_round_trips():
    call = wire.ForwardBackwardCall(
        model_id="m",
        seq_id=2,
        data=[Datum([1, 2], {"target_tokens": np.array([2, 3]), "advantages": np.array([0.5, -1.0])})],
        loss_fn="importance_sampling",
        loss_fn_config={"x": 1.0},
    )
    back = wire.decode_forward_backward(wire.encode_forward_backward_request(call))
    assert back.loss_fn == "importance_sampling" and back.loss_fn_config == {"x": 1.0}
    assert back.data[0].loss_fn_inputs["advantages"].dtype == np.float32


def test_forward_backward_output_decodes_with_the_sdk():
    logprobs = [np.array([-0.5, -1.25, -2.0], np.float32), np.array([-0.75], np.float32)]
    out = ForwardOutput(logprobs=logprobs, loss=4.5, metrics={"loss:sum": 4.5, "tokens": 4, "a:b:max": 2.0})
    sdk = deserialize_forward_backward_output(wire.encode_forward_backward_output(out))
    assert isinstance(sdk, types.ForwardBackwardOutput) and len(sdk.loss_fn_outputs) == 2
    for got, want in zip(sdk.loss_fn_outputs, logprobs, strict=True):
        assert got["logprobs"].dtype == "float32" and got["logprobs"].shape == [len(want)]
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)
    assert sdk.metrics == {"loss:sum": 4.5, "tokens:mean": 4.0, "a/b:max": 2.0}
    as_json = wire.forward_backward_output_json(out)
    assert as_json["loss_fn_outputs"][1]["logprobs"] == {"data": [-0.75], "dtype": "float32", "shape": [1]}


def test_sample_response_decodes_with_the_sdk():
    result = {
        "sequences": [
            {"tokens": [3, 4, 5], "logprobs": [-0.1, -0.2, -0.3], "stop_reason": "stop"},
            {"tokens": [6], "logprobs": None, "stop_reason": "length"},
        ],
        "prompt_logprobs": [None, -1.5, -2.5],
        "topk_prompt_logprobs": [None, [(7, -0.5), (8, -1.0)], [(9, -0.25)]],
    }
    sdk = deserialize_sample_response(wire.encode_sample_response(result))
    assert [s.tokens for s in sdk.sequences] == [[3, 4, 5], [6]]
    assert [s.stop_reason for s in sdk.sequences] == ["stop", "length"]
    assert sdk.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3]) and sdk.sequences[1].logprobs is None
    assert sdk.prompt_logprobs == [None, -1.5, -2.5]
    assert sdk.topk_prompt_logprobs == [None, [(7, -0.5), (8, -1.0)], [(9, -0.25)]]
    assert wire.sample_response_json(result)["sequences"][1] == {
        "tokens": [6],
        "logprobs": None,
        "stop_reason": "length",
    }
    with pytest.raises(ValueError, match="stop_reason"):
        wire.encode_sample_response({"sequences": [{"tokens": [1], "stop_reason": "eos"}]})
