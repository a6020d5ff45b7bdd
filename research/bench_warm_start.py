"""Warm-start diagnostic (a measurement script, not a test): how well checkpoints copy the buggy
line from the file they just viewed, teacher-forced on validation tasks.

For each validation task of an evaluation run (its first sample), the episode's tokens up to
the end of the first tool output (the `view` of the file) are the prefix; the target is the
correct `str_replace` turn (the smallest unique edit of the gold patch, as the scripted solver
writes it). Reported per checkpoint: mean NLL and argmax accuracy of the first `old_str`
token (which line), of the rest of `old_str` (copying it) and of `new_str` (the fix).
A model that copies has near-zero NLL on the rest of `old_str`. Evaluation only: nothing
here trains, and validation tasks are read exactly as `flows.evaluate` reads them.
Also: old_str[1:] NLL by quarter of the distance back to the first assistant turn (the view call and the
file it shows), and with
--show N the first N targets' old_str with each wrong token as [wanted->argmax].

    .venv/bin/python research/bench_warm_start.py EVAL_RUN_ID CHECKPOINT_DIR [...] [--show N]
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from schemas.presets import load_config  # noqa: E402
from tasks.agent.scripted import parse_unified_diff, unique_edit  # noqa: E402
from tasks.dataset.build import build_dataset  # noqa: E402
from tasks.dataset.mini import gold_patch  # noqa: E402
from tasks.policy.tokenizer import assistant_text  # noqa: E402
from tasks.storage import Store  # noqa: E402


def episodes(store, run_id: str, tasks: dict) -> list[tuple[list[int], int, str, str, str]]:
    """(prefix ids, where the first assistant turn starts, path, old_str, new_str) per validation task."""
    key = f"runs/{run_id}/step-00000/eval_trajectories.parquet"
    rows = store.read_table(key, stage="eval_trajectories").to_pylist()
    out = []
    for r in rows:
        if r["sample_index"] != 0:
            continue
        mask = r["loss_mask"]
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        if len(starts) < 2:  # the model never got past its first turn
            continue
        t = tasks[r["instance_id"]]
        old_file = json.loads(t["parsed_commit_content"])["file_diffs"][0]["old_file_content"]
        hunk = parse_unified_diff(gold_patch(t))[0]
        old, new = unique_edit(old_file, hunk)
        out.append((r["token_ids"][: starts[1]], starts[0], f"/testbed/{hunk.path}", old, new))
    return out


def copy_metrics(ckpt: str, eps, show: int = 0) -> dict:
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    nll = {"old_first": [], "old_rest": [], "new": []}
    hit = {k: [] for k in nll}
    by_length = []  # (tokens since the first assistant turn: the view, mean old_str[1:] NLL) per episode
    shown = []
    for prefix, first_turn, path, old, new in eps:
        text = assistant_text(None, [{"name": "file_editor", "arguments": {
            "command": "str_replace", "path": path, "old_str": old, "new_str": new}}])
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        o0 = text.index(old)
        n0 = text.index(new, o0 + len(old))
        with torch.no_grad():
            logits = model(torch.tensor([prefix + enc["input_ids"]])).logits[0, len(prefix) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1)
        target = torch.tensor(enc["input_ids"])
        tok_nll = -logp[torch.arange(len(target)), target]
        tok_hit = logp.argmax(-1) == target
        first, rest, marked = True, [], []
        for j, (a, _b) in enumerate(enc["offset_mapping"]):
            if o0 <= a < o0 + len(old):
                kind, first = ("old_first" if first else "old_rest"), False
                want = tok.decode([target[j]])
                marked.append(want if tok_hit[j] else f"[{want}->{tok.decode([logp[j].argmax()])}]")
            elif n0 <= a < n0 + len(new):
                kind = "new"
            else:
                continue
            nll[kind].append(tok_nll[j].item())
            hit[kind].append(float(tok_hit[j]))
            if kind == "old_rest":
                rest.append(tok_nll[j].item())
        if rest:
            by_length.append((len(prefix) - first_turn, sum(rest) / len(rest)))
        if len(shown) < show:
            shown.append("".join(marked))
    mean = lambda v: round(sum(v) / max(len(v), 1), 3)
    out = {k: {"nll": mean(nll[k]), "accuracy": mean(hit[k]), "tokens": len(nll[k])} for k in nll}
    by_length.sort()
    q = max(len(by_length) // 4, 1)
    out["old_rest_by_length"] = [(part[0][0], part[-1][0], mean([n for _, n in part]))
                                 for part in (by_length[i * q:(i + 1) * q if i < 3 else None] for i in range(4)) if part]
    out["shown"] = shown
    return out


def main(argv: list[str]) -> None:
    show = 0
    if "--show" in argv:
        i = argv.index("--show")
        show, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    run_id, ckpts = argv[0], argv[1:]
    cfg = load_config("mini")
    store = Store.from_config(cfg.storage)
    key = build_dataset(cfg.dataset, store, cfg.sandbox, verify=False)
    tasks = {t["instance_id"]: t for t in store.read_table(key, stage="tasks").to_pylist()}
    eps = episodes(store, run_id, tasks)
    print(f"{len(eps)} validation episodes from {run_id}")
    print(f"{'checkpoint':40} {'old_str[0] nll/acc':>20} {'old_str[1:] nll/acc':>20} {'new_str nll/acc':>18}")
    for ckpt in ckpts:
        m = copy_metrics(ckpt, eps, show)
        cols = [f"{m[k]['nll']:.2f} / {m[k]['accuracy']:.2f}" for k in ("old_first", "old_rest", "new")]
        print(f"{ckpt[-40:]:40} {cols[0]:>20} {cols[1]:>20} {cols[2]:>18}", flush=True)
        print("    old_str[1:] nll by tokens since the view call: " +
              ", ".join(f"{lo}-{hi} tokens {n:.2f}" for lo, hi, n in m["old_rest_by_length"]))
        for line in m["shown"]:
            print(f"    {line!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
