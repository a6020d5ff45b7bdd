"""`make run`: prepare (cached) + train on the embedded default, then the summary.

    python -m flows.main [--preset mini] [--run-id ID] [section.field=value ...]

Rerunning with the same --run-id resumes that run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from flows.process import TemporaryAPI, prefect_defaults, stop_on_signals, stop_signal


class QuietPermanentErrors(logging.Filter):
    """Prefect logs the exception of a failed flow or task run with its traceback; for an error
    that a rerun cannot fix, `main`'s one line says all of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        from schemas.presets import PermanentError

        return not (record.exc_info and isinstance(record.exc_info[1], PermanentError))


def quiet_permanent_errors() -> None:
    import prefect  # noqa: F401  (configures its loggers on import: add to them after)

    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(QuietPermanentErrors())


def pass_text(e: dict, target: float | None) -> str:
    """'pass@4 0.721 [0.662, 0.773]  P(>0.69) 0.86': the interval and posterior when the row has them."""
    from tasks.gate import describe  # numpy: off the CLI's import path

    return describe({"k": 4, **e}, target)


def print_summary(s: dict) -> None:
    print("\n==================== rlvr-flows: run summary ====================")
    print(f"run id            {s['run_id']}  ({s['status']}, {s['attempts']} attempt(s))")
    ttt = s.get("time_to_train_s")
    clock = "MLPerf run_start..run_stop" + ("" if s["status"] == "succeeded" else ", the target not reached")
    print(f"time to train     {ttt / 60:.1f} min ({clock})" if ttt else "time to train     n/a")
    print(f"steps             {s['steps']}")
    if s.get("base_pass_at_k") is not None:
        print(f"base checkpoint   pass@4 {s['base_pass_at_k']:.3f}  pass@1 {s['base_pass_at_1']:.3f}  (measured now)")
    rec = s.get("base_recorded")
    if rec:
        print(f"  when frozen     pass@{rec['k']} {rec['pass_at_k']:.3f}  pass@1 {rec['pass_at_1']:.3f}  "
              f"({rec['machine']}, {rec['measured_at'][:10]}; models/ manifest)")
    off = s.get("offline")
    if off:
        from tasks.mlperf import offline_clock

        for e in off["evaluations"]:
            mark = "  <- passed" if e["step"] == off["passed_step"] else ""
            print(f"checkpoint {e['step']:>4}   {pass_text(e, s.get('target'))}  pass@1 {e['pass_at_1']:.3f}  "
                  f"({e['samples']} samples, {e['minutes']:.1f} min, offline){mark}")
        verdict = (f"checkpoint {off['passed_step']} passed" if off["passed_step"] else "no checkpoint passed")
        past = f", {off['last_step'] - off['passed_step']} step(s) trained past it" if off["passed_step"] else ""
        print(f"offline eval      {verdict}; training stopped after step {off['last_step']}{past}; "
              f"{off['minutes']:.1f} min of evaluation, {offline_clock(off.get('order', 'after'))}")
    else:
        for e in s["evaluations"]:
            print(f"eval step {e['step']:>4}    {pass_text(e, s.get('target'))}  pass@1 {e['pass_at_1']:.3f}  "
                  f"(samples_count {e['samples_count']})")
    luck = s.get("luck")
    if luck:
        print(f"luck risk         {luck['luck_risk']:.2f} over {luck['evaluations']} evaluation(s) "
              f"({luck['per_evaluation']:.2f} each): a policy at pass@4 {luck['true_pass']:.2f} passing by chance "
              f"(upper bound; tasks/gate.py)")
    total = sum(s["stage_seconds"].values()) or 1.0
    print("time per stage    " + ", ".join(f"{k} {v:.0f}s ({100 * v / total:.0f}%)"
                                          for k, v in s["stage_seconds"].items()))
    rules = s.get("rules") or []
    if rules:
        checked = [r for r in rules if not r.get("info")]
        print(f"closed-division rules: {sum(r['ok'] for r in checked)} of {len(checked)} met")
        for r in rules:
            print(f"  [{'i' if r.get('info') else 'x' if r['ok'] else ' '}] {r['rule']}: {r['evidence']}")
    print(f"MLPerf log        {s['mlperf_log']}")
    print(f"run tables        {s['tables']}")
    print("==================================================================\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--run-id")
    ap.add_argument("--json", action="store_true", help="also print the summary as JSON")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    prefect_defaults()
    from schemas.presets import PermanentError, check_runnable, load_config, parse_overrides
    from tasks.storage import check_run_id

    run_id = args.run_id or f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_run_id(run_id)
        cfg = check_runnable(load_config(args.preset, args.overrides))  # fail in the first second on a bad value
    except PermanentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flows.check import missing, preflight, report

    findings = preflight(cfg)  # what `make check` shows, before a server or a sandbox starts
    if any(f.status != "ok" for f in findings):
        print(report([f for f in findings if f.status != "ok"]), flush=True)
    if missing(findings):
        print(f"error: missing: {missing(findings)} (make check ARGS=\"--preset {args.preset} ...\" lists what "
              "the preset needs)", file=sys.stderr)
        return 2
    stop_on_signals()
    from tasks.supervise import watch

    watch(os.getpid())  # ends what this run started if it is killed outright
    # What takes longest to start goes first, each in a process of its own: vLLM (flows.runtime.launch_early),
    # Prefect's API (before Prefect is imported: it reads PREFECT_API_URL once), the sandbox rootfs; then
    # the flows are imported and prepare runs while they load.
    from flows.runtime import launch_early

    servers, resume = [], f"rerun with --run-id {run_id} to resume it (make run ARGS=\"--run-id {run_id} ...\")"
    temporary_api = not os.environ.get("PREFECT_API_URL")  # else make ui's server (flows/process.py)
    starting = "starting Prefect's API, then " if temporary_api else ""
    print(f"rlvr-flows: run {run_id} (preset {args.preset}): {starting}prepare", flush=True)
    try:
        servers = launch_early(cfg, run_id)
        api = TemporaryAPI().start() if temporary_api else None
        quiet_permanent_errors()
        if cfg.dataset.source == "mini":  # prepare's sandbox_image waits for it
            from tasks.sandbox import image

            image.start_rootfs_build()
        from flows.train import train

        if api is not None:
            api.wait_ready()
        summary = train(preset=args.preset, overrides=parse_overrides(args.overrides), run_id=run_id,
                        servers=servers)
    except PermanentError as e:  # a rerun meets it again: no traceback, no resume hint
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:
        signame = stop_signal(e)
        if signame is not None:
            print(f"\nstopped by {signame}: committed stages are kept, the stage in progress is not; "
                  f"{resume}", file=sys.stderr)
            return 128 + signal.Signals[signame].value
        if not isinstance(e, Exception):
            raise  # SystemExit and the like
        import traceback

        traceback.print_exc()
        print(f"error: the run failed; {resume}", file=sys.stderr)
        return 3
    finally:
        from flows.runtime import STOP_GRACE_S

        for server in servers:  # the run stops the servers it adopted; these are what it never reached
            server.stop(timeout=STOP_GRACE_S)
    print_summary(summary)
    if args.json:
        print(json.dumps(summary, indent=1))
    # 0: target reached; 1: ran to max_steps without reaching it; 2: an error a rerun cannot fix (bad
    # configuration, missing model, unsupported store); 3: failed; 130/143: stopped by SIGINT/SIGTERM
    return 0 if summary["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
