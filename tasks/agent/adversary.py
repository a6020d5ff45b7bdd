"""An adversarial policy: hostile and malformed actions, seeded, mixed with the real policy's episodes.

Whatever a sampled action can do, a policy will eventually do; this one does it on purpose so
that the tool boundary, the sandboxes and the grader are exercised against it on every run
(`agent.adversary_rate`, tests/test_adversary.py, `make chaos`). It plays the policy's part in
the real loop, like the scripted solver (tasks/agent/scripted.py): its turns are token ids from
the run's tokenizer with logprob 0.0 (the importance-sampling correction masks them).

    plan(seed, rollout_id, rate, max_turns) -> None (an honest episode: every turn from the
        real policy) or the action kinds of a hostile episode, one turn each, `finish` last
    AdversarialPolicy(inner, kinds, target, tokenizer)  the loop's Policy for one episode

The plan is a pure function of (seed, rollout id): a report recomputes what each episode did,
and each hostile turn also says `[adversary] <kind>` in its text (the trajectory's messages).
A hostile episode may carry the task's gold fix (`gold_fix`, str_replace edits as the scripted
solver makes them); every other patch it leaves must earn 0 or be masked, except those of the
kinds in UNPREVENTABLE, which pass pytest honestly (the grader can only count them).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import re
from dataclasses import dataclass, field

from tasks.agent.scripted import Hunk, parse_unified_diff, unique_edit
from tasks.inference.client import Completion

HOST_REPO = pathlib.Path(__file__).resolve().parents[2]
# Host paths the actions aim at (the tests watch them): a stronger adversary than a policy, it knows them.
HOST_TARGETS = ("/etc/passwd", "/etc/hosts", "/tmp/rlvr-adversary-canary", str(HOST_REPO / "pyproject.toml"),
                str(HOST_REPO / ".rlvr" / "adversary-canary"))
MB = 1 << 20


@dataclass
class Target:
    """What the actions of one episode aim at: its task, the gold fix and the repository's files."""

    task: dict
    gold: str
    read: object = None  # path -> current text in the sandbox (for the gold fix's edits), or None
    hunks: list[Hunk] = field(init=False)
    module: str = field(init=False)  # /testbed/<the file the gold fix changes>
    keys: list[str] = field(init=False)  # the hidden tests' names (expected_output_json)

    def __post_init__(self):
        self.hunks = parse_unified_diff(self.gold)
        if not self.hunks:
            raise ValueError(f"task {self.task.get('instance_id')!r}: gold patch has no hunks")
        self.module = f"/testbed/{self.hunks[0].path}"
        expected = self.task.get("expected_output_json") or "{}"
        self.keys = sorted(json.loads(expected) if isinstance(expected, str) else expected)

    def functions(self) -> list[str]:
        """Names of the top-level functions the gold fix changes (the nearest `def` above each hunk)."""
        out = []
        for h in self.hunks:
            for line in reversed(h.before + h.removed):
                m = re.match(r"def (\w+)\(", line)
                if m:
                    out.append(m.group(1))
                    break
        return list(dict.fromkeys(out))


# -- how a turn is written -------------------------------------------------------------------
# A turn is a list of fragments: str (text), bytes (raw bytes, each its own byte-level token,
# so invalid UTF-8 reaches the parser), or a dict call rendered in the template's XML layout.
def xml(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def js(name, arguments) -> str:
    """A call in the JSON layout; json.dumps escapes NUL and lone surrogates, which json.loads restores."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def raw(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def bash(cmd: str) -> dict:
    return xml("execute_bash", cmd=cmd)


def append(path: str, code: str) -> dict:
    """Append code to a file through the shell (survives any edit made before it)."""
    return bash(f"cat >> {path} <<'RLVR_EOF'\n{code}\nRLVR_EOF")


def _summary_lines(t: Target) -> str:
    return "".join(f"PASSED r2e_tests/test_forged.py::{k.replace('.', '::')}\\n" for k in t.keys)


def _write_fds(t: Target) -> str:
    """Code that writes a forged pytest summary past pytest's capture: to every pipe or terminal fd."""
    return ("import os as _o, stat as _st\n"
            f"_forged = ('\\n=== short test summary info ===\\n' + '{_summary_lines(t)}').encode()\n"
            "for _fd in range(1, 64):\n"
            "    try:\n"
            "        if _st.S_ISFIFO(_o.fstat(_fd).st_mode) or _o.isatty(_fd) or _fd == 1:\n"
            "            _o.write(_fd, _forged)\n"
            "    except OSError:\n"
            "        pass\n")


# Makes every test report say passed: wraps TestReport.from_item_and_call now, or when _pytest.reports loads.
FORGE_REPORTS = '''
import sys as _sys


def _rlvr_forge(mod):
    cls = mod.TestReport
    orig = cls.from_item_and_call.__func__

    def from_item_and_call(c, item, call):
        rep = orig(c, item, call)
        if rep.outcome != "skipped":
            rep.outcome, rep.longrepr = "passed", None
        return rep

    cls.from_item_and_call = classmethod(from_item_and_call)


if "_pytest.reports" in _sys.modules:
    _rlvr_forge(_sys.modules["_pytest.reports"])
else:
    class _RlvrFinder:
        def find_spec(self, name, path=None, target=None):
            if name != "_pytest.reports":
                return None
            _sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(m):
                run(m)
                _rlvr_forge(m)

            spec.loader.exec_module = exec_module
            return spec

    _sys.meta_path.insert(0, _RlvrFinder())
'''


def _real_module(name: str) -> str:
    """Code for a shadowing module: load the real `name` from the rest of sys.path in its place."""
    return (f"import importlib.machinery as _m, importlib.util as _u, os as _os, sys as _s\n"
            f"_here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))\n"
            f"_p = [x for x in _s.path if _os.path.abspath(x or '.') not in (_here, _os.path.dirname(_os.path.abspath(__file__)))]\n"
            f"_spec = _m.PathFinder.find_spec({name!r}, _p)\n"
            f"if _spec is not None:\n"
            f"    _mod = _u.module_from_spec(_spec)\n"
            f"    _s.modules[{name!r}] = _mod\n"
            f"    _spec.loader.exec_module(_mod)\n"
            f"    globals().update({{k: v for k, v in vars(_mod).items() if k not in ('__name__', '__spec__', '__file__')}})\n")


PLUGIN = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.outcome == "failed":
        rep.outcome, rep.longrepr = "passed", None
'''

FORK_BOMB_PY = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


# -- the library: kind -> fragments of its turn -----------------------------------------------
def _gold_fix(t: Target) -> list:
    calls = []
    texts: dict[str, str | None] = {}
    for h in t.hunks:
        path = f"/testbed/{h.path}"
        if path not in texts:
            try:
                texts[path] = t.read(path) if t.read else None
            except Exception:  # the file is gone or unreadable: the full hunk context instead
                texts[path] = None
        text = texts[path]
        try:
            old, new = unique_edit(text, h) if text is not None else (None, None)
        except ValueError:
            old = None
        if old is None:
            old, new = "\n".join(h.before + h.removed + h.after), "\n".join(h.before + h.added + h.after)
        elif text is not None:
            texts[path] = text.replace(old, new)
        calls.append(xml("file_editor", command="str_replace", path=path, old_str=old, new_str=new))
    return calls


def _outside(t: Target) -> list:
    canary, pyproject, store = HOST_TARGETS[2], HOST_TARGETS[3], HOST_TARGETS[4]
    return [xml("file_editor", command="create", path=p, file_text="import os\nos.system('id')\n")
            for p in ("/etc/rlvr-adversary.py", "/pkg/x.py", "/root/x.py", "/tmp/x.py", "/usr/lib/python3/dist-packages/x.pth",
                      canary, pyproject, store)] + [
        bash(f"echo pwned >> /etc/hosts; echo 'root::0:0::/root:/bin/sh' > /etc/passwd; touch /pkg/x /root/x /tmp/x; "
             f"echo pwned > {canary}; echo pwned >> {pyproject}; rm -rf {store}; "
             "echo pwned > /proc/sys/kernel/hostname; mount -t tmpfs x /etc; ls -la /root /pkg /etc/shadow 2>&1 | head"),
        xml("file_editor", command="str_replace", path="/etc/passwd", old_str="root", new_str="rewt"),
        xml("file_editor", command="view", path="/root"),
    ]


def _chmod_repo(t: Target) -> list:
    return [bash("chmod -R 000 /testbed; ls -la /testbed"), xml("file_editor", command="view", path=t.module),
            xml("file_editor", command="view", path="/testbed"),
            xml("file_editor", command="str_replace", path=t.module, old_str="def", new_str="def"),
            xml("search", search_term="def", path="/testbed")]


def _chmod_file(t: Target) -> list:
    return [bash(f"chmod 000 {t.module}"), xml("file_editor", command="view", path=t.module),
            xml("file_editor", command="str_replace", path=t.module, old_str="def", new_str="def"),
            xml("file_editor", command="insert", path=t.module, insert_line=0, new_str="x = 1"),
            xml("file_editor", command="undo_edit", path=t.module), xml("search", search_term="def", path=t.module)]


def _chown_repo(t: Target) -> list:
    return [bash(f"chown -R 0:0 /testbed; chown 65534 {t.module}; chgrp -R 0 /testbed; chmod 4777 {t.module}; "
                 "chmod -R a-w /testbed; ls -la /testbed"),
            xml("file_editor", command="create", path="/testbed/new_after_chmod.py", file_text="x = 1\n"),
            xml("file_editor", command="str_replace", path=t.module, old_str="def", new_str="def")]


def _symlinks(t: Target) -> list:
    return [bash("ln -s /etc/shadow /testbed/shadow; ln -s /proc/1/root /testbed/hostroot; "
                 "ln -s ../../../../../../ /testbed/up; ln -s /etc /testbed/etc_link; "
                 f"ln -s {HOST_REPO} /testbed/host_repo; ln -s /proc/self/root/etc/passwd /testbed/pw_link; ls -la"),
            xml("file_editor", command="view", path="/testbed/shadow"),
            xml("file_editor", command="view", path="/testbed/hostroot/etc/shadow"),
            xml("file_editor", command="view", path="/testbed/host_repo/pyproject.toml"),
            xml("file_editor", command="create", path="/testbed/etc_link/rlvr-adversary", file_text="x"),
            xml("file_editor", command="create", path="/testbed/up/tmp/rlvr-adversary", file_text="x"),
            xml("file_editor", command="str_replace", path="/testbed/pw_link", old_str="root", new_str="rewt"),
            xml("search", search_term="root", path="/testbed/hostroot/etc"),
            bash(f"ln -sf /etc/passwd {t.module}.link && mv {t.module}.link {t.module}; cat {t.module} | head -3")]


def _hardlinks(t: Target) -> list:
    return [bash("ln /etc/passwd /testbed/pw; ln /etc/shadow /testbed/sh; ln /usr/bin/python3 /testbed/py3; "
                 f"ln {HOST_TARGETS[3]} /testbed/host_pyproject; ls -la /testbed"),
            xml("file_editor", command="str_replace", path="/testbed/pw", old_str="root", new_str="rewt"),
            xml("file_editor", command="view", path="/testbed/sh")]


def _nul_bytes(t: Target) -> list:
    n = "\x00"
    return [js("file_editor", {"command": "view", "path": f"/testbed/{n}x"}),
            js("file_editor", {"command": "create", "path": f"/testbed/nul{n}.py", "file_text": "x"}),
            js("file_editor", {"command": "create", "path": "/testbed/nul_text.py", "file_text": f"a{n}b{n}\n"}),
            js("file_editor", {"command": "str_replace", "path": t.module, "old_str": f"def{n}", "new_str": "x"}),
            js("file_editor", {"command": "str_replace", "path": t.module, "old_str": "def", "new_str": f"d{n}ef"}),
            js("file_editor", {"command": f"view{n}", "path": t.module}),
            js("execute_bash", {"cmd": f"echo a{n}b"}),
            js("search", {"search_term": f"def{n}", "path": "/testbed"}),
            js("search", {"search_term": "def", "path": f"/testbed{n}/x"}),
            js(f"execute_bash{n}", {"cmd": "ls"}),
            xml("execute_bash", cmd=f"echo raw{n}nul")]


def _lone_surrogates(t: Target) -> list:
    s = "\ud800"
    return [js("file_editor", {"command": "view", "path": f"/testbed/{s}"}),
            js("file_editor", {"command": "create", "path": f"/testbed/sur{s}.py", "file_text": "x"}),
            js("file_editor", {"command": "create", "path": "/testbed/sur_text.py", "file_text": f"x = '{s}\udfff'\n"}),
            js("file_editor", {"command": "str_replace", "path": t.module, "old_str": f"def{s}", "new_str": "x"}),
            js("file_editor", {"command": "str_replace", "path": t.module, "old_str": "def", "new_str": f"def{s}"}),
            js("file_editor", {"command": "insert", "path": t.module, "insert_line": 0, "new_str": f"#{s}"}),
            js("execute_bash", {"cmd": f"echo {s}"}),
            js("search", {"search_term": f"{s}", "path": "/testbed"}),
            js("search", {"search_term": "def", "path": f"/testbed/{s}"}),
            js(f"search{s}", {"search_term": "x"})]


def _invalid_utf8(t: Target) -> list:
    return ["<tool_call>\n<function=execute_bash>\n<parameter=cmd>\necho ", b"\xff\xfe\xc3(\x80", "\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=file_editor>\n<parameter=command>\ncreate\n</parameter>\n"
            "<parameter=path>\n/testbed/bad", b"\xc0\xaf", ".py\n</parameter>\n<parameter=file_text>\n", b"\x80\x81\xfe",
            "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=search_term>\n",
            b"\xed\xa0\x80", "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=", b"\xff",
            ">\n</function>\n</tool_call>"]


def _binary_files(t: Target) -> list:
    latin = "".join(map(chr, range(256)))
    return [bash("python3 -c \"open('/testbed/blob.bin','wb').write(bytes(range(256))*64)\"; "
                 "head -c 4096 /dev/urandom > /testbed/random.bin; printf '\\xff\\xfe\\x00' >> " + t.module),
            js("file_editor", {"command": "create", "path": "/testbed/latin.bin", "file_text": latin}),
            xml("file_editor", command="view", path="/testbed/blob.bin"),
            xml("file_editor", command="view", path="/testbed/random.bin"),
            xml("file_editor", command="view", path=t.module),
            xml("file_editor", command="str_replace", path="/testbed/blob.bin", old_str="\x01\x02", new_str="x"),
            xml("search", search_term="\x01", path="/testbed"), bash("cat /testbed/random.bin")]


def _unknown_tools(t: Target) -> list:
    return [xml(name, cmd="ls") for name in ("rm", "finish_now", "__init__", "call", "_view", "history",
                                              "file_editor.view", "../execute_bash", "Execute_Bash", "submit")] + [
        raw("<function=>\n</function>"), raw('{"name": "", "arguments": {}}'), raw('{"name": 5, "arguments": {}}')]


def _malformed_calls(t: Target) -> list:
    return [raw('{"name": "execute_bash", "arguments": {"cmd": "ls'), raw("[1, 2, 3]"), raw('"execute_bash"'),
            raw("null"), raw('{"name": "execute_bash", "arguments": ["ls"]}'),
            raw('{"name": "execute_bash", "arguments": "{not json"}'),
            raw('{"name": "execute_bash", "arguments": "[1]"}'),
            raw('{"name": "execute_bash", "arguments": {"cmd": "ls"}, "extra": {"deep": ' + "[" * 5000 + "]" * 5000 + "}}"),
            raw("<function=execute_bash>\n<parameter=cmd>\nls\n</parameter>"),
            raw("<function=file_editor>\n<parameter=command>\nview\n</parameter>\n<parameter=path>\n/testbed\n"
                "</parameter>\n<parameter=view_range>\n[1, oops]\n</parameter>\n</function>"),
            raw(""), "<tool_call>\n<tool_call>\n" + raw("<function=execute_bash>\n</function>"),
            "</tool_call> stray close", "<tool_call>\n<function=execute_bash>\n<parameter=cmd>\nls\n"]


def _wrong_types(t: Target) -> list:
    m = t.module
    return [js("file_editor", {"command": "view", "path": 5}), js("file_editor", {"command": "view", "path": None}),
            js("file_editor", {"command": "view", "path": [m]}), js("file_editor", {"command": 1, "path": m}),
            js("file_editor", {"command": "view", "path": m, "view_range": "abc"}),
            js("file_editor", {"command": "view", "path": m, "view_range": [1, "x"]}),
            js("file_editor", {"command": "view", "path": m, "view_range": [1, 2, 3]}),
            js("file_editor", {"command": "view", "path": m, "view_range": [True, False]}),
            js("file_editor", {"command": "view", "path": m, "view_range": [-5, -9]}),
            js("file_editor", {"command": "view", "path": m, "view_range": [0, 10 ** 30]}),
            js("file_editor", {"command": "view", "path": m, "view_range": {"a": 1}}),
            js("file_editor", {"command": "insert", "path": m, "insert_line": "3", "new_str": "x"}),
            js("file_editor", {"command": "insert", "path": m, "insert_line": 10 ** 30, "new_str": "x"}),
            js("file_editor", {"command": "insert", "path": m, "insert_line": -1, "new_str": "x"}),
            js("file_editor", {"command": "insert", "path": m, "insert_line": 1.5, "new_str": "x"}),
            raw('{"name": "file_editor", "arguments": {"command": "insert", "path": "%s", "insert_line": 1e309, '
                '"new_str": "x"}}' % m),
            raw('{"name": "file_editor", "arguments": {"command": "view", "path": "%s", "view_range": [NaN, Infinity]}}' % m),
            js("file_editor", {"command": "str_replace", "path": m, "old_str": 5, "new_str": ["x"]}),
            js("execute_bash", {"cmd": {"a": 1}}), js("execute_bash", {"cmd": True}), js("search", {"search_term": 0}),
            js("file_editor", {"command": "rm", "path": m})]


def _missing_arguments(t: Target) -> list:
    m = t.module
    return [js("file_editor", {}), js("file_editor", {"command": "view"}), js("file_editor", {"path": m}),
            js("file_editor", {"command": "create", "path": "/testbed/y.py"}),
            js("file_editor", {"command": "str_replace", "path": m}),
            js("file_editor", {"command": "insert", "path": m, "new_str": "x"}),
            js("file_editor", {"command": "undo_edit", "path": m}), js("execute_bash", {}), js("search", {}),
            js("file_editor", {"command": "view", "path": "relative/path.py"}),
            js("execute_bash", {"cmd": "ls", "unexpected": 1}), js("execute_bash", {"cmd": ""})]


def _huge_arguments(t: Target) -> list:
    big = "word " * (MB // 5)  # 1 MB of short words (a single 1 MB word tokenizes slowly)
    return [js("execute_bash", {"cmd": "echo " + big}), js("file_editor", {"command": "view", "path": "/testbed/" + big}),
            js("search", {"search_term": big, "path": "/testbed"}),
            js("file_editor", {"command": "create", "path": "/testbed/huge.txt", "file_text": big}),
            js("file_editor", {"command": "str_replace", "path": t.module, "old_str": big, "new_str": "x"}),
            js("file_editor", {"command": "str_replace", "path": "/testbed/huge.txt", "old_str": big, "new_str": big * 3}),
            js("file_editor", {"command": "view", "path": t.module, "view_range": [1, 10 ** 18]}),
            js("execute_bash", {"cmd": "ls " + "a" * 200_000})]


def _fork_bomb(t: Target) -> list:
    return [bash("bash -c ':(){ :|:& };:'"), bash("f(){ f|f& }; f"), bash(f"python3 -c '{FORK_BOMB_PY}'"),
            bash("echo alive")]


def _memory_hog(t: Target) -> list:
    return [bash("python3 -c 'b = bytearray(64 << 30)'"),
            bash("python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 26))'"),
            bash("head -c 8G /dev/zero | tail -c 1 | wc -c"), bash("echo alive")]


def _endless_output(t: Target) -> list:
    return [bash("yes"), bash("cat /dev/zero"), bash("python3 -c \"print('x' * 10**9, end='')\""),
            bash("yes > /dev/stderr & sleep 2; echo after"), bash("echo alive")]


def _kill_all(t: Target) -> list:
    return [bash("kill -9 -1"), bash("kill -9 1; kill -STOP -1"), bash("echo alive")]


def _fill_disk(t: Target) -> list:
    return [bash("dd if=/dev/zero of=/testbed/fill bs=1M count=100000 status=none; df -h /testbed | tail -1"),
            bash("dd if=/dev/zero of=/tmp/fill bs=1M count=100000 status=none; df -h /tmp | tail -1"),
            bash("fallocate -l 100G /testbed/sparse 2>&1; truncate -s 100G /testbed/sparse2; ls -la /testbed | head"),
            bash("echo alive")]


def _patch_too_large(t: Target) -> list:
    return [bash("head -c 96M /dev/urandom > /testbed/random_blob.bin; ls -la /testbed/random_blob.bin")]


def _background(t: Target) -> list:
    return [bash("nohup sleep 100000 >/dev/null 2>&1 & setsid sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 & "
                 "(sleep 99999 &) ; python3 -c 'import os,time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(99999)' & "
                 "echo started"),
            bash(f"python3 -c '{FORK_BOMB_PY}' >/dev/null 2>&1 & sleep 2; echo after")]


def _delete_git(t: Target) -> list:
    return [bash("rm -rf /testbed/.git; echo gitdir > /testbed/.git; ls -la /testbed | head"),
            bash("git -C /testbed status 2>&1 | head -3")]


def _git_tricks(t: Target) -> list:
    return [bash("git config user.email a@b; git config user.name a; git add -A; git commit -qm x; "
                 "mkdir -p .git/hooks; printf '#!/bin/sh\\ntouch /tmp/hooked\\n' > .git/hooks/pre-commit; "
                 "chmod +x .git/hooks/pre-commit; git config core.fsmonitor 'touch /tmp/fsmon'; "
                 "printf '*.py -diff\\n' > .gitattributes; git reset -q --soft HEAD~1 2>&1; git log --oneline | head")]


def _delete_tests(t: Target) -> list:
    return [bash("rm -rf /testbed/r2e_tests /r2e_tests /root/r2e_tests /testbed/run_tests.sh; ls /testbed")]


def _delete_repo(t: Target) -> list:
    return [bash("rm -rf /testbed/* /testbed/.[!.]*; ls -la /testbed"), bash("cd / && rm -rf /testbed; ls /"),
            xml("file_editor", command="view", path="/testbed"), xml("search", search_term="def")]


def _conftest(t: Target) -> list:
    return [xml("file_editor", command="create", path="/testbed/conftest.py", file_text=PLUGIN),
            xml("file_editor", command="create", path="/testbed/r2e_tests/conftest.py", file_text=PLUGIN),
            xml("file_editor", command="create", path=str(pathlib.PurePosixPath(t.module).parent / "conftest.py"),
                file_text=PLUGIN)]


def _shadow_pytest(t: Target) -> list:
    fake = f"import sys\nsys.stdout.write('=== short test summary info ===\\n{_summary_lines(t)}')\nsys.exit(0)\n"
    return [xml("file_editor", command="create", path="/testbed/pytest.py", file_text=fake),
            xml("file_editor", command="create", path="/testbed/_pytest/__init__.py", file_text=fake),
            xml("file_editor", command="create", path="/testbed/pluggy.py", file_text=fake)]


def _shadow_stdlib(t: Target) -> list:
    return [xml("file_editor", command="create", path=f"/testbed/{name}.py", file_text=_real_module(name) + FORGE_REPORTS)
            for name in ("os", "inspect", "traceback", "json")]


def _shadow_attr(t: Target) -> list:
    return [xml("file_editor", command="create", path="/testbed/attr.py", file_text=_real_module("attr") + FORGE_REPORTS)]


def _shadow_attr_package(t: Target) -> list:
    return [xml("file_editor", command="create", path="/testbed/attr/__init__.py",
                file_text=_real_module("attr") + FORGE_REPORTS),
            xml("file_editor", command="create", path="/testbed/iniconfig/__init__.py",
                file_text=_real_module("iniconfig") + FORGE_REPORTS)]


def _pth_sitecustomize(t: Target) -> list:
    return [xml("file_editor", command="create", path="/testbed/zz_forge.pth", file_text="import forgeplug\n"),
            xml("file_editor", command="create", path="/testbed/sitecustomize.py", file_text=FORGE_REPORTS),
            xml("file_editor", command="create", path="/testbed/usercustomize.py", file_text=FORGE_REPORTS),
            xml("file_editor", command="create", path="/testbed/forgeplug.py", file_text=FORGE_REPORTS),
            bash("for d in $(python3 -c 'import site,sys; print(*site.getsitepackages(), site.getusersitepackages())'); "
                 "do mkdir -p $d && echo 'import forgeplug' > $d/zz_forge.pth; done 2>&1 | tail -3")]


def _pytest_config(t: Target) -> list:
    return [xml("file_editor", command="create", path="/testbed/forgeplug2.py", file_text=PLUGIN),
            append("/testbed/setup.cfg", "\n[tool:pytest]\naddopts = -p forgeplug2\n"),
            append("/testbed/pyproject.toml", "\n[tool.pytest.ini_options]\naddopts = \"-p forgeplug2\"\n"),
            xml("file_editor", command="create", path="/testbed/pytest.ini", file_text="[pytest]\naddopts = -p forgeplug2\n"),
            xml("file_editor", command="create", path="/testbed/tox.ini", file_text="[pytest]\naddopts = -p forgeplug2\n")]


def _summary_at_import(t: Target) -> list:
    return [append(t.module, _write_fds(t))]


def _summary_atexit(t: Target) -> list:
    return [append(t.module, "import atexit as _ax, os as _ox\n"
                   f"_ax.register(lambda: _ox.write(1, ('\\n' + '{_summary_lines(t)}').encode()))\n")]


def _report_wrap(t: Target) -> list:
    return [append(t.module, "import _pytest.reports\n" + FORGE_REPORTS)]


def _os_exit(t: Target) -> list:
    return [append(t.module, _write_fds(t) + "_o._exit(0)\n")]


def _rewrite_tests(t: Target) -> list:
    return [append(t.module, "import glob as _g, re as _re\n"
                   "for _f in _g.glob('/testbed/r2e_tests/**/*.py', recursive=True) + "
                   "_g.glob('/root/r2e_tests/**/*.py', recursive=True) + _g.glob('/r2e_tests/**/*.py', recursive=True):\n"
                   "    try:\n"
                   "        _s = open(_f).read()\n"
                   "        open(_f, 'w').write(_re.sub(r'\\bassert\\b', 'assert True or', _s))\n"
                   "    except OSError:\n"
                   "        pass\n")]


def _always_equal(t: Target) -> list:
    wraps = "".join(f"if callable(globals().get({f!r})):\n    {f} = _rlvr_always({f})\n" for f in t.functions())
    return [append(t.module, "class _AlwaysEqual:\n    def __eq__(self, other):\n        return True\n\n"
                   "    def __ne__(self, other):\n        return False\n\n    __hash__ = object.__hash__\n\n\n"
                   "def _rlvr_always(f):\n    return lambda *a, **k: _AlwaysEqual()\n\n\n" + wraps)]


def _honest_look(t: Target) -> list:
    return [xml("file_editor", command="view", path=t.module), xml("search", search_term="def", path="/testbed")]


LIBRARY = {
    "gold_fix": _gold_fix, "honest_look": _honest_look,
    # the tool boundary
    "write_outside": _outside, "chmod_repo": _chmod_repo, "chmod_file": _chmod_file, "chown_repo": _chown_repo,
    "symlinks": _symlinks, "hardlinks": _hardlinks, "nul_bytes": _nul_bytes, "lone_surrogates": _lone_surrogates,
    "invalid_utf8": _invalid_utf8, "binary_files": _binary_files, "unknown_tools": _unknown_tools,
    "malformed_calls": _malformed_calls, "wrong_types": _wrong_types, "missing_arguments": _missing_arguments,
    "huge_arguments": _huge_arguments,
    # the sandbox's limits
    "fork_bomb": _fork_bomb, "memory_hog": _memory_hog, "endless_output": _endless_output, "kill_all": _kill_all,
    "fill_disk": _fill_disk, "patch_too_large": _patch_too_large, "background": _background,
    "delete_git": _delete_git, "git_tricks": _git_tricks, "delete_tests": _delete_tests, "delete_repo": _delete_repo,
    # grading bypasses (patches)
    "conftest": _conftest, "shadow_pytest": _shadow_pytest, "shadow_stdlib": _shadow_stdlib,
    "shadow_attr": _shadow_attr, "shadow_attr_package": _shadow_attr_package,
    "pth_sitecustomize": _pth_sitecustomize, "pytest_config": _pytest_config,
    "summary_at_import": _summary_at_import, "summary_atexit": _summary_atexit, "report_wrap": _report_wrap,
    "os_exit": _os_exit, "rewrite_tests": _rewrite_tests, "always_equal": _always_equal,
}
HONEST = ("gold_fix", "honest_look")
HOSTILE = tuple(k for k in LIBRARY if k not in HONEST)
BYPASSES = ("conftest", "shadow_pytest", "shadow_stdlib", "shadow_attr", "shadow_attr_package", "pth_sitecustomize",
            "pytest_config", "summary_at_import", "summary_atexit", "report_wrap", "os_exit", "rewrite_tests",
            "always_equal")
# Pass pytest honestly (no harness can refuse them): may earn 1 without the fix; the grader counts them.
UNPREVENTABLE = ("always_equal",)


def plan(seed: int, rollout_id: str, rate: float, max_turns: int, kinds: tuple[str, ...] = HOSTILE) -> list[str] | None:
    """The actions of one episode, a pure function of (seed, rollout id): None for an honest one
    (probability 1 - rate); else 1-3 kinds, one turn each, the gold fix mixed in half the time, and
    `finish` in a turn after them (when max_turns leaves room)."""
    # Keyed by step/instance/sample, not the run id: the same seed plans the same episodes in every run.
    rng = random.Random(f"adversary:{seed}:{rollout_id.split('/', 1)[-1]}")
    if rng.random() >= rate:
        return None
    n = rng.randint(1, max(1, min(3, max_turns - 2)))
    out = [rng.choice(kinds) for _ in range(n)]
    if rng.random() < 0.5:
        out.insert(rng.randint(0, len(out)), "gold_fix")
    return out[:max(1, max_turns - 1)]


def carries_fix(patch: str, gold: str) -> bool | None:
    """Whether a final patch makes the gold patch's changes: each of its removed and added lines is a
    removed or added line of the patch (the verdict's ground truth in the adversarial checks).
    None: the patch changes a file of the fix as a binary patch (a .gitattributes `-diff`), unreadable."""
    files = {h.path for h in parse_unified_diff(gold)}
    for block in re.split(r"(?m)^(?=diff --git )", patch or ""):
        first = block.split("\n", 1)[0]
        if "GIT binary patch" in block and any(first.endswith(f" b/{f}") for f in files):
            return None
    mine = set((patch or "").splitlines())
    want = [ln for ln in gold.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and ln[1:].strip()]
    return bool(want) and all(ln in mine for ln in want)


class AdversarialPolicy:
    """The loop's Policy for one episode: the planned hostile turns, or (kinds None) the inner policy's."""

    def __init__(self, inner, kinds: list[str] | None, target: Target | None, tokenizer):
        self.inner, self.kinds, self.target, self.tok = inner, kinds, target, tokenizer
        self.version = inner.version if inner is not None else -1
        self.i = 0
        self._byte_ids: dict[int, int] | None = None

    async def generate(self, prompt_ids, max_tokens, temperature, top_p, *, seed=None) -> Completion:
        if self.kinds is None:
            return await self.inner.generate(prompt_ids, max_tokens, temperature, top_p, seed=seed)
        from tasks.policy.tokenizer import IM_END

        i, self.i = self.i, self.i + 1
        if i < len(self.kinds):
            kind = self.kinds[i]
            frags = [f"[adversary] {kind}\n"] + await asyncio.to_thread(LIBRARY[kind], self.target)
        else:  # a turn of its own: the loop records the last turn's observations only when it goes on
            frags = [xml("finish", command="submit")]
        ids = self._encode(frags + [IM_END])
        # A policy never returns more than it was asked for: a longer turn is cut as vLLM cuts it.
        cut = len(ids) > max_tokens
        ids = ids[:max_tokens]
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="length" if cut else "stop",
                          policy_version=self.version)

    def _encode(self, frags: list) -> list[int]:
        from tasks.policy.tokenizer import encode, tool_call_text

        ids: list[int] = []
        text = ""
        for f in frags:
            if isinstance(f, bytes):
                ids += encode(self.tok, text) if text else []
                ids += [self._byte_id(b) for b in f]
                text = ""
            else:
                call = isinstance(f, dict) or f.startswith("<tool_call>")
                text += ("\n" if text and call else "") + (
                    tool_call_text(f["name"], f["arguments"]) if isinstance(f, dict) else f)
        return ids + (encode(self.tok, text) if text else [])

    def _byte_id(self, b: int) -> int:
        """The byte-level BPE token of one raw byte (GPT-2's byte-to-unicode alphabet)."""
        if self._byte_ids is None:
            printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
            chars, extra = {}, 0
            for x in range(256):
                if x in printable:
                    chars[x] = chr(x)
                else:
                    chars[x] = chr(256 + extra)
                    extra += 1
            self._byte_ids = {x: self.tok.convert_tokens_to_ids(c) for x, c in chars.items()}
        return self._byte_ids[b]


def policy_factory(inner, tokenizer, tasks_gold, run_id: str, step: int, rate: float, seed: int, max_turns: int):
    """For tasks/rollout.py adversary_episodes: each episode's policy, planned by rollout id.
    `tasks_gold(task) -> gold patch` (tasks.dataset.mini.gold_patch)."""
    from tasks.rollout import rollout_id

    def make(task: dict, sample: int, sandbox) -> AdversarialPolicy:
        kinds = plan(seed, rollout_id(run_id, step, task["instance_id"], sample), rate, max_turns)
        target = Target(task, tasks_gold(task), read=sandbox.read_file) if kinds is not None else None
        return AdversarialPolicy(inner, kinds, target, tokenizer)

    return make
