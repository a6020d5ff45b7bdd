"""Docker backend: one container per sandbox, every command an `exec` in it.

Containers run `sleep infinity` with no network (`network_mode=none`), memory (no
swap), pids and CPU limits, all capabilities dropped and no-new-privileges.

- archive tasks start from the base image (`cfg.image`) with a read-only root; every
  dir uid 1000 can write (/testbed, /tmp, /var/tmp, /dev/shm, /run/lock) and /root (the
  hidden tests, root-owned) are bind mounts of one host tmpfs per container, sized
  `cfg.disk_mb` beyond the task's files (ENOSPC past it, never a full host disk), filled
  from the host; the task's pristine .git is there too, read-only at PRISTINE_GIT for
  diff(). /testbed is owned by uid 1000 and commands run as uid 1000, like bwrap.
- image tasks (real R2E-Gym rows: `docker_image`, no `environment_uri`) start from
  that image and run as root, as R2E-Gym does; its hidden tests are removed
  (agent mode) or moved to /root (grading mode) at start.

`cfg.docker_reuse` keeps containers of archive tasks warm between sandboxes: on
close the container is reset (every uid-1000 process killed, then its host tmpfs
emptied: the writable dirs, the hidden tests, the pristine .git) and handed to the
next sandbox on the same image and limits, whatever its task or mode (at most
`cfg.concurrency` idle per image and limits). uid 1000 cannot write anywhere else, so a reset container is as
clean as a new one. Image tasks run as root and are never reused.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import select
import shutil
import socket
import tempfile
import threading
import time

from tasks.sandbox.base import (LOCAL_PATH, PRISTINE_GIT, R2E_PATH, TRUSTED_GIT_ENV, BaseSandbox,
                                CommandResult, OutputCap, SandboxError, SandboxInfraError,
                                add_cpu_seconds, check_argv, chown_tree, decode, diff_script, mount_tmpfs, new_id,
                                owner_pid, register, remove_tmpfs_dir, tree_bytes)
from tasks.sandbox.environment import SANDBOX_UID, Environment

LABEL = "rlvr.sandbox"
KILL_GRACE_S = 5.0
ZOMBIE_REAP_S = 10.0  # the longest wait for tini to reap the killed (returns as soon as it has)
# Archive tasks: host tmpfs subdir -> container path, all else read-only. The first five are where
# uid 1000 can write in the base image (world-writable dirs + /testbed); a reset empties them all.
# scratch: diff()'s temp space, a tmpfs of its own (the agent cannot fill it), root's until a diff.
BINDS = {"testbed": "/testbed", "tmp": "/tmp", "vartmp": "/var/tmp", "shm": "/dev/shm", "runlock": "/run/lock",
         "root": "/root", "git": PRISTINE_GIT, "scratch": "/run/rlvr-scratch"}


def host_root() -> pathlib.Path:
    return pathlib.Path(tempfile.gettempdir()) / "rlvr-docker"


def _host_dir(name: str) -> pathlib.Path:
    return host_root() / name

# SIGKILL every process of the sandbox user but this shell until none is left alive (zombies
# do not count; tini, init=True, reaps them). kill(-1)'s own status cannot tell: it succeeds
# whenever any other process exists, signalled or not. Builtins only: a fork would count.
_KILL_ALL = """kill_all() { me=$$; uid=$(id -u)
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  kill -9 -1 2>/dev/null; left=0
  for p in /proc/[0-9]*; do
    [ "$p" = "/proc/$me" ] && continue; st=; u=
    while read -r k v rest; do case $k in State:) st=$v;; Uid:) u=$v;; esac; done 2>/dev/null < "$p/status"
    [ "$u" = "$uid" ] && [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ] && left=1
  done
  [ $left = 0 ] && return 0
  sleep 0.05
done
return 1; }; kill_all"""

_client = None
_client_lock = threading.Lock()


def client():
    global _client
    with _client_lock:
        if _client is None:
            import docker

            try:
                _client = docker.from_env(timeout=300, max_pool_size=64)
                _client.ping()
            except Exception as e:
                _client = None
                raise SandboxInfraError(f"docker engine not reachable ({e}); run infra/system-setup.sh") from e
        return _client


def _infra(what: str, e: Exception) -> SandboxInfraError:
    return SandboxInfraError(f"docker: {what}: {type(e).__name__}: {e}")


# -- warm pool ------------------------------------------------------------------------------
_POOL: dict[tuple, list] = {}
_POOL_LOCK = threading.Lock()


def _pool_get(key: tuple):
    with _POOL_LOCK:
        items = _POOL.get(key) or []
        return items.pop() if items else None


def _pool_put(key: tuple, container, max_idle: int) -> bool:
    with _POOL_LOCK:
        items = _POOL.setdefault(key, [])
        if len(items) >= max_idle:
            return False
        items.append(container)
        return True


def close_pools() -> None:
    """Remove every warm container this process keeps."""
    with _POOL_LOCK:
        items = [c for cs in _POOL.values() for c in cs]
        _POOL.clear()
    for c in items:
        _remove(c)


atexit.register(close_pools)


def _remove(container) -> None:
    try:
        container.remove(force=True)
    except Exception:
        pass
    remove_tmpfs_dir(_host_dir(container.name))


def _make_host_dir(name: str) -> None:
    w = _host_dir(name)
    host_root().mkdir(mode=0o700, exist_ok=True)
    w.mkdir(mode=0o700)
    mount_tmpfs(w, 1024 * 1024, mode=0o700)  # resized for each task by _populate
    for sub in BINDS:
        (w / sub).mkdir()
        # As in the base image: world-writable with the sticky bit, /testbed (uid 1000's) and /root 0755.
        os.chmod(w / sub, 0o755 if sub in ("testbed", "root", "git", "scratch") else 0o1777)
    mount_tmpfs(w / "scratch", 1024 * 1024)


def _empty(d: pathlib.Path) -> None:
    for e in os.scandir(d):
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)


class DockerSandbox(BaseSandbox):
    def __init__(self, env: Environment, cfg, mode: str = "agent"):
        self.id, self.mode, self.cfg, self.env = new_id(), mode, cfg, env
        self.container = None
        self._discard = False
        self.local = env.kind == "archive"
        self.user = f"{SANDBOX_UID}:{SANDBOX_UID}" if self.local else "0:0"
        if self.local:
            # Plugin autoload off: nothing to load in the base image, and it costs ~1 s per run;
            # on for a task that brings its own virtualenv (its plugins, e.g. pytest-cov).
            self.env_vars = {"PATH": LOCAL_PATH, "HOME": "/tmp", "USER": "sandbox", "LANG": "C.UTF-8"}
            if not env.plugins:
                self.env_vars["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        else:
            # Real R2E-Gym images may rely on pytest plugins (e.g. asyncio): leave autoload on.
            self.env_vars = {"PATH": R2E_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        self.reusable = bool(getattr(cfg, "docker_reuse", False)) and self.local
        # Any environment and mode on the same image and limits: a reset container holds nothing.
        self.pool_key = (env.image, cfg.memory_mb, cfg.pids_limit, cfg.cpus)
        t0 = time.monotonic()
        register(self)
        try:
            self.container = _pool_get(self.pool_key) if self.reusable else None
            self.reused = self.container is not None
            if self.container is None:
                self.container = self._create()
            self._populate()
        except BaseException as e:
            self._discard = True
            self.close()
            if isinstance(e, (SandboxError, KeyboardInterrupt, SystemExit)):
                raise
            raise _infra("start", e) from e
        self.start_seconds = time.monotonic() - t0

    # -- start --------------------------------------------------------------------------
    def _create(self):
        import docker

        cfg = self.cfg
        name = new_id()
        local = {}
        if self.local:  # R2E-Gym images (root inside) keep their writable layer: no quota there
            binds = {str(_host_dir(name) / sub): {"bind": dest, "mode": "ro" if sub == "git" else "rw"}
                     for sub, dest in BINDS.items()}
            local = dict(read_only=True, volumes=binds)
        try:
            if self.local:
                _make_host_dir(name)
            return client().containers.run(
                self.env.image, ["sleep", "infinity"], detach=True, name=name,
                network_mode="none", mem_limit=f"{cfg.memory_mb}m", memswap_limit=f"{cfg.memory_mb}m",
                pids_limit=cfg.pids_limit, nano_cpus=int(cfg.cpus * 1e9),
                cap_drop=["ALL"], security_opt=["no-new-privileges"], working_dir="/testbed",
                labels={LABEL: "1", f"{LABEL}.owner": f"{socket.gethostname()}:{os.getpid()}"},
                stop_signal="SIGKILL",
                # tini as pid 1 reaps orphans: killed background processes must not linger as
                # zombies (they would count against pids_limit and keep kill(-1) succeeding).
                init=True, **local,
            )
        except BaseException as e:
            # `run` is create + start: a failed start leaves a created container behind.
            try:
                client().containers.get(name).remove(force=True)
            except Exception:
                pass
            remove_tmpfs_dir(_host_dir(name))
            if isinstance(e, docker.errors.ImageNotFound):
                raise SandboxInfraError(f"docker image {self.env.image!r} not found (and not pullable: "
                                        "build or load it first)") from e
            if isinstance(e, docker.errors.DockerException):
                raise _infra("container start", e) from e
            raise

    def _populate(self) -> None:
        c = self.container
        if self.local:
            # From the host into the container's tmpfs (sized for this task: a reused one is
            # resized): /testbed (uid 1000's), the pristine .git, and in grading mode the hidden
            # tests in /root (root-owned, read-only for uid 1000, where R2E-Gym keeps them).
            env, w = self.env, _host_dir(c.name)
            hidden = self.mode == "grading"
            need = tree_bytes(env.testbed, env.testbed / ".git", *([env.hidden] if hidden else []))
            for fs in (w, w / "scratch"):
                mount_tmpfs(fs, self.cfg.disk_mb * 1024 * 1024 + need, remount=True)
            shutil.copytree(env.testbed, w / "testbed", symlinks=True, dirs_exist_ok=True)
            chown_tree(w / "testbed", SANDBOX_UID)
            shutil.copytree(env.testbed / ".git", w / "git", symlinks=True, dirs_exist_ok=True)
            if hidden:
                shutil.copytree(env.hidden, w / "root", symlinks=True, dirs_exist_ok=True)
            return
        # R2E-Gym image: the hidden tests live in /r2e_tests and /testbed/run_tests.sh.
        venv = ("ln -sfn /testbed/.venv /root/.venv; mkdir -p /root/.local/bin; "
                "if [ -d /testbed/.venv/bin ]; then ln -sf /testbed/.venv/bin/python /root/.local/bin/python; "
                "ln -sf /testbed/.venv/bin/python /root/.local/bin/python3; "
                "find /testbed/.venv/bin -type f -executable -exec ln -sf {} /root/.local/bin/ \\; ; fi; "
                "find /testbed -name '*.pyc' -delete; find /testbed -name __pycache__ -prune -exec rm -rf {} +; ")
        if self.mode == "agent":
            setup = "rm -rf /r2e_tests /testbed/r2e_tests /testbed/run_tests.sh; " + venv
        else:
            setup = ("if [ -e /testbed/run_tests.sh ]; then mv -f /testbed/run_tests.sh /root/run_tests.sh; fi; "
                     "if [ -d /r2e_tests ]; then rm -rf /testbed/r2e_tests /root/r2e_tests; "
                     "mv /r2e_tests /root/r2e_tests; "
                     "elif [ -d /testbed/r2e_tests ]; then rm -rf /root/r2e_tests; "
                     "mv /testbed/r2e_tests /root/r2e_tests; fi; "
                     "find /root/r2e_tests -name '*.pyc' -delete; "
                     "find /root/r2e_tests -name __pycache__ -prune -exec rm -rf {} +; " + venv)
        r, _ = self._exec(["/bin/sh", "-c", setup + "true"], 120, 64 * 1024)
        if not r.ok:
            raise SandboxInfraError(f"docker: environment set-up failed: {r.output[-2000:]}")

    # -- commands -----------------------------------------------------------------------
    def _exec(self, argv: list[str], timeout: float, cap: int, stdin: bytes | None = None,
              workdir: str = "/testbed", env: dict[str, str] | None = None,
              user: str | None = None, wrap: bool = True, closing: bool = False) -> tuple[CommandResult, bytes]:
        args = (argv, timeout, cap, stdin, workdir, env, user, wrap, closing)
        r, data = self._exec_once(*args)
        # Our `timeout` wrapper could not fork the command (exit 125 before any output of the command's):
        # the agent's background processes hold every pid. They end, from the host, and the command runs
        # once more, as when the exec itself cannot start. A command that fakes the message loses the same.
        if wrap and self.local and r.exit_code == 125 and data.startswith(b"timeout: ") and self._kill_from_host():
            r, data = self._exec_once(*args)
        return r, data

    def _exec_once(self, argv: list[str], timeout: float, cap: int, stdin: bytes | None, workdir: str,
                   env: dict[str, str] | None, user: str | None, wrap: bool,
                   closing: bool) -> tuple[CommandResult, bytes]:
        import docker

        if self.container is None or (getattr(self, "_closed", False) and not closing):
            raise SandboxError(f"sandbox {self.id} is closed")
        check_argv(argv)
        api = client().api
        # In-container `timeout` is the backstop; our own deadline fires first.
        cmd = (["timeout", "-s", "KILL", str(int(timeout) + 2)] if wrap else []) + argv
        t0 = time.monotonic()
        for attempt in (1, 2):
            try:
                eid = api.exec_create(self.container.id, cmd, stdin=stdin is not None, tty=False,
                                      user=user or self.user, workdir=workdir,
                                      environment={**self.env_vars, **(env or {})})["Id"]
                sock = api.exec_start(eid, socket=True)
                break
            except docker.errors.DockerException as e:
                if "argument list too long" in str(e).lower():  # E2BIG: the caller's argv, not the engine
                    raise SandboxError(f"command arguments too long to execute (Linux caps one argument at "
                                       f"128 KiB): {sum(len(a) for a in cmd)} characters") from e
                # Out of pids (a fork bomb lives on): the agent's processes go, from the host; once more.
                if attempt == 2 or not self.local or not self._kill_from_host():
                    raise _infra("exec", e) from e
        raw = getattr(sock, "_sock", sock)
        early = _read_ahead(sock, raw)
        writer = None
        if stdin is not None:
            writer = threading.Thread(target=_send, args=(raw, stdin), daemon=True)
            writer.start()
        out = OutputCap(cap)
        timed_out, killer = False, []
        try:
            timed_out = self._drain(raw, out, t0 + timeout, eid, killer, early)
        finally:
            try:
                sock.close()  # also unblocks docker's copy of the output, should we have stopped reading
            except OSError:
                pass
            if writer is not None:
                writer.join(1.0)
            for k in killer:  # the next command must not start while the kill loop or the reaping still runs
                k.join(KILL_GRACE_S + ZOMBIE_REAP_S + 1.0)
                if k.is_alive():
                    self._discard = True
        if getattr(self, "_closed", False) and not closing:
            raise SandboxError(f"sandbox {self.id} was closed while the command ran")
        code = None
        if not timed_out:
            try:
                for _ in range(50):  # the stream ends a moment before the exec is marked done
                    info = api.exec_inspect(eid)
                    if not info.get("Running"):
                        code = info.get("ExitCode")
                        break
                    time.sleep(0.01)
            except docker.errors.DockerException as e:
                raise _infra("exec inspect", e) from e
        data = out.value()
        return CommandResult(exit_code=code, output=decode(data), timed_out=timed_out,
                             seconds=time.monotonic() - t0, truncated=out.truncated,
                             output_bytes=out.total), data

    def _drain(self, raw, out: OutputCap, deadline: float, eid: str, killer: list, early: bytes = b"") -> bool:
        """Read docker's multiplexed stream (8-byte frame headers) until EOF or the deadline."""
        buf = bytearray(early)
        timed_out = False
        while True:
            while len(buf) >= 8:
                size = int.from_bytes(buf[4:8], "big")
                if len(buf) < 8 + size:
                    break
                out.feed(bytes(buf[8:8 + size]))
                del buf[:8 + size]
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out = True
                # Kill from another thread and keep reading: dockerd finishes an exited exec (and
                # every later exec of the container, the kill's too) only once its output is read.
                k = threading.Thread(target=self._kill_processes, args=(eid,), daemon=True)
                k.start()
                killer.append(k)
                deadline = now + KILL_GRACE_S
            elif timed_out and now >= deadline:
                return True
            ready, _, _ = select.select([raw], [], [], min(1.0, max(0.0, deadline - now)))
            if not ready:
                continue
            try:
                chunk = raw.recv(1 << 16)
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:
                return timed_out
            buf += chunk

    def _kill_processes(self, eid: str) -> None:
        """Kill a timed-out command and what it started."""
        if self.local:
            # uid 1000: every process of the sandbox user (the command, its children, anything it
            # left in the background or in a new session). Root's init and keeper survive. From the
            # host: a fork bomb leaves no pid for an exec in the container.
            if self._kill_from_host():
                return
            cmd = ["sh", "-c", _KILL_ALL]
        else:
            # Root inside (R2E-Gym images): kill(-1) would take the container down; kill the
            # command's process group instead (`timeout` leads its own group).
            try:
                pid = client().api.exec_inspect(eid).get("Pid") or 0
                if pid > 0:
                    os.killpg(pid, 9)
                return
            except Exception:
                cmd = ["sh", "-c", "kill -9 -1"]
        try:
            self.container.exec_run(cmd, user=self.user)
        except Exception:
            self._discard = True

    def _quiesce(self) -> None:
        # Background processes outlive commands here: end them, from the host where it can (a sandbox
        # out of pids or memory cannot run the in-container kill).
        if not self.local or self._kill_from_host():
            return
        r, _ = self._exec(["/bin/sh", "-c", _KILL_ALL], 30, 4096, workdir="/", wrap=False)
        if r.exit_code != 0:
            raise SandboxInfraError(f"docker: cannot end the sandbox user's processes: {r.output[-500:]}")

    def _kill_from_host(self, wait_s: float = KILL_GRACE_S) -> bool:
        """SIGKILL, as root on the host, every process of the sandbox user in the container's cgroup
        (init and root's keeper stay) until none is left; False if the cgroup cannot be read."""
        procs = _cgroup_procs(self.container)
        if procs is None:
            return False
        freeze = _freezer(procs)  # a frozen fork bomb cannot fork while it is being killed
        deadline = time.monotonic() + wait_s
        try:
            if freeze:
                freeze(True)
            empty = 0
            while True:
                left = [pid for pid in _read_pids(procs) if _uid_of(pid) == SANDBOX_UID]
                empty = 0 if left else empty + 1
                if empty >= 3:  # thrice in a row, across thaws: nothing was mid-fork
                    return True
                for pid in left:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                if time.monotonic() > deadline:
                    return False
                if freeze:  # SIGKILL is delivered once thawed
                    freeze(False)
                    time.sleep(0.01)
                    freeze(True)
                else:
                    time.sleep(0.01)
        finally:
            if freeze:
                freeze(False)
            # The dead still hold pids until tini reaps them (it was frozen too): wait for it, or the next
            # command cannot fork. Reaping takes milliseconds; the bound is for a stalled engine.
            until = time.monotonic() + ZOMBIE_REAP_S
            while time.monotonic() < until and any(_uid_of(p, zombies=True) == SANDBOX_UID for p in _read_pids(procs)):
                time.sleep(0.01)

    def _run_diff(self) -> CommandResult:
        if not self.local:
            # R2E-Gym images run the agent as root: nothing there is out of its reach, so their git as before.
            return self.run(diff_script(trusted=False), timeout=60, output_cap=self.diff_cap_bytes)
        # _quiesce ended the agent's processes; give the diff (uid 1000 too) a fresh dir no process
        # of the agent's can rewrite.
        d = _host_dir(self.container.name) / "scratch" / "diff"
        d.mkdir(exist_ok=True)
        os.chown(d, SANDBOX_UID, SANDBOX_UID)
        try:
            r, _ = self._exec(["/bin/sh", "-c", diff_script(scratch=BINDS["scratch"] + "/diff")], 60, self.diff_cap_bytes,
                              env=TRUSTED_GIT_ENV)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return r

    def host_testbed(self) -> pathlib.Path:
        if not self.local:
            raise SandboxError("an R2E-Gym image's /testbed lives in its container, not on the host")
        return _host_dir(self.container.name) / "testbed"

    # -- clean-up -----------------------------------------------------------------------
    def _account_cpu(self, c) -> None:
        now = _container_cpu(c)
        with _POOL_LOCK:
            before = _cpu_seen.pop(c.id, 0.0)
            if self.reusable:
                _cpu_seen[c.id] = now
        add_cpu_seconds(max(0.0, now - before))

    def _reset(self) -> bool:
        """Make a used container as clean as a new one; False if that cannot be shown."""
        try:
            # Not under `timeout`: kill(-1) would kill that wrapper too.
            r, _ = self._exec(["/bin/sh", "-c", _KILL_ALL], 30, 4096, workdir="/", wrap=False, closing=True)
            if r.exit_code != 0:
                return False
            # No process of uid 1000 is left and the root is read-only: emptying the tmpfs from the
            # host (root, fd-based, never through a link) leaves nothing of the last sandbox.
            w = _host_dir(self.container.name)
            for sub in BINDS:
                _empty(w / sub)
            return not any(any((w / sub).iterdir()) for sub in BINDS)
        except Exception:
            return False

    def _close(self) -> None:
        c, self.container = self.container, None
        if c is None:
            return
        self._account_cpu(c)
        if self.reusable and not self._discard:
            self.container = c  # _exec needs it for the reset
            ok = self._reset()
            self.container = None
            if ok and _pool_put(self.pool_key, c, max(1, self.cfg.concurrency)):
                return
        _remove(c)


_cpu_seen: dict[str, float] = {}


def _cgroup_procs(c) -> pathlib.Path | None:
    """The host's cgroup.procs of a container's pids cgroup (v1) or unified cgroup (v2), from its init."""
    try:
        c.reload()
        init = int(c.attrs["State"]["Pid"])
        lines = pathlib.Path(f"/proc/{init}/cgroup").read_text().splitlines()
    except Exception:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not path.strip("/"):  # the root cgroup holds the whole host: never ours to kill in
            continue
        base = pathlib.Path("/sys/fs/cgroup") / ("pids" if "pids" in controllers.split(",") else "")
        if "pids" in controllers.split(",") or (controllers == "" and (base / "cgroup.controllers").exists()):
            f = base / path.lstrip("/") / "cgroup.procs"
            if f.exists():
                return f
    return None


def _freezer(procs: pathlib.Path):
    """freeze(True/False) for the cgroup whose cgroup.procs this is: v2's cgroup.freeze beside it, or
    v1's freezer hierarchy at the same path; None where neither is there."""
    v2 = procs.with_name("cgroup.freeze")
    parts = procs.parent.relative_to("/sys/fs/cgroup").parts
    v1 = pathlib.Path("/sys/fs/cgroup/freezer", *parts[1:], "freezer.state") if parts[:1] == ("pids",) else None
    if v2.exists():
        return lambda on: v2.write_text("1" if on else "0")
    if v1 is not None and v1.exists():
        return lambda on: v1.write_text("FROZEN" if on else "THAWED")
    return None


def _read_pids(procs: pathlib.Path) -> list[int]:
    try:
        return [int(x) for x in procs.read_text().split()]
    except OSError:
        return []


def _uid_of(pid: int, zombies: bool = False) -> int | None:
    """The process's real uid; None when gone, or (unless `zombies`) dead and waiting for init to reap it."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:") and line.split()[1] == "Z" and not zombies:
                return None
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _container_cpu(c) -> float:
    # The container's cgroup (cgroupfs driver); a reused container is charged per use.
    for p in (f"/sys/fs/cgroup/cpuacct/docker/{c.id}/cpuacct.usage", f"/sys/fs/cgroup/docker/{c.id}/cpu.stat"):
        try:
            text = pathlib.Path(p).read_text()
        except OSError:
            continue
        return int(text) / 1e9 if p.endswith("usage") else int(text.split("\n", 1)[0].split()[1]) / 1e6
    return 0.0


def _read_ahead(sock, raw) -> bytes:
    """The stream's first bytes, should http.client have read them along with the upgrade's
    headers (a fast command's whole output): they are in its buffer, not in the socket."""
    fp = getattr(getattr(getattr(getattr(sock, "_response", None), "raw", None), "_fp", None), "fp", None)
    if fp is None:
        return b""
    timeout = raw.gettimeout()
    raw.setblocking(False)  # an empty buffer must not wait for the socket
    try:
        return fp.read1(1 << 16) or b""
    except OSError:
        return b""
    finally:
        raw.settimeout(timeout)


def _send(raw, data: bytes) -> None:
    try:
        raw.sendall(data)
        raw.shutdown(socket.SHUT_WR)  # EOF on the command's stdin; the output keeps flowing
    except OSError:
        pass


def _owned(c) -> tuple[str, int | None]:
    host, _, pid = (c.labels or {}).get(f"{LABEL}.owner", ":").rpartition(":")
    return host, int(pid) if pid.isdigit() else None


def reap_stale(pid_alive) -> list[str]:
    """Remove this host's sandbox containers (and their host tmpfs) whose owner process is gone."""
    removed = []
    for c in client().containers.list(all=True, filters={"label": LABEL}):
        host, pid = _owned(c)
        if host == socket.gethostname() and pid is not None and not pid_alive(pid):
            _remove(c)
            removed.append(c.name)
    for w in _host_dirs():
        pid = owner_pid(w.name)
        if pid is not None and not pid_alive(pid):
            remove_tmpfs_dir(w)
            removed.append(str(w))
    return removed


def _host_dirs() -> list[pathlib.Path]:
    return sorted(host_root().iterdir()) if host_root().is_dir() else []


def leftovers(pid: int, include_pool: bool = False) -> list[str]:
    """Containers and host tmpfs dirs a process still holds (warm pool excluded unless asked)."""
    with _POOL_LOCK:
        pooled = {c.id for cs in _POOL.values() for c in cs}
        pooled_names = {c.name for cs in _POOL.values() for c in cs}
    out = []
    for c in client().containers.list(all=True, filters={"label": LABEL}):
        host, p = _owned(c)
        if host == socket.gethostname() and p == pid and (include_pool or c.id not in pooled):
            out.append(c.name)
    out += [str(w) for w in _host_dirs()
            if owner_pid(w.name) == pid and (include_pool or w.name not in pooled_names)]
    return out

