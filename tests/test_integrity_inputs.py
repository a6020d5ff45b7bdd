"""Inputs that must not reach the host (issue 30): hostile environment archives and run ids.

The archives are extracted for real (`resolve` -> `_extract`, as root: the permission fix-up
chowns), into a temporary RLVR_CACHE_DIR, never into the project's .rlvr/sandbox.
"""

from __future__ import annotations

import functools
import gzip
import io
import os
import subprocess
import sys
import tarfile

import pytest

from tasks.sandbox.environment import EnvironmentError_, resolve
from tasks.storage import RunIdError, check_run_id

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def envs(tmp_path, monkeypatch, file_store):
    """put(name, archive bytes) -> the task row; extraction goes to tmp_path/cache."""
    if os.geteuid() != 0:
        pytest.skip("extraction chowns to root")
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))

    def put(name: str, blob: bytes) -> dict:
        uri = file_store.put_bytes(f"environments/{name}.tar.gz", blob)
        return {"instance_id": name, "environment_uri": uri}

    return put


@functools.lru_cache(maxsize=1)
def _mini_archive() -> bytes:
    from schemas.config import DatasetConfig
    from tasks.dataset import mini

    return mini.generate(DatasetConfig(num_train=1, num_validation=1))[0].archive


def _with_members(blob: bytes, *extra: tarfile.TarInfo, first: bool = False) -> bytes:
    """The archive `blob` with extra members (data-less: links, devices, dirs) appended or prepended."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as src:
        members = [(m, src.extractfile(m).read() if m.isreg() else None) for m in src.getmembers()]
    added = [(m, None) for m in extra]
    members = added + members if first else members + added
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return gzip.compress(out.getvalue())


def _member(name: str, kind: bytes, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, linkname, mode
    return ti


def test_mini_and_task_archives_still_extract(envs, file_store):
    from tests.fixtures.sandbox import build_task_archive

    for name, blob in (("mini", _mini_archive()), ("calc", build_task_archive("calc"))):
        env = resolve(envs(name, blob), file_store)
        assert os.readlink(env.testbed / ".venv" / "bin" / "python") == "/usr/bin/python3"
        st = os.stat(env.hidden / "run_tests.sh")
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o755) and (env.testbed / ".git").is_dir()


def test_hard_link_to_a_host_file_is_refused_and_the_file_untouched(envs, file_store, tmp_path):
    host = tmp_path / "host-secret"
    host.write_text("secret\n")
    os.chmod(host, 0o600)
    os.chown(host, 4242, 4242)
    blob = _with_members(_mini_archive(), _member("testbed/leak", tarfile.LNKTYPE, str(host)))
    with pytest.raises(EnvironmentError_) as e:
        resolve(envs("hardlink", blob), file_store)
    assert "hardlink.tar.gz" in str(e.value) and "'testbed/leak'" in str(e.value) and "hard link" in str(e.value)
    st = os.stat(host)
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid, st.st_nlink) == (0o600, 4242, 4242, 1)
    assert host.read_text() == "secret\n"
    assert not list((tmp_path / "cache" / "sandbox" / "envs").glob("*/testbed"))  # nothing left half-extracted


@pytest.mark.parametrize("member,needle", [
    (_member("testbed/inner", tarfile.LNKTYPE, "testbed/setup.py"), "hard link"),  # even inside the tree
    (_member("testbed/etc", tarfile.SYMTYPE, "/etc"), "absolute path '/etc'"),
    (_member("testbed/up", tarfile.SYMTYPE, "../../../../etc/shadow"), "symlink leaving testbed/"),
    (_member("testbed/peek", tarfile.SYMTYPE, "../r2e_tests/test_1.py"), "symlink leaving testbed/"),
    (_member("testbed/.venv/bin/python3", tarfile.SYMTYPE, "/etc/shadow"), "absolute path '/etc/shadow'"),
    (_member("testbed/.venv/bin/pip", tarfile.SYMTYPE, "/usr/bin/python3"), "absolute path"),
    (_member("testbed/tty", tarfile.CHRTYPE), "not a regular file, directory or symlink"),
    (_member("testbed/fifo", tarfile.FIFOTYPE), "not a regular file, directory or symlink"),
    (_member("../outside.txt", tarfile.REGTYPE), "'..' component"),
    (_member("/tmp/rlvr-absolute.txt", tarfile.REGTYPE), "absolute name"),
])
def test_hostile_members_are_refused_by_name(envs, file_store, member, needle):
    with pytest.raises(EnvironmentError_) as e:
        resolve(envs("hostile", _with_members(_mini_archive(), member)), file_store)
    assert "hostile.tar.gz" in str(e.value) and repr(member.name) in str(e.value) and needle in str(e.value)
    assert not os.path.exists("/tmp/rlvr-absolute.txt")


def test_symlinks_that_chain_out_of_the_tree_are_refused(envs, file_store):
    # Each passes alone (x's target has no link yet; y -> .. stays in testbed/), together x is testbed/../..
    x = _member("testbed/a/b/x", tarfile.SYMTYPE, "y/../../..")
    y = _member("testbed/a/b/y", tarfile.SYMTYPE, "..")
    with pytest.raises(EnvironmentError_, match="symlink 'testbed/a/b/x' resolves outside testbed/"):
        resolve(envs("chain", _with_members(_mini_archive(), x, y, first=True)), file_store)


def test_interpreter_links_and_links_inside_the_tree_are_kept(envs, file_store):
    extra = [_member("testbed/.venv/bin/python3.11", tarfile.SYMTYPE, "/usr/local/bin/python3.11"),
             _member("testbed/.venv/bin/python3", tarfile.SYMTYPE, "python"),
             _member("testbed/docs", tarfile.DIRTYPE, mode=0o755),
             _member("testbed/docs/README", tarfile.SYMTYPE, "../setup.py")]
    env = resolve(envs("links", _with_members(_mini_archive(), *extra)), file_store)
    assert os.readlink(env.testbed / ".venv/bin/python3.11") == "/usr/local/bin/python3.11"
    assert os.readlink(env.testbed / "docs/README") == "../setup.py"


def test_permission_fix_up_never_follows_links(tmp_path):
    from tasks.sandbox.environment import _root_owned_readable

    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    host = tmp_path / "host"
    host.write_text("x")
    os.chmod(host, 0o600)
    os.chown(host, 4242, 4242)
    tree = tmp_path / "tree"
    tree.mkdir()
    os.symlink(host, tree / "sym")
    _root_owned_readable(tree)
    st = os.stat(host)
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, 4242)
    os.link(host, tree / "hard")
    with pytest.raises(EnvironmentError_, match="2 hard links"):
        _root_owned_readable(tree)
    st = os.stat(host)
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, 4242)


# ----------------------------------------------------------------------------- run ids
@pytest.mark.parametrize("run_id", ["mini-20261202-101500", "seeds-s0", "base-init-3d81a6e4c29e-1a2b3c4d",
                                    "eval-1767000000", "test-smoke-1767000000", "demonstrations", "dataset-verify",
                                    "ui-smoke-20261202-101500", "smoke-dev1-rerun-20261202-101500", "run.v2_a",
                                    "x" * 128])
def test_run_ids_the_flows_make_are_valid(run_id):
    assert check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", ["../../../x", "a/b", "..", "a..b", ".hidden", "-flag", "", "x" * 129,
                                    "a b", "a\nb", "run:1", "/abs"])
def test_bad_run_ids_are_refused_naming_the_rule(run_id, file_store):
    with pytest.raises(RunIdError) as e:
        check_run_id(run_id)
    assert repr(run_id) in str(e.value) and "letters, digits" in str(e.value)
    assert isinstance(e.value, ValueError)
    from tasks.storage import stage_key

    with pytest.raises(RunIdError):
        stage_key(run_id, 1, "trajectories")
    with pytest.raises(RunIdError):
        file_store.read_manifest(run_id)


def test_prepare_run_context_refuses_before_building_anything(tmp_path, monkeypatch):
    from flows.prepare import prepare_run_context

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunIdError, match=r"'\.\./\.\./\.\./x'"):
        prepare_run_context("smoke", {"storage": {"root": f"file://{tmp_path}/store"}}, "../../../x")
    assert not (tmp_path / "store").exists() and os.listdir(tmp_path) == []


def test_cli_exits_2_on_a_bad_run_id_before_anything_starts(tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=REPO)
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-m", "flows.main", "--run-id", "../../../x"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "error: invalid run id '../../../x'" in out.stderr and "Traceback" not in out.stderr
