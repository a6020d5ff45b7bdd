"""Does GRPO optimise the reward it is given? (a measurement script, not a test)

Runs real GRPO iterations (vLLM rollouts, sandbox grading, advantages, trainer update, weight
sync) on the same N train-split tasks at every step, and prints the mean training reward per
step and each task's success rate in the first and last steps. On a fixed set the reward must
rise if the update works; if it does and the validation pass@4 still does not move, what limits
the run is how the learned behaviour transfers, not the optimiser.

    python research/grpo_fixed_tasks.py CHECKPOINT_DIR [--tasks 16] [--steps 15] [overrides ...]

The run's tables go to runs/bench-fixed-<time>/ in the object store like any run's.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    from flows.runtime import RunContext
    from grpo_steps import bench_context, grpo_steps, pin_split
    from tasks.dataset.order import training_order

    ctx = bench_context(args.preset, args.overrides, args.tasks, f"bench-fixed-{int(time.time())}")
    fixed = sorted(training_order(RunContext.split_ids(ctx, "train"), 0, ctx.cfg.seed)[:args.tasks])
    # Every step's batch is the whole fixed set: training_batch cycles through `fixed` alone.
    pin_split(ctx, "train", fixed)
    per_step = []
    for step, rewards in grpo_steps(ctx, args.checkpoint, args.steps):
        by_task = collections.defaultdict(list)
        for r in rewards:
            by_task[r["instance_id"]].append(r["reward"])
        per_step.append({i: statistics.mean(v) for i, v in by_task.items()})
        mixed = sum(0 < m < 1 for m in per_step[-1].values())
        print(f"step {step}: mean reward {statistics.mean(r['reward'] for r in rewards):.3f} "
              f"({mixed}/{len(by_task)} tasks mixed)", flush=True)
    first, last = per_step[0], per_step[-1]
    print(f"\n{'task':44s} first  last")
    for i in fixed:
        print(f"{i:44s} {first.get(i, float('nan')):.2f}  {last.get(i, float('nan')):.2f}")
    n = max(1, len(per_step) // 3)
    early = statistics.mean(statistics.mean(s.values()) for s in per_step[:n])
    late = statistics.mean(statistics.mean(s.values()) for s in per_step[-n:])
    print(f"\nmean reward, first {n} steps {early:.3f}, last {n} steps {late:.3f} ({late - early:+.3f})")


if __name__ == "__main__":
    main()
