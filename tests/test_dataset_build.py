"""Building datasets into the store: archives + table, caching, verification errors, the sandbox check."""

import json

import pytest

from schemas.config import DatasetConfig
from schemas.tables import TASKS
from tasks.dataset import build, mini, verify
from tasks.dataset.build import build_mini_benchmark
from tasks.dataset.verify import DatasetVerificationError, LocalVerifier

SMALL = DatasetConfig(num_train=24, num_validation=12, seed=11)


def test_build_writes_archives_and_table_and_is_cached(file_store, monkeypatch):
    checked = []

    def verifier(rows, store, cfg):  # the real hidden tests, on a few rows (tests stay quick)
        checked.extend(r["instance_id"] for r in rows[:6])
        LocalVerifier()(rows[:6], store, cfg)

    key = build_mini_benchmark(SMALL, file_store, verify=True, verifier=verifier)
    assert len(checked) == 6
    did = key.split("/")[1]
    assert key == f"datasets/{did}/tasks.parquet" and did.startswith("mini-")
    table = file_store.read_table(key, stage="tasks")
    assert table.num_rows == 36
    for row in table.to_pylist():
        assert row["environment_uri"] == file_store.uri(f"environments/{did}/{row['instance_id']}.tar.gz")
        assert file_store.exists(row["environment_uri"])
    assert file_store.get_json(f"datasets/{did}/verified.json")["tasks"] == 36
    # A second build is a cache hit: nothing is generated or verified again.
    monkeypatch.setattr(mini, "generate", lambda *a, **k: pytest.fail("regenerated a cached dataset"))
    assert build_mini_benchmark(SMALL, file_store, verifier=lambda *a: pytest.fail("re-verified")) == key


def test_unverified_build_is_verified_later(file_store):
    key = build_mini_benchmark(SMALL, file_store, verify=False)
    did = key.split("/")[1]
    assert file_store.is_committed(key) and not file_store.exists(f"datasets/{did}/verified.json")
    seen = []
    build_mini_benchmark(SMALL, file_store, verifier=lambda rows, store, cfg: seen.append(len(rows)))
    assert seen == [36] and file_store.exists(f"datasets/{did}/verified.json")


def test_dataset_id_depends_on_config():
    ids = {build.mini_dataset_id(c, "rlvr-sandbox:bookworm") for c in
           (SMALL, SMALL.model_copy(update={"seed": 12}), SMALL.model_copy(update={"difficulty": 0.9}),
            SMALL.model_copy(update={"num_train": 25}))}
    assert len(ids) == 4
    assert build.mini_dataset_id(SMALL, "x") != build.mini_dataset_id(SMALL, "rlvr-sandbox:bookworm")
    # The training order is not part of the content.
    assert build.mini_dataset_id(SMALL.model_copy(update={"order": "shuffled"}), "x") == build.mini_dataset_id(SMALL, "x")


def test_verification_failure_names_the_instance_and_commits_nothing(file_store):
    def broken(rows, store, cfg):
        raise DatasetVerificationError({rows[3]["instance_id"]: "gold patch scored 0.0"}, len(rows))

    with pytest.raises(DatasetVerificationError, match="1 of 36 tasks failed verification") as e:
        build_mini_benchmark(SMALL, file_store, verifier=broken)
    assert list(e.value.failures.values()) == ["gold patch scored 0.0"]
    did = build.mini_dataset_id(SMALL, mini.DEFAULT_IMAGE)
    assert not file_store.is_committed(build.tasks_key(did))


def test_precheck_names_bad_rows():
    row = mini.generate(DatasetConfig(num_train=12, num_validation=12))[0].row
    patch, why = verify._precheck(row)
    assert why is None and patch.startswith("diff --git")
    bad = dict(row, expected_output_json='{"test_a": "PASS')
    assert "expected_output_json is not valid JSON" in verify._precheck(bad)[1]
    bad = dict(row, parsed_commit_content="[]")
    assert row["instance_id"] in verify._precheck(bad)[1]


def test_local_verifier_catches_a_gold_patch_that_does_not_apply(file_store):
    tasks = mini.generate(DatasetConfig(num_train=12, num_validation=12, seed=2))
    t = tasks[0]
    commit = json.loads(t.row["parsed_commit_content"])
    commit["file_diffs"][0]["old_file_content"] = "something else\n"
    row = dict(t.row, parsed_commit_content=json.dumps(commit))
    with pytest.raises(DatasetVerificationError, match=f"{row['instance_id']}: gold patch does not apply"):
        verify.verify_locally(row, t.archive)


def test_parse_pytest_summary_keys_like_r2e():
    out = ("=== short test summary info ===\nPASSED r2e_tests/test_1.py::test_a\n"
           "FAILED r2e_tests/test_1.py::TestX::test_b - assert 1 == 2\nERROR r2e_tests/test_1.py::test_c\n")
    assert verify.parse_pytest_summary(out) == {"test_a": "PASSED", "TestX.test_b": "FAILED", "test_c": "ERROR"}


def test_build_on_s3(s3_store):
    cfg = DatasetConfig(num_train=12, num_validation=12, seed=4)
    key = build_mini_benchmark(cfg, s3_store, verify=False)
    table = s3_store.read_table(key, stage="tasks")
    TASKS.validate(table)
    uri = table["environment_uri"][0].as_py()
    assert uri.startswith("s3://") and s3_store.get_bytes(uri)[:2] == b"\x1f\x8b"


@pytest.mark.slow
def test_sample_verified_in_real_sandbox(sandbox_rootfs, tmp_path):
    """~24 generated tasks covering every family and both splits: gold -> reward 1, empty -> 0,
    through tasks.grading in bwrap sandboxes (the full 951 are verified by the build itself)."""
    from tasks.storage import Store
    from tests.fixtures.sandbox import sandbox_cfg
    from tests.test_dataset_mini import _sample_covering_families

    cfg = DatasetConfig(num_train=48, num_validation=24, seed=21)
    store = Store(f"file://{tmp_path}/store")
    key = build_mini_benchmark(cfg, store, verify=False)
    rows = store.read_table(key, stage="tasks").to_pylist()
    by_id = {r["instance_id"]: r for r in rows}
    sample = [by_id[t.row["instance_id"]] for t in _sample_covering_families(
        [mini.MiniTask(r, b"") for r in rows], n=24)]
    assert {r["bug_family"] for r in sample} == set(mini.FAMILIES)
    verify.verify_tasks(sample, store, sandbox_cfg("bwrap"))
    # ... and a task whose hidden tests cannot pass is reported by instance.
    broken = dict(sample[0], expected_output_json=json.dumps({"test_missing": "PASSED"}))
    with pytest.raises(DatasetVerificationError, match=sample[0]["instance_id"]):
        verify.verify_tasks([broken], store, sandbox_cfg("bwrap"))


@pytest.mark.slow
def test_a_run_verifies_the_tasks_it_can_use_and_a_longer_run_only_what_it_adds(sandbox_rootfs, tmp_path,
                                                                                monkeypatch):
    """dataset.verify_scope=used: the validation split and the training batches of steps 1..max_steps,
    each recorded per task (a longer run grades only the batches it adds); a base build verifies all."""
    from flows import prepare
    from schemas.presets import load_config
    from tasks.storage import Store
    from tests.fixtures.sandbox import sandbox_cfg

    store = Store(f"file://{tmp_path}/store")
    graded = []
    real = verify.grade_rollouts
    monkeypatch.setattr(verify, "grade_rollouts", lambda items, *a, **k: graded.append(len(items)) or real(items, *a, **k))

    def cfg(steps):
        c = load_config("smoke", {"max_steps": steps, "grpo": {"prompts_per_step": 2},
                                  "dataset": {"num_train": 24, "num_validation": 6, "seed": 5, "verify_scope": "used"}})
        return c.model_copy(update={"sandbox": sandbox_cfg("bwrap")})

    key = prepare.dataset.fn(cfg(2), store, "used")
    rows = store.read_table(key, stage="tasks").to_pylist()
    used = prepare.used_task_ids(cfg(2), rows)
    train = sorted(r["instance_id"] for r in rows if r["split"] == "train")
    assert used == {r["instance_id"] for r in rows if r["split"] == "validation"} | {
        i for s in range(2) for i in prepare.training_batch(train, s, 2, 0, "fixed")}
    assert len(used) == 6 + 4 and graded == [2 * len(used)]  # a gold and an empty grading each

    def marked(row):
        return store.exists(f"datasets/verified/{verify._verification_key(row, store, sandbox_cfg('bwrap'))}.json")

    assert {r["instance_id"] for r in rows if marked(r)} == used
    assert not build.fully_verified(store, key)
    prepare.dataset.fn(cfg(3), store, "used")  # one more step: its batch only
    assert graded == [20, 2 * len(prepare.used_task_ids(cfg(3), rows) - used)] and graded[1] > 0
    prepare.dataset.fn(cfg(3), store, "all")  # a base build: every task, then the dataset's marker
    assert build.fully_verified(store, key) and graded[2] == 2 * len(rows)
    prepare.dataset.fn(cfg(9), store, "used")
    assert len(graded) == 3  # all verified: nothing more
