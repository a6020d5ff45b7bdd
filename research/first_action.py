"""Which first action an episode took (view, search, or an edit straight away) and how often each
succeeded: for training steps (trajectories + rewards) and evaluations (eval_trajectories +
eval_rewards) of a run. A measurement script for the blind-edit habit (sft.blind_edit_demonstrations).

    .venv/bin/python research/first_action.py RUN_ID [--steps 1,2,3] [--eval]
"""

import argparse
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tasks.storage import Store  # noqa: E402


def first_action(messages) -> str:
    msgs = json.loads(messages) if isinstance(messages, str) else messages
    for m in msgs:
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            try:
                args = json.loads(fn["arguments"])
            except (TypeError, ValueError):
                return "unparsable"
            return args.get("command", fn["name"]) if fn["name"] == "file_editor" else fn["name"]
    return "no tool call"


def table(store: Store, run_id: str, step: int, prefix: str) -> dict:
    """{first action: [episodes, summed reward]} of one step's committed stage."""
    traj = store.read_stage(run_id, step, f"{prefix}trajectories", columns=["rollout_id", "messages"])
    rew = store.read_stage(run_id, step, f"{prefix}rewards", columns=["rollout_id", "reward"])
    reward = dict(zip(rew["rollout_id"].to_pylist(), rew["reward"].to_pylist()))
    out = collections.defaultdict(lambda: [0, 0.0])
    for rid, msgs in zip(traj["rollout_id"].to_pylist(), traj["messages"].to_pylist()):
        a = first_action(msgs)
        out[a][0] += 1
        out[a][1] += reward.get(rid) or 0.0
    return dict(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_id")
    ap.add_argument("--steps", default=None, help="comma-separated; default: every committed step")
    ap.add_argument("--eval", action="store_true", help="evaluations instead of training rollouts")
    ap.add_argument("--store", default="file://.rlvr/store")
    ap.add_argument("--endpoint-url", default=None)
    a = ap.parse_args()
    store = Store(a.store, a.endpoint_url)
    prefix = "eval_" if a.eval else ""
    # One listing of the run's commit markers instead of probing step numbers.
    committed = sorted({int(c.key.split("/step-")[1][:5]) for c in store.commits(f"runs/{a.run_id}")
                        if c.stage == f"{prefix}rewards" and "/step-" in c.key})
    steps = [int(s) for s in a.steps.split(",")] if a.steps else committed
    for step in steps:
        t = table(store, a.run_id, step, prefix)
        n = sum(v[0] for v in t.values())
        cells = "  ".join(f"{k} {v[0] / n:.2f} (reward {v[1] / v[0]:.2f})" for k, v in sorted(t.items()))
        print(f"step {step:3d}  n={n:4d}  {cells}")


if __name__ == "__main__":
    main()
