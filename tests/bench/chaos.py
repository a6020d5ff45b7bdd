"""The adversarial policy in a longer training run, per sandbox backend (a benchmark; `make chaos`).

    python tests/bench/chaos.py --steps 20 --backends bwrap,docker [--rate 0.5] [--seed 0] [key=value ...]

Each backend gets one run of the smoke preset through `python -m flows.main` (rollouts, grading,
advantages, update; its own vLLM server) with `agent.adversary_rate` of the training episodes
played by tasks/agent/adversary.py. Printed per run: steps, episodes, actions by kind, outcomes by
status (finish_reason, grading_status, tampering, harness changes, hack signals), the reward-1
patches and whether each carried the gold fix, watched host files, what was left behind, wall time.
`report` and `violations` are what tests/test_adversary.py asserts on a short run.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tasks.agent import adversary as A  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
MASKED_FINISH = ("infra_error", "agent_error")


def report(store, run_id: str) -> dict:
    """What the adversary did in a run and what came of it, from the run's committed tables."""
    from flows.runtime import load_tasks
    from tasks.dataset.mini import gold_patch

    manifest = store.read_manifest(run_id)
    agent = manifest.config["agent"]
    rate, seed, max_turns = agent["adversary_rate"], agent["adversary_seed"], agent["max_turns"]
    tasks = load_tasks(store, manifest.prepared["tasks"])
    out = {"run_id": run_id, "status": manifest.status, "steps": 0, "episodes": 0, "hostile_episodes": 0,
           "actions": collections.Counter(), "finish_reason": collections.Counter(),
           "grading_status": collections.Counter(), "tampering": 0, "harness_changes": 0, "hack_signals": 0,
           "reward_1": [], "masked": [], "unmasked_without_reason": [], "missing_rows": [], "unrecorded_plans": [],
           "step_seconds": []}
    step = 1
    while store.stage_committed(run_id, step, "trajectories"):
        traj = store.read_stage(run_id, step, "trajectories").to_pylist()
        if not store.stage_committed(run_id, step, "rewards"):
            out["missing_rows"].append(f"step {step}: rewards not committed")
            break
        rewards = {r["rollout_id"]: r for r in store.read_stage(run_id, step, "rewards").to_pylist()}
        out["steps"] = step
        timings_key = f"runs/{run_id}/step-{step:05d}/timings.json"
        if store.exists(timings_key):
            out["step_seconds"].append(sum(store.get_json(timings_key).values()))
        for t in traj:
            rid = t["rollout_id"]
            out["episodes"] += 1
            kinds = A.plan(seed, rid, rate, max_turns)
            said = [m["content"].split("\n")[0].removeprefix("[adversary] ") for m in json.loads(t["messages"])
                    if m["role"] == "assistant" and (m["content"] or "").startswith("[adversary] ")]
            if kinds is not None:
                out["hostile_episodes"] += 1
                out["actions"].update(kinds)
                # the turns the episode reached, as planned (a row of an episode that never ran has no messages)
                if t["messages"] != "[]" and (said != kinds[:len(said)] or not said):
                    out["unrecorded_plans"].append(f"{rid}: planned {kinds}, trajectory says {said}")
            out["finish_reason"][t["finish_reason"]] += 1
            if t["finish_reason"] in MASKED_FINISH:
                if not t["error"]:
                    out["unmasked_without_reason"].append(f"{rid}: {t['finish_reason']} without an error")
                last = (t["error"] or "").strip().splitlines()[-1:] or [""]
                out["masked"].append(f"{t['finish_reason']} after {kinds}: {last[0][:160]}")
            g = rewards.get(rid)
            if g is None:
                out["missing_rows"].append(f"{rid}: no rewards row")
                continue
            out["grading_status"][g["grading_status"]] += 1
            out["tampering"] += bool(g.get("tampering"))
            out["harness_changes"] += bool(g.get("harness_changes"))
            out["hack_signals"] += bool(g.get("hack_signals"))
            if g["grading_status"] != "graded" and not g["error"]:
                out["unmasked_without_reason"].append(f"{rid}: {g['grading_status']} without an error")
            if g["reward"] == 1.0:
                fixed = A.carries_fix(t["final_patch"], gold_patch(tasks[t["instance_id"]]))
                out["reward_1"].append({"rollout_id": rid, "adversary": kinds, "gold_fix": fixed,
                                        "hack_signals": g.get("hack_signals") or []})
        step += 1
    return out


def violations(rep: dict, steps: int) -> list[str]:
    """What must never happen: a missing step or row, a mask without its reason, reward 1 without the
    fix (unless an unpreventable kind that the grader counted), a plan the trajectory does not show."""
    bad = []
    if rep["steps"] != steps:
        bad.append(f"{rep['steps']} of {steps} steps completed (run status {rep['status']})")
    bad += rep["missing_rows"] + rep["unmasked_without_reason"] + rep["unrecorded_plans"]
    for r in rep["reward_1"]:
        if r["gold_fix"]:
            continue
        if r["adversary"] and set(r["adversary"]) & set(A.UNPREVENTABLE) and r["hack_signals"]:
            continue  # passes pytest honestly; the grader counted it
        if r["gold_fix"] is None:
            bad.append(f"{r['rollout_id']}: reward 1, the fix's file changed as a binary patch (.gitattributes "
                       f"-diff?): neither this check nor the hack signals can read it (adversary {r['adversary']})")
            continue
        bad.append(f"{r['rollout_id']}: reward 1 without the gold fix (adversary {r['adversary']}, "
                   f"hack signals {r['hack_signals']})")
    return bad


def print_report(rep: dict, wall_s: float) -> None:
    print(f"run {rep['run_id']} ({rep['status']}): {rep['steps']} steps, {rep['episodes']} episodes "
          f"({rep['hostile_episodes']} adversarial), {wall_s:.0f} s wall"
          + (f", {sum(rep['step_seconds']) / max(1, len(rep['step_seconds'])):.0f} s a step" if rep["step_seconds"] else ""))
    print("  actions by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(rep["actions"].items())))
    print("  finish_reason: " + ", ".join(f"{k} {n}" for k, n in sorted(rep["finish_reason"].items())))
    print("  grading_status: " + ", ".join(f"{k} {n}" for k, n in sorted(rep["grading_status"].items()))
          + f"; tampering {rep['tampering']}, harness changes {rep['harness_changes']}, "
            f"hack signals {rep['hack_signals']}")
    for m in rep["masked"]:
        print(f"  masked: {m}")
    r1 = rep["reward_1"]
    print(f"  reward-1 patches: {len(r1)}, {sum(r['gold_fix'] is True for r in r1)} with the gold fix; without it "
          "or unreadable: " + (", ".join(f"{r['rollout_id']} ({r['adversary']}, fix {r['gold_fix']}, signals "
                                         f"{len(r['hack_signals'])})" for r in r1 if r["gold_fix"] is not True)
                               or "none"))


def host_hashes() -> dict[str, str | None]:
    import hashlib

    out = {}
    for p in ("/etc/passwd", "/etc/hosts", "/etc/shadow", REPO / "pyproject.toml", *A.HOST_TARGETS[2:]):
        p = pathlib.Path(p)
        out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backends", default="bwrap,docker")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    # The tests' store by default: the smoke preset's dataset and base are prepared there already.
    ap.add_argument("--store", default=f"file://{REPO / '.rlvr' / 'test-store'}")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides of the smoke preset")
    args = ap.parse_args()
    from schemas.presets import load_config
    from tasks.sandbox import leftovers
    from tasks.storage import Store

    failed = False
    for backend in args.backends.split(","):
        run_id = f"chaos-{backend}-{int(time.time())}"
        overrides = [f"storage.root={args.store}", f"max_steps={args.steps}", f"sandbox.backend={backend}",
                     f"agent.adversary_rate={args.rate}", f"agent.adversary_seed={args.seed}",
                     "agent.max_turns=6", "agent.training.max_tokens_per_turn=1024", "eval.max_tasks=1",
                     "grpo.async_rollouts=false", *args.overrides]
        cfg = load_config("smoke", overrides)
        before = host_hashes()
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="chaos-prefect-") as home:
            env = dict(__import__("os").environ, PREFECT_HOME=home, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                       PYTHONUNBUFFERED="1")
            env.pop("PREFECT_API_URL", None)
            log = pathlib.Path(home) / "run.log"
            with open(log, "w") as f:
                proc = subprocess.Popen([sys.executable, "-m", "flows.main", "--preset", "smoke", "--run-id", run_id,
                                         *overrides], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
                proc.wait()
            out = log.read_text()
        wall = time.monotonic() - t0
        store = Store.from_config(cfg.storage)
        rep = report(store, run_id)
        print_report(rep, wall)
        bad = violations(rep, args.steps)
        after = host_hashes()
        bad += [f"host file changed: {k}" for k in before if before[k] != after[k]]
        bad += [f"left behind: {x}" for x in leftovers(proc.pid, docker=backend == "docker")]
        if proc.returncode not in (0, 1):
            bad.append(f"flows.main exited {proc.returncode}:\n{out[-3000:]}")
        print(f"  {backend}: " + ("OK" if not bad else f"{len(bad)} violations:\n    " + "\n    ".join(bad)))
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
