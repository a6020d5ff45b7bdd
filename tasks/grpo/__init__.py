"""GRPO: group-relative advantages and NeMo-RL's clipped policy-gradient loss."""

from tasks.grpo.advantages import (
    MASKED_FINISH_REASONS,
    baseline_and_std,
    compute_advantages,
    grpo_advantages,
    summarize_advantages,
)
from tasks.grpo.loss import clipped_pg_loss, masked_mean

__all__ = [
    "MASKED_FINISH_REASONS",
    "baseline_and_std",
    "clipped_pg_loss",
    "compute_advantages",
    "grpo_advantages",
    "masked_mean",
    "summarize_advantages",
]
