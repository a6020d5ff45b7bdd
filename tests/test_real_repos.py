"""Real-style repositories (tests/data/import_tasks): per-task virtualenvs (a pytest plugin that
setup.cfg's addopts needs, a src layout), archives that keep file modes, symlinks and empty
directories, a testbed with its own .venv, the import command, verification of loaded R2E rows,
and environment errors that are never scored as 0."""

import io
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pyarrow as pa
import pytest

from tests.fixtures.sandbox import sandbox_cfg

TASKS_DIR = pathlib.Path(__file__).parent / "data" / "import_tasks"
GOOD = ["covplugin", "execfile", "ownvenv", "srclayout"]


def task_tree(dest: pathlib.Path, names=GOOD) -> pathlib.Path:
    """The test tasks as a user hands them over: what git cannot hold (an empty directory, a
    testbed's own .venv made on this machine) added here."""
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copytree(TASKS_DIR / n, dest / n, symlinks=True)
    if "execfile" in names:
        (dest / "execfile" / "repo" / "data" / "empty").mkdir(parents=True)
        (dest / "execfile" / "repo" / "bin" / "greet").chmod(0o755)
    if "ownvenv" in names:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest / "ownvenv" / "repo" / ".venv")],
                       check=True)
    return dest


def broken_task(dest: pathlib.Path) -> pathlib.Path:
    """covplugin without its requirements: setup.cfg's --cov is unknown to pytest, no test can run."""
    shutil.copytree(TASKS_DIR / "covplugin", dest / "nocov", symlinks=True)
    spec = json.loads((dest / "nocov" / "task.json").read_text())
    del spec["requirements"]
    spec["repo_name"] = "nocov"
    (dest / "nocov" / "task.json").write_text(json.dumps(spec))
    return dest / "nocov"


def harmless_edit(row: dict) -> str:
    from tasks.dataset.mini import unified_diff

    fd = json.loads(row["parsed_commit_content"])["file_diffs"][0]
    old = fd["old_file_content"]
    return unified_diff(fd["header"]["file"]["path"], old, old + "\n# a harmless comment\n")


@pytest.fixture(scope="module")
def imported(sandbox_backend, tmp_path_factory):
    """Every good task imported (archives, virtualenvs, verification) on the backend, in a store of its own."""
    from tasks.dataset.importer import import_tasks
    from tasks.storage import Store

    tmp = tmp_path_factory.mktemp(f"import-{sandbox_backend}")
    store = Store(f"file://{tmp}/store")
    lines = []
    res = import_tasks(task_tree(tmp / "src"), store, sandbox_cfg(sandbox_backend), offline=True, log=lines.append)
    return {"backend": sandbox_backend, "store": store, "res": res, "log": "\n".join(lines)}


# -- archives -----------------------------------------------------------------------------------
def test_archive_keeps_modes_symlinks_and_empty_dirs_and_leaves_out_a_foreign_venv(tmp_path):
    from tasks.sandbox import EnvironmentSpecError
    from tasks.sandbox.environment import build_archive_from_dir

    src = task_tree(tmp_path / "src", ["execfile", "ownvenv"])
    shutil.copytree(src / "ownvenv" / "repo" / ".venv", src / "execfile" / "repo" / ".venv", symlinks=True)
    data, head = build_archive_from_dir(src / "execfile" / "repo", src / "execfile" / "r2e_tests")
    members = {m.name: m for m in tarfile.open(fileobj=io.BytesIO(data)).getmembers()}
    assert members["testbed/bin/greet"].mode & 0o777 == 0o755
    assert members["testbed/README.md"].mode & 0o777 == 0o644
    assert members["testbed/greet"].issym() and members["testbed/greet"].linkname == "bin/greet"
    assert members["testbed/data/empty"].isdir()
    # The testbed's own .venv (this machine's interpreter) is replaced by the image's interpreter link.
    venv = sorted(n for n in members if n.startswith("testbed/.venv/"))
    assert venv == ["testbed/.venv/bin", "testbed/.venv/bin/python"]
    assert members["testbed/.venv/bin/python"].linkname == "/usr/bin/python3"
    out = tmp_path / "x"
    tarfile.open(fileobj=io.BytesIO(data)).extractall(out, filter="tar")
    tracked = subprocess.run(["git", "-C", str(out / "testbed"), "ls-files", "-s"], capture_output=True, text=True,
                             check=True).stdout
    assert "100755" in next(ln for ln in tracked.splitlines() if ln.endswith("\tbin/greet"))
    assert head == subprocess.run(["git", "-C", str(out / "testbed"), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, check=True).stdout.strip()
    (src / "execfile" / "repo" / "run_tests.sh").write_text("true\n")
    with pytest.raises(EnvironmentSpecError, match="must not contain run_tests.sh"):
        build_archive_from_dir(src / "execfile" / "repo", src / "execfile" / "r2e_tests")


def test_environment_cache_key_includes_the_image(tmp_path, monkeypatch):
    from tasks.sandbox import build_environment_archive, resolve_environment
    from tasks.storage import Store

    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))
    store = Store(f"file://{tmp_path}/store")
    uri = store.put_bytes("environments/t.tar.gz", build_environment_archive({"m.py": "x = 1\n"}, {"test_m.py": ""}))
    row = {"instance_id": "t", "environment_uri": uri}
    a, b = resolve_environment(row, store, base_image="img:a"), resolve_environment(row, store, base_image="img:b")
    assert (a.image, b.image) == ("img:a", "img:b") and a.key == b.key
    assert resolve_environment(row, store, base_image="img:a") is a
    assert not a.plugins  # only the interpreter link: plugin autoload stays off


# -- grading imported repos ---------------------------------------------------------------------
def test_import_verifies_every_real_style_repo(imported):
    res = imported["res"]
    assert res.failed == {} and sorted(res.verified) == GOOD, imported["log"]
    assert res.notes["ownvenv"] == ["repo/.venv left out (the environment has its own)"]
    store = imported["store"]
    table = store.read_table(res.tasks_key, stage="tasks")
    assert sorted(table["repo_name"].to_pylist()) == GOOD
    assert sorted(table["split"].to_pylist()) == ["train"] * 3 + ["validation"]
    rows = [json.loads(ln) for ln in store.get_bytes(res.rows_key).decode().splitlines()]
    assert all(store.exists(r["environment_uri"]) for r in rows)


@pytest.mark.parametrize("name", GOOD)
def test_real_style_repo_grades_right(imported, name):
    from tasks.dataset.mini import gold_patch
    from tasks.grading import grade_patch

    row, store = imported["res"].verified[name], imported["store"]
    cfg = sandbox_cfg(imported["backend"])
    gold = grade_patch(row, gold_patch(row), cfg, store)
    assert (gold.grading_status, gold.reward) == ("graded", 1.0), gold.error or gold.test_output[-2000:]
    empty = grade_patch(row, "", cfg, store)
    assert (empty.grading_status, empty.reward, empty.patch_applied) == ("graded", 0.0, True), empty.error
    harmless = grade_patch(row, harmless_edit(row), cfg, store)
    assert (harmless.grading_status, harmless.reward, harmless.patch_applied) == ("graded", 0.0, True), harmless.error
    if name == "covplugin":  # the plugin from the task's own virtualenv ran (autoload on)
        assert "fakecov: would measure tally" in gold.test_output


def test_patch_that_breaks_the_tests_is_still_a_zero(imported):
    """Tests that do not run because of the patch keep R2E-Gym's 0: the pristine state runs them."""
    from tasks.dataset.mini import unified_diff
    from tasks.grading import grade_patch

    row = imported["res"].verified["srclayout"]
    fd = json.loads(row["parsed_commit_content"])["file_diffs"][0]
    broken = unified_diff(fd["header"]["file"]["path"], fd["old_file_content"], "def slugify(:\n")
    res = grade_patch(row, broken, sandbox_cfg(imported["backend"]), imported["store"])
    assert (res.grading_status, res.reward, res.patch_applied) == ("graded", 0.0, True), res.error
    assert res.test_statuses == {"": "ERROR"}  # the collection error, as R2E-Gym parses it


def test_tests_that_cannot_run_are_env_errors_never_zero(imported, tmp_path):
    from schemas.tables import REWARDS
    from tasks.dataset.importer import build_task
    from tasks.dataset.mini import gold_patch
    from tasks.dataset.r2e import instance_id_for
    from tasks.grading import grade_rollouts

    store, cfg = imported["store"], sandbox_cfg(imported["backend"])
    row, _ = build_task(broken_task(tmp_path), store, cfg, offline=True)
    row = dict(row, instance_id=instance_id_for(row), expected_output_json=json.dumps(row["expected_output_json"]))
    items = [("r-empty", "run", 1, row, ""), ("r-gold", "run", 1, row, gold_patch(row)),
             ("r-edit", "run", 1, row, harmless_edit(row))]
    table = REWARDS.validate(grade_rollouts(items, cfg, store))
    for r in table.to_pylist():
        assert (r["grading_status"], r["reward"]) == ("env_error", None), r
        assert "unrecognized arguments: --cov=tally" in r["error"] and "without a patch" in r["error"]


def test_import_command_verifies_the_good_task_and_reports_the_broken_one(sandbox_rootfs, tmp_path, capsys):
    from tasks.dataset.importer import main

    src = task_tree(tmp_path / "src", ["execfile"])
    broken_task(src)
    rc = main([str(src), "--store", f"file://{tmp_path}/store", "--offline"])
    out = capsys.readouterr().out
    assert rc == 1  # a task was left out
    assert "verified execfile (execfile__" in out and "FAILED nocov: verification: " in out, out
    assert "env_error" in out and "unrecognized arguments: --cov=tally" in out  # its test log, by name
    (path,) = (tmp_path / "store" / "datasets").glob("import-*/rows.jsonl")
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["repo_name"] for r in rows] == ["execfile"]
    report = json.loads((path.parent / "import_report.json").read_text())
    assert report["verified"] == ["execfile"] and "--cov" in report["failed"]["nocov"]


def test_import_from_an_object_store_prefix(sandbox_rootfs, s3_store, tmp_path):
    from tasks.dataset.importer import import_tasks

    src = TASKS_DIR / "srclayout"
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        s3_store.put_bytes(f"incoming/tasks/srclayout/{f.relative_to(src).as_posix()}", f.read_bytes())
    res = import_tasks(s3_store.uri("incoming/tasks"), s3_store, sandbox_cfg("bwrap"), log=lambda *_: None)
    assert sorted(res.verified) == ["srclayout"] and not res.failed, res.failed
    assert res.verified["srclayout"]["environment_uri"].startswith("s3://")


def test_loaded_r2e_rows_with_archives_are_verified_and_failures_left_out(sandbox_rootfs, tmp_path):
    from schemas.config import DatasetConfig
    from tasks.dataset import r2e
    from tasks.dataset.build import build_dataset
    from tasks.dataset.importer import build_task
    from tasks.storage import Store

    store, cfg = Store(f"file://{tmp_path}/store"), sandbox_cfg("bwrap")
    src = task_tree(tmp_path / "src", ["execfile", "srclayout"])
    rows = [build_task(src / n, store, cfg, offline=True)[0] for n in ("execfile", "srclayout")]
    rows.append(build_task(broken_task(src), store, cfg, offline=True)[0])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A seed whose selection (2 of the 3 rows) takes the broken one: verification must replace it.
    seed = next(s for s in range(50) if "nocov" in [r["repo_name"] for r in sorted(
        rows, key=lambda r: r2e._order_key(s, r2e.instance_id_for(r)))[:2]])
    dcfg = DatasetConfig(source="r2e", path=str(path), num_train=1, num_validation=1, seed=seed)
    key = build_dataset(dcfg, store, cfg)
    table = store.read_table(key, stage="tasks")
    assert sorted(table["repo_name"].to_pylist()) == ["execfile", "srclayout"]
    report = store.get_json(key.replace("tasks.parquet", "load_report.json"))
    (issue,) = report["issues"]
    assert issue["column"] == "verification" and issue["instance"].startswith("nocov__")
    assert "env_error" in issue["problem"] and "--cov" in issue["problem"]
    assert build_dataset(dcfg, store, cfg) == key  # cached


def test_prepare_builds_the_sandbox_image_for_r2e_rows_with_archives(tmp_path, monkeypatch):
    from flows.prepare import sandbox_image
    from schemas.presets import load_config
    from tasks.sandbox import image

    built = []
    monkeypatch.setattr(image, "ensure_image", lambda docker_too=True: built.append(docker_too) or tmp_path)
    for uri, want in ((None, []), ("environments/a.tar.gz", [False])):
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps({"repo_name": "r", "environment_uri": uri}) + "\n")
        cfg = load_config("smoke", ["dataset.source=r2e", f"dataset.path={path}", "sandbox.backend=bwrap",
                                    f"storage.root=file://{tmp_path}/store"])
        built.clear()
        sandbox_image.fn(cfg)
        assert built == want


# -- env errors downstream, and the grader's decision without sandboxes -------------------------
def _rewards(statuses):
    from schemas.tables import REWARDS

    rows = [{"rollout_id": f"r{i}", "run_id": "run", "step": 1, "instance_id": "t", "reward": rw,
             "grading_status": st, "error": None if st == "graded" else f"{st}: why\nlog tail",
             "patch_applied": True, "test_statuses": "{}", "attempts": 1, "sandbox_start_seconds": 0.0,
             "test_seconds": 0.0, "total_seconds": 0.0, "harness_changes": None}
            for i, (st, rw) in enumerate(statuses)]
    return REWARDS.validate(REWARDS.from_rows(rows))


def test_env_errors_are_masked_downstream():
    from schemas.config import GRPOConfig
    from schemas.tables import REWARDS, TableValidationError
    from tasks.evaluation import eval_samples_table
    from tasks.grpo.advantages import MASK_GRADING_ENV_ERROR, compute_advantages

    rewards = _rewards([("graded", 1.0), ("graded", 0.0), ("env_error", None), ("infra_error", None)])
    traj = pa.table({"rollout_id": [f"r{i}" for i in range(4)], "run_id": ["run"] * 4, "step": [1] * 4,
                     "group_id": ["g"] * 4, "instance_id": ["t"] * 4, "finish_reason": ["submitted"] * 4,
                     "policy_version": [1] * 4, "sample_index": list(range(4))})
    adv = compute_advantages(traj, rewards, GRPOConfig()).to_pylist()
    assert [a["mask_reason"] for a in adv] == [None, None, MASK_GRADING_ENV_ERROR, "grading_infra_error"]
    assert adv[2]["advantage"] == 0.0 and adv[0]["group_valid"] == 2
    ev = eval_samples_table(traj, rewards).to_pylist()
    assert [e["masked"] for e in ev] == [False, False, True, True] and ev[2]["reward"] is None
    assert ev[2]["mask_reason"] == "env_error: why"
    with pytest.raises(TableValidationError, match="reward_iff_graded"):
        _rewards([("env_error", 0.0)])
    assert REWARDS.validate(_rewards([("infra_error", None)]))  # tables written before env_error still read


class _Box:
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def run(self, cmd, timeout=None, **kw):
        from tasks.sandbox import CommandResult

        tests = "bash /root/run_tests.sh;" in cmd
        return CommandResult(exit_code=(1 if self.log else 4) if tests else 0, output=self.log if tests else "",
                             timed_out=False, seconds=0.01)


def test_no_results_is_an_env_error_only_when_the_pristine_state_has_none_either(monkeypatch):
    import tasks.grading.grader as grader

    row = {"instance_id": "t", "environment_uri": "e", "expected_output_json": json.dumps({"test_a": "PASSED"})}
    ok = "short test summary info\nFAILED r2e_tests/test_1.py::test_a - assert 0\n"
    patch = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n"
    cfg = sandbox_cfg("bwrap")
    for pristine, status, reward in ((ok, "graded", 0.0), ("ERROR: usage: unrecognized arguments\n", "env_error", None)):
        logs = iter(["", pristine])  # the patch's run prints nothing; then the pristine check
        monkeypatch.setattr(grader, "open_sandbox", lambda *a, **k: _Box(next(logs)))
        monkeypatch.setattr(grader, "patch_paths", lambda p: ["m.py"])
        grader._PRISTINE.clear()
        res = grader.grade_patch(row, patch, cfg, None)
        assert (res.grading_status, res.reward, res.attempts) == (status, reward, 1), res.error
    # A collection error the expectation lacks counts as "did not run"; one it has does not.
    assert grader.tests_did_not_run({"": "ERROR", "test_a": "PASSED"}, {"test_a": "PASSED"})
    assert grader.tests_did_not_run({"": "ERROR"}, {"": "ERROR"}) is None
    assert grader.harness_reason("evil.dist-info/entry_points.txt", added=True)
