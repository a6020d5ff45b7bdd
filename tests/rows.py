"""Valid example rows for every table, for tests and benchmarks to mutate."""

import json
import random


def trajectory_row(i: int, run_id: str = "run-test", step: int = 1, turns: int = 2, prompt_len: int = 20,
                   completion_len: int = 5, observation_len: int = 8, rng: random.Random | None = None) -> dict:
    rng = rng or random.Random(i)
    tokens = [rng.randrange(4096) for _ in range(prompt_len)]
    mask, logprobs = [0] * prompt_len, [0.0] * prompt_len
    for t in range(turns):
        tokens += [rng.randrange(4096) for _ in range(completion_len)]
        mask += [1] * completion_len
        logprobs += [-rng.random() * 3 for _ in range(completion_len)]
        if t < turns - 1:
            tokens += [rng.randrange(4096) for _ in range(observation_len)]
            mask += [0] * observation_len
            logprobs += [0.0] * observation_len
    return dict(
        rollout_id=f"{run_id}/s{step}/task-{i // 4}/{i % 4}", run_id=run_id, step=step, policy_version=step - 1,
        instance_id=f"task-{i // 4}", group_id=f"s{step}/task-{i // 4}", sample_index=i % 4, split="train",
        messages=json.dumps([{"role": "user", "content": "fix the bug"}]), token_ids=tokens, loss_mask=mask,
        generation_logprobs=logprobs, prompt_length=prompt_len, num_turns=turns,
        num_generated_tokens=turns * completion_len, tool_errors=0, finish_reason="submitted", error=None,
        final_patch="diff --git a/x.py b/x.py\n", generation_seconds=1.0, sandbox_seconds=0.5, total_seconds=1.6,
    )


def task_row(i: int, split: str = "train") -> dict:
    return dict(
        instance_id=f"task-{i}", split=split, repo_name="minipkg", docker_image="rlvr-sandbox:bookworm",
        commit_hash=f"{i:040x}", problem_statement="Calling f(2) returns 3 but should return 4.",
        parsed_commit_content=json.dumps({"file_diffs": []}),
        expected_output_json=json.dumps({"test_f": "PASSED"}), modified_files=["pkg/f.py"],
        relevant_files=["pkg/f.py"], prompt=None, environment_uri=None, bug_family="off_by_one",
    )


def reward_row(i: int, reward: float | None = 1.0, status: str = "graded") -> dict:
    return dict(
        rollout_id=f"r{i}", run_id="run-test", step=1, instance_id=f"task-{i // 4}", reward=reward,
        grading_status=status, error=None if status == "graded" else "sandbox failed to start",
        patch_applied=True, test_statuses=json.dumps({"test_f": "PASSED"}), attempts=1,
        sandbox_start_seconds=0.05, test_seconds=0.2, total_seconds=0.3,
    )


def advantage_row(i: int) -> dict:
    return dict(rollout_id=f"r{i}", run_id="run-test", step=1, group_id="g0", instance_id="task-0", reward=1.0,
                baseline=0.5, group_std=0.5, advantage=0.99, group_size=4, group_valid=4, masked=False,
                mask_reason=None)


def eval_sample_row(i: int) -> dict:
    return dict(rollout_id=f"e{i}", run_id="run-test", step=3, policy_version=3, instance_id=f"task-{i // 4}",
                sample_index=i % 4, reward=0.0, masked=False, mask_reason=None, finish_reason="submitted")


def eval_summary_row(step: int) -> dict:
    return dict(run_id="run-test", step=step, policy_version=step, k=4, pass_at_k=0.7, pass_at_1=0.4,
                pass_hat_k=0.2, num_tasks=251, num_samples=1004, num_masked=0, samples_count=4096,
                eval_seconds=12.0)
