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

Verification (mini, tasks/dataset/verify.py): gold patch -> reward 1 and empty patch -> reward 0,
graded by tasks.grading exactly as rollouts are. A task that fails is a generator bug: the
build raises `DatasetVerificationError` naming every failing instance and why; no
row is ever dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import time

from schemas.tables import TASKS
from tasks.dataset import mini
from tasks.dataset.verify import verify_tasks

log = logging.getLogger(__name__)

_GENERATOR_FILES = ("mini.py", "templates.py", "archive.py")


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


def fully_verified(store, key: str) -> bool:
    """Whether every task of the mini tasks table `key` has been verified (its dataset's marker)."""
    return store.exists(f"{key.rsplit('/', 1)[0]}/verified.json")


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
