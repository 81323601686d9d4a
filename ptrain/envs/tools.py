"""The tools a multi-turn episode can call, each declared by a JSON schema.

    tools = make_tools(("calculator", "python", "read_file", "search"), sandbox=Sandbox(cfg))
    schemas = [t.schema() for t in tools.values()]      # the chat template's `tools=`
    result = await tools["calculator"].call({"expression": "2 ** 10"}, context)

Tools:
  python      runs code in `ptrain.sandbox` with the episode's workspace as its working
              folder; stdout and stderr come back interleaved, capped.
  bash        runs a shell command the same way (the terminal kind's tool).
  calculator  evaluates arithmetic with a parser of its own (Python's `ast` grammar, a
              whitelist of nodes and functions, caps on the size of numbers); never `eval`.
  read_file, write_file, list_files
              files of the episode's workspace, a host folder; every path is confined to it
              (no absolute paths, no `..` out of it, no symlink followed out of it).
  search      BM25 over a small corpus shipped with the package (ptrain/envs/data/corpus.jsonl);
              returns the top documents' titles and snippets.

The workspace is a host folder that belongs to one episode. Sandboxed tools see a copy of it
(the sandbox's scratch folder is fresh for every run) and their changes come back: a small
program in the sandbox runs the command, then packs the scratch folder into a tar archive
that it prints with the output; the host unpacks it with tarfile's `data` filter, so an
entry that would land outside the workspace (an absolute path, `..`, a device file, a link
pointing out) is dropped, never written. A workspace can be snapshotted as bytes, which is
how an episode checkpoint restores it without re-running the calls that built it.

Bad arguments (`ToolArgumentError`: a missing or unknown argument, a wrong type) make the
call invalid: the loop counts it. A tool that runs and fails (a path outside the workspace,
a timeout, a division by zero) answers with `ToolResult.error` set, which the policy sees.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import dataclasses
import io
import json
import math
import operator
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ptrain.config.env_multi_turn import SANDBOX_MARGIN_S
from ptrain.config.sandbox import SandboxConfig
from ptrain.sandbox import Sandbox

TOOL_NAMES = ("python", "bash", "calculator", "read_file", "write_file", "list_files", "search")
"""Every tool `make_tools` can build."""
SANDBOXED_TOOLS = ("python", "bash")
"""Tools that run model-written code, and so need a Sandbox."""


class ToolArgumentError(ValueError):
    """The call's arguments do not fit the tool's schema (an invalid call)."""


@dataclass(frozen=True)
class ToolResult:
    """What one call returned: the text the policy sees, and the audit facts."""

    output: str
    """The observation (capped at the episode's max_tool_output_chars)."""
    exit_code: int | None = None
    """Exit status of a sandboxed command (128 + N when signal N ended it)."""
    error: str | None = None
    """Set when the tool itself failed (the output says the same to the policy)."""
    duration_s: float = 0.0


@dataclass
class ToolContext:
    """What a call may touch: the episode's workspace, the sandbox, the output cap."""

    workspace: Workspace
    sandbox: Sandbox | None = None
    max_output_chars: int = 4000
    """Characters of a tool's output the policy sees; the rest is cut with a note."""
    timeout_s: float = 10.0
    """Wall-clock limit of one sandboxed command."""


def cap_text(text: str, limit: int) -> str:
    """text cut to `limit` characters, with a note saying how much was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


# ---------------------------------------------------------------------------------------- arguments


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_arguments(name: str, parameters: Mapping[str, Any], arguments: Any) -> dict[str, Any]:
    """The arguments, checked against the tool's `parameters` schema, with defaults filled in.

    Covers what the tools here declare: an object of named properties with a type each
    (string, integer, number, boolean, array, object), `required`, `enum`, `minimum` /
    `maximum`, `maxLength`, `default`, and no properties beyond the declared ones.
    Raises ToolArgumentError naming the argument and what was expected.
    """
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
    props: Mapping[str, Any] = parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolArgumentError(f"{name}: unknown argument(s) {unknown}; it takes {sorted(props)}")
    missing = [k for k in parameters.get("required", ()) if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{name}: missing required argument(s) {missing}")
    out: dict[str, Any] = {}
    for key, spec in props.items():
        if key not in arguments:
            if "default" in spec:
                out[key] = spec["default"]
            continue
        value = arguments[key]
        kind = spec.get("type", "string")
        ok = isinstance(value, _JSON_TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if not ok:
            raise ToolArgumentError(f"{name}: argument {key!r} must be a {kind}, got {json.dumps(value)[:80]}")
        if "enum" in spec and value not in spec["enum"]:
            raise ToolArgumentError(f"{name}: argument {key!r} must be one of {spec['enum']}, got {value!r}")
        if "minimum" in spec and value < spec["minimum"] or "maximum" in spec and value > spec["maximum"]:
            raise ToolArgumentError(
                f"{name}: argument {key!r} must be in [{spec.get('minimum', '-inf')}, {spec.get('maximum', 'inf')}], "
                f"got {value}"
            )
        if "maxLength" in spec and len(value) > spec["maxLength"]:
            raise ToolArgumentError(
                f"{name}: argument {key!r} is {len(value)} characters long, more than {spec['maxLength']}"
            )
        out[key] = value
    return out


class Tool:
    """A named function the policy can call: a JSON schema, and an async `call`."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {}
    """The JSON schema of the arguments (an object schema)."""
    caps_own_output = False
    """True for tools that cap their output themselves (keeping their notes after the cut)."""

    def schema(self) -> dict[str, Any]:
        """The declaration for a chat template's `tools=` (OpenAI function format)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
        """Check the arguments (ToolArgumentError), run, and time the call."""
        args = check_arguments(self.name, self.parameters, arguments)
        start = time.monotonic()
        result = await self.run(args, context)
        output = result.output if self.caps_own_output else cap_text(result.output, context.max_output_chars)
        return dataclasses.replace(result, output=output, duration_s=time.monotonic() - start)

    async def run(self, args: dict[str, Any], context: ToolContext) -> ToolResult:  # pragma: no cover
        raise NotImplementedError


def _object(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


# ---------------------------------------------------------------------------------------- workspace


class WorkspaceError(ValueError):
    """A path the workspace refuses (outside it, through a link, not a file), or a workspace too large."""


class Workspace:
    """One episode's folder of files on the host; every path is confined to it.

    `resolve` refuses absolute paths, paths that leave the folder through `..`, and paths
    that pass through a symlink, wherever it points; files are opened with O_NOFOLLOW as
    well, so a link swapped in after the check is not followed either.
    """

    def __init__(self, root: str, max_bytes: int = 4 << 20):
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self.max_bytes = max_bytes
        """Largest total size of the workspace's files (a sandboxed command that grows it
        past this keeps none of its changes)."""

    def resolve(self, path: str) -> str:
        """The host path of `path` (relative to the workspace root), checked to stay inside."""
        if not isinstance(path, str) or "\0" in path:
            raise WorkspaceError(f"path {path!r} is not a valid file name")
        if os.path.isabs(path):
            raise WorkspaceError(f"path {path!r} is absolute; give a path relative to the workspace")
        parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
        current = self.root
        for i, part in enumerate(parts):
            if part == "..":
                raise WorkspaceError(f"path {path!r} leaves the workspace ('..' is not allowed)")
            current = os.path.join(current, part)
            if os.path.islink(current):
                raise WorkspaceError(
                    f"path {path!r} goes through the link {'/'.join(parts[: i + 1])!r}; links are not followed"
                )
        return current

    def rel(self, host_path: str) -> str:
        return os.path.relpath(host_path, self.root)

    def read_text(self, path: str) -> str:
        host = self.resolve(path)
        if not os.path.exists(host):
            raise WorkspaceError(f"no file {path!r} in the workspace")
        if os.path.isdir(host):
            raise WorkspaceError(f"{path!r} is a folder; list_files shows what is in it")
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise WorkspaceError(f"{path!r} is not a regular file")
            data = f.read(self.max_bytes + 1)
        return data.decode("utf-8", "replace")

    def write_text(self, path: str, content: str) -> int:
        """Write (replace) a file, creating its folders; returns the bytes written."""
        host = self.resolve(path)
        if host == self.root or os.path.isdir(host):
            raise WorkspaceError(f"{path!r} is a folder, not a file")
        data = content.encode()
        if self.size() + len(data) > self.max_bytes:
            raise WorkspaceError(f"writing {len(data)} bytes would grow the workspace past {self.max_bytes} bytes")
        os.makedirs(os.path.dirname(host), exist_ok=True)
        fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return len(data)

    def list(self, path: str = ".") -> list[str]:
        """Entries under `path`, recursively, sorted; folders end with '/', links show their target."""
        host = self.resolve(path)
        if not os.path.isdir(host):
            raise WorkspaceError(f"no folder {path!r} in the workspace")
        out = []
        for dirpath, dirnames, filenames in os.walk(host, followlinks=False):
            dirnames.sort()
            for name in dirnames + sorted(filenames):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, host)
                if os.path.islink(full):
                    out.append(f"{rel} -> {os.readlink(full)}")
                elif os.path.isdir(full):
                    out.append(rel + "/")
                else:
                    out.append(rel)
        return sorted(out)

    def size(self) -> int:
        total = 0
        for dirpath, _, filenames in os.walk(self.root, followlinks=False):
            for name in filenames:
                total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def files(self) -> dict[str, bytes]:
        """Every regular file, by relative path (links and empty folders are left out)."""
        out = {}
        for dirpath, _, filenames in os.walk(self.root, followlinks=False):
            for name in filenames:
                full = os.path.join(dirpath, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    with open(full, "rb") as f:
                        out[self.rel(full)] = f.read()
        return out

    def populate(self, files: Mapping[str, str | bytes]) -> None:
        """Write files (relative path -> content) into the workspace."""
        for path, content in files.items():
            self.write_text(path, content if isinstance(content, str) else content.decode())

    def snapshot(self) -> bytes:
        """The whole workspace as a gzip'd tar archive (links kept as links)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
            for name in sorted(os.listdir(self.root)):
                tar.add(os.path.join(self.root, name), arcname=name, recursive=True)
        return buf.getvalue()

    def restore(self, archive: bytes) -> list[str]:
        """Replace the workspace's contents with an archive's (a snapshot, or a sandboxed
        command's result). Entries the `data` filter refuses are dropped and returned as
        notes; the archive is unpacked beside the workspace first, so a damaged archive
        leaves the workspace as it was."""
        notes: list[str] = []

        def keep(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
            try:
                return tarfile.data_filter(member, dest)
            except tarfile.FilterError as e:
                notes.append(f"dropped {member.name!r}: {e}")
                return None

        parent = os.path.dirname(self.root)
        staging = tempfile.mkdtemp(prefix=".ws-new-", dir=parent)
        try:
            with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
                total = sum(m.size for m in tar.getmembers() if m.isfile())
                if total > self.max_bytes:
                    raise WorkspaceError(f"the workspace would hold {total} bytes, more than {self.max_bytes}")
                tar.extractall(staging, filter=keep)
            old = tempfile.mkdtemp(prefix=".ws-old-", dir=parent)
            os.rename(self.root, os.path.join(old, "ws"))
            os.rename(staging, self.root)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return notes

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------- sandboxed tools

# Runs inside the sandbox with `python -I -S` (stdlib only). Reads its spec as JSON from
# stdin, runs the command in the scratch folder with stdout and stderr merged (as a terminal
# shows them) and capped, kills the command's process group at the timeout, then prints one
# JSON object: the status, the output, and the scratch folder as a base64 tar archive.
_WORKSPACE_RUNNER = r"""
import base64, io, json, os, selectors, signal, subprocess, sys, tarfile, time
spec = json.loads(sys.stdin.buffer.read())
start = time.monotonic(); deadline = start + spec["timeout"]; cap = spec["max_output"]
proc = subprocess.Popen(spec["cmd"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        start_new_session=True)
try:
    proc.stdin.write(spec.get("stdin", "").encode()); proc.stdin.close()
except OSError:
    pass
sel = selectors.DefaultSelector(); sel.register(proc.stdout, selectors.EVENT_READ)
chunks, kept, dropped, timed_out, exited_at = [], 0, 0, False, None
while True:
    now = time.monotonic()
    if proc.poll() is not None and exited_at is None:
        exited_at = now
    if now >= deadline or (exited_at is not None and now - exited_at > 0.2):
        timed_out = proc.poll() is None
        break
    events = sel.select(timeout=min(0.05, max(deadline - now, 0.001)))
    if events:
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            break
        room = cap - kept
        chunks.append(data[:room]); kept += min(len(data), room); dropped += max(len(data) - room, 0)
try:
    os.killpg(proc.pid, signal.SIGKILL)
except OSError:
    pass
code = proc.wait()
code = code if code >= 0 else 128 - code
buf = io.BytesIO(); error = None
with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
    for name in sorted(os.listdir(".")):
        tar.add(name, recursive=True)
archive = buf.getvalue()
if len(archive) > spec["max_archive"]:
    error = "the workspace grew past %d bytes (packed); this command's changes are not kept" % spec["max_archive"]
    archive = b""
sys.stdout.write(json.dumps({"exit_code": code, "timed_out": timed_out, "dropped": dropped,
    "output": base64.b64encode(b"".join(chunks)).decode(), "duration_s": time.monotonic() - start,
    "workspace": base64.b64encode(archive).decode() if archive else None, "workspace_error": error}))
"""


async def run_in_workspace(
    sandbox: Sandbox, workspace: Workspace, cmd: Sequence[str], *, stdin: str = "", timeout_s: float,
    max_output_chars: int,
) -> ToolResult:  # fmt: skip
    """Run `cmd` in the sandbox on a copy of the workspace and bring its changes back."""
    if sandbox is None:
        raise RuntimeError("this tool runs code and needs a sandbox; build the tools with make_tools(sandbox=...)")
    max_archive = 2 * workspace.max_bytes
    spec = {"cmd": list(cmd), "stdin": stdin, "timeout": timeout_s, "max_output": 4 * max_output_chars + 1024,
            "max_archive": max_archive}  # fmt: skip
    result = await sandbox.run_async(
        ["python", "-I", "-S", "-c", _WORKSPACE_RUNNER], files=workspace.root, stdin=json.dumps(spec).encode()
    )
    try:
        report = json.loads(result.stdout)
        output = base64.b64decode(report["output"]).decode("utf-8", "replace")
    except (ValueError, KeyError, TypeError):
        why = result.killed_by or f"exit code {result.exit_code}"
        detail = result.stderr_text.strip()[-500:]
        error = f"the sandbox ended the command ({why}){': ' + detail if detail else ''}; the workspace is unchanged"
        return ToolResult(output=f"error: {error}", exit_code=result.exit_code, error=error)
    notes = []
    if report["dropped"]:
        notes.append(f"[... {report['dropped']} more bytes of output cut]")
    if report["timed_out"]:
        notes.append(f"[timed out after {timeout_s:g} s; the command was killed]")
    if report["exit_code"]:
        notes.append(f"[exit code {report['exit_code']}]")
    error = "timeout" if report["timed_out"] else None
    if report["workspace"] is not None:
        try:
            dropped = workspace.restore(base64.b64decode(report["workspace"]))
        except (WorkspaceError, tarfile.TarError, OSError) as e:
            dropped = [f"the workspace changes were not kept: {e}"]
        notes += [f"[{d}]" for d in dropped]
    elif report["workspace_error"]:
        notes.append(f"[{report['workspace_error']}]")
        error = report["workspace_error"]
    text = cap_text(output, max_output_chars)
    if notes:
        text = (text + "\n" if text and not text.endswith("\n") else text) + "\n".join(notes)
    return ToolResult(output=text, exit_code=report["exit_code"], error=error)


class PythonTool(Tool):
    name = "python"
    caps_own_output = True
    description = (
        "Run a Python 3 program in a sandbox (no network) whose working folder holds the workspace files. "
        "Returns what it prints (stdout and stderr). State does not carry over between calls, files do."
    )
    parameters = _object({"code": {"type": "string", "description": "The program.", "maxLength": 100_000}}, ["code"])

    async def run(self, args, context):
        return await run_in_workspace(
            context.sandbox, context.workspace, ["python", "-"], stdin=args["code"], timeout_s=context.timeout_s,
            max_output_chars=context.max_output_chars,
        )  # fmt: skip


class BashTool(Tool):
    name = "bash"
    caps_own_output = True
    description = (
        "Run a bash command in a sandbox (no network) whose working folder is the repository. "
        "Returns its output (stdout and stderr) and exit code. Files persist between calls; processes do not."
    )
    parameters = _object(
        {"command": {"type": "string", "description": "The command line.", "maxLength": 100_000}}, ["command"]
    )

    async def run(self, args, context):
        return await run_in_workspace(
            context.sandbox, context.workspace, ["bash", "-c", args["command"]], timeout_s=context.timeout_s,
            max_output_chars=context.max_output_chars,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------- calculator


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


_MAX_EXPRESSION = 500
_MAX_INT_BITS = 4096
_MAX_DIGITS = math.ceil(_MAX_INT_BITS * math.log10(2))  # decimal digits of the largest int
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor, "ceil": math.ceil,
    "log": math.log, "log10": math.log10, "log2": math.log2, "exp": math.exp, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "factorial": math.factorial, "gcd": math.gcd,
}  # fmt: skip
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _bits(x: int | float) -> int:
    return abs(int(x)).bit_length() if isinstance(x, int) else 0


def _check_size(x: int | float) -> int | float:
    if isinstance(x, int) and x.bit_length() > _MAX_INT_BITS:
        raise CalculatorError(f"the result has more than {_MAX_INT_BITS} bits")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    return x


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if isinstance(a, int) and isinstance(b, int) and b > 0 and _bits(a) * b > _MAX_INT_BITS and abs(a) > 1:
                raise CalculatorError(f"the result has more than {_MAX_INT_BITS} bits")
            if isinstance(b, int | float) and abs(b) > 10_000:
                raise CalculatorError("exponents above 10000 are refused")
        if isinstance(node.op, ast.Mult) and _bits(a) + _bits(b) > _MAX_INT_BITS + 1:
            raise CalculatorError(f"the result has more than {_MAX_INT_BITS} bits")
        try:
            value = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        return _check_size(value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise CalculatorError(f"{node.func.id}() takes no keyword arguments")
        args = [_evaluate(a) for a in node.args]
        if node.func.id == "factorial" and (not args or not isinstance(args[0], int) or args[0] > 500):
            raise CalculatorError("factorial takes one integer up to 500")
        if node.func.id == "round" and len(args) == 2 and all(type(a) is int for a in args):
            # round(7, -10**8) builds 10**(10**8) first, past 20 s on the event loop. Every int
            # here is below 10**_MAX_DIGITS, so rounding it to a coarser place than that gives 0,
            # exactly what the huge place would give.
            args[1] = max(args[1], -_MAX_DIGITS - 1)
        try:
            return _check_size(_FUNCTIONS[node.func.id](*args))
        except (ValueError, TypeError, OverflowError) as e:
            raise CalculatorError(f"{node.func.id}(): {e}") from None
    allowed = "numbers, + - * / // % **, parentheses, " + ", ".join(sorted(_FUNCTIONS)) + ", pi, e"
    what = node.id if isinstance(node, ast.Name) else type(node).__name__
    raise CalculatorError(f"{what!r} is not allowed; the calculator takes {allowed}")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (ints stay exact); CalculatorError when it is
    not arithmetic, too long, or its numbers grow past 4096 bits."""
    if len(expression) > _MAX_EXPRESSION:
        raise CalculatorError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg}") from None
    return _evaluate(tree)


def format_number(x: int | float) -> str:
    """An int as is; a float without a trailing .0 when it is a whole number, else to 12 significant digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"


class CalculatorTool(Tool):
    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses, and the functions "
        "sqrt, abs, round, min, max, floor, ceil, log, log10, log2, exp, sin, cos, tan, factorial, gcd; pi, e."
    )
    parameters = _object(
        {"expression": {"type": "string", "description": "For example (17 + 5) * 3.", "maxLength": _MAX_EXPRESSION}},
        ["expression"],
    )

    async def run(self, args, context):
        try:
            return ToolResult(output=format_number(calculate(args["expression"])))
        except CalculatorError as e:
            return ToolResult(output=f"error: {e}", error=str(e))


# ---------------------------------------------------------------------------------------- files


class ReadFileTool(Tool):
    name = "read_file"
    description = "Read a text file of the workspace."
    parameters = _object({"path": {"type": "string", "description": "Path relative to the workspace."}}, ["path"])

    async def run(self, args, context):
        try:
            return ToolResult(output=context.workspace.read_text(args["path"]))
        except WorkspaceError as e:
            return ToolResult(output=f"error: {e}", error=str(e))


class WriteFileTool(Tool):
    name = "write_file"
    description = "Write (create or replace) a text file of the workspace."
    parameters = _object(
        {
            "path": {"type": "string", "description": "Path relative to the workspace."},
            "content": {"type": "string", "description": "The whole new content."},
        },
        ["path", "content"],
    )

    async def run(self, args, context):
        try:
            n = context.workspace.write_text(args["path"], args["content"])
            return ToolResult(output=f"wrote {n} bytes to {args['path']}")
        except WorkspaceError as e:
            return ToolResult(output=f"error: {e}", error=str(e))


class ListFilesTool(Tool):
    name = "list_files"
    description = "List the files of a workspace folder, recursively."
    parameters = _object(
        {"path": {"type": "string", "description": "Folder relative to the workspace.", "default": "."}}, []
    )

    async def run(self, args, context):
        try:
            entries = context.workspace.list(args["path"])
            return ToolResult(output="\n".join(entries) if entries else "(empty)")
        except WorkspaceError as e:
            return ToolResult(output=f"error: {e}", error=str(e))


# ---------------------------------------------------------------------------------------- search

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words (the search index's terms)."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str
    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Structured facts the text states (what generated questions are asked about)."""


class Corpus:
    """Documents with a BM25 index (Robertson and Zaragoza, "The Probabilistic Relevance
    Framework: BM25 and Beyond", 2009): score(d, q) = sum over query terms t of
    idf(t) * f(t, d) (k1 + 1) / (f(t, d) + k1 (1 - b + b |d| / avgdl)),
    idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))."""

    def __init__(self, documents: Sequence[Document], k1: float = 1.5, b: float = 0.75):
        if not documents:
            raise ValueError("a search corpus needs at least one document")
        self.documents = tuple(documents)
        self.k1, self.b = k1, b
        self._tf = [Counter(words(d.title + " " + d.text)) for d in self.documents]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / len(self._len)
        df = Counter(t for tf in self._tf for t in tf)
        n = len(self.documents)
        self._idf = {t: math.log(1 + (n - k + 0.5) / (k + 0.5)) for t, k in df.items()}

    @classmethod
    def load(cls, path: str | None = None) -> Corpus:
        """A JSONL corpus ({"id", "title", "text", "facts"} per line); None: the bundled one."""
        if path is None:
            return bundled_corpus()
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"search corpus {path!r} does not exist; pass a JSONL file or null for the bundled one"
            )
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ValueError(f"{path}:{line}: not UTF-8 text ({e}); write the corpus as UTF-8 JSONL") from None
        docs = _parse_corpus(text, path)
        if not docs:
            raise ValueError(f"search corpus {path!r} has no rows; write one JSON object per line, or pass null")
        return cls(docs)

    def search(self, query: str, k: int = 3) -> list[tuple[float, Document]]:
        """The k best-scoring documents (score > 0), best first; ties keep corpus order."""
        terms = [t for t in words(query) if t in self._idf]
        scored = []
        for i, tf in enumerate(self._tf):
            s = 0.0
            norm = self.k1 * (1 - self.b + self.b * self._len[i] / self._avg)
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    s += self._idf[t] * f * (self.k1 + 1) / (f + norm)
            if s > 0:
                scored.append((-s, i))
        scored.sort()
        return [(-s, self.documents[i]) for s, i in scored[:k]]


def _parse_corpus(text: str, where: str) -> list[Document]:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            docs.append(Document(str(row["id"]), row["title"], row["text"], row.get("facts", {})))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}:{n}: not a corpus row with id, title and text ({e})") from None
        doc = docs[-1]
        if not isinstance(doc.title, str) or not isinstance(doc.text, str) or not isinstance(doc.facts, Mapping):
            raise ValueError(
                f"{where}:{n}: title and text must be strings and facts an object, got title {doc.title!r}, "
                f"text {doc.text!r:.60}, facts {doc.facts!r:.60}"
            )
    return docs


@cache
def bundled_corpus() -> Corpus:
    """The corpus shipped in ptrain/envs/data/corpus.jsonl (fictional places, people and things,
    so that answers come from the corpus, not from what a model already knows)."""
    text = resources.files("ptrain.envs").joinpath("data/corpus.jsonl").read_text(encoding="utf-8")
    return Corpus(_parse_corpus(text, "ptrain/envs/data/corpus.jsonl"))


def snippet(text: str, query: str, width: int = 240) -> str:
    """The sentence of text sharing most words with the query, and what follows it, to `width` characters."""
    sentences = re.split(r"(?<=[.!?])\s+", text)
    q = set(words(query))
    best = max(range(len(sentences)), key=lambda i: (len(q & set(words(sentences[i]))), -i))
    out = " ".join(sentences[best:])
    return out if len(out) <= width else out[: width - 3].rstrip() + "..."


class SearchTool(Tool):
    name = "search"
    description = "Search the reference corpus; returns the best-matching documents' titles and snippets."
    parameters = _object(
        {
            "query": {"type": "string", "description": "Keywords.", "maxLength": 500},
            "k": {"type": "integer", "description": "How many results.", "minimum": 1, "maximum": 5, "default": 3},
        },
        ["query"],
    )

    def __init__(self, corpus: Corpus | None = None):
        self.corpus = corpus or bundled_corpus()

    async def run(self, args, context):
        hits = self.corpus.search(args["query"], args["k"])
        if not hits:
            return ToolResult(output="no results")
        return ToolResult(
            output="\n".join(f"{i}. {d.title}: {snippet(d.text, args['query'])}" for i, (_, d) in enumerate(hits, 1))
        )


# ---------------------------------------------------------------------------------------- building


def make_tools(
    names: Sequence[str], *, sandbox: Sandbox | None = None, corpus: Corpus | None = None
) -> dict[str, Tool]:
    """The named tools (in order). Sandboxed tools (python, bash) need `sandbox`."""
    unknown = [n for n in names if n not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; the tools are {', '.join(TOOL_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"tools {list(names)} name one tool twice")
    needs = [n for n in names if n in SANDBOXED_TOOLS]
    if needs and sandbox is None:
        raise ValueError(f"tools {needs} run code and need a sandbox (pass sandbox=Sandbox(SandboxConfig(...)))")
    build = {
        "python": PythonTool,
        "bash": BashTool,
        "calculator": CalculatorTool,
        "read_file": ReadFileTool,
        "write_file": WriteFileTool,
        "list_files": ListFilesTool,
        "search": lambda: SearchTool(corpus),
    }
    return {n: build[n]() for n in names}


def tool_sandbox(
    cfg: SandboxConfig | None, *, timeout_s: float, workspace_bytes: int, max_output_chars: int
) -> Sandbox:
    """A Sandbox for tool calls: `cfg` with room for the runner's report (the output and the
    packed workspace, base64) and a wall limit past the command's own, so that a command that
    times out still reports its output and keeps its files. SandboxUnavailableError, with
    what to install, when nothing isolates here."""
    cfg = cfg or SandboxConfig()
    report_bytes = 4 * max_output_chars + 3 * workspace_bytes + (1 << 16)
    return Sandbox(
        dataclasses.replace(
            cfg,
            timeout_s=max(cfg.timeout_s, timeout_s + SANDBOX_MARGIN_S),
            max_output_bytes=max(cfg.max_output_bytes, report_bytes),
            scratch_mb=max(cfg.scratch_mb, 2 * (workspace_bytes >> 20) + 16),
        )
    )


async def call_tool(tool: Tool, arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
    """`tool.call`, with any failure but bad arguments turned into an error result."""
    try:
        return await tool.call(arguments, context)
    except ToolArgumentError:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken tool is the policy's observation, not a crashed run
        return ToolResult(output=f"error: the tool failed: {type(e).__name__}: {e}", error=f"{type(e).__name__}: {e}")


__all__ = [
    "SANDBOXED_TOOLS",
    "TOOL_NAMES",
    "CalculatorError",
    "Corpus",
    "Document",
    "Tool",
    "ToolArgumentError",
    "ToolContext",
    "ToolResult",
    "Workspace",
    "WorkspaceError",
    "calculate",
    "call_tool",
    "check_arguments",
    "make_tools",
    "run_in_workspace",
]
