"""One GRPO update, top to bottom: a step's rollouts and advantages -> the next checkpoint.

    samples = prepare_samples(trajectories, advantages)        masked rows left out (batch.py)
    split the batch into mini-batches, one AdamW step each (optimizer.train_global_batch_size)
    pi_prev: with one step, the current logprobs detached in the same pass (ratio 1); with
             several, a no-grad pass before the first step; pi_ref likewise for a KL penalty
    for each mini-batch:
        for each micro-batch (tokens packed per rank):
            logp = log softmax(logits / T)[token]              T: the rollouts' sampling temperature
            loss = NeMo-RL's clipped policy-gradient loss      tasks/grpo/loss.py: clipped_pg_loss
            backward
        all-reduce the counts; abort on a non-finite loss or gradient; clip; AdamW step
    save the checkpoint (weights, tokenizer, optimizer.pt) and move on to it

`PolicyTrainer` keeps the policy and its AdamW state in memory between updates (the trainer
worker, worker.py, serves it). A failed update (BadBatchError, UpdateAborted) leaves weights
and optimizer state exactly as they were.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from schemas.config import RunConfig
from tasks.grpo.loss import clipped_pg_loss
from tasks.policy import checkpoint as ckpt
from tasks.policy.batch import Sample, collate, plan_micro_batches, prepare_samples
from tasks.policy.runtime import (MAX_METRICS, MIN_METRICS, OptimizerStep, UpdateAborted, adamw, all_reduce,
                                  load_for_training, forward_logprobs, init_runtime, peak_rss_mib, save, token_logprobs,
                                  vocab_size)


class PolicyTrainer:
    """The policy and its AdamW state on this rank, loaded once, then stepped.
    `model_dir` / `version` name the checkpoint the in-memory weights equal: the parent of the next one."""

    def __init__(self, model_dir: str | os.PathLike, cfg: RunConfig, *,
                 reference_dir: str | os.PathLike | None = None, keep_optimizer_state: bool = True,
                 precision: str | None = None):
        if cfg.grpo.reference_policy_kl_penalty > 0 and reference_dir is None:
            raise ValueError("reference_policy_kl_penalty > 0 needs reference_dir (the reference policy checkpoint)")
        self.cfg = cfg
        self.rt = init_runtime(precision)
        torch.manual_seed(cfg.seed)
        self.model_dir = Path(model_dir)
        self.version = ckpt.read_policy_version(model_dir)
        self.vocab_size = vocab_size(model_dir)
        self.model, self.params = load_for_training(model_dir, self.rt, cfg.optimizer.freeze_router)
        self.optimizer = adamw(self.params, cfg, cfg.effective_lr)
        # "resumed": this optimizer continues earlier steps (from optimizer.pt, or from memory later on).
        self.resumed = keep_optimizer_state and ckpt.load_optimizer_state(self.model, self.optimizer, model_dir)
        for group in self.optimizer.param_groups:  # the saved state carries the old hyperparameters: use today's
            group.update(lr=cfg.effective_lr, betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps,
                         weight_decay=cfg.optimizer.weight_decay)
        self.ref_model = None
        if reference_dir is not None and cfg.grpo.reference_policy_kl_penalty > 0:
            self.ref_model = load_for_training(reference_dir, self.rt)[0].eval()
        self.optimizer_unsaved = False  # the latest checkpoint dir lacks the in-memory AdamW state

    def prepare(self, trajectories, advantages) -> tuple[list[Sample], int]:
        return prepare_samples(trajectories, advantages, self.vocab_size)

    def grpo_update(self, samples: list[Sample], num_masked: int, out_dir: str | os.PathLike, *,
                    optimizer_steps: int | None = None, policy_version: int | None = None,
                    save_optimizer: bool = True, t0: float | None = None) -> dict:
        """One GRPO update on prepared samples (the module docstring); saves `out_dir` and moves on to it.
        save_optimizer=False skips optimizer.pt (most of the save time); save_optimizer_state() writes it later."""
        t0 = time.perf_counter() if t0 is None else t0
        cfg, rt, model, params, optimizer = self.cfg, self.rt, self.model, self.params, self.optimizer
        if optimizer_steps is None:
            gbs = cfg.optimizer.train_global_batch_size
            optimizer_steps = 1 if gbs is None else max(1, math.ceil(len(samples) / gbs))
        torch.manual_seed(cfg.seed)  # every update starts from the same RNG state, whatever came before
        version = self.version + 1 if policy_version is None else policy_version
        temperature = cfg.agent.training.temperature  # the rollouts were sampled from softmax(logits / T)
        t_loaded = time.perf_counter()

        batches = [[samples[i] for i in c] for c in np.array_split(np.arange(len(samples)), optimizer_steps) if len(c)]
        plans = [plan_micro_batches([len(s.tokens) for s in b], rt.world, cfg.optimizer.micro_batch_tokens)
                 for b in batches]
        for batch, plan in zip(batches, plans):  # pi_prev (and pi_ref): the policy before the first step
            if len(batches) > 1:
                forward_logprobs(model, batch, plan, rt, "prev_logprobs", temperature)
            if self.ref_model is not None:
                forward_logprobs(self.ref_model, batch, plan, rt, "ref_logprobs", temperature)
        # With several steps a later one can abort after an earlier one moved the policy: keep a copy
        # to put back (a single step aborts before optimizer.step(), nothing to undo).
        snapshot = _snapshot(params, optimizer) if len(batches) > 1 else None
        steps = []
        try:
            for batch, plan in zip(batches, plans):
                # The loss is normalised by this step's global counts, which every rank computes alike.
                tokens = float(sum(s.token_mask.sum().item() for s in batch))
                seqs = float(len(batch))
                step = OptimizerStep(rt, params)
                for micro in plan:
                    mb = collate(batch, micro[rt.rank], rt.device)
                    curr = token_logprobs(model, mb, rt, temperature)
                    prev = curr.detach() if mb.prev_logprobs is None else mb.prev_logprobs
                    loss, metrics = clipped_pg_loss(curr, prev, mb.gen_logprobs, mb.advantages, mb.token_mask,
                                                    mb.sample_mask, tokens, seqs, cfg.grpo,
                                                    reference_logprobs=mb.ref_logprobs)
                    step.backward(loss, metrics, mb)
                m = step.apply(optimizer, cfg.effective_grad_clip, batch, plan)
                steps.append({**m, "valid_tokens": int(tokens), "num_samples": len(batch)})
        except UpdateAborted:
            if snapshot is not None and steps:
                _restore(params, optimizer, snapshot)
            raise
        del snapshot
        t_updated, updated_unix = time.perf_counter(), time.time()

        save_s = save(model, optimizer if save_optimizer else None, rt, out_dir, self.model_dir, version,
                      {"mode": "grpo", "optimizer_steps": len(steps)})
        resumed = self.resumed
        self.model_dir, self.version = Path(out_dir), version
        self.resumed = self.resumed or bool(steps)
        self.optimizer_unsaved = not save_optimizer
        metrics = _combine_steps(steps)
        metrics.update(
            policy_version=version, world_size=rt.world, precision="bf16" if rt.bf16 else "fp32", optimizer_steps=len(steps), optimizer_resumed=bool(resumed),
            optimizer_saved=save_optimizer, num_samples=len(samples), num_masked_samples=num_masked,
            lr=cfg.effective_lr, grad_clip=cfg.effective_grad_clip, load_seconds=t_loaded - t0,
            update_seconds=t_updated - t_loaded, save_seconds=save_s, seconds=time.perf_counter() - t0,
            tokens_per_second=metrics.get("tokens", 0) / max(t_updated - t_loaded, 1e-9),
            skipped=not steps, peak_rss_mib=all_reduce([peak_rss_mib()], "max")[0],
            weight_update_end_unix=updated_unix,  # MLPerf's offline run_stop: before the checkpoint write
        )
        return metrics

    def save_optimizer_state(self) -> bool:
        """Write the in-memory AdamW state into the latest checkpoint dir if an update skipped it.
        Collective (every rank calls it). True when something was written."""
        if not self.optimizer_unsaved:
            return False
        state = ckpt.full_optimizer_state(self.model, self.optimizer)
        if self.rt.main:
            tmp = self.model_dir / f".{ckpt.OPTIMIZER_FILE}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, self.model_dir / ckpt.OPTIMIZER_FILE)  # a reader sees all of it or none
        if self.rt.world > 1:
            torch.distributed.barrier()
        self.optimizer_unsaved = False
        return True


def _snapshot(params, optimizer) -> tuple[list[torch.Tensor], dict]:
    """A copy of this rank's trainable weights (shards under FSDP2) and AdamW state."""
    with torch.no_grad():
        weights = [p.detach().clone() for p in params]
    state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in optimizer.state.items()}
    return weights, state


def _restore(params, optimizer, snapshot) -> None:
    weights, state = snapshot
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    optimizer.state.clear()
    optimizer.state.update(state)


def _combine_steps(steps: list[dict]) -> dict:
    """Optimizer steps -> one dict: counts add up, extrema combine, the rest is averaged."""
    if not steps:
        return {"tokens": 0, "valid_tokens": 0, "micro_batches": 0}
    out = {}
    for k in steps[0]:
        vals = [s[k] for s in steps]
        if k in ("tokens", "valid_tokens", "micro_batches", "num_valid_samples"):
            out[k] = sum(vals)
        elif k in MIN_METRICS:
            out[k] = min(vals)
        elif k in MAX_METRICS:
            out[k] = max(vals)
        elif k != "num_samples":
            out[k] = sum(vals) / len(vals)
    if len(steps) > 1:
        out["per_step"] = steps
    return out
