"""Tinker's wire format <-> ptrain values: the codec of `ptrain/tinker/server.py`.

Three payloads of Tinker's REST API are protobuf messages of the `tinker` SDK's own schema
(`tinker.proto.tinker_public_pb2`): the `forward_backward` request, and the results of a
forward/backward pass and of a sample, which the SDK reads only as protobuf. Everything else
is JSON. This module turns those messages into `ptrain.client.Datum` lists and plain dicts
for `TinkerService`, and the service's results back into bytes the SDK decodes.

Layouts, as the SDK writes and reads them:
  - token chunks: int32 little-endian bytes; a datum's model input is its chunks in order,
    and only text chunks are accepted (this server has no image or audio encoder);
  - a `Tensor` (one loss input): `dense` bytes of `dtype`, reshaped to `shape` (a sparse
    CSR tensor is made dense here);
  - a `BatchedTensor` (one output field over the datums): the datums' arrays back to back,
    with `offsets` the int64 byte offsets of each datum's start plus the end;
  - prompt log-probs: float32 bytes, NaN where there is none (the first prompt token).

Malformed input raises `WireError`, a ValueError whose message names what was wrong, so the
server answers it as a user error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ptrain.client import Datum

PROTOBUF_TYPE = "application/x-protobuf"
OUTPUT_RECORD_TYPE = "ArrayRecord"
"""`ForwardBackwardOutput.loss_fn_output_type`: per-datum records of named arrays."""
TOPK_MASK_LOGPROB = -99999.0
"""The SDK's filler for top-k slots a position does not have (token id 0 with this logprob)."""


class WireError(ValueError):
    """A request body that is not what Tinker's protocol says; the message says what is wrong."""


def pb():
    """The SDK's generated protobuf module: the schema both ends share, so it is never copied here."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # the tinker SDK is an optional dependency of ptrain
        raise ImportError("ptrain.tinker needs the Tinker SDK for its protobuf schema: pip install tinker") from e
    return tinker_public_pb2


@dataclass
class ForwardBackwardCall:
    """One decoded `forward_backward` (or `forward`) request."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None
    forward_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------- requests


def decode_forward_backward(
    body: bytes, content_type: str = PROTOBUF_TYPE, content_encoding: str | None = None
) -> ForwardBackwardCall:
    """A `forward_backward` body: protobuf (what SDK 0.38 sends) or JSON (older SDKs, and
    the `forward` route), zstd-compressed when `content_encoding` says so."""
    if (content_encoding or "").strip().lower() == "zstd":
        try:
            import zstandard
        except ImportError as e:
            raise WireError("the body is zstd-compressed, but the zstandard package is not installed") from e
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as e:
            raise WireError(f"the body is not valid zstd data ({e})") from None
    if "json" in (content_type or "").lower():
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise WireError(f"the body is not JSON ({e})") from None
        return decode_forward_backward_json(obj)
    return decode_forward_backward_proto(body)


def decode_forward_backward_proto(body: bytes) -> ForwardBackwardCall:
    from google.protobuf.message import DecodeError

    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"the body is not a tinker_public.ForwardBackwardRequest protobuf ({e})") from None
    if not msg.model_id:
        raise WireError("forward_backward: model_id is missing")
    data = []
    for i, d in enumerate(msg.data):
        tokens = _tokens_of_proto_chunks(d.model_input, where=f"data[{i}]")
        inputs = {name: _array_of_proto_tensor(t, where=f"data[{i}].loss_fn_inputs[{name!r}]")
                  for name, t in d.loss_fn_inputs.items()}  # fmt: skip
        data.append(_datum(tokens, inputs, where=f"data[{i}]"))
    config: dict[str, float | str] = {}
    for k, v in msg.loss_fn_config.items():
        config[k] = float(v)
    for k, v in msg.loss_fn_config_v2.items():  # the newer map wins: it also carries strings
        arm = v.WhichOneof("value")
        if arm == "number":
            config[k] = float(v.number)
        elif arm == "text":
            config[k] = v.text
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        data=data,
        loss_fn=msg.loss_fn,
        loss_fn_config=config or None,
        forward_only=bool(msg.forward_only),
    )


def decode_forward_backward_json(obj: Any) -> ForwardBackwardCall:
    """The JSON shape: {model_id, seq_id, forward_backward_input | forward_input: {data,
    loss_fn, loss_fn_config}, forward_only?}, datums as {model_input: {chunks}, loss_fn_inputs:
    {name: {data, dtype, shape}}}."""
    if not isinstance(obj, dict):
        raise WireError("the body must be a JSON object")
    forward_only = "forward_input" in obj and "forward_backward_input" not in obj
    inner = obj.get("forward_backward_input", obj.get("forward_input"))
    if not isinstance(inner, dict):
        raise WireError("the body needs forward_backward_input (or forward_input): {data, loss_fn, loss_fn_config}")
    model_id = obj.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise WireError("model_id is missing")
    raw_data = inner.get("data")
    if not isinstance(raw_data, list):
        raise WireError("forward_backward_input.data must be a list of datums")
    data = []
    for i, d in enumerate(raw_data):
        if not isinstance(d, dict):
            raise WireError(f"data[{i}] must be an object with model_input and loss_fn_inputs")
        tokens = decode_model_input_json(d.get("model_input"), where=f"data[{i}].model_input")
        raw_inputs = d.get("loss_fn_inputs") or {}
        if not isinstance(raw_inputs, dict):
            raise WireError(f"data[{i}].loss_fn_inputs must be an object of tensors")
        inputs = {name: _array_of_json_tensor(t, where=f"data[{i}].loss_fn_inputs[{name!r}]")
                  for name, t in raw_inputs.items()}  # fmt: skip
        data.append(_datum(tokens, inputs, where=f"data[{i}]"))
    loss_fn = inner.get("loss_fn")
    if not isinstance(loss_fn, str):
        raise WireError("forward_backward_input.loss_fn must be a loss name")
    config = inner.get("loss_fn_config")
    if config is not None and not isinstance(config, dict):
        raise WireError("forward_backward_input.loss_fn_config must be an object of numbers")
    seq_id = obj.get("seq_id")
    return ForwardBackwardCall(
        model_id=model_id,
        seq_id=int(seq_id) if isinstance(seq_id, int) else 0,
        data=data,
        loss_fn=loss_fn,
        loss_fn_config=dict(config) if config else None,
        forward_only=bool(obj.get("forward_only", forward_only)),
    )


def decode_model_input_json(model_input: Any, where: str = "prompt") -> list[int]:
    """A JSON ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}) -> its token ids."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise WireError(f"{where} must be a ModelInput: {{'chunks': [{{'type': 'encoded_text', 'tokens': [...]}}]}}")
    tokens: list[int] = []
    for j, chunk in enumerate(model_input["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise WireError(_unsupported_chunk(f"{where}.chunks[{j}]", kind))
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise WireError(f"{where}.chunks[{j}].tokens must be a list of token ids")
        tokens.extend(ids)
    return tokens


def _unsupported_chunk(where: str, kind: Any) -> str:
    return (
        f"{where}: a {kind!r} chunk; this server takes text only (encoded_text chunks), "
        "it has no image or audio encoder"
    )


def _tokens_of_proto_chunks(chunks, where: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(_unsupported_chunk(f"{where}.model_input[{j}]", kind))
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{where}.model_input[{j}]: token bytes are not whole int32 values")
        tokens.extend(np.frombuffer(raw, dtype="<i4").tolist())
    return tokens


_PROTO_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}
"""tinker_public.DType -> numpy: FLOAT32, INT64, INT32 (BFLOAT16, 4, is widened separately)."""
_BFLOAT16 = 4


def _array_of_proto_tensor(t, where: str) -> np.ndarray:
    shape = [int(s) for s in t.shape]
    if t.dtype == _BFLOAT16:
        dtype = np.dtype("<u2")
    elif t.dtype in _PROTO_DTYPES:
        dtype = _PROTO_DTYPES[t.dtype]
    else:
        raise WireError(f"{where}: unsupported tensor dtype {t.dtype} (float32 and int64 are Tinker's)")

    def read(raw: bytes, dt: np.dtype, what: str) -> np.ndarray:
        if len(raw) % dt.itemsize:
            raise WireError(f"{where}: {what} bytes are not whole {dt.name} values")
        return np.frombuffer(raw, dtype=dt)

    if t.HasField("sparse_csr"):
        values = read(t.sparse_csr.values, dtype, "values")
        crow = read(t.sparse_csr.crow_indices, np.dtype("<i8"), "crow_indices")
        col = read(t.sparse_csr.col_indices, np.dtype("<i8"), "col_indices")
        arr = _dense_of_csr(values, crow, col, shape, where)
    else:
        arr = read(t.dense, dtype, "dense")
    if t.dtype == _BFLOAT16:  # bfloat16 is the high half of a float32
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return _shaped(arr, shape, where)


def _array_of_json_tensor(t: Any, where: str) -> np.ndarray:
    if not isinstance(t, dict) or "data" not in t:
        raise WireError(
            f"{where} must be a TensorData: {{'data': [...], 'dtype': 'int64' | 'float32', 'shape': [...]}}"
        )
    dtype = {"int64": np.int64, "float32": np.float32}.get(t.get("dtype"))
    if dtype is None:
        raise WireError(f"{where}.dtype must be 'int64' or 'float32', got {t.get('dtype')!r}")
    try:
        values = np.asarray(t["data"], dtype=dtype).reshape(-1)
    except (TypeError, ValueError) as e:
        raise WireError(f"{where}.data is not a list of numbers ({e})") from None
    shape = t.get("shape")
    if t.get("sparse_crow_indices") is not None:
        if not shape or t.get("sparse_col_indices") is None:
            raise WireError(f"{where}: a sparse tensor needs shape and sparse_col_indices")
        crow = np.asarray(t["sparse_crow_indices"], dtype=np.int64)
        col = np.asarray(t["sparse_col_indices"], dtype=np.int64)
        values = _dense_of_csr(values, crow, col, list(shape), where)
    return _shaped(values, list(shape) if shape is not None else None, where)


def _dense_of_csr(values: np.ndarray, crow: np.ndarray, col: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or (len(crow) and crow[-1] != len(col)):
        raise WireError(f"{where}: inconsistent sparse CSR tensor (shape {shape})")
    dense = np.zeros(shape, dtype=values.dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    if len(col) and (col.min() < 0 or col.max() >= shape[1]):
        raise WireError(f"{where}: sparse column index out of range (shape {shape})")
    dense[rows, col] = values
    return dense.reshape(-1)


def _shaped(arr: np.ndarray, shape: list[int] | None, where: str) -> np.ndarray:
    if shape:
        if math.prod(shape) != arr.size:
            raise WireError(f"{where}: {arr.size} values do not fill shape {shape}")
        arr = arr.reshape(shape)
    # the SDK's two public dtypes: integers as int64, everything else as float32
    return arr.astype(np.int64 if arr.dtype.kind in "iu" else np.float32)


def _datum(tokens: list[int], inputs: dict[str, np.ndarray], where: str) -> Datum:
    if not tokens:
        raise WireError(f"{where}: the model input has no tokens")
    for name, arr in inputs.items():
        # per-token inputs are aligned with the model input: position t scores target_tokens[t]
        if arr.ndim >= 1 and arr.shape[0] != len(tokens):
            raise WireError(
                f"{where}.loss_fn_inputs[{name!r}] has {arr.shape[0]} rows for a model input of {len(tokens)} tokens; "
                "per-token inputs must match it"
            )
    return Datum(tokens=tokens, loss_fn_inputs=inputs)


def encode_forward_backward_request(call: ForwardBackwardCall) -> bytes:
    """The inverse of decode_forward_backward_proto (for tests and tools that talk to a Tinker server)."""
    p = pb()
    msg = p.ForwardBackwardRequest(model_id=call.model_id, seq_id=call.seq_id, loss_fn=call.loss_fn)
    msg.forward_only = call.forward_only
    for k, v in (call.loss_fn_config or {}).items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config[k] = float(v)
            msg.loss_fn_config_v2[k].number = float(v)
    for d in call.data:
        dm = msg.data.add()
        dm.model_input.add().encoded_text.tokens = np.asarray(d.tokens, dtype="<i4").tobytes()
        for name, arr in d.loss_fn_inputs.items():
            a = np.asarray(arr)
            a = a.astype("<i8") if a.dtype.kind in "iu" else a.astype("<f4")
            t = dm.loss_fn_inputs[name]
            t.dtype = p.DTYPE_INT64 if a.dtype.kind == "i" else p.DTYPE_FLOAT32
            t.shape.extend(a.shape)
            t.dense = a.tobytes()
    return msg.SerializeToString()


# ------------------------------------------------------------------------------ responses


def tinker_metrics(metrics: dict[str, Any], loss: float | None = None) -> dict[str, float]:
    """Metrics as the SDK combines them across request chunks: each key is `name:reduction`
    with exactly one colon (it splits on it), so a bare name becomes `name:mean` and extra
    colons in a name become '/'. `loss:sum` is set from `loss` when given."""
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        try:
            value = float(np.asarray(value))
        except (TypeError, ValueError):
            continue  # a non-numeric metric has no place in a str -> float map
        name, sep, reduction = str(key).rpartition(":")
        key = f"{name.replace(':', '/')}:{reduction}" if sep else f"{key}:mean"
        out[key] = value
    if loss is not None:
        out["loss:sum"] = float(np.asarray(loss))
    return out


def _batched(p, arrays: list[np.ndarray], dtype: np.dtype, proto_dtype: int):
    """Per-datum arrays (same trailing shape) -> one BatchedTensor."""
    arrays = [np.ascontiguousarray(np.asarray(a), dtype=dtype) for a in arrays]
    trailing = list(arrays[0].shape[1:]) if arrays else []
    sizes = [a.nbytes for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype("<i8")
    bt = p.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=proto_dtype)
    bt.trailing_shape.extend(trailing)
    return bt


def loss_fn_output_fields(out: Any) -> dict[str, list[np.ndarray]]:
    """The per-datum arrays of a forward result by output name: `logprobs` (the targets'
    log-probs under the current weights, what the cookbook's trainers read), and
    `elementwise_loss` when the result carries it."""
    fields = {"logprobs": [np.asarray(a, dtype=np.float32).reshape(-1) for a in out.logprobs]}
    extra = getattr(out, "elementwise_loss", None)
    if extra is not None:
        fields["elementwise_loss"] = [np.asarray(a, dtype=np.float32).reshape(-1) for a in extra]
    return fields


def encode_forward_backward_output(out: Any) -> bytes:
    """A `ptrain.client.ForwardOutput` (logprobs, loss, metrics) -> ForwardBackwardOutput protobuf bytes."""
    p = pb()
    fields = loss_fn_output_fields(out)
    msg = p.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_RECORD_TYPE)
    record = msg.loss_fn_outputs.add(num_datums=len(out.logprobs))
    for name, arrays in fields.items():
        record.fields[name].CopyFrom(_batched(p, arrays, np.dtype("<f4"), p.DTYPE_FLOAT32))
    for k, v in tinker_metrics(out.metrics, getattr(out, "loss", None)).items():
        msg.metrics[k] = v
    return msg.SerializeToString()


def forward_backward_output_json(out: Any) -> dict:
    """The same result as JSON, for clients that do not ask for protobuf."""
    fields = loss_fn_output_fields(out)
    n = len(out.logprobs)
    outputs = [
        {name: {"data": arrays[i].tolist(), "dtype": "float32", "shape": list(arrays[i].shape)}
         for name, arrays in fields.items()}
        for i in range(n)
    ]  # fmt: skip
    return {
        "loss_fn_output_type": OUTPUT_RECORD_TYPE,
        "loss_fn_outputs": outputs,
        "metrics": tinker_metrics(out.metrics, getattr(out, "loss", None)),
    }


_STOP_REASONS = {"stop": 0, "length": 1}
"""SampleResponse stop reasons -> tinker_public.StopReason."""


def _stop_reason(value: Any) -> int:
    if value not in _STOP_REASONS:
        raise ValueError(f"sample: stop_reason must be 'stop' or 'length', got {value!r}")
    return _STOP_REASONS[value]


def _prompt_logprobs_array(values: list) -> np.ndarray:
    return np.asarray([math.nan if v is None else float(v) for v in values], dtype="<f4")


def _topk(p, rows: list, msg) -> None:
    """Ragged [(id, logprob)] rows (None where there are none) -> a dense TopkLogprobs, padded
    with the SDK's sentinel (id 0, MASK logprob) that it reads back as missing."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), TOPK_MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (tid, lp) in enumerate(row or ()):
            ids[i, j], lps[i, j] = int(tid), float(lp)
    msg.token_ids, msg.logprobs, msg.k, msg.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def encode_sample_response(result: dict) -> bytes:
    """`TinkerService.sample`'s dict -> SampleResponse protobuf bytes."""
    p = pb()
    msg = p.SampleResponse()
    for seq in result.get("sequences") or ():
        s = msg.sequences.add(stop_reason=_stop_reason(seq.get("stop_reason")))
        s.tokens = np.asarray(seq.get("tokens") or [], dtype="<i4").tobytes()
        if seq.get("logprobs") is not None:
            s.logprobs = np.asarray(seq["logprobs"], dtype="<f4").tobytes()
    if result.get("prompt_logprobs") is not None:
        msg.prompt_logprobs = _prompt_logprobs_array(result["prompt_logprobs"]).tobytes()
    if result.get("topk_prompt_logprobs") is not None:
        _topk(p, result["topk_prompt_logprobs"], msg.topk_prompt_logprobs)
    return msg.SerializeToString()


def sample_response_json(result: dict) -> dict:
    """The same result as JSON, for clients that do not ask for protobuf."""
    out = {
        "type": "sample",
        "sequences": [
            {
                "tokens": [int(t) for t in seq.get("tokens") or ()],
                "logprobs": None if seq.get("logprobs") is None else [float(x) for x in seq["logprobs"]],
                "stop_reason": seq.get("stop_reason"),
            }
            for seq in result.get("sequences") or ()
        ],
        "prompt_logprobs": result.get("prompt_logprobs"),
    }
    if result.get("topk_prompt_logprobs") is not None:
        out["topk_prompt_logprobs"] = [
            None if row is None else [[int(t), float(lp)] for t, lp in row] for row in result["topk_prompt_logprobs"]
        ]
    return out
