"""Task environments: where a task's repo and hidden tests come from.

Two kinds (see the package docstring for the archive layout):
- archive: `environment_uri` names a .tar.gz in the object store. It is fetched once,
  checked, and extracted once per process tree into `.rlvr/sandbox/envs/<sha256>/`
  as `testbed/` and `hidden/{r2e_tests/,run_tests.sh}`; sandboxes copy from there.
- image: no `environment_uri`; the R2E-Gym `docker_image` already holds /testbed,
  /testbed/run_tests.sh and /r2e_tests (docker backend only).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import pathlib
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
from dataclasses import dataclass, field

from tasks.sandbox.image import cache_dir

RUN_TESTS_SH = "#!/bin/bash\n.venv/bin/python -W ignore -m pytest -rA r2e_tests\n"
GIT_EXCLUDES = ".venv\n__pycache__/\n*.pyc\n.pytest_cache/\n"
SANDBOX_UID = 1000  # the user inside every sandbox (uid and gid)


@dataclass
class Environment:
    kind: str  # "archive" | "image"
    key: str  # content key (archive sha256) or image name
    image: str | None = None  # docker image to start (archive: the base image)
    root: pathlib.Path | None = None  # archive: extracted dir with testbed/ and hidden/
    plugins: bool = False  # pytest plugin autoload on: the archive brings its own virtualenv
    _tars: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def testbed(self) -> pathlib.Path:
        return self.root / "testbed"

    @property
    def hidden(self) -> pathlib.Path:
        return self.root / "hidden"

    def tar(self, which: str) -> bytes:
        """Uncompressed tar, extracted at "/" by the docker backend, built once per environment:
        "agent" = testbed/ (owned by uid 1000); "grading" = that plus root/r2e_tests/ and
        root/run_tests.sh (root-owned, world-readable; no entry for /root itself)."""
        with self._lock:
            if which not in self._tars:
                buf = io.BytesIO()

                def owned_by(uid: int):
                    def f(ti: tarfile.TarInfo) -> tarfile.TarInfo:
                        ti.uid = ti.gid = uid
                        ti.uname = ti.gname = ""
                        if uid == 0:
                            ti.mode = (ti.mode | 0o444 | (0o111 if ti.isdir() else 0)) & 0o755
                        return ti
                    return f

                with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
                    tf.add(self.testbed, arcname="testbed", filter=owned_by(SANDBOX_UID))
                    if which == "grading":
                        for child in sorted(self.hidden.iterdir()):
                            tf.add(child, arcname=f"root/{child.name}", filter=owned_by(0))
                self._tars[which] = buf.getvalue()
            return self._tars[which]


class EnvironmentError_(ValueError):
    """The task row or its archive does not describe a usable environment (not retryable)."""


_ENVS: dict[str, Environment] = {}
_ENVS_LOCK = threading.Lock()


def resolve(task_row: dict, store, base_image: str = "rlvr-sandbox:bookworm") -> Environment:
    uri = task_row.get("environment_uri")
    if not uri:
        img = task_row.get("docker_image")
        if not img:
            raise EnvironmentError_(f"task {task_row.get('instance_id')!r} has neither environment_uri "
                                    "nor docker_image")
        return Environment(kind="image", key=img, image=img)
    with _ENVS_LOCK:
        env = _ENVS.get((uri, base_image))  # the image too: another sandbox.image is another environment
    if env is not None and env.root.exists():
        return env
    if store is None:
        raise EnvironmentError_(f"task {task_row.get('instance_id')!r} has environment_uri {uri!r} but no store")
    path = store.local_path(uri)
    env = Environment(kind="archive", key=_sha256(path), image=base_image)
    env.root = _extract(path, env.key)
    env.plugins = (env.testbed / ".venv" / "pyvenv.cfg").is_file()
    with _ENVS_LOCK:
        _ENVS[(uri, base_image)] = env
    return env


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract(archive: pathlib.Path, key: str) -> pathlib.Path:
    envs = cache_dir() / "envs"
    dest = envs / key[:32]
    if (dest / ".complete").exists():
        return dest
    envs.mkdir(parents=True, exist_ok=True)
    with open(envs / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / ".complete").exists():
            return dest
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{key[:12]}.", dir=envs))
        try:
            with tarfile.open(archive, "r:*") as tf:
                tf.extractall(tmp, filter=_member_filter(archive))
            _check_links(archive, tmp)
            for need in ("testbed/.git", "r2e_tests", "run_tests.sh"):
                if not (tmp / need).exists():
                    raise EnvironmentError_(f"environment archive {archive} lacks {need}")
            (tmp / "hidden").mkdir()
            (tmp / "r2e_tests").rename(tmp / "hidden" / "r2e_tests")
            (tmp / "run_tests.sh").rename(tmp / "hidden" / "run_tests.sh")
            _root_owned_readable(tmp)
            (tmp / ".complete").write_text(key + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


# The one absolute link the format has: testbed/.venv/bin/python* -> the image's interpreter.
_VENV_PYTHON = re.compile(r"testbed/\.venv/bin/python[0-9.]*")
_INTERPRETER = re.compile(r"/usr(/local)?/bin/python[0-9.]*")


def _member_filter(archive: pathlib.Path):
    """A tarfile extraction filter: regular files, directories and symlinks that stay inside the
    tree (plus the venv's interpreter link), nothing else; anything more fails the whole archive."""

    def refuse(member: tarfile.TarInfo, why: str):
        raise EnvironmentError_(f"environment archive {archive}: member {member.name!r} {why}")

    def check(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        name = member.name
        parts = pathlib.PurePosixPath(name).parts
        top = parts[0] if parts else name  # a link must stay in its own top directory (testbed/, r2e_tests/)
        if name.startswith("/") or ".." in parts:
            refuse(member, "has an absolute name or a '..' component")
        if member.islnk():  # a hard link may name any host file: the fix-up would chmod it
            refuse(member, f"is a hard link (to {member.linkname!r})")
        if not (member.isreg() or member.isdir() or member.issym()):
            refuse(member, "is not a regular file, directory or symlink (device, FIFO, ...)")
        if member.issym():
            target = member.linkname
            if target.startswith("/"):
                if not (_VENV_PYTHON.fullmatch(name) and _INTERPRETER.fullmatch(target)):
                    refuse(member, f"is a symlink to the absolute path {target!r}")
            elif not _inside(os.path.normpath(os.path.join(os.path.dirname(name), target)), top):
                refuse(member, f"is a symlink leaving {top}/ ({target!r})")
        try:  # still tar's own checks: a path through an extracted link, setuid bits
            return tarfile.tar_filter(member, dest)
        except tarfile.FilterError as e:
            refuse(member, f"is refused by tar's filter: {e}")

    return check


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _check_links(archive: pathlib.Path, root: pathlib.Path) -> None:
    """Every extracted symlink resolves inside its own top directory (testbed/, r2e_tests/) or to
    what a venv interpreter link resolves to: links that pass one by one can chain (a -> b/.., b -> ..)."""
    links, allowed = [], set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                rel = os.path.relpath(p, root)
                if _VENV_PYTHON.fullmatch(rel) and _INTERPRETER.fullmatch(os.readlink(p)):
                    allowed.add(os.path.realpath(p))
                else:
                    links.append((rel, p))
    for rel, p in links:
        top, real = rel.split(os.sep)[0], os.path.realpath(p)
        if not _inside(real, os.path.join(os.path.realpath(root), top)) and real not in allowed:
            raise EnvironmentError_(f"environment archive {archive}: symlink {rel!r} resolves outside "
                                    f"{top}/ (to {real})")


def _root_owned_readable(root: pathlib.Path) -> None:
    """chown -R 0:0 and chmod -R a+rX,go-w: the sandbox user reads these copies, cannot change them.
    Never through a link: symlinks are only lchown'd; files and dirs are changed through an fd
    opened with O_NOFOLLOW, and a file with a second hard link is refused."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [""] + dirnames + filenames:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                os.lchown(p, 0, 0)
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise EnvironmentError_(f"{p} is neither a regular file, a directory nor a symlink")
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:  # shared with a file outside the tree
                    raise EnvironmentError_(f"{p} has {st.st_nlink} hard links; refusing to change its owner")
                os.fchown(fd, 0, 0)
                mode = stat.S_IMODE(st.st_mode) | 0o444
                if stat.S_ISDIR(st.st_mode) or mode & 0o100:
                    mode |= 0o111
                os.fchmod(fd, mode & ~0o022)
            finally:
                os.close(fd)


def build_environment_archive(files: dict[str, str | bytes], tests: dict[str, str | bytes],
                  run_tests: str = RUN_TESTS_SH, python: str = "/usr/bin/python3") -> bytes:
    """A .tar.gz environment archive in the documented layout, from in-memory files.

    files: repo-relative path -> content (the buggy state, committed once);
    tests: path relative to r2e_tests/ -> content (the hidden tests).
    """
    with tempfile.TemporaryDirectory(prefix="rlvr-envfiles-") as d:
        for rel, content in files.items():
            _write(pathlib.Path(d) / "repo" / rel, content)
        for rel, content in tests.items():
            _write(pathlib.Path(d) / "tests" / rel, content)
        return build_archive_from_dir(pathlib.Path(d) / "repo", pathlib.Path(d) / "tests", run_tests,
                                      python=python)[0]


# Never copied from a repo snapshot: any repository's history (a .git directory or gitfile at any
# depth; a nested repository's files stay, as plain files of the one commit), its own virtualenv
# (the environment has its own .venv) and caches.
_SKIP_TOP = (".venv",)
_SKIP_ANY = (".git", "__pycache__", ".pytest_cache")
# The testbed's one commit says nothing about the task (the agent reads `git log`); author and
# date are fixed too.
COMMIT_MESSAGE = "buggy state"
_GIT_IDENTITY = {"GIT_AUTHOR_NAME": "rlvr", "GIT_AUTHOR_EMAIL": "rlvr@localhost", "GIT_COMMITTER_NAME": "rlvr",
                 "GIT_COMMITTER_EMAIL": "rlvr@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
                 "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1",
                 "GIT_CONFIG_GLOBAL": "/dev/null"}


def snapshot_left_out(repo: str | os.PathLike) -> list[str]:
    """Repo-relative paths of the history and virtualenv build_archive_from_dir leaves out of a
    snapshot (caches not listed), sorted; symlinked directories are not followed."""
    repo, out = pathlib.Path(repo), []
    for dirpath, dirnames, filenames in os.walk(repo):
        top = os.path.samefile(dirpath, repo)
        out += [os.path.relpath(os.path.join(dirpath, n), repo) for n in dirnames + filenames
                if n == ".git" or (top and n in _SKIP_TOP)]
        dirnames[:] = [n for n in dirnames if n not in _SKIP_ANY and not (top and n in _SKIP_TOP)]
    return sorted(out)


def build_archive_from_dir(repo: str | os.PathLike, tests: str | os.PathLike, run_tests: str = RUN_TESTS_SH,
                           venv: str | os.PathLike | None = None,
                           python: str = "/usr/bin/python3") -> tuple[bytes, str]:
    """(.tar.gz archive, HEAD commit sha) from a repo snapshot directory and a hidden-tests directory.

    File modes, symlinks and empty directories are kept. Every .git at any depth and the snapshot's
    own .venv are left out (a .venv made on another machine names that machine's interpreter). The
    testbed is a fresh repository holding only the snapshot: one branch (main) with one commit
    (COMMIT_MESSAGE, fixed author and date), no other refs, no reflogs, no hooks, no objects
    but that commit's, a config without paths. venv: a virtualenv built for /testbed/.venv with
    the image's Python (tasks/dataset/importer.py) to ship as testbed/.venv; None ships the link
    .venv/bin/python -> `python`.
    """
    repo, tests = pathlib.Path(repo), pathlib.Path(tests)
    for name in ("r2e_tests", "run_tests.sh"):
        if (repo / name).exists() or (repo / name).is_symlink():
            raise EnvironmentError_(f"{repo}: the repo must not contain {name} (the hidden tests and their runner "
                                    "come with the environment)")

    def skip(d: str, names: list[str]) -> list[str]:
        top = os.path.samefile(d, repo)
        return [n for n in names if n in _SKIP_ANY or n.endswith(".pyc") or (top and n in _SKIP_TOP)]

    with tempfile.TemporaryDirectory(prefix="rlvr-envbuild-") as d:
        root = pathlib.Path(d)
        tb = root / "testbed"
        if repo.is_dir():
            shutil.copytree(repo, tb, symlinks=True, ignore=skip)
        tb.mkdir(exist_ok=True)
        # The caller's GIT_DIR, GIT_INDEX_FILE, ... must not redirect or add to the new repository.
        git_env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | _GIT_IDENTITY
        # No template: no sample hooks or description, a smaller archive. filemode on: an executable stays 100755.
        subprocess.run(["git", "init", "-q", "--template=", "-b", "main", str(tb)], check=True, env=git_env)
        subprocess.run(["git", "-C", str(tb), "config", "core.filemode", "true"], check=True, env=git_env)
        (tb / ".git" / "info").mkdir(exist_ok=True)
        (tb / ".git" / "info" / "exclude").write_text(GIT_EXCLUDES)
        subprocess.run(["git", "-C", str(tb), "add", "-A"], check=True, env=git_env)
        # No reflog of the build; COMMIT_EDITMSG is the build's, not the snapshot's.
        subprocess.run(["git", "-C", str(tb), "-c", "core.logAllRefUpdates=false", "commit", "-q", "--allow-empty",
                        "--no-verify", "-m", COMMIT_MESSAGE], check=True, env=git_env)
        (tb / ".git" / "COMMIT_EDITMSG").unlink(missing_ok=True)
        head = subprocess.run(["git", "-C", str(tb), "rev-parse", "HEAD"], check=True, env=git_env,
                              capture_output=True, text=True).stdout.strip()
        if venv is not None:
            shutil.copytree(venv, tb / ".venv", symlinks=True)
        else:
            (tb / ".venv" / "bin").mkdir(parents=True)
            os.symlink(python, tb / ".venv" / "bin" / "python")
        if tests.is_dir():
            shutil.copytree(tests, root / "r2e_tests", symlinks=True, ignore=lambda d, ns: [
                n for n in ns if n in _SKIP_ANY or n.endswith(".pyc")])
        (root / "r2e_tests").mkdir(exist_ok=True)
        _write(root / "run_tests.sh", run_tests)
        os.chmod(root / "run_tests.sh", 0o755)
        buf = io.BytesIO()

        def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 946684800
            return ti

        with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tf:
            for top in ("testbed", "r2e_tests", "run_tests.sh"):
                tf.add(root / top, arcname=top, filter=norm)
        data = buf.getvalue()
    check_archive(data)
    return data, head


def check_archive(data: bytes) -> None:
    """Raise EnvironmentError_ unless the archive extracts as sandboxes would extract it (member filter, links)."""
    with tempfile.TemporaryDirectory(prefix="rlvr-envcheck-") as d:
        path = pathlib.Path(d) / "env.tar.gz"
        path.write_bytes(data)
        with tarfile.open(path, "r:*") as tf:
            tf.extractall(pathlib.Path(d) / "x", filter=_member_filter(path))
        _check_links(path, pathlib.Path(d) / "x")


def _write(path: pathlib.Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
