"""One GRPO iteration as a Prefect flow: rollouts -> grading -> advantages -> policy update -> weight sync.

Each stage is a Prefect task whose inputs and outputs are object-store keys. A
stage whose table is already committed is skipped, so rerunning an iteration
after a crash redoes only what is missing.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.runtime import Progress, RunContext, log
from tasks.grading.grader import hack_report
from tasks.storage import stage_key


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:05d}"


def training_batch_ids(ctx: RunContext, step: int) -> list[str]:
    from tasks.dataset.order import training_batch

    g = ctx.cfg.grpo
    return training_batch(ctx.split_ids("train"), step - 1, g.prompts_per_step, ctx.cfg.seed, ctx.cfg.dataset.order)


async def collect_rollouts(ctx: RunContext, step: int, instance_ids: list[str], split: str, samples: int,
                           stage: str):
    from tasks.rollout import RolloutSpec, collect

    sampling = ctx.cfg.agent.training if split == "train" else ctx.cfg.agent.validation
    spec = RolloutSpec(run_id=ctx.run_id, step=step, split=split, samples_per_task=samples,
                       temperature=sampling.temperature, top_p=sampling.top_p)
    total = len(instance_ids) * samples
    runner = None
    if ctx.cfg.cluster.address:
        from tasks.cluster import RayEpisodes

        # Episodes in the nodes' runner actors, spread evenly; rows come back here to be committed.
        runner = RayEpisodes(spec, ctx.client, ctx.tokenizer, ctx.cfg, ctx.store, say=log)
    adversary, a = None, ctx.cfg.agent
    if split == "train" and a.adversary_rate > 0:
        from tasks.agent.adversary import policy_factory
        from tasks.dataset.mini import gold_patch

        # Hostile episodes mixed into the policy's (tasks/agent/adversary.py), planned by rollout id.
        adversary = policy_factory(ctx.client, ctx.tokenizer, gold_patch, ctx.run_id, step, a.adversary_rate,
                                   a.adversary_seed, a.max_turns)
    where = f" on the Ray cluster at {ctx.cfg.cluster.address}" if runner else ""
    log(f"step {step} {stage}: start ({total} episodes, policy v{ctx.client.version}{where})")
    return await collect([ctx.tasks[i] for i in instance_ids], spec, ctx.client, ctx.tokenizer, ctx.cfg, ctx.store,
                         partial_key=stage_key(ctx.run_id, step, f"{stage}_partial"),
                         on_episode=Progress(f"step {step} {stage}", total, "episodes", every_s=30),
                         flush_every_s=ctx.cfg.agent.partial_flush_s, episode_runner=runner, policy_factory=adversary)


@task(name="rollouts", cache_policy=NONE)
def rollouts(ctx: RunContext, step: int) -> str:
    key = stage_key(ctx.run_id, step, "trajectories")
    if ctx.store.is_committed(key):
        return key
    table = ctx.loop.call(collect_rollouts(ctx, step, training_batch_ids(ctx, step), "train",
                                           ctx.cfg.grpo.generations_per_prompt, "trajectories"))
    ctx.store.write_table(key, table, stage="trajectories")
    return key


@task(name="grading", cache_policy=NONE)
def grading(ctx: RunContext, step: int, trajectories_key: str, stage: str = "rewards") -> str:
    from tasks.grading import grade_rollouts

    key = stage_key(ctx.run_id, step, stage)
    if ctx.store.is_committed(key):
        return key
    traj = ctx.store.read_table(trajectories_key,
                                columns=["rollout_id", "instance_id", "final_patch", "finish_reason"]).to_pylist()
    items = [(t["rollout_id"], ctx.run_id, step, ctx.tasks[t["instance_id"]], t["final_patch"]) for t in traj]
    distinct = len({(t["instance_id"], t["final_patch"]) for t in traj})
    pool = None
    if ctx.cfg.cluster.address:
        from tasks.cluster import RayGrading

        # One Ray task per distinct patch, on a node with the backend's capacity.
        pool = RayGrading(ctx.cfg.cluster, ctx.cfg.sandbox, ctx.store)
    log(f"step {step} {stage}: start ({len(items)} patches, {distinct} distinct"
        + (f", on the Ray cluster at {ctx.cfg.cluster.address})" if pool else ")"))
    table = grade_rollouts(items, ctx.cfg.sandbox, ctx.store, pool=pool,
                           on_graded=Progress(f"step {step} {stage}", distinct, "gradings", every_s=30))
    ctx.store.write_table(key, table, stage=stage)
    rewards = [r for r in table["reward"].to_pylist() if r is not None]
    hacks = sum(1 for h in table["harness_changes"].to_pylist() if h)
    flagged = hack_report(table)
    statuses = table.select(["instance_id", "grading_status"]).to_pylist()
    ended = Counter(t["finish_reason"] for t in traj)
    env = sum(1 for r in statuses if r["grading_status"] == "env_error")
    # A task whose every rollout hit an environment error teaches nothing: name it.
    lost = sorted({r["instance_id"] for r in statuses}
                  - {r["instance_id"] for r in statuses if r["grading_status"] != "env_error"})
    log(f"step {step} {stage}: {len(rewards)} graded, mean reward {sum(rewards) / max(1, len(rewards)):.3f}, "
        f"{table.num_rows - len(rewards) - env} infra errors, {env} environment errors (masked)"
        + (f", {hacks} patches changed the test harness (removed before grading)" if hacks else "")
        + (f", {flagged}" if flagged else "")
        + (f", {ended['agent_error']} episodes ended by an error of ours (agent_error, masked; traceback in "
           "the trajectory's error)" if ended["agent_error"] else "")
        + (f", {ended['patch_too_large']} patches over the diff cap (graded as the empty patch)"
           if ended["patch_too_large"] else "")
        + (f", {ended['patch_unreadable']} repositories git could not diff (graded as the empty patch)"
           if ended["patch_unreadable"] else "")
        + (f"; tasks whose tests never ran (every rollout an environment error): {', '.join(lost)}" if lost else ""))
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
def update(ctx: RunContext, step: int, trajectories_key: str, advantages_key: str) -> str:
    """Train on the step's batch; commit the new checkpoint (files first, then its marker)."""
    key = checkpoint_key(ctx.run_id, step)
    if ctx.store.exists(key + ".commit"):
        return key
    out = ctx.workdir / "policy" / f"step-{step:05d}"
    log(f"step {step} update: start")
    metrics = ctx.trainer.update(str(ctx.store.local_path(trajectories_key)),
                                 str(ctx.store.local_path(advantages_key)), str(out), policy_version=step)
    ctx.store.put_dir(key, out)
    ctx.store.put_json(key + ".commit", {"step": step, "policy_version": step, "metrics": metrics,
                                         "weight_update_end_unix": metrics.get("weight_update_end_unix"),
                                         "committed_at": time.time()})
    log(f"step {step} update: loss {metrics.get('loss', float('nan')):.4f} grad_norm "
        f"{metrics.get('grad_norm', float('nan')):.3f} tokens {metrics.get('tokens', 0)} "
        f"is_oob {metrics.get('is_oob_ratio', 0):.3f} ({metrics.get('seconds', 0):.1f} s)")
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
    import shutil

    dirs = sorted((ctx.workdir / "policy").glob("step-*"))
    for d in dirs[:-keep]:
        if d != ctx.policy_dir:
            shutil.rmtree(d, ignore_errors=True)


@flow(name="grpo_iteration")
def grpo_iteration(ctx: RunContext, step: int) -> dict:
    """rollouts -> grading -> advantages -> update -> weight sync for one step; returns stage timings.

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
    ckpt = timed("update", update, ctx, step, traj, adv)
    timed("weight_sync", weight_sync, ctx, step, ckpt)
    if prefetch is not None:
        timed("rollouts_wait", prefetch.result)
    return times
