"""SFT warm-start speed (a measurement script, not a test): where an SFT step's time goes and what
makes it faster, side by side in one process on the same batches.

The warm start is most of a first `make run` (three cosine cycles, 2,880 steps of 8 demonstrations
on the mini model). This times `--steps` real optimizer steps (the trainer's `_optimizer_step`:
forward, token-mean cross-entropy with the context weighted as `sft.context_loss_weight`, backward,
clip, AdamW) on the same demonstration batches for each variant, interleaved round-robin so that a
noisy host hits every variant alike, and reports the median seconds per step, tokens/s and the
ratio to the first variant. Variants (EXPERTS/ATTENTION/MICRO_BATCH_TOKENS): the transformers MoE experts implementation
(`eager` loops over experts, `grouped_mm`; `batched_mm` gathers each token's expert weights and runs out
of 24 GiB here), the attention implementation, and
the micro-batch token budget (smaller splits a batch into length-sorted micro-batches with less
padding, the wasted work reported as padded/real tokens, but smaller matrix products).

    .venv/bin/python tests/bench/bench_sft.py MODEL_DIR DEMONSTRATIONS.parquet [--steps 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from schemas.presets import load_recipe  # noqa: E402
from tasks.policy.batch import plan_micro_batches  # noqa: E402
from tasks.policy.runtime import Runtime  # noqa: E402
from tasks.policy.sft import sft_samples, sft_step  # noqa: E402


def batches(samples, batch_size: int, steps: int, seed: int = 0):
    rng = random.Random(seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    return [[samples[i] for i in order[s * batch_size:(s + 1) * batch_size]] for s in range(steps)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("demonstrations")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="eager/sdpa/16384,grouped_mm/sdpa/16384,eager/eager/16384,"
                                          "grouped_mm/sdpa/3200,grouped_mm/sdpa/1600")
    a = ap.parse_args()
    recipe = load_recipe("mini")
    samples = sft_samples(pq.read_table(a.demonstrations), a.model_dir, recipe.context_loss_weight)
    data = batches(samples, recipe.batch_size, a.steps)
    lengths = [len(s.tokens) for b in data for s in b]
    print(f"{len(samples)} demonstrations; batch {recipe.batch_size}; tokens per sequence: median "
          f"{statistics.median(lengths):.0f}, max {max(lengths)}; torch threads {torch.get_num_threads()}")
    rt = Runtime(0, 1, torch.device("cpu"), False)
    models = {}
    for v in a.variants.split(","):
        experts, attn, _ = v.split("/")
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation=attn,
                                                     experts_implementation=experts)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        models[v] = (model, params, torch.optim.AdamW(params, lr=1e-5))
    times = {v: [] for v in models}
    padded: dict[str, int] = {}
    real = sum(len(s.tokens) for b in data for s in b)
    for r in range(a.rounds):
        for v, (model, params, opt) in models.items():
            for batch in data:
                plan = plan_micro_batches([len(s.tokens) for s in batch], 1, int(v.split("/")[2]))
                if r == 0:
                    padded[v] = padded.get(v, 0) + sum(len(idx) * max(len(batch[i].tokens) for i in idx)
                                                       for (idx,) in plan)
                t0 = time.perf_counter()
                sft_step(model, params, opt, batch, plan, rt, 1.0)
                times[v].append(time.perf_counter() - t0)
    tokens_per_step = real / len(data)
    base = statistics.median(times[next(iter(models))])
    print(f"{tokens_per_step:.0f} real tokens per step")
    print(f"{'experts/attention/micro-batch tokens':<38}{'padded/real':>12}{'median s/step':>14}{'tokens/s':>10}"
          f"{'vs first':>10}")
    for v, t in times.items():
        m = statistics.median(t)
        print(f"{v:<38}{padded[v] / real:>12.3f}{m:>14.3f}{tokens_per_step / m:>10.0f}{m / base:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
