"""Byte-reproducible environment archives (the layout of tasks/sandbox/__init__.py).

The git repository under testbed/ is written object by object instead of with the
git CLI: `git add` stores stat data (inode, times) in the index and gzip stamps the
current time, so two CLI builds of the same files differ by a few bytes. Here the
index carries zeroed stat fields (git re-hashes such entries once and sees the files
clean), commit dates are fixed, tar members are sorted with fixed owners and times,
and the gzip header has mtime 0: same files in, same bytes out.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import tarfile
import zlib

try:  # the sandbox package owns the format; fall back to its documented values if it is absent
    from tasks.sandbox.environment import GIT_EXCLUDES, RUN_TESTS_SH
except ImportError:  # pragma: no cover
    RUN_TESTS_SH = "#!/bin/bash\n.venv/bin/python -W ignore -m pytest -rA r2e_tests\n"
    GIT_EXCLUDES = ".venv\n__pycache__/\n*.pyc\n.pytest_cache/\n"

AUTHOR = "rlvr-mini <mini@rlvr.invalid>"
EPOCH = 1700000000  # fixed commit and file time
GIT_CONFIG = ("[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
              "\tlogallrefupdates = true\n")


def _obj(kind: str, body: bytes) -> tuple[str, bytes]:
    data = f"{kind} {len(body)}\0".encode() + body
    return hashlib.sha1(data).hexdigest(), data


def blob_sha(content: bytes) -> str:
    return _obj("blob", content)[0]


class GitRepo:
    """An in-memory repository: files -> loose objects, a commit, an index."""

    def __init__(self, files: dict[str, bytes]):
        self.files = dict(sorted(files.items()))
        self.objects: dict[str, bytes] = {}

    def _put(self, kind: str, body: bytes) -> str:
        sha, data = _obj(kind, body)
        self.objects[sha] = data
        return sha

    def _tree(self, prefix: str) -> str:
        entries = {}
        for path, content in self.files.items():
            if not path.startswith(prefix):
                continue
            head, sep, _ = path[len(prefix):].partition("/")
            if sep:
                entries.setdefault(head, ("40000", None))
            else:
                entries[head] = ("100644", self._put("blob", content))
        body = b""
        # git sorts tree entries by name, a directory as if its name ended with "/"
        for name in sorted(entries, key=lambda n: n + "/" if entries[n][0] == "40000" else n):
            mode, sha = entries[name]
            if sha is None:
                sha = self._tree(prefix + name + "/")
            body += f"{mode} {name}\0".encode() + bytes.fromhex(sha)
        return self._put("tree", body)

    def commit(self, message: str, parent: str | None = None) -> str:
        tree = self._tree("")
        lines = [f"tree {tree}"] + ([f"parent {parent}"] if parent else [])
        lines += [f"author {AUTHOR} {EPOCH} +0000", f"committer {AUTHOR} {EPOCH} +0000", "", message]
        return self._put("commit", ("\n".join(lines) + "\n").encode())

    def index(self) -> bytes:
        out = b"DIRC" + struct.pack(">II", 2, len(self.files))
        for path, content in self.files.items():  # sorted by path
            name = path.encode()
            entry = struct.pack(">10I", 0, 0, 0, 0, 0, 0, 0o100644, 0, 0, len(content))
            entry += bytes.fromhex(blob_sha(content)) + struct.pack(">H", min(len(name), 0xFFF)) + name
            entry += b"\0" * (8 - (len(entry) % 8))  # 1..8 NULs: the name is NUL-terminated
            out += entry
        return out + hashlib.sha1(out).digest()

    def git_dir(self, head: str) -> dict[str, bytes]:
        """The .git/ directory's files (relative to .git/)."""
        out = {
            "HEAD": b"ref: refs/heads/main\n",
            "config": GIT_CONFIG.encode(),
            "info/exclude": GIT_EXCLUDES.encode(),
            "refs/heads/main": head.encode() + b"\n",
            "index": self.index(),
        }
        for sha, data in self.objects.items():
            out[f"objects/{sha[:2]}/{sha[2:]}"] = zlib.compress(data, 6)
        return out


def commit_sha(files: dict[str, bytes], message: str, parent: str | None = None) -> str:
    return GitRepo(files).commit(message, parent)


def build_reproducible_archive(files: dict[str, str], tests: dict[str, str], message: str,
                  python: str = "/usr/bin/python3") -> tuple[bytes, str]:
    """(tar.gz bytes, HEAD commit sha) for a repo snapshot and its hidden tests."""
    repo = GitRepo({p: c.encode() for p, c in files.items()})
    head = repo.commit(message)
    members: list[tuple[str, bytes | None, int, str | None]] = []  # (path, data, mode, link target)
    for path, content in repo.files.items():
        members.append((f"testbed/{path}", content, 0o644, None))
    for path, data in repo.git_dir(head).items():
        members.append((f"testbed/.git/{path}", data, 0o444 if path.startswith("objects/") else 0o644, None))
    members.append(("testbed/.git/refs/tags", None, 0o755, None))
    members.append(("testbed/.venv/bin/python", None, 0o777, python))
    for path, content in tests.items():
        members.append((f"r2e_tests/{path}", content.encode(), 0o644, None))
    members.append(("run_tests.sh", RUN_TESTS_SH.encode(), 0o755, None))
    return _tar_gz(members), head


def _tar_gz(members) -> bytes:
    # Every parent directory gets its own member, so extraction does not depend on umask.
    dirs = set()
    for path, data, _mode, _link in members:
        parts = path.split("/")
        for i in range(1, len(parts) if data is not None or _link else len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    entries = [(d, None, 0o755, None) for d in dirs]
    entries += [m for m in members if m[1] is not None or m[3]]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, data, mode, link in sorted(entries, key=lambda m: m[0]):
            ti = tarfile.TarInfo(path)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode = EPOCH, 0, 0, "", "", mode
            if link:
                ti.type, ti.linkname = tarfile.SYMTYPE, link
                tf.addfile(ti)
            elif data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()
