"""Build a dataset into the object store: the tasks table plus, for the mini benchmark,
one environment archive per task, every task verified in a sandbox.

    key = build_dataset(cfg.dataset, store, cfg.sandbox)     # "datasets/<id>/tasks.parquet"
    table = store.read_table(key, stage="tasks")

Layout:
    datasets/<dataset_id>/tasks.parquet (+ .commit)   the tasks table (stage "tasks")
    datasets/<dataset_id>/verified.json               verification summary (mini)
    environments/<dataset_id>/<instance_id>.tar.gz     environment archives (mini)

`dataset_id` hashes the generator (version and source) and the config, so a build
is skipped when an identical one is already committed, and any change to the
generator or config builds a new one next to it.

Verification (mini): gold patch -> reward 1 and empty patch -> reward 0, graded by
tasks.grading exactly as rollouts are. A task that fails is a generator bug: the
build raises `DatasetVerificationError` naming every failing instance and why; no
row is ever dropped.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from schemas.tables import TASKS
from tasks.dataset import mini

log = logging.getLogger(__name__)

_GENERATOR_FILES = ("mini.py", "templates.py", "archive.py")


class DatasetVerificationError(RuntimeError):
    """Generated tasks failed verification (a generator bug). `failures` maps instance id -> reason."""

    def __init__(self, failures: dict[str, str], total: int):
        self.failures = failures
        lines = "\n".join(f"  - {iid}: {why}" for iid, why in sorted(failures.items())[:50])
        more = f"\n  ... and {len(failures) - 50} more" if len(failures) > 50 else ""
        super().__init__(f"{len(failures)} of {total} tasks failed verification:\n{lines}{more}")


def mini_dataset_id(cfg, docker_image: str) -> str:
    h = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for name in _GENERATOR_FILES:  # any change to the generator's code is a new dataset
        h.update((here / name).read_bytes())
    h.update(json.dumps({"version": mini.GENERATOR_VERSION, "seed": cfg.seed, "num_train": cfg.num_train,
                         "num_validation": cfg.num_validation, "difficulty": cfg.difficulty,
                         "split": cfg.split,
                         "docker_image": docker_image}, sort_keys=True).encode())
    return "mini-" + h.hexdigest()[:12]


def tasks_key(dataset_id: str) -> str:
    return f"datasets/{dataset_id}/tasks.parquet"


def tasks_sha256(table) -> str:
    """sha256 of a tasks table's content: its rows in instance_id order, every column but
    environment_uri (where this store keeps the archive, not what is in it)."""
    h = hashlib.sha256()
    for row in sorted(table.to_pylist(), key=lambda r: r["instance_id"]):
        row.pop("environment_uri", None)
        h.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()


def build_dataset(cfg, store, sandbox_cfg=None, verify: bool = True, progress=None) -> str:
    """The tasks table's key for a DatasetConfig: generated (mini) or loaded (r2e).
    progress(what, total) -> callable, when given, counts the verification's gradings."""
    if cfg.source == "r2e":
        from tasks.dataset.r2e import load_r2e_dataset

        # Rows with environment archives are verified like imported tasks; failing ones are left out.
        return load_r2e_dataset(cfg, store, sandbox_cfg=sandbox_cfg if verify else None, progress=progress)
    return build_mini_benchmark(cfg, store, sandbox_cfg, verify=verify, progress=progress)


def build_mini_benchmark(cfg, store, sandbox_cfg=None, verify: bool = True, verifier=None, progress=None) -> str:
    """Generate the mini benchmark, store archives + table, verify every task; returns the table key.

    Cached: an already built (and, if `verify`, verified) dataset returns at once.
    verifier(rows, store, sandbox_cfg) defaults to `verify_tasks` (the sandbox via tasks.grading).
    """
    if sandbox_cfg is None:
        from schemas.config import SandboxConfig

        sandbox_cfg = SandboxConfig()
    image = sandbox_cfg.image
    did = mini_dataset_id(cfg, image)
    key, marker = tasks_key(did), f"datasets/{did}/verified.json"
    if store.is_committed(key):
        if not verify or store.exists(marker):
            return key
        rows = store.read_table(key, stage="tasks").to_pylist()  # built earlier without verification
    else:
        t0 = time.monotonic()
        tasks = mini.generate(cfg, docker_image=image)
        t1 = time.monotonic()
        rows = []
        for t in tasks:
            uri = store.put_bytes(f"environments/{did}/{t.row['instance_id']}.tar.gz", t.archive)
            rows.append(dict(t.row, environment_uri=uri))
        table = TASKS.validate(TASKS.from_rows(rows))
        log.info("mini benchmark %s: generated %d tasks in %.1f s, stored archives in %.1f s",
                 did, len(rows), t1 - t0, time.monotonic() - t1)
    if verify:
        t0 = time.monotonic()
        if verifier is not None:
            verifier(rows, store, sandbox_cfg)
        else:
            verify_tasks(rows, store, sandbox_cfg, progress)
        seconds = time.monotonic() - t0
        log.info("mini benchmark %s: verified %d tasks in %.1f s", did, len(rows), seconds)
    if not store.is_committed(key):
        store.write_table(key, table, stage="tasks")
    if verify:
        store.put_json(marker, {"dataset_id": did, "tasks": len(rows), "seconds": round(seconds, 1),
                                "checks": ["gold patch -> reward 1", "empty patch -> reward 0"]})
    return key


def pool_key(dataset_id: str, n: int, foreign_names: float = 0.0) -> str:
    return f"datasets/{dataset_id}/warm-start-pool-{n}{f'-foreign{foreign_names:g}' if foreign_names else ''}.parquet"


def build_warm_start_pool(cfg, n: int, store, sandbox_cfg=None, foreign_names: float = 0.0) -> str | None:
    """Up to `n` extra training-distribution tasks for the warm start (mini.generate_pool), stored
    like the benchmark's (table + archives); None when n is 0. Never read by RL or evaluation.

    Not verified in sandboxes: the pool only feeds the scripted solver, whose demonstrations
    must submit (the demonstrations stage checks that), and the generator itself checks that
    each bug fails a hidden test and the fix passes it (`_candidate`).
    """
    if n <= 0:
        return None
    if cfg.source != "mini":
        raise ValueError("a warm-start pool is generated for the mini benchmark only (dataset.source='mini')")
    image = (sandbox_cfg.image if sandbox_cfg is not None else mini.DEFAULT_IMAGE)
    did = mini_dataset_id(cfg, image)
    key = pool_key(did, n, foreign_names)
    if store.is_committed(key):
        return key
    benchmark = store.read_table(tasks_key(did), stage="tasks").to_pylist()
    t0 = time.monotonic()
    tasks = mini.generate_pool(cfg, n, benchmark, docker_image=image, foreign_names=foreign_names)
    rows = [dict(t.row, environment_uri=store.put_bytes(f"environments/{did}/pool/{t.row['instance_id']}.tar.gz",
                                                          t.archive)) for t in tasks]
    store.write_table(key, TASKS.validate(TASKS.from_rows(rows)), stage="tasks")
    log.info("warm-start pool for %s: %d of %d tasks in %.1f s", did, len(rows), n, time.monotonic() - t0)
    return key


# ----------------------------------------------------------------------------- verification
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
    from tasks.grading import grade_patch, grade_rollouts  # the sandbox engineer's module; needs the sandbox image

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
    from tasks.sandbox import image

    h = hashlib.sha256()
    for col in ("instance_id", "parsed_commit_content", "expected_output_json", "docker_image"):
        h.update(str(row.get(col)).encode() + b"\0")
    if row.get("environment_uri"):
        with open(store.local_path(row["environment_uri"]), "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    h.update(f"{sandbox_cfg.image}\0{image.content_key()}\0{sandbox_cfg.backend}".encode())
    return h.hexdigest()[:32]


def verify_tasks(rows: list[dict], store, sandbox_cfg, progress=None) -> None:
    """Grade the gold patch (must score 1) and the empty patch (must score 0) of every row in a
    sandbox (`check_tasks`). Raises DatasetVerificationError naming every failing instance and why."""
    failures = check_tasks(rows, store, sandbox_cfg, progress)
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
