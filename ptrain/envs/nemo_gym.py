"""NeMo Gym's resources-server protocol: ptrain plays NeMo Gym's simple agent with its own engine.

    env = make_env(EnvConfig(kind="nemo_gym", options={"url": URL, "rows": "example.jsonl"}), tokenizer=tok)
    trajectories = await env.rollout(env.tasks("train", seed=0)[0], engine, SamplingParams(n=4))
    metrics = await env.aggregate_metrics(trajectories)         # the server's /aggregate_metrics

    python -m ptrain.envs.nemo_gym reverify --url URL [--rows example.jsonl] ROLLOUTS.jsonl

A resources server (shared/reference/nemo_gym.md) holds a task family's tools and verifier
behind HTTP routes: `/seed_session` starts an episode's state, each tool is a `POST /<name>`
route, `/verify` scores a finished episode given in the OpenAI Responses shape, and
`/aggregate_metrics` summarises many. Its session middleware gives each client a cookie, so
every episode here has its own `httpx.AsyncClient` (its cookie jar carries the session from
seed to verify). NeMo Gym's agent servers ask a model server for each turn; here ptrain's own
engine samples the turns, so token ids stay exactly the sampled ones: each policy turn is the
shared tool loop's (`ptrain.envs.multi_turn`), and each call it parses is answered by a POST
to the server's route of that name.

Per episode (NeMo Gym 0.4 and 0.7 servers alike):
  1. POST /seed_session: the row as it is (the body NeMo Gym's simple agent sends), or 0.7's
     session body {resources_session_id, episode_id, task_id, task_data: the row} to a server
     whose OpenAPI document says its seed takes it (options.seed_body: auto, legacy, session);
  2. the tool loop: the row's input messages and tools through the chat template, engine
     turns, each <tool_call> -> POST /<name> with the parsed arguments, the server's answer
     (whatever its status, as NeMo Gym's agent does) rendered as a tool message, loss-masked;
  3. POST /verify with the row plus `response`: the episode as Responses output items
     (reasoning / message / function_call per policy turn, function_call_output per tool
     answer); the last item of each model call carries NeMo Gym's training fields
     prompt_token_ids, generation_token_ids, generation_log_probs;
  4. reward and reward_components (checked to sum to the reward, as NeMo RL requires) from
     the answer; `_ng_failure_class` (e.g. a failed LLM judge) is a reward_error. A 0.5+
     answer's `mask_sample: true` (its reward is no measurement: a judge that did not answer,
     a sandbox that died) masks the sample (`Trajectory.masked`: the RL stage does not train
     on it and leaves it out of its group's baseline); its `failure_kind` is
     `Trajectory.failure_kind` (a metric per kind) and `failure_reason` is in reward_error;
  5. POST /close_session {resources_session_id, episode_id} (0.7), once the episode is over
     whatever happened; a server without the route (0.4 answers 404) is not asked again.

Rows go to the server exactly as they are: a task field whose value is null is sent as null
(NeMo Gym's own clients send the row's dict as it is, with orjson; a verifier can read the
null, and dropping the field would let the server's default stand in for it).

An episode cut by a length limit is verified only with env.score_truncated (else reward 0,
metric truncated 1, as in every kind); an aborted one never.
A server that cannot be reached, answers an error status or does not answer in time makes
the episode's finish_reason "error" with the URL, route and status in `Trajectory.error`;
the run goes on.

Recorded rollouts (a server's data/example_rollouts.jsonl: the row, the model's `response`
and its `reward`) are re-verified by `reverify`: each row is seeded in a session of its own,
its recorded function calls are replayed against the tool routes (so stateful servers see
the state the episode built), then it goes to /verify. The body is what NeMo Gym's own
`reverify` sends, the input row plus the recorded `response`: with `--rows`, the example row
with the same input messages exactly as it is (recorded rollouts may lack its task fields);
without it, the recorded rollout less the fields its verify answer added (reward,
reward_components, mask_sample, failure_kind, failure_reason, _ng_failure_*). Task fields keep
their nulls; only the recorded request parameters (responses_create_params) that are null
are left out: the recording wrote every unset parameter as null, which /verify's request
model refuses for some (parallel_tool_calls, tool_choice). A server whose /reverify_mode
(0.5+) says "unsupported" is refused unless --force.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from ptrain.config.env_multi_turn import MultiTurnOptions
from ptrain.config.env_nemo_gym import NemoGymOptions
from ptrain.envs.base import Task, Trajectory, Turn
from ptrain.envs.episode import EpisodeState
from ptrain.envs.multi_turn import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatFormat,
    ChatTemplateError,
    MultiTurnEnv,
    ToolCall,
    parse_tool_calls,
)
from ptrain.envs.tools import cap_text
from ptrain.rollout.protocol import EngineUnavailable, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

NG_FAILURE_CLASS_KEY = "_ng_failure_class"
"""Verify answers that failed (a judge that did not answer, ...) carry their class here."""
FAILURE_KEYS = ("mask_sample", "failure_kind", "failure_reason")
"""What a 0.5+ verify answer says of a failure: whether the reward is a valid measurement,
the kind (NeMo Gym's failure_kinds vocabulary) and the occurrence's detail."""
VERIFY_ANSWER_KEYS = ("reward", "reward_components", *FAILURE_KEYS, NG_FAILURE_CLASS_KEY, "_ng_failure_judge_error")
"""Fields a verify answer adds to its request; a recorded rollout is verified again without them."""
SESSION_SEED_FIELDS = ("resources_session_id", "episode_id", "task_id", "task_data")
"""The fields of 0.7's session seed body (ResourcesSeedSessionRequest, extra fields forbidden)."""
TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
"""What /aggregate_metrics groups by: the task, and the sample within its group."""
ECHOED_KEYS = ("responses_create_params", "response")
"""Fields /verify echoes back from its request (left out of audit records and metrics requests)."""
INPUT_ROLES = ("user", "system", "developer", "assistant")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MODEL_NAME = "ptrain"
"""`response.model` of the episodes ptrain sends to /verify."""


CLI_OPTIONS = ("--url", "--timeout", "--verify-timeout")
"""What sets the server's URL, the request timeout and the verify timeout on the command line."""


def env_options(name: str) -> tuple[str, str, str]:
    """The config keys that set an environment's URL, request timeout and verify timeout."""
    return tuple(f"envs.{name}.options.{key}" for key in ("url", "request_timeout_s", "verify_timeout_s"))


class NemoGymError(RuntimeError):
    """A resources server that could not be reached, refused a request, did not answer in
    time or answered something unusable; the message names the URL, the route and the status."""


class RowError(ValueError):
    """A NeMo Gym row that cannot be played; the message names the file, the line and the field."""


# ----------------------------------------------------------------------------- HTTP


@dataclass(frozen=True)
class Timeouts:
    """Seconds allowed to connect, for one seed or tool call, and for one /verify."""

    connect_s: float = 5.0
    request_s: float = 60.0
    verify_s: float = 300.0


@dataclass(frozen=True)
class Reply:
    """A server's answer: status, the body as text, and its JSON (None when it is not JSON)."""

    status: int
    text: str
    json: Any = None
    json_error: str | None = None
    """Why the body is not JSON (None when it is)."""


class _BrokenExchange(Exception):
    """The connection broke (reset, closed, cut mid-answer) before a whole answer came."""


class ResourcesSession:
    """One episode's HTTP session with a resources server.

    One `httpx.AsyncClient` per session: the server's session cookie, set on the first
    answer, goes with every later request, as NeMo Gym's agent forwards it from seed to verify.
    """

    def __init__(self, url: str, timeouts: Timeouts = Timeouts(), *, option_names: Sequence[str] = CLI_OPTIONS):
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self.option_names = tuple(option_names)
        """What sets the URL, the request timeout and the verify timeout (named in errors)."""
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeouts.request_s, connect=timeouts.connect_s),
            headers={"content-type": "application/json"},
        )
        self.reached = False
        """Whether the server has answered anything on this ResourcesSession (its cookie jar)."""

    async def __aenter__(self) -> ResourcesSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.aclose()

    async def post(
        self, route: str, body: Any, *, timeout_s: float | None = None, what: str = "", resend_once: bool = False
    ) -> Reply:
        """POST JSON to `route`; NemoGymError when the server is unreachable or too slow (any
        status comes back as a Reply: what an error status means is the caller's to say).
        The body is sent as it is: null fields stay null. `resend_once` sends it a second time
        when the connection broke before any answer came (for requests that may be repeated)."""
        try:
            payload = json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise NemoGymError(f"POST {self.url}{route}: the request body is not JSON ({e})") from None
        if resend_once:
            try:
                return await self._send("POST", route, payload, timeout_s=timeout_s, what=what, broken_raises=True)
            except _BrokenExchange as e:
                logger.info("POST %s%s: the connection broke before an answer (%s); sending it again", self.url,
                            route, e)  # fmt: skip
        return await self._send("POST", route, payload, timeout_s=timeout_s, what=what)

    async def get(self, route: str, *, what: str = "") -> Reply:
        """GET `route` (as `post`: NemoGymError only when no answer came)."""
        return await self._send("GET", route, None, timeout_s=None, what=what)

    async def _send(
        self, method: str, route: str, payload: str | None, *, timeout_s: float | None, what: str,
        broken_raises: bool = False,
    ) -> Reply:  # fmt: skip
        where = f"{method} {self.url}{route}"
        timeout = httpx.Timeout(timeout_s or self.timeouts.request_s, connect=self.timeouts.connect_s)
        try:
            response = await self._client.request(method, route, content=payload, timeout=timeout)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
            if broken_raises:
                raise _BrokenExchange(f"{type(e).__name__}: {e}") from None
            raise NemoGymError(f"{where}: the request failed ({type(e).__name__}: {e})") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise NemoGymError(
                f"{where}: the NeMo Gym resources server at {self.url} is unreachable ({type(e).__name__}: {e}); "
                f"start it (python tools/nemo_gym_servers.py NAME prints its URL) or fix {self.option_names[0]}"
            ) from None
        except httpx.TimeoutException:
            limit = timeout.read
            raise NemoGymError(f"{where}: no answer within {limit:g} s{what}") from None
        except Exception as e:  # noqa: BLE001 - httpx.HTTPError (a dropped connection, a bad answer) and what
            # else a transport can raise: a failed exchange fails its episode, never the batch
            raise NemoGymError(f"{where}: the request failed ({type(e).__name__}: {e})") from None
        self.reached = True
        text = response.text
        try:
            parsed, problem = response.json(), None
        except (ValueError, RecursionError) as e:  # not JSON; nested past what the parser takes
            parsed, problem = None, f"{type(e).__name__}: {str(e)[:200]}"
        return Reply(response.status_code, text, parsed, problem)

    async def post_json(
        self, route: str, body: Any, *, timeout_s: float | None = None, what: str = "", resend_once: bool = False
    ) -> Any:
        """POST and demand a 2xx JSON object; NemoGymError names the route, status and body."""
        reply = await self.post(route, body, timeout_s=timeout_s, what=what, resend_once=resend_once)
        where = f"POST {self.url}{route}"
        if not 200 <= reply.status < 300:
            raise NemoGymError(f"{where} answered {reply.status}: {_excerpt(reply.text)}")
        if reply.json_error is not None:
            raise NemoGymError(f"{where} answered {reply.status} with a body that is not JSON ({reply.json_error}): "
                               f"{_excerpt(reply.text)}")  # fmt: skip
        if not isinstance(reply.json, dict):
            raise NemoGymError(f"{where} answered {reply.status} with a body that is not a JSON object: "
                               f"{_excerpt(reply.text)}")  # fmt: skip
        return reply.json

    async def seed_session(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The legacy seed: POST the row itself (what NeMo Gym's simple agent sends, 0.4 and 0.7).
        A seed starts the session afresh, so one whose connection broke unanswered is sent again."""
        return await self.post_json("/seed_session", row, what=f" ({self.option_names[1]})", resend_once=True)

    async def seed_resources_session(self, ids: SessionIds, row: Mapping[str, Any]) -> dict[str, Any]:
        """0.7's session seed: {resources_session_id, episode_id, task_id, task_data: the row}.
        The answer must echo the session id: one that does not means the server took the body
        for a legacy seed (its seed model ignores unknown fields), and the episode fails."""
        body = {**ids.body(), "task_id": dict(ids.task_id), "task_data": dict(row)}
        answer = await self.post_json("/seed_session", body, what=f" ({self.option_names[1]})", resend_once=True)
        if answer.get("resources_session_id") != ids.resources_session_id:
            raise NemoGymError(
                f"POST {self.url}/seed_session answered the session seed body with {_excerpt(json.dumps(answer), 200)}, "
                f"which does not echo resources_session_id {ids.resources_session_id!r}: the server does not take "
                "NeMo Gym 0.7's session body; seed it with the row (options.seed_body=legacy, or auto)"
            )
        return answer

    async def close_resources_session(self, ids: SessionIds) -> Reply:
        """POST /close_session {resources_session_id, episode_id} (0.7); the Reply whatever its
        status (0.4 servers have no such route and answer 404)."""
        return await self.post("/close_session", ids.body(), what=f" ({self.option_names[1]})")

    async def call_tool(self, name: str, arguments: Any) -> Reply:
        """POST /<name> with the arguments; every status is an answer for the policy to read."""
        return await self.post(f"/{name}", arguments, what=f" ({self.option_names[1]})")

    async def verify(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.post_json(
            "/verify", body, timeout_s=self.timeouts.verify_s, what=f" ({self.option_names[2]})"
        )


def _excerpt(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


@dataclass(frozen=True)
class SessionIds:
    """An episode's identity in NeMo Gym 0.7's session protocol (its EpisodeId and TaskId)."""

    resources_session_id: str
    episode_id: Mapping[str, Any]
    """{"rollout_id": str matching [A-Za-z0-9][A-Za-z0-9._-]*, "attempt": int >= 0}."""
    task_id: Mapping[str, Any]
    """{"taskset": str, "task_id": str}, both non-empty."""

    @classmethod
    def new(cls, taskset: str, task_id: str) -> SessionIds:
        """Fresh ids for one episode of task `task_id` of environment `taskset`."""
        sid = f"ptrain-{uuid.uuid4().hex}"
        return cls(sid, {"rollout_id": sid, "attempt": 0}, {"taskset": taskset or "nemo_gym", "task_id": task_id})

    def body(self) -> dict[str, Any]:
        """{resources_session_id, episode_id}: the close body (and the start of the seed body)."""
        return {"resources_session_id": self.resources_session_id, "episode_id": dict(self.episode_id)}


def takes_session_seed(openapi: Any) -> bool:
    """Whether a server's OpenAPI document (FastAPI's /openapi.json) says its /seed_session
    takes 0.7's session body: a request schema, or one alternative of it, that requires
    resources_session_id, episode_id, task_id and task_data. 0.4 servers and 0.7 servers whose
    seed takes only their own row fields say no; 0.7's default seed and servers that take the
    union (or the session body alone) say yes."""
    try:
        schema = openapi["paths"]["/seed_session"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    except (KeyError, TypeError):
        return False
    components = (openapi.get("components") or {}).get("schemas") or {}

    def alternatives(node: Any, depth: int = 0) -> Iterable[dict]:
        if depth > 8 or not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield from alternatives(components.get(ref.rsplit("/", 1)[-1]), depth + 1)
            return
        for key in ("anyOf", "oneOf"):
            for sub in node.get(key) or ():
                yield from alternatives(sub, depth + 1)
        yield node

    return any(set(SESSION_SEED_FIELDS) <= set(alt.get("required") or ()) for alt in alternatives(schema))


def recorded_verify_body(rollout: Mapping[str, Any], row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The /verify body of a recorded rollout, as NeMo Gym's reverify builds it (the input row
    plus the recorded `response`): `row` exactly as it is when given (the example row the
    rollout was made from), else the rollout less the fields its verify answer added. Null task
    fields stay; null request parameters (responses_create_params) of a rollout are left out
    (module docstring)."""
    if row is not None:
        body = {**row, "response": rollout.get("response")}
    else:
        body = {k: v for k, v in rollout.items() if k not in VERIFY_ANSWER_KEYS}
        params = body.get("responses_create_params")
        if isinstance(params, dict):
            body["responses_create_params"] = {k: v for k, v in params.items() if v is not None}
    return body


# ----------------------------------------------------------------------------- rows


def _content_text(content: Any, where: str) -> str:
    """A Responses message content (a string, or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowError(f"{where}.content[{j}]: only text parts can be played, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise RowError(f"{where}.content[{j}].text must be a string")
            parts.append(part["text"])
        return "".join(parts)
    raise RowError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def chat_messages(responses_input: Any, *, developer_as_system: bool = True) -> list[dict[str, Any]]:
    """A row's `responses_create_params.input` as the messages a chat template renders.

    A string is one user message. Message items keep their role (developer becomes system
    when asked: most templates know no developer role); function_call items become the
    tool_calls of an assistant message and function_call_output items tool messages, as NeMo
    Gym's own Responses-to-chat converter turns them. RowError names a bad item.
    """
    where = "responses_create_params.input"
    if isinstance(responses_input, str):
        return [{"role": "user", "content": responses_input}]
    if not isinstance(responses_input, list) or not responses_input:
        raise RowError(f"{where} must be a string or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(responses_input):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise RowError(f"{at} must be an object, got {type(item).__name__}")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise RowError(f"{at}.role must be one of {list(INPUT_ROLES)}, got {role!r}")
            if "content" not in item:
                raise RowError(f"{at} has no content")
            if role == "developer" and developer_as_system:
                role = "system"
            out.append({"role": role, "content": _content_text(item["content"], at)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise RowError(f"{at}: a function_call needs a name and its arguments as a JSON string")
            try:
                arguments = json.loads(item["arguments"])
            except ValueError:
                raise RowError(f"{at}.arguments is not JSON: {item['arguments'][:200]!r}") from None
            call = {
                "type": "function",
                "id": item.get("call_id"),
                "function": {"name": item["name"], "arguments": arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("output"), str):
                raise RowError(f"{at}: a function_call_output needs its output as a string")
            out.append({"role": "tool", "content": item["output"], "tool_call_id": item.get("call_id")})
        else:
            raise RowError(f"{at}: input items of type {kind!r} cannot be played (message, function_call, "
                           "function_call_output can)")  # fmt: skip
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """A row's `responses_create_params.tools` (Responses function tools) in the chat
    template's format, `{"type": "function", "function": {name, description, parameters}}`."""
    where = "responses_create_params.tools"
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RowError(f"{where} must be a list of function tools, got {type(tools).__name__}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RowError(f"{at}: only function tools are served by a resources server, got {kind!r}")
        name = tool.get("name")
        if not isinstance(name, str) or not name or "/" in name:
            raise RowError(f"{at}.name must be a route name (non-empty, no '/'), got {name!r}")
        if name in seen:
            raise RowError(f"{at}: tool {name!r} is declared twice")
        seen.add(name)
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise RowError(f"{at}.parameters must be a JSON schema object")
        out.append({"type": "function", "function": {
            "name": name, "description": tool.get("description") or "", "parameters": parameters}})  # fmt: skip
    return out


def check_row(row: Any, *, developer_as_system: bool = True) -> tuple[list[dict], list[dict]]:
    """(chat messages, chat tools) of a row; RowError when it cannot be played."""
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise RowError("the row has no 'responses_create_params' object (NeMo Gym rows carry the model "
                       "request there: {'responses_create_params': {'input': [...], 'tools': [...]}, ...})")  # fmt: skip
    if "input" not in params:
        raise RowError("responses_create_params has no 'input'")
    return (
        chat_messages(params["input"], developer_as_system=developer_as_system),
        chat_tools(params.get("tools")),
    )


@dataclass(frozen=True)
class BadRow:
    """A row that was skipped: where, and why."""

    path: str
    line: int
    problem: str


def read_rows(path: str) -> Iterable[tuple[int, Any, str | None]]:
    """(line number, parsed row or None, problem or None) for each non-blank line of a JSONL file."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, None, f"not UTF-8 text ({e})"
                continue
            if not line.strip():
                continue
            try:
                yield n, json.loads(line), None
            except ValueError as e:
                yield n, None, f"not JSON ({e})"


# ----------------------------------------------------------------------------- the Responses shape


@dataclass
class ModelCall:
    """One policy turn of an episode, as NeMo Gym's training mode records a model call."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    """The turn's text with its tool-call blocks and end-of-turn marker removed."""
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    """(call_id, tool name, arguments as a JSON string) of each tool call, in order."""
    reasoning: str = ""
    """Text the policy wrote in <think>...</think> (a reasoning item)."""


def output_items(calls: Sequence[ModelCall], tool_outputs: Mapping[str, str]) -> list[dict[str, Any]]:
    """The Responses output items of an episode: per model call its reasoning, message and
    function_call items (the last of them with prompt_token_ids, generation_token_ids and
    generation_log_probs), then the function_call_output of each of its calls that ran."""
    items: list[dict[str, Any]] = []
    for call in calls:
        own: list[dict[str, Any]] = []
        if call.reasoning:
            own.append({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                        "summary": [{"type": "summary_text", "text": call.reasoning}]})  # fmt: skip
        if call.text or not call.calls:
            own.append({
                "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": call.text, "annotations": []}],
            })  # fmt: skip
        for call_id, name, arguments in call.calls:
            own.append({"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                        "arguments": arguments, "status": "completed"})  # fmt: skip
        own[-1].update(
            prompt_token_ids=list(call.prompt_ids),
            generation_token_ids=list(call.output_ids),
            generation_log_probs=[float(x) for x in call.logprobs],
        )
        items.extend(own)
        for call_id, _, _ in call.calls:
            if call_id in tool_outputs:
                items.append({"type": "function_call_output", "call_id": call_id, "output": tool_outputs[call_id]})
    return items


def responses_response(
    params: Mapping[str, Any], items: list[dict[str, Any]], *, usage: Mapping[str, int], incomplete: str | None = None
) -> dict[str, Any]:
    """A Responses API `response` object around the output items (what /verify validates)."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": float(int(time.time())),
        "model": params.get("model") or MODEL_NAME,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "error": None,
        "instructions": params.get("instructions"),
        "metadata": params.get("metadata") or {},
        "output": items,
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "temperature": params.get("temperature"),
        "top_p": params.get("top_p"),
        "tool_choice": params.get("tool_choice", "auto"),
        "tools": list(params.get("tools") or []),
        "usage": {
            "input_tokens": usage.get("input_tokens", 0),
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            "output_tokens": usage.get("output_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("input_tokens", 0) + usage.get("output_tokens", 0),
        },
    }


# ----------------------------------------------------------------------------- verify answers


@dataclass(frozen=True)
class Verdict:
    """What a /verify answer says: the reward, its components, and what else it reported."""

    reward: float
    components: dict[str, float]
    reward_error: str | None
    """Why the reward is 0 or doubtful (no number, components that do not sum, a failure class)."""
    record: dict[str, Any]
    """The answer without the echoed request (responses_create_params, response): the
    fields /aggregate_metrics reads, kept in the audit record."""
    metrics: dict[str, float]
    """Numeric fields of the answer that the row did not send (library_reward, ...)."""
    masked: bool = False
    """mask_sample: the reward is no measurement (the server's infrastructure failed, not the
    policy), so the sample is not trained on."""
    failure_kind: str | None = None
    """failure_kind (0.5+; a 0.4-style answer's _ng_failure_class stands in when it has none)."""
    failure_reason: str | None = None


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        value = float(x)
    except OverflowError:  # a JSON integer past float's range
        return None
    return value if math.isfinite(value) else None


def read_verdict(answer: Mapping[str, Any], sent: Mapping[str, Any], *, where: str, tolerance: float = 1e-6) -> Verdict:
    """Read a /verify answer (`sent`: the request, whose echoed fields are not results)."""
    record = {k: v for k, v in answer.items() if k not in ECHOED_KEYS}
    usage = (answer.get("response") or {}).get("usage") if isinstance(answer.get("response"), dict) else None
    if usage:
        record["response"] = {"usage": usage}
    metrics = {}
    for k, v in answer.items():
        if k in sent or k in ECHOED_KEYS or k in VERIFY_ANSWER_KEYS or k.startswith("_ng_"):
            continue
        value = float(v) if isinstance(v, bool) else _number(v)
        if value is not None:
            metrics[f"verify_{k}"] = value
    masked = answer.get("mask_sample", False)
    kind, reason = answer.get("failure_kind"), answer.get("failure_reason")
    kind = kind if isinstance(kind, str) or kind is None else json.dumps(kind)[:100]
    kind = kind or (str(answer[NG_FAILURE_CLASS_KEY]) if answer.get(NG_FAILURE_CLASS_KEY) is not None else None)
    reason = reason if isinstance(reason, str) or reason is None else json.dumps(reason)
    if not isinstance(masked, bool):
        # What the server meant cannot be told, so the sample is kept out of training.
        return Verdict(0.0, {}, f"{where}: mask_sample must be true or false, got {json.dumps(masked)[:80]}; the "
                       "sample is masked", record, metrics, True, kind, reason)  # fmt: skip
    if masked:
        error = f"{where} masked the sample (mask_sample true, failure_kind {kind!r}): {reason or 'no failure_reason'}"
        if answer.get(NG_FAILURE_CLASS_KEY) is not None:
            metrics["verify_failed"] = 1.0
        return Verdict(_number(answer.get("reward")) or 0.0, {}, error, record, metrics, True, kind, reason)
    reward = _number(answer.get("reward"))
    if reward is None:
        return Verdict(0.0, {}, f"{where} answered without a finite number as reward: "
                       f"reward={answer.get('reward')!r:.80}", record, metrics, False, kind, reason)  # fmt: skip
    components: dict[str, float] = {}
    raw = answer.get("reward_components")
    error = None
    if raw is not None:
        if not isinstance(raw, dict) or any(_number(v) is None for v in raw.values()):
            return Verdict(0.0, {}, f"{where}: reward_components must map names to finite numbers, got "
                           f"{_excerpt(json.dumps(raw), 200)}", record, metrics, False, kind, reason)  # fmt: skip
        components = {str(k): float(v) for k, v in raw.items()}
        try:
            total = math.fsum(components.values())
        except OverflowError:  # finite components whose sum is not
            return Verdict(0.0, components, f"{where}: reward_components {components} sum past the float range; "
                           f"they cannot sum to reward {reward}", record, metrics, False, kind, reason)  # fmt: skip
        if abs(total - reward) > tolerance * max(1.0, abs(reward)):
            return Verdict(0.0, components, f"{where}: reward {reward} is not the sum of reward_components "
                           f"{components} ({total}); NeMo RL requires them to sum", record, metrics, False, kind,
                           reason)  # fmt: skip
    failure = answer.get(NG_FAILURE_CLASS_KEY)
    if failure is not None:
        error = f"{where} reported {NG_FAILURE_CLASS_KEY}={failure!r} (reward {reward})"
        metrics["verify_failed"] = 1.0
    # A failure_kind on an unmasked answer is a diagnosis: the reward is still a valid measurement.
    return Verdict(reward, components, error, record, metrics, False, kind, reason)


# ----------------------------------------------------------------------------- the environment


def split_policy_text(text: str, *, think_tags: bool = True) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, message text, tool calls) of a policy turn's decoded text.

    The calls are `parse_tool_calls(text)`, exactly what the tool loop ran; the well-formed
    blocks are cut from the message text (a malformed one stays there, as NeMo Gym's model
    servers leave unparsable calls in the content). With think_tags, what precedes
    `</think>` (after an optional `<think>`) is the reasoning.
    """
    calls = parse_tool_calls(text)
    rest = text
    for c in calls:
        if c.error is None:
            rest = rest.replace(f"{TOOL_CALL_OPEN}{c.raw}{TOOL_CALL_CLOSE}", "", 1)
    reasoning = ""
    if think_tags and THINK_CLOSE in rest:
        head, _, rest = rest.partition(THINK_CLOSE)
        reasoning = head.split(THINK_OPEN, 1)[-1].strip()
    return reasoning, rest.strip(), calls


def call_id(turn: int, k: int) -> str:
    """The id of the k-th tool call of policy turn `turn` (1-based) of an episode."""
    return f"call_{turn}_{k}"


def model_calls(
    token_ids: Sequence[int], logprobs: Sequence[float], turns: Sequence[Turn], *, think_tags: bool = True
) -> list[ModelCall]:
    """An episode's policy turns (of a Trajectory, or an EpisodeState's audit turns) as
    NeMo Gym model calls: the token ids before each turn (its prompt), the turn's own ids and
    log-probs, and its text split into reasoning, message and the calls that had a name and
    arguments (with the ids the tool loop gave them)."""
    out = []
    policy_turns = [t for t in turns if t.role == "policy"]
    for turn, t in enumerate(policy_turns, start=1):
        reasoning, text, calls = split_policy_text(t.text, think_tags=think_tags)
        out.append(ModelCall(
            prompt_ids=list(token_ids[: t.start]),
            output_ids=list(token_ids[t.start : t.end]),
            logprobs=list(logprobs[t.start : t.end]),
            text=text,
            reasoning=reasoning,
            calls=[(call_id(turn, k), c.name, json.dumps(c.arguments, ensure_ascii=False))
                   for k, c in enumerate(calls) if c.error is None],
        ))  # fmt: skip
    return out


def verify_record(trajectory: Trajectory) -> dict[str, Any] | None:
    """The /verify answer an episode got (without the echoed request), from its audit turns."""
    for t in reversed(trajectory.turns):
        if t.role == "env" and t.tool == "verify":
            return json.loads(t.text)
    return None


class NemoGymEnv(MultiTurnEnv):
    """Environment kind `nemo_gym`: NeMo Gym rows played against a resources server (module docstring).

    Built as every kind is, `NemoGymEnv(cfg, options, *, tokenizer)`, with a NemoGymOptions.
    The tool loop is ptrain.envs.multi_turn's: each policy turn is its `_policy_turn`; what
    differs is that every row brings its own tools (its chat format is built per tool set)
    and every episode its own HTTP session, so the calls are answered here, by the server.
    `stats["errors"]` counts episodes that a server failure (or an engine refusal) ended,
    `stats["masked"]` those whose verify answer masked them, `stats["close_errors"]` the
    /close_session calls that failed (the episode's result stands).
    """

    kind = "nemo_gym"

    def __init__(self, cfg: Any, options: NemoGymOptions, *, tokenizer: Any, sandbox: Any = None):
        loop = MultiTurnOptions(
            max_turns=options.max_turns,
            max_episode_tokens=options.max_episode_tokens,
            max_tool_calls_per_turn=options.max_tool_calls_per_turn,
            max_tool_output_chars=options.max_tool_output_chars,
            invalid_call_penalty=options.invalid_call_penalty,
            chat_template_kwargs=dict(options.chat_template_kwargs),
        )
        super().__init__(cfg, loop, tokenizer=tokenizer)
        self.nemo_options = options
        self.url = options.url.rstrip("/")
        self.timeouts = Timeouts(options.connect_timeout_s, options.request_timeout_s, options.verify_timeout_s)
        self.bad_rows: list[BadRow] = []
        """Rows skipped (options.bad_rows=skip), with their file, line and problem."""
        self.seed_body: str | None = None if options.seed_body == "auto" else options.seed_body
        """The seed body this server gets ("legacy" or "session"; None until auto has asked)."""
        self.has_close_session = True
        """False once the server answered /close_session with 404 (NeMo Gym before 0.7)."""
        self.stats.update(masked=0, close_errors=0)
        self._formats: dict[str, ChatFormat] = {}
        rows = self._load(options.rows)
        if not rows:
            raise RowError(
                f"envs.{self.name}.options.rows: no playable rows in {options.rows}"
                + (
                    f" ({len(self.bad_rows)} skipped, e.g. line {self.bad_rows[0].line}: {self.bad_rows[0].problem})"
                    if self.bad_rows
                    else ""
                )  # fmt: skip
            )
        if options.eval_rows is not None:
            self._rows = {"train": rows, "eval": self._load(options.eval_rows)}
        elif len(rows) <= cfg.n_eval:
            raise RowError(
                f"envs.{self.name}.options.rows: '{options.rows}' has {len(rows)} playable rows, and the first "
                f"n_eval={cfg.n_eval} are held out, which leaves none to train on; pass a smaller "
                f"envs.{self.name}.n_eval (conf/env/nemo_gym.yaml sets 0) or options.eval_rows"
            )
        else:
            self._rows = {"train": rows[cfg.n_eval :], "eval": rows[: cfg.n_eval]}

    def set_episode_dir(self, folder: str | None) -> None:
        """No episode checkpoints: an episode's state lives in the server's session, which a
        restarted run cannot rejoin (its cookie is gone), so an unfinished episode is played
        again from /seed_session instead of resumed."""
        self.store = None

    # ----------------------------------------------------------------- rows and tasks

    def _load(self, path: str) -> list[tuple[int, dict, list[dict]]]:
        """(line, row, chat messages) of each playable row; a bad one fails or is skipped."""
        rows = []
        for line, row, problem in read_rows(path):
            if problem is None:
                try:
                    messages, tools = check_row(row, developer_as_system=self.nemo_options.developer_as_system)
                    self.chat_format(tools)
                except (RowError, ChatTemplateError) as e:
                    problem = str(e)
            if problem is None:
                rows.append((line, row, messages))
                continue
            if self.nemo_options.bad_rows == "fail":
                raise RowError(f"{path}:{line}: {problem}; fix the row, or skip such rows with "
                               f"envs.{self.name}.options.bad_rows=skip")  # fmt: skip
            self.bad_rows.append(BadRow(path, line, problem))
            logger.warning("env %s: skipping %s:%d: %s", self.name, path, line, problem)
        return rows

    def chat_format(self, tools: list[dict[str, Any]]) -> ChatFormat:
        """The chat format of episodes with these tools (built once per distinct tool set)."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._formats:
            fmt = ChatFormat(self.tokenizer, tools, self.options.chat_template_kwargs)
            fmt.check(self.env_roles)
            self._formats[key] = fmt
        return self._formats[key]

    def make_tasks(self, seed: int) -> tuple[list[Task], list[Task]]:
        """The rows in file order (the seed does not reorder them): at most cfg.n_train
        training tasks and cfg.n_eval held-out ones. Task.data is the row as given."""
        out = []
        for split, limit in (("train", self.cfg.n_train), ("eval", self.cfg.n_eval)):
            out.append([self.task(split, i, messages, row) for i, (_, row, messages) in
                        enumerate(self._rows[split][:limit])])  # fmt: skip
        return out[0], out[1]

    # ----------------------------------------------------------------- episodes

    async def rollout(self, task: Task, engine: RolloutEngine, sampling: SamplingParams) -> list[Trajectory]:
        """`sampling.n` episodes of one row, concurrently, each in its own server session."""
        _, tools = check_row(dict(task.data), developer_as_system=self.nemo_options.developer_as_system)
        fmt = self.chat_format(tools)
        if self.cfg.max_new_tokens is not None:
            sampling = dataclasses.replace(sampling, max_new_tokens=self.cfg.max_new_tokens)
        stops = tuple(dict.fromkeys(tuple(sampling.stop_token_ids) + fmt.end_of_turn_ids))
        sampling = dataclasses.replace(sampling, stop_token_ids=stops)
        prompt = fmt.prompt_ids(task.messages)
        base = f"{self.name}/{task.id}"
        k = self._in_flight[base]
        self._in_flight[base] += 1
        rid = base if k == 0 else f"{base}#{k + 1}"
        try:
            runs = [self._play(task, fmt, engine, sampling, j, prompt, rid) for j in range(sampling.n)]
            results = await asyncio.gather(*runs, return_exceptions=True)
        finally:
            self._in_flight[base] -= 1
            if self._in_flight[base] <= 0:
                del self._in_flight[base]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:  # an engine that cannot sample at all ends the stage, whatever else failed
            raise next((f for f in failures if isinstance(f, EngineUnavailable)), failures[0])
        return list(results)

    async def _play(self, task: Task, fmt: ChatFormat, engine: RolloutEngine, sampling: SamplingParams, j: int,
                    prompt: list[int], rid: str) -> Trajectory:  # fmt: skip
        """One episode: seed, the tool loop with server-answered calls, verify."""
        state = EpisodeState(self.name, task.id, j, list(prompt), [0] * len(prompt), [0.0] * len(prompt),
                             prompt_length=len(prompt))  # fmt: skip
        state.messages = [dict(m) for m in task.messages]
        state.extra = {"tool_errors": 0, "outputs": {}}
        limit = self.options.max_episode_tokens
        context = getattr(engine, "context_length", None)
        if isinstance(context, int) and context > 1:
            limit = min(limit, context)
        verdict = None
        ids = SessionIds.new(self.name, task.id)
        async with ResourcesSession(self.url, self.timeouts, option_names=env_options(self.name)) as session:
            try:
                seeded = await self._seed(session, ids, task.data)
                end = len(state.token_ids)
                state.add_turn(Turn("env", end, end, text=json.dumps(seeded), tool="seed_session"))
                while not state.done:
                    if state.pending_calls:
                        await self._send_calls(state, session, fmt, limit)
                    else:
                        await self._policy_turn(task, state, engine, sampling, limit,
                                                f"{rid}/s{j}/t{state.policy_turns}")  # fmt: skip
                truncated = state.finish_reason in ("length", "token_limit")
                # As in every kind: a cut episode is scored only with env.score_truncated (length
                # shaping is the RL stage's), an aborted one never.
                if state.finish_reason != "abort" and (not truncated or getattr(self.cfg, "score_truncated", False)):
                    verdict = await self._verify(task, state, session)
            except NemoGymError as e:
                self.stats["errors"] += 1
                logger.warning("env %s task %s sample %d: %s", self.name, task.id, j, e)
                self._finish(state, "error", str(e))
            except EngineUnavailable:  # nothing can sample: the stage checkpoints and stops
                raise
            except Exception as e:  # noqa: BLE001 - what no check above foresaw fails this episode, not the batch
                self.stats["errors"] += 1
                logger.exception("env %s task %s sample %d failed", self.name, task.id, j)
                self._finish(state, "error", f"the episode against {self.url} failed unexpectedly "
                             f"({type(e).__name__}: {str(e)[:300]})")  # fmt: skip
            finally:
                # Whatever happened after the seed was sent: 0.7 servers release the episode's state.
                await self._close(state, session, ids)
        state.result = self._result(state, verdict)
        self.stats["episodes"] += 1
        return state.trajectory(task)

    async def _seed(self, session: ResourcesSession, ids: SessionIds, row: Mapping[str, Any]) -> dict[str, Any]:
        """POST /seed_session with the body options.seed_body says. auto asks the server's
        OpenAPI document once which body its seed takes (a document that is missing or says
        nothing of it means legacy); when that GET gets no answer at all, this episode seeds
        with the row, whose POST then reports the failure, and the next one asks again."""
        body = self.seed_body
        if body is None:
            try:
                reply = await session.get("/openapi.json", what=f" ({session.option_names[1]})")
            except NemoGymError:
                body = "legacy"
            else:
                ok = 200 <= reply.status < 300
                body = self.seed_body = "session" if ok and takes_session_seed(reply.json) else "legacy"
                logger.info("env %s: %s/seed_session gets the %s body", self.name, self.url, body)
        if body == "session":
            return await session.seed_resources_session(ids, row)
        return await session.seed_session(dict(row))

    async def _close(self, state: EpisodeState, session: ResourcesSession, ids: SessionIds) -> None:
        """POST /close_session once the episode is over (an audit turn), unless the server is
        known to lack it or never answered; a failure is counted and logged, never the episode's."""
        if not self.has_close_session or not session.reached:
            return
        end = len(state.token_ids)
        try:
            reply = await session.close_resources_session(ids)
        except NemoGymError as e:
            error = str(e)
        else:
            if reply.status == 404:  # NeMo Gym before 0.7: no such route
                self.has_close_session = False
                return
            if 200 <= reply.status < 300:
                state.add_turn(Turn("env", end, end, text=reply.text, tool="close_session"))
                return
            error = f"POST {session.url}/close_session answered {reply.status}: {_excerpt(reply.text, 300)}"
        self.stats["close_errors"] += 1
        state.extra["close_error"] = True
        logger.warning("env %s: %s", self.name, error)
        state.add_turn(Turn("env", end, end, tool="close_session", error=error))

    async def _send_calls(self, state: EpisodeState, session: ResourcesSession, fmt: ChatFormat, limit: int) -> None:
        """POST each pending call of the last policy turn to its route (or answer an invalid
        one with an error), then append the answers as the chat template renders tool messages."""
        declared = [t["function"]["name"] for t in fmt.tools]
        turn = state.policy_turns
        results = []
        for k, call in enumerate(state.pending_calls):
            error = call["error"]
            if error is None and k >= self.options.max_tool_calls_per_turn:
                error = (
                    f"more than {self.options.max_tool_calls_per_turn} tool calls in one turn; this one was not sent"
                )
            elif error is None and call["name"] not in declared:
                error = f"unknown tool {call['name']!r}; this task's tools are {', '.join(declared) or '(none)'}"
            if error is not None:
                output, took = f"error: {error}", 0.0
                state.invalid_tool_calls += 1
            else:
                start = time.monotonic()
                reply = await session.call_tool(call["name"], call["arguments"])
                output, took = reply.text, time.monotonic() - start
                if not 200 <= reply.status < 300:
                    error = f"POST {session.url}/{call['name']} answered {reply.status}"
                    state.extra["tool_errors"] += 1
            if call["name"] is not None and call["arguments"] is not None:
                state.extra["outputs"][call_id(turn, k)] = output
            state.tool_calls += 1
            state.tool_time_s += took
            results.append((call, output, error, took))
        messages = [{"role": "tool", "name": call["name"] or "invalid",
                     "content": cap_text(output, self.options.max_tool_output_chars)}
                    for call, output, *_ in results]  # fmt: skip
        ids, spans = fmt.delta_ids(messages)
        fits = len(state.token_ids) + len(ids) < limit  # and one token left for the policy
        start = state.append(ids, policy=False)[0] if fits else len(state.token_ids)
        for (call, _, error, took), message, (a, b) in zip(results, messages, spans):
            a, b = (start + a, start + b) if fits else (start, start)
            state.add_turn(Turn("tool", a, b, text=message["content"], tool=call["name"],
                                arguments=call["arguments"], duration_s=took, error=error))  # fmt: skip
        state.messages.extend(messages)
        state.pending_calls, state.call_results = [], []
        if not fits:
            self._finish(state, "token_limit")

    async def _verify(self, task: Task, state: EpisodeState, session: ResourcesSession) -> Verdict:
        """POST /verify with the row and the episode as a Responses `response`."""
        calls = model_calls(
            state.token_ids, state.logprobs, state.audit_turns(), think_tags=self.nemo_options.think_tags
        )
        items = output_items(calls, state.extra["outputs"])
        tokens = state.tokens
        usage = {"input_tokens": tokens["prompt_uncached"] + tokens["prompt_cached"],
                 "cached_tokens": tokens["prompt_cached"], "output_tokens": tokens["output"]}  # fmt: skip
        incomplete = "max_output_tokens" if state.finish_reason in ("length", "token_limit") else None
        params = task.data["responses_create_params"]
        body = {**task.data, "response": responses_response(params, items, usage=usage, incomplete=incomplete)}
        answer = await session.verify(body)
        verdict = read_verdict(answer, body, where=f"POST {session.url}/verify",
                               tolerance=self.nemo_options.reward_components_tolerance)  # fmt: skip
        end = len(state.token_ids)
        state.add_turn(Turn("env", end, end, text=json.dumps(verdict.record), tool="verify",
                            error=verdict.reward_error))  # fmt: skip
        return verdict

    def _result(self, state: EpisodeState, verdict: Verdict | None) -> dict[str, Any]:
        """reward, components, reward_error and metrics of a finished episode."""
        reward, components, reward_error, extra = 0.0, {}, None, {}
        masked, kind = False, None
        if verdict is not None:
            reward, components, reward_error, extra = (verdict.reward, dict(verdict.components),
                                                       verdict.reward_error, verdict.metrics)  # fmt: skip
            masked, kind = verdict.masked, verdict.failure_kind
            if reward_error is not None:
                self.stats["reward_errors"] += 1
            if masked:
                self.stats["masked"] += 1
        if state.invalid_tool_calls and self.options.invalid_call_penalty:
            components = components or {"verify": reward}
            components["invalid_tool_call"] = -float(self.options.invalid_call_penalty)
            reward = math.fsum(components.values())
        metrics = {
            "turns": float(state.policy_turns),
            "tool_calls": float(state.tool_calls),
            "invalid_tool_calls": float(state.invalid_tool_calls),
            "tool_errors": float(state.extra["tool_errors"]),
            "tool_time_s": state.tool_time_s,
            "generation_time_s": state.generation_time_s,
            "response_tokens": float(len(state.token_ids) - state.prompt_length),
            "policy_tokens": float(sum(state.loss_mask)),
            "verified": float(verdict is not None),
            "truncated": float(state.finish_reason in ("length", "token_limit")),
            "aborted": float(state.finish_reason == "abort"),
            "reward_error": float(reward_error is not None),
            "masked": float(masked),
            "close_errors": float(bool(state.extra.get("close_error"))),
            **({f"failure_kind/{kind}": 1.0} if kind else {}),
            **extra,
        }
        return {"reward": reward, "reward_components": components, "reward_error": reward_error, "metrics": metrics,
                "masked": masked, "failure_kind": kind}  # fmt: skip

    async def aggregate_metrics(self, trajectories: Iterable[Trajectory]) -> dict[str, Any]:
        """The server's /aggregate_metrics over the verify answers of these episodes (grouped
        by task, with their sample index): group_level_metrics, agent_metrics, key_metrics.
        Masked episodes are left out, as NeMo Gym leaves them out of its own aggregates."""
        entries, task_index = [], {}
        for t in trajectories:
            record = verify_record(t)
            if record is not None and not t.masked:
                index = task_index.setdefault(t.task.id, len(task_index))
                entries.append({**record, TASK_INDEX_KEY: index, ROLLOUT_INDEX_KEY: t.sample_index})
        async with ResourcesSession(self.url, self.timeouts, option_names=env_options(self.name)) as session:
            return await session.post_json("/aggregate_metrics", {"verify_responses": entries},
                                           timeout_s=self.timeouts.verify_s)  # fmt: skip


# ----------------------------------------------------------------------------- re-verifying recorded rollouts


def input_key(responses_input: Any) -> str:
    """A row's input messages as a key (role and text of each message item), to join rows."""
    if isinstance(responses_input, str):
        return json.dumps([["user", responses_input]])
    key = []
    for item in responses_input or []:
        if isinstance(item, dict) and (item.get("type") or "message") == "message":
            try:
                text = _content_text(item.get("content", ""), "input")
            except RowError:
                text = json.dumps(item.get("content"), sort_keys=True)
            key.append([item.get("role"), text])
    return json.dumps(key)


def example_row(rollout: Mapping[str, Any], rows_by_input: Mapping[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The example row with the rollout's input messages (None when there is none)."""
    params = rollout.get("responses_create_params")
    return rows_by_input.get(input_key(params.get("input") if isinstance(params, dict) else None))


async def reverify_one(
    url: str,
    rollout: Mapping[str, Any],
    *,
    row: Mapping[str, Any] | None = None,
    replay_tools: bool = True,
    timeouts: Timeouts = Timeouts(),
) -> dict[str, Any]:
    """Seed a session with the recorded row, replay its function calls (so stateful servers
    have the state the episode built), /verify it, close the session (0.7); the verdict, and
    how the replayed tool answers compare with the recorded ones. `row`: the example row the
    rollout was made from (recorded_verify_body)."""
    body = recorded_verify_body(rollout, row)
    out: dict[str, Any] = {}
    response = body.get("response") if isinstance(body.get("response"), dict) else {}
    outputs = [o for o in response.get("output") or () if isinstance(o, dict)]
    ids = SessionIds.new("reverify", "rollout")
    async with ResourcesSession(url, timeouts) as session:
        try:
            if replay_tools:
                await session.seed_session({k: v for k, v in body.items() if k != "response"})
                recorded = {
                    o.get("call_id"): o.get("output") for o in outputs if o.get("type") == "function_call_output"
                }
                replayed = differ = 0
                for item in outputs:
                    if item.get("type") != "function_call":
                        continue
                    try:
                        arguments = json.loads(item.get("arguments") or "{}")
                    except ValueError:
                        continue  # NeMo Gym's agent answers such a call itself, without the server
                    reply = await session.call_tool(item["name"], arguments)
                    replayed += 1
                    if item.get("call_id") in recorded and _same_json(reply.text, recorded[item.get("call_id")]):
                        continue
                    differ += 1
                out.update(tool_calls_replayed=replayed, tool_answers_differ=differ)
            started = time.monotonic()
            answer = await session.verify(body)
            out["verify_s"] = round(time.monotonic() - started, 3)
        finally:
            if session.reached:
                try:
                    closed = await session.close_resources_session(ids)
                    if closed.status != 404 and not 200 <= closed.status < 300:
                        out["close_error"] = f"POST {session.url}/close_session answered {closed.status}"
                except NemoGymError as e:
                    out["close_error"] = str(e)
    verdict = read_verdict(answer, body, where=f"POST {url.rstrip('/')}/verify")
    failure = {"masked": True} if verdict.masked else {}
    failure.update({k: v for k, v in (("failure_kind", verdict.failure_kind),
                                      ("failure_reason", verdict.failure_reason)) if v is not None})  # fmt: skip
    return {"reward": verdict.reward, **({"reward_components": verdict.components} if verdict.components else {}),
            **({"reward_error": verdict.reward_error} if verdict.reward_error else {}), **failure, **out}  # fmt: skip


async def reverify_mode(url: str, timeouts: Timeouts = Timeouts()) -> str | None:
    """What GET /reverify_mode says (0.5+: "stateless", "unsupported" or "unknown"); None when
    the server has no such route (0.4) or answers something else."""
    async with ResourcesSession(url, timeouts) as session:
        reply = await session.get("/reverify_mode")
    return reply.json if 200 <= reply.status < 300 and isinstance(reply.json, str) else None


def _same_json(a: str, b: Any) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except (TypeError, ValueError):
        return a == b


async def reverify(
    url: str,
    rollouts_path: str,
    *,
    rows_path: str | None = None,
    replay_tools: bool = True,
    timeouts: Timeouts = Timeouts(),
    concurrency: int = 8,
) -> list[dict[str, Any]]:
    """One result per recorded rollout of `rollouts_path`, in file order: its line, reward
    (and components), the recorded reward, whether they match, or the error that stopped it."""
    rows_by_input: dict[str, dict[str, Any]] = {}
    if rows_path:
        for n, row, problem in read_rows(rows_path):
            if problem or not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
                raise RowError(f"{rows_path}:{n}: {problem or 'not a NeMo Gym row (no responses_create_params)'}")
            rows_by_input.setdefault(input_key(row["responses_create_params"].get("input")), row)
    entries = list(read_rows(rollouts_path))
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int, rollout: Any, problem: str | None) -> dict[str, Any]:
        result: dict[str, Any] = {"line": n}
        if problem is None and not (isinstance(rollout, dict) and isinstance(rollout.get("response"), dict)):
            problem = "not a recorded rollout (a row with its 'response' object)"
        if problem:
            return {**result, "error": f"{rollouts_path}:{n}: {problem}"}
        recorded = rollout.get("reward")
        async with gate:
            try:
                verdict = await reverify_one(url, rollout, row=example_row(rollout, rows_by_input),
                                             replay_tools=replay_tools, timeouts=timeouts)  # fmt: skip
            except NemoGymError as e:
                return {**result, "error": str(e), "recorded_reward": recorded}
        return {**result, **verdict, "recorded_reward": recorded,
                "matches_recorded": recorded is not None and _number(recorded) == verdict["reward"]}  # fmt: skip

    return list(await asyncio.gather(*(one(*e) for e in entries)))


def _cli_reverify(args: argparse.Namespace) -> int:
    timeouts = Timeouts(connect_s=args.connect_timeout, request_s=args.timeout, verify_s=args.verify_timeout)
    try:
        mode = asyncio.run(reverify_mode(args.url, timeouts))
    except NemoGymError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if mode == "unsupported" and not args.force:
        print(f"error: {args.url}/reverify_mode says 'unsupported': this server's rewards cannot be computed again "
              "from a recorded rollout (its verifier needs the episode's live state); pass --force to re-verify "
              "anyway", file=sys.stderr)  # fmt: skip
        return 2
    if mode == "unsupported":
        print(f"warning: {args.url}/reverify_mode says 'unsupported'; the rewards below may be wrong (--force)",
              file=sys.stderr)  # fmt: skip
    try:
        results = asyncio.run(
            reverify(
                args.url,
                args.rollouts,
                rows_path=args.rows,
                replay_tools=not args.verify_only,
                timeouts=timeouts,
                concurrency=args.concurrency,
            )  # fmt: skip
        )
    except (OSError, RowError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rewards = []
    for r in results:
        print(json.dumps(r), flush=True)
        if "error" not in r and not r.get("masked"):
            rewards.append(r["reward"])
    mean = math.fsum(rewards) / len(rewards) if rewards else float("nan")
    print(f"mean_reward {mean}")
    failed = [r for r in results if "error" in r]
    if failed:
        print(f"error: {len(failed)} of {len(results)} rollouts could not be verified (see their 'error')",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ptrain.envs.nemo_gym", description="NeMo Gym resources-server tools")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "reverify",
        help="re-send recorded rollouts to /verify; one JSON line per row, then `mean_reward <value>`",
        description="Re-verify recorded rollouts (a server's data/example_rollouts.jsonl): per row, seed a "
        "session, replay its function calls, POST /verify, close the session (NeMo Gym 0.7); print one JSON object "
        "per row with its reward (and masked, failure_kind, failure_reason when the answer has them), then a last "
        "line `mean_reward <value>` over the rows not masked. Exit 1 when a row could not be verified.",
    )
    r.add_argument("rollouts", metavar="ROLLOUTS.jsonl", help="recorded verify answers: row + response + reward")
    r.add_argument("--url", required=True, help="the resources server's base URL, e.g. http://127.0.0.1:8001")
    r.add_argument("--rows", default=None, metavar="example.jsonl",
                   help="rows whose task fields the rollouts lack, joined by their input messages")  # fmt: skip
    r.add_argument("--verify-only", action="store_true",
                   help="send only /verify (no /seed_session, no replayed tool calls)")  # fmt: skip
    r.add_argument("--force", action="store_true",
                   help="re-verify even when the server's /reverify_mode says 'unsupported'")  # fmt: skip
    r.add_argument("--timeout", type=float, default=60.0, help="seconds for a seed or tool call (default 60)")
    r.add_argument("--verify-timeout", type=float, default=300.0, help="seconds for a /verify (default 300)")
    r.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect (default 5)")
    r.add_argument("--concurrency", type=int, default=8, help="rollouts verified at once (default 8)")
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error(f"--concurrency must be >= 1, got {args.concurrency}")
    for flag in ("timeout", "verify_timeout", "connect_timeout"):
        value = getattr(args, flag)
        # A negative one times out at once, which reads as a dead server; nan is a traceback.
        if not 0 < value < math.inf:
            p.error(f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {value}")
    url = urlsplit(args.url)
    try:
        url.port  # noqa: B018 - raises ValueError on a port that is not a number in 0..65535
    except ValueError:
        url = urlsplit("")
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/") or url.query:
        p.error(f"--url must be the server's base URL, http://host:port (no route), got {args.url!r}")
    return _cli_reverify(args)


if __name__ == "__main__":
    sys.exit(main())
