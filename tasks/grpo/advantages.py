"""GRPO advantages: each sample's reward against the other samples of its problem group.

For a group (G samples of one task at one step) with rewards r_j over the set S_i
that sample i is compared with (the whole group, or the group without i when
leave-one-out is on), n = |S_i|:

    b_i   = sum_{j in S_i} r_j / n
    std_i = sqrt((sum_{j in S_i} r_j^2 / n - b_i^2) * n / (n - 1))
    A_i   = (r_i - b_i) / (std_i + 1e-6)   if std_i > 0   (normalize on)
    A_i   =  r_i - b_i                     otherwise

These are NeMo-RL's GRPO estimator semantics (`calculate_baseline_and_std_per_prompt`),
quirks included: n/(n-1) is computed from a float32 count, a group with at most one
valid sample gets b = r and std = 0, and a sample whose leave-one-out peers all agree
keeps its unnormalised r - b (e.g. the single success in a group of failures gets 1.0).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Hashable, Sequence

import pyarrow as pa
import torch

from schemas.config import GRPOConfig
from schemas.tables import ADVANTAGES

log = logging.getLogger(__name__)

# finish_reason -> mask reason. These rollouts were cut off or broken by infrastructure:
# their reward says nothing about the policy, so they are invalid samples (MLPerf:
# "rollouts truncated by timeouts are invalid samples (masked, not zero reward)").
MASKED_FINISH_REASONS: dict[str, str] = {
    "infra_error": "rollout_infra_error",
    "timeout": "timeout",
    "context_limit": "context_limit",
}
MASK_GRADING_INFRA_ERROR = "grading_infra_error"
MASK_GRADING_ENV_ERROR = "grading_env_error"  # the task's environment could not run its tests
MASK_ZERO_VARIANCE = "zero_variance_group"
STD_EPS = 1e-6


class JoinError(ValueError):
    """Two tables that must match one row to one row (by rollout_id) do not."""


def _groups(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    return members


def baseline_and_std(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std over each sample's group (samples with valid_mask 0 are left out)."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    valid = torch.ones_like(rewards) if valid_mask is None else valid_mask.to(rewards.dtype)
    baseline = torch.zeros_like(rewards)
    std = torch.zeros_like(rewards)
    for members in _groups(group_ids).values():
        idx = torch.tensor(members)
        r, v = rewards[idx], valid[idx]
        if v.sum() <= 1:
            baseline[idx] = r  # nothing to compare with: advantage 0
            continue
        # Row i of `peers` selects the set S_i sample i is compared with.
        peers = torch.ones(len(members), len(members), dtype=rewards.dtype)
        if leave_one_out:
            peers -= torch.eye(len(members), dtype=rewards.dtype)
        # float32 count on purpose: NeMo-RL's n/(n-1) carries float32 rounding.
        n = v.float().sum() - int(leave_one_out)
        b = peers @ (r * v) / n
        mean_sq = peers @ (r.pow(2) * v) / n
        baseline[idx] = b
        # n = 1 (LOO over two samples) gives 0 * inf = nan, and equal rewards can round
        # to a tiny negative variance: both mean "no spread", std 0.
        std[idx] = ((mean_sq - b.square()) * (n / (n - 1))).sqrt().nan_to_num(0)
    return baseline, std


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    valid_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample GRPO advantages [B]; returns (advantages, baseline, std).

    valid_mask=None is NeMo-RL's estimator (every sample counts); broadcast the result
    over a sequence's tokens yourself.
    """
    baseline, std = baseline_and_std(rewards, group_ids, valid_mask, leave_one_out)
    adv = rewards - baseline
    if normalize:
        # Groups without spread are not sharpened: dividing by ~0 would blow them up.
        spread = std > 0
        adv = torch.where(spread, adv / (std + STD_EPS), adv)
    return adv, baseline, std


def check_one_to_one(left_ids: Sequence[str], right_ids: Sequence[str], left: str, right: str,
                     show: int = 5) -> None:
    """Raise JoinError naming rollout ids unless both id lists hold the same ids, each once."""
    problems = []
    for name, ids in ((left, left_ids), (right, right_ids)):
        dups = sorted(i for i, c in Counter(ids).items() if c > 1)
        if dups:
            problems.append(f"{len(dups)} rollout ids repeat in {name} ({', '.join(map(str, dups[:show]))})")
    only_left = sorted(set(left_ids) - set(right_ids))
    only_right = sorted(set(right_ids) - set(left_ids))
    if only_left:
        problems.append(f"{len(only_left)} {left} rows have no {right} row "
                        f"(rollout ids {', '.join(only_left[:show])}{', ...' if len(only_left) > show else ''})")
    if only_right:
        problems.append(f"{len(only_right)} {right} rows have no {left} row "
                        f"(rollout ids {', '.join(only_right[:show])}{', ...' if len(only_right) > show else ''})")
    if problems:
        raise JoinError(f"{left} and {right} do not join one to one on rollout_id: " + "; ".join(problems))


def compute_advantages(trajectories: pa.Table, rewards: pa.Table, cfg: GRPOConfig) -> pa.Table:
    """ADVANTAGES table, one row per trajectory (same order).

    Masked samples (finish reason in MASKED_FINISH_REASONS, grading infra or env error) are left
    out of their group's statistics and get advantage 0. Zero-variance groups (all valid
    rewards equal) get advantage 0; with cfg.filter_zero_variance_groups they are also
    masked. `summarize_advantages` counts both.
    """
    traj = trajectories.select(["rollout_id", "run_id", "step", "group_id", "instance_id", "finish_reason"]).to_pylist()
    rew = rewards.select(["rollout_id", "instance_id", "reward", "grading_status"]).to_pylist()
    check_one_to_one([t["rollout_id"] for t in traj], [r["rollout_id"] for r in rew], "trajectories", "rewards")
    by_id = {r["rollout_id"]: r for r in rew}
    wrong = [t["rollout_id"] for t in traj if by_id[t["rollout_id"]]["instance_id"] != t["instance_id"]]
    if wrong:
        raise JoinError(f"rewards and trajectories disagree on instance_id for rollout ids {', '.join(wrong[:5])}")

    reasons: list[str | None] = []
    values: list[float | None] = []
    for t in traj:
        r = by_id[t["rollout_id"]]
        values.append(r["reward"])
        if t["finish_reason"] in MASKED_FINISH_REASONS:
            reasons.append(MASKED_FINISH_REASONS[t["finish_reason"]])
        elif r["grading_status"] == "env_error":
            reasons.append(MASK_GRADING_ENV_ERROR)
        elif r["grading_status"] != "graded" or r["reward"] is None:
            reasons.append(MASK_GRADING_INFRA_ERROR)
        else:
            reasons.append(None)

    group_ids = [t["group_id"] for t in traj]
    valid = torch.tensor([m is None for m in reasons], dtype=torch.float64)
    # Masked rewards may be null; 0 is a placeholder the valid mask removes from every sum.
    r = torch.tensor([0.0 if v is None or m is not None else v for v, m in zip(values, reasons)], dtype=torch.float64)
    adv, baseline, std = grpo_advantages(r, group_ids, leave_one_out=cfg.leave_one_out_baseline,
                                         normalize=cfg.normalize_rewards, valid_mask=valid)
    members = _groups(group_ids)
    rows = [None] * len(traj)
    for g, idx in members.items():
        valid_rewards = [r[i].item() for i in idx if reasons[i] is None]
        zero_variance = len(set(valid_rewards)) <= 1
        n_valid = len(valid_rewards)
        # Masked rows report the group's plain mean and std, for people reading the table.
        mean = sum(valid_rewards) / n_valid if n_valid else 0.0
        spread = (sum((v - mean) ** 2 for v in valid_rewards) / (n_valid - 1)) ** 0.5 if n_valid > 1 else 0.0
        for i in idx:
            t, masked = traj[i], reasons[i] is not None
            reason = reasons[i]
            if zero_variance and not masked and cfg.filter_zero_variance_groups:
                masked, reason = True, MASK_ZERO_VARIANCE
            a = 0.0 if masked or zero_variance else adv[i].item()
            b, s = (mean, spread) if reasons[i] is not None else (baseline[i].item(), std[i].item())
            rows[i] = {
                "rollout_id": t["rollout_id"], "run_id": t["run_id"], "step": t["step"],
                "group_id": g, "instance_id": t["instance_id"], "reward": values[i],
                "baseline": b, "group_std": s, "advantage": a,
                "group_size": len(idx), "group_valid": n_valid,
                "masked": masked, "mask_reason": reason,
            }
    table = ADVANTAGES.validate(ADVANTAGES.from_rows(rows))
    log.info("advantages: %s", summarize_advantages(table))
    return table


def summarize_advantages(table: pa.Table) -> dict:
    """Counts a step's log wants: masked samples by reason, zero-variance groups."""
    rows = table.select(["group_id", "reward", "advantage", "masked", "mask_reason"]).to_pylist()
    by_reason = Counter(r["mask_reason"] for r in rows if r["masked"])
    groups: dict[str, set] = {}
    for r in rows:
        groups.setdefault(r["group_id"], set())
        # Rows masked only by the zero-variance filter still belong to the group's statistics.
        if not r["masked"] or r["mask_reason"] == MASK_ZERO_VARIANCE:
            groups[r["group_id"]].add(r["reward"])
    zero_var = sorted(g for g, vals in groups.items() if len(vals) <= 1)
    used = [r for r in rows if not r["masked"]]
    return {
        "num_rollouts": len(rows),
        "num_masked": sum(by_reason.values()),
        "masked_by_reason": dict(sorted(by_reason.items())),
        "num_groups": len(groups),
        "num_zero_variance_groups": len(zero_var),
        "zero_variance_groups": zero_var,
        "mean_reward": sum(r["reward"] for r in used) / len(used) if used else None,
        "mean_abs_advantage": sum(abs(r["advantage"]) for r in used) / len(used) if used else None,
    }
