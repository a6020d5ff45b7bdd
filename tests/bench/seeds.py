"""Time to train over several seeds (a measurement script, not a test): MLPerf scores a benchmark by
several runs' `run_start`..`run_stop` (for qwen35_397b_grpo 3 runs, their olympic mean: the fastest
and the slowest dropped), so the spread between seeds matters as much as any one run.

Each seed is one `make run` (`python -m flows.main --preset PRESET --run-id PREFIX-sSEED seed=SEED
--json`, extra overrides after `--`), one after the other. `prepare` is shared: the warm start has
its own seed (`sft.seed`), so `seed` varies only the timed GRPO run, as the reference starts every
run from the same checkpoint. Each seed's run id is PREFIX-sSEED, so a rerun with the same prefix
resumes a killed seed as `make run --run-id` does.

After the table: the MLPerf score of the runs (tasks.rcp.mlperf_score, the results summarizer's rule;
a run counts when its log passes the compliance checker, as the summarizer requires) and, with 2 or
more runs, the official RCP checker's verdict on their logs against a mini RCP made from the same
logs (written to --rcp-out) and against the benchmark's official RCP file. `--from-runs ID,...`
skips training and scores finished runs of the store.

    .venv/bin/python tests/bench/seeds.py [--seeds 0,1,2] [--preset mini] [--prefix seeds] [-- key=value ...]
    .venv/bin/python tests/bench/seeds.py --from-runs ID1,ID2,ID3 [--store file://.rlvr/store]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from schemas.config import StorageConfig  # noqa: E402
from tasks.mlperf import check, read_log_times  # noqa: E402
from tasks.rcp import mini_rcp, official_rcp_path, rcp_check, read_run, mlperf_score  # noqa: E402
from tasks.storage import Store  # noqa: E402


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


def ci(e: dict) -> str:
    """'0.737 [0.68, 0.79] P 0.93': an evaluation's pass@4, its 95% interval and P(> target)."""
    out = f"{e['pass_at_k']:.3f}"
    if e.get("pass_at_k_low") is not None:
        out += f" [{e['pass_at_k_low']:.2f}, {e['pass_at_k_high']:.2f}]"
    if e.get("p_above_target") is not None:
        out += f" P {e['p_above_target']:.2f}"
    return out


def minutes(summary: dict) -> float:
    return (summary.get("time_to_train_s") or 0) / 60


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--prefix", default="seeds")
    ap.add_argument("--from-runs", default="", help="ID1,ID2,...: score finished runs of the store, run nothing")
    ap.add_argument("--store", default=StorageConfig().root, help="store root of the runs")
    ap.add_argument("--rcp-out", default="", help="the mini RCP's file (default .rlvr/rcp/PREFIX-mini-rcp.json)")
    ap.add_argument("overrides", nargs="*", help="section.field=value, for every seed")
    a = ap.parse_args()
    if a.from_runs:
        ids = [i for i in a.from_runs.split(",") if i]
        score_and_check(from_runs(ids, a.store),
                        a.rcp_out or str(ROOT / ".rlvr" / "rcp" / f"{ids[0]}-etc-mini-rcp.json"))
        return 0
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for seed in seeds:
        s = run_seed(a.preset, f"{a.prefix}-s{seed}", seed, a.overrides)
        evals = ", ".join(f"{e['step']}: {ci(e)}" for e in s["evaluations"])
        rows.append((seed, s))
        print(f"seed {seed}: {s['status']}, {s['steps']} steps, {minutes(s):.1f} min to train, "
              f"{s['wall_s'] / 60:.1f} min of wall time, pass@4 by step {{{evals}}}", flush=True)
    print("\n| seed | status | steps | passed at | time to train (min) | wall time (min) | pass@4 [95%] by "
          "checkpoint | luck risk |\n|---|---|---|---|---|---|---|---|")
    for seed, s in rows:
        best = max((e["pass_at_k"] for e in s["evaluations"]), default=float("nan"))
        passed = (s.get("offline") or {}).get("passed_step") or next(
            (e["step"] for e in s["evaluations"] if s["status"] == "succeeded" and e["pass_at_k"] == best), "-")
        by_step = "; ".join(f"{e['step']}: {ci(e)}" for e in s["evaluations"])
        luck = f"{s['luck']['luck_risk']:.2f}" if s.get("luck") else "-"
        print(f"| {seed} | {s['status']} | {s['steps']} | {passed} | {minutes(s):.1f} | {s['wall_s'] / 60:.1f} "
              f"| {by_step} | {luck} |")
    done = [minutes(s) for _, s in rows if s["status"] == "succeeded" and s.get("time_to_train_s")]
    if done:
        print(f"\nreached the target: {len(done)} of {len(rows)}; time to train median {statistics.median(done):.1f} "
              f"min, spread {max(done) - min(done):.1f} min (min {min(done):.1f}, max {max(done):.1f})")
    else:
        print(f"\nreached the target: 0 of {len(rows)}")
    logs = [(f"seed {seed}", log_path(s["mlperf_log"], a.store)) for seed, s in rows if s.get("mlperf_log")]
    score_and_check(logs, a.rcp_out or str(ROOT / ".rlvr" / "rcp" / f"{a.prefix}-mini-rcp.json"))
    return 0


def store_of(root: str) -> Store:
    """The store at `root`, a relative file:// root taken from the repository root as flows.main does."""
    scheme, sep, rest = root.partition("://")
    if (not sep or scheme == "file") and not os.path.isabs(rest or root):
        root = f"file://{ROOT / (rest or root)}"
    return Store(root)


def log_path(uri: str, store_root: str) -> str:
    """A local file with a run's MLPerf log, from the store URI the summary gives (file:// or s3://)."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return str(store_of(store_root).local_path(uri))


def from_runs(ids: list[str], store_root: str) -> list[tuple[str, str]]:
    """Finished runs of the store: their logs (<store root>/runs/<run id>/mlperf.log) and a table of them."""
    store, logs = store_of(store_root), []
    print("| run | run_stop | samples to converge | time to train (min) |\n|---|---|---|---|")
    for run_id in ids:
        if not store.exists(f"runs/{run_id}/mlperf.log"):
            raise SystemExit(f"no MLPerf log of run {run_id} at {store.uri(f'runs/{run_id}/mlperf.log')}")
        path = str(store.local_path(f"runs/{run_id}/mlperf.log"))
        t, r = read_log_times(pathlib.Path(path).read_text()), read_run(path)
        mins = f"{t['run_seconds'] / 60:.1f}" if "run_seconds" in t else "-"
        print(f"| {run_id} | {t.get('status', 'none')} | {r['run_stop_samples'] or '-'} | {mins} |")
        logs.append((run_id, path))
    return logs


def key_lines(text: str) -> list[str]:
    """The checker's lines that carry its conclusion: the record it compared with, the runs' mean, the verdict."""
    keys = ("RCP Record", "Submission mean", "RCP test", "normalized", "WARNING", "ERROR")
    return [ln for ln in text.splitlines() if any(k in ln for k in keys)]


def score_and_check(logs: list[tuple[str, str]], rcp_out: str) -> None:
    """The MLPerf score of the runs, then the RCP checker on their logs (mini RCP and official)."""
    if not logs:
        print("\nMLPerf score: no MLPerf logs")
        return
    # The summarizer counts a run whose log passes the compliance checker and has run_start and run_stop.
    minutes, stopped = [], []
    print("\nper run, as the results summarizer reads it:")
    for label, path in logs:
        t = read_log_times(pathlib.Path(path).read_text())
        ok, out = check(path)
        failed = [ln.strip() for ln in out.splitlines() if "Failed" in ln or ("ERROR" in ln and "FAILED" not in ln)]
        m = t["run_seconds"] / 60 if "run_seconds" in t else None
        minutes.append(m if ok else None)
        stopped.append(m if t.get("status") == "success" else None)
        print(f"  {label}: run_stop {t.get('status', 'missing')}, "
              + (f"{m:.1f} min" if m is not None else "no time to train")
              + (", compliance checker passed" if ok else f", compliance checker FAILED ({'; '.join(failed[:2])})"))
    labels = [label for label, _ in logs]
    score = mlperf_score(minutes)
    print(f"MLPerf score, {score['benchmark']} ({score['required']} runs required): {describe(score, minutes, labels)}")
    if score["score"] is None and any(s is not None for s in stopped) and stopped != minutes:
        print("  counting every run with a successful run_stop (not the summarizer's rule): "
              + describe(mlperf_score(stopped), stopped, labels))

    if len(logs) < 2:
        print("RCP check: needs 2 or more runs")
        return
    paths = [path for _, path in logs]
    for label, path in logs:
        r = read_run(path)
        if r["converged"] and r["epochs"] != r["run_stop_samples"]:
            print(f"  note {label}: the checker reads {r['epochs']} samples to converge (last eval_accuracy "
                  f"before run_stop), run_stop says {r['run_stop_samples']}")
    try:
        rcp = mini_rcp([{"log": p} for p in paths])
    except ValueError as e:
        print(f"RCP check against a mini RCP: none made ({e})")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(rcp_out)), exist_ok=True)
        with open(rcp_out, "w") as f:
            json.dump(rcp, f, indent=2)
        (entry,) = rcp.values()
        n = len(entry["Epochs to converge"])
        # The checker's olympic mean drops the lowest and highest; its t-test bound (Min Epochs) assumes a
        # reference of 6 runs (2x the 3 submitted): with 3 it is the mean itself, with 4 or 5 far looser.
        caveat = ("" if n >= 6 else " (fewer than 3 leave the checker no mean)" if n < 3
                  else f"; a reference has 6 runs: with {n} the checker's bound, Min Epochs, is not the intended one")
        verdict, text = rcp_check(paths, rcp)
        print(f"RCP check against the mini RCP from these runs ({rcp_out}, BS {entry['BS']}, epochs to converge "
              f"{entry['Epochs to converge']}{caveat}): {verdict_word(verdict)}")
        print("\n".join("  " + ln for ln in key_lines(text)))
    verdict, text = rcp_check(paths, None)
    print(f"RCP check against the official RCPs ({official_rcp_path()}): {verdict_word(verdict)}")
    print("\n".join("  " + ln for ln in key_lines(text)))


def describe(score: dict, minutes: list, labels: list[str]) -> str:
    """One line of tasks.rcp.mlperf_score's answer: the score and the runs it used and dropped, or why none."""
    if score["score"] is None:
        mean = f"; plain mean of the counted runs {score['mean']:.1f} min" if score["mean"] is not None else ""
        return f"{score['rule']}{mean}"
    used = ", ".join(f"{labels[i]} {minutes[i]:.1f} min" for i in score["used"])
    dropped = ", ".join(f"{labels[d['index']]} ({d['why']})" for d in score["dropped"])
    return f"{score['score']:.1f} min ({score['rule']}; used {used}; dropped {dropped})"


def verdict_word(verdict: bool | None) -> str:
    return {True: "PASSED", False: "FAILED", None: "the checker could not run"}[verdict]


if __name__ == "__main__":
    sys.exit(main())
