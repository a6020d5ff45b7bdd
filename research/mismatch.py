"""Sampler/trainer mismatch of a run, measured as the reference measures it, per step.

    .venv/bin/python research/mismatch.py STORE_ROOT RUN_ID [--steps 1 2 3] [--precision fp32 bf16]

For each step, the trajectories vLLM sampled (their token ids and vLLM's logprobs) are scored again by
the trainer at the weights that sampled them (the base for step 1, checkpoint s-1 after), in each
way asked for, and compared over the generated tokens:
    fp32     fp32 compute on the fp32 weights (the trainer's default on CPU)
    bf16     bf16 compute on the bf16 rounding of the fp32 weights (optimizer.precision=bf16)
    fp32-bf16w  fp32 compute on the bf16 rounding of the weights: the values vLLM serves in bf16,
             without bf16's rounding of every activation (a scoring mode, to locate the mismatch)
    token_mult_prob_error  NeMo-RL's: mean over generated tokens of exp(|trainer - vLLM|) (1 = exact)
    masked                 the share of sequences seq-mask-tis drops: geometric-mean ratio
                           exp(mean(trainer - vLLM)) outside [0.999, 1.002] (the reference's bounds)
    ratio p5/p50/p95       the distribution of that per-sequence geometric-mean ratio
    |d| mean / max         per-token |trainer - vLLM| logprob difference
The training temperature divides the logits, as the trainer does (vLLM reports processed logprobs).
Per component (GDN, attention, router, experts, ...) and router flips: research/mismatch_layers.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LO, HI = 0.999, 1.002  # the reference's seq-mask-tis bounds (qwen35_397b_grpo preset)


def sequences(table) -> list[tuple[list[int], list[int], list[float]]]:
    """(token ids, loss mask, vLLM logprobs) per rollout, as the trajectories table stores them."""
    cols = [table.column(c).to_pylist() for c in ("token_ids", "loss_mask", "generation_logprobs")]
    return list(zip(*cols))


def compare(model, seqs, temperature: float, precision: str) -> dict:
    from tasks.policy.runtime import policy_logprobs

    return stats(seqs, policy_logprobs(model, [s[0] for s in seqs], temperature=temperature, precision=precision))


def stats(seqs, scored, ref=None) -> dict:
    """The mismatch of `scored` (per sequence, the shifted logprobs [L-1]) against vLLM's logprobs,
    or against `ref` (the same shape as `scored`) when given, over the generated tokens."""
    import numpy as np

    diffs, ratios = [], []
    for i, ((_, mask, gen), lp) in enumerate(zip(seqs, scored)):
        m = np.asarray(mask[1:], dtype=bool)  # shifted: position t predicts token t+1
        if not m.any():
            continue
        other = np.asarray(gen[1:], dtype=np.float64) if ref is None else ref[i].numpy().astype(np.float64)
        d = lp.numpy().astype(np.float64)[m] - other[m]
        diffs.append(d)
        ratios.append(float(np.exp(d.mean())))
    d = np.concatenate(diffs)
    r = np.asarray(ratios)
    return {"sequences": len(r), "tokens": int(d.size),
            "token_mult_prob_error": float(np.exp(np.abs(d)).mean()),
            "masked": float(((r < LO) | (r > HI)).mean()),
            "ratio_p5": float(np.percentile(r, 5)), "ratio_p50": float(np.median(r)),
            "ratio_p95": float(np.percentile(r, 95)),
            "abs_diff_mean": float(np.abs(d).mean()), "abs_diff_max": float(np.abs(d).max())}


def step_models(store_root, run_id, steps=None):
    """(step, run config, sequences, fp32 model that sampled them) for each step asked for (default:
    every step whose trajectories are committed): the base for step 1, checkpoint s-1 after."""
    import tempfile

    from flows.prepare import _local_model
    from flows.stages import checkpoint_key
    from schemas.config import RunConfig
    from tasks.policy.model import load_pretrained_policy
    from tasks.storage import Store

    store = Store(store_root)
    manifest = store.read_manifest(run_id)
    cfg = RunConfig.model_validate(manifest.config)
    steps = steps or [s for s in range(1, cfg.max_steps + 1) if store.stage_committed(run_id, s, "trajectories")]
    for step in steps:
        seqs = sequences(store.read_stage(run_id, step, "trajectories"))
        if step == 1:
            local = _local_model(cfg, store, manifest.prepared["base_model"])  # cached by its content key
        else:  # checkpoint names repeat across runs: a fresh copy
            local = store.get_dir(checkpoint_key(run_id, step - 1), Path(tempfile.mkdtemp()) / "ckpt")
        yield step, cfg, seqs, load_pretrained_policy(local)[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("run_id")
    p.add_argument("--steps", type=int, nargs="*")
    p.add_argument("--precision", nargs="*", default=["fp32", "bf16", "fp32-bf16w"],
                   choices=["fp32", "bf16", "fp32-bf16w"])
    p.add_argument("--json", help="write the rows here too")
    a = p.parse_args(argv)

    import copy

    import torch

    rows = []
    for step, cfg, seqs, model in step_models(a.store, a.run_id, a.steps):
        for precision in a.precision:
            scorer = model
            if precision == "fp32-bf16w":
                scorer = copy.deepcopy(model)
                with torch.no_grad():
                    for p_ in scorer.parameters():
                        p_.copy_(p_.bfloat16().float())
            row = {"step": step, "trainer": precision, "sampler": cfg.inference.dtype or "float32",
                   "arch": model.config.model_type,
                   **compare(scorer, seqs, cfg.agent.training.temperature, precision.split("-")[0])}
            rows.append(row)
            print(f"step {step} sampler {row['sampler']:>8} trainer {precision:>10}: {row['sequences']} seqs "
                  f"{row['tokens']} tokens  token_mult_prob_error {row['token_mult_prob_error']:.5f}  "
                  f"masked {row['masked']:.1%}  ratio p5/p50/p95 {row['ratio_p5']:.5f}/{row['ratio_p50']:.5f}/"
                  f"{row['ratio_p95']:.5f}  |d| mean {row['abs_diff_mean']:.2e} max {row['abs_diff_max']:.2e}",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
