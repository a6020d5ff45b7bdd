"""Does a refactor change the policy update? One GRPO update on the mini preset by each of two trees, on
the same inputs, through the path the flow takes (flows/grpo_iteration.py `update` -> the trainer worker's
client, tasks/policy/worker.py -> a worker subprocess -> tasks/policy/grpo.py PolicyTrainer -> the loss).

Inputs, built once by this tree: the shipped base, 16 random episodes of 300-600 tokens in two groups,
generation logprobs of the base at the preset's training temperature (+1e-5 noise, inside the
seq-mask-tis band), rewards at random, advantages. Each tree then runs a small driver in a subprocess of
its own (cwd and PYTHONPATH = that tree) that starts its trainer worker with its own mini preset and asks
for one update. Prints the two trees' loss, grad norm and other metrics, and the largest weight difference
after the step. A refactor should agree to 1e-6 (same machine: usually exactly).

    git worktree add /tmp/before 0769e99 && .venv/bin/python research/update_equivalence.py /tmp/before [OUT_DIR]
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import torch

HERE = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

# The per-tree driver. The client's update method has had other names in other trees: take the first present.
DRIVER = r"""
import json, sys
from schemas.presets import load_config
from tasks.policy.worker import TrainerWorker
model_dir, traj, adv, out, result = sys.argv[1:6]
cfg = load_config("mini")
NAMES = ("update", "train_step", "grpo_update", "update_policy", "policy_update")
with TrainerWorker(model_dir, cfg) as worker:
    name = next((n for n in NAMES if callable(getattr(worker, n, None))), None)
    if name is None:
        sys.exit(f"TrainerWorker has none of {NAMES}; it has {[n for n in dir(worker) if not n.startswith('_')]}")
    metrics = getattr(worker, name)(traj, adv, out, policy_version=1)
json.dump({"method": name, "metrics": metrics, "grpo": json.loads(cfg.grpo.model_dump_json()),
           "optimizer": json.loads(cfg.optimizer.model_dump_json())}, open(result, "w"))
"""
SHOWN = ("loss", "grad_norm", "is_oob_ratio", "probs_ratio", "tokens", "num_valid_samples", "optimizer_steps")


def make_inputs(out: pathlib.Path, model_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    from transformers import AutoModelForCausalLM

    from schemas.presets import load_config
    from schemas.tables import REWARDS, TRAJECTORIES
    from tasks.grpo import compute_advantages
    from tasks.policy.runtime import policy_logprobs

    cfg = load_config("mini")
    g = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows, rewards = [], []
    for k in range(16):
        length = 300 + int(torch.randint(0, 300, (1,), generator=g))
        prompt = length // 3
        tokens = torch.randint(10, 4000, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        lp = policy_logprobs(model, [tokens], temperature=cfg.agent.training.temperature)[0].tolist()
        noise = (torch.randn(length, generator=g) * 1e-5).tolist()  # inside the seq-mask-tis band
        gen = [0.0] + [lp[t - 1] + noise[t] if mask[t] else 0.0 for t in range(1, length)]
        grp = f"g{k // 8}"
        rows.append({"rollout_id": f"{grp}-{k}", "run_id": "eq", "step": 1, "policy_version": 0, "instance_id": grp,
                     "group_id": grp, "sample_index": k % 8, "split": "train", "messages": "[]",
                     "token_ids": tokens, "loss_mask": mask, "generation_logprobs": gen, "prompt_length": prompt,
                     "num_turns": 1, "num_generated_tokens": length - prompt, "tool_errors": 0,
                     "finish_reason": "submitted", "error": None, "final_patch": "", "generation_seconds": 0.0,
                     "sandbox_seconds": 0.0, "total_seconds": 0.0})
        rewards.append(float(torch.rand(1, generator=g) < 0.5))
    traj = TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))
    rew = REWARDS.validate(REWARDS.from_rows([
        {"rollout_id": r["rollout_id"], "run_id": "eq", "step": 1, "instance_id": r["instance_id"], "reward": x,
         "grading_status": "graded", "error": None, "patch_applied": True, "test_statuses": "{}", "attempts": 1,
         "sandbox_start_seconds": 0.0, "test_seconds": 0.0, "total_seconds": 0.0}
        for r, x in zip(rows, rewards)]))
    paths = out / "traj.parquet", out / "adv.parquet"
    pq.write_table(traj, paths[0])
    pq.write_table(compute_advantages(traj, rew, cfg.grpo), paths[1])
    return paths


def run_tree(tree: pathlib.Path, name: str, model_dir, traj, adv, out: pathlib.Path) -> dict:
    ckpt, result = out / name, out / f"{name}.json"
    shutil.rmtree(ckpt, ignore_errors=True)  # a rerun writes the checkpoint afresh
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "-c", DRIVER, str(model_dir), str(traj), str(adv), str(ckpt), str(result)],
                   cwd=tree, env=env, check=True)
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other_tree", type=pathlib.Path, help="the tree to compare with (e.g. a git worktree)")
    ap.add_argument("out", type=pathlib.Path, nargs="?", default=pathlib.Path(".rlvr/update-equivalence"))
    ap.add_argument("--this-tree", type=pathlib.Path, default=HERE)
    a = ap.parse_args()
    other, this = a.other_tree.resolve(), a.this_tree.resolve()
    for tree in (other, this):
        if not (tree / "tasks" / "policy" / "worker.py").exists():
            sys.exit(f"{tree}: not a tree of this project (no tasks/policy/worker.py)")
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = (HERE / "models" / "mini-base").resolve()
    traj, adv = make_inputs(out, model_dir)
    results = {"other": run_tree(other, "other", model_dir, traj, adv, out),
               "this": run_tree(this, "this", model_dir, traj, adv, out)}
    o, t = results["other"], results["this"]
    print(f"trees: other {other} ({o['method']}), this {this} ({t['method']})")
    for section in ("grpo", "optimizer"):
        diff = {k: (o[section].get(k), v) for k, v in t[section].items() if o[section].get(k) != v}
        print(f"{section} config: {'equal' if not diff else diff}")
    for k in SHOWN:
        x, y = o["metrics"].get(k), t["metrics"].get(k)
        d = abs(x - y) if isinstance(x, (int, float)) and isinstance(y, (int, float)) else "n/a"
        print(f"{k:18s} other {x!r:24} this {y!r:24} diff {d}")
    from safetensors.torch import load_file

    w_other, w_this = (load_file(str(out / name / "model.safetensors")) for name in ("other", "this"))
    if w_other.keys() != w_this.keys():
        sys.exit(f"the checkpoints hold different tensors: {sorted(w_other.keys() ^ w_this.keys())[:10]}")
    print("max |w_other - w_this| after the step:",
          max((w_other[k].float() - w_this[k].float()).abs().max().item() for k in w_this))


if __name__ == "__main__":
    main()
