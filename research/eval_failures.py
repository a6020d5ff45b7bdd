"""Why evaluation samples fail (a measurement script, not a test): for each failed sample of an
evaluation run, its first `str_replace` against the gold patch.

    .venv/bin/python research/eval_failures.py RUN_ID datasets/DATASET_ID/tasks.parquet [--store URL] [--step N]

Categories: no file view / no edit at all; the edit's site (the lines of the viewed file closest
to its `old_str`) is or is not a line the gold patch changes (or the line an insertion follows);
`old_str` is or is not a verbatim copy of the file. "right site, miscopied" is a reading error
(names recalled instead of copied); "wrong site" is a localisation error.
"""

import argparse
import collections
import difflib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tasks.storage import Store  # noqa: E402

VIEW = "Here's the result of running `cat -n` on "


def changed_lines(task: dict, path: str) -> list[float]:
    """Old-file line numbers the gold commit changes in `path` (from its ParsedCommit hunks); an
    insertion counts as the half line before it."""
    out = []
    for fd in json.loads(task["parsed_commit_content"])["file_diffs"]:
        if "/testbed/" + fd["header"]["file"]["path"] != path:
            continue
        for h in fd["hunks"]:
            line = h["descriptor"]["old_range"]["start"]
            for ln in h["line_group"]["all_lines"]:
                if ln["type"] == "added":
                    out.append(line - 0.5)
                elif ln["type"] == "deleted":
                    out.append(line)
                    line += 1
                elif ln["type"] != "note":  # context
                    line += 1
    return out


def classify(messages: list[dict], task: dict) -> str:
    view = next((m["content"] for m in messages if m["role"] == "tool" and m["content"].startswith(VIEW)), None)
    calls = (json.loads(c["function"]["arguments"]) for m in messages if m["role"] == "assistant"
             for c in m.get("tool_calls") or [])
    edit = next((a for a in calls if a.get("command") == "str_replace"), None)
    if view is None:
        return "no file view"
    if edit is None or not edit.get("old_str"):
        return "no str_replace"
    lines = [ln.split("\t", 1)[1] if "\t" in ln else "" for ln in view.split("\n")[1:]]
    n = edit["old_str"].count("\n") + 1
    ratio = lambda i: difflib.SequenceMatcher(None, edit["old_str"], "\n".join(lines[i:i + n])).ratio()
    first = max(range(max(len(lines) - n + 1, 1)), key=ratio) + 1
    path = view.split("\n", 1)[0][len(VIEW):].rstrip(":")
    site = any(first - 0.5 <= x <= first + n - 0.5 for x in changed_lines(task, path))
    copied = edit["old_str"] in "\n".join(lines)
    return f"{'right' if site else 'wrong'} site, old_str {'verbatim' if copied else 'miscopied'}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_id")
    ap.add_argument("tasks", help="the evaluated dataset's tasks table, a key in the store")
    ap.add_argument("--store", default="file://.rlvr/store")
    ap.add_argument("--step", type=int, default=0)
    args = ap.parse_args()
    store = Store(args.store)
    samples = store.read_stage(args.run_id, args.step, "eval_trajectories").to_pylist()
    rewards = {r["rollout_id"]: r["reward"] for r in store.read_stage(args.run_id, args.step, "eval_rewards").to_pylist()}
    tasks = {r["instance_id"]: r for r in store.read_table(args.tasks).to_pylist()}
    counts = collections.Counter()
    for s in samples:
        if rewards.get(s["rollout_id"]) == 1.0:
            counts["solved"] += 1
            continue
        messages = json.loads(s["messages"]) if isinstance(s["messages"], str) else s["messages"]
        counts[classify(messages, tasks[s["instance_id"]])] += 1
    total = sum(counts.values())
    print(f"{args.run_id}: {total} samples")
    for k, v in counts.most_common():
        print(f"  {v:5d}  {v / total:5.1%}  {k}")


if __name__ == "__main__":
    main()
