"""Synchronous versus overlapped collection (a benchmark, not a test).

    python tests/bench/bench_overlap.py [--preset smoke] [--steps 4] [--repeats 2] [overrides ...]

Runs the whole `train` flow (`python -m flows.main`) with `grpo.async_rollouts=false` and
`=true`, alternately so that machine load affects both alike, with only the final evaluation (the same in both), and reports
the median time to train (MLPerf run_start..run_stop), per step, and the ratio. In
overlapped mode the rollouts of step k+1 run while step k's update trains (trajectories
at most `grpo.max_trajectory_age` steps old, importance-sampling correction on).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    times: dict[str, list[float]] = {"sync": [], "overlapped": []}
    for rep in range(args.repeats):
        for mode in ("sync", "overlapped"):
            run_id = f"bench-overlap-{mode}-{int(time.time())}"
            cmd = [sys.executable, "-m", "flows.main", "--preset", args.preset, "--run-id", run_id, "--json",
                   f"max_steps={args.steps}", f"eval.start_step={args.steps + 1}",
                   f"grpo.async_rollouts={'true' if mode == 'overlapped' else 'false'}", *args.overrides]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
            if proc.returncode not in (0, 1):
                sys.exit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            summary = json.loads(proc.stdout[proc.stdout.index("\n{\n") + 1:])
            times[mode].append(summary["time_to_train_s"])
            print(f"repeat {rep} {mode:10}: time to train {summary['time_to_train_s']:.1f} s "
                  f"({args.steps} steps); stages {json.dumps(summary.get('stage_seconds', {}))}", flush=True)
    s, o = statistics.median(times["sync"]), statistics.median(times["overlapped"])
    print(f"\nmedian time to train over {args.steps} steps: sync {s:.1f} s ({s / args.steps:.1f} s/step), "
          f"overlapped {o:.1f} s ({o / args.steps:.1f} s/step); speed-up {s / o:.2f}x")


if __name__ == "__main__":
    main()
