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


def prefect_defaults() -> None:
    """A project-local Prefect home, no telemetry, time for the ephemeral API to start on a busy machine."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(".rlvr/prefect"))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect makes only the last level
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # One model file: transformers' per-shard progress bars only add noise to the first screen.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # torchao on import: a failed load per CUDA kernel library and a torch deprecation line per
    # enum it registers. Not ours, not actionable on a CPU machine; real errors still show.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt in the main thread, so every `finally` stops the
    run's servers and sandboxes; a process started in the background inherits SIGINT ignored."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def start_prefect_api() -> None:
    """Start Prefect's temporary API server now, with SIGINT blocked (a blocked signal stays blocked
    across exec): a Ctrl-C to the terminal's process group must not kill the API the run reports
    to while the run is stopping, which made a stop wait on retries for ~90 s. No-op with
    PREFECT_API_URL set (a real server)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.hello()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


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
        for e in off["evaluations"]:
            mark = "  <- passed" if e["step"] == off["passed_step"] else ""
            print(f"checkpoint {e['step']:>4}   pass@4 {e['pass_at_k']:.3f}  pass@1 {e['pass_at_1']:.3f}  "
                  f"({e['samples']} samples, {e['minutes']:.1f} min, offline){mark}")
        verdict = (f"checkpoint {off['passed_step']} passed" if off["passed_step"] else "no checkpoint passed")
        past = f", {off['last_step'] - off['passed_step']} step(s) trained past it" if off["passed_step"] else ""
        print(f"offline eval      {verdict}; training stopped after step {off['last_step']}{past}; "
              f"{off['minutes']:.1f} min of evaluation, outside the timed interval")
    else:
        for e in s["evaluations"]:
            print(f"eval step {e['step']:>4}    pass@4 {e['pass_at_k']:.3f}  pass@1 {e['pass_at_1']:.3f}  "
                  f"(samples_count {e['samples_count']})")
    total = sum(s["stage_seconds"].values()) or 1.0
    print("time per stage    " + ", ".join(f"{k} {v:.0f}s ({100 * v / total:.0f}%)"
                                          for k, v in s["stage_seconds"].items()))
    rules = s.get("rules") or []
    if rules:
        print(f"closed-division rules: {sum(r['ok'] for r in rules)} of {len(rules)} met")
        for r in rules:
            print(f"  [{'x' if r['ok'] else ' '}] {r['rule']}: {r['evidence']}")
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
    from schemas.presets import ConfigError, load_config, parse_overrides
    from tasks.storage import RunIdError, check_run_id

    run_id = args.run_id or f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_run_id(run_id)
        load_config(args.preset, args.overrides)  # fail in the first second on a bad value
    except (ConfigError, RunIdError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop_on_signals()
    print(f"rlvr-flows: run {run_id} (preset {args.preset}): starting Prefect's API, then prepare", flush=True)
    from tasks.supervise import watch

    watch(os.getpid())  # ends what this run started if it is killed outright
    resume = f"rerun with --run-id {run_id} to resume it (make run ARGS=\"--run-id {run_id} ...\")"
    from tasks.policy.base import BaseCheckpointError

    try:
        start_prefect_api()
        from flows.train import train

        summary = train(preset=args.preset, overrides=parse_overrides(args.overrides), run_id=run_id)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e or 'SIGINT'}): committed stages are kept, the stage in progress is not; "
              f"{resume}", file=sys.stderr)
        return 130
    except (ConfigError, BaseCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception:
        import traceback

        traceback.print_exc()
        print(f"error: the run failed; {resume}", file=sys.stderr)
        return 3
    print_summary(summary)
    if args.json:
        print(json.dumps(summary, indent=1))
    # 0: target reached; 1: ran to max_steps without reaching it; 2: bad configuration; 3: failed; 130: interrupted
    return 0 if summary["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
