"""Nothing outlives its run: a watchdog that ends what a run started once the run is gone.

A run's main process starts children in sessions of their own (vLLM, the trainer, sandbox
commands) and Prefect starts its temporary API server; a main process killed outright
(SIGKILL, OOM) runs no clean-up, and those would live on. The watchdog, started by
`watch(os.getpid())` in a session of its own, notes the main process's descendants every
second; when the main process has exited, however it ended, it kills the ones still alive
(same pid and start time) and removes the sandboxes whose owner is gone.

`owner()` names this process (host, pid, start time) for a run's manifest; `owner_gone` tells
a reader whether an attempt's process still exists, so an attempt killed outright reads `killed`.

    python -m tasks.supervise PID
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

POLL_S = 1.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[1]), int(fields[19])) if fields[0] != "Z" else None


def owner() -> dict:
    """This process, as an attempt's owner: host, pid and start time (pids are reused, start times not)."""
    st = _stat(os.getpid())
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": st[1] if st else None}


def owner_gone(host: str | None, pid: int | None, pid_start: int | None) -> bool:
    """Whether the owner process is known to be gone; only this host's processes can be checked."""
    if pid is None or host != socket.gethostname():
        return False
    st = _stat(pid)
    return st is None or (pid_start is not None and st[1] != pid_start)


def descendant_start_times(root: int) -> dict[int, int]:
    """pid -> start time of every live process below `root`."""
    children: dict[int, list[int]] = {}
    start = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append(int(name))
            start[int(name)] = st[1]
    out, frontier = {}, [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in out:
                out[child] = start[child]
                frontier.append(child)
    return out


def supervise(pid: int) -> list[int]:
    """Wait for `pid` to exit, then kill what it left running; returns the pids killed."""
    me = _stat(pid)
    seen: dict[int, int] = {}
    while (st := _stat(pid)) is not None and st[1] == me[1]:
        seen.update(descendant_start_times(pid))
        seen = {p: s for p, s in seen.items() if (now := _stat(p)) is not None and now[1] == s}
        time.sleep(POLL_S)
    killed = []
    for p, s in seen.items():
        if p != os.getpid() and (now := _stat(p)) is not None and now[1] == s:
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except OSError:
                pass
    try:  # containers, cgroups and work dirs whose owner process is gone
        from tasks.sandbox import reap_stale

        reap_stale()
    except Exception:
        pass
    return killed


def watch(pid: int) -> subprocess.Popen:
    """Start the watchdog of `pid` in its own session (a Ctrl-C to the run's terminal does not reach it)."""
    return subprocess.Popen([sys.executable, "-m", "tasks.supervise", str(pid)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=os.getcwd())


if __name__ == "__main__":
    if _stat(int(sys.argv[1])) is not None:
        supervise(int(sys.argv[1]))
