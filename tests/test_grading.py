"""Grading end to end on both backends: hand-written R2E-Gym tasks, hostile patches, infra
failures, the REWARDS table, and clean-up."""

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.fixtures.sandbox import sandbox_cfg

pytestmark = pytest.mark.usefixtures("no_sandbox_leaks")
REPO = pathlib.Path(__file__).resolve().parents[1]
TASKS = ["calc", "strutil", "inventory"]


def grade(backend, task, patch, store, **cfg):
    from tasks.grading import grade_patch

    return grade_patch(task["row"], patch, sandbox_cfg(backend, **cfg), store)


@pytest.mark.parametrize("name", TASKS)
def test_gold_patch_scores_one_and_empty_patch_zero(sandbox_backend, r2e_tasks, sandbox_store, name):
    task = r2e_tasks[name]
    expected = json.loads(task["row"]["expected_output_json"])
    gold = grade(sandbox_backend, task, task["gold"], sandbox_store)
    assert (gold.grading_status, gold.reward, gold.patch_applied, gold.error) == ("graded", 1.0, True, None), gold.error
    assert gold.test_statuses == expected  # includes expected FAILED / ERROR tests (strutil, inventory)
    assert gold.attempts == 1 and gold.test_seconds > 0 and gold.total_seconds >= gold.test_seconds
    empty = grade(sandbox_backend, task, "", sandbox_store)
    assert (empty.grading_status, empty.reward, empty.patch_applied) == ("graded", 0.0, True)
    assert empty.test_statuses != expected and set(empty.test_statuses) == set(expected)


def test_real_r2e_image_row_grades_on_docker(r2e_image_task, sandbox_store):
    assert r2e_image_task["row"]["environment_uri"] is None
    assert grade("docker", r2e_image_task, r2e_image_task["gold"], sandbox_store).reward == 1.0
    assert grade("docker", r2e_image_task, "", sandbox_store).reward == 0.0


def test_grade_rollouts_builds_a_valid_rewards_table(sandbox_backend, r2e_tasks, sandbox_store):
    from schemas.tables import REWARDS
    from tasks.grading import grade_rollouts

    missing = dict(r2e_tasks["calc"]["row"], instance_id="ghost", environment_uri=None,
                   docker_image="namanjain12/does-not-exist:0")
    items = [(f"r{i}", "run-x", 3, r2e_tasks[name]["row"], patch)
             for i, (name, patch) in enumerate([("calc", r2e_tasks["calc"]["gold"]), ("calc", ""),
                                                ("strutil", r2e_tasks["strutil"]["gold"]),
                                                ("inventory", "not a diff\n")])]
    items.append(("r4", "run-x", 3, missing, r2e_tasks["calc"]["gold"]))
    t = grade_rollouts(items, sandbox_cfg(sandbox_backend, concurrency=3, infra_retries=1), sandbox_store)
    REWARDS.validate(t)
    rows = t.to_pylist()
    assert [r["rollout_id"] for r in rows] == ["r0", "r1", "r2", "r3", "r4"]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 0.0, None]
    assert [r["grading_status"] for r in rows] == ["graded"] * 4 + ["infra_error"]
    assert rows[3]["patch_applied"] is False and rows[3]["error"].startswith("patch_apply_failed")
    assert rows[4]["attempts"] == 2 and rows[4]["error"].startswith("infra_error")
    assert json.loads(rows[0]["test_statuses"]) == json.loads(r2e_tasks["calc"]["row"]["expected_output_json"])
    assert all(r["step"] == 3 and r["run_id"] == "run-x" for r in rows)


# -- hostile patches --------------------------------------------------------------------------
def calc_patch(body: str, fix: bool = False) -> str:
    """A patch that appends `body` to calc/__init__.py (run when the tests import calc)."""
    old = ['"""Tiny arithmetic helpers."""', "", "", "def add(a, b):", "    return a - b", "", "",
           "def mean(values):", "    if not values:", '        raise ValueError("mean of empty sequence")',
           "    return sum(values) / len(values)"]
    new = list(old)
    if fix:
        new[4] = "    return a + b"
    new += body.rstrip("\n").split("\n")
    lines = [" " + ln if ln else " " for ln in old[:4]]
    lines += ["-" + old[4], "+" + new[4]] if fix else [" " + old[4]]
    lines += [" " + ln if ln else " " for ln in old[5:]] + ["+" + ln for ln in new[len(old):]]
    return ("diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n+++ b/calc/__init__.py\n"
            f"@@ -1,{len(old)} +1,{len(new)} @@\n" + "\n".join(lines) + "\n")


HOSTILE = {
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)\n",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "allocate_4gb": "_hog = bytearray(4 * 1024 ** 3)\n",
    "loop_forever": "while True:\n    pass\n",
    "write_outside": ("import shutil\nfor _p in ['/etc/passwd', '/usr/lib/python3/dist-packages/pwned.pth', '/pwned',\n"
                      "           '/root/r2e_tests/test_1.py', '/root/run_tests.sh', '/tmp/pwned']:\n"
                      "    try:\n        open(_p, 'a').write('pwned')\n    except OSError:\n        pass\n"
                      "shutil.rmtree('/root/r2e_tests', ignore_errors=True)\n"),
    # Printed inside a test call: pytest shows that output in its report (import-time output it drops).
    "print_100mb": ("_add = add\n\n\ndef add(a, b):\n    import sys\n"
                    "    sys.stdout.write('x' * (100 * 1024 * 1024))\n    return _add(a, b)\n"),
}


def _host_fingerprint(sandbox_store, row) -> dict:
    from tasks.sandbox import image, resolve_environment

    env = resolve_environment(row, sandbox_store)
    files = [image.rootfs_path() / "etc" / "passwd", env.hidden / "r2e_tests" / "test_1.py",
             env.hidden / "run_tests.sh"]
    out = {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    out["host /tmp/pwned"] = os.path.exists("/tmp/pwned")
    out["rootfs /pwned"] = (image.rootfs_path() / "pwned").exists()
    return out


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_patch_is_contained(sandbox_backend, r2e_tasks, sandbox_store, kind):
    task = r2e_tasks["calc"]
    before = _host_fingerprint(sandbox_store, task["row"])
    t0 = time.monotonic()
    # Room for pytest to hold 100 MB of captured output: that case is about the output cap.
    memory = 1536 if kind == "print_100mb" else 256
    # Short for the cases that can only end by the clock; generous for the rest (a loaded machine).
    timeout = 4 if kind in ("fork_bomb", "loop_forever") else 30
    res = grade(sandbox_backend, task, calc_patch(HOSTILE[kind]), sandbox_store,
                memory_mb=memory, pids_limit=64, test_timeout_s=timeout, command_timeout_s=10)
    assert (res.grading_status, res.reward, res.patch_applied) == ("graded", 0.0, True), res.error
    assert time.monotonic() - t0 < 45
    if kind in ("fork_bomb", "loop_forever"):
        assert res.error.startswith("tests timed out")
    if kind == "print_100mb":
        assert "bytes omitted" in res.test_output and len(res.test_output) < 9 * 1024 * 1024
    if kind == "write_outside":
        # With the fix, reward 1: the hidden tests survived the attempt to edit and delete them.
        fixed = grade(sandbox_backend, task, calc_patch(HOSTILE[kind], fix=True), sandbox_store)
        assert fixed.reward == 1.0
    assert _host_fingerprint(sandbox_store, task["row"]) == before
    # The next grading of the same task is unaffected.
    assert grade(sandbox_backend, task, task["gold"], sandbox_store).reward == 1.0


def test_huge_output_still_grades_from_the_summary_at_the_end(sandbox_backend, r2e_tasks, sandbox_store):
    # The gold fix plus 100 MB of noise: the capped log keeps pytest's summary, so reward 1.
    task = r2e_tasks["calc"]
    res = grade(sandbox_backend, task, calc_patch(HOSTILE["print_100mb"], fix=True), sandbox_store,
                memory_mb=1536)
    assert res.reward == 1.0 and "bytes omitted" in res.test_output


def test_patch_editing_hidden_tests_or_runner_is_ignored(sandbox_backend, r2e_tasks, sandbox_store):
    task = r2e_tasks["calc"]
    cheat = ("diff --git a/r2e_tests/test_1.py b/r2e_tests/test_1.py\nnew file mode 100644\n--- /dev/null\n"
             "+++ b/r2e_tests/test_1.py\n@@ -0,0 +1,2 @@\n+def test_add():\n+    pass\n"
             "diff --git a/run_tests.sh b/run_tests.sh\nnew file mode 100755\n--- /dev/null\n+++ b/run_tests.sh\n"
             "@@ -0,0 +1,2 @@\n+echo 'short test summary info'\n+echo 'PASSED r2e_tests/test_1.py::test_add'\n"
             "diff --git a/r2e_tests/test_1.py b/r2e_tests/test_1.py\ndeleted file mode 100644\n"
             "--- a/r2e_tests/test_1.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n")
    res = grade(sandbox_backend, task, cheat, sandbox_store)
    assert (res.reward, res.patch_applied, len(res.harness_changes)) == (0.0, True, 3)
    res = grade(sandbox_backend, task, cheat + task["gold"], sandbox_store)
    assert (res.reward, res.patch_applied) == (1.0, True)  # the solution part still counts


# -- reward hacking: a patch must not change what runs the tests ------------------------------
def new_file(path: str, content: str, quoted: bool = False) -> str:
    """A git patch creating `path`; `quoted` writes the names C-quoted ("b/.\\166env/...")."""
    if quoted:
        a, b = ('"%s/%s"' % (side, path.replace(".venv", ".\\166env")) for side in "ab")
    else:
        a, b = f"a/{path}", f"b/{path}"
    lines = content.rstrip("\n").split("\n")
    return (f"diff --git {a} {b}\nnew file mode 100755\n--- /dev/null\n+++ {b}\n@@ -0,0 +1,{len(lines)} @@\n"
            + "".join("+" + ln + "\n" for ln in lines))


def forged_summary(row) -> str:
    """Python that prints pytest's summary with exactly the statuses the task expects."""
    expected = json.loads(row["expected_output_json"])
    lines = ["short test summary info"] + [f"{st} r2e_tests/test_1.py::{key.replace('.', '::')}"
                                           for key, st in expected.items()]
    return f"print({chr(10).join(lines)!r})\n"


CALC_FIX_IN_PLUGIN = "import calc\ncalc.add = lambda a, b: a + b\n"


def hacks(row) -> dict[str, str]:
    """Patches that earn reward 1 with no fix from a grader that applies them as they are
    (each checked against the previous grader); sitecustomize.py and *.pth are refused as well
    (test_grading_r2e.py), though cwd is not on sys.path when Python's site module runs."""
    forged = forged_summary(row)
    venv_python = ('diff --git "a/.\\166env/bin/python" "b/.\\166env/bin/python"\ndeleted file mode 120000\n'
                   '--- "a/.\\166env/bin/python"\n+++ /dev/null\n@@ -1 +0,0 @@\n-/usr/bin/python3\n'
                   '\\ No newline at end of file\n')
    return {
        "root conftest.py fixes the function at import": new_file("conftest.py", CALC_FIX_IN_PLUGIN),
        "pytest.py shadows pytest": new_file("pytest.py", forged),
        "C-quoted .venv/bin/python replaced": venv_python + new_file(
            ".venv/bin/python", "#!/bin/sh\n/usr/bin/python3 -c " + json.dumps(forged.strip()), quoted=True),
        "setup.cfg adds a plugin": new_file("calc_plugin.py", CALC_FIX_IN_PLUGIN)
        + new_file("setup.cfg", "[tool:pytest]\naddopts = -p calc_plugin\n"),
        "pytest.ini adds a plugin": new_file("calc_plugin.py", CALC_FIX_IN_PLUGIN)
        + new_file("pytest.ini", "[pytest]\naddopts = -p calc_plugin\n"),
        "git-ignored pytest.py": new_file(".gitignore", "pytest.py\n") + new_file("pytest.py", forged),
    }


@pytest.mark.parametrize("hack", sorted(hacks({"expected_output_json": "{}"})))
def test_patch_that_changes_the_test_harness_earns_nothing(sandbox_backend, r2e_tasks, sandbox_store, hack):
    task = r2e_tasks["calc"]
    patch = hacks(task["row"])[hack]
    res = grade(sandbox_backend, task, patch, sandbox_store)
    assert (res.grading_status, res.reward) == ("graded", 0.0), (res.error, res.test_output[-2000:])
    assert res.harness_changes, "the removed changes are reported"
    # The honest part of a patch still counts: the same hack plus the real fix scores 1.
    fixed = grade(sandbox_backend, task, patch + task["gold"], sandbox_store)
    assert (fixed.reward, fixed.harness_changes) == (1.0, res.harness_changes), fixed.test_output[-2000:]


def test_repo_config_outside_its_pytest_section_may_change(sandbox_rootfs, r2e_tasks, sandbox_store):
    task = r2e_tasks["calc"]
    res = grade("bwrap", task, new_file("setup.cfg", "[metadata]\nname = calc\n") + task["gold"], sandbox_store)
    assert (res.reward, res.harness_changes) == (1.0, [])


def test_patch_that_does_not_apply_is_a_clear_zero(sandbox_backend, r2e_tasks, sandbox_store):
    task = r2e_tasks["calc"]
    for patch in ("this is not a diff\n", task["gold"].replace("return a - b", "return a * b")):
        res = grade(sandbox_backend, task, patch, sandbox_store)
        assert (res.grading_status, res.reward, res.patch_applied) == ("graded", 0.0, False)
        assert res.error.startswith("patch_apply_failed: ") and len(res.error) > len("patch_apply_failed: ")
        assert res.test_statuses == {}


# -- infra failures: retried, never a zero ----------------------------------------------------
class _FakeBox:
    def __init__(self, script):
        self.script = script

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def write_file(self, path, content):
        pass

    def run(self, cmd, timeout=None, **kw):
        return self.script(cmd)


def _fake_open(monkeypatch, behaviours):
    """Each call of open_sandbox takes the next behaviour: an exception to raise or a command script."""
    import tasks.grading.grader as grader

    calls = iter(behaviours)

    def fake(*a, **k):
        b = next(calls)
        if isinstance(b, Exception):
            raise b
        return _FakeBox(b)

    monkeypatch.setattr(grader, "open_sandbox", fake)


def _ok_script(cmd):
    from tasks.sandbox import CommandResult

    out = ("short test summary info\nPASSED r2e_tests/test_1.py::test_a\n" if "bash /root/run_tests.sh;" in cmd else "")
    return CommandResult(exit_code=0, output=out, timed_out=False, seconds=0.01)


ROW = {"instance_id": "t", "expected_output_json": json.dumps({"test_a": "PASSED"})}


def test_start_failure_is_retried_then_graded(monkeypatch):
    from tasks.grading import grade_patch
    from tasks.sandbox import SandboxInfraError

    _fake_open(monkeypatch, [SandboxInfraError("engine hiccup"), _ok_script])
    res = grade_patch(ROW, "", sandbox_cfg("bwrap", infra_retries=2), None)
    assert (res.grading_status, res.reward, res.attempts) == ("graded", 1.0, 2)


def test_persistent_infra_failure_is_infra_error_never_zero(monkeypatch):
    from tasks.grading import grade_patch
    from tasks.sandbox import SandboxInfraError

    _fake_open(monkeypatch, [SandboxInfraError("no engine")] * 3)
    res = grade_patch(ROW, "", sandbox_cfg("bwrap", infra_retries=2), None)
    assert (res.grading_status, res.reward, res.attempts) == ("infra_error", None, 3)
    assert "no engine" in res.error


def test_setup_timeout_and_harness_kill_are_infra_errors(monkeypatch):
    from tasks.grading import grade_patch
    from tasks.sandbox import CommandResult

    def apply_times_out(cmd):
        if "git apply" in cmd:
            return CommandResult(exit_code=None, output="", timed_out=True, seconds=30)
        return _ok_script(cmd)

    def placing_killed(cmd):
        if "rm -rf r2e_tests" in cmd:
            return CommandResult(exit_code=137, output="Killed", timed_out=False, seconds=0.1)
        return _ok_script(cmd)

    _fake_open(monkeypatch, [apply_times_out, placing_killed])
    patch = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
    res = grade_patch(ROW, patch, sandbox_cfg("bwrap", infra_retries=1), None)
    assert (res.grading_status, res.reward, res.attempts) == ("infra_error", None, 2)
    assert "set-up failed" in res.error


def test_test_timeout_is_a_legitimate_zero(monkeypatch):
    from tasks.grading import grade_patch
    from tasks.sandbox import CommandResult

    def tests_hang(cmd):
        if "bash /root/run_tests.sh;" in cmd:
            return CommandResult(exit_code=None, output="short test summary info\nPASSED x::test_a\n",
                                 timed_out=True, seconds=300)
        return _ok_script(cmd)

    _fake_open(monkeypatch, [tests_hang])
    res = grade_patch(ROW, "", sandbox_cfg("bwrap"), None)
    assert (res.grading_status, res.reward, res.attempts, res.test_statuses) == ("graded", 0.0, 1, {})


def test_real_infra_failure_on_the_backend(sandbox_backend, r2e_tasks, sandbox_store, monkeypatch):
    task = r2e_tasks["calc"]
    if sandbox_backend == "bwrap":
        from tasks.sandbox import bwrap

        monkeypatch.setattr(bwrap, "HOST_UID", 0)  # bwrap as root with --uid refuses the setup...
        monkeypatch.setattr(bwrap.BwrapSandbox, "_bwrap_args",
                            lambda self, w, e: ["bwrap", "--ro-bind", "/nonexistent", "/"])
    else:
        task = dict(task, row=dict(task["row"], environment_uri=None, docker_image="namanjain12/absent:1"))
    res = grade(sandbox_backend, task, task["gold"], sandbox_store, infra_retries=1)
    assert (res.grading_status, res.reward, res.attempts) == ("infra_error", None, 2), res.error


# -- interruption -----------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import sys
    import signal
    # A shell that starts jobs in the background (`cmd &`) hands them SIGINT ignored, and Python
    # then never raises KeyboardInterrupt: restore it, the test is about what Ctrl-C does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from tasks.storage import Store
    from tasks.grading import grade_rollouts
    from tests.fixtures.sandbox import sandbox_cfg
    row, patch = {row!r}, {patch!r}
    items = [(f"r{{i}}", "run", 1, row, patch) for i in range(6)]
    print("ready", flush=True)
    grade_rollouts(items, sandbox_cfg({backend!r}, concurrency=2, test_timeout_s=60), Store({store!r}))
""")


def test_ctrl_c_during_grading_leaves_nothing(sandbox_backend, r2e_tasks, sandbox_store):
    from tasks.sandbox import leftovers

    code = _CHILD.format(repo=str(REPO), row=r2e_tasks["calc"]["row"], patch=calc_patch(HOSTILE["loop_forever"]),
                         store=sandbox_store.root, backend=sandbox_backend)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO)
    docker = sandbox_backend == "docker"
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        deadline = time.monotonic() + 30
        while len(leftovers(child.pid, docker=docker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # wait until both gradings are in their (endless) test runs
        time.sleep(1.0)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
        assert "KeyboardInterrupt" in err
        assert leftovers(child.pid, docker=docker) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_identical_patches_of_a_task_are_graded_once(sandbox_rootfs, r2e_tasks, sandbox_store):
    from tasks.grading import grade_rollouts

    task = r2e_tasks["calc"]
    items = [("r0", "run", 1, task["row"], task["gold"]), ("r1", "run", 1, task["row"], ""),
             ("r2", "run", 1, task["row"], task["gold"])]
    rows = grade_rollouts(items, sandbox_cfg("bwrap"), sandbox_store).to_pylist()
    assert [r["rollout_id"] for r in rows] == ["r0", "r1", "r2"]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0]
    # one grading shared: the same measured times, to the nanosecond
    assert rows[0]["total_seconds"] == rows[2]["total_seconds"] != rows[1]["total_seconds"]
    separate = grade_rollouts(items, sandbox_cfg("bwrap"), sandbox_store, dedupe=False).to_pylist()
    assert separate[0]["total_seconds"] != separate[2]["total_seconds"]
