"""Real GRPO iterations on a task set a measurement chooses (used by grpo_fixed_tasks.py and
grpo_fresh_tasks.py; not a feature of the flows, which always train on the dataset's split)."""

from __future__ import annotations

import pathlib

from flows.runtime import RunContext


def bench_context(preset: str, overrides: list[str], prompts_per_step: int, run_id: str) -> RunContext:
    """A synchronous run's context over the preset's dataset (no warm start is built)."""
    from flows.process import prefect_defaults

    prefect_defaults()
    from flows.prepare import prepare_run_context
    from schemas.presets import parse_overrides

    overrides = parse_overrides(overrides + ["grpo.async_rollouts=false", f"grpo.prompts_per_step={prompts_per_step}"])
    ctx, _ = prepare_run_context(preset, overrides, run_id, dataset_only=True)
    return ctx


def pin_split(ctx: RunContext, split: str, ids: list[str]) -> None:
    """Make `split` mean exactly `ids` for this context (training batches, evaluation)."""
    ctx.split_ids = lambda s: ids if s == split else RunContext.split_ids(ctx, s)


def grpo_steps(ctx: RunContext, checkpoint: str, steps: int):
    """Serve `checkpoint`, run GRPO steps 1..steps, yield (step, graded reward rows); closes ctx."""
    from flows.grpo_iteration import grpo_iteration

    ctx.start_policy(pathlib.Path(checkpoint), 0)
    try:
        for step in range(1, steps + 1):
            grpo_iteration(ctx, step)
            yield step, [r for r in ctx.store.read_stage(ctx.run_id, step, "rewards").to_pylist()
                         if r["reward"] is not None]  # infra errors are not zeros
    finally:
        ctx.close()
