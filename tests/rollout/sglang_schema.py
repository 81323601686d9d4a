"""SGLang's own schema, for checking every request and response the tests exchange.

SGLang 0.5.23 ships its HTTP JSON contract as generated msgspec structs in
`sglang/api/v1/api_types.py`; with `pip install --no-deps "sglang==0.5.23"` and `msgspec`
that one file loads by path (never `import sglang`, which needs its GPU stack). Its
`from_json_value` decoders are what SGLang's server runs on a request body and what a
client runs on an answer; they raise `JsonContractError` with SGLang's own message, which
the checks below pass on.

The schema is lenient by design (unknown keys are ignored), so the response checks add
what a faithful server must also do: use no field the schema lacks, and fill the
`meta_info` fields clients read. `io_struct_fields` reads the dataclass fields and
defaults of `srt/managers/io_struct.py` with `ast` (that module imports torch).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import pathlib
from typing import Any

import pytest

INSTALL = 'pip install --no-deps "sglang==0.5.23" msgspec'
META_INFO_REQUIRED = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version")


def sglang_file(relative: str) -> pathlib.Path:
    """A file of the installed sglang distribution; skips the test when it is absent."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"sglang's package files are not installed; {INSTALL}")
    path = pathlib.Path(dist.locate_file(f"sglang/{relative}"))
    if not path.is_file():
        pytest.skip(f"{path} is missing; {INSTALL}")
    return path


@functools.cache
def api_types():
    """`sglang/api/v1/api_types.py`, loaded by path as a module of its own."""
    path = sglang_file("api/v1/api_types.py")
    if importlib.util.find_spec("msgspec") is None:
        pytest.skip(f"msgspec is not installed; {INSTALL}")
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decode(struct_name: str, obj: Any, what: str):
    t = api_types()
    try:
        return getattr(t, struct_name).from_json_value(obj)
    except t.JsonContractError as e:
        raise AssertionError(f"SGLang's schema rejects the {what}: {e}\n{obj!r}"[:4000]) from None


def struct_fields(struct_name: str) -> tuple[str, ...]:
    """The JSON field names of one schema struct."""
    return tuple(getattr(api_types(), struct_name).__struct_fields__)


def _only_known(obj: dict, struct_name: str, what: str) -> None:
    extra = sorted(set(obj) - set(struct_fields(struct_name)))
    assert not extra, f"the {what} has fields SGLang's {struct_name} does not define: {extra}"


def check_generate_request(obj: Any):
    """A `/generate` body as SGLang's server checks it (GenerateRequest); returns the struct."""
    return _decode("GenerateRequest", obj, "/generate request")


def check_generate_item(obj: Any, *, final: bool = True):
    """One response object (GenerateResponse); `final`: its finish_reason must be set."""
    t = api_types()
    item = _decode("GenerateResponse", obj, "/generate response")
    _only_known(obj, "GenerateResponse", "/generate response")
    assert isinstance(obj.get("output_ids"), list), f"output_ids missing: {obj!r}"[:2000]
    meta = obj.get("meta_info")
    assert isinstance(meta, dict), f"meta_info missing: {obj!r}"[:2000]
    _only_known(meta, "GenerateMetaInfo", "meta_info")
    missing = [k for k in META_INFO_REQUIRED if k not in meta]
    assert not missing, f"meta_info lacks {missing}: {meta!r}"[:2000]
    assert isinstance(meta.get("e2e_latency"), float), f"meta_info.e2e_latency must be seconds: {meta!r}"[:2000]
    finish = item.meta_info.finish_reason
    if final:
        assert isinstance(finish, (t.FinishStop, t.FinishLength, t.FinishAbort)), (
            f"finish_reason is not one of SGLang's stop/length/abort objects: {meta.get('finish_reason')!r}"
        )
    if "output_token_logprobs" in meta:
        assert [e[1] for e in meta["output_token_logprobs"]] == obj["output_ids"], "log-prob token ids != output_ids"
    assert meta["completion_tokens"] == len(obj["output_ids"]), "completion_tokens != len(output_ids)"
    return item


def check_generate_response(obj: Any, *, count: int | None = None):
    """A whole `/generate` answer: one object, or a list of `count` objects."""
    if isinstance(obj, list):
        if count is not None:
            assert len(obj) == count, f"expected {count} response objects, got {len(obj)}"
        return [check_generate_item(x) for x in obj]
    assert count in (None, 1), f"expected a list of {count} response objects, got one object"
    return check_generate_item(obj)


def check_stream_chunk(obj: Any):
    """One SSE `data:` object of a streamed `/generate`: a partial or final response, or an error."""
    if "error" in obj:
        return _decode("GenerateStreamError", obj, "stream error chunk")
    final = (obj.get("meta_info") or {}).get("finish_reason") is not None
    return check_generate_item(obj, final=final)


def check_error(obj: Any) -> str:
    """SGLang's native error body `{"error": {"message": ...}}`; returns the message."""
    assert isinstance(obj, dict) and isinstance(obj.get("error"), dict), f"not SGLang's error shape: {obj!r}"
    body = _decode("ErrorBody", obj["error"], "error body")
    assert body.message, f"the error has no message: {obj!r}"
    return body.message


def check_model_info(obj: Any):
    """A `/model_info` answer (GetModelInfoResponse)."""
    return _decode("GetModelInfoResponse", obj, "/model_info response")


def check_server_info(obj: Any):
    """A `/server_info` answer (GetServerInfoResponse)."""
    return _decode("GetServerInfoResponse", obj, "/server_info response")


def check_abort_request(obj: Any):
    """An `/abort_request` body (AbortRequest)."""
    return _decode("AbortRequest", obj, "/abort_request body")


def _default_of(value: ast.expr | None) -> Any:
    """A dataclass field's default from its AST: literal, `field(default=...)`, or `field(default_factory=X)`."""
    if value is None:
        return ...  # required
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.literal_eval(kw.value)
            if kw.arg == "default_factory":
                return {"list": [], "dict": {}}.get(getattr(kw.value, "id", ""), ...)
        return ...
    return ast.literal_eval(value)


@functools.cache
def io_struct_fields(class_name: str) -> dict[str, Any]:
    """{field: default} of a class in `srt/managers/io_struct.py`, read with `ast`
    (`...` marks a required field). Includes fields of its `BaseReq` base when it has one."""
    tree = ast.parse(sglang_file("srt/managers/io_struct.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if class_name not in classes:
        raise AssertionError(f"io_struct.py has no class {class_name}; sglang's version changed?")
    out: dict[str, Any] = {}
    node = classes[class_name]
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(io_struct_fields(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out[stmt.target.id] = _default_of(stmt.value)
    return out
