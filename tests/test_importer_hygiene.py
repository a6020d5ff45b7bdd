"""What the agent must not see: a testbed holds the snapshot and nothing else. No history of the
repository or of a repository nested in it, a commit message that does not name the task, one
branch with one commit, no reflogs, no unreachable objects, no hooks, no paths in its config.
Checked on every archive builder (import, in-memory files, the mini benchmark's) and in a
sandbox, where grading still applies patches against that one commit."""

import io
import json
import pathlib
import subprocess
import tarfile
import zlib

import pytest

from tests.fixtures.sandbox import sandbox_cfg

NAME = "fix-off-by-one-in-parser"  # a descriptive task folder name: it tells the bug
SECRETS = (NAME, "secret fix", "SECRET-FIX-CONTENT")
BUGGY = "def fields(line):\n    return line.split(',')[:-1]\n"
FIXED = "def fields(line):\n    return line.split(',')\n"
TEST = ("from lineparse import fields\nfrom vendor.lib.helper import twice\n\n\n"
        "def test_fields():\n    assert fields('a,b') == ['a', 'b']\n\n\n"
        "def test_twice():\n    assert twice(2) == 4\n")


def git(cwd: pathlib.Path, *args: str, check: bool = True) -> str:
    env = {"GIT_AUTHOR_NAME": "dev", "GIT_AUTHOR_EMAIL": "dev@example.com", "GIT_COMMITTER_NAME": "dev",
           "GIT_COMMITTER_EMAIL": "dev@example.com", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} in {cwd} failed: {r.stderr}")
    return r.stdout


def task_with_history(dest: pathlib.Path) -> pathlib.Path:
    """A task as a user may hand it over: the repo's own .git with the fix on a branch, a vendored
    repository (vendor/lib/.git) whose history holds a "secret fix" commit, and a submodule's gitfile."""
    from tasks.dataset.mini import unified_diff

    task = dest / NAME
    repo = task / "repo"
    (repo / "vendor" / "lib").mkdir(parents=True)
    (repo / "lineparse.py").write_text(BUGGY)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "buggy")
    git(repo, "checkout", "-q", "-b", "the-fix")
    (repo / "lineparse.py").write_text(FIXED)
    git(repo, "commit", "-q", "-am", "secret fix: off-by-one in the parser")
    git(repo, "checkout", "-q", "main")
    lib = repo / "vendor" / "lib"
    (lib / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    git(lib, "init", "-q", "-b", "main")
    git(lib, "add", "-A")
    git(lib, "commit", "-q", "-m", "vendored helper")
    (lib / "FIX.txt").write_text("SECRET-FIX-CONTENT\n")
    git(lib, "add", "-A")
    git(lib, "commit", "-q", "-m", "secret fix: the answer")
    git(lib, "tag", "answer")
    git(lib, "reset", "-q", "--hard", "HEAD~1")  # the fix stays in the nested history only
    (repo / "sub").mkdir()
    (repo / "sub" / ".git").write_text("gitdir: ../.git/modules/sub\n")
    (repo / "sub" / "mod.py").write_text("X = 1\n")
    (task / "r2e_tests").mkdir()
    (task / "r2e_tests" / "test_1.py").write_text(TEST)
    (task / "gold.patch").write_text(unified_diff("lineparse.py", BUGGY, FIXED))
    (task / "task.json").write_text(json.dumps({
        "problem_statement": "fields('a,b') drops the last field.",
        "expected_output_json": {"test_fields": "PASSED", "test_twice": "PASSED"}}))
    return task


def extract(data: bytes, dest: pathlib.Path) -> pathlib.Path:
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        tf.extractall(dest, filter="tar")
    return dest / "testbed"


def assert_snapshot_only(tb: pathlib.Path, message: str) -> None:
    """The testbed's .git holds one commit (`message`) on main and nothing else."""
    log = git(tb, "log", "--all", "--format=%s|%an|%ad", "--date=unix").splitlines()
    assert len(log) == 1 and log[0].split("|")[0] == message, log
    assert git(tb, "for-each-ref", "--format=%(refname)").split() == ["refs/heads/main"]
    assert git(tb, "reflog", "--all") == "" and not (tb / ".git" / "logs").exists()
    assert not (tb / ".git" / "packed-refs").exists() and not (tb / ".git" / "COMMIT_EDITMSG").exists()
    assert not any((tb / ".git" / "hooks").glob("*"))
    fsck = subprocess.run(["git", "-C", str(tb), "fsck", "--full", "--unreachable", "--no-reflogs", "--no-progress"],
                          capture_output=True, text=True)
    assert fsck.returncode == 0 and fsck.stdout == "", fsck.stdout + fsck.stderr
    counts = dict(ln.split(": ") for ln in git(tb, "count-objects", "-v").splitlines())
    reachable = git(tb, "rev-list", "--objects", "--all").splitlines()
    assert int(counts["count"]) + int(counts["in-pack"]) == len(reachable), counts
    # Tracked as plain files, never a gitlink (mode 160000) to a nested repository.
    assert not [ln for ln in git(tb, "ls-files", "-s").splitlines() if ln.startswith("160000")]
    assert git(tb, "status", "--porcelain") == ""
    assert [p.relative_to(tb).as_posix() for p in tb.rglob(".git")] == [".git"]


def git_dir_text(tb: pathlib.Path) -> bytes:
    """Every byte a reader of testbed/.git can get at: its files as stored, loose objects inflated,
    and every object's content as git prints it."""
    out = []
    for p in sorted((tb / ".git").rglob("*")):
        if p.is_file():
            raw = p.read_bytes()
            out.append(raw)
            if p.parent.parent.name == "objects":
                out.append(zlib.decompress(raw))
    out.append(subprocess.run(["git", "-C", str(tb), "cat-file", "--batch-all-objects", "--batch"],
                              capture_output=True, check=True).stdout)
    return b"\n".join(out)


def test_import_keeps_only_the_snapshot(tmp_path):
    from schemas.config import SandboxConfig
    from tasks.dataset.importer import build_task
    from tasks.sandbox.environment import COMMIT_MESSAGE
    from tasks.storage import Store

    task = task_with_history(tmp_path / "src")
    # The set-up holds the fix in the nested history.
    assert "SECRET-FIX-CONTENT" in git(task / "repo" / "vendor" / "lib", "show", "answer:FIX.txt")
    store = Store(f"file://{tmp_path}/store")
    row, notes = build_task(task, store, SandboxConfig(), offline=True)
    assert notes == ["repo/.git left out (the environment has its own)",
                     "repo/sub/.git left out (a nested repository's history; its files stay)",
                     "repo/vendor/lib/.git left out (a nested repository's history; its files stay)"]
    data = store.get_bytes(row["environment_uri"])
    tb = extract(data, tmp_path / "x")
    assert_snapshot_only(tb, COMMIT_MESSAGE)
    assert row["commit_hash"] == git(tb, "rev-parse", "HEAD").strip()
    # The nested repository's files are part of the snapshot; the fix in its history is not.
    assert (tb / "vendor" / "lib" / "helper.py").read_text().startswith("def twice")
    assert (tb / "sub" / "mod.py").is_file() and (tb / "lineparse.py").read_text() == BUGGY
    assert not (tb / "vendor" / "lib" / "FIX.txt").exists()
    tracked = git(tb, "ls-files").split()
    assert tracked == ["lineparse.py", "sub/mod.py", "vendor/lib/helper.py"]
    seen = git_dir_text(tb) + zlib.decompress(data, 31)  # the whole archive, uncompressed, too
    for secret in SECRETS:
        assert secret.encode() not in seen, secret
    assert str(tmp_path).encode() not in git_dir_text(tb)
    config = git(tb, "config", "--local", "--list").splitlines()
    assert all(ln.startswith("core.") and "/" not in ln for ln in config), config


def test_every_archive_builder_keeps_only_the_snapshot(tmp_path):
    from tasks.dataset import archive as mini_archive
    from tasks.sandbox import build_environment_archive
    from tasks.sandbox.environment import COMMIT_MESSAGE

    files = {"pkg/__init__.py": "", "pkg/m.py": "x = 1\n"}
    tb = extract(build_environment_archive(files, {"test_m.py": "def test_x():\n    pass\n"}), tmp_path / "env")
    assert_snapshot_only(tb, COMMIT_MESSAGE)
    data, head = mini_archive.build_reproducible_archive(files, {"test_m.py": ""}, "Initial import of pkg")
    tb = extract(data, tmp_path / "mini")
    assert_snapshot_only(tb, "Initial import of pkg")
    assert git(tb, "rev-parse", "HEAD").strip() == head


def test_sandbox_and_grading_see_one_plain_commit(sandbox_backend, tmp_path):
    """In a sandbox: one commit, the vendored files tracked (a change to them is an ordinary diff),
    and grading applies the gold patch against that commit."""
    from tasks.dataset.importer import build_task
    from tasks.dataset.mini import gold_patch
    from tasks.dataset.r2e import instance_id_for
    from tasks.grading import grade_patch
    from tasks.sandbox import open_sandbox
    from tasks.storage import Store

    store, cfg = Store(f"file://{tmp_path}/store"), sandbox_cfg(sandbox_backend)
    row, _ = build_task(task_with_history(tmp_path / "src"), store, cfg, offline=True)
    row = dict(row, instance_id=instance_id_for(row), expected_output_json=json.dumps(row["expected_output_json"]))
    with open_sandbox(row, cfg, store) as sb:
        r = sb.run("git log --all --format=%s && git reflog --all | wc -l && git status --porcelain | wc -l")
        assert r.output.split("\n")[:3] == ["buggy state", "0", "0"], r.output
        sb.run("echo '# local change' >> vendor/lib/helper.py")
        patch = sb.diff()
    assert patch.startswith("diff --git a/vendor/lib/helper.py b/vendor/lib/helper.py\n") and "+# local change" in patch
    assert "Subproject" not in patch
    gold = grade_patch(row, gold_patch(row), cfg, store)
    assert (gold.grading_status, gold.reward) == ("graded", 1.0), gold.error or gold.test_output[-2000:]
    empty = grade_patch(row, "", cfg, store)
    assert (empty.grading_status, empty.reward) == ("graded", 0.0), empty.error
