"""Tools of the multi-turn environments: argument checks, the calculator's refusals, the
workspace's confinement (.., absolute paths, symlinks in and out of the sandbox), sandboxed
commands whose files persist between calls, and BM25 search over the bundled corpus."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import time

import pytest

from ptrain.config.sandbox import SandboxConfig
from ptrain.envs.tools import (
    TOOL_NAMES,
    CalculatorError,
    Corpus,
    Document,
    ToolArgumentError,
    ToolContext,
    Workspace,
    WorkspaceError,
    bundled_corpus,
    calculate,
    check_arguments,
    make_tools,
    tool_sandbox,
)
from ptrain.sandbox import Sandbox, SandboxUnavailableError


def _sandbox_or_skip() -> Sandbox:
    try:
        return tool_sandbox(SandboxConfig(timeout_s=5), timeout_s=3.0, workspace_bytes=1 << 20, max_output_chars=500)
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox backend isolates here: {e}")


@pytest.fixture(scope="module")
def sandbox():
    return _sandbox_or_skip()


@pytest.fixture
def workspace(tmp_path):
    return Workspace(str(tmp_path / "ws"), max_bytes=1 << 20)


def run(coro):
    return asyncio.run(coro)


def call(tool, args, ws, sandbox=None, **kw):
    return run(tool.call(args, ToolContext(ws, sandbox, **kw)))


# ---------------------------------------------------------------------------------------- schemas


def test_every_tool_declares_an_openai_function_schema(sandbox):
    tools = make_tools(TOOL_NAMES, sandbox=sandbox)
    assert list(tools) == list(TOOL_NAMES)
    for name, tool in tools.items():
        s = tool.schema()
        assert s["type"] == "function" and s["function"]["name"] == name
        assert s["function"]["description"]
        params = s["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        json.dumps(s)  # what the chat template's `tools=` receives


def test_make_tools_refuses_unknown_tools_and_sandboxed_tools_without_a_sandbox():
    with pytest.raises(ValueError, match="unknown tool"):
        make_tools(["calculator", "web"])
    with pytest.raises(ValueError, match="need a sandbox"):
        make_tools(["bash"])
    with pytest.raises(ValueError, match="twice"):
        make_tools(["search", "search"])


def test_arguments_are_checked_against_the_schema():
    params = make_tools(["search"])["search"].parameters
    assert check_arguments("search", params, {"query": "eel"}) == {"query": "eel", "k": 3}
    assert check_arguments("search", params, {"query": "eel", "k": 2.0}) == {"query": "eel", "k": 2}
    for bad, match in [
        ({}, "missing required"),
        ({"query": "x", "limit": 3}, "unknown argument"),
        ({"query": 5}, "must be a string"),
        ({"query": "x", "k": True}, "must be a integer"),
        ({"query": "x", "k": 9}, r"in \[1, 5\]"),
        ({"query": "x" * 501}, "more than 500"),
        (["x"], "JSON object"),
    ]:
        with pytest.raises(ToolArgumentError, match=match):
            check_arguments("search", params, bad)


# ---------------------------------------------------------------------------------------- calculator


def test_calculator_is_exact_on_integers_and_handles_functions():
    assert calculate("4817 * 293 - 77 * 61") == 4817 * 293 - 77 * 61
    assert calculate("2 ** 100") == 2**100
    assert calculate("2^10") == 1024
    assert calculate("sqrt(16) + abs(-3) + max(1, 7)") == 14.0
    assert calculate("(1 + 2) * -3 // 2 % 5") == ((1 + 2) * -3 // 2) % 5
    assert calculate("10 / 4") == 2.5


@pytest.mark.parametrize(
    "expr, match",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('/etc/passwd').read()", "not allowed"),
        ("(lambda: 1)()", "not allowed"),
        ("[1, 2]", "not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("'a' * 3", "not allowed"),
        ("9 ** 9 ** 9", "bits"),
        ("2 ** 5000", "bits"),
        ("factorial(10000)", "factorial"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "finite"),
        ("sqrt(-1)", "sqrt"),
        ("1 +", "cannot parse"),
        ("1" * 600, "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr, match):
    with pytest.raises(CalculatorError, match=match):
        calculate(expr)


def test_calculator_rounds_to_a_huge_place_at_once():
    """round(7, -10**8) built 10**(10**8) first: past 20 s on the event loop that runs every
    episode. The answer is 0 for any place coarser than the largest int the calculator holds."""
    start = time.monotonic()
    assert calculate("round(7, -100000000)") == 0
    assert calculate("round(-2 ** 2000, -10 ** 9)") == 0
    assert time.monotonic() - start < 1.0
    assert calculate("round(123456, -2)") == 123500 and calculate("round(7, 10 ** 9)") == 7


def test_calculator_tool_answers_errors_as_observations(workspace):
    tool = make_tools(["calculator"])["calculator"]
    ok = call(tool, {"expression": "6 * 7"}, workspace)
    assert ok.output == "42" and ok.error is None and ok.duration_s >= 0
    bad = call(tool, {"expression": "1/0"}, workspace)
    assert bad.output == "error: division by zero" and bad.error == "division by zero"


# ---------------------------------------------------------------------------------------- files


def test_files_read_write_list_inside_the_workspace(workspace):
    tools = make_tools(["read_file", "write_file", "list_files"])
    assert call(tools["write_file"], {"path": "notes/a.txt", "content": "hello"}, workspace).output.startswith(
        "wrote 5"
    )
    assert call(tools["read_file"], {"path": "notes/a.txt"}, workspace).output == "hello"
    assert call(tools["read_file"], {"path": "./notes//a.txt"}, workspace).output == "hello"
    assert call(tools["list_files"], {}, workspace).output == "notes/\nnotes/a.txt"
    missing = call(tools["read_file"], {"path": "nope.txt"}, workspace)
    assert missing.error and "no file" in missing.output


@pytest.mark.parametrize("path", ["../outside.txt", "notes/../../outside.txt", "/etc/passwd", "a/../../x"])
def test_paths_cannot_leave_the_workspace(workspace, tmp_path, path):
    tools = make_tools(["read_file", "write_file", "list_files"])
    (tmp_path / "outside.txt").write_text("secret")
    for name, args in [("read_file", {"path": path}), ("write_file", {"path": path, "content": "x"}),
                       ("list_files", {"path": path})]:  # fmt: skip
        result = call(tools[name], args, workspace)
        assert result.error is not None and result.output.startswith("error:")
        assert "secret" not in result.output
    assert (tmp_path / "outside.txt").read_text() == "secret"


def test_symlinks_are_never_followed(workspace, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s3cr3t-content")
    os.symlink(str(outside / "secret.txt"), os.path.join(workspace.root, "file_link"))
    os.symlink(str(outside), os.path.join(workspace.root, "dir_link"))
    os.symlink("inside.txt", os.path.join(workspace.root, "relative_link"))
    workspace.write_text("inside.txt", "ok")
    tools = make_tools(["read_file", "write_file", "list_files"])
    for args in [{"path": "file_link"}, {"path": "dir_link/secret.txt"}, {"path": "relative_link"}]:
        result = call(tools["read_file"], args, workspace)
        assert "link" in result.output and "s3cr3t" not in result.output
    for path in ["file_link", "dir_link/new.txt"]:
        result = call(tools["write_file"], {"path": path, "content": "pwned"}, workspace)
        assert "link" in result.output
    assert (outside / "secret.txt").read_text() == "s3cr3t-content" and not (outside / "new.txt").exists()
    listing = call(tools["list_files"], {}, workspace).output
    assert "dir_link -> " in listing and not any(line.startswith("dir_link/") for line in listing.splitlines())
    assert "link" in call(tools["list_files"], {"path": "dir_link"}, workspace).output


def test_workspace_size_is_capped(tmp_path):
    ws = Workspace(str(tmp_path / "ws"), max_bytes=100)
    ws.write_text("a.txt", "x" * 60)
    with pytest.raises(WorkspaceError, match="past 100 bytes"):
        ws.write_text("b.txt", "x" * 60)


def test_snapshot_and_restore_round_trip_and_drop_escaping_entries(workspace, tmp_path):
    workspace.write_text("a/b.txt", "one")
    os.symlink("b.txt", os.path.join(workspace.root, "a", "link"))
    snap = workspace.snapshot()
    workspace.write_text("a/b.txt", "two")
    workspace.write_text("c.txt", "new")
    assert workspace.restore(snap) == []
    assert workspace.files() == {"a/b.txt": b"one"} and os.readlink(os.path.join(workspace.root, "a/link")) == "b.txt"
    # An archive with entries outside the workspace: those are dropped, the rest kept.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind in [("ok.txt", tarfile.REGTYPE), ("../evil.txt", tarfile.REGTYPE), ("/abs.txt", tarfile.REGTYPE),
                           ("abs_link", tarfile.SYMTYPE), ("up_link", tarfile.SYMTYPE), ("dev", tarfile.CHRTYPE)]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = {"abs_link": "/etc/passwd", "up_link": "../../x"}.get(name, "")
            data = b"data" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    notes = workspace.restore(buf.getvalue())
    assert len(notes) == 4 and all(n.startswith("dropped") for n in notes)
    assert workspace.files() == {"ok.txt": b"data", "abs.txt": b"data"}  # the filter strips a leading '/'
    assert not (tmp_path / "evil.txt").exists() and not os.path.exists("/abs.txt")


# ---------------------------------------------------------------------------------------- sandboxed tools


def test_bash_and_python_see_and_change_the_workspace(sandbox, workspace):
    tools = make_tools(["bash", "python", "read_file"], sandbox=sandbox)
    workspace.write_text("data.txt", "3\n4\n")
    r = call(tools["bash"], {"command": "cat data.txt; echo 5 >> data.txt; mkdir -p out && echo hi > out/x"},
             workspace, sandbox)  # fmt: skip
    assert r.output == "3\n4\n" and r.exit_code == 0 and r.error is None
    assert workspace.read_text("data.txt") == "3\n4\n5\n" and workspace.read_text("out/x") == "hi\n"
    r = call(tools["python"], {"code": "print(sum(int(x) for x in open('data.txt')))\nopen('sum.txt','w').write('12')"},
             workspace, sandbox)  # fmt: skip
    assert r.output == "12\n" and workspace.read_text("sum.txt") == "12"
    r = call(tools["python"], {"code": "import sys\nprint('to stderr', file=sys.stderr)\nraise SystemExit(3)"},
             workspace, sandbox)  # fmt: skip
    assert "to stderr" in r.output and "[exit code 3]" in r.output and r.exit_code == 3
    # The host's files are not visible: the sandbox shows only the workspace copy.
    host_parent = os.path.dirname(workspace.root)
    r = call(tools["bash"], {"command": f"test -e {host_parent} && echo visible || echo hidden"}, workspace, sandbox)
    assert r.output == "hidden\n"


def test_a_link_made_in_the_sandbox_that_points_out_never_reaches_the_host(sandbox, workspace):
    tools = make_tools(["bash", "read_file"], sandbox=sandbox)
    r = call(tools["bash"], {"command": "ln -s /etc/passwd passwd; ln -s ../.. up; ln -s data.txt ok; echo x > data.txt"},
             workspace, sandbox)  # fmt: skip
    assert "dropped 'passwd'" in r.output and "dropped 'up'" in r.output
    assert sorted(os.listdir(workspace.root)) == ["data.txt", "ok"]
    assert os.readlink(os.path.join(workspace.root, "ok")) == "data.txt"


def test_output_is_capped_and_a_timeout_keeps_the_files_written_before_it(sandbox, workspace):
    tools = make_tools(["bash"], sandbox=sandbox)
    r = call(tools["bash"], {"command": "yes line | head -c 20000"}, workspace, sandbox, max_output_chars=500)
    assert len(r.output) < 700 and "cut]" in r.output.splitlines()[-1]
    r = call(tools["bash"], {"command": "echo before > kept.txt; echo started; sleep 30"}, workspace, sandbox,
             timeout_s=1.0)  # fmt: skip
    assert r.error == "timeout" and "started" in r.output and "timed out after 1 s" in r.output
    assert r.duration_s < 10 and workspace.read_text("kept.txt") == "before\n"


def test_sandboxed_calls_run_concurrently(sandbox, tmp_path):
    tools = make_tools(["bash"], sandbox=sandbox)
    spaces = [Workspace(str(tmp_path / f"w{i}")) for i in range(3)]

    async def main():
        import time

        start = time.monotonic()
        results = await asyncio.gather(
            *(
                tools["bash"].call({"command": f"sleep 1; echo {i} > n"}, ToolContext(w, sandbox))
                for i, w in enumerate(spaces)
            )
        )
        return time.monotonic() - start, results

    wall, results = run(main())
    assert all(r.exit_code == 0 for r in results)
    assert [w.read_text("n") for w in spaces] == ["0\n", "1\n", "2\n"]
    assert wall < 2.5  # three 1 s sleeps overlapped


def test_a_broken_runner_report_leaves_the_workspace_unchanged(sandbox, workspace):
    """Code that writes garbage where the runner reports (its parent's stdout) gets an error, not a crash."""
    tools = make_tools(["python"], sandbox=sandbox)
    workspace.write_text("a.txt", "original")
    code = "import os\nopen('a.txt','w').write('changed')\nos.write(os.open('/proc/%d/fd/1' % os.getppid(), os.O_WRONLY), b'junk')"
    r = call(tools["python"], {"code": code}, workspace, sandbox)
    if r.error is not None:  # the report was spoiled: nothing was taken from it
        assert "unchanged" in r.error and workspace.read_text("a.txt") == "original"
    else:  # the write did not reach the report
        assert workspace.read_text("a.txt") == "changed"


# ---------------------------------------------------------------------------------------- search


def test_bundled_corpus_states_every_fact_it_lists():
    corpus = bundled_corpus()
    assert len(corpus.documents) >= 50
    assert len({d.id for d in corpus.documents}) == len(corpus.documents)
    for d in corpus.documents:
        assert d.facts
        for value in d.facts.values():
            assert str(value) in d.text, (d.id, value)


def test_bm25_ranks_the_document_that_names_the_query_first(workspace):
    corpus = bundled_corpus()
    for d in corpus.documents[::7]:
        (score, best), *_ = corpus.search(d.title, k=3)
        assert best.id == d.id and score > 0
    tool = make_tools(["search"])["search"]
    doc = corpus.documents[0]
    out = call(tool, {"query": f"{doc.title} founded", "k": 2}, workspace).output
    assert out.startswith(f"1. {doc.title}: ") and out.count("\n") <= 1
    assert call(tool, {"query": "zzzz qqqq"}, workspace).output == "no results"


def test_bm25_scores_by_the_formula():
    docs = [Document("a", "A", "cat cat dog"), Document("b", "B", "dog fish"), Document("c", "C", "bird")]
    corpus = Corpus(docs, k1=1.2, b=0.75)
    import math

    n, avg = 3, (4 + 3 + 2) / 3  # the title counts as a word
    idf = math.log(1 + (n - 1 + 0.5) / (1 + 0.5))
    f, dl = 2, 4
    want = idf * f * 2.2 / (f + 1.2 * (1 - 0.75 + 0.75 * dl / avg))
    ((score, best),) = corpus.search("cat", k=5)
    assert best.id == "a" and score == pytest.approx(want)


def test_a_corpus_file_with_a_bad_row_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": 1, "title": "t", "text": "x"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2"):
        Corpus.load(str(path))
    with pytest.raises(FileNotFoundError, match="null for the bundled"):
        Corpus.load(str(tmp_path / "missing.jsonl"))
    # A null title was a TypeError from the index; an empty file did not name itself.
    path.write_text(json.dumps({"id": 1, "title": "t", "text": "x"}) + "\n" + json.dumps({"id": 2, "title": None,
                    "text": "y"}) + "\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"c.jsonl:2: title and text must be strings and facts an object"):
        Corpus.load(str(path))
    path.write_text(json.dumps({"id": 1, "title": "t", "text": "x", "facts": ["population"]}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: .*facts \['population'\]"):
        Corpus.load(str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"search corpus '.*c.jsonl' has no rows"):
        Corpus.load(str(path))
    path.write_bytes(json.dumps({"id": 1, "title": "t", "text": "x"}).encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2: not UTF-8 text"):
        Corpus.load(str(path))
