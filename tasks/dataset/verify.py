"""Verification of tasks: the gold patch must score 1 and the empty patch 0, graded in a sandbox by
tasks.grading exactly as a rollout is (`check_tasks`, `verify_tasks`); and, for tests of the mini
generator only, the same check without a sandbox (`verify_locally`, `LocalVerifier`).

Used by the mini build (tasks/dataset/build.py), the R2E-Gym loader (r2e.py) and the importer.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tasks.dataset import mini
from tasks.grading import grade_patch, grade_rollouts
from tasks.sandbox import image


class DatasetVerificationError(RuntimeError):
    """Generated tasks failed verification (a generator bug). `failures` maps instance id -> reason."""

    def __init__(self, failures: dict[str, str], total: int):
        self.failures = failures
        lines = "\n".join(f"  - {iid}: {why}" for iid, why in sorted(failures.items())[:50])
        more = f"\n  ... and {len(failures) - 50} more" if len(failures) > 50 else ""
        super().__init__(f"{len(failures)} of {total} tasks failed verification:\n{lines}{more}")


def _precheck(row: dict) -> tuple[str | None, str | None]:
    """(gold patch, None) or (None, reason): what can be wrong before any sandbox starts."""
    iid = row.get("instance_id")
    try:
        expected = json.loads(row["expected_output_json"])
        if not isinstance(expected, dict) or not expected:
            return None, "expected_output_json is not a non-empty JSON object"
    except (TypeError, ValueError) as e:
        return None, f"expected_output_json is not valid JSON ({e})"
    try:
        patch = mini.gold_patch(row)
    except KeyError as e:  # a file diff without what the patch is rebuilt from
        return None, f"task {iid!r}: parsed_commit_content: a file diff lacks {e} (cannot rebuild the gold patch)"
    except (ValueError, TypeError) as e:
        return None, str(e)
    if not patch.strip():
        return None, f"task {iid!r}: the gold patch is empty"
    return patch, None


LOG_TAIL_CHARS = 2000


def check_tasks(rows: list[dict], store, sandbox_cfg, progress=None, gold_runs: int = 1,
                cache: bool = False) -> dict[str, str]:
    """instance id -> why, for every row whose gold patch does not score 1 in each of `gold_runs`
    gradings or whose empty patch does not score 0, with the failing run's test log tail.

    Graded by tasks.grading's pool (`grade_rollouts`, `sandbox_cfg.concurrency` sandboxes at
    once), exactly as a rollout is. cache: rows this store has verified before on the same image
    and backend are skipped and passing rows are recorded (`datasets/verified/<key>.json`; the key
    hashes the row, its archive, the image and the backend). progress(what, total) makes a counter
    called per grading.
    """
    failures: dict[str, str] = {}
    items, patches, markers = [], {}, {}
    for row in rows:
        iid = row["instance_id"]
        patch, why = _precheck(row)
        if why:
            failures[iid] = why
            continue
        if cache:
            markers[iid] = f"datasets/verified/{_verification_key(row, store, sandbox_cfg)}.json"
            if store.exists(markers[iid]):
                continue
        patches[iid] = patch
        items += [(f"verify-gold{k}/{iid}", "dataset-verify", 0, row, patch) for k in range(gold_runs)]
        items.append((f"verify-empty/{iid}", "dataset-verify", 0, row, ""))
    if items:
        counter = (progress(f"dataset: verifying gold patches and empty patches of {len(patches)} tasks", len(items))
                   if progress else None)
        by_iid = {row["instance_id"]: row for row in rows}
        # dedupe off: the gold patch runs gold_runs times (flaky tests fail one of them)
        for r in grade_rollouts(items, sandbox_cfg, store, dedupe=False, on_graded=counter).to_pylist():
            kind, want = ("empty", 0.0) if r["rollout_id"].startswith("verify-empty/") else ("gold", 1.0)
            if r["grading_status"] == "graded" and r["reward"] == want or r["instance_id"] in failures:
                continue
            row, run = by_iid[r["instance_id"]], r["rollout_id"].split("/", 1)[0].removeprefix("verify-")
            if r["grading_status"] != "graded":  # an env_error's error holds its test log tail
                why = f"{kind} patch could not be graded: {r['error']}"
            elif not r["patch_applied"]:
                why = f"{kind} patch does not apply: {r['error']}"
            else:
                again = grade_patch(row, patches[r["instance_id"]] if kind == "gold" else "", sandbox_cfg, store)
                why = (f"{kind} patch scored {r['reward']} ({run}; test statuses {r['test_statuses']}); "
                       f"test log tail:\n{again.test_output[-LOG_TAIL_CHARS:]}")
            failures[r["instance_id"]] = why
    for iid, key in markers.items():
        if iid in patches and iid not in failures:
            store.put_json(key, {"instance_id": iid, "gold_runs": gold_runs, "image": sandbox_cfg.image,
                                 "checks": ["gold patch -> reward 1", "empty patch -> reward 0"]})
    return failures


def _verification_key(row: dict, store, sandbox_cfg) -> str:
    h = hashlib.sha256()
    for col in ("instance_id", "parsed_commit_content", "expected_output_json", "docker_image"):
        h.update(str(row.get(col)).encode() + b"\0")
    if row.get("environment_uri"):
        with open(store.local_path(row["environment_uri"]), "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    h.update(f"{sandbox_cfg.image}\0{image.content_key()}\0{sandbox_cfg.backend}".encode())
    return h.hexdigest()[:32]


def verify_tasks(rows: list[dict], store, sandbox_cfg, progress=None, cache: bool = False) -> None:
    """Grade the gold patch (must score 1) and the empty patch (must score 0) of every row in a
    sandbox (`check_tasks`; cache: as there). Raises DatasetVerificationError naming every failing
    instance and why."""
    failures = check_tasks(rows, store, sandbox_cfg, progress, cache=cache)
    if failures:
        raise DatasetVerificationError(failures, len(rows))


# ----------------------------------------------------------------------------- local check (no sandbox)
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR)\s+(\S+?)(?: - .*)?$")


def parse_pytest_summary(output: str) -> dict[str, str]:
    """Test key -> status from `pytest -rA` output, keyed the R2E-Gym way (node id parts after the file, '.'-joined)."""
    out = {}
    tail = output.split("short test summary info", 1)[-1]
    for line in tail.splitlines():
        m = _SUMMARY.match(line.strip())
        if m:
            out[".".join(m.group(2).split("::")[1:])] = m.group(1)
    return out


def verify_locally(row: dict, archive_bytes: bytes, python: str = sys.executable) -> tuple[dict, dict]:
    """(test statuses before, after the gold patch) from running the hidden tests on this machine.

    For tests and debugging of the generator only: it runs generated code without a sandbox.
    """
    patch, why = _precheck(row)
    if why:
        raise DatasetVerificationError({row["instance_id"]: why}, 1)
    with tempfile.TemporaryDirectory(prefix="rlvr-mini-verify-") as d:
        with tarfile.open(fileobj=io.BytesIO(archive_bytes), mode="r:gz") as tf:
            tf.extractall(d, filter="tar")
        tb = pathlib.Path(d) / "testbed"
        (pathlib.Path(d) / "r2e_tests").rename(tb / "r2e_tests")
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1")

        def run_tests() -> dict:
            r = subprocess.run([python, "-W", "ignore", "-m", "pytest", "-rA", "-p", "no:cacheprovider", "r2e_tests"],
                               cwd=tb, env=env, capture_output=True, text=True, timeout=120)
            return parse_pytest_summary(r.stdout)

        before = run_tests()
        r = subprocess.run(["git", "apply", "-"], cwd=tb, input=patch, capture_output=True, text=True)
        if r.returncode:
            raise DatasetVerificationError({row["instance_id"]: f"gold patch does not apply: {r.stderr.strip()}"}, 1)
        return before, run_tests()


@dataclass
class LocalVerifier:
    """A `verifier` for build_mini_benchmark that runs the hidden tests without a sandbox (tests only)."""

    workers: int = 2

    def __call__(self, rows, store, sandbox_cfg) -> None:
        def check(row):
            expected = json.loads(row["expected_output_json"])
            before, after = verify_locally(row, store.get_bytes(row["environment_uri"]))
            if after != expected:
                return row["instance_id"], f"after the gold patch: {after} != expected {expected}"
            if before == expected:
                return row["instance_id"], "the hidden tests already pass without the gold patch"
            return row["instance_id"], None

        with ThreadPoolExecutor(self.workers) as pool:
            failures = {iid: why for iid, why in pool.map(check, rows) if why}
        if failures:
            raise DatasetVerificationError(failures, len(rows))
