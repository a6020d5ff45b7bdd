"""The sandbox protocol, on both backends (tests/fixtures/sandbox.py builds the image once)."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.fixtures.sandbox import sandbox_cfg

pytestmark = pytest.mark.usefixtures("no_sandbox_leaks")
REPO = pathlib.Path(__file__).resolve().parents[1]
# `ps` for an image without procps: one command line per process.
PS = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done"


@pytest.fixture
def calc(r2e_tasks):
    return r2e_tasks["calc"]["row"]


def open_box(backend, row, store, mode="agent", **cfg):
    from tasks.sandbox import open_sandbox

    return open_sandbox(row, sandbox_cfg(backend, **cfg), store, mode=mode)


def test_run_reports_exit_code_output_and_time(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        r = sb.run("echo out; echo err >&2; pwd; id -u; exit 3")
        assert r.exit_code == 3 and not r.timed_out and not r.truncated
        # docker keeps stdout and stderr as two streams: their relative order is not guaranteed.
        assert sorted(r.output.split()) == sorted(["out", "err", "/testbed", "1000"])
        assert 0 < r.seconds < 10
        assert sb.run("python --version").output.startswith("Python 3")  # .venv/bin/python on PATH
        assert sb.run("git log --format=%s").output.strip() == "buggy state"
        assert sb.run("pwd", workdir="/testbed/calc").output.strip() == "/testbed/calc"
        assert sb.run("echo $PYTEST_DISABLE_PLUGIN_AUTOLOAD").output.strip() == "1"


def test_timeout_kills_the_command_and_its_children(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        t0 = time.monotonic()
        r = sb.run("echo started; (sleep 60 &); sleep 60", timeout=1)
        assert r.timed_out and r.exit_code is None and "started" in r.output
        assert time.monotonic() - t0 < 8
        assert sb.run("echo still usable").output.strip() == "still usable"
        # Nothing of the timed-out command is left running.
        assert sb.run(PS + " | grep -c '^sleep 60'").output.strip() == "0"


def test_output_is_capped_keeping_head_and_tail(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store, output_cap_bytes=4096) as sb:
        r = sb.run("echo BEGIN; head -c 5000000 /dev/zero | tr '\\0' x; echo; echo END")
        assert r.exit_code == 0 and r.truncated and r.output_bytes > 5_000_000
        assert r.output.startswith("BEGIN\n") and r.output.endswith("END\n")
        assert len(r.output) < 4096 + 100 and "bytes omitted" in r.output


def test_files_in_and_out(sandbox_backend, calc, sandbox_store, tmp_path):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.write_file("/testbed/new/dir/a.txt", "héllo\n")
        assert sb.read_file("/testbed/new/dir/a.txt") == "héllo\n"
        sb.write_file("/tmp/b.bin", bytes(range(256)))
        assert sb.run("wc -c < /tmp/b.bin").output.strip() == "256"
        (tmp_path / "tree" / "sub").mkdir(parents=True)
        (tmp_path / "tree" / "x.py").write_text("x = 1\n")
        (tmp_path / "tree" / "sub" / "y.py").write_text("y = 2\n")
        sb.copy_tree_in(tmp_path / "tree", "/testbed/copied")
        assert sb.read_file("/testbed/copied/sub/y.py") == "y = 2\n"
        # Copied files belong to the sandbox user: the agent can edit them.
        assert sb.run("echo z >> /testbed/copied/x.py && stat -c %u /testbed/copied/x.py").output.strip() == "1000"
        with pytest.raises(FileNotFoundError):
            sb.read_file("/testbed/missing.txt")
        assert sb.read_file("new/dir/a.txt") == "héllo\n"  # relative to /testbed
        sb.write_file("/testbed/odd name [1] (ü).py", "z = 3\n")  # argv, not a shell: any name works
        assert sb.read_file("/testbed/odd name [1] (ü).py") == "z = 3\n"
        with pytest.raises(ValueError):
            sb.read_file("nul\0byte")


def test_diff_is_the_patch_and_skips_environment_and_caches(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.run("sed -i 's/a - b/a + b/' calc/__init__.py && echo 'NEW = 1' > calc/new.py && "
               "python -c 'import calc' && mkdir -p r2e_tests && echo x > r2e_tests/t.py && "
               "echo x > run_tests.sh && echo junk > .venv/junk && printf '\\000\\001' > data.bin")
        patch = sb.diff()
    assert "-    return a - b\n+    return a + b" in patch
    assert "b/calc/new.py" in patch and "GIT binary patch" in patch  # data.bin, applicable
    for excluded in ("__pycache__", ".pyc", "r2e_tests", "run_tests.sh", ".venv"):
        assert excluded not in patch
    # The patch applies to a fresh copy of the task.
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.write_file("/tmp/p.diff", patch)
        r = sb.run("git apply /tmp/p.diff && cat calc/new.py")
        assert r.exit_code == 0 and r.output == "NEW = 1\n"


def test_agent_mode_cannot_see_hidden_tests(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store, mode="agent") as sb:
        r = sb.run("ls -A /root; ls /testbed; find / -xdev \\( -name 'run_tests.sh' -o -name r2e_tests \\) "
                   "2>/dev/null; echo done")
        assert "r2e_tests" not in r.output and "run_tests.sh" not in r.output and r.output.endswith("done\n")


def test_grading_mode_has_hidden_tests_read_only(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store, mode="grading") as sb:
        assert sb.run("ls /root/r2e_tests").output.split() == ["test_1.py"]
        r = sb.run("echo hacked > /root/r2e_tests/test_1.py || echo refused; rm -f /root/run_tests.sh || "
                   "echo refused; head -c 20 /root/run_tests.sh")
        assert r.output.count("refused") == 2 and "#!/bin/bash" in r.output


def test_no_network(sandbox_backend, calc, sandbox_store):
    # A listener on the host's loopback: a sandbox must not reach it (its loopback is its own).
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    try:
        with open_box(sandbox_backend, calc, sandbox_store) as sb:
            code = (f"import socket\nfor host in ('127.0.0.1', '1.1.1.1', '10.0.0.1'):\n"
                    f"    try:\n        socket.create_connection((host, {port}), timeout=2); print('CONNECTED', host)\n"
                    f"    except OSError as e:\n        print('blocked', host, e.errno)\n")
            sb.write_file("/tmp/net.py", code)
            r = sb.run("python /tmp/net.py")
            assert "CONNECTED" not in r.output and r.output.count("blocked") == 3
            assert sb.run("cat /proc/net/dev | grep -c ':'").output.strip() == "1"  # loopback only
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()


def test_memory_and_pids_limits(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store, memory_mb=128, pids_limit=32) as sb:
        r = sb.run("python -c 'x = bytearray(1024 * 1024 * 1024); print(\"ALLOCATED\")'")
        assert r.exit_code not in (0, None) and "ALLOCATED" not in r.output
        r = sb.run("for i in $(seq 100); do sleep 5 & done 2>&1 | head -1; echo spawned", timeout=10)
        assert "fork" in r.output.lower() or "resource temporarily unavailable" in r.output.lower()
        assert sb.run("echo alive").output.strip() == "alive"


def test_unprivileged_and_root_filesystem_read_only(sandbox_backend, calc, sandbox_store):
    marker = f"/tmp/rlvr-escape-{os.getpid()}"
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        r = sb.run(f"id -u; grep CapEff /proc/self/status; for p in /etc/passwd /usr/bin/python3 /x {marker}; do "
                   f"  (echo pwned >> $p) 2>/dev/null && echo WROTE $p || echo denied $p; done")
        lines = r.output.split("\n")
        assert lines[0] == "1000" and lines[1].split()[1] == "0000000000000000"
        assert "WROTE /etc/passwd" not in r.output and "WROTE /usr/bin/python3" not in r.output
        assert "WROTE /x" not in r.output
    assert not os.path.exists(marker)  # the sandbox's /tmp is its own


def test_bwrap_user_maps_to_an_unprivileged_host_uid(sandbox_rootfs, calc, sandbox_store):
    # Seen from the host, the sandbox's processes and files belong to HOST_UID, not root.
    from tasks.sandbox.bwrap import HOST_UID

    with open_box("bwrap", calc, sandbox_store) as sb:
        seen = {}

        def look():
            time.sleep(0.5)
            for pid in sb.cgroup.pids():
                try:
                    status = pathlib.Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                name = status.split("\n", 1)[0].split()[1]
                seen[name] = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])

        t = threading.Thread(target=look)
        t.start()
        sb.run("touch /testbed/mine; sleep 2")
        t.join()
        assert seen["sleep"] == HOST_UID and seen["bwrap"] == HOST_UID
        assert (sb.work / "testbed" / "mine").stat().st_uid == HOST_UID


def test_close_removes_everything_even_after_an_exception(sandbox_backend, calc, sandbox_store):
    from tasks.sandbox import leftovers

    with pytest.raises(RuntimeError):
        with open_box(sandbox_backend, calc, sandbox_store) as sb:
            sb.run("sleep 30 > /dev/null 2>&1 &")
            assert leftovers(docker=sandbox_backend == "docker")
            raise RuntimeError("boom")
    assert leftovers(docker=sandbox_backend == "docker") == []


def test_close_from_another_thread_stops_a_running_command(sandbox_backend, calc, sandbox_store):
    from tasks.sandbox import close_all

    from tasks.sandbox import SandboxError

    sb = open_box(sandbox_backend, calc, sandbox_store)
    closer = threading.Timer(1.0, close_all)
    closer.start()
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="closed"):
        sb.run("sleep 60", timeout=60)
    assert time.monotonic() - t0 < 15
    closer.join()


_CHILD = textwrap.dedent("""
    import sys, time
    import signal
    # A shell that starts jobs in the background (`cmd &`) hands them SIGINT ignored, and Python
    # then never raises KeyboardInterrupt: restore it, the test is about what Ctrl-C does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from tasks.storage import Store
    from tasks.sandbox import open_sandbox
    from tests.fixtures.sandbox import sandbox_cfg
    row = {row!r}
    store = Store({store!r})
    boxes = [open_sandbox(row, sandbox_cfg({backend!r}), store) for _ in range(2)]
    with boxes[0], boxes[1]:
        boxes[1].run("sleep 30 >/dev/null 2>&1 &")
        print("ready", flush=True)
        boxes[0].run("sleep 60", timeout=60)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill-then-reap"])
def test_interrupted_process_leaves_nothing(sandbox_backend, calc, sandbox_store, sig):
    from tasks.sandbox import leftovers, reap_stale

    code = _CHILD.format(repo=str(REPO), row=calc, store=sandbox_store.root, backend=sandbox_backend)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        docker = sandbox_backend == "docker"
        assert len(leftovers(child.pid, docker=docker)) >= 2
        child.send_signal(sig)
        child.wait(timeout=30)
        if sig == signal.SIGKILL:
            assert leftovers(child.pid, docker=docker)  # nobody cleaned up...
            reap_stale(docker=docker)  # ...until the reaper runs
        assert leftovers(child.pid, docker=docker) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_docker_reuse_hands_over_a_clean_container(docker_engine, r2e_tasks, sandbox_store):
    from tasks.sandbox import close_pools, leftovers

    calc, strutil = r2e_tasks["calc"]["row"], r2e_tasks["strutil"]["row"]
    try:
        with open_box("docker", calc, sandbox_store, mode="grading", docker_reuse=True) as sb:
            assert not sb.reused
            first = sb.container.id
            sb.run("echo dirty > /tmp/x; echo dirty > /dev/shm/y; echo new > /testbed/new.txt; chmod 000 calc; "
                   "setsid sleep 300 >/dev/null 2>&1 < /dev/null &")
        # Another task, another mode: the same container, with nothing of the first left in it.
        with open_box("docker", strutil, sandbox_store, mode="agent", docker_reuse=True) as sb:
            assert sb.reused and sb.container.id == first
            r = sb.run("ls -A /tmp /dev/shm /root; ls; git status --porcelain; " + PS + " | grep -c '^sleep'")
            assert r.output.split() == ["/dev/shm:", "/root:", "/tmp:", "strutil", "1"]  # 1: the keeper
        assert leftovers(docker=True) == []  # pooled containers are not leaks...
    finally:
        close_pools()
    assert not docker_engine.containers.list(all=True, filters={"id": first})  # ...and close_pools removes them


def test_docker_runs_a_real_r2e_gym_style_image(r2e_image_task, sandbox_store):
    row = r2e_image_task["row"]
    with open_box("docker", row, sandbox_store, mode="agent") as sb:
        r = sb.run("id -u; ls -A /root; ls /testbed; ls / | grep -c r2e_tests; which python")
        out = r.output.split()
        assert out[0] == "0" and "r2e_tests" not in out and "run_tests.sh" not in out
        assert out[-1] == "/root/.venv/bin/python"  # R2E-Gym's PATH and venv links
    with open_box("docker", row, sandbox_store, mode="grading") as sb:
        assert sb.run("ls /root/r2e_tests /root/run_tests.sh; test -e /r2e_tests || echo moved").output.split() == [
            "/root/run_tests.sh", "/root/r2e_tests:", "test_1.py", "moved"]


def test_bwrap_refuses_image_only_tasks(sandbox_rootfs, calc, sandbox_store):
    from tasks.sandbox import SandboxError

    with pytest.raises(SandboxError, match="docker"):
        open_box("bwrap", dict(calc, environment_uri=None), sandbox_store)
