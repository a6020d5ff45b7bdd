"""The verdict recorder: a pytest plugin the grader loads into the hidden tests' run (tasks/grading/verdict.py).

It runs inside the sandbox, in pytest's own process, under the image's Python (any 3.x pytest
supports, so no newer syntax). It is imported with `-p` from a directory outside /testbed,
under a module name that holds the grading's nonce, before pytest imports any repository code.
From then on it writes evidence the grader trusts more than the log, one line each, prefixed
by the nonce, to a record file (written as it happens, so nothing later can take it back):

- `start`: modules already loaded from /testbed (nothing of the repository should be: a file
  that is, was loaded by pytest's own start-up, e.g. a module shadowing one of its imports),
  pytest functions whose code is the repository's, and the top-level modules loaded so far;
- `test`: each test report's status as pytest made it, in the -rA vocabulary;
- `changed`: pytest or pluggy functions replaced since start-up (checked at every report);
- `plugin`: plugins registered after start-up, with the file that defines them;
- `end`: the session finished; then a marker line on pytest's stdout, after its last line,
  so the grader can drop whatever the process printed after the session (atexit handlers).

The nonce is only in memory (this file and its bytecode are deleted once imported), in closures
rather than a named attribute. Code in the same process that goes looking for it there can find
it: this raises the bar against forging, the integrity checks above catch the known ways.
"""

import json
import os
import sys
import types

if not __name__.startswith("rlvr_verdict_"):  # anywhere else, importing it would delete this very file
    raise ImportError(f"{__file__} is the grader's pytest plugin: only a grading in a sandbox loads it "
                      "(as rlvr_verdict_<nonce>, tasks/grading/verdict.py)")

TESTBED = "/testbed/"
WATCHED = ("_pytest.reports", "_pytest.runner", "_pytest.terminal", "_pytest.skipping", "_pytest.python",
           "_pytest.main", "_pytest.outcomes", "_pytest.capture", "_pytest.unittest", "_pytest.nodes",
           "pluggy._callers", "pluggy._hooks", "pluggy._manager", "pluggy._result",
           "pluggy.callers", "pluggy.hooks", "pluggy.manager")

_here = os.path.dirname(os.path.abspath(__file__))
_record = os.open(os.path.join(_here, "record"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
_stdout = os.dup(1)  # pytest's stdout before any capture: the end marker goes here


def _forget_environment():
    # For this session only: pytest run by a test (in a subprocess or in-process) goes without it.
    opts = os.environ.get("PYTEST_ADDOPTS", "").replace("-p " + __name__, "").strip()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _here]
    for name, value in (("PYTEST_ADDOPTS", opts), ("PYTHONPATH", os.pathsep.join(paths))):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)


def _forget_source():
    try:
        import importlib.util
        os.unlink(importlib.util.cache_from_source(os.path.abspath(__file__)))
    except Exception:
        pass
    try:
        os.unlink(os.path.abspath(__file__))
    except OSError:
        pass


def _writers(nonce):
    # The nonce stays in these closures, not in a module attribute a test could read by name.
    def emit(event):
        os.write(_record, (nonce + " " + json.dumps(event, sort_keys=True) + "\n").encode("utf-8", "replace"))

    def end_marker():
        os.write(_stdout, ("\n" + nonce + " end of pytest\n").encode())

    return emit, end_marker


_emit, _end_marker = _writers("@@RLVR_NONCE@@")


def _origin(obj):
    """The source file of a function (or classmethod, staticmethod, property) or None."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    code = getattr(obj, "__code__", None)
    return code.co_filename if code is not None else None


def _callables():
    """name -> object for the functions of the modules that make and report test outcomes."""
    out = {}
    for modname in WATCHED:
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, type) and getattr(obj, "__module__", None) == modname:
                for attr, value in list(vars(obj).items()):
                    if isinstance(value, (types.FunctionType, classmethod, staticmethod, property)):
                        out[modname + ":" + name + "." + attr] = value
            elif isinstance(obj, types.FunctionType):
                out[modname + ":" + name] = obj
    return out


def _testbed_file(path):
    if not path or not os.path.isabs(path):  # "<attrs generated eq ...>", "<string>": no file
        return None
    path = os.path.normpath(path)
    return path[len(TESTBED):] if path.startswith(TESTBED) else None


def _loaded_from_testbed():
    out = []
    for name, mod in list(sys.modules.items()):
        rel = _testbed_file(getattr(mod, "__file__", None))
        if rel and not rel.startswith(".venv/"):
            out.append([name, rel])
    return sorted(out)


_start = _callables()
# Repository code (outside the task's .venv) that already stands in for pytest's own functions.
_foreign = sorted(name for name, obj in _start.items()
                  if not (_testbed_file(_origin(obj)) or ".venv/").startswith(".venv/"))
_emit({"event": "start", "pid": os.getpid(), "testbed_modules": _loaded_from_testbed(), "foreign": _foreign,
       "modules": sorted({name.split(".")[0] for name in list(sys.modules)})})
_forget_source()
_forget_environment()
_reported_changes = set()
_known_plugins = None


def _pytest_dirs():
    out = []
    for name in ("_pytest", "pluggy"):
        f = getattr(sys.modules.get(name), "__file__", None)
        if f:
            out.append(os.path.dirname(os.path.realpath(f)) + os.sep)
    return tuple(out)


# On the path of every report: checked at each one (the rest at the session's end, to stay cheap).
HOT = ("_pytest.reports:TestReport.from_item_and_call", "_pytest.reports:BaseReport.passed",
       "_pytest.reports:BaseReport.failed", "_pytest.reports:BaseReport.skipped", "_pytest.runner:CallInfo.from_call",
       "_pytest.runner:call_and_report", "_pytest.runner:call_runtest_hook", "_pytest.runner:runtestprotocol",
       "_pytest.runner:pytest_runtest_makereport", "_pytest.skipping:pytest_runtest_makereport",
       "_pytest.python:pytest_pyfunc_call", "_pytest.python:Function.runtest",
       "_pytest.terminal:TerminalReporter.pytest_runtest_logreport",
       "_pytest.terminal:TerminalReporter.short_test_summary", "_pytest.terminal:TerminalReporter.summary_stats",
       "pluggy._callers:_multicall", "pluggy.callers:_multicall")


def _hot():
    out = {}
    for key in HOT:
        if key not in _start:
            continue
        modname, dotted = key.split(":")
        obj = sys.modules.get(modname)
        for part in dotted.split("."):
            obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
        out[key] = obj
    return out


def _check(full=True):
    # pytest patches itself too (legacypath at configure): a replacement from pytest's files is its own.
    now = _callables() if full else _hot()
    own = _pytest_dirs()
    names = set(_start) | set(now) if full else set(now)
    changed = sorted(k for k in names if _start.get(k) is not now.get(k)
                     and not os.path.realpath(_origin(now.get(k)) or "/-").startswith(own))
    new = [k for k in changed if k not in _reported_changes]
    if new:
        _reported_changes.update(new)
        _emit({"event": "changed", "names": new, "files": sorted({str(_origin(now.get(k))) for k in new})})


def _plugin_file(plugin):
    f = getattr(plugin, "__file__", None)
    if f is None:
        mod = sys.modules.get(getattr(type(plugin), "__module__", None) or "")
        f = getattr(mod, "__file__", None)
    return f


def _check_plugins(config):
    global _known_plugins
    plugins = config.pluginmanager.get_plugins()
    if _known_plugins is None:
        _known_plugins = set(map(id, plugins))
        return
    for plugin in plugins:
        if id(plugin) not in _known_plugins:
            _known_plugins.add(id(plugin))
            f = _plugin_file(plugin)
            _emit({"event": "plugin", "name": str(config.pluginmanager.get_name(plugin)), "file": f,
                   "testbed_file": _testbed_file(f)})


def _status(rep):
    xfail = hasattr(rep, "wasxfail")
    if rep.when == "call":
        if rep.passed:
            return "XPASS" if xfail else "PASSED"
        if rep.failed:
            return "FAILED"
        return "XFAIL" if xfail else "SKIPPED"
    if rep.failed:
        return "ERROR"
    if rep.skipped:
        return "XFAIL" if xfail else "SKIPPED"
    return None


def pytest_configure(config):
    _check_plugins(config)


def pytest_collectreport(report):
    if report.failed:
        _emit({"event": "test", "nodeid": report.nodeid, "status": "ERROR"})


def pytest_runtest_logreport(report):
    _check(full=False)
    status = _status(report)
    if status:
        _emit({"event": "test", "nodeid": report.nodeid, "status": status})


def pytest_sessionfinish(session, exitstatus):
    _check()
    _check_plugins(session.config)
    _emit({"event": "end", "exitstatus": int(exitstatus)})


def pytest_unconfigure(config):
    _check()
    reporter = config.pluginmanager.getplugin("terminalreporter")
    try:
        if reporter is not None:
            reporter._tw.flush()
        sys.stdout.flush()
    except Exception:
        pass
    _end_marker()
