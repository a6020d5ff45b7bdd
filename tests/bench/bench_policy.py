"""Benchmark of the policy update (a script, not a test).

    python tests/bench/bench_policy.py [--repeats 3] [--seqs 16] [--min-len 1024] [--max-len 2048]

A ~8M-parameter qwen3_moe, one GRPO update on `--seqs` random-token episodes of
1-2k tokens, run as the flows run it (the trainer worker; 1 rank, and 2 ranks under
torchrun with FSDP2/gloo). Reports medians of: update tokens/s, the overhead
ratio against a plain single-process PyTorch loop computing the same loss
(target <= 1.25x), peak RSS, and checkpoint save / load seconds.

Each trainer run is a trainer worker (tasks/policy/worker.py) started, given one update, stopped:
`process seconds` is that whole life, `update seconds` the update itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build_inputs(work: Path, seqs: int, min_len: int, max_len: int, seed: int = 0):
    import pyarrow.parquet as pq
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from schemas.config import GRPOConfig, OptimizerConfig, RunConfig
    from tasks.grpo import compute_advantages
    from tasks.policy.runtime import policy_logprobs
    from tests.test_policy_support import reward_table, trajectory_rows

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = Qwen3MoeForCausalLM(cfg).float()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(work / "v0"))

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (seqs,), generator=g).tolist()
    tokens = [torch.randint(4, 4096, (n,), generator=g).tolist() for n in lengths]
    lps = policy_logprobs(model, tokens)
    rows = trajectory_rows([("", "")] * seqs)  # placeholder rows, then the real tokens
    rows = rows.to_pylist()
    for k, (t, lp) in enumerate(zip(tokens, lps)):
        prompt = len(t) // 4  # the first quarter is the prompt, the rest was "generated"
        mask = [0] * prompt + [1] * (len(t) - prompt)
        rows[k].update(token_ids=t, loss_mask=mask, prompt_length=prompt, num_generated_tokens=len(t) - prompt,
                       group_id=f"g{k // 8}", instance_id=f"g{k // 8}",
                       generation_logprobs=[0.0] + [lp[i - 1].item() if mask[i] else 0.0 for i in range(1, len(t))])
    from schemas.tables import TRAJECTORIES

    traj = TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))
    rewards = torch.randint(0, 2, (seqs,), generator=g).tolist()
    run = RunConfig(grpo=GRPOConfig(prompts_per_step=max(1, seqs // 8), generations_per_prompt=8),
                    optimizer=OptimizerConfig(lr=1e-5))
    adv = compute_advantages(traj, reward_table(traj, rewards), run.grpo)
    pq.write_table(traj, work / "traj.parquet")
    pq.write_table(adv, work / "adv.parquet")
    (work / "run.json").write_text(run.model_dump_json())
    return params, sum(lengths)


def baseline(work: Path) -> dict:
    """The same update as a plain PyTorch loop: same micro-batches, same loss, AdamW, grad clip."""
    import pyarrow.parquet as pq
    import torch
    import torch.nn.functional as F

    from schemas.config import RunConfig
    from tasks.policy.checkpoint import load_policy
    from tasks.policy.batch import plan_micro_batches
    from tasks.policy.runtime import peak_rss_mib

    cfg = RunConfig.model_validate_json((work / "run.json").read_text())
    g = cfg.grpo
    traj = pq.read_table(work / "traj.parquet").to_pylist()
    adv = {r["rollout_id"]: r["advantage"] for r in pq.read_table(work / "adv.parquet").to_pylist()}
    model = load_policy(work / "v0")
    model.train()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if ".mlp.gate." not in n],
                            lr=cfg.effective_lr, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps)
    for n, p in model.named_parameters():
        p.requires_grad_(".mlp.gate." not in n)
    toks = sum(sum(r["loss_mask"][1:]) for r in traj)
    plan = plan_micro_batches([len(r["token_ids"]) for r in traj], 1, cfg.optimizer.micro_batch_tokens)
    t0 = time.perf_counter()
    for (idx,) in plan:
        T = max(len(traj[i]["token_ids"]) for i in idx) - 1
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        tgt, attn = torch.zeros_like(ids), torch.zeros_like(ids)
        mask, gen, a = (torch.zeros(len(idx), T) for _ in range(3))
        for j, i in enumerate(idx):
            t, n = traj[i]["token_ids"], len(traj[i]["token_ids"]) - 1
            ids[j, :n], tgt[j, :n], attn[j, :n] = torch.tensor(t[:-1]), torch.tensor(t[1:]), 1
            mask[j, :n] = torch.tensor(traj[i]["loss_mask"][1:], dtype=torch.float)
            gen[j, :n] = torch.tensor(traj[i]["generation_logprobs"][1:])
            a[j] = adv[traj[i]["rollout_id"]]
        logits = model(input_ids=ids, attention_mask=None if bool(attn.all()) else attn, use_cache=False).logits
        lp = -F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), reduction="none").view_as(tgt)
        ratio = torch.exp(lp - lp.detach())
        pg = torch.max(-a * ratio, -a * ratio.clamp(1 - g.ratio_clip_min, 1 + g.ratio_clip_max))
        w = torch.exp(lp.detach() - gen)
        geo = torch.exp(((lp.detach() - gen) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
        keep = ((geo >= g.truncated_importance_sampling_ratio_min) & (geo <= g.truncated_importance_sampling_ratio))
        loss = (w * keep[:, None] * pg * mask).sum() / toks
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.effective_grad_clip)
    opt.step()
    opt.zero_grad()
    seconds = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) - 1 for r in traj)
    return {"update_seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
            "peak_rss_mib": peak_rss_mib()}


def checkpoint_times(work: Path, repeats: int) -> dict:
    import shutil

    from tasks.policy.checkpoint import load_policy, save_policy

    loads, saves = [], []
    for k in range(repeats):
        t = time.perf_counter()
        model = load_policy(work / "v0")
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        save_policy(model, work / "saved", policy_version=k + 1, source_dir=work / "v0")
        saves.append(time.perf_counter() - t)
        shutil.rmtree(work / "saved")
    return {"load_seconds": statistics.median(loads), "save_seconds": statistics.median(saves)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the 1-process runs (default: torch's choice); "
                    "torchrun gives each of the 2 ranks 1 thread")
    ap.add_argument("--json-out", help="also write the results here")
    ap.add_argument("--baseline-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.baseline_worker:
        print(json.dumps(baseline(Path(a.baseline_worker))))
        return

    from schemas.config import RunConfig
    from tasks.policy.worker import TrainerWorker

    with tempfile.TemporaryDirectory(prefix="bench-policy-") as d:
        work = Path(d)
        params, tokens = build_inputs(work, a.seqs, a.min_len, a.max_len)
        print(f"model {params / 1e6:.1f}M params; batch {a.seqs} sequences, {tokens} tokens", flush=True)
        env = {**os.environ, **({"OMP_NUM_THREADS": str(a.threads)} if a.threads else {})}
        cfg = RunConfig.model_validate_json((work / "run.json").read_text())
        runs: dict[str, list[dict]] = {"plain PyTorch loop": [], "trainer 1 rank": [], "trainer 2 ranks (FSDP2 gloo)": []}
        for r in range(a.repeats):
            out = subprocess.run([sys.executable, __file__, "--baseline-worker", str(work)], capture_output=True,
                                 text=True, check=True, cwd=ROOT, env=env)
            runs["plain PyTorch loop"].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for ranks, name in ((1, "trainer 1 rank"), (2, "trainer 2 ranks (FSDP2 gloo)")):
                t = time.perf_counter()
                with TrainerWorker(work / "v0", cfg, num_ranks=ranks, env=env if ranks == 1 else None) as w:
                    m = w.train_step(work / "traj.parquet", work / "adv.parquet", work / f"out{ranks}")
                m["process_seconds"] = time.perf_counter() - t
                runs[name].append(m)
            print(f"repeat {r + 1}/{a.repeats}: " + ", ".join(
                f"{k}: {v[-1]['tokens_per_second']:.0f} tok/s" for k, v in runs.items()), flush=True)
        ckpt = checkpoint_times(work, max(a.repeats, 3))

    med = lambda rs, k: statistics.median(x[k] for x in rs if k in x)  # noqa: E731
    base = med(runs["plain PyTorch loop"], "update_seconds")
    results = {"params_m": params / 1e6, "tokens": tokens, "repeats": a.repeats, "checkpoint": ckpt}
    print(f"\nmedians over {a.repeats} runs ({tokens} tokens per update, {params / 1e6:.1f}M params):")
    print(f"{'':32s} {'update s':>9s} {'tok/s':>8s} {'vs plain':>9s} {'peak RSS MiB':>13s} {'process s':>10s}")
    for name, rs in runs.items():
        row = {"update_seconds": med(rs, "update_seconds"), "tokens_per_second": med(rs, "tokens_per_second"),
               "peak_rss_mib": med(rs, "peak_rss_mib"), "overhead_vs_plain": med(rs, "update_seconds") / base}
        if "process_seconds" in rs[0]:
            row.update(process_seconds=med(rs, "process_seconds"), load_seconds=med(rs, "load_seconds"),
                       save_seconds=med(rs, "save_seconds"))
        results[name] = row
        print(f"{name:32s} {row['update_seconds']:9.2f} {row['tokens_per_second']:8.0f} "
              f"{row['overhead_vs_plain']:8.2f}x {row['peak_rss_mib']:13.0f} "
              f"{row.get('process_seconds', math.nan):10.1f}")
    print(f"checkpoint (in process, median): load {ckpt['load_seconds']:.3f} s, save {ckpt['save_seconds']:.3f} s")
    ratio = results["trainer 1 rank"]["overhead_vs_plain"]
    print(f"1-rank overhead vs plain loop: {ratio:.2f}x (target <= 1.25x): {'OK' if ratio <= 1.25 else 'ABOVE TARGET'}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"results": results, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
