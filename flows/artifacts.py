"""What a run shows in the Prefect UI (its flow run's Artifacts tab and the Artifacts page).

    publish_step(ctx, step, times)   progress bar `<run>-steps` (step / max_steps, updated in place) and,
                                     after an evaluation or every 10th step, a new version of the table
                                     `<run>-progress`: one row per step so far (reward, solved, finish
                                     reasons, turns, tokens, groups with signal, pass@k when evaluated,
                                     seconds per stage)
    publish_run(ctx, summary)        the final progress table and markdown `<run>-summary`: status, time
                                     to train, the pass@k curve (PNG, inline), evaluations, time per
                                     stage, where the tables and the MLPerf log are

`ctx` needs `.store` and `.run_id` (and `.cfg` for the target line); a RunContext has them.
Both are no-ops outside a flow run and never raise: a run must not fail because the
UI could not be told about it. Both are idempotent within one flow run, so the
deployment entry flow may publish after `train` whether or not `train` already did.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

@dataclass
class _RunState:  # what one flow run has published for one training run
    rows: dict = field(default_factory=dict)      # step -> progress-table row
    tabled: int = 0                                # rows in the last published table version
    progress_id: object = None                     # the progress artifact, updated in place
    done: set = field(default_factory=set)         # steps (and "run") already published


_state: dict[tuple[str, str], _RunState] = {}


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


def publish_step(ctx, step: int, times: dict | None = None, table: bool | None = None) -> None:
    """Record step `step`, move the progress bar; publish a new version of the progress table when the
    step was evaluated or every 10th step (table=None), always (True) or never (False): one version per
    step would fill the run's Artifacts tab on a 200-step run."""
    fr = _flow_run_id()
    if fr is None:
        return
    st = _state.setdefault((fr, ctx.run_id), _RunState())
    if step in st.done:
        return
    try:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        from tasks.inspect import step_stats

        row = step_stats(ctx.store, ctx.run_id, step)
        row.update({f"s_{k}": round(v, 1) for k, v in sorted((times or {}).items())})
        st.rows[step] = row
        st.done.add(step)
        max_steps = getattr(getattr(ctx, "cfg", None), "max_steps", None)
        if max_steps:
            pct = min(100.0, 100.0 * step / max_steps)
            if st.progress_id is None:
                st.progress_id = create_progress_artifact(pct, key=artifact_key(ctx.run_id, "steps"),
                                                          description=f"run {ctx.run_id}: steps done of {max_steps}")
            else:
                update_progress_artifact(st.progress_id, pct)
        evaluated = any(k.startswith("pass@") for k in row)
        if table or (table is None and (evaluated or step % 10 == 0)):
            _publish_table(ctx, st)
    except Exception as e:
        _warn(f"step {step}", e)


def _publish_table(ctx, st: _RunState) -> None:
    from prefect.artifacts import create_table_artifact

    if not st.rows or len(st.rows) == st.tabled:
        return
    rows = [st.rows[s] for s in sorted(st.rows)]
    cols = list(dict.fromkeys(k for r in rows for k in r))  # every row the same columns, in order
    create_table_artifact([{c: r.get(c) for c in cols} for r in rows], key=artifact_key(ctx.run_id, "progress"),
                          description=f"run {ctx.run_id}: one row per GRPO step (s_* = seconds per stage)")
    st.tabled = len(st.rows)


def publish_steps(ctx) -> None:
    """Record every step that has timings in the store (for callers that did not publish per step);
    the table follows with publish_run."""
    if _flow_run_id() is None:
        return
    try:
        step = 1
        while ctx.store.exists(f"runs/{ctx.run_id}/step-{step:05d}/timings.json"):
            publish_step(ctx, step, ctx.store.get_json(f"runs/{ctx.run_id}/step-{step:05d}/timings.json"),
                         table=False)
            step += 1
    except Exception as e:
        _warn("steps", e)


def publish_run(ctx, summary: dict) -> None:
    fr = _flow_run_id()
    if fr is None:
        return
    st = _state.setdefault((fr, ctx.run_id), _RunState())
    if "run" in st.done:
        return
    try:
        from prefect.artifacts import create_markdown_artifact

        _publish_table(ctx, st)
        create_markdown_artifact(run_markdown(ctx, summary), key=artifact_key(ctx.run_id, "summary"),
                                 description=f"run {ctx.run_id}: pass@k, time to train, where everything is")
        st.done.add("run")
    except Exception as e:
        _warn("the run summary", e)


def _ci(e: dict, col: str) -> str:
    """'0.721 [0.662, 0.773]', or the bare number for rows written before the intervals."""
    if e.get(f"{col}_low") is None:
        return f"{e[col]:.3f}"
    return f"{e[col]:.3f} [{e[f'{col}_low']:.3f}, {e[f'{col}_high']:.3f}]"


def _p(e: dict) -> str:
    return "" if e.get("p_above_target") is None else f"{e['p_above_target']:.2f}"


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
                  "| step | pass@k [95%] | pass@1 [95%] | P(> target) | samples_count |", "|---:|---:|---:|---:|---:|"]
        if summary.get("base_pass_at_k") is not None:
            lines.append(f"| base | {summary['base_pass_at_k']:.3f} | {summary['base_pass_at_1']:.3f} | | 0 |")
        lines += [f"| {e['step']} | {_ci(e, 'pass_at_k')} | {_ci(e, 'pass_at_1')} | {_p(e)} | {e['samples_count']} |"
                  for e in evals]
    off = summary.get("offline")
    if off:
        from tasks.mlperf import offline_clock

        verdict = f"checkpoint **{off['passed_step']}** passed" if off["passed_step"] else "no checkpoint passed"
        lines += ["", f"Offline evaluation: {verdict}; training stopped after step {off['last_step']}; "
                      f"{off['minutes']:.1f} min of evaluation, {offline_clock(off.get('order', 'after'))}.", "",
                  "| checkpoint | pass@k [95%] | pass@1 [95%] | P(> target) | samples | minutes |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {e['step']} | {_ci(e, 'pass_at_k')} | {_ci(e, 'pass_at_1')} | {_p(e)} | {e['samples']} | "
                  f"{e['minutes']:.1f} |" for e in off["evaluations"]]
    luck = summary.get("luck")
    if luck:
        lines += ["", f"Luck risk: **{luck['luck_risk']:.2f}**, the chance that a policy with true pass@k "
                      f"{luck['true_pass']:.2f} passes (> {luck['target']:g}) at least once in the "
                      f"{luck['evaluations']} evaluation(s) this run "
                      f"made ({luck['per_evaluation']:.2f} per evaluation; per-task rates shaped as step "
                      f"{luck['from_step']}'s; evaluations taken as independent, an upper bound)."]
    rules = summary.get("rules") or []
    if rules:
        checked = [r for r in rules if not r.get("info")]
        lines += ["", f"Closed-division rules: {sum(r['ok'] for r in checked)} of {len(checked)} met", "",
                  "| rule | met | evidence |", "|---|:---:|---|"]
        lines += [f"| {r['rule']} | {'info' if r.get('info') else 'yes' if r['ok'] else 'no'} | {r['evidence']} |"
                  for r in rules]
    stages = summary.get("stage_seconds") or {}
    if stages:
        total = sum(stages.values()) or 1.0
        lines += ["", "| stage | seconds | share |", "|---|---:|---:|"]
        lines += [f"| {k} | {v:.0f} | {100 * v / total:.0f}% |" for k, v in stages.items()]
    lines += ["", "| what | where |", "|---|---|",
              f"| run tables | `{summary.get('tables')}` |", f"| MLPerf log | `{summary.get('mlperf_log')}` |",
              f"| manifest | `{ctx.store.uri(f'runs/{ctx.run_id}/manifest.json')}` |",
              f"| notebook | `python -m tasks.inspect {ctx.run_id}` (executes notebooks/inspect_run.ipynb) |"]
    return "\n".join(lines)
