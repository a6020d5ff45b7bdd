"""Time to train over several seeds (a measurement script, not a test): the MLPerf way of scoring a
run is the median of several runs' `run_start`..`run_stop`, so the spread between seeds matters as
much as any one run.

Each seed is one `make run` (`python -m flows.main --preset PRESET --run-id PREFIX-sSEED seed=SEED
--json`, extra overrides after `--`), one after the other. `prepare` is shared: the warm start has
its own seed (`sft.seed`), so `seed` varies only the timed GRPO run, as the reference starts every
run from the same checkpoint. Each seed's run id is PREFIX-sSEED, so a rerun with the same prefix
resumes a killed seed as `make run --run-id` does.

    .venv/bin/python tests/bench/seeds.py [--seeds 0,1,2] [--preset mini] [--prefix seeds] [-- key=value ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_seed(preset: str, run_id: str, seed: int, overrides: list[str]) -> dict:
    """One run's summary (flows.main --json prints it last, as an indented JSON object), with the
    user's wall time of the whole command; its output is passed on as it comes."""
    cmd = [sys.executable, "-m", "flows.main", "--preset", preset, "--run-id", run_id, "--json",
           f"seed={seed}", *overrides]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        sys.stderr.write(line)
    proc.wait()
    out = "".join(lines)
    start = out.rfind("\n{\n")
    if proc.returncode not in (0, 1) or start < 0:
        raise SystemExit(f"seed {seed}: flows.main exited {proc.returncode} without a summary:\n{out[-2000:]}")
    return {**json.loads(out[start + 1:]), "wall_s": time.monotonic() - t0}


def minutes(summary: dict) -> float:
    return (summary.get("time_to_train_s") or 0) / 60


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--prefix", default="seeds")
    ap.add_argument("overrides", nargs="*", help="section.field=value, for every seed")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for seed in seeds:
        s = run_seed(a.preset, f"{a.prefix}-s{seed}", seed, a.overrides)
        evals = ", ".join(f"{e['step']}: {e['pass_at_k']:.3f}" for e in s["evaluations"])
        rows.append((seed, s))
        print(f"seed {seed}: {s['status']}, {s['steps']} steps, {minutes(s):.1f} min to train, "
              f"{s['wall_s'] / 60:.1f} min of wall time, pass@4 by step {{{evals}}}", flush=True)
    print("\n| seed | status | steps | passed at | time to train (min) | wall time (min) | best pass@4 |\n"
          "|---|---|---|---|---|---|---|")
    for seed, s in rows:
        best = max((e["pass_at_k"] for e in s["evaluations"]), default=float("nan"))
        passed = (s.get("offline") or {}).get("passed_step") or next(
            (e["step"] for e in s["evaluations"] if s["status"] == "succeeded" and e["pass_at_k"] == best), "-")
        print(f"| {seed} | {s['status']} | {s['steps']} | {passed} | {minutes(s):.1f} | {s['wall_s'] / 60:.1f} "
              f"| {best:.3f} |")
    done = [minutes(s) for _, s in rows if s["status"] == "succeeded" and s.get("time_to_train_s")]
    if done:
        print(f"\nreached the target: {len(done)} of {len(rows)}; time to train median {statistics.median(done):.1f} "
              f"min, spread {max(done) - min(done):.1f} min (min {min(done):.1f}, max {max(done):.1f})")
    else:
        print(f"\nreached the target: 0 of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
