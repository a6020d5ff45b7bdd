"""Data contracts: one pandera schema (pyarrow backend) per table that travels between stages.

Each table has an id column, exact Arrow types (token ids are list<int32>,
logprobs list<float32>, ...) and value rules. `TableSchema.validate` runs the
pandera schema and, on failure, raises one `TableValidationError` naming the
table, the column, the first offending row's id and the rule.

Build tables with `schema.from_rows(rows)` so the Arrow types are exact.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pandera.pyarrow as ppa
from pandera.errors import SchemaError, SchemaErrors

# pandera imports its pyspark engine inside every dtype check. Without pyspark that import fails each
# time, and a thread can meet another's half-imported module (AttributeError: no 'DataType'): a
# run's parallel table writes did. Marked absent, the import fails at once in every thread.
if importlib.util.find_spec("pyspark") is None:
    sys.modules.setdefault("pandera.engines.pyspark_engine", None)

# agent_error: an error of our own code ended the episode (masked); patch_too_large: the final patch
# was over the diff cap (the policy's doing: graded as the empty patch).
FINISH_REASONS = ("submitted", "max_turns", "context_limit", "timeout", "infra_error", "agent_error", "patch_too_large",
                  "patch_unreadable")
# env_error (added later; older tables hold the first two only): the task's environment cannot run
# its tests (tasks/grading/grader.py). Like infra_error: reward null, masked downstream.
GRADING_STATUSES = ("graded", "infra_error", "env_error")
SPLITS = ("train", "validation")
TEST_STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


class TableValidationError(ValueError):
    """A table broke its contract. Names the table, column, first offending row id and rule."""

    def __init__(self, table: str, column: str | None, row_id: str | None, rule: str, detail: str = ""):
        self.table, self.column, self.row_id, self.rule, self.detail = table, column, row_id, rule, detail
        where = f"column '{column}'" if column else "table"
        row = f", first offending row {row_id}" if row_id is not None else ""
        super().__init__(f"{table}: {where}{row} violates rule '{rule}'" + (f": {detail}" if detail else ""))


# A rule is a vectorised predicate over the whole table: True where the row is fine.
RowRule = Callable[[pa.Table], pa.ChunkedArray | pa.Array]


@dataclass
class _Rule:
    name: str
    column: str | None
    fn: RowRule
    detail: str


def _true_where_null(mask: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    return pc.fill_null(mask, True)


def _list_lengths_equal(*cols: str) -> RowRule:
    def fn(t: pa.Table):
        first = pc.list_value_length(t[cols[0]])
        ok = pc.equal(first, first)
        for c in cols[1:]:
            ok = pc.and_(ok, pc.equal(first, pc.list_value_length(t[c])))
        return ok

    return fn


def _values_in(column: str, allowed) -> RowRule:
    # Nulls are the nullable flag's business, not this rule's.
    return lambda t: pc.or_(pc.is_null(t[column]),
                            pc.is_in(t[column], value_set=pa.array(allowed, t.schema.field(column).type)))


def _between(column: str, lo: float | None = None, hi: float | None = None) -> RowRule:
    def fn(t: pa.Table):
        c = t[column]
        ok = pc.is_valid(c) if lo is None and hi is None else None
        if lo is not None:
            ok = pc.greater_equal(c, lo)
        if hi is not None:
            ok = pc.less_equal(c, hi) if ok is None else pc.and_(ok, pc.less_equal(c, hi))
        return _true_where_null(ok)

    return fn


def _finite(column: str) -> RowRule:
    return lambda t: _true_where_null(pc.is_finite(t[column]))


def _list_values_finite(column: str) -> RowRule:
    def fn(t: pa.Table):
        col = t[column].combine_chunks() if isinstance(t[column], pa.ChunkedArray) else t[column]
        flat_ok = pc.is_finite(pc.list_flatten(col))
        # Fold per-element flags back to rows: a row is fine if none of its elements is non-finite.
        parents = pc.list_parent_indices(col)
        bad_rows = pc.unique(pc.filter(parents, pc.invert(flat_ok)))
        return pc.invert(pc.is_in(pa.array(range(len(col)), pa.int64()), value_set=bad_rows))

    return fn


def _list_values_in(column: str, allowed) -> RowRule:
    def fn(t: pa.Table):
        col = t[column].combine_chunks() if isinstance(t[column], pa.ChunkedArray) else t[column]
        flat = pc.list_flatten(col)
        flat_ok = pc.is_in(flat, value_set=pa.array(allowed, flat.type))
        parents = pc.list_parent_indices(col)
        bad_rows = pc.unique(pc.filter(parents, pc.invert(flat_ok)))
        return pc.invert(pc.is_in(pa.array(range(len(col)), pa.int64()), value_set=bad_rows))

    return fn


def _list_values_nonnegative(column: str) -> RowRule:
    def fn(t: pa.Table):
        col = t[column].combine_chunks() if isinstance(t[column], pa.ChunkedArray) else t[column]
        flat_ok = pc.greater_equal(pc.list_flatten(col), 0)
        parents = pc.list_parent_indices(col)
        bad_rows = pc.unique(pc.filter(parents, pc.invert(flat_ok)))
        return pc.invert(pc.is_in(pa.array(range(len(col)), pa.int64()), value_set=bad_rows))

    return fn


def _nonnegative(*columns: str) -> list[_Rule]:
    # Counts, seconds and indices: a negative one is a bug upstream, never data to commit.
    return [_rule("nonnegative", c, _between(c, lo=0), f"{c} must be >= 0") for c in columns]


def _valid_json(column: str, kind: type) -> RowRule:
    # Python-level parse: these are small text columns, and the error must name the row.
    def fn(t: pa.Table):
        out = []
        for v in t[column].to_pylist():
            if v is None:
                out.append(True)
                continue
            try:
                out.append(isinstance(json.loads(v), kind))
            except ValueError:
                out.append(False)
        return pa.array(out, pa.bool_())

    return fn


@dataclass
class TableSchema:
    name: str
    id_column: str
    columns: dict[str, tuple[pa.DataType, bool]]  # name -> (type, nullable)
    unique: list[str] = field(default_factory=list)
    rules: list[_Rule] = field(default_factory=list)
    strict: bool = True
    descriptions: dict[str, str] = field(default_factory=dict)
    # Nullable columns added after tables were stored: absent in an older table, they read as nulls.
    added_later: tuple[str, ...] = ()
    # Columns no longer written: present in an older table, they are dropped when it is read.
    retired: tuple[str, ...] = ()

    def __post_init__(self):
        checks_by_col: dict[str | None, list] = {}
        for r in self.rules:
            # Bind r explicitly: the lambda runs later, inside pandera.
            chk = ppa.Check(lambda d, r=r: r.fn(d.table), name=r.name, error=r.detail or r.name)
            checks_by_col.setdefault(r.column, []).append(chk)
        cols = {
            name: ppa.Column(
                typ,
                checks=checks_by_col.get(name, []),
                nullable=nullable,
                unique=name in self.unique,
                description=self.descriptions.get(name),
            )
            for name, (typ, nullable) in self.columns.items()
        }
        self.pandera = ppa.DataFrameSchema(cols, checks=checks_by_col.get(None, []), strict=self.strict, name=self.name)
        self.arrow_schema = pa.schema([pa.field(n, t, nullable=nb) for n, (t, nb) in self.columns.items()])

    # -- building -----------------------------------------------------------------
    def from_rows(self, rows: list[dict]) -> pa.Table:
        """Build a table with this schema's exact Arrow types (extra keys are an error)."""
        for i, r in enumerate(rows):
            extra = set(r) - set(self.columns)
            if extra and self.strict:
                raise TableValidationError(self.name, sorted(extra)[0], self._row_label(r, i), "known_columns",
                                           f"unexpected columns {sorted(extra)}")
        try:
            return pa.Table.from_pylist(rows, schema=self.arrow_schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            col, row_id = self._locate_build_error(rows)
            raise TableValidationError(self.name, col, row_id, "arrow_type", str(e)) from e

    def empty(self) -> pa.Table:
        return self.arrow_schema.empty_table()

    def _row_label(self, row: dict, i: int) -> str:
        rid = row.get(self.id_column)
        return f"{self.id_column}={rid!r}" if rid is not None else f"#{i}"

    def _locate_build_error(self, rows: list[dict]) -> tuple[str | None, str | None]:
        for name, (typ, nullable) in self.columns.items():
            for i, r in enumerate(rows):
                try:
                    pa.array([r.get(name)], typ)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                    return name, self._row_label(r, i)
        return None, None

    # -- validating ---------------------------------------------------------------
    def validate(self, table: pa.Table, stage: str | None = None) -> pa.Table:
        label = f"{stage} ({self.name})" if stage and stage != self.name else self.name
        table = table.drop_columns([c for c in self.retired if c in table.column_names])
        for name in self.added_later:
            if name not in table.column_names:
                at = min(list(self.columns).index(name), table.num_columns)
                table = table.add_column(at, pa.field(name, self.columns[name][0]),
                                         pa.nulls(table.num_rows, self.columns[name][0]))
        try:
            self.pandera.validate(table, lazy=True)
        except SchemaErrors as e:
            raise self._explain(table, label, e.schema_errors) from None
        except SchemaError as e:
            raise self._explain(table, label, [e]) from None
        return table

    def _row_id(self, table: pa.Table, index: int) -> str:
        if self.id_column in table.column_names:
            return f"{self.id_column}={table[self.id_column][index].as_py()!r}"
        return f"#{index}"

    def _explain(self, table: pa.Table, label: str, errors: list) -> TableValidationError:
        # Structural problems first: a missing column or wrong type makes row checks meaningless.
        names = set(table.column_names)
        for name, (typ, nullable) in self.columns.items():
            if name not in names:
                return TableValidationError(label, name, None, "column_present", "column is missing")
        for name, (typ, nullable) in self.columns.items():
            got = table.schema.field(name).type
            if got != typ:
                return TableValidationError(label, name, None, "dtype", f"expected {typ}, got {got}")
        if self.strict:
            extra = [c for c in table.column_names if c not in self.columns]
            if extra:
                return TableValidationError(label, extra[0], None, "known_columns", f"unexpected columns {extra}")
        for name, (typ, nullable) in self.columns.items():
            if not nullable and table[name].null_count:
                idx = pc.index(pc.is_null(table[name]), True).as_py()
                return TableValidationError(label, name, self._row_id(table, idx), "not_null", "value is null")
        for name in self.unique:
            col = table[name]
            seen: set = set()
            for i, v in enumerate(col.to_pylist()):
                if v in seen:
                    return TableValidationError(label, name, self._row_id(table, i), "unique", f"duplicate value {v!r}")
                seen.add(v)
        for r in self.rules:
            ok = r.fn(table)
            if isinstance(ok, pa.ChunkedArray):
                ok = ok.combine_chunks()
            bad = pc.invert(pc.fill_null(ok, False))
            if pc.any(bad).as_py():
                idx = pc.index(bad, True).as_py()
                return TableValidationError(label, r.column, self._row_id(table, idx), r.name, r.detail)
        # pandera found something our own walk did not: report it as pandera states it.
        first = errors[0] if errors else None
        return TableValidationError(label, getattr(first, "column_name", None), None,
                                    str(getattr(first, "reason_code", "schema")), str(first))


def _rule(name: str, column: str | None, fn: RowRule, detail: str = "") -> _Rule:
    return _Rule(name, column, fn, detail)


STR, I32, I64, F32, F64, BOOL = pa.string(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.bool_()
TOKENS, MASK, LOGPROBS = pa.list_(pa.int32()), pa.list_(pa.int8()), pa.list_(pa.float32())


# --- tasks: R2E-Gym rows as published, plus our ids and, for local environments, where they live ---
TASKS = TableSchema(
    name="tasks",
    id_column="instance_id",
    columns={
        "instance_id": (STR, False),
        "split": (STR, False),
        "repo_name": (STR, False),
        "docker_image": (STR, False),
        "commit_hash": (STR, False),
        "problem_statement": (STR, False),
        # JSON document of the gold commit (R2E-Gym's ParsedCommit: file diffs, messages).
        "parsed_commit_content": (STR, False),
        # JSON object: hidden test name -> PASSED / FAILED / ERROR after the gold patch.
        "expected_output_json": (STR, False),
        "modified_files": (pa.list_(STR), False),
        "relevant_files": (pa.list_(STR), True),
        "prompt": (STR, True),
        # Locally built environments: object-store URI of the repo snapshot + hidden tests (tar).
        "environment_uri": (STR, True),
        # Mini benchmark only: which bug family was injected (for per-family solve rates).
        "bug_family": (STR, True),
    },
    unique=["instance_id"],
    rules=[
        _rule("split_known", "split", _values_in("split", list(SPLITS)), f"split must be one of {SPLITS}"),
        _rule("expected_output_is_json_object", "expected_output_json", _valid_json("expected_output_json", dict),
              "expected_output_json must be a JSON object of test name -> status"),
        _rule("parsed_commit_is_json", "parsed_commit_content", _valid_json("parsed_commit_content", dict),
              "parsed_commit_content must be a JSON object"),
        _rule("problem_statement_nonempty", "problem_statement",
              lambda t: pc.greater(pc.utf8_length(t["problem_statement"]), 0), "problem statement is empty"),
    ],
    strict=False,  # published R2E-Gym rows carry more columns; keep them
)

# --- trajectories: one row per rollout, with exactly the tokens the policy sampled ---
TRAJECTORIES = TableSchema(
    name="trajectories",
    id_column="rollout_id",
    columns={
        "rollout_id": (STR, False),
        "run_id": (STR, False),
        "step": (I32, False),
        "policy_version": (I32, False),
        "instance_id": (STR, False),
        "group_id": (STR, False),
        "sample_index": (I32, False),
        "split": (STR, False),
        # The conversation as OpenAI-style messages (JSON), for people and notebooks.
        "messages": (STR, False),
        # The whole episode as one token sequence: each turn's prompt is a prefix of it.
        "token_ids": (TOKENS, False),
        # 1 on tokens the policy generated (the only ones the loss sees).
        "loss_mask": (MASK, False),
        # vLLM's logprob of each generated token; 0 where loss_mask is 0.
        "generation_logprobs": (LOGPROBS, False),
        "prompt_length": (I32, False),
        "num_turns": (I32, False),
        "num_generated_tokens": (I32, False),
        "tool_errors": (I32, False),
        "finish_reason": (STR, False),
        "error": (STR, True),
        "final_patch": (STR, False),
        "generation_seconds": (F64, False),
        "sandbox_seconds": (F64, False),
        "total_seconds": (F64, False),
        # The vLLM servers (base URLs) that generated the episode's turns, in order of first use
        # (more than one only when a server failed mid-episode); null: no server (scripted).
        "servers": (pa.list_(STR), True),
        # Ray node id the episode ran on (cluster.address set); null: in the driver's process.
        "node": (STR, True),
    },
    unique=["rollout_id"],
    added_later=("servers", "node"),
    rules=[
        _rule("token_columns_aligned", "loss_mask",
              _list_lengths_equal("token_ids", "loss_mask", "generation_logprobs"),
              "token_ids, loss_mask and generation_logprobs must have the same length"),
        _rule("finish_reason_known", "finish_reason", _values_in("finish_reason", list(FINISH_REASONS)),
              f"finish_reason must be one of {FINISH_REASONS}"),
        _rule("split_known", "split", _values_in("split", list(SPLITS)), f"split must be one of {SPLITS}"),
        _rule("logprobs_finite", "generation_logprobs", _list_values_finite("generation_logprobs"),
              "generation logprobs must be finite"),
        _rule("loss_mask_binary", "loss_mask", _list_values_in("loss_mask", [0, 1]), "loss_mask values must be 0 or 1"),
        _rule("prompt_within_tokens", "prompt_length",
              lambda t: pc.less_equal(t["prompt_length"], pc.list_value_length(t["token_ids"])),
              "prompt_length exceeds the token sequence"),
        _rule("generated_count_matches_mask", "num_generated_tokens",
              lambda t: pc.equal(t["num_generated_tokens"],
                                 pc.cast(_list_sums(t["loss_mask"]), pa.int32())),
              "num_generated_tokens must equal sum(loss_mask)"),
        _rule("token_ids_nonnegative", "token_ids", _list_values_nonnegative("token_ids"), "token ids must be >= 0"),
        *_nonnegative("step", "sample_index", "prompt_length", "num_turns", "num_generated_tokens", "tool_errors",
                      "generation_seconds", "sandbox_seconds", "total_seconds"),
    ],
    retired=("mistake_mask",),
)


def _list_sums(col: pa.ChunkedArray) -> pa.Array:
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    flat = pc.cast(pc.list_flatten(col), pa.int64())
    parents = pc.list_parent_indices(col)
    sums = [0] * len(col)
    if len(flat):
        grouped = pa.table({"p": parents, "v": flat}).group_by("p").aggregate([("v", "sum")])
        for p, s in zip(grouped["p"].to_pylist(), grouped["v_sum"].to_pylist()):
            sums[p] = s
    return pa.array(sums, pa.int64())


# --- rewards: one row per graded rollout; infra failures are not zeros ---
REWARDS = TableSchema(
    name="rewards",
    id_column="rollout_id",
    columns={
        "rollout_id": (STR, False),
        "run_id": (STR, False),
        "step": (I32, False),
        "instance_id": (STR, False),
        # 0/1 when graded; null when grading_status is infra_error or env_error (downstream masks it).
        "reward": (F32, True),
        "grading_status": (STR, False),
        "error": (STR, True),
        "patch_applied": (BOOL, False),
        # JSON object test name -> status, parsed from pytest's short test summary.
        "test_statuses": (STR, False),
        "attempts": (I32, False),
        "sandbox_start_seconds": (F64, False),
        "test_seconds": (F64, False),
        "total_seconds": (F64, False),
        # "path: why" for each change the grader removed from the patch before the tests ran
        # (tasks/grading/grader.py: what a patch may not change); a reward-hacking signal.
        "harness_changes": (pa.list_(STR), True),
        # What the verdict recorder's evidence said against the test log (tasks/grading/verdict.py):
        # the patch tampered with the test run; reward 0.
        "tampering": (pa.list_(STR), True),
        # "path: construct (line N)": reward-hacking constructs in the patch's own code that no
        # harness can refuse (tasks/grading/hacks.py); counted, not scored.
        "hack_signals": (pa.list_(STR), True),
        # Ray node id the grading ran on (cluster.address set); null: in the driver's process.
        "node": (STR, True),
    },
    unique=["rollout_id"],
    added_later=("harness_changes", "node", "tampering", "hack_signals"),
    rules=[
        _rule("reward_binary", "reward", _values_in("reward", [0.0, 1.0]), "reward must be 0 or 1"),
        _rule("grading_status_known", "grading_status", _values_in("grading_status", list(GRADING_STATUSES)),
              f"grading_status must be one of {GRADING_STATUSES}"),
        _rule("reward_iff_graded", "reward",
              lambda t: pc.equal(pc.is_valid(t["reward"]), pc.equal(t["grading_status"], "graded")),
              "reward must be set exactly when grading_status is 'graded'"),
        _rule("test_statuses_json", "test_statuses", _valid_json("test_statuses", dict),
              "test_statuses must be a JSON object"),
        *_nonnegative("step", "attempts", "sandbox_start_seconds", "test_seconds", "total_seconds"),
    ],
)

# --- advantages: one row per rollout of the step's groups ---
ADVANTAGES = TableSchema(
    name="advantages",
    id_column="rollout_id",
    columns={
        "rollout_id": (STR, False),
        "run_id": (STR, False),
        "step": (I32, False),
        "group_id": (STR, False),
        "instance_id": (STR, False),
        "reward": (F32, True),
        "baseline": (F64, False),
        "group_std": (F64, False),
        "advantage": (F64, False),
        "group_size": (I32, False),
        "group_valid": (I32, False),
        # Masked samples are left out of group statistics and of the loss.
        "masked": (BOOL, False),
        "mask_reason": (STR, True),
    },
    unique=["rollout_id"],
    rules=[
        _rule("advantage_finite", "advantage", _finite("advantage"), "advantage must be finite"),
        _rule("baseline_finite", "baseline", _finite("baseline"), "baseline must be finite"),
        _rule("std_nonnegative", "group_std", _between("group_std", lo=0.0), "group_std must be >= 0"),
        _rule("reward_binary", "reward", _values_in("reward", [0.0, 1.0]), "reward must be 0 or 1"),
        _rule("masked_has_reason", "mask_reason",
              lambda t: pc.or_(pc.invert(t["masked"]), pc.is_valid(t["mask_reason"])),
              "a masked sample must say why"),
    ],
)

# --- evaluation: per-sample rewards on validation, and the per-step summary ---
EVAL_SAMPLES = TableSchema(
    name="eval_samples",
    id_column="rollout_id",
    columns={
        "rollout_id": (STR, False),
        "run_id": (STR, False),
        "step": (I32, False),
        "policy_version": (I32, False),
        "instance_id": (STR, False),
        "sample_index": (I32, False),
        "reward": (F32, True),
        "masked": (BOOL, False),
        "mask_reason": (STR, True),
        "finish_reason": (STR, False),
    },
    unique=["rollout_id"],
    rules=[
        _rule("reward_binary", "reward", _values_in("reward", [0.0, 1.0]), "reward must be 0 or 1"),
        _rule("finish_reason_known", "finish_reason", _values_in("finish_reason", list(FINISH_REASONS)),
              f"finish_reason must be one of {FINISH_REASONS}"),
        _rule("reward_unless_masked", "reward",
              lambda t: pc.or_(t["masked"], pc.is_valid(t["reward"])), "an unmasked sample needs a reward"),
    ],
)

EVAL_SUMMARY = TableSchema(
    name="eval_summary",
    id_column="step",
    columns={
        "run_id": (STR, False),
        "step": (I32, False),
        "policy_version": (I32, False),
        "k": (I32, False),
        "pass_at_k": (F64, False),
        "pass_at_1": (F64, False),
        # pass^k: the chance that all k samples succeed (a consistency diagnostic); null when the
        # evaluation stopped drawing for a task at its first success (procedure "early_stop").
        "pass_hat_k": (F64, True),
        "num_tasks": (I32, False),
        "num_samples": (I32, False),
        "num_masked": (I32, False),
        # MLPerf samples_count: training samples consumed when this evaluation ran.
        "samples_count": (I64, False),
        "eval_seconds": (F64, False),
        # "full": k samples of every task; "early_stop": samples until the first success, at most k
        # (the same pass@k distribution, tasks/evaluation.py); null in tables written before.
        "procedure": (STR, True),
        # Unix time the evaluation started (offline evaluations are logged after training with it).
        "started_unix": (F64, True),
        # 95% Wilson intervals over tasks and P(true pass@k > eval.target) (tasks/gate.py); null before.
        "pass_at_k_low": (F64, True),
        "pass_at_k_high": (F64, True),
        "pass_at_1_low": (F64, True),
        "pass_at_1_high": (F64, True),
        "p_above_target": (F64, True),
    },
    unique=["step"],
    added_later=("procedure", "started_unix", "pass_at_k_low", "pass_at_k_high", "pass_at_1_low", "pass_at_1_high",
                 "p_above_target"),
    rules=[
        _rule("pass_at_k_in_unit", "pass_at_k", _between("pass_at_k", 0.0, 1.0), "must be in [0, 1]"),
        _rule("pass_at_1_in_unit", "pass_at_1", _between("pass_at_1", 0.0, 1.0), "must be in [0, 1]"),
        _rule("pass_hat_k_in_unit", "pass_hat_k", _between("pass_hat_k", 0.0, 1.0), "must be in [0, 1]"),
        _rule("k_positive", "k", _between("k", lo=1), "k must be >= 1"),
    ],
)

REPRODUCIBILITY_METRICS = ("config", "dataset", "base_checkpoint", "batch_membership", "eval_tasks", "prompt_agreement",
           "pass_at_k", "pass_at_1", "train_reward_mean", "time_to_train_s", "trajectory_agreement",
           "eval_trajectory_agreement", "reward_agreement", "update_agreement")
REPRODUCIBILITY_RULES = ("exact", "binomial", "ratio", "min_share", "info")

# --- reproducibility: a rerun of a pinned configuration compared with its baseline run ---
REPRODUCIBILITY = TableSchema(
    name="reproducibility",
    id_column="row_id",
    columns={
        "row_id": (STR, False),            # "<metric>/<step or ->"
        "baseline_run_id": (STR, False),
        "rerun_id": (STR, False),
        "metric": (STR, False),
        "step": (I32, True),               # null for run-level metrics
        "baseline": (F64, True),
        "rerun": (F64, True),
        "delta": (F64, True),              # rerun - baseline (ratio for time_to_train_s)
        "tolerance": (F64, True),
        "rule": (STR, False),
        "gated": (BOOL, False),            # outside tolerance fails the flow run
        "ok": (BOOL, False),
        "detail": (STR, True),
        "created_at": (F64, False),
    },
    unique=["row_id"],
    rules=[_rule("metric_known", "metric", _values_in("metric", list(REPRODUCIBILITY_METRICS)),
                 f"metric must be one of {REPRODUCIBILITY_METRICS}"),
           _rule("rule_known", "rule", _values_in("rule", list(REPRODUCIBILITY_RULES)),
                 f"rule must be one of {REPRODUCIBILITY_RULES}"),
           _rule("tolerance_nonnegative", "tolerance", _between("tolerance", lo=0.0), "tolerance must be >= 0")],
)

# Every stage name the store knows, and the contract its table must keep.
SCHEMAS: dict[str, TableSchema] = {
    "tasks": TASKS,
    "trajectories": TRAJECTORIES,
    "trajectories_partial": TRAJECTORIES,
    "demonstrations": TRAJECTORIES,
    "rewards": REWARDS,
    "rewards_partial": REWARDS,
    "advantages": ADVANTAGES,
    "eval_samples": EVAL_SAMPLES,
    "eval_trajectories": TRAJECTORIES,
    "eval_rewards": REWARDS,
    "eval_summary": EVAL_SUMMARY,
    "reproducibility": REPRODUCIBILITY,
}


def schema_for(stage: str) -> TableSchema:
    try:
        return SCHEMAS[stage]
    except KeyError:
        raise KeyError(f"no schema for stage '{stage}'; known stages: {sorted(SCHEMAS)}") from None
