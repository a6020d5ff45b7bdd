"""What every backend shares: the result type, errors, output capping, the diff, clean-up."""

from __future__ import annotations

import atexit
import os
import posixpath
import re
import threading
import time
from dataclasses import dataclass

# Paths that never belong in a rollout's patch: the environment's interpreter link,
# the hidden tests and their runner (grading drops them anyway), caches pytest and
# python leave behind (binary, and `git apply` rejects binary hunks without --binary).
DIFF_EXCLUDES = (".venv", "r2e_tests", "run_tests.sh", ".pytest_cache", "**/__pycache__/**", "**/*.pyc")

# R2E-Gym's PATH inside its images (runtime/docker.py): the repo's venv comes first.
R2E_PATH = ("/root/.venv/bin:/root/.local/bin:/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:"
            "/usr/sbin:/usr/bin:/sbin:/bin")
# Our base image has no /root/.venv for uid 1000; the repo's venv plays that part.
LOCAL_PATH = "/testbed/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(RuntimeError):
    """A sandbox operation failed for a reason that is not the agent's code."""


class SandboxInfraError(SandboxError):
    """Infrastructure failed (engine, start-up, set-up): retry, and never count it as reward 0."""


@dataclass
class CommandResult:
    exit_code: int | None  # None when the command was killed by the wall clock
    output: str  # stdout and stderr interleaved, capped (head + tail kept)
    timed_out: bool
    seconds: float
    truncated: bool = False
    output_bytes: int = 0  # bytes the command produced, before capping

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class OutputCap:
    """Keeps the first and last bytes of a stream, so memory stays bounded however much is printed.

    The tail matters as much as the head: pytest's short test summary comes last.
    """

    def __init__(self, cap: int):
        self.cap = max(cap, 64)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.cap:  # trim in batches, not on every chunk
                del self.tail[: len(self.tail) - self.cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def value(self) -> bytes:
        if not self.truncated:
            return bytes(self.head)
        keep_tail = self.cap // 2
        head = bytes(self.head[: self.cap - keep_tail])
        tail = bytes((self.head[self.cap - keep_tail:] + self.tail)[-keep_tail:])
        omitted = self.total - len(head) - len(tail)
        return head + f"\n[... {omitted} bytes omitted ...]\n".encode() + tail


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def check_path(path: str) -> str:
    """Paths travel as argv entries, never through a shell, so any name is safe; relative ones
    are relative to the command's working directory (/testbed). Only NUL cannot be passed."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"unsupported sandbox path {path!r}")
    return path


def abs_workdir(workdir: str) -> str:
    return posixpath.join("/testbed", check_path(workdir))


class BaseSandbox:
    """The protocol every backend implements (see tasks/sandbox/__init__.py)."""

    id: str
    mode: str

    # -- to implement -------------------------------------------------------------------
    def run(self, cmd: str, timeout: float | None = None, *, workdir: str = "/testbed",
            output_cap: int | None = None, env: dict[str, str] | None = None,
            stdin: str | bytes | None = None) -> CommandResult:
        """`/bin/sh -c cmd` in the sandbox (default timeout: cfg.command_timeout_s; output cap:
        cfg.output_cap_bytes; stdin: bytes fed to the command, else /dev/null)."""
        raise NotImplementedError

    def read_file(self, path: str) -> str:
        raise NotImplementedError

    def write_file(self, path: str, content: str | bytes) -> None:
        raise NotImplementedError

    def copy_tree_in(self, src: str | os.PathLike, dest: str) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def diff(self) -> str:
        """The rollout's final patch: every change under /testbed, new files included.

        `git add -A && git diff --cached` as R2E-Gym's get_patch, minus DIFF_EXCLUDES, and
        `--binary` so that a binary change still applies at grading time.
        """
        spec = " ".join(f"':(exclude,glob){p}'" if "*" in p else f"':(exclude){p}'" for p in DIFF_EXCLUDES)
        # Exclusions go to `diff` only: `git add` fails when an excluded path is also git-ignored.
        r = self.run(f"git add -A && git -c core.quotepath=false diff --cached --binary -- . {spec}",
                     timeout=60, output_cap=64 * 1024 * 1024)
        if not r.ok:
            raise SandboxError(f"git diff failed in /testbed (exit {r.exit_code}): {r.output[-2000:]}")
        return r.output

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            self._close()
        finally:
            _unregister(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# Every open sandbox, so an interrupted process (Ctrl-C, exception, normal exit) still
# removes its containers, cgroups and temp dirs. A SIGKILLed process cannot: reap_stale()
# cleans those up by owner pid.
_OPEN: dict[str, BaseSandbox] = {}
_OPEN_LOCK = threading.Lock()


def register(sb: BaseSandbox) -> None:
    with _OPEN_LOCK:
        _OPEN[sb.id] = sb


def _unregister(sb: BaseSandbox) -> None:
    with _OPEN_LOCK:
        _OPEN.pop(sb.id, None)


def close_all() -> None:
    """Close every sandbox this process still has open (also from another thread: it kills their commands)."""
    with _OPEN_LOCK:
        boxes = list(_OPEN.values())
    for sb in boxes:
        sb._discard = True  # an interrupted sandbox is never handed to a warm pool
        try:
            sb.close()
        except Exception:
            pass


atexit.register(close_all)


# CPU seconds used inside sandboxes this process closed (cgroup accounting, read at close):
# what a grading really costs, whatever else runs on the machine. See sandbox_cpu_seconds().
_CPU = [0.0]
_CPU_LOCK = threading.Lock()


def add_cpu_seconds(s: float) -> None:
    with _CPU_LOCK:
        _CPU[0] += s


def sandbox_cpu_seconds() -> float:
    with _CPU_LOCK:
        return _CPU[0]


def new_id() -> str:
    # The owner pid in the name lets reap_stale() tell a dead process's leftovers from live ones.
    return f"rlvr-{os.getpid()}-{os.urandom(4).hex()}"


def owner_pid(name: str) -> int | None:
    m = re.match(r"^rlvr-(\d+)-[0-9a-f]+$", name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def monotonic() -> float:
    return time.monotonic()
