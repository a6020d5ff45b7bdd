"""Stages more than one flow runs: the episodes of a batch of tasks (training and evaluation
rollouts), their grading, and where a step's checkpoint is kept.

`flows/grpo_iteration.py` (training), `flows/evaluate.py` (evaluation), `flows/train.py` and
`flows/offline_eval.py` (checkpoints) import them from here.
"""

from __future__ import annotations

from collections import Counter

from prefect import task
from prefect.cache_policies import NONE

from flows.runtime import Progress, RunContext, log
from tasks.grading import grade_rollouts
from tasks.grading.grader import hack_report
from tasks.storage import Store, stage_key


def checkpoint_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/checkpoints/step-{step:05d}"


def last_checkpoint(store: Store, run_id: str) -> int:
    """The last step whose checkpoint is committed (0: none yet)."""
    step = 0
    while store.exists(checkpoint_key(run_id, step + 1) + ".commit"):
        step += 1
    return step


async def collect_rollouts(ctx: RunContext, step: int, instance_ids: list[str], split: str, samples: int,
                           stage: str):
    """The episodes of `samples` rollouts per task under the split's sampling settings, as a table
    (progress flushed to `<stage>_partial`; committing the stage is the caller's)."""
    from tasks.rollout import PartialTable, RolloutSpec, adversary_episodes, collect, served_episodes

    sampling = ctx.cfg.agent.training if split == "train" else ctx.cfg.agent.validation
    spec = RolloutSpec(run_id=ctx.run_id, step=step, split=split, samples_per_task=samples,
                       temperature=sampling.temperature, top_p=sampling.top_p)
    total = len(instance_ids) * samples
    a = ctx.cfg.agent
    if ctx.cfg.cluster.address:  # the config refuses the adversary on a cluster
        from tasks.cluster import RayEpisodes

        # Episodes in the nodes' runner actors, spread evenly; rows come back here to be committed.
        episodes = RayEpisodes(spec, ctx.client, ctx.tokenizer, ctx.cfg, ctx.store, say=log)
    elif split == "train" and a.adversary_rate > 0:
        from tasks.agent.adversary import policy_factory
        from tasks.dataset.mini import gold_patch

        # Hostile episodes mixed into the policy's (tasks/agent/adversary.py), planned by rollout id.
        adversary = policy_factory(ctx.client, ctx.tokenizer, gold_patch, ctx.run_id, step, a.adversary_rate,
                                   a.adversary_seed, a.max_turns)
        episodes = adversary_episodes(ctx.client, adversary, spec, ctx.tokenizer, ctx.cfg, ctx.store)
    else:
        episodes = served_episodes(ctx.client, spec, ctx.tokenizer, ctx.cfg, ctx.store)
    where = f" on the Ray cluster at {ctx.cfg.cluster.address}" if ctx.cfg.cluster.address else ""
    progress = Progress(f"step {step} {stage}", total, "episodes", every_s=30)

    def start(committed: int):
        progress.resumed(committed)
        log(f"step {step} {stage}: start ({total} episodes"
            + (f", {committed} committed by an earlier attempt" if committed else "")
            + f", policy v{ctx.client.version}{where})")

    return await collect([ctx.tasks[i] for i in instance_ids], spec, episodes, a.concurrency,
                         partial=PartialTable(ctx.store, stage_key(ctx.run_id, step, f"{stage}_partial"),
                                              a.partial_flush_s),
                         on_start=start, on_episode=progress)


@task(name="grading", cache_policy=NONE)
def grading(ctx: RunContext, step: int, trajectories_key: str, stage: str = "rewards") -> str:
    """Each trajectory's final patch graded by its task's hidden tests; commits the `stage` table."""
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
