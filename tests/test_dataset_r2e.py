"""R2E-Gym loader: the fixture (incl. malformed rows), file formats, splits, the store, ordering."""

import json
import pathlib
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.config import DatasetConfig
from schemas.tables import TASKS
from tasks.dataset import r2e
from tasks.dataset.mini import gold_patch
from tasks.dataset.order import training_batch, training_order

FIXTURE = pathlib.Path(__file__).parent / "data" / "r2e_fixture.jsonl"


@pytest.fixture(scope="module")
def rows():
    return r2e.read_rows(str(FIXTURE))


def test_fixture_loads_and_reports_malformed_rows(rows):
    table, report = r2e.to_tasks(rows, num_train=3, num_validation=1, seed=0, source="r2e_fixture.jsonl")
    TASKS.validate(table)
    assert report.total == 7 and report.kept == 4 and table.num_rows == 4
    found = {(i.instance, i.column) for i in report.issues}
    assert ("pyramid__5a4b3c2d1e0f", "expected_output_json") in found
    assert ("numpy__0f1e2d3c4b5a", "problem_statement") in found
    assert ("numpy__0f1e2d3c4b5a", "modified_files") in found
    assert ("tornado__8c1d2e3f4a5b", "commit_hash") in found  # the duplicate row
    text = report.summary()
    assert "kept 4 of 7 rows" in text and "pyramid__5a4b3c2d1e0f: column 'expected_output_json': is not valid JSON" in text
    assert sorted(report.rejected_instances) == ["numpy__0f1e2d3c4b5a", "pyramid__5a4b3c2d1e0f", "tornado__8c1d2e3f4a5b"]


def test_ids_are_stable_and_extra_columns_kept(rows):
    table, _ = r2e.to_tasks(rows, 3, 1)
    ids = set(table["instance_id"].to_pylist())
    assert ids == {"aiohttp__3f6e9c2b1a0d", "tornado__8c1d2e3f4a5b", "pillow__1b2c3d4e5f60", "datalad__9e8d7c6b5a4f"}
    for col in ("execution_result_content", "modified_entity_summaries", "num_non_test_lines"):
        assert col in table.column_names
    assert json.loads(table["modified_entity_summaries"][0].as_py())[0]["type"] == "function"
    assert table["environment_uri"].null_count == table.num_rows  # real rows run in their docker images


def test_splits_are_seeded_and_validation_is_stable(rows):
    t1, _ = r2e.to_tasks(rows, 3, 1, seed=0)
    t2, _ = r2e.to_tasks(list(reversed(rows)), 3, 1, seed=0)
    assert t1.to_pylist() == t2.to_pylist()  # row order of the source does not matter
    val = lambda t: {r["instance_id"] for r in t.to_pylist() if r["split"] == "validation"}
    # Fewer training rows never move a validation task.
    t3, rep = r2e.to_tasks(rows, 2, 1, seed=0)
    assert val(t3) == val(t1) and rep.selected["unused"] == 1
    assert any(val(r2e.to_tasks(rows, 3, 1, seed=s)[0]) != val(t1) for s in range(1, 8))


def test_too_few_rows_is_a_clear_error(rows):
    with pytest.raises(r2e.DatasetError, match="only 4 usable rows of 7.*700 train \\+ 251 validation"):
        r2e.to_tasks(rows, 700, 251)


def test_parquet_and_json_array_read_the_same_rows(rows, tmp_path):
    pq_path = tmp_path / "subset.parquet"
    good = [r for r in rows if r["repo_name"] in ("aiohttp", "tornado", "pillow", "datalad")][:4]
    pq.write_table(pa.Table.from_pylist(good), pq_path)
    assert r2e.read_rows(str(pq_path)) == good
    arr = tmp_path / "rows.json"
    arr.write_text(json.dumps(good))
    assert r2e.read_rows(str(arr)) == good


def test_corrupt_files_name_the_file(tmp_path):
    bad_pq = tmp_path / "broken.parquet"
    bad_pq.write_bytes(b"PAR1" + b"\x00" * 50)
    with pytest.raises(r2e.DatasetError, match="broken.parquet is not a readable Parquet file"):
        r2e.read_rows(str(bad_pq))
    bad_jsonl = tmp_path / "broken.jsonl"
    bad_jsonl.write_text('{"repo_name": "a"}\n{"repo_name": \n')
    with pytest.raises(r2e.DatasetError, match="broken.jsonl line 2 is not valid JSON"):
        r2e.read_rows(str(bad_jsonl))
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(r2e.DatasetError, match="blob.jsonl is neither Parquet nor UTF-8"):
        r2e.read_rows(str(binary))
    with pytest.raises(r2e.DatasetError, match="no file at .*missing.parquet"):
        r2e.read_rows(str(tmp_path / "missing.parquet"))


def test_load_into_store_is_cached(file_store):
    cfg = DatasetConfig(source="r2e", path=str(FIXTURE), num_train=3, num_validation=1)
    key = r2e.load_r2e_dataset(cfg, file_store)
    assert key.startswith("datasets/r2e-") and file_store.is_committed(key)
    table = file_store.read_table(key, stage="tasks")
    assert sorted(table["split"].to_pylist()) == ["train", "train", "train", "validation"]
    report = file_store.get_json(key.replace("tasks.parquet", "load_report.json"))
    assert report["kept"] == 4 and {i["column"] for i in report["issues"]} >= {"expected_output_json"}
    assert r2e.load_r2e_dataset(cfg, file_store) == key
    with pytest.raises(r2e.DatasetError, match="expected_output_json"):
        r2e.load_r2e_dataset(cfg.model_copy(update={"seed": 1}), file_store, strict=True)


def test_load_from_s3(s3_store, rows, tmp_path):
    good = [r for r in rows if r["repo_name"] != "numpy"]
    buf = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(good), buf)
    uri = s3_store.put_bytes("incoming/r2e-gym-subset.parquet", buf.getvalue().to_pybytes())
    cfg = DatasetConfig(source="r2e", path=uri, num_train=2, num_validation=2)
    key = r2e.load_r2e_dataset(cfg, s3_store)
    assert s3_store.read_table(key, stage="tasks").num_rows == 4
    with pytest.raises(r2e.DatasetError, match="no file at"):
        r2e.read_rows(s3_store.uri("incoming/nothing.parquet"), s3_store)


def test_gold_patch_of_r2e_rows_applies(rows, tmp_path):
    for row in rows[:4]:
        commit = json.loads(row["parsed_commit_content"])
        fd = commit["file_diffs"][0]
        repo = tmp_path / row["repo_name"]
        target = repo / fd["header"]["file"]["path"]
        target.parent.mkdir(parents=True)
        target.write_text(fd["old_file_content"])
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(["git", "apply", "-"], cwd=repo, input=gold_patch(row), text=True, check=True)
        assert target.read_text() == fd["new_file_content"]


def test_training_order_fixed_and_shuffled():
    ids = [f"t{i}" for i in range(20)]
    fixed = [training_order(ids, epoch=e, seed=3) for e in range(3)]
    assert fixed[0] == fixed[1] == fixed[2] and sorted(fixed[0]) == sorted(ids) and fixed[0] != sorted(ids)
    assert training_order(list(reversed(ids)), 0, seed=3) == fixed[0]  # table order does not matter
    shuffled = [training_order(ids, epoch=e, seed=3, order="shuffled") for e in range(3)]
    assert len({tuple(s) for s in shuffled}) == 3
    assert training_order(ids, 1, 3, "shuffled") == shuffled[1]  # reproducible
    # Batches walk the order and continue into the next epoch.
    b = [training_batch(ids, step, 8, seed=3) for step in range(3)]
    assert b[0] + b[1] + b[2][:4] == fixed[0] and b[2][4:] == fixed[0][:4]
    with pytest.raises(ValueError):
        training_order(ids, order="random")


def test_environment_uri_must_stay_in_the_dataset_store(rows, file_store):
    good = [r for r in rows if r["repo_name"] in ("aiohttp", "tornado", "pillow", "datalad")][:4]
    inside = file_store.uri("environments/a.tar.gz")
    hostile = {
        "file:///etc/shadow": "not inside the dataset store",
        "s3://other-bucket/environments/a.tar.gz": "not inside the dataset store",
        inside.replace("environments/", "environments/../../../"): "leaves the dataset store",
        "environments/../../outside.tar.gz": "leaves the dataset store",
    }
    for uri, problem in hostile.items():
        test_rows = [dict(good[0], environment_uri=uri)] + good[1:] + [dict(good[1], commit_hash="f" * 40)]
        # A hostile row is left out and reported by instance and column; the rest still load.
        table, report = r2e.to_tasks(test_rows, 3, 1, store=file_store)
        iid = r2e.instance_id_for(good[0])
        assert [(i.instance, i.column) for i in report.issues] == [(iid, "environment_uri")], uri
        assert problem in str(report.issues[0]) and iid not in table["instance_id"].to_pylist()
    # Keys and URIs under the store's root are kept as given; without a store only keys are.
    ok = [dict(good[0], environment_uri=inside), dict(good[1], environment_uri="environments/b.tar.gz")] + good[2:]
    table, report = r2e.to_tasks(ok, 3, 1, store=file_store)
    assert not report.issues and set(table["environment_uri"].to_pylist()) == {inside, "environments/b.tar.gz", None}
    _, report = r2e.to_tasks(ok, 2, 1)
    assert [i.column for i in report.issues] == ["environment_uri"] and "none given" in str(report.issues[0])


def test_file_diffs_the_verifier_cannot_read_are_reported_per_row(rows):
    good = [r for r in rows if r["repo_name"] in ("aiohttp", "tornado", "pillow", "datalad")][:4]
    commit = json.loads(good[0]["parsed_commit_content"])
    no_header = dict(commit, file_diffs=[{k: v for k, v in fd.items() if k != "header"} for fd in commit["file_diffs"]])
    no_body = dict(commit, file_diffs=[{"header": fd["header"]} for fd in commit["file_diffs"]])
    bad_hunks = dict(commit, file_diffs=[{"header": fd["header"], "hunks": [{"line_group": {}}]}
                                         for fd in commit["file_diffs"]])
    for broken, problem in ((no_header, "file_diffs[0] has no header.file.path"),
                            (no_body, "neither old/new_file_content nor a 'hunks' list"),
                            (bad_hunks, "cannot be rebuilt into the gold patch (KeyError")):
        test_rows = [dict(good[0], parsed_commit_content=json.dumps(broken))] + good[1:]
        table, report = r2e.to_tasks(test_rows, 2, 1)
        iid = r2e.instance_id_for(good[0])
        assert [(i.instance, i.column) for i in report.issues] == [(iid, "parsed_commit_content")]
        assert problem in str(report.issues[0]), str(report.issues[0])
        assert iid not in table["instance_id"].to_pylist()
