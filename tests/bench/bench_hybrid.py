"""The benchmark's architecture against the mini's, at the mini's sizes (a script, not a test).

    .venv/bin/python tests/bench/bench_hybrid.py [--concurrency 128] [--new-tokens 128] [--repeats 3]

For `qwen3_moe` (the mini's, served and trained in fp32) and `qwen3_5_moe` (Gated DeltaNet + full
attention + MoE with a shared expert: the mini-hybrid preset, served in bf16, trained in fp32 or bf16),
both random weights at the mini preset's width (hidden 256, 4 layers, 8 experts top-2, vocab 4096):
    decode    tokens/s of vLLM CPU (the project's VLLMServer, as a run starts it) for `--concurrency`
              requests at once (the mini's agent.concurrency), each `--new-tokens` tokens past a short prompt
    update    seconds of one GRPO-sized trainer pass (forward, backward, AdamW) on --train-batch
              sequences of --train-seq tokens, per trainer precision (runtime.token_logprobs)
    sft       with --sft DEMONSTRATIONS.parquet: seconds per warm-start step (the mini recipe's first
              stage: batches of 8, micro-batches of <= 1,600 tokens, loss on the context too) on those
              demonstrations, per architecture and trainer precision: what `make base` costs
    grpo      with --grpo STORE RUN RUN: one GRPO update (tasks/policy/grpo.py) on step 1's rollouts of
              each run (a mini and a mini-hybrid run, rewards drawn with p=0.3 so most groups have
              signal), the trainer in each run's own precision
    grpo-batch with --grpo-batch N: one GRPO update (PolicyTrainer.grpo_update: the mini's 16,384-token
              micro-batches, the loss, AdamW) on N generated episodes of 1,000-4,000 tokens (30% of them
              policy tokens, 7 of 8 with an advantage), no store needed: qwen3_moe fp32 (the mini),
              the hybrid bf16 (mini-hybrid) and fp32
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


def sft_seconds(dirs: dict, demonstrations: str, repeats: int) -> dict:
    import random

    import pyarrow.parquet as pq
    import torch

    from schemas.presets import load_config, load_recipe
    from schemas.recipe import stages
    from tasks.policy.batch import plan_micro_batches
    from tasks.policy.runtime import Runtime, adamw, load_for_training
    from tasks.policy.sft import sft_samples, sft_step

    stage, cfg = stages(load_recipe("mini"))[0], load_config("mini")
    setups = {}
    for arch, d in dirs.items():
        samples = sft_samples(pq.read_table(demonstrations), d, stage.context_loss_weight)
        for precision in ("fp32", "bf16"):
            rt = Runtime(0, 1, torch.device("cpu"), precision == "bf16")
            model, params = load_for_training(d, rt, True)
            setups[arch, precision] = (model, params, adamw(params, cfg, stage.lr), rt, samples)
    rng, out = random.Random(0), {}
    for _ in range(repeats + 1):  # the first round warms up
        for key, (model, params, opt, rt, samples) in setups.items():
            batch = rng.sample(samples, stage.batch_size)
            plan = plan_micro_batches([len(s.tokens) for s in batch], 1, stage.micro_batch_tokens)
            t0 = time.perf_counter()
            sft_step(model, params, opt, batch, plan, rt, 1.0)
            out.setdefault(key, []).append(time.perf_counter() - t0)
    return {f"{a} {p}": statistics.median(v[1:]) for (a, p), v in out.items()}


def grpo_seconds(store_root: str, runs: list[str], repeats: int) -> dict:
    import random
    import tempfile

    from schemas.config import RunConfig
    from tasks.grpo import compute_advantages
    from tasks.policy.grpo import PolicyTrainer
    from tests.test_policy_support import reward_table
    from tasks.storage import Store

    store, inputs, out = Store(store_root), {}, {}
    for run in runs:  # read once; each repeat starts from the run's own weights
        cfg = RunConfig.model_validate(store.read_manifest(run).config)
        traj = store.read_stage(run, 1, "trajectories")
        rng = random.Random(0)
        inputs[run] = cfg, traj, compute_advantages(
            traj, reward_table(traj, [rng.random() < 0.3 for _ in range(traj.num_rows)]), cfg.grpo)
    for _ in range(repeats):
        for run, (cfg, traj, adv) in inputs.items():
            trainer = PolicyTrainer(cfg.model.path, cfg, precision=cfg.optimizer.precision)
            samples, masked = trainer.prepare(traj, adv)
            t0 = time.perf_counter()
            trainer.grpo_update(samples, masked, tempfile.mkdtemp(), save_optimizer=False)
            key = f"{cfg.model.arch} {cfg.optimizer.precision or 'fp32'}: {len(samples)} samples"
            out.setdefault(key, []).append(time.perf_counter() - t0)
            print(f"grpo {key}: {out[key][-1]:.0f} s", flush=True)
    return {k: statistics.median(v) for k, v in out.items()}


def grpo_batch_seconds(n: int, repeats: int) -> dict:
    import random

    import torch

    from schemas.presets import load_config
    from tasks.policy.batch import Sample
    from tasks.policy.grpo import PolicyTrainer

    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        L = rng.randint(1000, 4000)
        samples.append(Sample(str(i), torch.randint(10, 4000, (L,), generator=g),
                              (torch.rand(L - 1, generator=g) < 0.3).float(), torch.full((L - 1,), -1.0),
                              advantage=rng.choice([-1.0, 1.0]) if i % 8 else 0.0))
    print(f"{n} episodes, {sum(len(s.tokens) for s in samples)} tokens", flush=True)
    root, out = Path(tempfile.mkdtemp(prefix="bench-hybrid-")), {}
    runs = [("qwen3_moe", "fp32"), ("qwen3_5_moe", "bf16"), ("qwen3_5_moe", "fp32")]
    dirs = {arch: build(arch, root) for arch in ARCHS}
    for _ in range(repeats):
        for arch, precision in runs:
            cfg = load_config(ARCHS[arch][0]).model_copy(deep=True)
            cfg.model.path = str(dirs[arch])
            trainer = PolicyTrainer(dirs[arch], cfg, precision=precision)
            t0 = time.perf_counter()
            trainer.grpo_update(samples, 0, tempfile.mkdtemp(dir=root), save_optimizer=False)
            out.setdefault(f"{arch} {precision}", []).append(time.perf_counter() - t0)
            print(f"grpo {arch} {precision}: {out[f'{arch} {precision}'][-1]:.1f} s", flush=True)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-batch", type=int, default=16)
    ap.add_argument("--train-seq", type=int, default=1024)
    ap.add_argument("--sft", metavar="DEMONSTRATIONS", help="also time warm-start steps on these demonstrations")
    ap.add_argument("--grpo", nargs=3, metavar=("STORE", "MINI_RUN", "HYBRID_RUN"),
                    help="only time one GRPO update on each run's step-1 rollouts")
    ap.add_argument("--grpo-batch", type=int, metavar="N", help="only time one GRPO update on N generated episodes")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    if a.grpo_batch:
        med = grpo_batch_seconds(a.grpo_batch, a.repeats)
        for key, sec in med.items():
            print(f"GRPO update, {key}: {sec:.1f} s ({sec / med['qwen3_moe fp32']:.2f}x the mini's)")
        return 0
    if a.grpo:
        for key, sec in grpo_seconds(a.grpo[0], a.grpo[1:], a.repeats).items():
            print(f"GRPO update, {key}: {sec:.0f} s")
        return 0

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
    if a.sft:
        res["sft_step_s"] = sft_seconds(dirs, a.sft, a.repeats)
        for key, sec in res["sft_step_s"].items():
            print(f"warm-start step, {key}: {sec:.2f} s")
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
