"""Evaluation cost by procedure on one checkpoint (a benchmark, not a test): k samples of every task
("full", the reference's way) against samples until each task's first success ("early_stop", the
same pass@k distribution), alternated over repeats so both see the same machine.

    .venv/bin/python tests/bench/bench_eval.py [--checkpoint models/mini-base] [--repeats 3] [key=value ...]

Prints per repeat: episodes, minutes (the evaluation's own time, server start excluded), pass@4,
pass@1; then medians and the ratio of episodes and minutes.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "models" / "mini-base"))
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from flows.evaluate import evaluate
    from flows.process import prefect_defaults
    from schemas.presets import parse_overrides, set_dotted

    prefect_defaults()
    rows = []
    stamp = int(time.time())
    for r in range(a.repeats):
        for procedure in ("full", "early_stop"):
            overrides = parse_overrides(a.overrides)
            set_dotted(overrides, "eval.early_stop", procedure == "early_stop")
            row = evaluate(preset=a.preset, overrides=overrides, checkpoint=a.checkpoint,
                           run_id=f"bench-eval-{stamp}-{procedure}-{r}")
            rows.append((procedure, r, row))
            print(f"{procedure:10s} repeat {r}: {row['num_samples']} episodes, {row['eval_seconds'] / 60:.1f} min, "
                  f"pass@4 {row['pass_at_k']:.3f}, pass@1 {row['pass_at_1']:.3f}", flush=True)
    print("\n| procedure | episodes (median) | minutes (median) | pass@4 per repeat | pass@1 per repeat |")
    print("|---|---:|---:|---|---|")
    med = {}
    for procedure in ("full", "early_stop"):
        mine = [row for p, _, row in rows if p == procedure]
        med[procedure] = (statistics.median(x["num_samples"] for x in mine),
                          statistics.median(x["eval_seconds"] / 60 for x in mine))
        pk = ", ".join("%.3f" % x["pass_at_k"] for x in mine)
        p1 = ", ".join("%.3f" % x["pass_at_1"] for x in mine)
        print(f"| {procedure} | {med[procedure][0]:.0f} | {med[procedure][1]:.1f} | {pk} | {p1} |")
    print(f"\nearly_stop / full: episodes {med['early_stop'][0] / med['full'][0]:.2f}, "
          f"minutes {med['early_stop'][1] / med['full'][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
