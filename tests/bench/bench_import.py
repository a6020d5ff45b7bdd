"""Importing real-style repositories, and what grading them costs (a benchmark, not a test).

    python tests/bench/bench_import.py [--n 16] [--backends bwrap docker] [--concurrency 2]

For each backend, in a fresh store:
- import + verification of the tasks in tests/data/import_tasks (a pytest plugin in the task's own
  virtualenv, a src layout, an executable file, a testbed with its own .venv): seconds per task to
  build each archive (its virtualenv included) and to verify them all (gold 1 twice, empty 0);
- gradings per second through `grade_rollouts` (half gold, half empty patches, no dedupe) of an
  imported repo with its own virtualenv (covplugin: plugin autoload on), of one without
  (execfile), and of a generated mini task, with the CPU seconds each grading costs.
Needs root, the sandbox image and, for docker, a running engine. Wheels come from the test data
(--offline): no network.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def gradings_per_s(row: dict, store, cfg, n: int) -> tuple[float, float]:
    from tasks.dataset.mini import gold_patch
    from tasks.grading import grade_rollouts
    from tests.bench.bench_sandbox import cpu_seconds

    items = [(f"b{i}", "bench", 0, row, gold_patch(row) if i % 2 else "") for i in range(n)]
    grade_rollouts(items[:2], cfg, store, dedupe=False)  # warm: extraction, caches
    c0, t0 = cpu_seconds(cfg.backend), time.monotonic()
    table = grade_rollouts(items, cfg, store, dedupe=False)
    seconds, cpu = time.monotonic() - t0, cpu_seconds(cfg.backend) - c0
    rewards = table["reward"].to_pylist()
    assert rewards == [float(i % 2) for i in range(n)], (rewards, table["error"].to_pylist())
    return n / seconds, cpu / n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--backends", nargs="+", default=["bwrap", "docker"])
    p.add_argument("--concurrency", type=int, default=2)
    a = p.parse_args()
    from schemas.config import DatasetConfig, SandboxConfig
    from tasks.dataset import mini
    from tasks.dataset.importer import import_tasks
    from tasks.sandbox import image
    from tasks.storage import Store
    from tests.test_real_repos import task_tree

    out = {"load_average": os.getloadavg(), "cores": os.cpu_count()}
    for backend in a.backends:
        image.ensure_image(docker_too=backend == "docker")
        cfg = SandboxConfig(backend=backend, concurrency=a.concurrency, memory_mb=512, pids_limit=128,
                            command_timeout_s=30, test_timeout_s=60, infra_retries=0)
        with tempfile.TemporaryDirectory(prefix="rlvr-bench-import-") as d:
            store = Store(f"file://{d}/store")
            src = task_tree(pathlib.Path(d) / "src")
            t0 = time.monotonic()
            res = import_tasks(src, store, cfg, offline=True, log=lambda *_: None)
            total = time.monotonic() - t0
            assert not res.failed, res.failed
            n = len(res.verified)
            r = {"tasks": n, "import_s_per_task": round(total / n, 2),
                 "build_s": {k: round(v, 2) for k, v in res.seconds.items()},
                 "verify_s_per_task": round(res.verify_seconds / n, 2)}
            task = mini.generate(DatasetConfig(num_train=12, num_validation=12, seed=5))[0]
            mini_row = dict(task.row, environment_uri=store.put_bytes("environments/mini.tar.gz", task.archive))
            for name, row in (("imported, own venv (covplugin)", res.verified["covplugin"]),
                              ("imported, no venv (execfile)", res.verified["execfile"]), ("mini task", mini_row)):
                rate, cpu = gradings_per_s(row, store, cfg, a.n)
                r[name] = {"gradings_per_s": round(rate, 2), "cpu_s_per_grading": round(cpu, 2)}
            out[backend] = r
            print(backend, json.dumps(r, indent=1), flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
