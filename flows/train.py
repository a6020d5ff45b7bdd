"""train: the timed benchmark run (MLPerf run_start .. run_stop).

    init (untimed)  prepare (cached), start vLLM + the trainer, evaluate the base checkpoint once
    run_start
    for step in 1..max_steps:
        grpo_iteration(step)                      rollouts -> grading -> advantages -> update -> weight sync
        evaluation(step) when due                 pass@k on the validation split; stop at the target
                                                  (inline, or offline "between_steps"; offline "concurrent"
                                                  and "after" evaluate on a server of their own)
    run_stop

Resume: rerun with the same run id. Committed stages are skipped, the policy
restarts from the last committed checkpoint, and the MLPerf log continues the
same file: run_start stays at the first attempt's start, so the reported time
to train includes the time lost to the crash. The manifest lists every attempt.

`train` reads in that order: the manifest's attempt (`open_manifest`, `begin_attempt`,
`end_attempt`, `record_stop`), the MLPerf log (`StoredRunLog`), init (`start_run`), the steps
(`train_online`, or `train_offline` with the evaluator process of `start_evaluator`), the summary.
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
from flows.grpo_iteration import grpo_iteration
from flows.offline_eval import checkpoint_commit, evaluated_rows, offline_evaluation, outcome, settle, training_done
from flows.prepare import prepare_run_context
from flows.process import stop_signal
from flows.runtime import RunContext, code_version, config_json, log
from flows.stages import checkpoint_key, last_checkpoint
from schemas.manifest import Attempt, RunManifest
from schemas.presets import ConfigError, format_overrides
from tasks.evaluation import base_eval_id, run_luck
from tasks.gate import passes
from tasks.mlperf import RunLog, deviations, read_log_times, rules_report
from tasks.policy.base import read_manifest
from tasks.storage import Store
from tasks.supervise import owner

FINISHED = ("succeeded", "target_not_reached")


@flow(name="train", validate_parameters=False)
def train(preset: str = "mini", overrides: dict | None = None, run_id: str | None = None,
          servers: list | None = None) -> dict:
    """Train with GRPO until pass@k on the validation split reaches the target (or max_steps). `servers`:
    vLLM servers launched before the flow (flows.runtime.launch_early), which the run adopts."""
    run_id = run_id or f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    ctx, prepared = prepare_run_context(preset, overrides, run_id)
    manifest, resumed = open_manifest(ctx, preset, prepared)
    if manifest.status in FINISHED:
        log(f"run {run_id} already finished ({manifest.status}); nothing to do")
        return publish_summary(ctx, prepared)
    start_step = last_checkpoint(ctx.store, run_id) + 1
    begin_attempt(ctx.store, manifest, resumed_at_step=start_step if resumed else 0)
    mllog = StoredRunLog(ctx, resumed)
    evaluator = None
    try:
        base_row = start_run(ctx, prepared, mllog, start_step, resumed, servers)
        if ctx.cfg.eval.mode == "offline":
            finished = training_done(ctx.store, run_id)
            if finished is None and ctx.cfg.eval.offline_order == "concurrent":
                evaluator = start_evaluator(preset, overrides, run_id, ctx.workdir)
            reached = train_offline(ctx, mllog, start_step, finished, evaluator, preset, overrides)
        else:
            reached = train_online(ctx, mllog, start_step)
        mllog.upload()
        manifest.status = "succeeded" if reached else "target_not_reached"
    except BaseException as e:
        record_stop(ctx, manifest, e, evaluator)
        raise
    finally:
        mllog.close()
        end_attempt(ctx.store, manifest)
        ctx.close()
    return publish_summary(ctx, prepared, base_row)


# ---------------------------------------------------------------------------- the manifest's attempts


def open_manifest(ctx: RunContext, preset: str, prepared: dict) -> tuple[RunManifest, bool]:
    """The run's manifest and whether the run resumes: the earlier attempts' (refused when the
    configuration differs), or a new one."""
    cfg_json = json.loads(config_json(ctx.cfg))
    manifest = ctx.store.read_manifest(ctx.run_id)
    if manifest is None:
        return RunManifest(run_id=ctx.run_id, preset=preset, config=cfg_json,
                           config_sha256=RunManifest.config_digest(cfg_json), code_version=code_version(),
                           prepared=_recorded(prepared)), False
    if manifest.config_sha256 != RunManifest.config_digest(cfg_json):
        raise ConfigError(f"run {ctx.run_id} already exists with a different configuration; use a new run id")
    return manifest, True


def begin_attempt(store: Store, manifest: RunManifest, resumed_at_step: int) -> None:
    manifest.attempts.append(Attempt(started_at=time.time(), resumed_at_step=resumed_at_step, **owner()))
    manifest.status = "running"
    store.write_manifest(manifest)


def record_stop(ctx: RunContext, manifest: RunManifest, e: BaseException, evaluator) -> None:
    """A stopped or failed attempt: why, in the manifest; what it started is ended at once (nothing
    will commit the work in progress, so nothing waits for it)."""
    signame = stop_signal(e)
    manifest.status = "stopped" if signame else "failed"
    first_line = (str(e).splitlines() or [""])[0]
    manifest.attempts[-1].reason = f"stopped: {signame}" if signame else f"failed: {type(e).__name__}: {first_line}"[:500]
    ctx.close(graceful=False)
    if evaluator is not None and evaluator.poll() is None:
        evaluator.terminate()  # its own session: a terminal's Ctrl-C does not reach it


def end_attempt(store: Store, manifest: RunManifest) -> None:
    manifest.attempts[-1].ended_at = time.time()
    manifest.attempts[-1].status = manifest.status
    store.write_manifest(manifest)


def _recorded(prepared: dict) -> dict:
    """What prepare made, as the manifest and the summary record it (not this machine's local copy)."""
    return {k: v for k, v in prepared.items() if k != "base_model_dir"}


# ---------------------------------------------------------------------------- the MLPerf log


class StoredRunLog(RunLog):
    """The run's MLPerf log: a local file every attempt appends to (copied back from the store when
    a run resumes on another machine), uploaded to the store after each step."""

    def __init__(self, ctx: RunContext, resumed: bool):
        local, self.key, self.store = ctx.workdir / "mlperf.log", f"runs/{ctx.run_id}/mlperf.log", ctx.store
        if resumed and not local.exists() and self.store.exists(self.key):
            local.write_bytes(self.store.get_bytes(self.key))
        super().__init__(str(local), division="open", platform=f"{os.cpu_count()}-core CPU")

    def text(self) -> str:
        return pathlib.Path(self.path).read_text()

    def upload(self) -> None:
        self.store.put_bytes(self.key, pathlib.Path(self.path).read_bytes())


# ---------------------------------------------------------------------------- init and the steps


def start_run(ctx: RunContext, prepared: dict, mllog: StoredRunLog, start_step: int, resumed: bool,
              servers: list | None = None) -> dict:
    """Init (untimed, logged once per run): the policy served and trained from where the run
    stands, the base checkpoint evaluated; then run_start. Returns the base evaluation's row."""
    if not resumed:
        mllog.header(ctx.cfg)
    for d in deviations(ctx.cfg):
        log(f"note: {d}")
    start_policy(ctx, prepared, start_step, servers)
    base_row = evaluate_base(ctx, prepared)
    if not resumed:
        mllog.end(C.INIT_STOP)
        mllog.start(C.RUN_START)
    mllog.upload()
    return base_row


def start_policy(ctx: RunContext, prepared: dict, start_step: int, servers: list | None = None) -> None:
    """Serve and train the base model, or a resumed run's last committed checkpoint (`servers`: launched
    early, serving the base)."""
    policy_dir, version = pathlib.Path(prepared["base_model_dir"]), 0
    if start_step > 1:
        policy_dir = ctx.workdir / "policy" / f"step-{start_step - 1:05d}"
        if not policy_dir.exists():
            ctx.store.get_dir(checkpoint_key(ctx.run_id, start_step - 1), policy_dir)
        version = start_step - 1
        log(f"resuming run {ctx.run_id} at step {start_step} from checkpoint v{version}")
    ctx.start_policy(policy_dir, version, servers=servers)


def train_online(ctx: RunContext, mllog: StoredRunLog, start_step: int) -> bool:
    """Steps from `start_step`, each evaluated when due, until the target or max_steps; then
    run_stop. Returns whether the target was reached."""
    cfg, reached = ctx.cfg, False
    if start_step > 1 and _eval_due(cfg, start_step - 1):
        # The evaluation of the last trained step: already decided, or cut short by the crash.
        reached = evaluate_step(ctx, mllog, start_step - 1)
    step = start_step
    while not reached and step <= cfg.max_steps:
        times = timed_iteration(ctx, mllog, step)
        if _eval_due(cfg, step):
            reached = evaluate_step(ctx, mllog, step)
        publish_step(ctx, step, times)
        mllog.upload()
        step += 1
    mllog.end(C.RUN_STOP, metadata={"status": "success" if reached else "aborted"})
    return reached


def train_offline(ctx: RunContext, mllog: StoredRunLog, start_step: int, finished: dict | None,
                  evaluator: subprocess.Popen | None, preset: str, overrides: dict | None) -> bool:
    """Steps from `start_step` until a checkpoint passes (the evaluator beside training records it) or
    max_steps, unless an earlier attempt finished training (`finished`); then the machine goes to the
    evaluation (the evaluator's end, or the offline evaluation now) and its results to the MLPerf log.
    Returns whether a checkpoint passed."""
    store, run_id = ctx.store, ctx.run_id
    between = ctx.cfg.eval.offline_order == "between_steps"
    if finished is None:
        if between:  # the last attempt's last checkpoint, if it was cut off before its verdict
            evaluate_between_steps(ctx, mllog, start_step - 1)
        step = start_step
        while step <= ctx.cfg.max_steps and outcome(store, run_id) is None:  # a pass stops training
            if evaluator is not None and evaluator.poll() not in (None, 0):
                raise _evaluator_failed(evaluator, ctx.workdir)
            publish_step(ctx, step, timed_iteration(ctx, mllog, step))
            if between:
                evaluate_between_steps(ctx, mllog, step)
            mllog.upload()
            step += 1
        finished = {"last_step": step - 1, "at_unix": time.time(),
                    "stopped_by": "a passing checkpoint" if outcome(store, run_id) else "max_steps"}
        store.put_json(f"runs/{run_id}/training_done.json", finished)
    log(f"training stopped after step {finished['last_step']} ({finished['stopped_by']})")
    ctx.close()  # the evaluation gets the machine
    if evaluator is not None:
        if evaluator.wait() != 0:
            raise _evaluator_failed(evaluator, ctx.workdir)
    elif outcome(store, run_id) is None and not between:
        offline_evaluation(preset=preset, overrides=overrides, run_id=run_id)
    return log_offline_evaluations(mllog, store, ctx.cfg, run_id, mllog.text())


def evaluate_between_steps(ctx: RunContext, mllog: StoredRunLog, step: int) -> None:
    """eval.offline_order="between_steps": checkpoint `step` (the one the training's server now
    serves: the weight sync loads the committed checkpoint's files) evaluated while training waits,
    logged as it happens; a pass is recorded as the offline evaluator records it."""
    start = max(1, ctx.cfg.eval.start_step)
    if step < start or checkpoint_commit(ctx.store, ctx.run_id, step) is None:
        return
    assert ctx.policy_version == step, f"the server serves v{ctx.policy_version}, not checkpoint {step}"
    evaluate_step(ctx, mllog, step)
    passed = {r["step"]: passes(r["pass_at_k"], ctx.cfg.eval.target)
              for r in evaluated_rows(ctx.store, ctx.run_id, start)}
    settle(ctx.store, ctx.run_id, passed, ctx.cfg)


def timed_iteration(ctx: RunContext, mllog: StoredRunLog, step: int) -> dict:
    """One GRPO iteration as an MLPerf block (a killed attempt's block is still open: it is not
    started again); returns its stage timings."""
    gbs = ctx.cfg.grpo.global_batch_size
    log(f"step {step}/{ctx.cfg.max_steps} (policy v{ctx.policy_version})")
    if step - 1 not in read_log_times(mllog.text())["blocks_open"]:
        mllog.start(C.BLOCK_START, metadata={"samples_count": (step - 1) * gbs, "first_epoch_num": step - 1,
                                             "epoch_count": 1})
    times = grpo_iteration(ctx, step)
    mllog.end(C.BLOCK_STOP, metadata={"samples_count": step * gbs, "first_epoch_num": step - 1})
    return times


def evaluate_step(ctx: RunContext, mllog: StoredRunLog, step: int) -> bool:
    """The online evaluation of `step`, logged once (a resumed run may already have logged it before
    it was killed); whether it reached the target."""
    n = step * ctx.cfg.grpo.global_batch_size
    logged = n in {samples for samples, _ in read_log_times(mllog.text())["evals"]}
    if not logged:
        mllog.start(C.EVAL_START, metadata={"samples_count": n})
    row = evaluation(ctx, step)
    if not logged:
        mllog.event(C.EVAL_ACCURACY, row["pass_at_k"], metadata={"samples_count": n})
        mllog.end(C.EVAL_STOP, metadata={"samples_count": n})
    return passes(row["pass_at_k"], ctx.cfg.eval.target)


def _eval_due(cfg, step: int) -> bool:
    e = cfg.eval
    return step == cfg.max_steps or (step >= max(1, e.start_step) and (step - max(1, e.start_step)) % e.every_steps == 0)


def evaluate_base(ctx: RunContext, prepared: dict) -> dict:
    """pass@k of the warm-started base checkpoint, computed once per base model and evaluation and reused by every run."""
    base_ctx = dataclasses.replace(ctx, run_id=base_eval_id(ctx.cfg, prepared))
    log("evaluating the warm-started base checkpoint (untimed, cached per base model and evaluation)")
    return evaluation(base_ctx, 0)


# ---------------------------------------------------------------------------- offline evaluation


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


def _evaluator_failed(evaluator: subprocess.Popen, workdir: pathlib.Path) -> RuntimeError:
    return RuntimeError(f"the offline evaluator exited with {evaluator.returncode}: "
                        f"see {workdir / 'logs' / 'offline-eval.log'}")


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


# ---------------------------------------------------------------------------- the summary


def publish_summary(ctx: RunContext, prepared: dict, base_row: dict | None = None) -> dict:
    summary = summarize_run(ctx, prepared, base_row)
    publish_run(ctx, summary)
    return summary


def _gate(row: dict) -> dict:
    """An eval_summary row's intervals and P(> target) (None in tables written before them)."""
    return {c: row.get(c) for c in ("pass_at_k_low", "pass_at_k_high", "pass_at_1_low", "pass_at_1_high",
                                    "p_above_target")}


def summarize_run(ctx: RunContext, prepared: dict, base_row: dict | None = None) -> dict:
    """What `make run` prints at the end: time to train, pass@k per evaluation, stage times, where things are."""
    store, run_id = ctx.store, ctx.run_id
    evals = []
    for commit in store.commits(f"runs/{run_id}"):
        if commit.stage == "eval_summary":
            evals.append(store.read_table(commit.key).to_pylist()[0])
    steps = last_checkpoint(store, run_id)
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
        offline = {"order": ctx.cfg.eval.offline_order, "passed_step": result["passed_step"] if result else None,
                   "last_step": done["last_step"] if done else None,
                   "minutes": round(sum(r["eval_seconds"] for r in rows) / 60, 1),
                   "evaluations": [{"step": r["step"], "pass_at_k": r["pass_at_k"], "pass_at_1": r["pass_at_1"],
                                    "minutes": round(r["eval_seconds"] / 60, 1), "samples": r["num_samples"],
                                    **_gate(r)} for r in rows]}
        stage_totals["evaluation"] = sum(r["eval_seconds"] for r in rows)
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
    began = min((a.started_at for a in manifest.attempts), default=None) if manifest else None
    if base_row and began and (base_row.get("started_unix") or 0) >= began:  # measured by this run, not cached
        stage_totals["base_evaluation"] = base_row["eval_seconds"]
    recorded = None
    if prepared.get("base_weights"):
        recorded = (read_manifest(prepared["base_model"]) or {}).get("evaluation")
    return {
        "run_id": run_id,
        "status": manifest.status if manifest else "unknown",
        "attempts": len(manifest.attempts) if manifest else 0,
        "time_to_train_s": times.get("run_seconds"),
        "steps": steps,
        "target": ctx.cfg.eval.target,
        "base_pass_at_k": base_row["pass_at_k"] if base_row else None,
        "base_pass_at_1": base_row["pass_at_1"] if base_row else None,
        "base_recorded": recorded,
        "evaluations": [{"step": e["step"], "pass_at_k": e["pass_at_k"], "pass_at_1": e["pass_at_1"],
                         "samples_count": e["samples_count"], **_gate(e)}
                        for e in sorted(evals, key=lambda e: e["step"])],
        "luck": run_luck(store, run_id, range(1, steps + 1), ctx.cfg.eval.target),
        "offline": offline,
        "rules": rules_report(ctx.cfg, store, run_id),
        "stage_seconds": {k: round(v, 1) for k, v in sorted(stage_totals.items())},
        "mlperf_log": store.uri(log_key),
        "tables": store.uri(f"runs/{run_id}"),
        "prepared": _recorded(prepared),
    }
