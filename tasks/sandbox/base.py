"""What every backend shares: the result type, errors, output capping, the diff, clean-up."""

from __future__ import annotations

import atexit
import ctypes
import errno
import io
import os
import pathlib
import posixpath
import re
import shutil
import tarfile
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

# The task's own .git as it came in the environment, read-only to the agent (archive tasks):
# diff() reads HEAD, config and objects from there, never from the agent's /testbed/.git.
PRISTINE_GIT = "/run/rlvr-git"
# The rootfs's git (read-only / root-owned), never a PATH lookup: /testbed/.venv/bin comes first
# there. No system/global config; no fsmonitor, hooks, untracked cache, external diff or textconv.
TRUSTED_GIT = ("/usr/bin/git -c core.fsmonitor=false -c core.hooksPath=/dev/null -c core.untrackedCache=false "
               "-c core.quotepath=false")
DIFF_CAP_BYTES = 64 * 1024 * 1024
TRUSTED_GIT_ENV = {"GIT_DIR": PRISTINE_GIT, "GIT_WORK_TREE": "/testbed", "GIT_CONFIG_NOSYSTEM": "1",
                   "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ALTERNATE_OBJECT_DIRECTORIES": f"{PRISTINE_GIT}/objects",
                   "GIT_OPTIONAL_LOCKS": "0"}  # a read writes nothing it can skip: a full disk does not stop it


class SandboxError(RuntimeError):
    """A sandbox operation failed for a reason that is not the agent's code."""


class SandboxInfraError(SandboxError):
    """Infrastructure failed (engine, start-up, set-up): retry, and never count it as reward 0."""


class FileTooLargeError(OSError):
    """read_file refused a file over the read cap: it is never returned cut short."""

    def __init__(self, path: str, size: int, cap: int):
        super().__init__(errno.EFBIG, f"{path} is {size} bytes, over the {cap}-byte limit for reading a file whole")
        self.path, self.size, self.cap = path, size, cap


# Linux's MAX_ARG_STRLEN: exec refuses (E2BIG) an argument this long or longer, NUL included.
MAX_ARG_BYTES = 128 * 1024


def check_argv(argv: list[str]) -> None:
    """An argv the kernel would refuse to exec is the caller's error (SandboxError), not the engine's."""
    for a in argv:
        n = len(a.encode("utf-8", "surrogateescape"))
        if n >= MAX_ARG_BYTES:
            raise SandboxError(f"command arguments too long to execute: one is {n} bytes, Linux caps one "
                               f"argument at {MAX_ARG_BYTES} bytes (E2BIG); pass long content through a file")


class PatchUnreadableError(SandboxError):
    """git could not read /testbed for the final patch (the agent made its repository unreadable or
    filled the disk past what our restore could undo): the agent's outcome, not an engine failure."""


class PatchTooLargeError(SandboxError):
    """diff() refused a patch over DIFF_CAP_BYTES: a patch is whole or not at all, never cut."""

    def __init__(self, size: int, cap: int):
        super().__init__(f"the patch is {size} bytes, {size - cap} bytes over the {cap}-byte cap")
        self.size, self.cap = size, cap


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
    def _exec(self, argv: list[str], timeout: float, cap: int, stdin: bytes | None = None,
              workdir: str = "/testbed", env: dict[str, str] | None = None) -> tuple[CommandResult, bytes]:
        """argv as the sandbox user, no shell; returns the result and its raw (capped) output."""
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    # -- commands and files, through _exec as the sandbox user (its permissions and symlinks) --
    def run(self, cmd: str, timeout: float | None = None, *, workdir: str = "/testbed",
            output_cap: int | None = None, env: dict[str, str] | None = None,
            stdin: str | bytes | None = None) -> CommandResult:
        """`/bin/sh -c cmd` in the sandbox (default timeout: cfg.command_timeout_s; output cap:
        cfg.output_cap_bytes; stdin: bytes fed to the command, else /dev/null)."""
        data = stdin.encode() if isinstance(stdin, str) else stdin
        r, _ = self._exec(["/bin/sh", "-c", cmd], timeout or self.cfg.command_timeout_s,
                          output_cap or self.cfg.output_cap_bytes, stdin=data, workdir=abs_workdir(workdir), env=env)
        return r

    def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode() if isinstance(content, str) else content
        r, _ = self._exec(["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", check_path(path)],
                          60, 64 * 1024, stdin=data)
        if r.exit_code != 0:
            raise SandboxError(f"cannot write {path}: {r.output.strip()}")

    def copy_tree_in(self, src: str | os.PathLike, dest: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for child in sorted(pathlib.Path(src).iterdir()):
                tf.add(child, arcname=child.name)
        r, _ = self._exec(["/bin/sh", "-c", 'mkdir -p -- "$1" && tar -x --no-same-owner -f - -C "$1"', "sh",
                           check_path(dest)], 120, 64 * 1024, stdin=buf.getvalue())
        if r.exit_code != 0:
            raise SandboxError(f"cannot copy {src} to {dest}: {r.output.strip()}")

    def host_testbed(self) -> pathlib.Path:
        """Where this sandbox's /testbed lies on the host (archive tasks): what a build in it made."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    # Bytes read_file returns at most; a larger file raises FileTooLargeError.
    read_cap_bytes = 256 * 1024 * 1024
    # Bytes of patch diff() returns at most; a larger one raises PatchTooLargeError.
    diff_cap_bytes = DIFF_CAP_BYTES

    def read_file(self, path: str) -> str:
        # Read inside the sandbox: a host-side open() would follow the agent's symlinks as root.
        # The size first: a file over the cap is refused unread, never cut; one whose size stat
        # cannot tell (/proc) is read to at most cap + 1 bytes.
        cap = self.read_cap_bytes
        script = 's=$(stat -L -c %s -- "$1") && echo "$s" && if [ "$s" -le "$2" ]; then exec head -c "$3" -- "$1"; fi'
        r, data = self._exec(["/bin/sh", "-c", script, "sh", check_path(path), str(cap), str(cap + 1)], 60, cap + 64)
        size, _, data = data.partition(b"\n")
        if r.exit_code != 0 or not size.isdigit():
            err = data if size.isdigit() else size + b"\n" + data  # stat's or head's message
            raise FileNotFoundError(f"{path}: {decode(err).strip()}")
        if len(data) > cap or int(size) > cap:
            raise FileTooLargeError(path, max(int(size), len(data)), cap)
        return decode(data)

    def diff(self) -> str:
        """The rollout's final patch: every change under /testbed, new files included.

        `git add -A && git diff --cached` as R2E-Gym's get_patch, minus DIFF_EXCLUDES, and
        `--binary` so that a binary change still applies at grading time; computed by a git the
        agent cannot replace or configure, against the task's pristine .git (diff_script). A patch
        over diff_cap_bytes raises PatchTooLargeError; a repository git cannot read even after the
        agent's processes are gone and its permissions restored raises PatchUnreadableError.
        """
        self._quiesce()
        # The files are the sandbox user's: what the agent chmod-ed away, its owner can give back.
        self._exec(["/bin/sh", "-c", "chmod -R u+rwX /testbed 2>/dev/null; true"], 120, 4096, workdir="/")
        r = self._run_diff()
        if not r.ok:
            raise PatchUnreadableError(f"git diff failed in /testbed (exit {r.exit_code}"
                                       f"{', timed out' if r.timed_out else ''}): {r.output[-2000:]}")
        if r.truncated:  # cut in the middle it would be a corrupt patch
            raise PatchTooLargeError(r.output_bytes, self.diff_cap_bytes)
        return r.output

    def _quiesce(self) -> None:
        """End the agent's leftover processes before diff() (a backend whose commands can leave any)."""

    def _run_diff(self) -> CommandResult:
        return self.run(diff_script(), timeout=60, output_cap=self.diff_cap_bytes, env=TRUSTED_GIT_ENV)

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


def diff_script(trusted: bool = True, scratch: str = "/run/rlvr-diff") -> str:
    """The shell command behind diff(). trusted: the rootfs's git on the pristine .git (run with
    TRUSTED_GIT_ENV), its index (copied, then refreshed: unchanged files are not rewritten) and new
    objects in `scratch`, a fresh dir out of the agent's reach and off its full quota (bwrap: the
    command's own /run), so no fake git, .git/config, hook or rewritten ref/object of the agent's
    reaches the patch. Untrusted: the PATH's git on /testbed/.git (R2E-Gym images)."""
    spec = " ".join(f"':(exclude,glob){p}'" if "*" in p else f"':(exclude){p}'" for p in DIFF_EXCLUDES)
    if not trusted:
        # Exclusions go to `diff` only: `git add` fails when an excluded path is also git-ignored.
        return f"git add -A && git -c core.quotepath=false diff --cached --binary -- . {spec}"
    g = TRUSTED_GIT
    return (f't={scratch} && mkdir -p "$t/objects" && export HOME="$t" GIT_INDEX_FILE="$t/index" '
            f'GIT_OBJECT_DIRECTORY="$t/objects" && {{ cp {PRISTINE_GIT}/index "$t/index" 2>/dev/null; '
            f'{g} update-index -q --refresh >/dev/null 2>&1; '
            f'{g} add -A && {g} diff --cached --binary --no-ext-diff --no-textconv -- . {spec}; }}')


# -- disk quota: one size-limited tmpfs per sandbox holds everything it can write ----------------
_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_REMOUNT, MNT_DETACH = 2, 4, 32, 2


def mount_tmpfs(path, size_bytes: int, mode: int = 0o755, remount: bool = False) -> None:
    """Mount (or resize) a tmpfs of size_bytes at path: writes past it fail with ENOSPC."""
    flags = MS_NOSUID | MS_NODEV | (MS_REMOUNT if remount else 0)
    opts = (f"size={int(size_bytes)}" + ("" if remount else f",mode={mode:o}")).encode()
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs at {path}: {os.strerror(e)}")


def remove_tmpfs_dir(path) -> None:
    """Unmount the tmpfs at path, and all it holds with it, then remove the dir (also if never mounted)."""
    # Lazy: a mount a dying process (or a removed container) still holds goes as soon as it is free.
    _libc.umount2(os.fsencode(path), MNT_DETACH)
    shutil.rmtree(path, ignore_errors=True)


def chown_tree(root, uid: int) -> None:
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, uid)


_TREE_BYTES: dict[str, int] = {}


def tree_bytes(*roots) -> int:
    """What copies of these trees take in a tmpfs (whole pages), cached: environments never change."""
    total = 0
    for root in roots:
        key = str(root)
        if key not in _TREE_BYTES:
            n = 0
            for dirpath, dirnames, filenames in os.walk(root):
                for name in filenames + dirnames:
                    try:
                        n += -(-os.lstat(os.path.join(dirpath, name)).st_size // 4096) * 4096 + 4096
                    except OSError:
                        pass
            _TREE_BYTES[key] = n
        total += _TREE_BYTES[key]
    return total


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
