"""Shared helpers for the policy tests (no tests here): a tiny random qwen3_moe checkpoint,
a byte-level toy vocabulary and trajectory rows built from real text."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from schemas.config import GRPOConfig, OptimizerConfig, RunConfig
from schemas.recipe import SFTStage, WarmStartRecipe, stages
from schemas.tables import REWARDS, TRAJECTORIES

PAD, BOS, EOS, OFFSET = 0, 1, 2, 4  # ids 0..3 are specials, byte b is id b + 4
VOCAB = 256 + OFFSET


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def tiny_config(**kw):
    from transformers import Qwen3MoeConfig

    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=True,
                pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    args.update(kw)
    return Qwen3MoeConfig(**args)


def make_policy_dir(path: Path, seed: int = 0, **kw) -> Path:
    """A random tiny qwen3_moe checkpoint (+ a stand-in tokenizer file that must travel along)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**kw)).float()
    model.save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteToy", "offset": OFFSET}))
    return path


def run_config(lr: float = 1e-3, grad_clip: float | None = 1.0, micro_batch_tokens: int = 256, **grpo) -> RunConfig:
    return RunConfig(
        grpo=GRPOConfig(prompts_per_step=1, generations_per_prompt=8, **grpo),
        optimizer=OptimizerConfig(lr=lr, grad_clip=grad_clip, micro_batch_tokens=micro_batch_tokens),
    )


def sft_stage(**fields) -> SFTStage:
    """The warm start of a short recipe (lr 3e-3, batches of 8, one minute), with `fields` changed."""
    first = stages(WarmStartRecipe(lr=3e-3, batch_size=8, minutes=1.0))[0]
    return SFTStage.model_validate({**first.model_dump(), **fields})


def episode(prompt: str, completion: str) -> tuple[list[int], list[int]]:
    p, c = [BOS] + encode(prompt), encode(completion) + [EOS]
    return p + c, [0] * len(p) + [1] * len(c)


def trajectory_rows(episodes, group="g0", step=1, logprobs=None, finish="submitted"):
    """TRAJECTORIES rows for (prompt, completion) pairs; generation logprobs from `logprobs`
    (one [L-1] tensor per episode, shifted) or 0."""
    rows = []
    for k, (prompt, completion) in enumerate(episodes):
        tokens, mask = episode(prompt, completion)
        gen = [0.0] * len(tokens)
        if logprobs is not None:
            lp = logprobs[k].tolist()
            gen = [0.0] + [lp[t - 1] if mask[t] else 0.0 for t in range(1, len(tokens))]
        rows.append({
            "rollout_id": f"{group}-s{step}-{k}", "run_id": "test", "step": step, "policy_version": step - 1,
            "instance_id": group, "group_id": group, "sample_index": k, "split": "train",
            "messages": "[]", "token_ids": tokens, "loss_mask": mask, "generation_logprobs": gen,
            "prompt_length": mask.index(1), "num_turns": 1, "num_generated_tokens": sum(mask), "tool_errors": 0,
            "finish_reason": finish, "error": None, "final_patch": "", "generation_seconds": 0.0,
            "sandbox_seconds": 0.0, "total_seconds": 0.0,
        })
    return TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))


def reward_table(traj, rewards):
    rows = [{"rollout_id": rid, "run_id": "test", "step": 1, "instance_id": inst, "reward": float(r),
             "grading_status": "graded", "error": None, "patch_applied": True, "test_statuses": "{}",
             "attempts": 1, "sandbox_start_seconds": 0.0, "test_seconds": 0.0, "total_seconds": 0.0}
            for rid, inst, r in zip(traj.column("rollout_id").to_pylist(), traj.column("instance_id").to_pylist(),
                                    rewards)]
    return REWARDS.validate(REWARDS.from_rows(rows))


def completion_logprob(model, prompt: str, completion: str) -> float:
    """log pi(completion + EOS | prompt) under a plain model."""
    from tasks.policy.runtime import policy_logprobs

    tokens, mask = episode(prompt, completion)
    lp = policy_logprobs(model, [tokens])[0]
    return float(sum(lp[t - 1] for t in range(1, len(tokens)) if mask[t]))


def grpo_step(model_dir, trajectories, advantages, cfg, out_dir, *, optimizer_steps=None, reference_dir=None,
              policy_version=None, keep_optimizer_state=True, precision=None) -> dict:
    """One GRPO update in this process: what the trainer worker serves (a fresh PolicyTrainer each call)."""
    from tasks.policy.grpo import PolicyTrainer

    trainer = PolicyTrainer(model_dir, cfg, reference_dir=reference_dir, keep_optimizer_state=keep_optimizer_state,
                            precision=precision)
    samples, masked = trainer.prepare(trajectories, advantages)
    return trainer.grpo_update(samples, masked, out_dir, optimizer_steps=optimizer_steps,
                               policy_version=policy_version, save_optimizer=keep_optimizer_state)
