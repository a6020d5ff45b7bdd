"""Decode throughput: vLLM CPU server (token-in/token-out client) vs Hugging Face
`generate`, on the same prompts (a script, not a test).

The model is the mini preset's tiny policy (ModelConfig defaults, or --arch).
vLLM: N concurrent requests (N = 1, 8, 32), each a distinct --prompt-len token
prompt, --new-tokens sampled tokens (T=1); throughput = generated tokens /
wall time. HF: the same prompts as one batch of N, run right after each vLLM
round (the idle server stays up) so that both see the same machine load; the
ratio is the median of the per-round ratios. Medians over --repeats.

    .venv/bin/python tests/bench/bench_inference.py [--threads 1] [--compiled] [--arch qwen3_moe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def prompts(n, length, vocab):
    import random

    rng = random.Random(n * 1000 + length)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


async def vllm_round(client, batch, new_tokens):
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(p, new_tokens, 1.0, 1.0) for p in batch))
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def hf_round(model, batch, new_tokens):
    import torch

    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, pad_token_id=0)
    dt = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="vLLM OMP threads (default: vLLM's choice)")
    ap.add_argument("--hf-threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="torch.compile in vLLM (default on CPU: eager)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json-out")
    a = ap.parse_args()

    import torch

    from schemas.config import InferenceConfig, ModelConfig
    from tasks.inference import PolicyClient, VLLMServer
    from tasks.policy.model import create_tiny_policy, load_pretrained_policy
    from tasks.policy.tokenizer import IM_END, special_token_ids

    mcfg = ModelConfig(arch=a.arch)
    work = Path(tempfile.mkdtemp(prefix="bench-inference-"))
    model_dir = create_tiny_policy(mcfg, work / "model")
    model, tok = load_pretrained_policy(model_dir)
    icfg = InferenceConfig(max_model_len=a.prompt_len + a.new_tokens + 16, max_num_seqs=max(a.concurrency),
                           cpu_kvcache_gib=2, cpu_threads=a.threads, enforce_eager=not a.compiled,
                           startup_timeout_s=900)
    torch.set_num_threads(a.hf_threads)
    per = {n: {"vllm": [], "hf": [], "ratio": []} for n in a.concurrency}
    t0 = time.perf_counter()
    with VLLMServer(model_dir, icfg, log_dir=work / "logs") as server:
        startup = time.perf_counter() - t0
        client = PolicyClient([server.base_url], stop_token_ids=[special_token_ids(tok)[IM_END]])

        async def run_all():
            await client.generate(prompts(1, a.prompt_len, mcfg.vocab_size)[0], 8)  # warm-up
            if not a.skip_hf:
                hf_round(model, prompts(1, a.prompt_len, mcfg.vocab_size), 4)
            for _ in range(a.repeats):
                for n in a.concurrency:
                    batch = prompts(n, a.prompt_len, mcfg.vocab_size)
                    v = await vllm_round(client, batch, a.new_tokens)
                    per[n]["vllm"].append(v)
                    if not a.skip_hf:
                        h = hf_round(model, batch, a.new_tokens)
                        per[n]["hf"].append(h)
                        per[n]["ratio"].append(v / h)

        asyncio.run(run_all())
    rows = []
    for n in a.concurrency:
        row = {"concurrency": n, "vllm_tok_s": round(statistics.median(per[n]["vllm"]))}
        if not a.skip_hf:
            row |= {"hf_tok_s": round(statistics.median(per[n]["hf"])),
                    "ratio": round(statistics.median(per[n]["ratio"]), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"arch": a.arch, "vllm_threads": a.threads or "vllm default", "hf_threads": a.hf_threads,
            "compiled": a.compiled, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
            "repeats": a.repeats, "server_startup_s": round(startup, 1), "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(meta))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
