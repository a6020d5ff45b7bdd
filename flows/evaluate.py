"""Evaluation: pass@k of a policy on the validation split (T=0.1, top-p 0.95 in the reference).

`evaluation(ctx, step)` runs inside the train flow with its server; the
`evaluate` flow serves a given checkpoint on its own (for a person, a
deployment, or the warm-started base model).
"""

from __future__ import annotations

import time

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.prepare import prepare_run_context
from flows.runtime import Progress, RunContext, log
from flows.stages import collect_rollouts, grading
from tasks.evaluation import (
    eval_samples_table,
    eval_summary_row,
    sample_until_solved,
    spread,
    summarize,
    summarize_early_stop,
    summary_table,
)
from tasks.gate import describe
from tasks.storage import stage_key


def eval_task_ids(ctx: RunContext) -> list[str]:
    """All validation tasks, or with eval.max_tasks an evenly strided subset of them: ids sort by
    package, so a prefix would evaluate one or two packages only."""
    ids = ctx.split_ids("validation")
    n = ctx.cfg.eval.max_tasks
    if n is None or n >= len(ids):
        return ids
    return [ids[i * len(ids) // n] for i in range(n)]


@task(name="eval-rollouts", cache_policy=NONE)
def eval_rollouts(ctx: RunContext, step: int) -> str:
    key = stage_key(ctx.run_id, step, "eval_trajectories")
    if ctx.store.is_committed(key):
        return key
    ids = eval_task_ids(ctx)
    table = ctx.loop.call(collect_rollouts(ctx, step, ids, "validation", ctx.cfg.eval.samples_per_task,
                                           "eval_trajectories"))
    ctx.store.write_table(key, table, stage="eval_trajectories")
    return key


@task(name="eval-until-solved", cache_policy=NONE)
def eval_until_solved(ctx: RunContext, step: int) -> tuple[str, str]:
    """eval.early_stop: each task's samples until its first success (tasks/evaluation.py)."""
    from tasks.rollout import RolloutSpec

    keys = stage_key(ctx.run_id, step, "eval_trajectories"), stage_key(ctx.run_id, step, "eval_rewards")
    if all(ctx.store.is_committed(k) for k in keys):
        return keys
    ids, sampling = eval_task_ids(ctx), ctx.cfg.agent.validation
    spec = RolloutSpec(run_id=ctx.run_id, step=step, split="validation", samples_per_task=ctx.cfg.eval.k,
                       temperature=sampling.temperature, top_p=sampling.top_p)
    log(f"step {step} evaluation: start ({len(ids)} tasks, samples until the first success, at most "
        f"{ctx.cfg.eval.k}; policy v{ctx.client.version})")
    # Counted in tasks decided (a success, or k samples): a task's sample count is unknown until then.
    progress = Progress(f"step {step} eval", len(ids), "tasks decided", every_s=30)
    traj, rew = ctx.loop.call(sample_until_solved(
        [ctx.tasks[i] for i in ids], spec, ctx.client, ctx.tokenizer, ctx.cfg, ctx.store, ctx.cfg.eval.k,
        partial_key=stage_key(ctx.run_id, step, "eval_trajectories_partial"), on_task=progress))
    ctx.store.write_table(keys[0], traj, stage="eval_trajectories")
    ctx.store.write_table(keys[1], rew, stage="eval_rewards")
    return keys


@task(name="summarize-evaluation", cache_policy=NONE)
def summarize_evaluation(ctx: RunContext, step: int, trajectories_key: str, rewards_key: str,
                         seconds: float) -> dict:
    key = stage_key(ctx.run_id, step, "eval_summary")
    if ctx.store.is_committed(key):
        return ctx.store.read_table(key).to_pylist()[0]
    samples = eval_samples_table(ctx.store.read_table(trajectories_key), ctx.store.read_table(rewards_key))
    ctx.store.write_table(stage_key(ctx.run_id, step, "eval_samples"), samples, stage="eval_samples", overwrite=True)
    ids, early = eval_task_ids(ctx), ctx.cfg.eval.early_stop
    s = (summarize_early_stop if early else summarize)(samples.to_pylist(), ctx.cfg.eval.k, task_ids=ids)
    versions = samples["policy_version"].to_pylist()
    row = eval_summary_row(ctx.run_id, step, min(versions) if versions else ctx.policy_version, s, ctx.cfg.eval.k,
                           samples_count=step * ctx.cfg.grpo.global_batch_size, seconds=seconds,
                           procedure="early_stop" if early else "full", started_unix=time.time() - seconds,
                           target=ctx.cfg.eval.target)

    ctx.store.write_table(key, summary_table([row]), stage="eval_summary")
    ctx.store.put_json(stage_key(ctx.run_id, step, "eval_spread").replace(".parquet", ".json"), spread(s))
    return row


def evaluation(ctx: RunContext, step: int) -> dict:
    t0 = time.monotonic()
    if ctx.cfg.eval.early_stop:
        traj, rew = eval_until_solved(ctx, step)
    else:
        traj = eval_rollouts(ctx, step)
        rew = grading(ctx, step, traj, stage="eval_rewards")
    row = summarize_evaluation(ctx, step, traj, rew, time.monotonic() - t0)
    hat = f"pass^{row['k']} {row['pass_hat_k']:.3f}  " if row["pass_hat_k"] is not None else ""
    log(f"step {step} evaluation: {describe(row, ctx.cfg.eval.target)}  pass@1 {row['pass_at_1']:.3f}  {hat}"
        f"({row['num_tasks']} tasks, {row['num_samples']} samples, {row['num_masked']} masked, "
        f"{row['eval_seconds'] / 60:.1f} min)")
    return row


@flow(name="evaluate")
def evaluate(preset: str = "mini", overrides: dict | None = None, checkpoint: str | None = None,
             run_id: str | None = None, step: int = 0) -> dict:
    """pass@k of `checkpoint` (a model dir or object-store URI; default: the preset's warm-started base)."""
    ctx, base = prepare_run_context(preset, overrides, run_id or f"eval-{int(time.time())}",
                                    dataset_only=checkpoint is not None)
    try:
        from tasks.policy.model import resolve_model_dir

        if checkpoint is None:
            model_dir = base["base_model_dir"]
        else:  # a local directory, a URI, or a key in the run's store
            local = checkpoint.startswith("/") or "://" in checkpoint
            model_dir = resolve_model_dir(checkpoint if local else ctx.store.uri(checkpoint),
                                          storage_options=_storage_options(ctx))
        ctx.start_policy(model_dir, version=0, trainer=False)
        return evaluation(ctx, step)
    finally:
        ctx.close()


def _storage_options(ctx: RunContext) -> dict | None:
    ep = ctx.cfg.storage.endpoint_url
    return {"client_kwargs": {"endpoint_url": ep}} if ep else None
