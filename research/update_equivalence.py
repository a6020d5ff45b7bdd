"""Does a refactor change the policy update? One GRPO update on the mini preset by an older tree's
trainer CLI (`python -m tasks.policy.trainer grpo`, e.g. a worktree of cd6c528) and by this tree's
PolicyTrainer, on the same inputs: the shipped base, 16 random episodes of 300-600 tokens in two
groups, generation logprobs of the policy at the preset's training temperature (+1e-5 noise, inside
the seq-mask-tis band). Prints loss, grad norm and the largest weight difference after the step.

    git worktree add /tmp/old cd6c528 && .venv/bin/python research/update_equivalence.py /tmp/old [OUT_DIR]
"""
import json, os, pathlib, subprocess, sys
import pyarrow as pa, pyarrow.parquet as pq, torch
old_tree = sys.argv[1]
out = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else ".rlvr/update-equivalence"); out.mkdir(parents=True, exist_ok=True)
from schemas.presets import load_config
from schemas.tables import REWARDS, TRAJECTORIES
from tasks.grpo import compute_advantages
from tasks.policy.checkpoint import load_policy
from tasks.policy.runtime import policy_logprobs
cfg = load_config("mini")
model_dir = pathlib.Path("models/mini-base").resolve()
g = torch.Generator().manual_seed(0)
model = load_policy(model_dir)
rows, rewards = [], []
for k in range(16):
    L = 300 + int(torch.randint(0, 300, (1,), generator=g))
    P = L // 3
    tokens = torch.randint(10, 4000, (L,), generator=g).tolist()
    mask = [0] * P + [1] * (L - P)
    lp = policy_logprobs(model, [tokens], temperature=cfg.agent.training.temperature)[0].tolist()
    noise = (torch.randn(L, generator=g) * 1e-5).tolist()  # inside the seq-mask-tis band
    gen = [0.0] + [lp[t - 1] + noise[t] if mask[t] else 0.0 for t in range(1, L)]
    grp = f"g{k // 8}"
    rows.append({"rollout_id": f"{grp}-{k}", "run_id": "eq", "step": 1, "policy_version": 0, "instance_id": grp,
                 "group_id": grp, "sample_index": k % 8, "split": "train", "messages": "[]", "token_ids": tokens,
                 "loss_mask": mask, "generation_logprobs": gen, "prompt_length": P, "num_turns": 1,
                 "num_generated_tokens": L - P, "tool_errors": 0, "finish_reason": "submitted", "error": None,
                 "final_patch": "", "generation_seconds": 0.0, "sandbox_seconds": 0.0, "total_seconds": 0.0})
    rewards.append(float(torch.rand(1, generator=g) < 0.5))
traj = TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))
rew = REWARDS.validate(REWARDS.from_rows([{"rollout_id": r["rollout_id"], "run_id": "eq", "step": 1,
    "instance_id": r["instance_id"], "reward": x, "grading_status": "graded", "error": None, "patch_applied": True,
    "test_statuses": "{}", "attempts": 1, "sandbox_start_seconds": 0.0, "test_seconds": 0.0, "total_seconds": 0.0}
    for r, x in zip(rows, rewards)]))
adv = compute_advantages(traj, rew, cfg.grpo)
pq.write_table(traj, out / "traj.parquet"); pq.write_table(adv, out / "adv.parquet")
pq.write_table(traj.append_column("mistake_mask", pa.nulls(traj.num_rows, pa.list_(pa.int8()))), out / "traj_old.parquet")
del model
from tasks.policy.grpo import PolicyTrainer
new = PolicyTrainer(model_dir, cfg).grpo_step(traj, adv, out / "new", policy_version=1)
env = dict(os.environ, PYTHONPATH=old_tree)
subprocess.run([sys.executable, "-c", "from schemas.presets import load_config; import sys; "
                "open(sys.argv[1],'w').write(load_config('mini').model_dump_json())", str(out / "old_cfg.json")],
               cwd=old_tree, env=env, check=True)
subprocess.run([sys.executable, "-m", "tasks.policy.trainer", "grpo", "--model", str(model_dir), "--out",
                str(out / "old"), "--config", str(out / "old_cfg.json"), "--trajectories", str(out / "traj_old.parquet"),
                "--advantages", str(out / "adv.parquet"), "--policy-version", "1", "--metrics-out",
                str(out / "old_metrics.json")], cwd=old_tree, env=env, check=True)
old = json.loads((out / "old_metrics.json").read_text())
oc = json.loads((out / "old_cfg.json").read_text())
print("grpo/optimizer config equal:", oc["grpo"] == json.loads(cfg.grpo.model_dump_json()) or
      {k: (oc["grpo"].get(k), v) for k, v in json.loads(cfg.grpo.model_dump_json()).items() if oc["grpo"].get(k) != v},
      {k: (oc["optimizer"].get(k), v) for k, v in json.loads(cfg.optimizer.model_dump_json()).items() if oc["optimizer"].get(k) != v})
for k in ("loss", "grad_norm", "is_oob_ratio", "tokens", "num_valid_samples"):
    a, b = old.get(k), new.get(k)
    print(f"{k:18s} old {a!r:24} new {b!r:24} diff {abs(a - b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else 'n/a'}")
w_old = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(out / "old" / "model.safetensors"))
w_new = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(out / "new" / "model.safetensors"))
print("max |w_old - w_new| after the step:", max((w_old[k].float() - w_new[k].float()).abs().max().item() for k in w_new))
