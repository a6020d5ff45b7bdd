"""Rollout throughput on mini-benchmark tasks (a benchmark, not a test).

    python tests/bench/bench_rollouts.py [--checkpoint DIR] [--concurrency 1 8 32] [--episodes 32]

One vLLM server (the mini preset's inference settings) serves a checkpoint (default: the
mini preset's warm-started base, prepared if missing); `collect` runs `--episodes` training
episodes (T=1) of train-split tasks at each concurrency, with real sandboxes. Reports
episodes per minute, generated tokens per second, and where an episode's wall time goes:
in the model (waiting on vLLM), in the sandbox (tool commands; sandbox start and teardown fall outside the episode), and the
rest (our own code: tokenizing, parsing tool calls, building the table).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", help="model dir (default: the mini preset's warm-started base)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--episodes", type=int, default=32, help="episodes per concurrency level")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    from flows.stages import collect_rollouts
    from flows.prepare import prepare_run_context

    ctx, base = prepare_run_context("mini", {}, f"bench-rollouts-{int(time.time())}",
                                    dataset_only=args.checkpoint is not None)
    results = []
    try:
        ctx.start_policy(pathlib.Path(args.checkpoint or base["base_model_dir"]), version=0, trainer=False)
        train_ids = ctx.split_ids("train")
        for i, conc in enumerate(args.concurrency):
            ctx.cfg.agent.concurrency = conc
            # distinct tasks per level (steps 1, 2, ...), one sample each, so no level reuses another's work
            ids = train_ids[i * args.episodes:(i + 1) * args.episodes]
            t0 = time.perf_counter()
            table = ctx.loop.call(collect_rollouts(ctx, i + 1, ids, "train", 1, "trajectories"))
            wall = time.perf_counter() - t0
            rows = table.to_pylist()
            gen = sum(r["generation_seconds"] for r in rows)
            sbx = sum(r["sandbox_seconds"] for r in rows)
            tot = sum(r["total_seconds"] for r in rows)
            toks = sum(r["num_generated_tokens"] for r in rows)
            res = dict(concurrency=conc, episodes=len(rows), wall_s=round(wall, 1),
                       episodes_per_min=round(60 * len(rows) / wall, 1), generated_tok_per_s=round(toks / wall, 1),
                       mean_turns=round(sum(r["num_turns"] for r in rows) / len(rows), 2),
                       share_model=round(gen / tot, 3), share_sandbox=round(sbx / tot, 3),
                       share_own_code=round(max(tot - gen - sbx, 0.0) / tot, 3),
                       load_avg_1m=round(os.getloadavg()[0], 1))
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        ctx.close()
    print(f"\n{'conc':>4} {'episodes/min':>12} {'gen tok/s':>9} {'turns':>5} {'model':>6} {'sandbox':>7} {'own':>5}")
    for r in results:
        print(f"{r['concurrency']:4d} {r['episodes_per_min']:12.1f} {r['generated_tok_per_s']:9.1f} "
              f"{r['mean_turns']:5.2f} {r['share_model']:6.1%} {r['share_sandbox']:7.1%} {r['share_own_code']:5.1%}")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
