"""Grading: R2E-Gym's reward for a rollout's final patch, run in a fresh sandbox.

    grade_patch(task_row, patch, cfg: SandboxConfig, store) -> GradeResult
    grade_rollouts([(rollout_id, run_id, step, task_row, patch), ...], cfg, store) -> pa.Table  (REWARDS)

See grader.py for the steps and outcomes, r2e.py for the exact reward semantics.
"""

from tasks.grading.grader import GradeResult, grade_patch, grade_rollouts, harness_reason, patch_paths
from tasks.grading.r2e import clean_test_output, decolor_keys, parse_log_pytest, r2e_reward

__all__ = ["GradeResult", "grade_patch", "grade_rollouts", "harness_reason", "patch_paths", "parse_log_pytest",
           "decolor_keys", "r2e_reward", "clean_test_output"]
