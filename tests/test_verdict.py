"""Verdicts from outside the tested code (tasks/grading/verdict.py): patches that touch only the
package's own source and forged a pass from a log-only grader earn 0, flagged `tampering`, on both
backends; honest patches keep R2E-Gym's exact reward."""

import json
import textwrap

import pytest

from tasks.grading.verdict import Evidence, Recorder, cut_log, disagreements, read_record
from tests.test_grading import calc_patch, grade, new_file

pytestmark = pytest.mark.usefixtures("no_sandbox_leaks")

FORGED_LINES = "".join(f"PASSED r2e_tests/test_1.py::{k}\\n" for k in
                       ("TestAdd::test_add", "TestAdd::test_add_negative", "test_mean", "test_mean_empty"))

FORGERIES = {
    # After pytest printed its summary: R2E-Gym's parser reads to the end, so the later line wins.
    "atexit summary lines": textwrap.dedent(f"""\
        import atexit as _atexit, os as _os
        _atexit.register(lambda: _os.write(1, b"short test summary info\\n{FORGED_LINES}"))
        """),
    # Every report says passed, from the package's own module at import.
    "TestReport.from_item_and_call wrapped": textwrap.dedent("""\
        import _pytest.reports as _reports
        _made = _reports.TestReport.from_item_and_call.__func__
        def _passed(cls, item, call):
            rep = _made(cls, item, call)
            rep.outcome, rep.longrepr = "passed", None
            return rep
        _reports.TestReport.from_item_and_call = classmethod(_passed)
        """),
    # A plugin registered at run time that rewrites every report after pytest made it.
    "plugin registered at import": textwrap.dedent("""\
        import gc as _gc
        import _pytest.config as _cfg
        class _Forge:
            def pytest_runtest_logreport(self, report):
                report.outcome = "passed"
        for _o in _gc.get_objects():
            if isinstance(_o, _cfg.Config):
                _o.pluginmanager.register(_Forge(), "forge")
                break
        """),
}

# attr.py at the repo root: the image's pytest imports `attr` at start-up, before any test.
ATTR_SHADOW = textwrap.dedent("""\
    import sys
    _me = sys.modules.pop("attr")
    _path = sys.path[:]
    sys.path[:] = [p for p in sys.path if p not in ("", ".", "/testbed")]
    import attr as _real
    sys.path[:] = _path
    sys.modules["attr"] = _real
    globals().update(vars(_real))
    """)


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_forged_pass_earns_zero_and_is_flagged(sandbox_backend, r2e_tasks, sandbox_store, kind):
    task = r2e_tasks["calc"]
    res = grade(sandbox_backend, task, calc_patch(FORGERIES[kind]), sandbox_store)
    assert (res.grading_status, res.reward) == ("graded", 0.0), (res.error, res.test_output[-1500:])
    assert res.tampering and res.error.startswith("tampering:"), (res.tampering, res.test_output[-1500:])
    assert res.harness_changes == []  # nothing the harness rule protects was touched


def test_module_shadowing_what_pytest_imports_at_start_up_is_removed(sandbox_backend, r2e_tasks, sandbox_store):
    task = r2e_tasks["calc"]
    res = grade(sandbox_backend, task, new_file("attr.py", ATTR_SHADOW), sandbox_store)
    assert (res.grading_status, res.reward) == ("graded", 0.0), res.error
    assert res.harness_changes == ["attr.py: shadows the module attr"]
    fixed = grade(sandbox_backend, task, new_file("attr/__init__.py", ATTR_SHADOW) + task["gold"], sandbox_store)
    assert (fixed.reward, fixed.harness_changes, fixed.tampering) == (1.0, ["attr/: shadows the module attr"], [])


def test_honest_patches_keep_r2e_reward_and_no_flag(sandbox_backend, r2e_tasks, sandbox_store):
    task = r2e_tasks["calc"]
    honest_late_output = "import atexit as _a\n_a.register(print, 'bye')\n"
    for patch, reward in ((task["gold"], 1.0), ("", 0.0), (calc_patch(honest_late_output, fix=True), 1.0)):
        res = grade(sandbox_backend, task, patch, sandbox_store)
        assert (res.reward, res.tampering, res.verdict_loaded) == (reward, [], True), res.error


# -- the evidence, as functions ---------------------------------------------------------------
def test_cut_log_drops_what_came_after_pytests_end():
    rec = Recorder()
    log = f"== 1 failed in 0.1s ==\n{rec.end_marker}\nPASSED t.py::x\n"
    assert cut_log(log, rec) == ("== 1 failed in 0.1s ==", "PASSED t.py::x\n")
    assert cut_log(log.replace(rec.nonce, "f" * 32), rec) == (log.replace(rec.nonce, "f" * 32), "")


def test_record_lines_without_the_nonce_are_ignored():
    rec = Recorder()
    lines = [f"{rec.nonce} " + json.dumps(e) for e in (
        {"event": "start", "testbed_modules": [], "foreign": []},
        {"event": "test", "nodeid": "r2e_tests/t.py::C::x", "status": "FAILED"},
        {"event": "end", "exitstatus": 1})]
    forged = "0" * 32 + " " + json.dumps({"event": "test", "nodeid": "r2e_tests/t.py::C::x", "status": "PASSED"})
    ev = read_record("\n".join(lines + [forged, "garbage", f"{rec.nonce} {{not json"]), rec.nonce)
    assert (ev.loaded, ev.ended, ev.tests) == (True, True, {"C.x": {"FAILED"}})


def test_disagreements_name_what_disagreed():
    ev = Evidence(loaded=True, ended=True, tests={"x": {"FAILED"}, "y": {"PASSED"}},
                  testbed_modules=[("attr", "attr/__init__.py")], plugins=[("forge", "calc/__init__.py")])
    got = disagreements({"x": "PASSED", "y": "PASSED", "z": "FAILED"}, ev, "", {"attr/", "calc/__init__.py"})
    assert got == ["pytest's start-up loaded attr/__init__.py (module attr) from the patch",
                   "the patch's calc/__init__.py registered a pytest plugin (forge)",
                   "the log says x PASSED, pytest reported FAILED"]
    assert disagreements({"y": "PASSED", "x": "FAILED"}, ev, "", set()) == []
    assert disagreements({}, ev, "short test summary info\nPASSED a.py::y\n", set()) == [
        "output after pytest's session ended claims 1 passed tests"]


def test_a_test_that_runs_pytest_itself_keeps_its_verdict(sandbox_backend, r2e_tasks, sandbox_store):
    """The recorder is for the grading's session only: a hidden test that runs pytest in a subprocess
    (as plugin and CLI repositories' tests do) sees neither its -p option nor its path."""
    task = r2e_tasks["calc"]
    body = textwrap.dedent("""\
        def _pytest_in_a_subprocess():
            import os, subprocess, sys
            assert "rlvr_verdict" not in os.environ.get("PYTEST_ADDOPTS", "") + os.environ.get("PYTHONPATH", "")
            return subprocess.run([sys.executable, "-m", "pytest", "--version"], capture_output=True).returncode
        _add = add
        def add(a, b):
            assert _pytest_in_a_subprocess() == 0
            return _add(a, b)
        """)
    res = grade(sandbox_backend, task, calc_patch(body, fix=True), sandbox_store)
    assert (res.reward, res.tampering) == (1.0, []), (res.error, res.test_output[-1500:])
