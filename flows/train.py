"""train: the timed benchmark run (MLPerf run_start .. run_stop).

    init (untimed)  prepare (cached), start vLLM + the trainer, evaluate the base checkpoint once
    run_start
    for step in 1..max_steps:
        grpo_iteration(step)                      rollouts -> grading -> advantages -> update -> weight sync
        evaluation(step) when due                 pass@k on the validation split; stop at the target
    run_stop

Resume: rerun with the same run id. Committed stages are skipped, the policy
restarts from the last committed checkpoint, and the MLPerf log continues the
same file: run_start stays at the first attempt's start, so the reported time
to train includes the time lost to the crash. The manifest lists every attempt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

from mlperf_logging.mllog import constants as C
from prefect import flow

from flows.artifacts import publish_run, publish_step
from flows.evaluate import evaluation
from flows.grpo_iteration import checkpoint_key, grpo_iteration
from flows.offline_eval import checkpoint_commit, evaluated_rows, offline_evaluation, outcome, training_done
from flows.prepare import prepare_run_context
from flows.runtime import RunContext, config_json, log, stop_signal
from schemas.manifest import Attempt, RunManifest
from schemas.presets import ConfigError, format_overrides, load_config
from tasks.evaluation import base_eval_id
from tasks.mlperf import RunLog, deviations, read_log_times, rules_report
from tasks.supervise import owner


def _eval_due(cfg, step: int) -> bool:
    e = cfg.eval
    return step == cfg.max_steps or (step >= max(1, e.start_step) and (step - max(1, e.start_step)) % e.every_steps == 0)


def _last_checkpoint(ctx: RunContext) -> int:
    step = 0
    while ctx.store.exists(checkpoint_key(ctx.run_id, step + 1) + ".commit"):
        step += 1
    return step


def _git_version() -> str:
    try:
        import subprocess

        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


@flow(name="train", validate_parameters=False)
def train(preset: str = "mini", overrides: dict | None = None, run_id: str | None = None) -> dict:
    """Train with GRPO until pass@k on the validation split reaches the target (or max_steps)."""
    cfg = load_config(preset, overrides)
    run_id = run_id or f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    ctx, prepared = prepare_run_context(preset, overrides, run_id)
    store = ctx.store
    cfg_json = json.loads(config_json(cfg))
    manifest = store.read_manifest(run_id)
    if manifest is not None and manifest.config_sha256 != RunManifest.config_digest(cfg_json):
        raise ConfigError(f"run {run_id} already exists with a different configuration; use a new run id")
    if manifest is not None and manifest.status in ("succeeded", "target_not_reached"):
        log(f"run {run_id} already finished ({manifest.status}); nothing to do")
        summary = summarize_run(ctx, prepared)
        publish_run(ctx, summary)
        return summary
    resumed = manifest is not None
    if manifest is None:
        manifest = RunManifest(run_id=run_id, preset=preset, config=cfg_json,
                               config_sha256=RunManifest.config_digest(cfg_json), code_version=_git_version(),
                               prepared={k: v for k, v in prepared.items() if k != "base_model_dir"})
    start_step = _last_checkpoint(ctx) + 1
    manifest.attempts.append(Attempt(started_at=time.time(), resumed_at_step=start_step if resumed else 0, **owner()))
    manifest.status = "running"
    store.write_manifest(manifest)

    log_path = ctx.workdir / "mlperf.log"
    log_key = f"runs/{run_id}/mlperf.log"
    if resumed and not log_path.exists() and store.exists(log_key):
        log_path.write_bytes(store.get_bytes(log_key))
    mllog = RunLog(str(log_path), division="open", platform=f"{os.cpu_count()}-core CPU")
    evaluator = None
    try:
        if not resumed:
            mllog.header(cfg)
        for d in deviations(cfg):
            log(f"note: {d}")
        policy_dir, version = pathlib.Path(prepared["base_model_dir"]), 0
        if start_step > 1:
            policy_dir = ctx.workdir / "policy" / f"step-{start_step - 1:05d}"
            if not policy_dir.exists():
                store.get_dir(checkpoint_key(run_id, start_step - 1), policy_dir)
            version = start_step - 1
            log(f"resuming run {run_id} at step {start_step} from checkpoint v{version}")
        ctx.start_policy(policy_dir, version)
        base_row = evaluate_base(ctx, prepared)
        if not resumed:
            mllog.end(C.INIT_STOP)
            mllog.start(C.RUN_START)
        store.put_bytes(log_key, log_path.read_bytes())

        gbs, target = cfg.grpo.global_batch_size, cfg.eval.target

        def evaluate_step(step: int) -> bool:
            # A resumed run may already have logged this evaluation before it was killed: log it once.
            logged = {n for n, _ in read_log_times(log_path.read_text())["evals"]}
            if step * gbs not in logged:
                mllog.start(C.EVAL_START, metadata={"samples_count": step * gbs})
            row = evaluation(ctx, step)
            if step * gbs not in logged:
                mllog.event(C.EVAL_ACCURACY, row["pass_at_k"], metadata={"samples_count": step * gbs})
                mllog.end(C.EVAL_STOP, metadata={"samples_count": step * gbs})
            return row["pass_at_k"] >= target

        offline, reached = cfg.eval.mode == "offline", False
        if not offline and start_step > 1 and _eval_due(cfg, start_step - 1):
            # The evaluation of the last trained step: already decided, or cut short by the crash.
            reached = evaluate_step(start_step - 1)
        finished = training_done(store, run_id) if offline else None
        if offline and finished is None and cfg.eval.offline_order == "concurrent":
            evaluator = start_evaluator(preset, overrides, run_id, ctx.workdir)
        step = start_step
        while finished is None and not reached and step <= cfg.max_steps:
            if offline and outcome(store, run_id) is not None:
                break  # the evaluator found a passing checkpoint: training stops
            if evaluator is not None and evaluator.poll() not in (None, 0):
                raise RuntimeError(f"the offline evaluator exited with {evaluator.returncode}: "
                                   f"see {ctx.workdir / 'logs' / 'offline-eval.log'}")
            log(f"step {step}/{cfg.max_steps} (policy v{ctx.policy_version})")
            if step - 1 not in read_log_times(log_path.read_text())["blocks_open"]:  # a killed attempt's step is open
                mllog.start(C.BLOCK_START, metadata={"samples_count": (step - 1) * gbs, "first_epoch_num": step - 1,
                                                     "epoch_count": 1})
            times = grpo_iteration(ctx, step)
            mllog.end(C.BLOCK_STOP, metadata={"samples_count": step * gbs, "first_epoch_num": step - 1})
            if not offline and _eval_due(cfg, step):
                reached = evaluate_step(step)
            publish_step(ctx, step, times)
            store.put_bytes(log_key, log_path.read_bytes())
            step += 1
        if offline:
            if finished is None:
                finished = {"last_step": step - 1, "at_unix": time.time(),
                            "stopped_by": "a passing checkpoint" if outcome(store, run_id) else "max_steps"}
                store.put_json(f"runs/{run_id}/training_done.json", finished)
            log(f"training stopped after step {finished['last_step']} ({finished['stopped_by']})")
            ctx.close()  # the evaluation gets the machine
            if evaluator is not None:
                if evaluator.wait() != 0:
                    raise RuntimeError(f"the offline evaluator exited with {evaluator.returncode}: "
                                       f"see {ctx.workdir / 'logs' / 'offline-eval.log'}")
            elif outcome(store, run_id) is None:
                offline_evaluation(preset=preset, overrides=overrides, run_id=run_id)
            reached = log_offline_evaluations(mllog, store, cfg, run_id, log_path.read_text())
        else:
            mllog.end(C.RUN_STOP, metadata={"status": "success" if reached else "aborted"})
        store.put_bytes(log_key, log_path.read_bytes())
        manifest.status = "succeeded" if reached else "target_not_reached"
    except BaseException as e:
        signame = stop_signal(e)
        manifest.status = "stopped" if signame else "failed"
        first_line = (str(e).splitlines() or [""])[0]
        manifest.attempts[-1].reason = f"stopped: {signame}" if signame else f"failed: {type(e).__name__}: {first_line}"[:500]
        ctx.close(graceful=False)  # stopped or failed: nothing will commit the work in progress, do not wait for it
        if evaluator is not None and evaluator.poll() is None:
            evaluator.terminate()  # its own session: a terminal's Ctrl-C does not reach it
        raise
    finally:
        mllog.close()
        manifest.attempts[-1].ended_at = time.time()
        manifest.attempts[-1].status = manifest.status
        store.write_manifest(manifest)
        ctx.close()
    summary = summarize_run(ctx, prepared, base_row)
    publish_run(ctx, summary)
    return summary


def start_evaluator(preset: str, overrides: dict | None, run_id: str, workdir: pathlib.Path) -> subprocess.Popen:
    """The offline evaluator as a process (and Prefect flow run) of its own, reporting to this run's API."""
    env = dict(os.environ)
    api = _api_url()
    if api:
        env["PREFECT_API_URL"] = api
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    out = open(workdir / "logs" / "offline-eval.log", "ab")
    # Its own managed vLLM server: external servers are the training's, busy with its rollouts.
    cmd = [sys.executable, "-m", "flows.offline_eval", "--preset", preset, "--run-id", run_id,
           *format_overrides(overrides or {}), "inference.mode=managed"]
    log(f"offline evaluator started beside training (log {workdir / 'logs' / 'offline-eval.log'})")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _api_url() -> str | None:
    """This process's Prefect API: the configured one, or the temporary server it started."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    try:
        from prefect.server.api.server import SubprocessASGIServer

        return next((s.api_url for s in SubprocessASGIServer._instances.values() if s.running), None)
    except Exception:
        return None


def log_offline_evaluations(mllog: RunLog, store, cfg, run_id: str, log_text: str) -> bool:
    """The offline evaluations in step order, then run_stop at the passing checkpoint's weight-update
    time (aborted at the last checkpoint's if none passed), as the reference's evaluator appends them
    after training. Returns whether a checkpoint passed."""
    gbs, logged = cfg.grpo.global_batch_size, {n for n, _ in read_log_times(log_text)["evals"]}
    for row in evaluated_rows(store, run_id, max(1, cfg.eval.start_step)):
        n = row["step"] * gbs
        if n in logged:
            continue
        t0 = int(1000 * (row["started_unix"] or time.time()))
        t1 = t0 + int(1000 * row["eval_seconds"])
        mllog.start(C.EVAL_START, metadata={"samples_count": n}, time_ms=t0)
        mllog.event(C.EVAL_ACCURACY, row["pass_at_k"], metadata={"samples_count": n}, time_ms=t1)
        mllog.end(C.EVAL_STOP, metadata={"samples_count": n}, time_ms=t1)
    result = outcome(store, run_id)
    if result is not None:
        mllog.end(C.RUN_STOP, metadata={"status": "success", "samples_count": result["passed_step"] * gbs},
                  time_ms=int(1000 * result["weight_update_end_unix"]))
        return True
    last = training_done(store, run_id)["last_step"]
    rec = checkpoint_commit(store, run_id, last) or {}
    mllog.end(C.RUN_STOP, metadata={"status": "aborted", "samples_count": last * gbs},
              time_ms=int(1000 * rec["weight_update_end_unix"]) if rec.get("weight_update_end_unix") else None)
    return False


def evaluate_base(ctx: RunContext, prepared: dict) -> dict:
    """pass@k of the warm-started base checkpoint, computed once per base model and evaluation and reused by every run."""
    base_ctx = dataclasses.replace(ctx, run_id=base_eval_id(ctx.cfg, prepared))
    log("evaluating the warm-started base checkpoint (untimed, cached per base model and evaluation)")
    return evaluation(base_ctx, 0)


def summarize_run(ctx: RunContext, prepared: dict, base_row: dict | None = None) -> dict:
    """What `make run` prints at the end: time to train, pass@k per evaluation, stage times, where things are."""
    from tasks.mlperf import read_log_times

    store, run_id = ctx.store, ctx.run_id
    evals = []
    steps = 0
    for commit in store.commits(f"runs/{run_id}"):
        if commit.stage == "eval_summary":
            evals.append(store.read_table(commit.key).to_pylist()[0])
    while store.exists(checkpoint_key(run_id, steps + 1) + ".commit"):
        steps += 1
    stage_totals: dict[str, float] = {}
    for s in range(1, steps + 1):
        key = f"runs/{run_id}/step-{s:05d}/timings.json"
        if store.exists(key):
            for k, v in store.get_json(key).items():
                stage_totals[k] = stage_totals.get(k, 0.0) + v
    offline = None
    if ctx.cfg.eval.mode == "offline":  # outside the timed interval: reported on their own
        result, done = outcome(store, run_id), training_done(store, run_id)
        rows = evaluated_rows(store, run_id, max(1, ctx.cfg.eval.start_step))
        offline = {"passed_step": result["passed_step"] if result else None,
                   "last_step": done["last_step"] if done else None,
                   "minutes": round(sum(r["eval_seconds"] for r in rows) / 60, 1),
                   "evaluations": [{"step": r["step"], "pass_at_k": r["pass_at_k"], "pass_at_1": r["pass_at_1"],
                                    "minutes": round(r["eval_seconds"] / 60, 1), "samples": r["num_samples"]}
                                   for r in rows]}
    else:
        for e in evals:
            stage_totals["evaluation"] = stage_totals.get("evaluation", 0.0) + e["eval_seconds"]
    manifest = store.read_manifest(run_id)
    log_key = f"runs/{run_id}/mlperf.log"
    times = read_log_times(store.get_bytes(log_key).decode()) if store.exists(log_key) else {}
    if base_row is None and prepared.get("base_model"):
        base_id = base_eval_id(ctx.cfg, prepared)
        if store.stage_committed(base_id, 0, "eval_summary"):
            base_row = store.read_stage(base_id, 0, "eval_summary").to_pylist()[0]
    recorded = None
    if prepared.get("base_weights"):
        from tasks.policy.base import read_manifest

        recorded = (read_manifest(prepared["base_model"]) or {}).get("evaluation")
    return {
        "run_id": run_id,
        "status": manifest.status if manifest else "unknown",
        "attempts": len(manifest.attempts) if manifest else 0,
        "time_to_train_s": times.get("run_seconds"),
        "steps": steps,
        "base_pass_at_k": base_row["pass_at_k"] if base_row else None,
        "base_pass_at_1": base_row["pass_at_1"] if base_row else None,
        "base_recorded": recorded,
        "evaluations": [{"step": e["step"], "pass_at_k": e["pass_at_k"], "pass_at_1": e["pass_at_1"],
                         "samples_count": e["samples_count"]} for e in sorted(evals, key=lambda e: e["step"])],
        "offline": offline,
        "rules": rules_report(ctx.cfg, store, run_id),
        "stage_seconds": {k: round(v, 1) for k, v in sorted(stage_totals.items())},
        "mlperf_log": store.uri(log_key),
        "tables": store.uri(f"runs/{run_id}"),
        "prepared": {k: v for k, v in prepared.items() if k != "base_model_dir"},
    }
