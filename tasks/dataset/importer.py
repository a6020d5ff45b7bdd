"""Import a user's own repositories as verified tasks.

    python -m tasks.dataset.importer DIR [--store ROOT] [--backend bwrap|docker] [--offline]
                                         [--num-validation N] [--seed S]

DIR (a local directory or an object-store prefix) holds one directory per task: repo/, r2e_tests/,
gold.patch, task.json (an R2E-Gym-style row, with "requirements" / "pythonpath" for a task that
brings its own virtualenv), optionally run_tests.sh. The input layout, the archive each task becomes
and what is written where are documented in one place: tasks/sandbox/__init__.py. Every task is
verified in sandboxes (gold patch 1 twice, empty patch 0); one that fails any step is reported by
name with the reason and its test log tail and left out. Exit status 1 when any task was left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from schemas.config import SandboxConfig, StorageConfig
from tasks.dataset import mini, r2e
from tasks.dataset.verify import check_tasks
from tasks.grading import grade_patch
from tasks.sandbox import RUN_TESTS_SH, EnvironmentSpecError, image
from tasks.sandbox.environment import build_archive_from_dir, snapshot_left_out
from tasks.storage import Store

VENV_BUILD_TIMEOUT_S = 900.0
LOG_TAIL_CHARS = 2000


class ImportFailure(Exception):
    """One task cannot be imported: the message says why (with a log tail where there is one)."""


@dataclass
class ImportResult:
    verified: dict[str, dict] = field(default_factory=dict)  # name -> tasks row
    failed: dict[str, str] = field(default_factory=dict)  # name -> why
    notes: dict[str, list[str]] = field(default_factory=dict)  # name -> what was left out of its snapshot
    seconds: dict[str, float] = field(default_factory=dict)  # name -> archive build (venv included)
    verify_seconds: float = 0.0
    rows_key: str | None = None
    tasks_key: str | None = None


# ----------------------------------------------------------------------------- one task
def _tail(text: str) -> str:
    return text[-LOG_TAIL_CHARS:]


def build_venv(task_dir: pathlib.Path, requirements: list[str], pythonpath: list[str], sandbox_cfg,
               out: pathlib.Path, offline: bool = False) -> pathlib.Path:
    """A virtualenv for /testbed/.venv at out/.venv: wheels resolved on the host, installed by the
    image's Python in a sandbox (no network there)."""
    from tasks.sandbox import Environment, open_sandbox

    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    if requirements:
        args = [a for req in requirements for a in (shlex.split(req) if req.startswith("-") else [req])]
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels)]
        cmd += ["--no-index", "--no-build-isolation"] if offline else []
        r = subprocess.run(cmd + args, cwd=task_dir, capture_output=True, text=True)
        if r.returncode != 0:
            raise ImportFailure(f"pip wheel {' '.join(args)} failed (exit {r.returncode}):\n{_tail(r.stdout + r.stderr)}")
    # A throwaway environment holding only an empty repository: the sandbox needs a /testbed with a .git.
    env_root = out / "env"
    (env_root / "hidden").mkdir(parents=True)
    os.chmod(out, 0o755)  # bwrap binds the env's .git as an unprivileged host user
    subprocess.run(["git", "init", "-q", str(env_root / "testbed")], check=True)
    env = Environment(kind="archive", key=f"venv-build-{os.getpid()}", image=sandbox_cfg.image, root=env_root)
    import pip  # this environment's pip runs under the image's Python in the sandbox

    script = ["set -e", "/usr/bin/python3 -m venv --system-site-packages --without-pip /testbed/.venv"]
    if any(wheels.iterdir()):
        script.append("PYTHONPATH=/tmp/pip /testbed/.venv/bin/python -m pip install -q --no-index --no-deps "
                      "--no-cache-dir --no-compile --disable-pip-version-check /tmp/wheels/*.whl")
    with open_sandbox({"instance_id": f"venv-build:{task_dir.name}"}, sandbox_cfg, env=env) as sb:
        sb.copy_tree_in(pathlib.Path(pip.__file__).parent, "/tmp/pip/pip")
        if any(wheels.iterdir()):
            sb.copy_tree_in(wheels, "/tmp/wheels")
        r = sb.run("\n".join(script), timeout=VENV_BUILD_TIMEOUT_S, output_cap=256 * 1024)
        if not r.ok:
            raise ImportFailure(f"building the virtualenv in the sandbox failed (exit {r.exit_code}):\n{_tail(r.output)}")
        shutil.copytree(sb.host_testbed() / ".venv", out / ".venv", symlinks=True)
    if pythonpath:  # what an editable install of the repo amounts to: its source dirs on sys.path
        site = next((out / ".venv").glob("lib/python3*/site-packages"))
        (site / "_rlvr_pythonpath.pth").write_text("".join(f"/testbed/{p.strip('/')}\n" for p in pythonpath))
    return out / ".venv"


def parsed_commit_from_patch(repo: pathlib.Path, patch: str, message: str) -> dict:
    """R2E-Gym's ParsedCommit for a gold patch against a repo snapshot: each file's old and new text."""
    from tasks.grading import patch_paths

    with tempfile.TemporaryDirectory(prefix="rlvr-gold-") as d:
        after = pathlib.Path(d) / "repo"
        shutil.copytree(repo, after, symlinks=True, ignore=shutil.ignore_patterns(".git", ".venv"))
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=after, input=patch.encode(),
                           capture_output=True)
        if r.returncode != 0:
            raise ImportFailure(f"gold.patch does not apply to repo/: {r.stderr.decode(errors='replace').strip()}")
        diffs = []
        for path in patch_paths(patch):
            try:
                old = (repo / path).read_text() if (repo / path).is_file() else ""
                new = (after / path).read_text() if (after / path).is_file() else ""
            except UnicodeDecodeError:
                raise ImportFailure(f"gold.patch changes {path}, which is not UTF-8 text (binary files are not supported)")
            diffs += mini.parsed_commit(path, old, new, "0" * 40, "0" * 40, message)["file_diffs"]
    return {"file_diffs": diffs, "old_commit_hash": "", "new_commit_hash": "", "commit_message": message,
            "commit_date": mini.COMMIT_DATE, "metadata": {}}


def build_task(task_dir: pathlib.Path, store, sandbox_cfg, offline: bool = False) -> tuple[dict, list[str]]:
    """(R2E-Gym-style row with environment_uri, notes) for one task directory; raises ImportFailure."""
    name, repo, tests = task_dir.name, task_dir / "repo", task_dir / "r2e_tests"
    spec_path = task_dir / "task.json"
    try:
        spec = json.loads(spec_path.read_text()) if spec_path.exists() else {}
    except ValueError as e:
        raise ImportFailure(f"task.json is not valid JSON: {e}") from None
    for need in (repo, tests):
        if not need.is_dir():
            raise ImportFailure(f"no {need.name}/ directory")
    # The testbed's commit and history tell the agent nothing: not this directory's name, no .git.
    notes = [f"repo/{p} left out " + ("(the environment has its own)" if p in (".git", ".venv") else
                                      "(a nested repository's history; its files stay)")
             for p in snapshot_left_out(repo)]
    run_tests = (task_dir / "run_tests.sh").read_text() if (task_dir / "run_tests.sh").exists() else RUN_TESTS_SH
    if "parsed_commit_content" in spec:
        commit = spec.pop("parsed_commit_content")
        commit = json.loads(commit) if isinstance(commit, str) else commit
    elif (task_dir / "gold.patch").exists():
        commit = parsed_commit_from_patch(repo, (task_dir / "gold.patch").read_text(), f"{name}: fix")
    else:
        raise ImportFailure("neither gold.patch nor parsed_commit_content in task.json")
    requirements, pythonpath = spec.pop("requirements", []), spec.pop("pythonpath", [])
    with tempfile.TemporaryDirectory(prefix="rlvr-import-") as d:
        venv = None
        if requirements or pythonpath:
            venv = build_venv(task_dir, requirements, pythonpath, sandbox_cfg, pathlib.Path(d), offline)
        try:
            archive, head = build_archive_from_dir(repo, tests, run_tests, venv=venv)
        except EnvironmentSpecError as e:
            raise ImportFailure(str(e)) from None
    uri = store.put_bytes(f"environments/import/{hashlib.sha256(archive).hexdigest()[:24]}.tar.gz", archive)
    row = dict(spec, repo_name=spec.get("repo_name", name), commit_hash=spec.get("commit_hash", head),
               docker_image=spec.get("docker_image", sandbox_cfg.image), environment_uri=uri,
               parsed_commit_content=json.dumps(commit))
    gold = mini.gold_patch(row)
    row.setdefault("modified_files", [fd["header"]["file"]["path"] for fd in commit["file_diffs"]
                                      if not mini._is_test_file(fd["header"]["file"]["path"])])
    if "expected_output_json" not in row:  # the statuses after the fix, which verification then checks
        row["expected_output_json"] = json.dumps(_expected_from_gold(row, gold, store, sandbox_cfg))
    return row, notes


def _expected_from_gold(row: dict, gold: str, store, sandbox_cfg) -> dict:
    res = grade_patch(dict(row, instance_id=r2e.instance_id_for(row), expected_output_json="{}"), gold,
                      sandbox_cfg, store)
    if res.grading_status != "graded" or not res.test_statuses or "" in res.test_statuses:
        raise ImportFailure(f"no expected_output_json, and a gold-patch run gives none ({res.grading_status}: "
                            f"{res.error or 'no test results'}):\n{_tail(res.test_output)}")
    return res.test_statuses


# ----------------------------------------------------------------------------- a directory
def _local_copy(src: str, tmp: pathlib.Path, store) -> pathlib.Path:
    """An object-store prefix fetched to a local dir (an object store keeps no file modes or symlinks:
    import such repos from a directory). The store's own scheme is read with its credentials and endpoint."""
    if "://" not in src or src.startswith("file://"):
        return pathlib.Path(src.removeprefix("file://"))
    if src.startswith(store.scheme + "://"):
        fs, path = store.fs, store.path(src)
    else:
        import fsspec

        fs, path = fsspec.core.url_to_fs(src)
    fs.get(path.rstrip("/") + "/", str(tmp / "src") + "/", recursive=True)
    return tmp / "src"


def import_tasks(src: str | os.PathLike, store, sandbox_cfg, offline: bool = False, num_validation: int | None = None,
                 seed: int = 0, log=print) -> ImportResult:
    """Build, verify and store every task under src (see the module docstring); never raises for one task."""
    res = ImportResult()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlvr-import-src-") as tmp:
        root = _local_copy(str(src), pathlib.Path(tmp), store)
        dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        for d in dirs:
            t0 = time.monotonic()
            try:
                row, res.notes[d.name] = build_task(d, store, sandbox_cfg, offline)
                row["instance_id"] = r2e.instance_id_for(row)
                checked, issues = r2e._check_row(row, d.name, store)  # what the loader will ask of the row
                if issues:
                    raise ImportFailure("; ".join(str(i) for i in issues))
                rows[d.name] = dict(row, **checked)  # JSON columns as text, as the tasks table holds them
            except ImportFailure as e:
                res.failed[d.name] = str(e)
            except Exception as e:  # a sandbox or tool failure on this task: report it, go on with the rest
                res.failed[d.name] = f"{type(e).__name__}: {e}"
            res.seconds[d.name] = time.monotonic() - t0
    t0 = time.monotonic()
    names: dict[str, str] = {}
    for name in sorted(rows):
        iid = rows[name]["instance_id"]
        if iid in names:  # <repo_name>__<commit[:12]>: set commit_hash in task.json to tell them apart
            res.failed[name] = f"same instance id {iid} as task {names[iid]}"
            rows.pop(name)
        else:
            names[iid] = name
    bad = check_tasks(list(rows.values()), store, sandbox_cfg, gold_runs=2, cache=True)
    res.verify_seconds = time.monotonic() - t0
    for iid, why in bad.items():
        res.failed[names[iid]] = "verification: " + why
        rows.pop(names[iid])
    res.verified = rows
    for name in sorted(res.failed):
        log(f"FAILED {name}: {res.failed[name]}\n  -> left out")
    for name, row in sorted(rows.items()):
        log(f"verified {name} ({row['instance_id']}): gold 1 twice, empty 0"
            + "".join(f"; {n}" for n in res.notes.get(name, [])))
    if rows:
        _write(res, store, num_validation, seed, log)
    return res


def _write(res: ImportResult, store, num_validation: int | None, seed: int, log) -> None:
    rows = [res.verified[n] for n in sorted(res.verified)]
    body = "".join(json.dumps({k: v for k, v in r.items() if k != "instance_id"}, sort_keys=True) + "\n" for r in rows)
    did = "import-" + hashlib.sha256(body.encode()).hexdigest()[:12]
    nv = len(rows) // 4 if num_validation is None else min(num_validation, len(rows))
    table, _ = r2e.to_tasks([json.loads(line) for line in body.splitlines()], len(rows) - nv, nv, seed,
                            source=did, store=store)
    rows_uri = store.put_bytes(f"datasets/{did}/rows.jsonl", body.encode())
    res.rows_key, res.tasks_key = f"datasets/{did}/rows.jsonl", f"datasets/{did}/tasks.parquet"
    store.write_table(res.tasks_key, table, stage="tasks")
    store.put_json(f"datasets/{did}/import_report.json",
                   {"verified": sorted(res.verified), "failed": res.failed, "notes": res.notes,
                    "build_seconds": {k: round(v, 2) for k, v in res.seconds.items()},
                    "verify_seconds": round(res.verify_seconds, 2)})
    log(f"{len(rows)} tasks verified ({len(rows) - nv} train, {nv} validation): {store.uri(res.tasks_key)}")
    if nv and len(rows) - nv:
        log(f"train on them: make run ARGS=\"dataset.source=r2e dataset.path={rows_uri} "
            f"dataset.num_train={len(rows) - nv} dataset.num_validation={nv}\"")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.dataset.importer", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="directory (or object-store prefix) with one directory per task")
    p.add_argument("--store", default=StorageConfig().root, help="object store root (default: %(default)s)")
    p.add_argument("--backend", choices=["bwrap", "docker"], default="bwrap")
    p.add_argument("--offline", action="store_true", help="pip without an index: local packages and PIP_FIND_LINKS")
    p.add_argument("--num-validation", type=int, default=None, help="validation tasks (default: a quarter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=2, help="sandboxes at once")
    a = p.parse_args(argv)

    image.ensure_image(docker_too=a.backend == "docker")
    cfg = SandboxConfig(backend=a.backend, concurrency=a.concurrency)
    res = import_tasks(a.src, Store(a.store), cfg, offline=a.offline, num_validation=a.num_validation, seed=a.seed)
    return 1 if res.failed else 0


if __name__ == "__main__":
    sys.exit(main())
