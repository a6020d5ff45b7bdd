"""The warm start: supervised fine-tuning on demonstration trajectories (how `make base` builds a base).

One stage of the recipe (schemas/recipe.py: SFTStage) per call:

    samples = the demonstrations' tokens, loss on the generated ones (and on the context at
              stage.context_loss_weight: a tiny model trained from scratch has no pretraining)
    for each step, until stage.max_steps (or the stage.minutes budget):
        lr = stage.lr, or along a cosine to 0 (stage.cosine_cycles restarts)
        batch = the next stage.batch_size samples of a seeded shuffle, epoch after epoch
        loss = token-weighted mean cross-entropy over the batch, micro-batch by micro-batch
        clip (optimizer.grad_clip, else 1.0), AdamW step
        every resume_every_s: save the weights, AdamW and the shuffle beside out_dir (<out_dir>.resume)
    save the checkpoint, drop <out_dir>.resume

A stage is hours on 2 CPU cores (the mini's warm start: 2,880 steps), so a call that finds a resume
state for the same stage, demonstrations and limit carries on from it: same weights, optimizer
moments, shuffle and schedule as if it had not stopped, and a minutes budget counts the time before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import pyarrow as pa
import torch

from schemas.config import RunConfig
from schemas.recipe import SFTStage
from tasks.policy.batch import BadBatchError, Sample, collate, plan_micro_batches, prepare_samples
from tasks.policy import checkpoint as ckpt
from tasks.policy.runtime import (OptimizerStep, adamw, all_reduce, load_for_training, init_runtime, peak_rss_mib, save,
                                  token_logprobs, vocab_size)


def sft_samples(demonstrations: pa.Table | list[dict], model_dir, context_loss_weight: float) -> list[Sample]:
    """The demonstrations as training samples, the tokens the policy did not generate at the given weight."""
    samples, _ = prepare_samples(demonstrations, None, vocab_size(model_dir))
    samples = [s for s in samples if s.token_mask.sum() > 0]
    if not samples:
        raise BadBatchError("no demonstration has loss_mask tokens to learn from")
    w = context_loss_weight
    if w > 0:  # the prompt and tool outputs count too, at weight w (a tiny model has no pretraining)
        samples = [dataclasses.replace(s, token_mask=s.token_mask + w * (1 - s.token_mask)) for s in samples]
    return samples


def sft_lr(base: float, cosine: bool, step: int, max_steps: int | None, elapsed_s: float, minutes: float | None,
           cycles: int = 1) -> float:
    """The SFT learning rate before `step` (0-based): `base`, or with `cosine` a half cosine to 0 over
    the run's progress, the larger of the step and the time fractions (a run ends on either). With
    `cycles` > 1 the cosine restarts from `base` that many times (equal parts of the run), the last
    one still ending at 0."""
    if not cosine:
        return base
    by_time = elapsed_s / (minutes * 60) if minutes else 0.0
    done = min(max(step / max_steps if max_steps else 0.0, by_time), 1.0) * cycles
    part = done - min(math.floor(done), cycles - 1)
    return base * 0.5 * (1 + math.cos(math.pi * part))


def sft_step(model, params, optimizer, batch: list[Sample], plan, rt, clip: float) -> dict:
    """One AdamW step on the batch's token-weighted mean cross-entropy, micro-batch by micro-batch."""
    weight = float(sum(s.token_mask.sum().item() for s in batch))
    step = OptimizerStep(rt, params)
    for micro in plan:
        mb = collate(batch, micro[rt.rank], rt.device)
        curr = token_logprobs(model, mb, rt)
        loss = -(curr * mb.token_mask * mb.sample_mask[:, None]).sum() / (weight + 1e-8)
        step.backward(loss, {"loss": loss.item()}, mb)
    return step.apply(optimizer, clip, batch, plan)


def sft_train(model_dir: str | os.PathLike, demonstrations: pa.Table | list[dict], cfg: RunConfig,
              stage: SFTStage, out_dir: str | os.PathLike, *, max_steps: int | None = None, policy_version: int = 0,
              precision: str | None = None, progress=None, resume_every_s: float = 600.0) -> dict:
    """One warm-start stage (the module docstring) from checkpoint `model_dir` into `out_dir`; returns its
    metrics. cfg gives the optimizer's settings (betas, weight decay, grad clip, ranks), `stage` the rest.
    progress(text), when given, gets a line at the first step and every 100th (rank 0)."""
    t0 = time.perf_counter()
    samples = sft_samples(demonstrations, model_dir, stage.context_loss_weight)
    rt = init_runtime(precision)
    torch.manual_seed(stage.seed)
    limit = max_steps if max_steps is not None else stage.max_steps
    resume_dir = Path(str(out_dir) + ".resume")
    identity = {"stage": stage.model_dump(), "samples": len(samples), "limit": limit, "world": rt.world,
                "parent": str(model_dir)}
    state = _resume_state(resume_dir, identity)
    if all_reduce([float(state is not None)], "min")[0] < 1:  # every rank resumes, or none does
        state = None
    model, params = load_for_training(resume_dir if state else model_dir, rt, cfg.optimizer.freeze_router)
    optimizer = adamw(params, cfg, stage.lr)
    if state and not ckpt.load_optimizer_state(model, optimizer, resume_dir):
        raise RuntimeError(f"{resume_dir}: resume state without {ckpt.OPTIMIZER_FILE}")
    clip = cfg.optimizer.grad_clip if cfg.optimizer.grad_clip is not None else 1.0
    rng = random.Random(stage.seed)
    order: list[int] = []
    losses, tokens, step = [], 0, 0
    if state:  # the clock too: a minutes budget and its cosine go on where they stopped
        step, order, losses, tokens = state["step"], state["order"], state["losses"], state["tokens"]
        rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        t0 -= state["elapsed"]
        if rt.main and progress is not None:
            progress(f"sft resumed at step {step}/{limit or '?'} from {resume_dir}")
    first, tokens_before, t_loaded = step, tokens, time.perf_counter()
    last_saved = all_reduce([t_loaded - t0], "max")[0]
    while limit is None or step < limit:
        # One clock for all ranks (the slowest): every rank must run the same number of steps and,
        # with the cosine decay, apply the same learning rate.
        elapsed = all_reduce([time.perf_counter() - t0], "max")[0]
        if stage.minutes is not None and elapsed >= stage.minutes * 60 and step > 0:
            break
        if elapsed - last_saved >= resume_every_s and step > first:
            _save_resume(model, optimizer, rt, resume_dir, model_dir, identity, {
                "step": step, "order": order, "rng": rng.getstate(), "losses": losses, "tokens": tokens,
                "elapsed": elapsed})
            last_saved = elapsed
        if len(order) < stage.batch_size:
            epoch = list(range(len(samples)))
            rng.shuffle(epoch)
            order += epoch
        for group in optimizer.param_groups:
            group["lr"] = sft_lr(stage.lr, stage.cosine_decay, step, limit, elapsed, stage.minutes,
                                 stage.cosine_cycles)
        batch = [samples[i] for i in order[:stage.batch_size]]
        order = order[stage.batch_size:]
        plan = plan_micro_batches([len(s.tokens) for s in batch], rt.world,
                                  stage.micro_batch_tokens or cfg.optimizer.micro_batch_tokens)
        m = sft_step(model, params, optimizer, batch, plan, rt, clip)
        losses.append(m["loss"])
        tokens += m["tokens"]
        step += 1
        if rt.main and progress is not None and (step == 1 or step % 100 == 0):
            took = time.perf_counter() - t_loaded
            left = f", about {took / (step - first) * (limit - step) / 60:.0f} min left" if limit else ""
            progress(f"sft step {step}/{limit or '?'}: loss {m['loss']:.4f} lr {optimizer.param_groups[0]['lr']:.2e}"
                     f" ({took / 60:.1f} min{left})")
    t_trained = time.perf_counter()
    save_s = save(model, None, rt, out_dir, model_dir, policy_version, {"mode": "sft", "steps": step})
    if rt.main:
        shutil.rmtree(resume_dir, ignore_errors=True)
    tail = losses[-10:]
    return {
        "steps": step, "loss_first": losses[0], "loss_last": losses[-1], "loss_last10": sum(tail) / len(tail),
        "losses": losses, "tokens": tokens, "train_seconds": t_trained - t_loaded, "save_seconds": save_s,
        "seconds": time.perf_counter() - t0,
        "tokens_per_second": (tokens - tokens_before) / max(t_trained - t_loaded, 1e-9),
        "policy_version": policy_version, "world_size": rt.world, "lr": stage.lr,
        "peak_rss_mib": all_reduce([peak_rss_mib()], "max")[0], "resumed_at_step": first,
    }


def _resume_state(resume_dir: Path, identity: dict) -> dict | None:
    """The saved loop state when resume_dir holds one for this same stage (else None: start over)."""
    try:
        info = json.loads((resume_dir / ckpt.VERSION_FILE).read_text())
    except (OSError, ValueError):
        return None
    if info.get("mode") != "sft-resume" or info.get("identity") != identity:
        return None
    return info["loop"]


def _save_resume(model, optimizer, rt, resume_dir: Path, model_dir, identity: dict, loop: dict) -> None:
    """Weights and AdamW (collective, written atomically by rank 0) with the loop's own state."""
    save(model, optimizer, rt, resume_dir, model_dir, 0, {"mode": "sft-resume", "identity": identity, "loop": loop})
