"""Stopping a run: Ctrl-C ends everything within seconds and says how to resume; a run killed
outright leaves no process behind (tasks/supervise.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures.smoke import REPO, flow_env, main_command, smoke_overrides


def _start(run_id: str, tmp_path, **overrides):
    # A dataset no other test builds, so that prepare has seconds of work to be interrupted in.
    cmd = main_command(run_id, smoke_overrides(**{"dataset.seed": int(time.time()) % 100000 + 1000, **overrides}))
    return subprocess.Popen(cmd, cwd=REPO, env=flow_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for(proc, marker: str, timeout: float = 300) -> str:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    proc.kill()
    pytest.fail(f"never saw {marker!r}:\n{''.join(seen)[-3000:]}\n{proc.stderr.read()[-3000:]}")


def _alive(pids: dict[int, int]) -> list[int]:
    from tasks.supervise import _stat

    return [p for p, start in pids.items() if (st := _stat(p)) is not None and st[1] == start]


def test_ctrl_c_during_prepare_stops_everything_and_says_how_to_resume(sandbox_rootfs, tmp_path):
    from tasks.sandbox import leftovers
    from tasks.supervise import descendant_start_times

    run_id = f"test-ctrl-c-{int(time.time())}"
    proc = _start(run_id, tmp_path)
    try:
        _wait_for(proc, "dataset: verifying gold patches")
        children = descendant_start_times(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert f"--run-id {run_id}" in err and "stopped by SIGINT" in err
    assert took < 20, f"took {took:.0f} s to stop"
    deadline = time.monotonic() + 15  # the watchdog's last sweep
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(children) == [] and leftovers(proc.pid, docker=False) == []


def test_a_run_killed_outright_leaves_no_process_behind(sandbox_rootfs, tmp_path):
    from tasks.supervise import descendant_start_times

    proc = _start(f"test-sigkill-{int(time.time())}", tmp_path)
    try:
        _wait_for(proc, "dataset: verifying gold patches")
        children = descendant_start_times(proc.pid)
        assert any("uvicorn" in open(f"/proc/{p}/cmdline").read() for p in _alive(children)), \
            "Prefect's temporary API server should be running"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(children) == [], [open(f"/proc/{p}/cmdline").read() for p in _alive(children)]


def test_supervise_kills_what_a_dead_process_left(tmp_path):
    # A parent that starts a child in a session of its own, then dies by SIGKILL.
    from tasks.supervise import _stat

    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
              "print(c.pid, flush=True)\ntime.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    watchdog = subprocess.Popen([sys.executable, "-m", "tasks.supervise", str(parent.pid)], cwd=REPO)
    time.sleep(2.5)  # it has seen the child
    parent.kill()
    parent.wait()
    assert watchdog.wait(timeout=20) == 0
    assert _stat(child) is None
