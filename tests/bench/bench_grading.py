"""Grading throughput, this checkout against another revision, side by side (interleaved rounds).

Grades the gold and the empty patch of N generated mini tasks through tasks.grading.grade_rollouts
(dedupe off), one round per code version in turn, and reports gradings per second: the medians,
their ratio, and whether every verdict was right (gold 1, empty 0) in every round.

    python tests/bench/bench_grading.py [--before REV] [--backend bwrap|docker] [--tasks 24] [--rounds 3]

--before REV checks REV out into a git worktree under /tmp and runs the same rounds with it.
Needs root and the sandbox rootfs / image (make setup; python -m tasks.sandbox.image build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def one_round(code: str, backend: str, n: int, concurrency: int) -> dict:
    """Run in a child process with `code` first on sys.path (so each revision grades with its own grader)."""
    sys.path.insert(0, code)
    from schemas.config import DatasetConfig, SandboxConfig
    from tasks.dataset import build
    try:
        from tasks.dataset.verify import _precheck
    except ImportError:  # a revision before verification had its own module
        from tasks.dataset.build import _precheck
    from tasks.grading import grade_rollouts
    from tasks.storage import Store

    cfg = DatasetConfig(seed=0, num_train=n, num_validation=1)
    sandbox = SandboxConfig(backend=backend, concurrency=concurrency, test_timeout_s=60, command_timeout_s=30)
    with tempfile.TemporaryDirectory() as d:
        store = Store(f"file://{d}/store")
        rows = store.read_table(build.build_mini_benchmark(cfg, store, sandbox, verify=False), stage="tasks").to_pylist()
        rows = [r for r in rows if r["split"] == "train"][:n]
        items = []
        for row in rows:
            patch, _ = _precheck(row)
            items += [(f"gold/{row['instance_id']}", "bench", 0, row, patch),
                      (f"empty/{row['instance_id']}", "bench", 0, row, "")]
        grade_rollouts(items[:2], sandbox, store, dedupe=False)  # warm: the start-up probe, page cache
        t0 = time.perf_counter()
        table = grade_rollouts(items, sandbox, store, dedupe=False)
        seconds = time.perf_counter() - t0
    rows = table.to_pylist()
    right = sum(1 for r in rows if r["reward"] == (1.0 if r["rollout_id"].startswith("gold/") else 0.0))
    return {"gradings": len(rows), "seconds": round(seconds, 2), "per_s": round(len(rows) / seconds, 3),
            "right": right, "code": code}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", help="a git revision to compare with")
    p.add_argument("--backend", default="bwrap", choices=["bwrap", "docker"])
    p.add_argument("--tasks", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--round", help=argparse.SUPPRESS)  # internal: run one round with this code dir
    a = p.parse_args(argv)
    if a.round:
        print(json.dumps(one_round(a.round, a.backend, a.tasks, a.concurrency)))
        return 0
    codes = {"after": REPO}
    if a.before:
        tree = f"/tmp/rlvr-bench-{a.before[:12]}"
        if not os.path.isdir(tree):
            subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, a.before], check=True,
                           capture_output=True)
        codes = {"before": tree, **codes}
    results: dict[str, list[dict]] = {k: [] for k in codes}
    for i in range(a.rounds):
        for name, code in codes.items():
            out = subprocess.run([sys.executable, __file__, "--round", code, "--backend", a.backend, "--tasks",
                                  str(a.tasks), "--concurrency", str(a.concurrency)],
                                 capture_output=True, text=True, cwd=code,
                                 env={**os.environ, "RLVR_CACHE_DIR": os.environ.get("RLVR_CACHE_DIR",
                                                                                     os.path.join(REPO, ".rlvr"))})
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(r)
            print(f"round {i + 1} {name}: {r['gradings']} gradings in {r['seconds']} s ({r['per_s']}/s), "
                  f"{r['right']} verdicts right", flush=True)
    summary = {name: {"median_per_s": statistics.median(r["per_s"] for r in rs),
                      "all_right": all(r["right"] == r["gradings"] for r in rs)} for name, rs in results.items()}
    if "before" in summary:
        summary["after_over_before"] = round(summary["after"]["median_per_s"] / summary["before"]["median_per_s"], 3)
    summary.update(backend=a.backend, tasks=a.tasks, rounds=a.rounds, concurrency=a.concurrency)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
