"""Start-up of a warm `make run`: from the command to its first rollout, by phase, this checkout against
another revision side by side (interleaved rounds); and each start-up part alone.

    python tests/bench/bench_startup.py [--before REV] [--rounds 3] [--parts]

A round runs `python -m flows.main --preset mini` (a new run id each time, the store and Prefect home of
this checkout: the dataset, its verification and the base's evaluation are cached after the first, untimed
warm-up round of each revision), timestamps every line it prints as it arrives, and stops the run with
SIGINT at its first rollout ("step 1 trajectories: start"). --before REV checks REV out into a git worktree
under /tmp and runs the same rounds with it, in turns with this checkout.

--parts times the pieces alone, --rounds times each: the imports of the train flow (compiled bytecode as a
second run finds it, and none, as a fresh venv's first run does), Prefect's temporary API server (a fresh
database, migrated at start, and one already migrated), a vLLM server of the mini base (with its log's own
phases) and the trainer worker loading it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PY = sys.executable
# The lines a run prints on its way to the first rollout, in the order a run before this change printed them.
MARKERS = [
    ("cli ready", r"rlvr-flows: run "),
    ("vLLM launched", r"vLLM server launched at "),
    ("tasks ready", r"prepare: tasks table "),
    ("base checked", r"prepare: base checkpoint "),
    ("policy start", r"starting \d+ vLLM server|using the server launched at the start"),
    ("vLLM ready", r"vLLM serving policy v0 "),
    ("base eval (cached)", r"evaluating the warm-started base checkpoint"),
    ("first rollout", r"step 1 trajectories: start"),
]


def one_run(code: str, run_id: str, store: str, timeout: float = 1800) -> dict:
    """One `make run` in `code` until its first rollout: seconds from the command to each marker."""
    # One store, Prefect home, work dir and vLLM environment for both revisions (a worktree has no venvs).
    env = dict(os.environ, PYTHONUNBUFFERED="1", PREFECT_HOME=os.path.join(REPO, ".rlvr", "prefect"),
               RLVR_WORK=os.path.join(REPO, ".rlvr", "work"),
               RLVR_VLLM_PYTHON=os.path.join(REPO, ".venv-vllm", "bin", "python"))
    env.pop("PREFECT_API_URL", None)
    t0 = time.monotonic()
    proc = subprocess.Popen([PY, "-m", "flows.main", "--preset", "mini", "--run-id", run_id, f"storage.root={store}"],
                            cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen, lines = {}, []
    try:
        for line in proc.stdout:
            lines.append(line)
            for name, pattern in MARKERS:
                if name not in seen and re.search(pattern, line):
                    seen[name] = round(time.monotonic() - t0, 1)
            if "first rollout" in seen or time.monotonic() - t0 > timeout:
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if "first rollout" not in seen:
        raise RuntimeError(f"{code}: no first rollout:\n{''.join(lines)[-4000:]}")
    return seen


def worktree(rev: str) -> str:
    tree = f"/tmp/rlvr-bench-{rev[:12]}"
    if not os.path.isdir(tree):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, rev], check=True, capture_output=True)
    return tree


def end_to_end(before: str | None, rounds: int) -> dict:
    store = "file://" + os.path.join(REPO, ".rlvr", "store")
    codes = {"after": REPO}
    if before:
        codes = {"before": worktree(before), **codes}
    for name, code in codes.items():  # untimed: builds or checks what a warm run finds cached
        print(f"warm-up ({name}) ...", flush=True)
        one_run(code, f"bench-startup-warm-{name}-{int(time.time())}", store, timeout=7200)
    results = {k: [] for k in codes}
    for i in range(rounds):
        for name, code in codes.items():
            r = one_run(code, f"bench-startup-{name}-{int(time.time())}-{i}", store)
            results[name].append(r)
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    return results


def median_table(results: dict) -> str:
    names = list(results)
    rows = ["| from the command to | " + " | ".join(f"{n} (median s)" for n in names)
            + (" | after/before |" if len(names) == 2 else " |"),
            "|---|" + "---|" * len(names) + ("---|" if len(names) == 2 else "")]
    for marker, _ in MARKERS:
        meds = [statistics.median([r[marker] for r in results[n] if marker in r]) if any(marker in r for r in results[n])
                else None for n in names]
        cells = [f"{m:.1f}" if m is not None else "-" for m in meds]
        ratio = (f" | {meds[1] / meds[0]:.2f}x" if len(names) == 2 and None not in meds and meds[0] else
                 (" | -" if len(names) == 2 else ""))
        rows.append(f"| {marker} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------- the parts alone


def timed(cmd: list[str], env: dict | None = None, cwd: str = REPO) -> float:
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, check=True, capture_output=True)
    return time.monotonic() - t0


def vllm_log_phases(path: str) -> dict:
    """Seconds from the command to what vLLM's own log reports (its first line is our '$ command')."""
    text = open(path, errors="replace").read()
    out = {}
    for name, pattern in (("weights loaded", r"Loading weights took ([\d.]+) seconds"),
                          ("model loaded", r"Model loading took [\d.]+ Gi?B(?: memory)? and ([\d.]+) seconds"),
                          ("engine init (profile, KV cache, warm-up)", r"init engine .* took ([\d.]+) seconds")):
        m = re.search(pattern, text)
        if m:
            out[name] = float(m[1])
    return out


def parts(rounds: int) -> dict:
    sys.path.insert(0, REPO)
    from schemas.presets import load_config
    from tasks.inference import VLLMServer
    from tasks.policy.worker import TrainerWorker

    cfg = load_config("mini")
    base = os.path.join(REPO, "models", "mini-base")
    out: dict[str, list] = {}
    work = tempfile.mkdtemp(prefix="rlvr-bench-startup-")
    api = ("import time, os; from flows.process import TemporaryAPI, prefect_defaults; prefect_defaults(); "
           "t = time.monotonic(); TemporaryAPI().start().wait_ready(); print(time.monotonic() - t)")
    warm_home = os.path.join(work, "prefect-warm")
    subprocess.run([PY, "-c", api], cwd=REPO, env={**os.environ, "PREFECT_HOME": warm_home}, check=True,
                   capture_output=True)
    for i in range(rounds):
        cold = os.path.join(work, f"pycache-{i}")  # no compiled bytecode: what a fresh venv's first run meets
        out.setdefault("imports of flows.train, bytecode compiled", []).append(
            timed([PY, "-c", "import flows.train"]))
        out.setdefault("imports of flows.train, no bytecode", []).append(
            timed([PY, "-c", "import flows.train"], {"PYTHONPYCACHEPREFIX": cold}))
        for label, home in (("fresh database", os.path.join(work, f"prefect-fresh-{i}")), ("migrated database", warm_home)):
            r = subprocess.run([PY, "-c", api], cwd=REPO, env={**os.environ, "PREFECT_HOME": home, "PYTHONUNBUFFERED": "1"},
                               capture_output=True, text=True, check=True)
            out.setdefault(f"Prefect API, {label}", []).append(float(r.stdout.strip().splitlines()[-1]))
        t0 = time.monotonic()
        server = VLLMServer(base, cfg.inference, log_dir=os.path.join(work, "vllm")).start()
        out.setdefault("vLLM server (mini base)", []).append(time.monotonic() - t0)
        server.stop()
        for k, v in vllm_log_phases(str(server.log_path)).items():
            out.setdefault(f"  vLLM: {k}", []).append(v)
        t0 = time.monotonic()
        TrainerWorker(base, cfg, log_path=os.path.join(work, "trainer.log")).start().stop()
        out.setdefault("trainer worker (mini base)", []).append(time.monotonic() - t0)
        print(f"round {i + 1}: " + ", ".join(f"{k.strip()} {v[-1]:.1f}" for k, v in out.items()), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", help="a git revision to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", action="store_true", help="time the start-up parts alone instead")
    a = p.parse_args(argv)
    if a.parts:
        res = parts(a.rounds)
        print("\n| part | median s | rounds |\n|---|---|---|")
        for k, v in res.items():
            print(f"| {k} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
        return 0
    res = end_to_end(a.before, a.rounds)
    print("\n" + median_table(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
