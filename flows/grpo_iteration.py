"""One GRPO iteration as a Prefect flow: rollouts -> grading -> advantages -> policy update -> weight sync.

Each stage is a Prefect task whose inputs and outputs are object-store keys. A
stage whose table is already committed is skipped, so rerunning an iteration
after a crash redoes only what is missing.
"""

from __future__ import annotations

import json
import shutil
import time

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.runtime import RunContext, log
from flows.stages import checkpoint_key, collect_rollouts, grading
from tasks.dataset.order import training_batch
from tasks.storage import stage_key


def training_batch_ids(ctx: RunContext, step: int) -> list[str]:
    g = ctx.cfg.grpo
    return training_batch(ctx.split_ids("train"), step - 1, g.prompts_per_step, ctx.cfg.seed, ctx.cfg.dataset.order)


@task(name="rollouts", cache_policy=NONE)
def rollouts(ctx: RunContext, step: int) -> str:
    key = stage_key(ctx.run_id, step, "trajectories")
    if ctx.store.is_committed(key):
        return key
    table = ctx.loop.call(collect_rollouts(ctx, step, training_batch_ids(ctx, step), "train",
                                           ctx.cfg.grpo.generations_per_prompt, "trajectories"))
    ctx.store.write_table(key, table, stage="trajectories")
    return key


@task(name="advantages", cache_policy=NONE)
def advantages(ctx: RunContext, step: int, trajectories_key: str, rewards_key: str) -> str:
    from tasks.grpo.advantages import compute_advantages, summarize_advantages

    key = stage_key(ctx.run_id, step, "advantages")
    if ctx.store.is_committed(key):
        return key
    table = compute_advantages(ctx.store.read_table(trajectories_key), ctx.store.read_table(rewards_key), ctx.cfg.grpo,
                               policy_version=ctx.policy_version)
    ctx.store.write_table(key, table, stage="advantages")
    s = summarize_advantages(table)
    log(f"step {step} advantages: {json.dumps(s, default=str)[:300]}")
    return key


@task(name="policy-update", cache_policy=NONE)
def update_policy(ctx: RunContext, step: int, trajectories_key: str, advantages_key: str) -> str:
    """Train on the step's batch; commit the new checkpoint (files first, then its marker).

    The path to the loss: `TrainerWorker.train_step` (this process) sends a `grpo` request to the
    trainer worker, whose `_handle_grpo` reads the tables and calls `PolicyTrainer.grpo_update`,
    which steps AdamW on `clipped_pg_loss` (tasks/policy/worker.py, grpo.py, tasks/grpo/loss.py).
    """
    key = checkpoint_key(ctx.run_id, step)
    if ctx.store.exists(key + ".commit"):
        return key
    out = ctx.workdir / "policy" / f"step-{step:05d}"
    log(f"step {step} update: start")
    metrics = ctx.trainer.train_step(str(ctx.store.local_path(trajectories_key)),
                                     str(ctx.store.local_path(advantages_key)), str(out), policy_version=step)
    ctx.store.put_dir(key, out)
    ctx.store.put_json(key + ".commit", {"step": step, "policy_version": step, "metrics": metrics,
                                         "weight_update_end_unix": metrics.get("weight_update_end_unix"),
                                         "committed_at": time.time()})
    log(f"step {step} update: loss {metrics.get('loss', float('nan')):.4f} grad_norm "
        f"{metrics.get('grad_norm', float('nan')):.3f} tokens {metrics.get('tokens', 0)} "
        f"is_oob {metrics.get('is_oob_ratio', 0):.3f} mult_prob_error {metrics.get('token_mult_prob_error', 0):.5f} "
        f"({metrics.get('precision', '?')}, {metrics.get('seconds', 0):.1f} s)")
    return key


@task(name="weight-sync", cache_policy=NONE)
def weight_sync(ctx: RunContext, step: int, checkpoint: str) -> int:
    local = ctx.workdir / "policy" / f"step-{step:05d}"
    if not local.exists():  # resumed on another machine, or the local copy was cleaned
        ctx.store.get_dir(checkpoint, local)
    ctx.loop.call(ctx.client.reload_weights(local, step))
    ctx.policy_dir, ctx.policy_version = local, step
    _prune_local_checkpoints(ctx, keep=2)
    return step


def _prune_local_checkpoints(ctx: RunContext, keep: int) -> None:
    dirs = sorted((ctx.workdir / "policy").glob("step-*"))
    for d in dirs[:-keep]:
        if d != ctx.policy_dir:
            shutil.rmtree(d, ignore_errors=True)


@flow(name="grpo_iteration")
def grpo_iteration(ctx: RunContext, step: int) -> dict:
    """rollouts -> grading -> advantages -> policy update -> weight sync for one step; returns stage
    timings (the policy update's as "update").

    Overlapped mode (grpo.async_rollouts): once this step's advantages are committed, the next
    step's rollouts start in the background with the current weights and run while this step
    trains; the weight sync lands mid-collection, so those trajectories are at most one policy
    version old (the importance-sampling correction accounts for it).
    """
    # Kept in the store stage by stage: a resumed step adds its stages to what earlier attempts ran.
    times_key = f"runs/{ctx.run_id}/step-{step:05d}/timings.json"
    times = ctx.store.get_json(times_key) if ctx.store.exists(times_key) else {}

    def timed(name, fn, *args):
        t0 = time.monotonic()
        out = fn(*args)
        times[name] = times.get(name, 0.0) + time.monotonic() - t0
        ctx.store.put_json(times_key, times)
        return out

    traj = timed("rollouts", rollouts, ctx, step)
    rew = timed("grading", grading, ctx, step, traj)
    adv = timed("advantages", advantages, ctx, step, traj, rew)
    prefetch = None
    if ctx.cfg.grpo.async_rollouts and ctx.cfg.grpo.max_trajectory_age >= 1 and step < ctx.cfg.max_steps:
        prefetch = rollouts.submit(ctx, step + 1)
    ckpt = timed("update", update_policy, ctx, step, traj, adv)
    timed("weight_sync", weight_sync, ctx, step, ckpt)
    if prefetch is not None:
        timed("rollouts_wait", prefetch.result)
    return times
