"""Per-step wall time by stage and the generation/training mismatch of runs in the local store,
side by side (a report, not a test): what a rollout change did to a GRPO step.

    .venv/bin/python research/step_times.py RUN_ID [RUN_ID ...] [--steps 1-10] [--store s3://b/p --endpoint-url URL]
"""

from __future__ import annotations

import argparse
import statistics

from tasks.storage import Store

MISMATCH = ("token_mult_prob_error", "gen_kl_error", "is_oob_ratio")


def steps_of(store: Store, run: str, lo: int, hi: int) -> list[dict]:
    out = []
    for step in range(lo, hi + 1):
        t = f"runs/{run}/step-{step:05d}/timings.json"
        c = f"runs/{run}/checkpoints/step-{step:05d}.commit"
        if not store.exists(t):
            continue
        row = {"step": step, **store.get_json(t)}
        if store.exists(c):
            m = store.get_json(c)["metrics"]
            row |= {k: m.get(k) for k in MISMATCH}
        row["total"] = sum(v for k, v in row.items() if k in ("rollouts", "grading", "advantages", "update", "weight_sync"))
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--steps", default="1-10")
    ap.add_argument("--store", default="file://.rlvr/store")
    ap.add_argument("--endpoint-url")
    a = ap.parse_args()
    store = Store(a.store, a.endpoint_url)
    lo, hi = (int(x) for x in a.steps.split("-"))
    print(f"{'run':28s} {'steps':>5} {'step s':>7} {'rollouts':>8} {'update':>7} {'grading':>7} "
          f"{'mult_prob_err':>13} {'max is_oob':>10}")
    for run in a.runs:
        rows = steps_of(store, run, lo, hi)
        if not rows:
            print(f"{run:28s} no steps")
            continue
        med = lambda k: statistics.median(r[k] for r in rows if r.get(k) is not None)
        print(f"{run:28s} {len(rows):5d} {med('total'):7.1f} {med('rollouts'):8.1f} {med('update'):7.1f} "
              f"{med('grading'):7.1f} {max(r.get('token_mult_prob_error') or 0 for r in rows):13.6f} "
              f"{max(r.get('is_oob_ratio') or 0 for r in rows):10.3f}")


if __name__ == "__main__":
    main()
