"""What a run shows in the Prefect UI (its flow run's Artifacts tab and the Artifacts page).

    publish_step(ctx, step, times)   a new version of the table artifact `<run>-progress`: one row per
                                     step so far (reward, solved, finish reasons, turns, tokens,
                                     groups with signal, pass@k when evaluated, seconds per stage)
    publish_run(ctx, summary)        markdown `<run>-summary`: status, time to train, the pass@k curve
                                     (PNG, inline), evaluations, time per stage, where the tables and
                                     the MLPerf log are

`ctx` needs `.store` and `.run_id` (and `.cfg` for the target line); a RunContext has them.
Both are no-ops outside a flow run and never raise: a run must not fail because the
UI could not be told about it. Both are idempotent within one flow run, so the
deployment entry flow may publish after `train` whether or not `train` already did.
"""

from __future__ import annotations

import re
import sys

_rows: dict[tuple[str, str], dict[int, dict]] = {}  # (flow run id, run id) -> step -> row
_published: set[tuple] = set()


def _flow_run_id() -> str | None:
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    except Exception:
        return None


def artifact_key(run_id: str, what: str) -> str:
    """Prefect keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", f"{run_id}-{what}".lower())).strip("-")


def _warn(what: str, e: Exception) -> None:
    print(f"warning: could not publish {what} to the Prefect UI: {type(e).__name__}: {e}", file=sys.stderr)


def publish_step(ctx, step: int, times: dict | None = None) -> None:
    fr = _flow_run_id()
    if fr is None or (fr, ctx.run_id, step) in _published:
        return
    try:
        from prefect.artifacts import create_table_artifact

        from tasks.inspect import step_stats

        row = step_stats(ctx.store, ctx.run_id, step)
        row.update({f"s_{k}": round(v, 1) for k, v in sorted((times or {}).items())})
        rows = _rows.setdefault((fr, ctx.run_id), {})
        rows[step] = row
        table = [rows[s] for s in sorted(rows)]
        cols = list(dict.fromkeys(k for r in table for k in r))  # every row the same columns, in order
        create_table_artifact([{c: r.get(c) for c in cols} for r in table], key=artifact_key(ctx.run_id, "progress"),
                              description=f"run {ctx.run_id}: one row per GRPO step (s_* = seconds per stage)")
        _published.add((fr, ctx.run_id, step))
    except Exception as e:
        _warn(f"step {step}", e)


def publish_steps(ctx) -> None:
    """Publish every step that has timings in the store (for callers that did not publish per step)."""
    if _flow_run_id() is None:
        return
    try:
        step = 1
        while ctx.store.exists(f"runs/{ctx.run_id}/step-{step:05d}/timings.json"):
            publish_step(ctx, step, ctx.store.get_json(f"runs/{ctx.run_id}/step-{step:05d}/timings.json"))
            step += 1
    except Exception as e:
        _warn("steps", e)


def publish_run(ctx, summary: dict) -> None:
    fr = _flow_run_id()
    if fr is None or (fr, ctx.run_id, "run") in _published:
        return
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(run_markdown(ctx, summary), key=artifact_key(ctx.run_id, "summary"),
                                 description=f"run {ctx.run_id}: pass@k, time to train, where everything is")
        _published.add((fr, ctx.run_id, "run"))
    except Exception as e:
        _warn("the run summary", e)


def run_markdown(ctx, summary: dict) -> str:
    from tasks.inspect import Run, pass_at_k_png, png_data_uri

    cfg = getattr(ctx, "cfg", None)
    target = cfg.eval.target if cfg is not None else None
    ttt = summary.get("time_to_train_s")
    lines = [f"# run `{summary['run_id']}`: {summary['status']}", "",
             f"- time to train (MLPerf run_start..run_stop): **{ttt / 60:.1f} min**" if ttt else
             "- time to train: n/a", f"- steps: {summary['steps']}, attempts: {summary['attempts']}"]
    if target is not None:
        lines.append(f"- target pass@k: {target}")
    evals = summary.get("evaluations") or []
    if evals or summary.get("base_pass_at_k") is not None:
        run = Run(store=ctx.store, run_id=ctx.run_id, manifest=ctx.store.read_manifest(ctx.run_id))
        lines += ["", f"![pass@k per evaluation]({png_data_uri(pass_at_k_png(run, target))})", "",
                  "| step | pass@k | pass@1 | samples_count |", "|---:|---:|---:|---:|"]
        if summary.get("base_pass_at_k") is not None:
            lines.append(f"| base | {summary['base_pass_at_k']:.3f} | {summary['base_pass_at_1']:.3f} | 0 |")
        lines += [f"| {e['step']} | {e['pass_at_k']:.3f} | {e['pass_at_1']:.3f} | {e['samples_count']} |"
                  for e in evals]
    stages = summary.get("stage_seconds") or {}
    if stages:
        total = sum(stages.values()) or 1.0
        lines += ["", "| stage | seconds | share |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:.0f} | {100 * v / total:.0f}% |" for k, v in stages.items()]
    lines += ["", "| what | where |", "|---|---|",
              f"| run tables | `{summary.get('tables')}` |", f"| MLPerf log | `{summary.get('mlperf_log')}` |",
              f"| manifest | `{ctx.store.uri(f'runs/{ctx.run_id}/manifest.json')}` |",
              f"| notebook | `RLVR_RUN_ID={ctx.run_id} jupyter nbconvert --execute notebooks/inspect_run.ipynb` |"]
    return "\n".join(lines)
