"""The multi-turn tool loop shared by the tool_use, long_horizon and terminal kinds.

    env = make_env(EnvConfig(kind="tool_use"), tokenizer=tok)          # a MultiTurnEnv
    env.set_episode_dir("runs/x/episodes/step_000012")                  # checkpoints (optional)
    trajectories = await env.rollout(task, engine, SamplingParams(n=8, max_new_tokens=256))

One episode, per sample of a task (the n samples run concurrently as asyncio tasks):

  1. the prompt is the task's messages rendered by the tokenizer's chat template with the
     tools declared through its `tools=` argument (a template that ignores tools gets them in
     the system message instead, in the same Hermes / Qwen format);
  2. each policy turn is one n=1 request of the whole episode's token ids so far, stopping at
     the template's end-of-turn token; the engine's output ids are appended as they are (loss
     mask 1, the engine's log-probs). The engine's prefix cache holds the episode's previous
     request, so a turn pays only for its new tokens (TokenCounts.prompt_cached);
  3. `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are parsed from the
     decoded output and each call runs (sandboxed ones through the sandbox's async API, so a
     slow tool blocks only its own episode). A malformed call, an unknown tool or arguments
     that do not fit the tool's schema get an error observation instead, and are counted
     (metrics.invalid_tool_calls; reward component invalid_tool_call when
     `invalid_call_penalty` > 0);
  4. the results are rendered as the chat template renders tool messages, and only that delta
     is tokenised (see `ChatFormat.delta_ids`) and appended with loss mask 0, ending in the
     next assistant header; the environment's own messages (a long-horizon episode's user
     follow-ups) are appended the same way;
  5. the loop ends when the policy answers without a tool call and the environment has
     nothing more to say (finish "stop"), at the turn or token limit, or when a sample ends
     for another reason (length, abort); then the kind scores the episode.

Token ids are never re-tokenised: what the trainer sees is exactly what was sampled plus the
environment's deltas, which are exactly what the chat template would give for the whole
conversation at those positions (the tests check this for the embedded template and for
Qwen2.5's and Qwen3's).

With an episode folder (`options.episode_dir`, or `set_episode_dir` from the stage, one per
rollout batch) every episode is checkpointed after each turn (`ptrain.envs.episode`) and a
rollout resumes unfinished episodes without re-running their recorded tool calls; the
workspace comes back from the checkpoint's archive.

Measured on the build machine (2 AMD EPYC cores shared with other jobs, bwrap backend): a
sandboxed bash call about 0.13 s p50, a python call about 0.2 s (two interpreter starts: the
workspace runner and the program); the loop itself about 0.5 ms a turn against the replay
engine (a 32-turn long_horizon episode in 17 ms, reward workers warm), and a checkpoint
about 15 ms a turn (the file's and the folder's fsync).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ptrain.config.env_multi_turn import MultiTurnOptions
from ptrain.data.tokenizer import stop_token_ids
from ptrain.envs.base import Task, TaskSplits, Trajectory, Turn
from ptrain.envs.episode import EpisodeState, EpisodeStore
from ptrain.envs.tools import (
    SANDBOXED_TOOLS,
    Tool,
    ToolArgumentError,
    ToolContext,
    Workspace,
    call_tool,
    make_tools,
    tool_sandbox,
)
from ptrain.rollout.protocol import EngineUnavailable, GenerateRequest, RequestError, RolloutEngine, SamplingParams
from ptrain.sandbox import Sandbox

logger = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

# Declaration of tools for a chat template that does not render `tools=` itself (the embedded
# ChatML one): the Hermes / Qwen convention, so the policy sees what a Qwen model would.
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more of the functions below. Their signatures are given as JSON "
    "schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON "
    'object with its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{{"name": '
    '<function-name>, "arguments": <args-json-object>}}\n</tool_call>\nEach result comes back in a tool message.'
)

_DUMMY_QUESTION = "ptrain delta probe question"
_DUMMY_ANSWER = "ptrain delta probe answer 7d1f"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot render what a multi-turn episode needs."""


# ---------------------------------------------------------------------------------------- rendering


class ChatFormat:
    """A tokenizer's chat template as the tool loop uses it: the first prompt, the end-of-turn
    ids the policy stops at, and the token deltas of tool results and environment messages.

    `delta_ids(messages)` renders a fixed conversation [user, assistant, *messages] with the
    generation prompt and keeps what follows the assistant's end-of-turn token: the closing
    separator of the policy's turn, the new messages, and the next assistant header. Because
    the policy's turn ends with that end-of-turn token, the episode's ids stay equal to the
    template's render of the whole conversation (tokenised at the same boundaries).
    """

    def __init__(
        self, tokenizer, tools: Sequence[Mapping[str, Any]] = (), chat_template_kwargs: Mapping[str, Any] | None = None
    ):
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools]
        self.kwargs = dict(chat_template_kwargs or {})
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template; multi-turn environments need one")
        self.end_of_turn_ids = tuple(stop_token_ids(tokenizer))
        self.end_of_turn_text = tokenizer.convert_ids_to_tokens(self.end_of_turn_ids[0])
        self.tools_in_template = True
        if self.tools:
            probe = [{"role": "user", "content": _DUMMY_QUESTION}]
            self.tools_in_template = self._render(probe, tools=self.tools) != self._render(probe, tools=None)

    def _render(self, messages, *, tools="default", add_generation_prompt: bool = False) -> str:
        tools = self.tools if tools == "default" else tools
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.kwargs,
        )

    def with_tools(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages, with the tools declared in the system message when the template ignores `tools=`."""
        messages = [dict(m) for m in messages]
        if not self.tools or self.tools_in_template:
            return messages
        block = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools))
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
        else:
            messages.insert(0, {"role": "system", "content": block})
        return messages

    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return self._render(self.with_tools(messages), add_generation_prompt=True)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the episode's first prompt (tools declared, generation prompt added)."""
        return self.encode(self.prompt_text(messages))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def delta_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """What the template writes after a policy turn's end-of-turn token for `messages`."""
        conv = [{"role": "user", "content": _DUMMY_QUESTION}, {"role": "assistant", "content": _DUMMY_ANSWER}]
        try:
            text = self._render(self.with_tools(conv + [dict(m) for m in messages]), add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - jinja2 and template raise_exception errors
            roles = sorted({m.get("role", "?") for m in messages})
            raise ChatTemplateError(
                f"the chat template cannot render {roles} messages after an assistant turn "
                f"({type(e).__name__}: {e}); use a template with tool (and user) turns"
            ) from e
        at = text.find(_DUMMY_ANSWER)
        end = text.find(self.end_of_turn_text, at + len(_DUMMY_ANSWER)) if at >= 0 else -1
        if end < 0:
            raise ChatTemplateError(
                f"the chat template does not close an assistant turn with {self.end_of_turn_text!r} "
                "(the end-of-turn token the policy stops at), so turns cannot be appended as tokens"
            )
        return text[end + len(self.end_of_turn_text) :]

    def delta_ids(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[tuple[int, int]]]:
        """(token ids of the delta, token span of each message's part of it).

        The spans partition the delta: message i's part runs to the token after its content
        (the first from the delta's start, the last to its end, generation prompt included).
        Where a message's content cannot be found in the render, the spans fall back to the
        whole delta for the first message and empty spans at the end for the others.
        """
        text = self.delta_text(messages)
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            offsets = list(enc["offset_mapping"])
        except (NotImplementedError, KeyError, ValueError):
            enc, offsets = self.tokenizer(text, add_special_tokens=False), None
        ids = list(enc["input_ids"])
        n = len(ids)
        whole = [(0, n)] + [(n, n)] * (len(messages) - 1)
        if offsets is None or len(messages) <= 1:
            return ids, whole
        cuts, pos = [], 0
        for m in messages[:-1]:
            content = str(m.get("content", ""))
            at = text.find(content, pos)
            if at < 0:
                return ids, whole
            pos = at + len(content)
            cuts.append(next((k for k, (a, _) in enumerate(offsets) if a >= pos), n))
        bounds = [0] + cuts + [n]
        return ids, [(bounds[i], bounds[i + 1]) for i in range(len(messages))]

    def check(self, roles: Sequence[str]) -> None:
        """ChatTemplateError now, naming the problem, if a delta of these roles cannot be rendered."""
        for role in roles:
            self.delta_ids([{"role": role, "content": "probe", "name": "probe"}])


# ---------------------------------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block of a policy turn: its name and arguments, or why it is malformed."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a policy turn, in order (Hermes / Qwen format).

    Each `<tool_call>...</tool_call>` block must hold one JSON object with a string "name"
    and an "arguments" object (a JSON string that decodes to an object is accepted, as is a
    missing "arguments" for a tool without any). A block that is not, and a `<tool_call>`
    that is never closed, become calls with `error` set.
    """
    calls = []
    last = 0
    for match in _CALL_RE.finditer(text):
        last = match.end()
        calls.append(_parse_call(match.group(1)))
    tail = text.find(TOOL_CALL_OPEN, last)
    if tail >= 0:
        calls.append(ToolCall(None, None, text[tail:], f"a {TOOL_CALL_OPEN} was never closed with {TOOL_CALL_CLOSE}"))
    return calls


def _parse_call(raw: str) -> ToolCall:
    body = raw.strip()
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall(None, None, raw, f"the tool call is not valid JSON ({e})")
    if not isinstance(obj, dict):
        return ToolCall(None, None, raw, f"the tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, 'the tool call has no "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            return ToolCall(name, None, raw, f'"arguments" of {name} is a string that is not JSON ({e})')
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, f'"arguments" of {name} must be a JSON object, got {type(args).__name__}')
    return ToolCall(name, args, raw)


# ---------------------------------------------------------------------------------------- scoring


@dataclass
class Score:
    """What a kind's scorer returns: reward components (summed into the reward), metrics,
    and the reason when reward code failed (the reward is then 0)."""

    components: dict[str, float]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    reward_error: str | None = None


# ---------------------------------------------------------------------------------------- the env


class MultiTurnEnv(TaskSplits):
    """Base of the multi-turn kinds: the tool loop, episode checkpoints and token accounting.

    Built as the registry builds every kind: `cls(cfg, options, *, tokenizer, sandbox=None)`
    with its EnvConfig (name, n_train, n_eval, reward_timeout_s, reward_workers,
    max_new_tokens) and its typed options (a MultiTurnOptions). A kind provides
    `make_tasks(seed)` and `score(task, state, workspace)`, and may override
    `setup_workspace(task, workspace)` (its starting files; default task.data["files"]) and
    `env_response(task, state)` (the environment's messages after a policy turn without a
    tool call, or None to end the episode; default None).
    """

    kind = "multi_turn"
    env_roles: tuple[str, ...] = ("tool",)
    """Roles of the messages the environment appends (the template is checked for them at start)."""
    needs_sandbox = False
    """True for kinds that run code themselves (the terminal kind's test run)."""
    component_names: tuple[str, ...] = ()
    """The kind's reward components (0 in episodes that were not scored)."""
    metric_names: tuple[str, ...] = ()
    """The kind's own metrics (0 in episodes that were not scored)."""

    def __init__(self, cfg: Any, options: MultiTurnOptions, *, tokenizer: Any, sandbox: Any = None,
                 runner: Any = None, corpus: Any = None):  # fmt: skip
        self.cfg = cfg
        self.options = options
        self.name: str = cfg.env_name
        self.weight: float = float(getattr(cfg, "weight", 1.0))
        self.tokenizer = tokenizer
        tool_names = tuple(getattr(options, "tools", ()))
        self.sandbox = None
        if self.needs_sandbox or any(t in SANDBOXED_TOOLS for t in tool_names):
            # The stage's sandbox settings, with room for the workspace and a command's full timeout.
            base = sandbox.cfg if isinstance(sandbox, Sandbox) else sandbox
            self.sandbox = tool_sandbox(
                base, timeout_s=self.sandbox_timeout_s(),
                workspace_bytes=options.workspace_mb << 20, max_output_chars=options.max_tool_output_chars,
            )  # fmt: skip
        self.tools: dict[str, Tool] = make_tools(tool_names, sandbox=self.sandbox, corpus=corpus)
        self.format = ChatFormat(tokenizer, [t.schema() for t in self.tools.values()], options.chat_template_kwargs)
        self.format.check(self.env_roles)
        self.store = EpisodeStore(options.episode_dir) if options.episode_dir else None
        self._runner = runner
        self._owns_runner = runner is None
        self._in_flight: Counter[str] = Counter()
        self.stats: Counter[str] = Counter({"episodes": 0, "resumed": 0, "reward_errors": 0, "errors": 0})
        """Episodes finished, episodes resumed from a checkpoint, reward-code failures, engine-refused turns."""

    def sandbox_timeout_s(self) -> float:
        """The longest command this kind runs in its sandbox, in seconds."""
        return self.options.tool_timeout_s

    # ----------------------------------------------------------------- tasks and hooks

    async def setup_workspace(self, task: Task, workspace: Workspace) -> None:
        """Put the task's starting files into a fresh workspace."""
        workspace.populate(task.data.get("files", {}))

    async def env_response(self, task: Task, state: EpisodeState) -> list[dict[str, Any]] | None:
        """The environment's messages after a policy turn with no tool call; None ends the episode."""
        return None

    async def score(self, task: Task, state: EpisodeState, workspace: Workspace) -> Score:  # pragma: no cover
        raise NotImplementedError

    # ----------------------------------------------------------------- reward code

    @property
    def runner(self):
        """The worker pool that runs this environment's reward functions (started on first use)."""
        if self._runner is None:
            from ptrain.envs.safety import RewardRunner

            self._runner = RewardRunner(workers=self.cfg.reward_workers, timeout_s=self.cfg.reward_timeout_s)
        return self._runner

    async def judge(self, fn: Callable[..., Any], *args: Any) -> tuple[float, str | None]:
        """fn(*args) in this environment's reward workers (ptrain.envs.safety), off the event
        loop: (value, None), or (0.0, reason) when it raised, hung, crashed or returned a non-number."""
        outcome = await asyncio.to_thread(self.runner.run, fn, *args, timeout_s=self.cfg.reward_timeout_s)
        return outcome.reward, outcome.reason

    def close(self) -> None:
        """Stop this environment's reward workers."""
        if self._runner is not None and self._owns_runner:
            self._runner.close()
            self._runner = None

    # ----------------------------------------------------------------- the loop

    def set_episode_dir(self, folder: str | None) -> None:
        """Checkpoint episodes in `folder` from now on (the stage calls this once per rollout batch)."""
        self.store = EpisodeStore(folder) if folder else None

    async def rollout(self, task: Task, engine: RolloutEngine, sampling: SamplingParams) -> list[Trajectory]:
        """`sampling.n` scored episodes of one task, run concurrently (Environment.rollout).

        Each sample's turns are n=1 requests with rid '<env>/<task id>/s<j>/t<turn>' (plus
        '#k' while another rollout of the same task runs). With an episode folder, a sample
        whose checkpoint is finished is returned as recorded and an unfinished one resumes.
        An engine failure (not a refused request) propagates once every sample has stopped,
        so their checkpoints are current.
        """
        if self.cfg.max_new_tokens is not None:
            sampling = dataclasses.replace(sampling, max_new_tokens=self.cfg.max_new_tokens)
        stops = tuple(dict.fromkeys(tuple(sampling.stop_token_ids) + self.format.end_of_turn_ids))
        sampling = dataclasses.replace(sampling, stop_token_ids=stops)
        prompt = self.format.prompt_ids(task.messages)
        base = f"{self.name}/{task.id}"
        k = self._in_flight[base]
        self._in_flight[base] += 1
        rid = base if k == 0 else f"{base}#{k + 1}"
        try:
            runs = [self._episode(task, engine, sampling, j, prompt, rid) for j in range(sampling.n)]
            results = await asyncio.gather(*runs, return_exceptions=True)
        finally:
            self._in_flight[base] -= 1
            if self._in_flight[base] <= 0:
                del self._in_flight[base]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:  # an engine that cannot sample at all ends the stage, whatever else failed
            raise next((f for f in failures if isinstance(f, EngineUnavailable)), failures[0])
        return list(results)

    async def _episode(self, task, engine, sampling, j: int, prompt: list[int], rid: str) -> Trajectory:
        state = self.store.load(self.name, task.id, j) if self.store else None
        if state is not None and state.done and state.result is not None:
            return state.trajectory(task)
        if state is not None:
            self.stats["resumed"] += 1
        folder = tempfile.mkdtemp(prefix="ptrain-episode-")
        workspace = Workspace(os.path.join(folder, "workspace"), max_bytes=self.options.workspace_mb << 20)
        try:
            if state is None:
                state = EpisodeState(self.name, task.id, j, list(prompt), [0] * len(prompt), [0.0] * len(prompt),
                                     prompt_length=len(prompt))  # fmt: skip
                state.messages = [dict(m) for m in task.messages]
                await self.setup_workspace(task, workspace)
                state.workspace = base64.b64encode(workspace.snapshot()).decode()
                self._save(state)
            elif state.workspace:
                workspace.restore(base64.b64decode(state.workspace))
            limit = self.options.max_episode_tokens
            context = getattr(engine, "context_length", None)
            if isinstance(context, int) and context > 1:
                limit = min(limit, context)  # the engine serves prompts shorter than its context
            ctx = ToolContext(workspace, self.sandbox, self.options.max_tool_output_chars, self.options.tool_timeout_s)
            while not state.done:
                if state.pending_calls:
                    await self._answer_calls(state, ctx, limit)
                else:
                    await self._policy_turn(task, state, engine, sampling, limit, f"{rid}/s{j}/t{state.policy_turns}")
            if state.result is None:
                state.result = await self._score(task, state, workspace)
                self._save(state)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.stats["episodes"] += 1
        return state.trajectory(task)

    def _save(self, state: EpisodeState) -> None:
        if self.store is not None:
            self.store.save(state)

    def _finish(self, state: EpisodeState, reason: str, error: str | None = None) -> None:
        state.done, state.finish_reason, state.error = True, reason, error
        self._save(state)

    async def _policy_turn(self, task, state: EpisodeState, engine, sampling: SamplingParams, limit: int,
                           rid: str) -> None:  # fmt: skip
        """One policy turn, then its tool calls queued, or the environment's reply appended."""
        fmt = self.format
        if state.policy_turns >= self.options.max_turns:
            return self._finish(state, "turn_limit")
        room = limit - len(state.token_ids)
        if room < 1:
            return self._finish(state, "token_limit")
        seed = sampling.sampling_seed
        if seed is not None:  # distinct per sample and turn, reproducible
            seed = (seed * 1_000_003 + state.sample_index * 7_919 + state.policy_turns) % (2**31 - 1)
        request = GenerateRequest(
            input_ids=tuple(state.token_ids),
            sampling=dataclasses.replace(
                sampling, n=1, max_new_tokens=min(sampling.max_new_tokens, room), sampling_seed=seed
            ),
            rid=rid,
        )
        try:
            future = engine.submit(request)
        except RequestError as e:
            self.stats["errors"] += 1
            return self._finish(state, "error", f"the engine refused turn {state.policy_turns + 1}: {e}")
        try:
            (sample,) = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            engine.abort(rid)
            raise
        out = list(sample.output_ids)
        start, end = state.append(out, policy=True, logprobs=list(sample.logprobs))
        state.policy_turns += 1
        state.generation_time_s += sample.e2e_latency_s
        t = state.tokens
        t["prompt_cached"] += sample.cached_tokens
        t["prompt_uncached"] += len(request.input_ids) - sample.cached_tokens
        t["output"] += len(out)
        for span in sample.weight_versions or ():
            state.add_weight_version(span.version)
        if not sample.weight_versions:
            state.add_weight_version(sample.weight_version)
        reason = sample.finish_reason
        ended_turn = reason is not None and reason.type == "stop" and bool(out) and out[-1] in fmt.end_of_turn_ids
        text = self.tokenizer.decode(out[:-1] if ended_turn else out, skip_special_tokens=False)
        state.add_turn(Turn("policy", start, end, text=text, duration_s=sample.e2e_latency_s))
        state.messages.append({"role": "assistant", "content": text})
        if not ended_turn:
            # The sample ended inside its turn: at max_new_tokens, aborted, or at another stop id (EOS).
            kind = reason.type if reason is not None else "abort"
            if kind == "length" and len(state.token_ids) >= limit:
                kind = "token_limit"
            return self._finish(state, kind)
        calls = parse_tool_calls(text)
        if calls:
            if state.policy_turns >= self.options.max_turns:
                return self._finish(state, "turn_limit")
            state.pending_calls = [c.to_dict() for c in calls]
            state.call_results = []
            return self._save(state)
        follow_up = await self.env_response(task, state)
        if not follow_up:
            return self._finish(state, "stop")
        if state.policy_turns >= self.options.max_turns:
            return self._finish(state, "turn_limit")
        ids, spans = fmt.delta_ids(follow_up)
        if len(state.token_ids) + len(ids) >= limit:
            return self._finish(state, "token_limit")
        start, _ = state.append(ids, policy=False)
        for m, (a, b) in zip(follow_up, spans):
            state.add_turn(Turn("env", start + a, start + b, text=str(m.get("content", ""))))
            state.messages.append(dict(m))
        state.env_turns += 1
        self._save(state)

    async def _answer_calls(self, state: EpisodeState, ctx: ToolContext, limit: int) -> None:
        """Run the pending calls not answered yet (checkpointing after each), then append their results."""
        fmt = self.format
        allowed = tuple(self.tools)
        while len(state.call_results) < len(state.pending_calls):
            k = len(state.call_results)
            state.call_results.append(await self._answer(state.pending_calls[k], k, allowed, ctx))
            state.tool_calls += 1
            state.invalid_tool_calls += int(state.call_results[-1]["invalid"])
            state.tool_time_s += state.call_results[-1]["duration_s"]
            if state.call_results[-1]["changed_workspace"]:
                state.workspace = base64.b64encode(ctx.workspace.snapshot()).decode()
            self._save(state)
        messages = [
            {"role": "tool", "name": call.get("name") or "invalid", "content": result["output"]}
            for call, result in zip(state.pending_calls, state.call_results)
        ]
        ids, spans = fmt.delta_ids(messages)
        fits = len(state.token_ids) + len(ids) < limit  # and one token left for the policy
        start = state.append(ids, policy=False)[0] if fits else len(state.token_ids)
        for call, result, (a, b) in zip(state.pending_calls, state.call_results, spans):
            a, b = (start + a, start + b) if fits else (start, start)
            state.add_turn(
                Turn("tool", a, b, text=result["output"], tool=call.get("name"), arguments=call.get("arguments"),
                     exit_code=result["exit_code"], duration_s=result["duration_s"], error=result["error"])
            )  # fmt: skip
        state.messages.extend(messages)
        state.pending_calls, state.call_results = [], []
        if not fits:
            return self._finish(state, "token_limit")
        self._save(state)

    async def _answer(self, call: dict[str, Any], k: int, allowed: Sequence[str], ctx: ToolContext) -> dict[str, Any]:
        """The result record of one parsed call: its observation, or an invalid call's error."""

        def invalid(error: str) -> dict[str, Any]:
            return {"output": f"error: {error}", "exit_code": None, "error": error, "duration_s": 0.0,
                    "invalid": True, "changed_workspace": False}  # fmt: skip

        if call["error"]:
            return invalid(call["error"])
        if k >= self.options.max_tool_calls_per_turn:
            return invalid(
                f"more than {self.options.max_tool_calls_per_turn} tool calls in one turn; this one was not run"
            )
        name = call["name"]
        if name not in allowed:
            return invalid(f"unknown tool {name!r}; the tools are {', '.join(allowed) or '(none)'}")
        tool = self.tools[name]
        try:
            result = await call_tool(tool, call["arguments"], ctx)
        except ToolArgumentError as e:
            return invalid(str(e))
        return {"output": result.output, "exit_code": result.exit_code, "error": result.error,
                "duration_s": result.duration_s, "invalid": False,
                "changed_workspace": name in ("write_file", *SANDBOXED_TOOLS)}  # fmt: skip

    async def _score(self, task: Task, state: EpisodeState, workspace: Workspace) -> dict[str, Any]:
        """The episode's result record: reward, components, reward_error and metrics.

        An episode cut by a length limit (finish length or token_limit) is scored only with
        env.score_truncated; otherwise its components are 0 and metric truncated is 1, as in
        the single-turn kinds (length shaping belongs to the RL stage). An aborted or failed
        episode is not scored either. Invalid tool calls cost `invalid_call_penalty`
        (component invalid_tool_call) whatever the rest scored.
        """
        truncated = state.finish_reason in ("length", "token_limit")
        if state.finish_reason in ("abort", "error") or (truncated and not getattr(self.cfg, "score_truncated", False)):
            score = Score({})
        else:
            try:
                score = await self.score(task, state, workspace)
            except Exception as e:  # noqa: BLE001 - a scorer bug scores 0 with its reason, the run goes on
                logger.exception("%s: scoring task %s failed", self.name, task.id)
                score = Score({}, reward_error=f"the scorer raised {type(e).__name__}: {e}")
        components = {name: 0.0 for name in self.component_names}
        if score.reward_error is not None:
            self.stats["reward_errors"] += 1
            logger.warning("env %s task %s: reward code failed, reward 0: %s", self.name, task.id, score.reward_error)
        else:
            components.update(score.components)
            if state.invalid_tool_calls and self.options.invalid_call_penalty:
                components["invalid_tool_call"] = -float(self.options.invalid_call_penalty)
        metrics = {name: 0.0 for name in self.metric_names}
        metrics.update({k: float(v) for k, v in score.metrics.items()})
        metrics.update(
            turns=float(state.policy_turns),
            env_turns=float(state.env_turns),
            tool_calls=float(state.tool_calls),
            invalid_tool_calls=float(state.invalid_tool_calls),
            tool_time_s=state.tool_time_s,
            generation_time_s=state.generation_time_s,
            response_tokens=float(len(state.token_ids) - state.prompt_length),
            policy_tokens=float(sum(state.loss_mask)),
            truncated=float(truncated),
            aborted=float(state.finish_reason == "abort"),
            reward_error=float(score.reward_error is not None),
        )
        return {
            "reward": float(sum(components.values())),
            "reward_components": components,
            "reward_error": score.reward_error,
            "metrics": metrics,
        }


def final_answer(state: EpisodeState) -> str:
    """The text of the episode's last policy turn ("" when it has none)."""
    for m in reversed(state.messages):
        if m.get("role") == "assistant":
            return str(m.get("content", ""))
    return ""


__all__ = [
    "TOOLS_SYSTEM_PROMPT",
    "ChatFormat",
    "ChatTemplateError",
    "MultiTurnEnv",
    "Score",
    "ToolCall",
    "final_answer",
    "parse_tool_calls",
]
