"""Tiny policy model benchmark (a script, not a test).

For each architecture at the mini preset's width (ModelConfig defaults: hidden
256, 4 layers, 4 heads / 2 KV heads, FFN 768, MoE 8 experts top-2, vocab 4096):
parameter counts, training throughput (forward + backward + AdamW step, fp32)
and Hugging Face `generate` throughput (KV cache, batch of prompts, fp32).
Medians over --repeats timed runs after a warm-up. The architectures are
measured in turns (round-robin) so that a busy machine slows all of them alike.

    .venv/bin/python tests/bench/bench_model.py [--threads 2] [--repeats 5] [--arch qwen3_moe qwen3 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def train_step(model, opt, ids):
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def generate_once(model, ids, new_tokens):
    import torch

    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                             pad_token_id=0)
    dt = time.perf_counter() - t0
    model.train()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["qwen3_moe", "qwen3", "qwen3_5_moe"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=512)
    ap.add_argument("--gen-batch", type=int, default=8)
    ap.add_argument("--gen-prompt", type=int, default=128)
    ap.add_argument("--gen-new", type=int, default=64)
    ap.add_argument("--json-out")
    a = ap.parse_args()

    import torch

    from schemas.config import ModelConfig
    from tasks.policy.model import build_tiny_model, num_parameters
    from tasks.policy.tokenizer import train_tokenizer

    torch.set_num_threads(a.threads)
    tok = train_tokenizer(vocab_size=ModelConfig().vocab_size)
    g = torch.Generator().manual_seed(0)
    train_ids = torch.randint(10, ModelConfig().vocab_size, (a.train_batch, a.train_seq), generator=g)
    gen_ids = torch.randint(10, ModelConfig().vocab_size, (a.gen_batch, a.gen_prompt), generator=g)
    models = {}
    for arch in a.arch:
        model = build_tiny_model(ModelConfig(arch=arch), tok)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_step(model, opt, train_ids)  # warm-up
        generate_once(model, gen_ids[:, :8], 2)
        models[arch] = (model, opt)
    times = {arch: {"train": [], "gen": []} for arch in a.arch}
    for _ in range(a.repeats):
        for arch, (model, opt) in models.items():
            times[arch]["train"].append(train_step(model, opt, train_ids))
            times[arch]["gen"].append(generate_once(model, gen_ids, a.gen_new))
    results = []
    for arch, (model, _) in models.items():
        row = {
            "arch": arch,
            "params_total_M": round(num_parameters(model) / 1e6, 2),
            "params_active_M": round(num_parameters(model, active=True) / 1e6, 2),
            "train_tok_s": round(a.train_batch * a.train_seq / statistics.median(times[arch]["train"])),
            "generate_tok_s": round(a.gen_batch * a.gen_new / statistics.median(times[arch]["gen"])),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    meta = {"threads": a.threads, "repeats": a.repeats, "train": f"{a.train_batch}x{a.train_seq} fwd+bwd+AdamW fp32",
            "generate": f"batch {a.gen_batch}, prompt {a.gen_prompt}, {a.gen_new} new tokens, sampled, fp32",
            "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(meta))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
