"""Does GRPO learn something general when no prompt repeats? (a measurement script, not a test)

Generates fresh training-distribution tasks (tasks/dataset/mini.py: generate_pool with another
seed), keeps those whose buggy function and issue appear neither in the benchmark nor in the
warm start's SFT pool, and runs real GRPO iterations (vLLM rollouts, sandbox grading,
advantages, trainer update, weight sync) on them, each task used by one step only. The policy
has never seen any of these tasks, so the training reward of step k is a held-out measurement
of the policy after k-1 updates: if it rises, what GRPO learns transfers to new instances.

    python research/grpo_fresh_tasks.py CHECKPOINT_DIR [--prompts 32] [--steps 40] [overrides ...]
    python research/grpo_fresh_tasks.py CHECKPOINT_DIR --compare CKPT [--compare CKPT ...] [--heldout 128] [...]

--compare evaluates the base CHECKPOINT_DIR and each CKPT (pass@k at the validation sampling, as
the evaluation flow does) on fresh tasks that a run with the same --prompts/--steps/--pool-seed
did not train on: the same comparison as the validation pass@4, on tasks no policy has seen.

Validation tasks are never touched (the generator keeps the split rule against them). The run's
tables and per-step checkpoints go to runs/bench-fresh-<time>/ in the object store.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def fresh_tasks(ctx, n: int, seed: int) -> list[dict]:
    """At least n generated tasks (pools of seeds seed, seed+1, ... until there are n), sharing no
    buggy function or issue text with any task the benchmark or the SFT pool holds; their
    environments stored like the pool's. The same arguments give the same tasks in the same order."""
    from schemas.presets import load_recipe
    from tasks.dataset import mini
    from tasks.dataset.build import mini_dataset_id, pool_key

    cfg, recipe = ctx.cfg, load_recipe(ctx.cfg.preset)
    benchmark = list(ctx.tasks.values())
    seen = set()
    did = mini_dataset_id(cfg.dataset, cfg.sandbox.image)
    sft_pool = pool_key(did, recipe.pool_tasks, recipe.pool_foreign_names)
    sft_rows = ctx.store.read_table(sft_pool, stage="tasks").to_pylist() if recipe.pool_tasks else []
    for row in benchmark + sft_rows:
        seen.add(json.loads(row["parsed_commit_content"])["metadata"]["buggy_function"])
        seen.add(row["problem_statement"])
    rows = []
    # Most generated tasks repeat a function body the SFT pool holds (few sites per family).
    while len(rows) < n:
        generated = mini.generate_pool(cfg.dataset.model_copy(update={"seed": seed}), 2000, benchmark,
                                       docker_image=cfg.sandbox.image)
        before = len(rows)
        for t in generated:
            body = json.loads(t.row["parsed_commit_content"])["metadata"]["buggy_function"]
            if body in seen or t.row["problem_statement"] in seen:
                continue
            seen.update((body, t.row["problem_statement"]))
            iid = f"fresh{seed}-{t.row['instance_id']}"
            uri = ctx.store.put_bytes(f"environments/{did}/fresh-{seed}/{iid}.tar.gz", t.archive)
            rows.append(dict(t.row, instance_id=iid, split="train", environment_uri=uri))
        print(f"fresh tasks: {len(rows) - before} of {len(generated)} generated with seed {seed} are new "
              f"to the policy ({len(rows)} in all)", flush=True)
        if len(rows) == before:
            break
        seed += 1
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--prompts", type=int, default=32, help="fresh tasks per step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pool-seed", type=int, default=1000)
    # Repeated, not nargs="+": a list option would also swallow the overrides after it.
    ap.add_argument("--compare", action="append", metavar="CKPT", help="a checkpoint to evaluate on held-out fresh "
                    "tasks (repeat for more)")
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    from flows.evaluate import evaluation
    from flows.stages import checkpoint_key
    from grpo_steps import bench_context, grpo_steps, pin_split

    run_id = f"bench-fresh{'-compare' if args.compare else ''}-{int(time.time())}"
    ctx = bench_context(args.preset, args.overrides, args.prompts, run_id)
    used = args.prompts * args.steps
    need = used + (args.heldout if args.compare else 0)
    rows = fresh_tasks(ctx, need, args.pool_seed)
    if len(rows) < need:
        sys.exit(f"only {len(rows)} fresh tasks, {need} needed")
    ctx.tasks.update({r["instance_id"]: r for r in rows[:need]})
    if args.compare:
        heldout = sorted(r["instance_id"] for r in rows[used:need])
        pin_split(ctx, "validation", heldout)
        ctx.start_policy(pathlib.Path(args.checkpoint), 0, trainer=False)
        try:
            results = [("base", evaluation(ctx, 0))]
            for i, ckpt in enumerate(args.compare, start=1):
                ctx.loop.call(ctx.client.reload_weights(pathlib.Path(ckpt), i))
                results.append((ckpt, evaluation(ctx, i)))
        finally:
            ctx.close()
        print(f"\n{len(heldout)} held-out fresh tasks (run {run_id}):")
        for name, row in results:
            print(f"  pass@{row['k']} {row['pass_at_k']:.3f}  pass@1 {row['pass_at_1']:.3f}  {name}")
        return
    # training_batch's seeded order over exactly steps x prompts ids uses each once in the run.
    pin_split(ctx, "train", [r["instance_id"] for r in rows[:used]])
    means = []
    for step, rewards in grpo_steps(ctx, args.checkpoint, args.steps):
        means.append(statistics.mean(r["reward"] for r in rewards))
        print(f"step {step}: mean reward on {args.prompts} new tasks {means[-1]:.3f}", flush=True)
    n = max(1, len(means) // 4)
    early, late = statistics.mean(means[:n]), statistics.mean(means[-n:])
    print(f"\nmean reward on new tasks, first {n} steps {early:.3f}, last {n} steps {late:.3f} ({late - early:+.3f})")
    print(f"checkpoints: {ctx.store.uri(checkpoint_key(run_id, args.steps))} (and every step before)")

if __name__ == "__main__":
    main()
