"""Grading: a rollout's final patch -> R2E-Gym reward, in a fresh sandbox of its task.

Per rollout: start a grading-mode sandbox (hidden tests at /root, out of the patch's
reach) -> `git apply --whitespace=fix` (R2E-Gym's flags) without the patch's harness
changes (below) -> replace /testbed/r2e_tests by a link to /root/r2e_tests -> `bash
/root/run_tests.sh` under the test timeout -> parse and compare (tasks/grading/r2e.py).

What a patch may not change (the reward is R2E-Gym's for everything else). R2E-Gym grades
in the agent's own container, so a patch there can rewrite the tests' surroundings; here a
patch may not add, change, delete or rename:
- the environment: r2e_tests/, run_tests.sh, .venv/, .git/;
- what pytest loads around the tests: any conftest.py, pytest.ini, .pytest.ini, tox.ini,
  and the pytest sections of the repo's setup.cfg ([tool:pytest]) and pyproject.toml
  ([tool.pytest.ini_options], [tool.pytest]);
- what Python loads at start-up: sitecustomize.py, usercustomize.py, *.pth, bytecode
  (__pycache__/, *.pyc);
- package metadata (*.dist-info/, *.egg-info/): in a task with plugin autoload on (its own
  virtualenv, tasks/sandbox/__init__.py) pytest loads the entry points it finds on sys.path;
- nor add a module or package, at the repo root or in src/, named like one the test runner
  imports: the standard library, pytest's own (pytest, _pytest, pluggy, py, iniconfig), and
  every top-level module the task's pytest has loaded at start-up, learned by running that
  start-up once per environment (no hand-written list: the image's pytest 7.2 imports `attr`).
Such file changes are removed before the tests run and the rest of the patch is graded;
`harness_changes` in the rewards table lists them (a reward-hacking signal the step summary
counts). Which paths a patch touches is decided by git's own parse (`git apply --numstat -z`
on the host, then `git status` in the sandbox after applying), never by reading header text.

Where the verdict comes from (tasks/grading/verdict.py). The repository's code runs inside
pytest's process and can print or patch anything there, so the log alone is not evidence. A
recorder plugin, loaded with `-p` from outside /testbed under a per-grading nonce before any
repository code, records each report as pytest makes it and marks the end of pytest's output.
The log is read only up to that mark, and the verdict is `tampering` (reward 0, what disagreed
in `tampering`) when the record contradicts it: a test the log calls PASSED that pytest did not
report passed, pytest's functions replaced by other code, a file of the patch loaded at pytest's
start-up or registered as a plugin. Honest patches never meet these, so R2E-Gym's reward stands.
What no harness can refuse (an `__eq__` that always returns True) is counted, not scored:
`hack_signals` (tasks/grading/hacks.py).

Outcomes:
- graded, reward 1/0: the tests ran (a timeout, a crash, an OOM-killed pytest are the
  agent's doing and score 0), or the patch did not apply (0, `patch_applied=False`, the
  reason in `error`), or the patch tampered with the test run (0, `tampering`).
- infra_error, reward null: the sandbox could not start, the engine failed, a set-up step
  timed out or was killed; retried `cfg.infra_retries` times first. Never a 0.
- env_error, reward null: the task's environment cannot run its hidden tests, so no reward
  says anything about the patch. A status of its own, not infra_error: it is a property of the
  task, not a passing failure, so it is never retried, and verification reports the task.
  R2E-Gym scores such a run 0 (its parser finds no results: `_calculate_reward_r2e` compares
  {} with the expectation); here a run that did not time out and whose log parses to no test
  result, or to a collection error ("" key) the expectation lacks, is checked against the
  task's pristine state: the empty patch graded once per process and task. If the tests do not
  run there either (a pytest usage error such as an unknown `--cov` option, a hidden conftest
  that cannot import, zero tests collected) the grading is env_error, with the reason and the
  test log's tail in `error`; if they do, the patch broke them and R2E-Gym's 0 stands. So every
  run in which the tests did run keeps R2E-Gym's exact reward. An unusable archive
  (EnvironmentSpecError) is env_error as well. Downstream it is masked like an infra error
  (tasks/grpo/advantages.py, tasks/evaluation.py) and counted in the step's grading log.
"""

from __future__ import annotations

import configparser
import json
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from schemas.tables import REWARDS
from tasks.grading.hacks import hack_signals
from tasks.grading.r2e import clean_test_output, parse_log_pytest, r2e_reward
from tasks.grading.verdict import Recorder, cut_log, disagreements, read_record, split_record
from tasks.sandbox import EnvironmentSpecError, SandboxInfraError, close_all, open_sandbox, reap_stale

GIT = "/usr/bin/git"  # the image's, never a PATH lookup: /testbed/.venv/bin comes first there
ENVIRONMENT = ("r2e_tests", "run_tests.sh", ".venv", ".git")
PYTEST_FILES = ("conftest.py", "pytest.ini", ".pytest.ini", "tox.ini")
STARTUP_FILES = ("sitecustomize.py", "usercustomize.py")
# Always refused; to these the grader adds every module the task's test runner imports at start-up
# (probed once per environment: tasks/grading/verdict_plugin.py lists them).
SHADOWED = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py", "iniconfig"}
# Root config files that may change only outside their pytest section: (format, section path).
PYTEST_SECTIONS = {"setup.cfg": ("ini", ("tool:pytest",)),
                   "pyproject.toml": ("toml", ("tool", "pytest"))}
PATCH_REJECTED = 97
MARK = "\x1e@@rlvr-status@@\x1e"  # between git's messages and the status listings
MAX_ERROR_CHARS = 4000
ENV_LOG_TAIL_CHARS = 2000  # of an env_error's test log, kept in `error`


@dataclass
class GradeResult:
    reward: float | None
    grading_status: str  # "graded" | "infra_error" | "env_error"
    error: str | None = None
    patch_applied: bool = False
    test_statuses: dict[str, str] = field(default_factory=dict)
    attempts: int = 1
    sandbox_start_seconds: float = 0.0
    test_seconds: float = 0.0
    total_seconds: float = 0.0
    test_output: str = ""  # the cleaned test log (capped); not part of the table
    harness_changes: list[str] = field(default_factory=list)  # "path: why" for each change removed
    env_reason: str = ""  # env_error: why the tests did not run (not part of the table)
    tampering: list[str] = field(default_factory=list)  # the verdict evidence against the log (reward 0)
    hack_signals: list[str] = field(default_factory=list)  # tasks/grading/hacks.py, on the patch as given
    verdict_loaded: bool = False  # the recorder plugin ran in this grading's pytest (not part of the table)
    node: str | None = None  # Ray node id it was graded on (tasks/cluster.py); None: this process

    def row(self, rollout_id: str, run_id: str, step: int, instance_id: str) -> dict:
        return {"rollout_id": rollout_id, "run_id": run_id, "step": int(step), "instance_id": instance_id,
                "reward": self.reward, "grading_status": self.grading_status, "error": self.error,
                "patch_applied": self.patch_applied, "test_statuses": json.dumps(self.test_statuses, sort_keys=True),
                "attempts": self.attempts, "sandbox_start_seconds": self.sandbox_start_seconds,
                "test_seconds": self.test_seconds, "total_seconds": self.total_seconds,
                "harness_changes": self.harness_changes, "tampering": self.tampering or None,
                "hack_signals": self.hack_signals or None, "node": self.node}


# -- the patch ------------------------------------------------------------------------------
def harness_reason(path: str, added: bool = False, shadowed: frozenset = SHADOWED) -> str | None:
    """Why a patch may not touch `path` (repo-relative, as git parsed it); None if it may.
    `added`: the path is new (only new modules can shadow); `shadowed`: module names it may not add."""
    is_dir = path.endswith("/")  # git status lists a new directory once, as "dir/"
    parts = path.strip("/").split("/")
    name = parts[-1]
    if parts[0] in ENVIRONMENT:
        return "the environment"
    if name in PYTEST_FILES:
        return "what pytest loads (" + name + ")"
    if name in STARTUP_FILES or name.endswith(".pth"):
        return "what Python loads at start-up (" + name + ")"
    if "__pycache__" in parts or name.endswith((".pyc", ".pyo")):
        return "bytecode"
    if any(p.endswith((".dist-info", ".egg-info")) for p in parts):  # entry points pytest autoloads from sys.path
        return "package metadata (entry points of plugins)"
    if added:
        top = parts[1:] if parts[0] == "src" and len(parts) > 1 else parts
        module = top[0] if len(top) > 1 or is_dir else (top[0][:-3] if top[0].endswith(".py") else None)
        if module in shadowed:
            return f"shadows the module {module}"
    return None


def patch_paths(patch: str) -> list[str]:
    """The paths a patch touches, as git parses them (C-quoted names decoded, a/ b/ stripped):
    for each file section its new name, or its old one when the file is deleted."""
    r = subprocess.run(["git", "apply", "--numstat", "-z", "-"], input=patch.encode(), capture_output=True,
                       cwd="/", timeout=60)
    if r.returncode != 0:
        raise _PatchRejected(r.stderr.decode(errors="replace").strip() or "git apply cannot parse the patch")
    fields = r.stdout.decode(errors="surrogateescape").split("\0")
    return [f.split("\t", 2)[2] for f in fields if f.count("\t") >= 2]


def _wildmatch_literal(path: str) -> str:
    return "".join("\\" + c if c in "*?[\\" else c for c in path)


def _status(text: str) -> dict[str, str]:
    """`git status --porcelain -z` -> {path: XY}."""
    return {e[3:]: e[:2] for e in text.split("\0") if len(e) > 3}


def _pytest_section(text: str | None, fmt: str, section: tuple) -> object:
    """The pytest part of a config file, comparable across versions; a file that does not parse
    counts as changed (it could hide anything)."""
    if text is None:
        return None
    try:
        if fmt == "ini":
            cp = configparser.RawConfigParser(strict=False)
            cp.read_string(text)
            return {k: v for k, v in cp.items(section[0])} if cp.has_section(section[0]) else None
        data = tomllib.loads(text)
        for key in section:
            data = data.get(key) if isinstance(data, dict) else None
        return data
    except (configparser.Error, tomllib.TOMLDecodeError, UnicodeError) as e:
        return f"unparseable: {e}"


# -- one rollout ----------------------------------------------------------------------------
class _PatchRejected(Exception):
    pass


def _attempt(task_row: dict, patch: str, cfg, store, res: GradeResult) -> None:
    patch = patch or ""
    names = patch_paths(patch) if patch.strip() else []
    excluded = [(n, why) for n in names if (why := harness_reason(n))]
    t0 = time.monotonic()
    with open_sandbox(task_row, cfg, store, mode="grading") as sb:
        res.sandbox_start_seconds = time.monotonic() - t0
        rec = Recorder()
        shadowed = SHADOWED | _startup_modules(sb, task_row, cfg)
        folder = f"/tmp/.rlvr-{rec.token}"
        # Status before and after applying: what the patch really changed, in git's terms.
        status = f"{GIT} status --porcelain=v1 -z --ignored=matching -unormal"
        # The recorder goes in first, as a here-document: the patch is on stdin.
        steps = [f"mkdir -m 700 {folder} && cat > {folder}/{rec.module}.py <<'RLVR_{rec.token}'",
                 f"printf '%s' '{MARK}'", status]
        if patch.strip():  # git apply itself rejects empty input
            excludes = " ".join(shlex.quote("--exclude=" + _wildmatch_literal(n)) for n, _ in excluded)
            steps += [f'out=$({GIT} apply --whitespace=fix {excludes} - 2>&1) || '
                      f'{{ printf "%s" "$out"; exit {PATCH_REJECTED}; }}']
        steps += [f"printf '%s' '{MARK}'", status, "rm -rf r2e_tests run_tests.sh && ln -s /root/r2e_tests r2e_tests"]
        r = sb.run(" && ".join(steps) + f"\n{rec.source}\nRLVR_{rec.token}\n", timeout=cfg.command_timeout_s,
                   stdin=patch if patch.strip() else None, output_cap=1024 * 1024)
        if r.timed_out:
            raise SandboxInfraError(f"set-up timeout: git apply / placing tests ran past {cfg.command_timeout_s:g}s")
        if r.exit_code == PATCH_REJECTED:
            raise _PatchRejected(r.output.split(MARK)[-1].strip() or "git apply failed")
        if r.exit_code != 0:
            raise SandboxInfraError(f"set-up failed (exit {r.exit_code}): {r.output.strip()[:500]}")
        res.patch_applied = True
        parts = r.output.split(MARK)
        before, after = (_status(parts[1]), _status(parts[2])) if len(parts) == 3 else ({}, {})
        changed = {p: xy for p, xy in after.items() if before.get(p) != xy}
        revert = [(p, xy, why) for p, xy in changed.items()
                  if (why := harness_reason(p, added=xy in ("??", "!!"), shadowed=shadowed))]
        revert += _pytest_config_changes(sb, changed, cfg)
        if revert:
            tracked = [p for p, xy, _ in revert if xy not in ("??", "!!")]
            new = [p for p, xy, _ in revert if xy in ("??", "!!")]
            cmd = " && ".join(([f"{GIT} checkout HEAD -- {' '.join(map(shlex.quote, tracked))}"] if tracked else [])
                              + ([f"rm -rf -- {' '.join(map(shlex.quote, new))}"] if new else []))
            rr = sb.run(cmd, timeout=cfg.command_timeout_s)
            if not rr.ok:
                raise SandboxInfraError(f"set-up failed: cannot undo the patch's harness changes: {rr.output[:500]}")
        res.harness_changes = ([f"{n}: {why}" for n, why in excluded]
                               + [f"{p}: {why}" for p, _, why in revert])
        kept = set(changed) - {p for p, _, _ in revert}  # what the tests will see of the patch
        r = sb.run(f'PYTHONPATH="{folder}${{PYTHONPATH:+:$PYTHONPATH}}" '
                   f'PYTEST_ADDOPTS="-p {rec.module}${{PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}}" bash /root/run_tests.sh; '
                   f"s=$?; printf '\\n%s\\n' '{rec.record_marker}'; cat -- {folder}/record 2>/dev/null; exit $s",
                   timeout=cfg.test_timeout_s, output_cap=getattr(cfg, "test_output_cap_bytes", 8 * 1024 * 1024))
        res.test_seconds = r.seconds
        output, record = split_record(r.output, rec)
        log, late = cut_log(clean_test_output(output, r.timed_out, cfg.test_timeout_s), rec)
        res.test_output = log
        res.test_statuses = parse_log_pytest(log)
        evidence = read_record(record, rec.nonce)
        res.verdict_loaded = evidence.loaded
        why = None if r.timed_out else tests_did_not_run(res.test_statuses, task_row["expected_output_json"])
        broken = why and (f"{why}, without a patch" if not patch.strip() else _pristine_failure(task_row, cfg, store))
        if broken:
            res.grading_status, res.env_reason = "env_error", broken
            tail = log[-ENV_LOG_TAIL_CHARS:]
            res.error = (f"env_error: the hidden tests do not run in this environment ({broken}; "
                         f"test command exit {r.exit_code}); test log tail:\n{tail}")
            return
        res.reward = r2e_reward(res.test_statuses, task_row["expected_output_json"])
        res.grading_status = "graded"
        if r.timed_out:
            res.error = f"tests timed out after {cfg.test_timeout_s:g}s"
        elif evidence.loaded:
            res.tampering = disagreements(res.test_statuses, evidence, late, kept)
        elif patch.strip() and _pristine(task_row, cfg, store).verdict_loaded:
            res.tampering = ["the verdict recorder did not run (it does without the patch)"]
        if res.tampering:
            res.reward = 0.0
            res.error = "tampering: " + "; ".join(res.tampering)[:MAX_ERROR_CHARS]


# (environment kind, image, backend) -> top-level modules its test runner has loaded at start-up.
_STARTUP: dict[tuple, frozenset] = {}


def _startup_modules(sb, task_row: dict, cfg) -> frozenset:
    """The top-level modules the task's test runner imports at start-up, before the patch is
    applied: learned once per environment by running that start-up (pytest --version) with the
    recorder. A patch may not add a module of those names. The repository's own modules (pytest
    imported them: the repo is one of its dependencies) stay its own."""
    own_venv = getattr(getattr(sb, "env", None), "plugins", False)
    kind = task_row.get("docker_image") or (task_row.get("environment_uri") if own_venv else "interpreter")
    key = (kind, cfg.image, cfg.backend)
    if key not in _STARTUP:
        rec = Recorder()
        d = f"/tmp/.rlvr-probe-{rec.token}"
        r = sb.run(f'mkdir -m 700 {d} && cat > {d}/{rec.module}.py && (PYTHONPATH={d} '
                   f'PYTEST_ADDOPTS="-p {rec.module} --version" bash /root/run_tests.sh >/dev/null 2>&1; '
                   f'cat -- {d}/record 2>/dev/null; rm -rf {d}; true)',
                   timeout=cfg.command_timeout_s, stdin=rec.source, output_cap=4 * 1024 * 1024)
        if not r.ok:
            raise SandboxInfraError(f"set-up failed: the test runner's start-up probe: {r.output.strip()[:500]}")
        start = read_record(r.output, rec.nonce)
        _STARTUP[key] = frozenset(start.modules - {m.split(".")[0] for m, _ in start.testbed_modules} - {rec.module})
    return _STARTUP[key]


def tests_did_not_run(statuses: dict[str, str], expected: dict | str) -> str | None:
    """Why a finished test run's parsed statuses show that the tests did not run, or None."""
    if isinstance(expected, str):
        expected = json.loads(expected)
    if not statuses:
        return "no test result in the log"
    if "" in statuses and "" not in expected:  # a line without "::": a file that was not collected
        return "a test file could not be collected"
    return None


# (instance, environment, image, backend) -> the pristine state's grading.
_PRISTINE: dict[tuple, GradeResult] = {}
_PRISTINE_LOCK = threading.Lock()


def _pristine(task_row: dict, cfg, store) -> GradeResult:
    """The task graded without any patch, once per process and environment."""
    key = (task_row.get("instance_id"), task_row.get("environment_uri") or task_row.get("docker_image"),
           cfg.image, cfg.backend)
    with _PRISTINE_LOCK:
        if key in _PRISTINE:
            return _PRISTINE[key]
    res = grade_patch(task_row, "", cfg, store)
    if res.grading_status == "infra_error":  # undecided: retry the whole grading as an infra failure
        raise SandboxInfraError(f"pristine check of the environment failed: {res.error}")
    with _PRISTINE_LOCK:
        _PRISTINE[key] = res
    return res


def _pristine_failure(task_row: dict, cfg, store) -> str | None:
    """Whether the task's tests run without any patch: tells a broken environment (env_error) from
    a patch that broke the tests (R2E-Gym's 0)."""
    res = _pristine(task_row, cfg, store)
    return (res.env_reason or res.error) if res.grading_status == "env_error" else None


def _pytest_config_changes(sb, changed: dict[str, str], cfg) -> list[tuple[str, str, str]]:
    """Root setup.cfg / pyproject.toml whose pytest section the patch changed, added or removed."""
    out = []
    for name, (fmt, section) in PYTEST_SECTIONS.items():
        if name not in changed:
            continue
        xy = changed[name]
        old = None if xy in ("??", "!!") else sb.run(f"{GIT} show HEAD:{name}", timeout=cfg.command_timeout_s).output
        new = None if "D" in xy else sb.run(f"cat -- {name}", timeout=cfg.command_timeout_s).output
        if _pytest_section(old, fmt, section) != _pytest_section(new, fmt, section):
            out.append((name, xy, "what pytest loads (its section of " + name + ")"))
    return out


def grade_patch(task_row: dict, patch: str, cfg, store, cancel: threading.Event | None = None) -> GradeResult:
    """Grade one patch against its task's hidden tests. Never raises for infra failures: those
    come back as grading_status="infra_error" with reward None after the retries; a task whose
    environment cannot run its tests comes back as "env_error" (reward None, not retried)."""
    t0 = time.monotonic()
    res = GradeResult(reward=None, grading_status="infra_error")
    attempts = 1 + max(0, cfg.infra_retries)
    for attempt in range(1, attempts + 1):
        res = GradeResult(reward=None, grading_status="infra_error", attempts=attempt)
        if cancel is not None and cancel.is_set():
            res.error = "cancelled"
            break
        try:
            _attempt(task_row, patch, cfg, store, res)
            break
        except _PatchRejected as e:
            res.reward, res.grading_status, res.patch_applied = 0.0, "graded", False
            res.error = f"patch_apply_failed: {str(e)[:MAX_ERROR_CHARS]}"
            break
        except EnvironmentSpecError as e:  # the task row itself is unusable: retrying cannot help
            res.grading_status, res.error = "env_error", f"env_error: bad environment: {str(e)[:MAX_ERROR_CHARS]}"
            break
        except Exception as e:  # engine errors, set-up failures, our own bugs: never a 0
            res.reward, res.grading_status, res.patch_applied = None, "infra_error", False
            res.test_statuses = {}
            res.error = f"infra_error: {type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}"
    res.hack_signals = hack_signals(patch or "")
    res.total_seconds = time.monotonic() - t0
    return res


# -- a batch --------------------------------------------------------------------------------
HACKING_COLUMNS = ("harness_changes", "tampering", "hack_signals")


def reward_hacking(table: pa.Table) -> dict[str, list[str]]:
    """Rollout ids per reward-hacking signal of a rewards table (older tables lack the later columns)."""
    ids = table["rollout_id"].to_pylist()
    return {c: [i for i, v in zip(ids, table[c].to_pylist()) if v] if c in table.column_names else []
            for c in HACKING_COLUMNS}


def hack_report(table: pa.Table, show: int = 3) -> str:
    """One line for a step's summary: the rollouts flagged tampering or carrying hack constructs."""
    found = reward_hacking(table)
    parts = [f"{len(found[c])} {what} ({', '.join(found[c][:show])}{' ...' if len(found[c]) > show else ''})"
             for c, what in (("tampering", "patches tampered with the test run (reward 0)"),
                             ("hack_signals", "patches carry reward-hacking constructs (counted only)"))
             if found[c]]
    return ", ".join(parts)


_reaped = False


def _reap_once(cfg) -> None:
    # A grading process killed outright (SIGKILL, OOM) leaves containers and cgroups behind;
    # the next process that grades removes them (only those whose owner process is gone).
    global _reaped
    if not _reaped:
        _reaped = True
        try:
            reap_stale(docker=cfg.backend == "docker")
        except Exception:
            pass


def _sigterm_cleans_up() -> None:
    """SIGTERM's default ends a process without clean-up, leaving its containers behind: in a
    process that left it at the default, make it raise so that the clean-up below runs."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        def stop(signum, frame):
            raise KeyboardInterrupt("SIGTERM")

        signal.signal(signal.SIGTERM, stop)


def grade_rollouts(items, cfg, store, dedupe: bool = True, on_graded=None, pool=None) -> pa.Table:
    """Grade (rollout_id, run_id, step, task_row, patch) items with at most cfg.concurrency
    sandboxes at once; returns a validated REWARDS table in the items' order.

    dedupe: rollouts of one task with byte-identical patches are graded once and share the result
    (the hidden tests see the same files). Groups sampled at low temperature repeat themselves a
    lot (an evaluation's 4 samples, many empty patches), so this saves most gradings there.
    on_graded(result), when given, is called from the pool as each distinct patch is graded.
    pool: where gradings run; None = a thread pool here (tasks/cluster.py: RayGrading, one Ray task each)."""
    items = list(items)
    _reap_once(cfg)
    _sigterm_cleans_up()
    keys = [(row["instance_id"], patch) if dedupe else i for i, (_, _, _, row, patch) in enumerate(items)]
    unique = {}
    for k, (_, _, _, row, patch) in zip(keys, items):
        unique.setdefault(k, (row, patch))
    cancel = threading.Event()
    pool = pool or ThreadPoolExecutor(max_workers=max(1, cfg.concurrency), thread_name_prefix="grade")
    try:
        futures = {k: pool.submit(grade_patch, row, patch, cfg, store, cancel) for k, (row, patch) in unique.items()}
        if on_graded is not None:
            for f in futures.values():
                f.add_done_callback(lambda f: f.exception() is None and on_graded(f.result()))
        graded = {k: f.result() for k, f in futures.items()}
        results = [graded[k] for k in keys]
    except BaseException:
        # Ctrl-C (or a bug): stop new gradings, kill the running ones, leave nothing behind.
        cancel.set()
        pool.shutdown(wait=False, cancel_futures=True)
        close_all()
        pool.shutdown(wait=True)
        close_all()
        raise
    pool.shutdown(wait=True)
    rows = [res.row(rid, run_id, step, row["instance_id"])
            for (rid, run_id, step, row, _), res in zip(items, results)]
    return REWARDS.validate(REWARDS.from_rows(rows) if rows else REWARDS.empty(), stage="grading")
