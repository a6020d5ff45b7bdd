"""bubblewrap backend: no daemon, one short-lived sandboxed process per command.

A sandbox is a host directory (its /testbed and /tmp) on its own size-limited tmpfs
(`cfg.disk_mb` beyond the repo's copy: writing more gives ENOSPC, never a full host disk)
plus one cgroup per controller; each `run` starts, as root only for the first microsecond:

    sh (joins the cgroups) -> setpriv (host uid RLVR_BWRAP_HOST_UID, default 61000, no groups)
       -> timeout -s KILL -> bwrap (new user/pid/net/ipc/uts/cgroup namespaces, uid 1000,
          no capabilities, read-only rootfs, writable /testbed and /tmp only) -> /bin/sh -c CMD

bwrap runs as an unprivileged host user so that uid 1000 inside maps to a uid that owns
nothing on the host (started by root, uid 1000 inside would map to host root, and the
root-owned files of the bound trees would appear as its own). The network namespace is
empty: no interface but loopback. Background processes end with the command: when it
exits, the pid namespace's init exits and the kernel kills the rest.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from tasks.sandbox import image as image_mod
from tasks.sandbox.base import (
    LOCAL_PATH,
    PRISTINE_GIT,
    BaseSandbox,
    CommandResult,
    OutputCap,
    SandboxError,
    SandboxInfraError,
    add_cpu_seconds,
    check_argv,
    chown_tree,
    decode,
    mount_tmpfs,
    new_id,
    owner_pid,
    register,
    remove_tmpfs_dir,
    tree_bytes,
)
from tasks.sandbox.environment import SANDBOX_UID, Environment

HOST_UID = int(os.environ.get("RLVR_BWRAP_HOST_UID", "61000"))
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
CGROUP_PARENT = "rlvr"
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")  # cpuacct: CPU accounting only
KILL_GRACE_S = 5.0


def sandbox_work_root() -> pathlib.Path:
    return pathlib.Path(tempfile.gettempdir()) / "rlvr-sandbox"


class Cgroup:
    """One cgroup per sandbox, v1 (memory, pids, cpu hierarchies) or v2 (unified)."""

    def __init__(self, name: str, memory_mb: int, pids: int, cpus: float):
        self.v1 = (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").exists()
        self.dirs: list[pathlib.Path] = []
        mem = memory_mb * 1024 * 1024
        period = 100_000
        try:
            if self.v1:
                seen = set()
                for c in V1_CONTROLLERS:
                    # cpu and cpuacct are often one hierarchy (cpu,cpuacct) under two names.
                    real = (CGROUP_ROOT / c).resolve()
                    if real in seen or not real.is_dir():
                        continue
                    seen.add(real)
                    d = real / CGROUP_PARENT / name
                    d.mkdir(parents=True)
                    self.dirs.append(d)
                m, p, cpu = self.dirs[:3]
                (m / "memory.limit_in_bytes").write_text(str(mem))
                if (m / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no swap either
                    (m / "memory.memsw.limit_in_bytes").write_text(str(mem))
                (p / "pids.max").write_text(str(pids))
                (cpu / "cpu.cfs_period_us").write_text(str(period))
                (cpu / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            else:
                parent = CGROUP_ROOT / CGROUP_PARENT
                parent.mkdir(exist_ok=True)
                (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
                d = parent / name
                d.mkdir()
                self.dirs.append(d)
                (d / "memory.max").write_text(str(mem))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(pids))
                (d / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        except OSError as e:
            self.remove()
            raise SandboxInfraError(f"cannot set up cgroup {name}: {e}") from e

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(out)

    def kill_all(self, wait_s: float = KILL_GRACE_S) -> None:
        # SIGKILL everything until nothing is left; a fork bomb is bounded by pids.max,
        # and killing the pid namespace's init takes the whole namespace with it.
        deadline = time.monotonic() + wait_s
        while True:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def cpu_seconds(self) -> float:
        for d in self.dirs:
            try:
                if (d / "cpuacct.usage").exists():
                    return int((d / "cpuacct.usage").read_text()) / 1e9
                if (d / "cpu.stat").exists() and not self.v1:
                    usec = (d / "cpu.stat").read_text().split("\n", 1)[0].split()[1]
                    return int(usec) / 1e6
            except (OSError, ValueError, IndexError):
                pass
        return 0.0

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(100):  # rmdir fails (EBUSY) while exiting processes are still counted
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
        self.dirs = [d for d in self.dirs if d.exists()]


# Joins the cgroups (needs root), then execs the rest of argv.
_ATTACH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


class BwrapSandbox(BaseSandbox):
    def __init__(self, env: Environment, cfg, mode: str = "agent", rootfs: pathlib.Path | None = None):
        if env.kind != "archive":
            raise SandboxError("the bwrap backend runs tasks with an environment_uri archive; "
                               f"{env.key!r} is a docker image: use sandbox.backend=docker")
        if shutil.which("bwrap") is None:
            raise SandboxInfraError("bwrap is not installed (run infra/system-setup.sh)")
        self.id, self.mode, self.cfg, self.env = new_id(), mode, cfg, env
        self.rootfs = rootfs or image_mod.rootfs_path()
        if not (self.rootfs / "usr" / "bin" / "python3").exists():
            raise SandboxInfraError(f"no sandbox rootfs at {self.rootfs}: run python -m tasks.sandbox.image build")
        t0 = time.monotonic()
        self.work = sandbox_work_root() / self.id
        self.cgroup = None
        register(self)
        try:
            sandbox_work_root().mkdir(mode=0o755, exist_ok=True)
            self.work.mkdir(mode=0o755)
            # The quota: pages the sandbox writes here are also charged to its memory cgroup.
            mount_tmpfs(self.work, cfg.disk_mb * 1024 * 1024 + tree_bytes(env.testbed))
            shutil.copytree(env.testbed, self.work / "testbed", symlinks=True)
            (self.work / "tmp").mkdir(mode=0o700)
            chown_tree(self.work / "testbed", HOST_UID)
            os.lchown(self.work / "tmp", HOST_UID, HOST_UID)
            self.cgroup = Cgroup(self.id, cfg.memory_mb, cfg.pids_limit, cfg.cpus)
        except SandboxInfraError:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise SandboxInfraError(f"cannot prepare bwrap sandbox: {e}") from e
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        self._kill_lock = threading.Lock()

    # -- commands -----------------------------------------------------------------------
    def _bwrap_args(self, workdir: str, env: dict[str, str]) -> list[str]:
        # Per-command tmpfs (gone when the command ends), each capped at the quota as well.
        quota = str(self.cfg.disk_mb * 1024 * 1024)
        a = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID),
             "--gid", str(SANDBOX_UID), "--hostname", "sandbox", "--die-with-parent", "--new-session",
             "--cap-drop", "ALL",
             "--ro-bind", str(self.rootfs), "/", "--proc", "/proc", "--dev", "/dev",
             "--size", quota, "--tmpfs", "/dev/shm", "--size", quota, "--tmpfs", "/var/tmp",
             "--size", quota, "--tmpfs", "/run",
             "--bind", str(self.work / "testbed"), "/testbed", "--bind", str(self.work / "tmp"), "/tmp",
             # The environment's own .git, root-owned and read-only: what diff() trusts.
             "--ro-bind", str(self.env.testbed / ".git"), PRISTINE_GIT]
        if self.mode == "grading":
            # Hidden tests and run_tests.sh, read-only, where R2E-Gym keeps them.
            a += ["--ro-bind", str(self.env.hidden), "/root"]
        a += ["--chdir", workdir, "--clearenv"]
        base = {"PATH": LOCAL_PATH, "HOME": "/tmp", "USER": "sandbox", "LANG": "C.UTF-8"}
        if not self.env.plugins:  # our own tests need no plugin; a task's own virtualenv may
            base["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        for k, v in {**base, **(env or {})}.items():
            a += ["--setenv", k, v]
        return a

    def _exec(self, argv: list[str], timeout: float, cap: int, stdin: bytes | None = None,
              workdir: str = "/testbed", env: dict[str, str] | None = None) -> tuple[CommandResult, bytes]:
        if getattr(self, "_closed", False):
            raise SandboxError(f"sandbox {self.id} is closed")
        check_argv(argv)
        status_r, status_w = os.pipe()
        # `timeout` is the backstop; our own deadline (below) fires first and kills the cgroup.
        full = (["sh", "-c", _ATTACH, "sh", *self.cgroup.procs_files(), "--",
                 "setpriv", f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups",
                 "timeout", "-s", "KILL", str(int(timeout) + 2)]
                + self._bwrap_args(workdir, env) + ["--json-status-fd", str(status_w)] + argv)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(full, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(status_w,),
                                    start_new_session=True)
        except OSError as e:
            os.close(status_r)
            if e.errno == errno.E2BIG:  # the caller's argv, not the engine
                raise SandboxError(f"command arguments too long to execute (Linux caps one argument at "
                                   f"128 KiB): {sum(len(a) for a in argv)} characters") from e
            raise SandboxInfraError(f"cannot start bwrap: {e}") from e
        finally:
            os.close(status_w)
        writer = None
        if stdin is not None:
            writer = threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True)
            writer.start()
        out = OutputCap(cap)
        interrupted = True
        try:
            timed_out = self._drain(proc, out, t0 + timeout)
            interrupted = False
        finally:
            if interrupted:  # Ctrl-C or an error here: do not wait for the command
                self.cgroup.kill_all(1.0)
                proc.kill()
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:  # something kept it alive past EOF
                self.cgroup.kill_all(1.0)
                proc.kill()
                proc.wait()
            proc.stdout.close()
            if writer is not None:
                writer.join(1.0)
            status = _read_status(status_r)
        seconds = time.monotonic() - t0
        if getattr(self, "_closed", False):
            raise SandboxError(f"sandbox {self.id} was closed while the command ran")
        if "child-pid" not in status and not timed_out:
            # bwrap never started the command: its own error message is the output.
            raise SandboxInfraError(f"bwrap failed to start (exit {proc.returncode}): {decode(out.value())[-2000:]}")
        # The command's own exit status (timeout and bwrap pass it through); not the status fd,
        # which the command could write to.
        code = None if timed_out else proc.returncode
        data = out.value()
        return CommandResult(exit_code=code, output=decode(data), timed_out=timed_out, seconds=seconds,
                             truncated=out.truncated, output_bytes=out.total), data

    def _drain(self, proc: subprocess.Popen, out: OutputCap, deadline: float) -> bool:
        fd = proc.stdout.fileno()
        timed_out = False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if not timed_out and now >= deadline:
                    timed_out = True
                    self.cgroup.kill_all()
                    deadline = now + KILL_GRACE_S  # drain what is left, then give up
                elif timed_out and now >= deadline:
                    return True
                if sel.select(timeout=min(1.0, max(0.0, deadline - now))):
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        return timed_out
                    out.feed(chunk)

    def host_testbed(self) -> pathlib.Path:
        return self.work / "testbed"

    # -- clean-up -----------------------------------------------------------------------
    def _close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill_all()
            add_cpu_seconds(self.cgroup.cpu_seconds())
            self.cgroup.remove()
        remove_tmpfs_dir(self.work)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass


def _read_status(fd: int) -> dict:
    """bwrap's --json-status-fd: {"child-pid": N} once the sandbox is up, {"exit-code": N} at the end."""
    chunks = []
    os.set_blocking(fd, False)
    try:
        while True:
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    status: dict = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                status.update(json.loads(line))
            except ValueError:
                pass
    return status


def _parents() -> list[pathlib.Path]:
    out = {(CGROUP_ROOT / c).resolve() / CGROUP_PARENT for c in V1_CONTROLLERS}
    return sorted(out) + [CGROUP_ROOT / CGROUP_PARENT]


def reap_stale(pid_alive) -> list[str]:
    """Remove cgroups and work dirs whose owner process is gone. Returns what was removed."""
    removed = []
    for parent in _parents():
        if not parent.is_dir():
            continue
        for d in parent.iterdir():
            pid = owner_pid(d.name)
            if d.is_dir() and pid is not None and not pid_alive(pid):
                cg = Cgroup.__new__(Cgroup)
                cg.dirs = [d]
                cg.remove()
                removed.append(str(d))
    if sandbox_work_root().is_dir():
        for d in sandbox_work_root().iterdir():
            pid = owner_pid(d.name)
            if pid is not None and not pid_alive(pid):
                remove_tmpfs_dir(d)
                removed.append(str(d))
    return removed


def leftovers(pid: int) -> list[str]:
    """Cgroups and work dirs a process still holds (tests assert this is empty after close)."""
    out = []
    for parent in _parents():
        if parent.is_dir():
            out += [str(d) for d in parent.iterdir() if d.is_dir() and owner_pid(d.name) == pid]
    if sandbox_work_root().is_dir():
        out += [str(d) for d in sandbox_work_root().iterdir() if owner_pid(d.name) == pid]
    return out
