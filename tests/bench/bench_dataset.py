"""Dataset benchmark: generate the mini benchmark (700 + 251 tasks), store it, verify every task
in a sandbox (gold patch -> 1, empty patch -> 0, through tasks.grading).

    python tests/bench/bench_dataset.py [--backend bwrap] [--concurrency 2] [--no-verify] [--json-out F]

Needs root and the sandbox rootfs (`python -m tasks.sandbox.image build`) for the verification.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from schemas.config import DatasetConfig, SandboxConfig  # noqa: E402
from tasks.dataset import build, mini  # noqa: E402
from tasks.storage import Store  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--difficulty", type=float, default=0.5)
    p.add_argument("--num-train", type=int, default=700)
    p.add_argument("--num-validation", type=int, default=251)
    p.add_argument("--backend", default="bwrap", choices=["bwrap", "docker"])
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = DatasetConfig(seed=a.seed, difficulty=a.difficulty, num_train=a.num_train, num_validation=a.num_validation)
    sandbox = SandboxConfig(backend=a.backend, concurrency=a.concurrency, test_timeout_s=60, command_timeout_s=30)
    out: dict = {"tasks": cfg.num_train + cfg.num_validation, "backend": a.backend, "concurrency": a.concurrency,
                 "cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}

    t0 = time.perf_counter()
    tasks = mini.generate(cfg)
    out["generate_s"] = round(time.perf_counter() - t0, 2)
    out["archive_mb"] = round(sum(len(t.archive) for t in tasks) / 1e6, 2)
    with tempfile.TemporaryDirectory() as d:
        store = Store(f"file://{d}/store")
        t0 = time.perf_counter()
        key = build.build_mini_benchmark(cfg, store, sandbox, verify=False)  # generate + store + table
        out["generate_and_store_s"] = round(time.perf_counter() - t0, 2)
        if not a.no_verify:
            rows = store.read_table(key, stage="tasks").to_pylist()
            t0 = time.perf_counter()
            build.verify_tasks(rows, store, sandbox)
            out["verify_s"] = round(time.perf_counter() - t0, 1)
            out["verify_per_task_s"] = round(out["verify_s"] / len(rows), 3)
    out["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
