"""Orchestration overhead: one GRPO iteration as the Prefect flow (tables committed to the object
store, validated on write and read) versus the same task functions called in one plain Python
process with the tables kept in memory (synchronous collection in both; synchronous versus
overlapped is tests/bench/bench_overlap.py).

    python tests/bench/bench_orchestration.py [--preset smoke] [--repeats 3] [overrides ...]

Both variants share one vLLM server and one trainer worker, and run alternately, so machine
load affects them alike. Reports medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkpoint", help="policy to serve and train (default: the preset's warm-started base)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from flows.process import prefect_defaults

    prefect_defaults()
    import pyarrow.parquet as pq

    from flows.grpo_iteration import grpo_iteration, training_batch_ids
    from tasks.rollout import RolloutSpec, collect, served_episodes
    from flows.prepare import prepare_run_context
    from schemas.presets import parse_overrides
    from tasks.grading import grade_rollouts
    from tasks.grpo.advantages import compute_advantages

    run_id = f"bench-orch-{int(time.time())}"
    overrides = parse_overrides(args.overrides + ["grpo.async_rollouts=false"])
    ctx, prepared = prepare_run_context(args.preset, overrides, run_id, dataset_only=args.checkpoint is not None)
    ctx.start_policy(__import__("pathlib").Path(args.checkpoint or prepared["base_model_dir"]), 0)
    tmp = tempfile.mkdtemp(prefix="bench-orch-")
    flow_times, plain_times = [], []
    try:
        step = 0
        for rep in range(args.repeats):
            # --- Prefect flow, object store -------------------------------------------------
            step += 1
            t0 = time.perf_counter()
            grpo_iteration(ctx, step)
            flow_times.append(time.perf_counter() - t0)
            # --- plain functions, in memory --------------------------------------------------
            step += 1
            t0 = time.perf_counter()
            g = ctx.cfg.agent.training
            spec = RolloutSpec(run_id=run_id, step=step, split="train",
                               samples_per_task=ctx.cfg.grpo.generations_per_prompt, temperature=g.temperature,
                               top_p=g.top_p)
            episodes = served_episodes(ctx.client, spec, ctx.tokenizer, ctx.cfg, ctx.store)
            traj = ctx.loop.call(collect([ctx.tasks[i] for i in training_batch_ids(ctx, step)], spec, episodes,
                                         ctx.cfg.agent.concurrency))
            rows = traj.select(["rollout_id", "instance_id", "final_patch"]).to_pylist()
            rewards = grade_rollouts([(r["rollout_id"], run_id, step, ctx.tasks[r["instance_id"]], r["final_patch"])
                                      for r in rows], ctx.cfg.sandbox, ctx.store)  # the store only serves task archives
            adv = compute_advantages(traj, rewards, ctx.cfg.grpo)
            # the trainer is another process: it needs files either way (plain Parquet, no validation/commit)
            tp, ap_ = os.path.join(tmp, f"t{step}.parquet"), os.path.join(tmp, f"a{step}.parquet")
            pq.write_table(traj, tp)
            pq.write_table(adv, ap_)
            out = os.path.join(tmp, f"ckpt-{step}")
            ctx.trainer.train_step(tp, ap_, out, policy_version=step)
            ctx.loop.call(ctx.client.reload_weights(out, step))
            plain_times.append(time.perf_counter() - t0)
            print(f"repeat {rep}: flow {flow_times[-1]:.1f} s, plain {plain_times[-1]:.1f} s", flush=True)
    finally:
        ctx.close()
    f, p = statistics.median(flow_times), statistics.median(plain_times)
    print(f"\niteration wall time, median of {args.repeats}: Prefect flow + object store {f:.2f} s, "
          f"plain in-memory {p:.2f} s, overhead {100 * (f / p - 1):+.1f}%")


if __name__ == "__main__":
    main()
