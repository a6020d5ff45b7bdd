"""Offline evaluation (MLPerf v6.1, training_policies #596): the run's checkpoints, in step order.

From eval.start_step on, training commits a checkpoint after every step with the time its
weights were updated (before the checkpoint was written). This flow evaluates them in step
order on a vLLM server of its own, stops at the first whose pass@k reaches eval.target, and
records the outcome in the store:

    runs/<id>/offline_eval.json     {"passed_step", "weight_update_end_unix", "evaluated": [...]}
    runs/<id>/training_done.json    written by the train flow when it stops (the last step)

It runs beside training (eval.offline_order="concurrent": a separate process and Prefect flow
run, started by the train flow, which stops training once a checkpoint passes) or after it
("after"). A checkpoint whose evaluation is committed is never evaluated again, so a run
killed here resumes where it stopped.

    python -m flows.offline_eval --preset mini --run-id ID [section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from prefect import flow

from flows.runtime import log

POLL_S = 2.0


def checkpoint_commit(store, run_id: str, step: int) -> dict | None:
    from flows.grpo_iteration import checkpoint_key

    key = checkpoint_key(run_id, step) + ".commit"
    return store.get_json(key) if store.exists(key) else None


def outcome(store, run_id: str) -> dict | None:
    key = f"runs/{run_id}/offline_eval.json"
    return store.get_json(key) if store.exists(key) else None


def training_done(store, run_id: str) -> dict | None:
    key = f"runs/{run_id}/training_done.json"
    return store.get_json(key) if store.exists(key) else None


def evaluated_rows(store, run_id: str, start: int) -> list[dict]:
    """The committed offline evaluations from `start` on, in step order, up to the first gap."""
    rows, step = [], start
    while store.stage_committed(run_id, step, "eval_summary"):
        rows.append(store.read_stage(run_id, step, "eval_summary").to_pylist()[0])
        step += 1
    return rows


@flow(name="offline-evaluation")
def offline_evaluation(preset: str = "mini", overrides: dict | None = None, run_id: str = "") -> dict:
    """Evaluate run `run_id`'s checkpoints from eval.start_step in step order until one passes."""
    from flows.evaluate import evaluation
    from flows.grpo_iteration import checkpoint_key
    from flows.prepare import prepare_run_context

    ctx, _ = prepare_run_context(preset, overrides, run_id, dataset_only=True)
    cfg, store = ctx.cfg, ctx.store
    step, started = max(1, cfg.eval.start_step), False
    evaluated = []
    try:
        while (done := outcome(store, run_id)) is None:
            rec = checkpoint_commit(store, run_id, step)
            if rec is None:
                finished = training_done(store, run_id)
                if finished is not None and step > finished["last_step"]:
                    break  # every checkpoint evaluated, none passed
                time.sleep(POLL_S)
                continue
            local = ctx.workdir / "eval-policy" / f"step-{step:05d}"
            if not store.stage_committed(run_id, step, "eval_summary"):
                if not local.exists():
                    store.get_dir(checkpoint_key(run_id, step), local)
                if not started:
                    ctx.start_policy(local, version=step, trainer=False)
                    started = True
                else:
                    ctx.loop.call(ctx.client.reload_weights(local, step))
            t0 = time.time()
            row = evaluation(ctx, step)
            evaluated.append({"step": step, "pass_at_k": row["pass_at_k"], "pass_at_1": row["pass_at_1"],
                              "eval_seconds": row["eval_seconds"], "num_samples": row["num_samples"],
                              "started_unix": t0, "weight_update_end_unix": rec.get("weight_update_end_unix")})
            if row["pass_at_k"] >= cfg.eval.target:
                done = {"passed_step": step, "weight_update_end_unix": rec.get("weight_update_end_unix"),
                        "pass_at_k": row["pass_at_k"], "target": cfg.eval.target}
                store.put_json(f"runs/{run_id}/offline_eval.json", done)
                log(f"offline evaluation: checkpoint {step} passes (pass@{row['k']} {row['pass_at_k']:.3f} >= "
                    f"{cfg.eval.target})")
                break
            step += 1
    finally:
        ctx.close()
    return {"outcome": done, "evaluated": evaluated}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    from flows.main import prefect_defaults, stop_on_signals
    from schemas.presets import parse_overrides

    prefect_defaults()
    stop_on_signals()
    result = offline_evaluation(preset=args.preset, overrides=parse_overrides(args.overrides), run_id=args.run_id)
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
