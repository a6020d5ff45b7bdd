"""The benchmark's architecture against the mini's, at the mini's sizes (a script, not a test).

    .venv/bin/python tests/bench/bench_hybrid.py [--concurrency 128] [--new-tokens 128] [--repeats 3]

For `qwen3_moe` (the mini's, served and trained in fp32) and `qwen3_5_moe` (Gated DeltaNet + full
attention + MoE with a shared expert: the mini-hybrid preset, served in bf16, trained in fp32 or bf16),
both random weights at the mini preset's width (hidden 256, 4 layers, 8 experts top-2, vocab 4096):
    decode    tokens/s of vLLM CPU (the project's VLLMServer, as a run starts it) for `--concurrency`
              requests at once (the mini's agent.concurrency), each `--new-tokens` tokens past a short prompt
    update    seconds of one GRPO-sized trainer pass (forward, backward, AdamW) on --train-batch
              sequences of --train-seq tokens, per trainer precision (runtime.token_logprobs)
Medians over --repeats, the architectures measured in turns so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ARCHS = {"qwen3_moe": ("mini", "float32"), "qwen3_5_moe": ("mini-hybrid", "bfloat16")}


def build(arch: str, root: Path) -> Path:
    from schemas.presets import load_config
    from tasks.policy.model import create_tiny_policy

    cfg = load_config(ARCHS[arch][0]).model.model_copy(update={"path": None, "arch": arch})
    return create_tiny_policy(cfg, root / arch)


async def decode(server, tok, concurrency: int, new_tokens: int) -> float:
    from tasks.inference import PolicyClient
    from tasks.policy import tokenizer as T

    # No stop ids of ours (vLLM still stops at the model's EOS): tokens/s counts what was generated.
    client = PolicyClient([server.base_url], stop_token_ids=[])
    prompts = [T.prompt_ids(tok, [{"role": "user", "content": f"Fix bug number {i} in foo.py."}])
               for i in range(concurrency)]
    t0 = time.perf_counter()
    out = await asyncio.gather(*(client.generate(p, new_tokens, 1.0, 1.0, seed=i) for i, p in enumerate(prompts)))
    dt = time.perf_counter() - t0
    await client.aclose()
    return sum(len(o.token_ids) for o in out) / dt


def update_seconds(model_dir: Path, precision: str, batch: int, seq: int) -> float:
    import torch

    from tasks.policy.batch import Sample, collate
    from tasks.policy.model import load_pretrained_policy
    from tasks.policy.runtime import Runtime, token_logprobs

    model, _ = load_pretrained_policy(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rt = Runtime(0, 1, torch.device("cpu"), precision == "bf16")
    g = torch.Generator().manual_seed(0)
    samples = [Sample(str(i), torch.randint(10, 4000, (seq,), generator=g), torch.ones(seq - 1), torch.zeros(seq - 1))
               for i in range(batch)]
    t0 = time.perf_counter()
    for i in range(batch):  # one sequence per micro-batch, as the mini's token budget packs them
        mb = collate(samples, [i], rt.device)
        (-token_logprobs(model, mb, rt).sum() / batch).backward()
    opt.step()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--train-seq", type=int, default=1024)
    ap.add_argument("--json-out")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from schemas.config import InferenceConfig
    from tasks.inference import VLLMServer
    from tasks.policy.model import load_pretrained_policy, num_parameters

    root = Path(tempfile.mkdtemp(prefix="bench-hybrid-"))
    dirs = {arch: build(arch, root) for arch in ARCHS}
    res: dict = {arch: {"decode_tok_s": [], "update_s": {"fp32": [], "bf16": []}} for arch in ARCHS}
    for arch, d in dirs.items():
        res[arch]["parameters"] = num_parameters(load_pretrained_policy(d)[0])
    # Decode: one server per architecture, in turns (start-up excluded).
    for arch, d in dirs.items():
        # As a seeded run serves (RunConfig): no chunked prefill on CPU, so the hybrid caches no prefixes.
        cfg = InferenceConfig(max_model_len=4096, max_num_seqs=a.concurrency, startup_timeout_s=600,
                              chunked_prefill=False)
        t0 = time.perf_counter()
        with VLLMServer(d, cfg, log_dir=root / "logs") as server:
            res[arch]["server_start_s"] = time.perf_counter() - t0
            tok = AutoTokenizer.from_pretrained(d)
            asyncio.run(decode(server, tok, 8, 8))  # warm-up
            for _ in range(a.repeats):
                res[arch]["decode_tok_s"].append(asyncio.run(decode(server, tok, a.concurrency, a.new_tokens)))
                print(f"{arch} decode {res[arch]['decode_tok_s'][-1]:.0f} tok/s", flush=True)
    for _ in range(a.repeats):
        for arch, d in dirs.items():
            for precision in ("fp32", "bf16"):
                res[arch]["update_s"][precision].append(update_seconds(d, precision, a.train_batch, a.train_seq))
                print(f"{arch} update {precision} {res[arch]['update_s'][precision][-1]:.1f} s", flush=True)
    print(f"\n{a.concurrency} requests x {a.new_tokens} tokens; update: {a.train_batch} x {a.train_seq} tokens")
    base = {}
    for arch in ARCHS:
        r = res[arch]
        med = {"decode": statistics.median(r["decode_tok_s"]),
               **{p: statistics.median(v) for p, v in r["update_s"].items()}}
        base[arch] = med
        print(f"{arch:12} {r['parameters'] / 1e6:5.1f}M params  served {ARCHS[arch][1]:8}  decode {med['decode']:6.0f} tok/s"
              f"  update fp32 {med['fp32']:5.1f} s  bf16 {med['bf16']:5.1f} s  (server start {r['server_start_s']:.0f} s)")
    h, m = base["qwen3_5_moe"], base["qwen3_moe"]
    print(f"hybrid / mini: decode {h['decode'] / m['decode']:.2f}x, update fp32 {h['fp32'] / m['fp32']:.2f}x, "
          f"hybrid bf16 update / mini fp32 update {h['bf16'] / m['fp32']:.2f}x")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
