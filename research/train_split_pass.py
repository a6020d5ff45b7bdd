"""Memorisation check (a measurement script, not a test): a checkpoint's pass@4 on the first 64
train-split tasks at the evaluation sampling (T=0.1, top-p 0.95, 4 samples), through the real
rollout and grading path. Compare with `flows.evaluate` on validation: a warm start that scores
here and not there memorised its demonstrations.

    .venv/bin/python research/train_split_pass.py CHECKPOINT_DIR
"""

import collections
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from flows.stages import collect_rollouts  # noqa: E402
from flows.prepare import prepare_run_context  # noqa: E402
from tasks.grading import grade_rollouts  # noqa: E402

ctx, _ = prepare_run_context("mini", {}, f"diag-train-{int(time.time())}", dataset_only=True)
try:
    ctx.cfg.agent.training.temperature, ctx.cfg.agent.training.top_p = 0.1, 0.95
    ctx.start_policy(pathlib.Path(sys.argv[1]), 0, trainer=False)
    ids = ctx.split_ids("train")[:64]
    t = ctx.loop.call(collect_rollouts(ctx, 1, ids, "train", 4, "trajectories"))
    rows = t.select(["rollout_id", "instance_id", "final_patch"]).to_pylist()
    r = grade_rollouts([(x["rollout_id"], ctx.run_id, 1, ctx.tasks[x["instance_id"]], x["final_patch"]) for x in rows],
                       ctx.cfg.sandbox, ctx.store).to_pylist()
    by = collections.defaultdict(list)
    for x in r:
        by[x["instance_id"]].append(x["reward"])
    print("train tasks", len(by), "pass@4", sum(any(v) for v in by.values()) / len(by),
          "mean reward", sum(x["reward"] for x in r) / len(r),
          "non-empty patches", sum(bool(x["final_patch"]) for x in rows) / len(rows))
finally:
    ctx.close()
