"""Offline evaluation (MLPerf v6.1, training_policies #596): the run's checkpoints, in step order.

From eval.start_step on, training commits a checkpoint after every step with the time its
weights were updated (before the checkpoint was written). This flow evaluates them in step
order on a vLLM server of its own, stops at the first whose pass@k is above eval.target (or,
with eval.offline_search="bisect" after training, searches from the last checkpoint back), and
records the outcome in the store:

    runs/<id>/offline_eval.json     {"passed_step", "weight_update_end_unix", "evaluated": [...]}
    runs/<id>/training_done.json    written by the train flow when it stops (the last step)

It runs beside training (eval.offline_order="concurrent": a separate process and Prefect flow
run, started by the train flow, which stops training once a checkpoint passes) or after it
("after"). A checkpoint whose evaluation is committed is never evaluated again, so a run
killed here resumes where it stopped. ("between_steps" needs no flow of its own: the train flow
evaluates each checkpoint on its own server once it is synced, `settle` records the pass.)

    python -m flows.offline_eval --preset mini --run-id ID [section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from prefect import flow

from flows.evaluate import evaluation
from flows.prepare import prepare_run_context
from flows.process import prefect_defaults, stop_on_signals
from flows.runtime import log
from flows.stages import checkpoint_key
from schemas.presets import parse_overrides
from tasks.gate import describe, passes

POLL_S = 2.0


def checkpoint_commit(store, run_id: str, step: int) -> dict | None:
    key = checkpoint_key(run_id, step) + ".commit"
    return store.get_json(key) if store.exists(key) else None


def outcome(store, run_id: str) -> dict | None:
    key = f"runs/{run_id}/offline_eval.json"
    return store.get_json(key) if store.exists(key) else None


def training_done(store, run_id: str) -> dict | None:
    key = f"runs/{run_id}/training_done.json"
    return store.get_json(key) if store.exists(key) else None


def evaluated_rows(store, run_id: str, start: int) -> list[dict]:
    """The committed offline evaluations of the run's checkpoints from `start` on, in step order."""
    rows, step = [], start
    while checkpoint_commit(store, run_id, step) is not None:
        if store.stage_committed(run_id, step, "eval_summary"):
            rows.append(store.read_stage(run_id, step, "eval_summary").to_pylist()[0])
        step += 1
    return rows


def next_checkpoint(passed: dict[int, bool], start: int, last: int | None, search: str) -> int | None:
    """The checkpoint to evaluate next, given the verdicts so far (step -> reached the target), or
    None when the search is over. `last` is the last trained step (None while training goes on)."""
    passing = [s for s, ok in passed.items() if ok]
    if search == "step_order":
        if passing:
            return None
        step = start
        while step in passed:
            step += 1
        return step if last is None or step <= last else None
    # bisect: the last checkpoint, then the middle of (latest failing below the earliest passing, that one)
    if not passing:
        return last if last is not None and last >= start and last not in passed else None
    hi = min(passing)
    lo = max((s for s, ok in passed.items() if not ok and s < hi), default=start - 1)
    return None if hi - lo == 1 else (lo + hi) // 2


def settle(store, run_id: str, passed: dict[int, bool], cfg) -> dict | None:
    """Record the outcome once the search has settled on the first passing checkpoint (None if none
    passed): `runs/<id>/offline_eval.json`, which stops training and dates run_stop."""
    if not any(passed.values()):
        return None
    first = min(s for s, ok in passed.items() if ok)
    rec = checkpoint_commit(store, run_id, first)
    row = store.read_stage(run_id, first, "eval_summary").to_pylist()[0]
    done = {"passed_step": first, "weight_update_end_unix": rec.get("weight_update_end_unix"),
            "pass_at_k": row["pass_at_k"], "target": cfg.eval.target, "search": cfg.eval.offline_search,
            "order": cfg.eval.offline_order}
    store.put_json(f"runs/{run_id}/offline_eval.json", done)
    log(f"offline evaluation: checkpoint {first} passes ({describe(row, cfg.eval.target)}, above "
        f"{cfg.eval.target}; {len(passed)} checkpoints evaluated, {cfg.eval.offline_search}, "
        f"{cfg.eval.offline_order})")
    return done


@flow(name="offline-evaluation")
def offline_evaluation(preset: str = "mini", overrides: dict | None = None, run_id: str = "") -> dict:
    """Evaluate run `run_id`'s checkpoints from eval.start_step (eval.offline_search decides which
    and in what order) until the search settles on the first passing one or none."""
    ctx, _ = prepare_run_context(preset, overrides, run_id, dataset_only=True)
    cfg, store = ctx.cfg, ctx.store
    start, search, started = max(1, cfg.eval.start_step), cfg.eval.offline_search, False
    servers = launch_on_base(ctx)  # it loads while training makes the first checkpoint
    # Verdicts already committed (a resumed evaluation does not redo them).
    passed = {r["step"]: passes(r["pass_at_k"], cfg.eval.target) for r in evaluated_rows(store, run_id, start)}
    evaluated = []
    try:
        while (done := outcome(store, run_id)) is None:
            finished = training_done(store, run_id)
            last = finished["last_step"] if finished else None
            if search == "bisect" and last is None:
                time.sleep(POLL_S)  # bisect starts from the last checkpoint
                continue
            step = next_checkpoint(passed, start, last, search)
            if step is None:
                done = settle(store, run_id, passed, cfg)
                break  # settled, or every checkpoint evaluated and none passed
            rec = checkpoint_commit(store, run_id, step)
            if rec is None:
                time.sleep(POLL_S)  # beside training: the checkpoint has not landed yet
                continue
            local = ctx.workdir / "eval-policy" / f"step-{step:05d}"
            if not local.exists():
                store.get_dir(checkpoint_key(run_id, step), local)
            if not started:
                ctx.start_policy(local, version=step, trainer=False, servers=servers)
                started, servers = True, []
            else:
                ctx.loop.call(ctx.client.reload_weights(local, step))
            t0 = time.time()
            row = evaluation(ctx, step)
            passed[step] = passes(row["pass_at_k"], cfg.eval.target)
            evaluated.append({"step": step, "pass_at_k": row["pass_at_k"], "pass_at_1": row["pass_at_1"],
                              "eval_seconds": row["eval_seconds"], "num_samples": row["num_samples"],
                              "started_unix": t0, "weight_update_end_unix": rec.get("weight_update_end_unix")})
    finally:
        for server in servers:  # launched, never adopted
            server.stop()
        ctx.close()
    return {"outcome": done, "evaluated": evaluated}


def launch_on_base(ctx) -> list:
    """The evaluator's own vLLM server, launched at once on the run's base checkpoint (as its manifest
    records it): the first checkpoint's weights are loaded into it when that lands, so the server's
    start-up runs while training makes it instead of after."""
    from flows.prepare import _local_model
    from tasks.inference import VLLMServer

    inf, manifest = ctx.cfg.inference, ctx.store.read_manifest(ctx.run_id)
    base = (manifest.prepared or {}).get("base_model") if manifest is not None else None
    if inf.mode != "managed" or inf.num_servers != 1 or not base:
        return []
    (ctx.workdir / "logs").mkdir(parents=True, exist_ok=True)
    server = VLLMServer(_local_model(ctx.cfg, ctx.store, base), inf, log_dir=ctx.workdir / "logs").launch()
    log(f"offline evaluation: vLLM server launched at {server.base_url} on the base, loading while training "
        "makes the first checkpoint")
    return [server]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)

    prefect_defaults()
    stop_on_signals()
    result = offline_evaluation(preset=args.preset, overrides=parse_overrides(args.overrides), run_id=args.run_id)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
