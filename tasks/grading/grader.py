"""Grading: a rollout's final patch -> R2E-Gym reward, in a fresh sandbox of its task.

Per rollout: start a grading-mode sandbox (hidden tests at /root, out of the patch's
reach) -> drop the patch's sections that touch r2e_tests/, run_tests.sh or .venv (the
environment, not the solution) -> `git apply --whitespace=fix` (R2E-Gym's flags) ->
replace /testbed/r2e_tests and /testbed/run_tests.sh by a link to /root/r2e_tests ->
`bash /root/run_tests.sh` under the test timeout -> parse and compare (tasks/grading/r2e.py).

Outcomes:
- graded, reward 1/0: the tests ran (a timeout, a crash, an OOM-killed pytest are the
  agent's doing and score 0), or the patch did not apply (0, `patch_applied=False`, the
  reason in `error`).
- infra_error, reward null: the sandbox could not start, the engine failed, a set-up step
  timed out or was killed; retried `cfg.infra_retries` times first. Never a 0.
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from schemas.tables import REWARDS
from tasks.grading.r2e import clean_test_output, parse_log_pytest, r2e_reward
from tasks.sandbox import EnvironmentSpecError, SandboxInfraError, close_all, open_sandbox, reap_stale

PROTECTED = ("r2e_tests", "run_tests.sh", ".venv")
# One sandbox command for the set-up: R2E-Gym's `git apply --whitespace=fix` (the patch on
# stdin: same semantics as a file, one process less), then the hidden tests replace whatever
# /testbed has under their names. Exit 97 = the patch did not apply, with git's message.
APPLY = 'out=$(git apply --whitespace=fix - 2>&1) || { printf "%s" "$out"; exit 97; }'
PLACE_TESTS = "rm -rf r2e_tests run_tests.sh && ln -s /root/r2e_tests r2e_tests"
PATCH_REJECTED = 97
MAX_ERROR_CHARS = 4000


@dataclass
class GradeResult:
    reward: float | None
    grading_status: str  # "graded" | "infra_error"
    error: str | None = None
    patch_applied: bool = False
    test_statuses: dict[str, str] = field(default_factory=dict)
    attempts: int = 1
    sandbox_start_seconds: float = 0.0
    test_seconds: float = 0.0
    total_seconds: float = 0.0
    test_output: str = ""  # the cleaned test log (capped); not part of the table
    dropped_paths: list[str] = field(default_factory=list)

    def row(self, rollout_id: str, run_id: str, step: int, instance_id: str) -> dict:
        return {"rollout_id": rollout_id, "run_id": run_id, "step": int(step), "instance_id": instance_id,
                "reward": self.reward, "grading_status": self.grading_status, "error": self.error,
                "patch_applied": self.patch_applied, "test_statuses": json.dumps(self.test_statuses, sort_keys=True),
                "attempts": self.attempts, "sandbox_start_seconds": self.sandbox_start_seconds,
                "test_seconds": self.test_seconds, "total_seconds": self.total_seconds}


# -- the patch ------------------------------------------------------------------------------
def _section_paths(lines: list[str]) -> list[str]:
    paths = []
    for ln in lines:
        if ln.startswith("diff --git "):
            rest = ln[len("diff --git "):]
            # "a/X b/Y": without quoting X == Y in the common case; split at " b/" as git does.
            if rest.startswith('"') or " b/" not in rest:
                paths.append(rest)
            else:
                a, _, b = rest.partition(" b/")
                paths += [a, "b/" + b]
        elif ln.startswith(("--- ", "+++ ")):
            paths.append(ln[4:].split("\t")[0])
        elif ln.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            paths.append(ln.split(" ", 2)[2])
        elif ln.startswith("@@"):
            break
    return paths


def _protected(path: str) -> bool:
    p = path.strip().strip('"')
    if p == "/dev/null":
        return False
    if p.startswith(("a/", "b/")):
        p = p[2:]
    p = posixpath.normpath(p).lstrip("/")
    return any(p == name or p.startswith(name + "/") for name in PROTECTED)


def filter_patch(patch: str) -> tuple[str, list[str]]:
    """Drop the file sections of a patch that touch the hidden tests, run_tests.sh or .venv.

    Returns (patch to apply, dropped section headers). Text before the first section is kept
    (git apply ignores it). Splits git diffs at "diff --git", plain unified diffs at "--- "
    followed by "+++ ".
    """
    lines = patch.splitlines(keepends=True)
    git_style = any(ln.startswith("diff --git ") for ln in lines)
    starts = [i for i, ln in enumerate(lines)
              if (ln.startswith("diff --git ") if git_style else
                  ln.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "))]
    if not starts:
        return patch, []
    kept = lines[: starts[0]]
    dropped = []
    for j, s in enumerate(starts):
        section = lines[s: starts[j + 1] if j + 1 < len(starts) else len(lines)]
        if any(_protected(p) for p in _section_paths(section)):
            dropped.append(section[0].rstrip("\n"))
        else:
            kept += section
    return "".join(kept), dropped


# -- one rollout ----------------------------------------------------------------------------
class _PatchRejected(Exception):
    pass


def _attempt(task_row: dict, patch: str, cfg, store, res: GradeResult) -> None:
    to_apply, res.dropped_paths = filter_patch(patch or "")
    t0 = time.monotonic()
    with open_sandbox(task_row, cfg, store, mode="grading") as sb:
        res.sandbox_start_seconds = time.monotonic() - t0
        # An empty patch applies trivially (git apply itself rejects empty input).
        patch_in = to_apply if to_apply.strip() else ""
        setup = f"{APPLY}; {PLACE_TESTS}" if patch_in else PLACE_TESTS
        r = sb.run(setup, timeout=cfg.command_timeout_s, stdin=patch_in or None)
        if r.timed_out:
            raise SandboxInfraError(f"set-up timeout: git apply / placing tests ran past {cfg.command_timeout_s:g}s")
        if r.exit_code == PATCH_REJECTED:
            raise _PatchRejected(r.output.strip() or "git apply failed")
        if r.exit_code != 0:
            raise SandboxInfraError(f"set-up failed (exit {r.exit_code}): {r.output.strip()[:500]}")
        res.patch_applied = True
        r = sb.run("bash /root/run_tests.sh", timeout=cfg.test_timeout_s,
                   output_cap=getattr(cfg, "test_output_cap_bytes", 8 * 1024 * 1024))
        res.test_seconds = r.seconds
        log = clean_test_output(r.output, r.timed_out, cfg.test_timeout_s)
        res.test_output = log
        res.test_statuses = parse_log_pytest(log)
        res.reward = r2e_reward(res.test_statuses, task_row["expected_output_json"])
        res.grading_status = "graded"
        if r.timed_out:
            res.error = f"tests timed out after {cfg.test_timeout_s:g}s"


def grade_patch(task_row: dict, patch: str, cfg, store, cancel: threading.Event | None = None) -> GradeResult:
    """Grade one patch against its task's hidden tests. Never raises for infra failures: those
    come back as grading_status="infra_error" with reward None after the retries."""
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
            res.error = f"infra_error: bad environment: {e}"
            break
        except Exception as e:  # engine errors, set-up failures, our own bugs: never a 0
            res.reward, res.grading_status, res.patch_applied = None, "infra_error", False
            res.test_statuses = {}
            res.error = f"infra_error: {type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}"
    res.total_seconds = time.monotonic() - t0
    return res


# -- a batch --------------------------------------------------------------------------------
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


def grade_rollouts(items, cfg, store, dedupe: bool = True) -> pa.Table:
    """Grade (rollout_id, run_id, step, task_row, patch) items with at most cfg.concurrency
    sandboxes at once; returns a validated REWARDS table in the items' order.

    dedupe: rollouts of one task with byte-identical patches are graded once and share the result
    (the hidden tests see the same files). Groups sampled at low temperature repeat themselves a
    lot (an evaluation's 4 samples, many empty patches), so this saves most gradings there."""
    items = list(items)
    _reap_once(cfg)
    keys = [(row["instance_id"], patch) if dedupe else i for i, (_, _, _, row, patch) in enumerate(items)]
    unique = {}
    for k, (_, _, _, row, patch) in zip(keys, items):
        unique.setdefault(k, (row, patch))
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, cfg.concurrency), thread_name_prefix="grade")
    try:
        futures = {k: pool.submit(grade_patch, row, patch, cfg, store, cancel) for k, (row, patch) in unique.items()}
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
