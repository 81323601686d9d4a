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
engine samples the turns, so token ids stay exactly the sampled ones (the tool loop of
`ptrain.envs.multi_turn`), and the rows' function tools become thin HTTP tools in that loop.

Per episode:
  1. POST /seed_session with the row;
  2. the tool loop: the row's input messages and tools through the chat template, engine
     turns, each <tool_call> -> POST /<name> with the parsed arguments, the server's answer
     (whatever its status, as NeMo Gym's agent does) rendered as a tool message, loss-masked;
  3. POST /verify with the row plus `response`: the episode as Responses output items
     (reasoning / message / function_call per policy turn, function_call_output per tool
     answer); the last item of each model call carries NeMo Gym's training fields
     prompt_token_ids, generation_token_ids, generation_log_probs;
  4. reward and reward_components (checked to sum to the reward, as NeMo RL requires) from
     the answer; `_ng_failure_class` (e.g. a failed LLM judge) is a reward_error.
A server that cannot be reached, answers an error status or does not answer in time makes
the episode's finish_reason "error" with the URL, route and status in `Trajectory.error`;
the run goes on.

Recorded rollouts (a server's data/example_rollouts.jsonl: the row, the model's `response`
and its `reward`) are re-verified by `reverify`: each row is seeded in a session of its own,
its recorded function calls are replayed against the tool routes (so stateful servers see
the state the episode built), then it goes to /verify. Recorded rows hold explicit nulls
that /verify refuses, so null fields are dropped first; and they may lack task fields of
their example.jsonl rows, which `--rows` joins back by the input messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

NG_FAILURE_CLASS_KEY = "_ng_failure_class"
"""Verify answers that failed (a judge that did not answer, ...) carry their class here."""
TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
"""What /aggregate_metrics groups by: the task, and the sample within its group."""
ECHOED_KEYS = ("responses_create_params", "response")
"""Fields /verify echoes back from its request (left out of audit records and metrics requests)."""
INPUT_ROLES = ("user", "system", "developer", "assistant")
MODEL_NAME = "ptrain"
"""`response.model` of the episodes ptrain sends to /verify."""


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


class ResourcesSession:
    """One episode's HTTP session with a resources server.

    One `httpx.AsyncClient` per session: the server's session cookie, set on the first
    answer, goes with every later request, as NeMo Gym's agent forwards it from seed to verify.
    """

    def __init__(self, url: str, timeouts: Timeouts = Timeouts()):
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeouts.request_s, connect=timeouts.connect_s),
            headers={"content-type": "application/json"},
        )

    async def __aenter__(self) -> ResourcesSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.aclose()

    @property
    def cookies(self) -> dict[str, str]:
        return dict(self._client.cookies)

    async def post(self, route: str, body: Any, *, timeout_s: float | None = None, what: str = "") -> Reply:
        """POST JSON to `route`; NemoGymError when the server is unreachable or too slow (any
        status comes back as a Reply: what an error status means is the caller's to say)."""
        where = f"POST {self.url}{route}"
        timeout = httpx.Timeout(timeout_s or self.timeouts.request_s, connect=self.timeouts.connect_s)
        try:
            payload = json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise NemoGymError(f"{where}: the request body is not JSON ({e})") from None
        try:
            response = await self._client.post(route, content=payload, timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise NemoGymError(
                f"{where}: the NeMo Gym resources server at {self.url} is unreachable ({type(e).__name__}: {e}); "
                "start it (python tools/nemo_gym_servers.py NAME prints its URL) or fix env.options.url"
            ) from None
        except httpx.TimeoutException:
            limit = timeout.read
            raise NemoGymError(f"{where}: no answer within {limit:g} s{what}") from None
        except httpx.HTTPError as e:
            raise NemoGymError(f"{where}: the request failed ({type(e).__name__}: {e})") from None
        text = response.text
        try:
            parsed = response.json()
        except ValueError:
            parsed = None
        return Reply(response.status_code, text, parsed)

    async def post_json(self, route: str, body: Any, *, timeout_s: float | None = None, what: str = "") -> Any:
        """POST and demand a 2xx JSON object; NemoGymError names the route, status and body."""
        reply = await self.post(route, body, timeout_s=timeout_s, what=what)
        where = f"POST {self.url}{route}"
        if not 200 <= reply.status < 300:
            raise NemoGymError(f"{where} answered {reply.status}: {_excerpt(reply.text)}")
        if not isinstance(reply.json, dict):
            raise NemoGymError(f"{where} answered {reply.status} with a body that is not a JSON object: "
                               f"{_excerpt(reply.text)}")  # fmt: skip
        return reply.json

    async def seed_session(self, row: Mapping[str, Any]) -> dict[str, Any]:
        return await self.post_json("/seed_session", row, what=" (env.options.request_timeout_s)")

    async def call_tool(self, name: str, arguments: Any) -> Reply:
        """POST /<name> with the arguments; every status is an answer for the policy to read."""
        return await self.post(f"/{name}", arguments, what=" (env.options.request_timeout_s)")

    async def verify(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.post_json(
            "/verify", body, timeout_s=self.timeouts.verify_s, what=" (env.options.verify_timeout_s)"
        )


def _excerpt(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def drop_nulls(value: Any) -> Any:
    """`value` with every null-valued object field removed, recursively (list items stay)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


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
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
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


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x)


def read_verdict(answer: Mapping[str, Any], sent: Mapping[str, Any], *, where: str, tolerance: float = 1e-6) -> Verdict:
    """Read a /verify answer (`sent`: the request, whose echoed fields are not results)."""
    record = {k: v for k, v in answer.items() if k not in ECHOED_KEYS}
    usage = (answer.get("response") or {}).get("usage") if isinstance(answer.get("response"), dict) else None
    if usage:
        record["response"] = {"usage": usage}
    metrics = {}
    for k, v in answer.items():
        if k in sent or k in ECHOED_KEYS or k in ("reward", "reward_components") or k.startswith("_ng_"):
            continue
        value = float(v) if isinstance(v, bool) else _number(v)
        if value is not None:
            metrics[f"verify_{k}"] = value
    reward = _number(answer.get("reward"))
    if reward is None:
        return Verdict(0.0, {}, f"{where} answered without a finite number as reward: "
                       f"reward={answer.get('reward')!r}", record, metrics)  # fmt: skip
    components: dict[str, float] = {}
    raw = answer.get("reward_components")
    error = None
    if raw is not None:
        if not isinstance(raw, dict) or any(_number(v) is None for v in raw.values()):
            return Verdict(0.0, {}, f"{where}: reward_components must map names to finite numbers, got "
                           f"{_excerpt(json.dumps(raw), 200)}", record, metrics)  # fmt: skip
        components = {str(k): float(v) for k, v in raw.items()}
        total = math.fsum(components.values())
        if abs(total - reward) > tolerance * max(1.0, abs(reward)):
            return Verdict(0.0, components, f"{where}: reward {reward} is not the sum of reward_components "
                           f"{components} ({total}); NeMo RL requires them to sum", record, metrics)  # fmt: skip
    failure = answer.get(NG_FAILURE_CLASS_KEY)
    if failure is not None:
        error = f"{where} reported {NG_FAILURE_CLASS_KEY}={failure!r} (reward {reward})"
        metrics["verify_failed"] = 1.0
    return Verdict(reward, components, error, record, metrics)


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


def join_task_fields(rollout: dict[str, Any], rows_by_input: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The rollout with the task fields of its example row (same input messages) that it lacks."""
    params = rollout.get("responses_create_params") or {}
    row = rows_by_input.get(input_key(params.get("input")))
    if row is None:
        return rollout
    return {**{k: v for k, v in row.items() if k != "responses_create_params"}, **rollout}


async def reverify_one(
    url: str, rollout: dict[str, Any], *, replay_tools: bool = True, timeouts: Timeouts = Timeouts()
) -> dict[str, Any]:
    """Seed a session with the recorded row, replay its function calls (so stateful servers
    have the state the episode built), /verify it; the verdict, and how the replayed tool
    answers compare with the recorded ones."""
    body = drop_nulls({k: v for k, v in rollout.items() if k not in ("reward", "reward_components")})
    out: dict[str, Any] = {}
    async with ResourcesSession(url, timeouts) as session:
        if replay_tools:
            seed = {k: v for k, v in body.items() if k != "response"}
            await session.seed_session(seed)
            recorded = {
                o.get("call_id"): o.get("output")
                for o in (body.get("response") or {}).get("output", [])
                if o.get("type") == "function_call_output"
            }
            replayed = differ = 0
            for item in (body.get("response") or {}).get("output", []):
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
        answer = await session.verify(body)
    verdict = read_verdict(answer, body, where=f"POST {url.rstrip('/')}/verify")
    return {"reward": verdict.reward, **({"reward_components": verdict.components} if verdict.components else {}),
            **({"reward_error": verdict.reward_error} if verdict.reward_error else {}), **out}  # fmt: skip


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
                verdict = await reverify_one(
                    url, join_task_fields(rollout, rows_by_input), replay_tools=replay_tools, timeouts=timeouts
                )
            except NemoGymError as e:
                return {**result, "error": str(e), "recorded_reward": recorded}
        return {**result, **verdict, "recorded_reward": recorded,
                "matches_recorded": recorded is not None and _number(recorded) == verdict["reward"]}  # fmt: skip

    return list(await asyncio.gather(*(one(*e) for e in entries)))


def _cli_reverify(args: argparse.Namespace) -> int:
    timeouts = Timeouts(connect_s=args.connect_timeout, request_s=args.timeout, verify_s=args.verify_timeout)
    try:
        results = asyncio.run(
            reverify(args.url, args.rollouts, rows_path=args.rows, replay_tools=not args.verify_only, timeouts=timeouts)
        )
    except (OSError, RowError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rewards = []
    for r in results:
        print(json.dumps(r), flush=True)
        if "error" not in r:
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
        "session, replay its function calls, POST /verify; print one JSON object per row with its reward, then "
        "a last line `mean_reward <value>`. Exit 1 when a row could not be verified.",
    )
    r.add_argument("rollouts", metavar="ROLLOUTS.jsonl", help="recorded verify answers: row + response + reward")
    r.add_argument("--url", required=True, help="the resources server's base URL, e.g. http://127.0.0.1:8001")
    r.add_argument("--rows", default=None, metavar="example.jsonl",
                   help="rows whose task fields the rollouts lack, joined by their input messages")  # fmt: skip
    r.add_argument("--verify-only", action="store_true",
                   help="send only /verify (no /seed_session, no replayed tool calls)")  # fmt: skip
    r.add_argument("--timeout", type=float, default=60.0, help="seconds for a seed or tool call (default 60)")
    r.add_argument("--verify-timeout", type=float, default=300.0, help="seconds for a /verify (default 300)")
    r.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect (default 5)")
    args = p.parse_args(argv)
    return _cli_reverify(args)


if __name__ == "__main__":
    sys.exit(main())
