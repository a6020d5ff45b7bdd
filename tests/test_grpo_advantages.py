"""Table-level GRPO advantages: masking, zero-variance groups, join errors, and the table against the
module docstring's formulas written out one sample at a time (property-based)."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.config import GRPOConfig
from schemas.tables import ADVANTAGES, REWARDS, TRAJECTORIES
from tasks.grpo.advantages import (
    MASK_GRADING_ENV_ERROR,
    MASK_GRADING_INFRA_ERROR,
    MASK_STALE,
    MASK_ZERO_VARIANCE,
    MASKED_FINISH_REASONS,
    JoinError,
    compute_advantages,
    grpo_advantages,
    summarize_advantages,
)


def traj_row(rid, group, finish="submitted", version=2):
    return {
        "rollout_id": rid, "run_id": "run", "step": 3, "policy_version": version, "instance_id": f"task-{group}",
        "group_id": group, "sample_index": 0, "split": "train", "messages": "[]",
        "token_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "generation_logprobs": [0.0, 0.0, -0.5, -0.1],
        "prompt_length": 2, "num_turns": 1, "num_generated_tokens": 2, "tool_errors": 0,
        "finish_reason": finish, "error": None, "final_patch": "", "generation_seconds": 0.1,
        "sandbox_seconds": 0.1, "total_seconds": 0.2,
    }


def reward_row(rid, group, reward):
    graded = reward is not None
    return {
        "rollout_id": rid, "run_id": "run", "step": 3, "instance_id": f"task-{group}",
        "reward": reward, "grading_status": "graded" if graded else "infra_error",
        "error": None if graded else "sandbox died", "patch_applied": True, "test_statuses": "{}",
        "attempts": 1, "sandbox_start_seconds": 0.1, "test_seconds": 0.1, "total_seconds": 0.2,
    }


def tables(spec):
    """spec: list of (rollout_id, group, reward, finish_reason)."""
    t = TRAJECTORIES.validate(TRAJECTORIES.from_rows([traj_row(r, g, f) for r, g, _, f in spec]))
    w = REWARDS.validate(REWARDS.from_rows([reward_row(r, g, x) for r, g, x, _ in spec]))
    return t, w


def by_id(table):
    return {r["rollout_id"]: r for r in table.to_pylist()}


def test_plain_groups_match_tensor_estimator():
    spec = [(f"a{i}", "A", x, "submitted") for i, x in enumerate([1.0, 0.0, 0.0, 1.0, 1.0])]
    spec += [(f"b{i}", "B", x, "submitted") for i, x in enumerate([0.0, 0.0, 0.0, 1.0])]
    out = compute_advantages(*tables(spec), GRPOConfig())
    ADVANTAGES.validate(out)
    rewards = torch.tensor([s[2] for s in spec], dtype=torch.float64)
    want, baseline, _ = grpo_advantages(rewards, [s[1] for s in spec])
    got = out.column("advantage").to_pylist()
    assert got == pytest.approx(want.tolist(), rel=1e-12)
    assert out.column("baseline").to_pylist() == pytest.approx(baseline.tolist())
    assert not any(out.column("masked").to_pylist())
    # The single success in B: its peers all failed, LOO std is 0, so A = r - b = 1 (NeMo-RL quirk).
    assert by_id(out)["b3"]["advantage"] == pytest.approx(1.0)


def test_all_equal_group_gets_zero_and_is_reported():
    spec = [(f"a{i}", "A", 1.0, "submitted") for i in range(4)]
    spec += [(f"b{i}", "B", x, "submitted") for i, x in enumerate([0.0, 1.0, 0.0, 1.0])]
    out = compute_advantages(*tables(spec), GRPOConfig())
    rows = by_id(out)
    assert all(rows[f"a{i}"]["advantage"] == 0.0 and not rows[f"a{i}"]["masked"] for i in range(4))
    assert all(rows[f"b{i}"]["advantage"] != 0.0 for i in range(4))
    s = summarize_advantages(out)
    assert s["zero_variance_groups"] == ["A"] and s["num_zero_variance_groups"] == 1 and s["num_masked"] == 0


def test_filter_zero_variance_groups_masks_them():
    spec = [(f"a{i}", "A", 0.0, "submitted") for i in range(3)]
    spec += [(f"b{i}", "B", x, "submitted") for i, x in enumerate([0.0, 1.0, 1.0])]
    out = compute_advantages(*tables(spec), GRPOConfig(filter_zero_variance_groups=True))
    rows = by_id(out)
    assert all(rows[f"a{i}"]["masked"] and rows[f"a{i}"]["mask_reason"] == MASK_ZERO_VARIANCE for i in range(3))
    assert not any(rows[f"b{i}"]["masked"] for i in range(3))
    s = summarize_advantages(out)
    assert s["masked_by_reason"] == {MASK_ZERO_VARIANCE: 3} and s["zero_variance_groups"] == ["A"]


def test_masked_samples_leave_statistics_and_loss():
    rewards = [1.0, 0.0, 1.0, None, 0.0, 1.0]
    finishes = ["submitted", "submitted", "timeout", "submitted", "context_limit", "infra_error"]
    spec = [(f"a{i}", "A", x, f) for i, (x, f) in enumerate(zip(rewards, finishes))]
    out = compute_advantages(*tables(spec), GRPOConfig())
    rows = by_id(out)
    assert rows["a2"]["mask_reason"] == MASKED_FINISH_REASONS["timeout"]
    assert rows["a3"]["mask_reason"] == MASK_GRADING_INFRA_ERROR and rows["a3"]["reward"] is None
    assert rows["a4"]["mask_reason"] == "context_limit"
    assert rows["a5"]["mask_reason"] == "rollout_infra_error"
    for i in (2, 3, 4, 5):
        assert rows[f"a{i}"]["masked"] and rows[f"a{i}"]["advantage"] == 0.0
    # Only a0 (1.0) and a1 (0.0) are valid: the same as a group of those two alone.
    want, _, _ = grpo_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), [0, 0])
    assert [rows["a0"]["advantage"], rows["a1"]["advantage"]] == pytest.approx(want.tolist())
    assert rows["a0"]["group_size"] == 6 and rows["a0"]["group_valid"] == 2
    # Masked rows report the plain mean of the valid rewards.
    assert rows["a2"]["baseline"] == pytest.approx(0.5)
    s = summarize_advantages(out)
    assert s["num_masked"] == 4
    assert s["masked_by_reason"] == {"context_limit": 1, MASK_GRADING_INFRA_ERROR: 1, "rollout_infra_error": 1,
                                     "timeout": 1}


def test_trajectories_older_than_max_trajectory_age_are_masked():
    # Updating policy v3 with max_trajectory_age 1: v2 samples train, a v1 sample is stale.
    rows = [traj_row(f"a{i}", "A", version=v) for i, v in enumerate([2, 2, 1, 3])]
    t = TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))
    w = REWARDS.validate(REWARDS.from_rows([reward_row(f"a{i}", "A", x) for i, x in enumerate([1.0, 0.0, 1.0, 0.0])]))
    out = by_id(compute_advantages(t, w, GRPOConfig(max_trajectory_age=1), policy_version=3))
    assert out["a2"]["masked"] and out["a2"]["mask_reason"] == MASK_STALE and out["a2"]["advantage"] == 0.0
    assert not any(out[k]["masked"] for k in ("a0", "a1", "a3"))
    assert out["a0"]["group_valid"] == 3
    # Without the version (tables read back for inspection) nothing is judged stale.
    assert not any(r["masked"] for r in compute_advantages(t, w, GRPOConfig(max_trajectory_age=1)).to_pylist())


def test_single_valid_sample_gets_zero():
    spec = [("a0", "A", 1.0, "submitted"), ("a1", "A", 0.0, "timeout"), ("a2", "A", None, "submitted")]
    out = compute_advantages(*tables(spec), GRPOConfig())
    rows = by_id(out)
    assert rows["a0"]["advantage"] == 0.0 and not rows["a0"]["masked"]
    assert rows["a0"]["baseline"] == 1.0 and rows["a0"]["group_std"] == 0.0
    assert summarize_advantages(out)["zero_variance_groups"] == ["A"]


def test_group_with_no_valid_sample():
    spec = [("a0", "A", None, "submitted"), ("a1", "A", 0.0, "timeout")]
    out = compute_advantages(*tables(spec), GRPOConfig())
    assert all(out.column("masked").to_pylist())
    assert out.column("advantage").to_pylist() == [0.0, 0.0]


@pytest.mark.parametrize("leave_one_out,normalize", [(True, True), (False, True), (True, False), (False, False)])
def test_options_pass_through(leave_one_out, normalize):
    spec = [(f"a{i}", "A", x, "submitted") for i, x in enumerate([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])]
    cfg = GRPOConfig(leave_one_out_baseline=leave_one_out, normalize_rewards=normalize)
    out = compute_advantages(*tables(spec), cfg)
    want, _, _ = grpo_advantages(torch.tensor([s[2] for s in spec], dtype=torch.float64), ["A"] * 6,
                                 leave_one_out=leave_one_out, normalize=normalize)
    assert out.column("advantage").to_pylist() == pytest.approx(want.tolist())


def test_join_errors_name_rollout_ids():
    spec = [("a0", "A", 1.0, "submitted"), ("a1", "A", 0.0, "submitted"), ("a2", "A", 0.0, "submitted")]
    t, w = tables(spec)
    with pytest.raises(JoinError, match=r"a2"):
        compute_advantages(t, w.slice(0, 2), GRPOConfig())
    extra = REWARDS.from_rows([reward_row(r, "A", 1.0) for r in ("a0", "a1", "a2", "zz9")])
    with pytest.raises(JoinError, match=r"zz9"):
        compute_advantages(t, extra, GRPOConfig())
    dup = REWARDS.from_rows([reward_row(r, "A", 1.0) for r in ("a0", "a1", "a2", "a1")])
    with pytest.raises(JoinError, match=r"repeat in rewards \(a1\)"):
        compute_advantages(t, dup, GRPOConfig())
    wrong_task = REWARDS.from_rows([reward_row("a0", "B", 1.0)] + [reward_row(r, "A", 1.0) for r in ("a1", "a2")])
    with pytest.raises(JoinError, match=r"instance_id.*a0"):
        compute_advantages(t, wrong_task, GRPOConfig())


def reference_table(samples, cfg, policy_version):
    """The module docstring's formulas and compute_advantages' masking rules, one sample at a time in
    plain floats: rollout id -> (advantage, baseline, group_std, mask_reason, group_valid)."""
    def reason(s):
        if s["finish"] in MASKED_FINISH_REASONS:
            return MASKED_FINISH_REASONS[s["finish"]]
        if policy_version is not None and s["version"] < policy_version - cfg.max_trajectory_age:
            return MASK_STALE
        if s["status"] == "env_error":
            return MASK_GRADING_ENV_ERROR
        return MASK_GRADING_INFRA_ERROR if s["status"] != "graded" or s["reward"] is None else None

    out = {}
    for g in {s["group"] for s in samples}:
        members = [s for s in samples if s["group"] == g]
        kept = {s["id"]: s["reward"] for s in members if reason(s) is None}
        zero_variance = len(set(kept.values())) <= 1
        mean = sum(kept.values()) / len(kept) if kept else 0.0
        spread = math.sqrt(sum((x - mean) ** 2 for x in kept.values()) / (len(kept) - 1)) if len(kept) > 1 else 0.0
        for s in members:
            why = reason(s)
            if why is not None:
                out[s["id"]] = (0.0, mean, spread, why, len(kept))
                continue
            peers = [x for i, x in kept.items() if not (cfg.leave_one_out_baseline and i == s["id"])]
            n = len(peers)
            if len(kept) <= 1:
                b, std = s["reward"], 0.0
            else:
                b = sum(peers) / n
                var = (sum(x * x for x in peers) / n - b * b) * n / (n - 1) if n > 1 else 0.0
                std = math.sqrt(max(var, 0.0))
            adv = s["reward"] - b
            if cfg.normalize_rewards and std > 0:
                adv /= std + 1e-6
            zv_masked = zero_variance and cfg.filter_zero_variance_groups
            out[s["id"]] = (0.0 if zero_variance else adv, b, std, MASK_ZERO_VARIANCE if zv_masked else None,
                            len(kept))
    return out


SAMPLE = st.fixed_dictionaries({
    "reward": st.sampled_from([0.0, 1.0, None]),
    "finish": st.sampled_from(["submitted"] * 4 + sorted(MASKED_FINISH_REASONS) + ["max_turns", "patch_too_large"]),
    "status": st.sampled_from(["graded"] * 6 + ["env_error", "infra_error"]),
    "version": st.sampled_from([1, 2, 3]),
})


@settings(max_examples=150, deadline=None)
@given(groups=st.lists(st.lists(SAMPLE, min_size=1, max_size=9), min_size=1, max_size=5),
       leave_one_out=st.booleans(), normalize=st.booleans(), filter_zero_variance=st.booleans(),
       policy_version=st.sampled_from([None, 3]), max_age=st.sampled_from([0, 1]), seed=st.integers(0, 2**16))
def test_table_matches_reference_formulas(groups, leave_one_out, normalize, filter_zero_variance, policy_version,
                                          max_age, seed):
    samples = [dict(s, id=f"g{g}-{j}", group=f"G{g}", reward=None if s["status"] == "infra_error" else s["reward"])
               for g, members in enumerate(groups) for j, s in enumerate(members)]
    random.Random(seed).shuffle(samples)  # groups interleaved, as a step's rows may be
    traj, rew = [], []
    for s in samples:
        traj.append(traj_row(s["id"], s["group"], s["finish"], version=s["version"]))
        rew.append(dict(reward_row(s["id"], s["group"], s["reward"]), grading_status=s["status"],
                        error=None if s["status"] == "graded" else s["status"]))
    cfg = GRPOConfig(leave_one_out_baseline=leave_one_out, normalize_rewards=normalize,
                     filter_zero_variance_groups=filter_zero_variance, max_trajectory_age=max_age)
    out = compute_advantages(TRAJECTORIES.from_rows(traj), REWARDS.from_rows(rew), cfg, policy_version=policy_version)
    assert out.column("rollout_id").to_pylist() == [s["id"] for s in samples]
    want = reference_table(samples, cfg, policy_version)
    for row in out.to_pylist():
        adv, b, std, why, n_valid = want[row["rollout_id"]]
        got = (row["advantage"], row["baseline"], row["group_std"])
        assert got == pytest.approx((adv, b, std), rel=1e-6, abs=1e-12), row
        assert (row["mask_reason"], row["masked"], row["group_valid"]) == (why, why is not None, n_valid), row
