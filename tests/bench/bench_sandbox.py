"""Sandbox and grading throughput (a benchmark, not a test).

    python tests/bench/bench_sandbox.py [--n 24] [--concurrency 1 2 4 8] [--modes bwrap docker docker_reuse]

For each mode (bwrap; docker, a container per grading; docker_reuse, warm containers reset
between gradings) it reports:
- graded rollouts per second of a small task (tests/data/r2e_tasks/calc; half gold, half
  empty patches) through `grade_rollouts` at each concurrency;
- median sandbox start latency (grading mode, including teardown of the previous one) and
  median per-command latency (`true`);
- where a grading's time goes (sandbox start, the pytest run, the rest: patch, placing the
  tests, teardown), from the REWARDS table's timings, and the CPU seconds each grading costs
  (so the rate an idle machine would reach is cores / CPU-seconds, whatever else runs now).
Needs root, the sandbox image (built if missing) and, for docker modes, a running engine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def cfg_for(mode: str, concurrency: int):
    from schemas.config import SandboxConfig

    return SandboxConfig(backend="bwrap" if mode == "bwrap" else "docker", docker_reuse=mode == "docker_reuse",
                         concurrency=concurrency, memory_mb=512, pids_limit=128, cpus=1.0,
                         command_timeout_s=30, test_timeout_s=60, infra_retries=0)


def _proc_cpu(pid: int) -> float:
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(mode: str) -> float:
    """CPU used for grading: this process (the harness) plus every sandbox's cgroup (read at
    close); for docker modes also dockerd and containerd (not the per-container shims or
    runc, which exit: a lower bound)."""
    from tasks.sandbox.base import sandbox_cpu_seconds

    t = os.times()
    total = t.user + t.system + sandbox_cpu_seconds()
    if mode != "bwrap":
        for name in ("dockerd", "containerd"):
            for p in pathlib.Path("/proc").glob("[0-9]*"):
                try:
                    if (p / "comm").read_text().strip() == name:
                        total += _proc_cpu(int(p.name))
                except OSError:
                    pass
    return total


def latencies(mode: str, row: dict, store, n: int) -> tuple[float, float]:
    from tasks.sandbox import open_sandbox

    cfg = cfg_for(mode, 1)
    starts, cmds = [], []
    with open_sandbox(row, cfg, store, mode="grading"):
        pass  # warm caches (and, for docker_reuse, the pool)
    for _ in range(n):
        t0 = time.monotonic()
        with open_sandbox(row, cfg, store, mode="grading") as sb:
            starts.append(time.monotonic() - t0)
            for _ in range(3):
                cmds.append(sb.run("true").seconds)
    return statistics.median(starts), statistics.median(cmds)


def throughput(mode: str, row: dict, gold: str, store, n: int, concurrency: int) -> dict:
    from tasks.grading import grade_rollouts

    items = [(f"r{i}", "bench", 1, row, gold if i % 2 == 0 else "") for i in range(n)]
    cfg = cfg_for(mode, concurrency)
    # dedupe off: every grading runs, as it must for distinct patches (the bench has only two)
    grade_rollouts(items[:concurrency], cfg, store, dedupe=False)  # warm-up (pool, page cache)
    cpu0, t0 = cpu_seconds(mode), time.monotonic()
    t = grade_rollouts(items, cfg, store, dedupe=False)
    wall = time.monotonic() - t0
    cpu = cpu_seconds(mode) - cpu0
    rows = t.to_pylist()
    bad = [r for r in rows if r["reward"] != (1.0 if int(r["rollout_id"][1:]) % 2 == 0 else 0.0)]
    assert not bad, f"wrong rewards: {bad[:2]}"
    start = statistics.mean(r["sandbox_start_seconds"] for r in rows)
    test = statistics.mean(r["test_seconds"] for r in rows)
    total = statistics.mean(r["total_seconds"] for r in rows)
    return {"mode": mode, "concurrency": concurrency, "n": n, "gradings_per_s": n / wall,
            "cpu_s_per_grading": cpu / n, "load_avg_1m": os.getloadavg()[0],
            "mean_start_s": start, "mean_test_s": test, "mean_other_s": total - start - test, "mean_total_s": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=24, help="gradings per measurement")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["bwrap", "docker", "docker_reuse"])
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    from tasks.sandbox import close_pools, image
    from tasks.storage import Store
    from tests.fixtures.sandbox import build_task_archive, make_task_row

    image.ensure_image(docker_too=any(m.startswith("docker") for m in a.modes))
    store = Store(f"file://{tempfile.mkdtemp(prefix='rlvr-bench-')}")
    row = make_task_row("calc", store, store.put_bytes("environments/calc.tar.gz", build_task_archive("calc")))
    gold = (REPO / "tests" / "data" / "r2e_tasks" / "calc" / "gold.patch").read_text()

    print(f"machine: {os.cpu_count()} CPUs; task: calc (4 hidden tests); {a.n} gradings per point\n")
    results = []
    for mode in a.modes:
        start, cmd = latencies(mode, row, store, 15)
        print(f"{mode:13s} median sandbox start {start * 1000:6.1f} ms   median command {cmd * 1000:6.1f} ms")
        for c in a.concurrency:
            r = throughput(mode, row, gold, store, a.n, c)
            r.update(median_start_latency_s=start, median_command_latency_s=cmd)
            results.append(r)
            print(f"  concurrency {c}: {r['gradings_per_s']:5.2f} gradings/s ({r['cpu_s_per_grading']:.2f} CPU-s "
                  f"each, load {r['load_avg_1m']:.1f})   per grading: start "
                  f"{r['mean_start_s'] * 1000:5.0f} ms, pytest {r['mean_test_s'] * 1000:5.0f} ms, "
                  f"other {r['mean_other_s'] * 1000:5.0f} ms (total {r['mean_total_s'] * 1000:5.0f} ms)")
        close_pools()
    best = max(results, key=lambda r: r["gradings_per_s"])
    print(f"\nbest: {best['mode']} at concurrency {best['concurrency']}: {best['gradings_per_s']:.2f} gradings/s")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
