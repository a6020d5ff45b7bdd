"""Hostile agents and tests against the sandbox itself (issue 30, items 3, 6, 7, 8), on both backends:
a forged final patch, a full host disk, an exec that never returns, a file silently cut and edited."""

import hashlib
import os
import re
import shutil
import threading
import time

import pytest

from tests.fixtures.sandbox import sandbox_cfg
from tests.test_sandbox import open_box

pytestmark = pytest.mark.usefixtures("no_sandbox_leaks")

FORGED = ("diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n+++ b/calc/__init__.py\n"
          "@@ -1 +1 @@\n-x\n+FORGED\n")
THE_FIX = "-    return a - b\n+    return a + b\n"
SPAM_AT_IMPORT = """
import os as _os, stat as _st


def _fifo(fd):
    try:
        return _st.S_ISFIFO(_os.fstat(fd).st_mode)
    except OSError:
        return False


_pipes = [fd for fd in range(3, 64) if _fifo(fd)]
while True:
    for fd in _pipes:
        try:
            _os.write(fd, b"spam\\n" * 1000)
        except OSError:
            pass
"""


@pytest.fixture
def calc(r2e_tasks):
    return r2e_tasks["calc"]["row"]


def bounded(fn, limit_s: float):
    """fn() in a thread; fails (instead of hanging the suite) if it has not returned in limit_s."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised below
            out["error"] = e

    t0 = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still running after {limit_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"], time.monotonic() - t0


# -- item 3: the final patch comes from a git the agent cannot replace or configure ---------------
def test_diff_ignores_a_fake_git_on_path(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        fake = f"#!/bin/sh\ncat <<'EOF'\n{FORGED}EOF\n"
        sb.write_file("/testbed/.venv/bin/git", fake)
        sb.run("chmod +x .venv/bin/git && sed -i 's/a - b/a + b/' calc/__init__.py")
        assert "FORGED" in sb.run("git diff").output  # PATH finds the agent's git first...
        patch = sb.diff()  # ...diff() does not
    assert THE_FIX in patch and "FORGED" not in patch
    assert patch.startswith("diff --git a/calc/__init__.py b/calc/__init__.py\n")


def test_diff_ignores_git_config_hooks_and_rewritten_history(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        # A filter driver that forges the staged content, an fsmonitor and external diff that run
        # the agent's code, a hooks dir; then the fix committed with it (the branch ref rewritten).
        r = sb.run("printf '#!/bin/sh\\ntouch /tmp/RAN; echo FORGED\\n' > /tmp/evil && chmod +x /tmp/evil && "
                   "git config filter.evil.clean /tmp/evil && git config filter.evil.smudge cat && "
                   "git config core.fsmonitor /tmp/evil && git config diff.external /tmp/evil && "
                   "git config core.hooksPath /tmp && echo '*.py filter=evil diff=evil' > .git/info/attributes && "
                   "sed -i 's/a - b/a + b/' calc/__init__.py && git -c core.fsmonitor=false commit -qam done && "
                   "git -c core.fsmonitor=false log --format=%s | head -1")
        assert r.ok and r.output.strip() == "done", r.output
        assert "FORGED" in sb.run("git show HEAD:calc/__init__.py").output  # the agent's git is poisoned
        sb.run("rm -f /tmp/RAN")
        patch = sb.diff()
        assert sb.run("test -e /tmp/RAN && echo RAN || echo clean").output.strip() == "clean"
    # The committed fix is still the change (against the task's own HEAD), unforged.
    assert THE_FIX in patch and "FORGED" not in patch and "info/attributes" not in patch


def test_diff_of_an_honest_episode_is_byte_identical_to_r2e_gyms(sandbox_backend, calc, sandbox_store):
    from tasks.sandbox.base import diff_script

    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.run("sed -i 's/a - b/a + b/' calc/__init__.py && echo 'NEW = 1' > calc/new.py && "
               "python -c 'import calc' && printf '\\000\\001' > data.bin && echo junk > .venv/junk && "
               "echo 'ignored.txt' > .gitignore && echo x > ignored.txt && "
               "mkdir -p r2e_tests && echo x > r2e_tests/t.py")
        patch = sb.diff()
        # R2E-Gym's get_patch: the agent's own git on its own index, as before this change.
        assert patch == sb.run(diff_script(trusted=False), output_cap=64 << 20).output
    assert THE_FIX in patch and "b/calc/new.py" in patch and "GIT binary patch" in patch
    assert "ignored.txt\n" in patch and "b/ignored.txt" not in patch and "r2e_tests" not in patch


# -- item 6: a disk quota on everything a sandbox can write -------------------------------------------
def _host_used() -> int:
    # Every filesystem a sandbox's writes could land on (bwrap's work dirs, docker's layers), once each.
    paths = [p for p in ("/", "/tmp", "/var/lib/docker") if os.path.isdir(p)]
    return sum(shutil.disk_usage(p).used for p in {os.stat(p).st_dev: p for p in paths}.values())


def _our_mounts() -> list[str]:
    # The backends' work dirs (bwrap: /tmp/rlvr-sandbox/<id>, docker: /tmp/rlvr-docker/<name>) of this process.
    tag = f"/rlvr-{os.getpid()}-"
    return [ln for ln in open("/proc/self/mounts").read().splitlines() if tag in ln.split(" ")[1]]


def test_disk_quota_gives_enospc_not_a_full_host_disk(sandbox_backend, calc, sandbox_store):
    quota = 128
    before = _host_used()
    sb = open_box(sandbox_backend, calc, sandbox_store, disk_mb=quota)
    try:
        assert _our_mounts()
        for where in ("/tmp", "/testbed", "/var/tmp"):
            # Twice the quota, in one go; the next write (after the first filled it) fails at once.
            r, seconds = bounded(lambda: sb.run(f"dd if=/dev/zero of={where}/fill bs=1M count={2 * quota} 2>&1; "
                                                f"echo more > {where}/more; echo SIZE $(du -sm {where}/fill)",
                                                timeout=60), 90)
            assert "No space left on device" in r.output, r.output
            size = int(re.search(r"SIZE (\d+)", r.output).group(1))
            assert size <= quota + 2 and seconds < 60  # + the task's own files
            if where == "/tmp":
                assert sb.diff() == ""  # the final patch needs no room of the agent's
            sb.run(f"rm -f {where}/fill")
        assert sb.run("echo still fine > /tmp/ok && cat /tmp/ok").output.strip() == "still fine"
        # A full quota on the host would be >= 3 x 2 x 128 MB; leave room for other writers here.
        assert _host_used() - before < 2 * quota * 1024 * 1024
    finally:
        sb.close()
    assert _our_mounts() == []


# -- item 7: a command that keeps printing past its timeout returns ------------------------------------
def test_endless_output_past_the_timeout_returns(sandbox_backend, calc, sandbox_store):
    with open_box(sandbox_backend, calc, sandbox_store, output_cap_bytes=8192) as sb:
        r, seconds = bounded(lambda: sb.run("yes spam", timeout=5), 60)
        assert r.timed_out and r.exit_code is None and seconds < 15
        assert r.truncated and len(r.output) < 8192 + 100 and r.output.startswith("spam\n")
        assert sb.run("echo usable").output.strip() == "usable"


def test_grading_a_test_that_prints_without_end_returns(sandbox_backend, calc, sandbox_store):
    from tasks.grading import grade_patch

    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        # At import, write for ever to every pipe the test process holds: pytest's saved stdout
        # among them, so the output gets past its capture to the sandbox's stream.
        sb.write_file("/testbed/calc/__init__.py", sb.read_file("calc/__init__.py") + SPAM_AT_IMPORT)
        patch = sb.diff()
    cfg = sandbox_cfg(sandbox_backend, test_timeout_s=5, command_timeout_s=10, infra_retries=0)
    res, seconds = bounded(lambda: grade_patch(calc, patch, cfg, sandbox_store), 90)
    assert res.grading_status == "graded" and res.reward == 0.0 and seconds < 30, res
    assert "timed out" in (res.error or "")


# -- item 8: read_file refuses a file over its cap; the editor writes nothing ----------------------------
def test_file_over_the_read_cap_is_an_error_and_never_edited(sandbox_backend, calc, sandbox_store):
    from tasks.agent.tools import ToolBox, ToolError
    from tasks.sandbox import FileTooLargeError

    with open_box(sandbox_backend, calc, sandbox_store) as sb:
        sb.read_cap_bytes = 4096  # the real cap is 256 MB
        sb.write_file("/testbed/at_cap.txt", "a" * 4095 + "\n")
        assert sb.read_file("/testbed/at_cap.txt") == "a" * 4095 + "\n"
        big = ("line\n" * 820)[:4097]
        sb.write_file("/testbed/big.txt", big)
        sha = hashlib.sha256(big.encode()).hexdigest()
        with pytest.raises(FileTooLargeError, match="4097 bytes, over the 4096-byte limit") as e:
            sb.read_file("/testbed/big.txt")
        assert e.value.path == "/testbed/big.txt" and e.value.size == 4097 and e.value.cap == 4096
        box = ToolBox(sb, command_timeout_s=10)
        for args in ({"command": "view"}, {"command": "str_replace", "old_str": "line", "new_str": "x"},
                     {"command": "insert", "insert_line": 1, "new_str": "x"}):
            with pytest.raises(ToolError, match="big.txt is 4097 bytes"):
                box.call("file_editor", dict(args, path="/testbed/big.txt"))
        assert sb.run("sha256sum big.txt").output.split()[0] == sha


def test_docker_reuse_resets_the_quota_and_the_pristine_git(docker_engine, r2e_tasks, sandbox_store):
    from tasks.sandbox import close_pools, leftovers

    calc, strutil = r2e_tasks["calc"]["row"], r2e_tasks["strutil"]["row"]
    try:
        with open_box("docker", calc, sandbox_store, mode="grading", docker_reuse=True, disk_mb=32) as sb:
            first = sb.container.id
            r = sb.run("dd if=/dev/zero of=/var/tmp/fill bs=1M count=64 2>&1; echo x > /run/lock/y; "
                       "sed -i 's/a - b/a + b/' calc/__init__.py")
            assert "No space left on device" in r.output
        # Another task and quota: nothing of the first is left, diff() compares with strutil's own .git.
        with open_box("docker", strutil, sandbox_store, mode="agent", docker_reuse=True, disk_mb=64) as sb:
            assert sb.reused and sb.container.id == first
            assert sorted(sb.run("ls -A /var/tmp /run/lock /root /tmp").output.split()) == [
                "/root:", "/run/lock:", "/tmp:", "/var/tmp:"]
            assert 64 <= int(sb.run("df -m /tmp | tail -1").output.split()[1]) < 70
            sb.run("echo '# changed' >> strutil/__init__.py")
            patch = sb.diff()
        assert patch.startswith("diff --git a/strutil/__init__.py b/strutil/__init__.py\n")
        assert patch.endswith("+# changed\n") and patch.count("diff --git") == 1
        assert leftovers(docker=True) == []  # the pooled container's tmpfs is not a leak...
    finally:
        close_pools()
    assert _our_mounts() == []  # ...and close_pools unmounts it
