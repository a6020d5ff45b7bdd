"""Every table contract accepts valid rows and rejects each kind of violation with a precise message."""

import copy

import pyarrow as pa
import pytest

from schemas.tables import (ADVANTAGES, EVAL_SAMPLES, EVAL_SUMMARY, REWARDS, TASKS, TRAJECTORIES,
                            TableValidationError)
from tests import rows as R

VALID = {
    "tasks": (TASKS, [R.task_row(i) for i in range(3)]),
    "trajectories": (TRAJECTORIES, [R.trajectory_row(i) for i in range(3)]),
    "rewards": (REWARDS, [R.reward_row(0), R.reward_row(1, 0.0), R.reward_row(2, None, "infra_error")]),
    "advantages": (ADVANTAGES, [dict(R.advantage_row(i), rollout_id=f"r{i}") for i in range(3)]),
    "eval_samples": (EVAL_SAMPLES, [R.eval_sample_row(i) for i in range(3)]),
    "eval_summary": (EVAL_SUMMARY, [R.eval_summary_row(s) for s in (1, 2, 3)]),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_table_passes(name):
    schema, rows = VALID[name]
    table = schema.from_rows(rows)
    assert schema.validate(table) is table


# (table, row index to break, mutation, expected column, expected rule)
VIOLATIONS = [
    ("tasks", 1, {"split": "test"}, "split", "split_known"),
    ("tasks", 2, {"expected_output_json": "{not json"}, "expected_output_json", "expected_output_is_json_object"),
    ("tasks", 1, {"instance_id": "task-0"}, "instance_id", "unique"),
    ("tasks", 1, {"problem_statement": ""}, "problem_statement", "problem_statement_nonempty"),
    ("tasks", 2, {"repo_name": None}, "repo_name", "not_null"),
    ("trajectories", 1, {"loss_mask": [1, 1]}, "loss_mask", "token_columns_aligned"),
    ("trajectories", 2, {"finish_reason": "crashed"}, "finish_reason", "finish_reason_known"),
    ("trajectories", 1, {"num_generated_tokens": 999}, "num_generated_tokens", "generated_count_matches_mask"),
    ("trajectories", 1, {"rollout_id": "run-test/s1/task-0/0"}, "rollout_id", "unique"),
    ("rewards", 1, {"reward": 0.5}, "reward", "reward_binary"),
    ("rewards", 2, {"grading_status": "graded"}, "reward", "reward_iff_graded"),
    ("rewards", 0, {"test_statuses": "[]"}, "test_statuses", "test_statuses_json"),
    ("rewards", 1, {"attempts": -1}, "attempts", "nonnegative"),
    ("rewards", 2, {"test_seconds": -0.5}, "test_seconds", "nonnegative"),
    ("rewards", 0, {"sandbox_start_seconds": float("nan")}, "sandbox_start_seconds", "nonnegative"),
    ("trajectories", 2, {"num_turns": -1}, "num_turns", "nonnegative"),
    ("trajectories", 1, {"prompt_length": -3}, "prompt_length", "nonnegative"),
    ("trajectories", 0, {"generation_seconds": -1.0}, "generation_seconds", "nonnegative"),
    ("trajectories", 2, {"tool_errors": -2}, "tool_errors", "nonnegative"),
    ("advantages", 1, {"advantage": float("inf")}, "advantage", "advantage_finite"),
    ("advantages", 2, {"masked": True}, "mask_reason", "masked_has_reason"),
    ("eval_samples", 1, {"reward": None}, "reward", "reward_unless_masked"),
    ("eval_summary", 1, {"pass_at_k": 1.5}, "pass_at_k", "pass_at_k_in_unit"),
]


@pytest.mark.parametrize("name,index,change,column,rule", VIOLATIONS, ids=[f"{v[0]}-{v[4]}" for v in VIOLATIONS])
def test_violation_names_column_row_and_rule(name, index, change, column, rule):
    schema, rows = VALID[name]
    rows = copy.deepcopy(rows)
    rows[index].update(change)
    with pytest.raises(TableValidationError) as e:
        schema.validate(schema.from_rows(rows), stage=f"{name}-stage")
    err = e.value
    assert (err.column, err.rule) == (column, rule), str(err)
    row_id = rows[index][schema.id_column]
    assert err.row_id == f"{schema.id_column}={row_id!r}"
    assert f"{name}-stage" in str(err) and column in str(err) and rule in str(err) and repr(row_id) in str(err)


def test_logprob_nan_is_rejected():
    rows = [R.trajectory_row(i) for i in range(2)]
    rows[1]["generation_logprobs"][-1] = float("nan")
    with pytest.raises(TableValidationError, match="logprobs_finite"):
        TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))


def test_wrong_list_type_is_a_dtype_error():
    t = TRAJECTORIES.from_rows([R.trajectory_row(0)])
    t = t.set_column(t.schema.get_field_index("token_ids"), "token_ids", t["token_ids"].cast(pa.list_(pa.int64())))
    with pytest.raises(TableValidationError) as e:
        TRAJECTORIES.validate(t)
    assert e.value.column == "token_ids" and e.value.rule == "dtype" and "int32" in str(e.value)


def test_missing_and_unexpected_columns():
    t = REWARDS.from_rows([R.reward_row(0)])
    with pytest.raises(TableValidationError, match="column 'attempts'.*column_present"):
        REWARDS.validate(t.drop_columns(["attempts"]))
    with pytest.raises(TableValidationError, match="known_columns"):
        REWARDS.validate(t.append_column("surprise", pa.array([1])))


def test_tables_read_across_schema_changes():
    # A retired column (mistake_mask, dropped with the demonstrations that used it) is dropped on read;
    # a column added later (rewards' harness_changes) reads as nulls.
    t = TRAJECTORIES.from_rows([R.trajectory_row(i) for i in range(2)])
    old = t.append_column("mistake_mask", pa.array([[0, 1], None], pa.list_(pa.int8())))
    assert TRAJECTORIES.validate(old).schema == TRAJECTORIES.arrow_schema
    r = REWARDS.from_rows([R.reward_row(i) for i in range(2)]).drop_columns(["harness_changes"])
    back = REWARDS.validate(r)
    assert back["harness_changes"].null_count == 2 and back.schema == REWARDS.arrow_schema


def test_tasks_keep_extra_r2e_columns():
    t = TASKS.from_rows([R.task_row(0)]).append_column("num_non_test_files", pa.array([3]))
    assert TASKS.validate(t).num_rows == 1


def test_from_rows_names_the_bad_cell():
    rows = [R.trajectory_row(0), R.trajectory_row(1)]
    rows[1]["step"] = "three"
    with pytest.raises(TableValidationError) as e:
        TRAJECTORIES.from_rows(rows)
    assert e.value.column == "step" and rows[1]["rollout_id"] in str(e.value)


def test_negative_token_ids_are_rejected():
    rows = [R.trajectory_row(i) for i in range(3)]
    rows[2]["token_ids"] = [-7] + rows[2]["token_ids"][1:]  # same length: only the value is wrong
    with pytest.raises(TableValidationError) as e:
        TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))
    assert (e.value.column, e.value.rule) == ("token_ids", "token_ids_nonnegative")
    assert rows[2]["rollout_id"] in str(e.value)


def test_demonstrations_keep_policy_version_minus_one():
    # The scripted solver's version is -1 (tasks/agent/scripted.py): not a count, so no sign rule.
    rows = [dict(R.trajectory_row(i), policy_version=-1) for i in range(2)]
    TRAJECTORIES.validate(TRAJECTORIES.from_rows(rows))


_RACE = """
import threading
from schemas.tables import TRAJECTORIES
errors, gate = [], threading.Barrier(16)
def validate():
    gate.wait()
    try:
        for _ in range(5):
            TRAJECTORIES.validate(TRAJECTORIES.from_rows([]))
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=validate) for _ in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""


def test_tables_validated_in_many_threads_at_once_from_a_fresh_interpreter():
    """pandera retries its missing pyspark engine's import in every dtype check; 16 threads at once
    met a half-imported module ("no attribute 'DataType'") in 2 of 5 fresh interpreters before
    schemas/tables.py marked it absent (a run's parallel table writes failed on it)."""
    import subprocess
    import sys

    from tests.fixtures.smoke import REPO

    # Six fresh interpreters, all at once: the machine's cores are busy with their imports, not idle.
    procs = [subprocess.Popen([sys.executable, "-c", _RACE], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0 and stdout.strip() == "[]", stdout[-2000:] + stderr[-2000:]
