"""`make run`: prepare (cached) + train on the embedded default, then the summary.

    python -m flows.main [--preset mini] [--run-id ID] [section.field=value ...]

Rerunning with the same --run-id resumes that run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def prefect_defaults() -> None:
    """A project-local Prefect home, no telemetry, time for the ephemeral API to start on a busy machine."""
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(".rlvr/prefect"))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect makes only the last level
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def print_summary(s: dict) -> None:
    print("\n==================== rlvr-flows: run summary ====================")
    print(f"run id            {s['run_id']}  ({s['status']}, {s['attempts']} attempt(s))")
    ttt = s.get("time_to_train_s")
    print(f"time to train     {ttt / 60:.1f} min (MLPerf run_start..run_stop)" if ttt else "time to train     n/a")
    print(f"steps             {s['steps']}")
    if s.get("base_pass_at_k") is not None:
        print(f"base checkpoint   pass@4 {s['base_pass_at_k']:.3f}  pass@1 {s['base_pass_at_1']:.3f}")
    for e in s["evaluations"]:
        print(f"eval step {e['step']:>4}    pass@4 {e['pass_at_k']:.3f}  pass@1 {e['pass_at_1']:.3f}  "
              f"(samples_count {e['samples_count']})")
    total = sum(s["stage_seconds"].values()) or 1.0
    print("time per stage    " + ", ".join(f"{k} {v:.0f}s ({100 * v / total:.0f}%)"
                                          for k, v in s["stage_seconds"].items()))
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

    try:
        load_config(args.preset, args.overrides)  # fail in the first second on a bad value
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flows.train import train

    try:
        summary = train(preset=args.preset, overrides=parse_overrides(args.overrides), run_id=args.run_id)
    except Exception:
        import traceback

        traceback.print_exc()
        print("error: the run failed; rerun the same command with --run-id to resume it", file=sys.stderr)
        return 3
    print_summary(summary)
    if args.json:
        print(json.dumps(summary, indent=1))
    # 0: target reached; 1: ran to max_steps without reaching it; 2: bad configuration; 3: failed
    return 0 if summary["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
