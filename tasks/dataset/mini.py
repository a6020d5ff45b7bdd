"""The mini benchmark: R2E-Gym-format tasks whose environments are built locally.

Each task is a small stdlib-only Python package (one of `templates.PACKAGE_DOCS`)
with ONE injected bug, an issue written like a GitHub report (symptom + a `>>>`
reproduction, never the fix), hidden pytest tests in `r2e_tests/` (at least one
fails before the gold patch; the others pass both ways) and the gold patch as an
R2E-Gym-style ParsedCommit. Everything is a pure function of the config: the same
seed gives byte-identical rows and archives.

Splits are by instance (`split="instance"`, the default). Bug families, packages, the
identifier pools and the bug sites are shared by train and validation (a tiny model scores
~0 on families, names or edits it never trained on, docs/architecture.md s8; measured here too:
with sites split, 225 of 251 validation tasks needed an edit never demonstrated and a
warm start that solved a third of its training tasks solved no validation task), but no
validation task shares with any training task
  - its (package, function name, bug family),
  - its buggy function's text,
  - its issue text.
So a validation task is an edit the model has seen made to a function of another name
(and other argument names, neighbours, file layout, issue wording): it has to read the
code it is given rather than recall it. `split="bug_site"` adds a fourth key, the
(template, bug site, constants) group: each group belongs to one split, decided up front
per family (round-robin over functions, at least 4 groups in validation, no function
validation-only), the far harder generalisation. `split="text"` drops the first key: a
validation task may be a bug of a family the training set shows in the same function (another
instance: other argument names, constants, neighbours, layout and issue wording), so the edit's
site can be recalled while its text must still be copied from the file (how the prototype of
docs/architecture.md s8 split, where a tiny model reached pass@4 0.5-0.8).
`leakage_keys(row)` recomputes the keys from a row; the tests check them.
Names stay shared: validation reuses function names that training uses (for other bugs).

`difficulty` (0..1; every level keeps every family in both splits):
  - distractor code: each other function of the target module is included with
    probability 0.25 + 0.75*d, each other module of the package with probability d
    (d=0: one ~14-line module, the buggy function and sometimes a neighbour;
    d=0.5: ~20-line module, ~1.6 modules; d=1: the whole package, 2 modules of
    2-4 functions, ~27-line target module, ~57 lines in all);
  - how directly the issue points at the code: level 0 names the function and its
    file and states actual vs expected in the title; level 1 names the function;
    level 2 describes what the user tried to do, and only the reproduction's import
    shows where the code lives. Levels are drawn with weights ((1-d)^2, 2d(1-d), d^2);
  - the family mix: harder families (missing edge case, swapped arguments, wrong
    accumulator init, wrong return value, off-by-one, wrong function) get weight
    0.5 + d, the others 1.5 - d.
Within a family the surface form varies (sites in ~10-30 functions: different
operators, constants, names, positions), so a model fails some instances of a
family rather than whole families.
"""

from __future__ import annotations

import builtins
import copy
import difflib
import itertools
import json
import keyword
import random
import re
import string
import traceback
from dataclasses import dataclass

from tasks.dataset import archive
from tasks.dataset.templates import FAMILIES, HARD_FAMILIES, MODULE_DOCS, PACKAGE_DOCS, TEMPLATES, Template

GENERATOR_VERSION = "mini-1"
DEFAULT_IMAGE = "rlvr-sandbox:bookworm"
MAX_MODULE_LINES = 60
COMMIT_DATE = "2023-11-14T22:13:20+00:00"  # archive.EPOCH


# The leakage keys each split rule holds out: no validation task shares one with a training task.
# "fn" = (package, function name, bug family), "body" = the buggy function's text, "const" = the
# (template, bug site, constants) group, "issue" = the issue text.
HELD_OUT = {"bug_site": {"fn", "body", "const", "issue"}, "instance": {"fn", "body", "issue"},
            "text": {"body", "issue"}}


class GenerationError(RuntimeError):
    """The generator could not produce the requested dataset (a bug here, never bad input)."""


@dataclass
class MiniTask:
    row: dict  # a TASKS row; environment_uri is filled in when the archive is stored
    archive: bytes


# ----------------------------------------------------------------------------- rendering
def _sub(text: str, mapping: dict) -> str:
    return string.Template(text).substitute(mapping)


@dataclass
class Rendered:
    tpl: Template
    name: str  # the function name
    mapping: dict
    source: str  # the correct function, ending with "\n"

    @property
    def imports(self) -> tuple[str, ...]:
        return self.tpl.imports


_FOREIGN: dict[str, tuple[str, ...]] = {}


def _foreign_names(tpl: Template) -> tuple[str, ...]:
    """Every argument/local name of the shared vocabulary (all templates' pools) that `tpl` can
    take without clashing with a word its source, imports or Python already use."""
    if tpl.key in _FOREIGN:
        return _FOREIGN[tpl.key]
    used = set(re.findall(r"[A-Za-z_]\w*", re.sub(r"\$\w+", " ", tpl.src) + " ".join(tpl.imports)))
    used |= set(keyword.kwlist) | set(dir(builtins)) | set(tpl.fn)
    _FOREIGN[tpl.key] = tuple(sorted({n for t in TEMPLATES for pool in t.names.values() for n in pool} - used))
    return _FOREIGN[tpl.key]


def _render(tpl: Template, rng: random.Random, taken: set[str], prefer: set[str] = frozenset(),
            consts: dict | None = None, foreign_names: float = 0.0) -> Rendered | None:
    names = [n for n in tpl.fn if n not in taken]
    if set(names) & prefer:
        names = [n for n in names if n in prefer]
    if not names:
        return None
    mapping = {"fn": rng.choice(names)}
    for slot, pool in tpl.names.items():
        # rng.random() only when asked: the benchmark's own draws must not change.
        foreign = foreign_names > 0 and rng.random() < foreign_names
        mapping[slot] = rng.choice(_foreign_names(tpl) if foreign else pool)
    chosen = list(mapping.values())
    if len(set(chosen)) != len(chosen):  # two slots drew the same name
        return None
    if consts is None:
        consts = {k: rng.choice(v) for k, v in tpl.consts.items()}
    mapping.update({k: str(v) for k, v in consts.items()})
    for ident in string.Template(tpl.src).get_identifiers():  # a slot without a pool keeps its own name
        mapping.setdefault(ident, ident)
    mapping["_consts"] = consts
    src = _sub(tpl.src.strip("\n") + "\n", {k: v for k, v in mapping.items() if k != "_consts"})
    return Rendered(tpl, mapping["fn"], mapping, src)


def _merge_imports(lines) -> list[str]:
    """One `from X import a, b` line per module (functions bring their own import lines)."""
    names: dict[str, set] = {}
    plain = set()
    for ln in lines:
        if ln.startswith("from "):
            mod, _, what = ln[5:].partition(" import ")
            names.setdefault(mod, set()).update(w.strip() for w in what.split(","))
        else:
            plain.add(ln)
    return sorted(plain) + [f"from {m} import {', '.join(sorted(ns))}" for m, ns in sorted(names.items())]


def _module_text(package: str, module: str, funcs: list[Rendered]) -> str:
    imports = _merge_imports({i for f in funcs for i in f.imports})
    head = f'"""{MODULE_DOCS[(package, module)]}"""\n'
    if imports:
        head += "\n" + "\n".join(imports) + "\n"
    return head + "".join("\n\n" + f.source for f in funcs)


# ----------------------------------------------------------------------------- running
def _compile(r: Rendered, source: str):
    ns: dict = {}
    exec(compile("\n".join(r.imports) + "\n" + source, f"<mini:{r.name}>", "exec"), ns)  # our own generated code
    return ns[r.name]


def _outcome(fn, args: tuple):
    try:
        return ("value", fn(*copy.deepcopy(args)))
    except Exception as e:  # the behaviour under test, not an error of ours
        return ("raise", e)


def _passes(got, expected) -> bool:
    """Would the hidden test written for `expected` pass when the code does `got`?"""
    if expected[0] == "raise":
        return got[0] == "raise" and isinstance(got[1], type(expected[1]))
    if expected[1] is None or isinstance(expected[1], bool):  # the test asserts `is`
        return got[0] == "value" and got[1] is expected[1]
    return got[0] == "value" and _equal(got[1], expected[1])


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _literal_ok(value) -> bool:
    try:
        return _equal(eval(repr(value), {}), value) and type(eval(repr(value), {})) is type(value)
    except Exception:
        return False


def _expected_ok(r: Rendered, expected) -> bool:
    # A test may only pin behaviour the code documents: a value, or an exception it raises itself.
    if expected[0] == "raise":
        return f"raise {type(expected[1]).__name__}" in r.source
    return _literal_ok(expected[1])


# ----------------------------------------------------------------------------- issue text
def _call(fn: str, args: tuple) -> str:
    return f"{fn}({', '.join(repr(a) for a in args)})"


def _shown(outcome) -> str:
    if outcome[0] == "value":
        return repr(outcome[1])
    return "Traceback (most recent call last):\n  ...\n" + traceback.format_exception_only(outcome[1])[-1].rstrip("\n")


def _exc(outcome) -> str:
    return type(outcome[1]).__name__


def _problem_statement(rng: random.Random, level: int, r: Rendered, path: str, import_path: str,
                       args: tuple, actual, expected) -> str:
    fn, call = r.name, _call(r.name, args)
    a_kind, e_kind = actual[0], expected[0]
    if e_kind == "value" and a_kind == "value":
        short = f"returns `{repr(actual[1])}` instead of `{repr(expected[1])}`"
        expect = rng.choice([f"Expected `{repr(expected[1])}`.", f"It should return `{repr(expected[1])}`.",
                             f"The expected result is `{repr(expected[1])}`."])
    elif e_kind == "value":
        short = f"raises `{_exc(actual)}` instead of returning `{repr(expected[1])}`"
        expect = rng.choice([f"Expected `{repr(expected[1])}` instead of an exception.",
                             f"It should return `{repr(expected[1])}`."])
    elif a_kind == "value":
        short = f"returns `{repr(actual[1])}` instead of raising `{_exc(expected)}`"
        expect = rng.choice([f"Expected a `{_exc(expected)}` for this input.",
                             f"It should raise `{_exc(expected)}` here."])
    else:
        short = f"raises `{_exc(actual)}` instead of `{_exc(expected)}`"
        expect = rng.choice([f"It should raise `{_exc(expected)}`, which is what callers catch.",
                             f"Expected `{_exc(expected)}`: that is what callers catch."])
    if level == 0:
        title = f"`{fn}` in `{path}` {short}"
        intro = rng.choice([f"The function `{fn}` in `{path}` gives a wrong result for this input:",
                            f"`{fn}` (defined in `{path}`) misbehaves:"])
    elif level == 1:
        title = rng.choice([f"`{fn}` gives a wrong result", f"`{fn}` {short}", f"Bug in `{fn}`"])
        intro = rng.choice([f"I ran into this while using `{fn}`:", "Minimal reproduction:"])
    else:
        title = rng.choice([f"Wrong result when trying to {r.tpl.summary}",
                            f"Unexpected behaviour when I {r.tpl.summary}",
                            f"Cannot {r.tpl.summary} correctly"])
        intro = rng.choice(["Steps to reproduce:", "I ran into this:", "Reproduction:"])
    # The REPL prints nothing for None: show it the way a user would.
    shown_call = f"print({call})" if actual == ("value", None) else call
    repro = f">>> from {import_path} import {fn}\n>>> {shown_call}\n{_shown(actual)}"
    return f"{title}\n\n{intro}\n\n{repro}\n\n{expect}\n"


# ----------------------------------------------------------------------------- diffs
def unified_diff(path: str, old: str, new: str) -> str:
    """A git-style unified diff of one text file (what `git apply` accepts)."""
    if old == new:
        return ""
    head = f"diff --git a/{path} b/{path}\n"
    src, dst = f"a/{path}", f"b/{path}"
    if not old:
        head += "new file mode 100644\n"
        src = "/dev/null"
    elif not new:
        head += "deleted file mode 100644\n"
        dst = "/dev/null"
    body = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), src, dst, n=3))
    # difflib leaves a last line without "\n" unterminated; git wants the marker line
    lines = [ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in body.splitlines(True)]
    return head + "".join(lines)


def _hunks(diff: str) -> list[dict]:
    """The hunks of `unified_diff` output in R2E-Gym's ParsedCommit shape."""
    hunks, cur = [], None
    for ln in diff.splitlines():
        if ln.startswith("@@"):
            old, new = ln.split()[1:3]
            rng = lambda s: dict(zip(("start", "length"), [int(x) for x in s[1:].split(",")] + ([1] if "," not in s else [])))
            cur = {"descriptor": {"old_range": rng(old), "new_range": rng(new), "section": ""},
                   "line_group": {"all_lines": []}}
            hunks.append(cur)
        elif cur is not None and ln[:1] in (" ", "-", "+", "\\"):
            kind = {" ": "context", "-": "deleted", "+": "added", "\\": "note"}[ln[0]]
            cur["line_group"]["all_lines"].append({"content": ln[1:] if kind != "note" else ln[2:], "type": kind})
    return hunks


def parsed_commit(path: str, old: str, new: str, old_sha: str, new_sha: str, message: str) -> dict:
    diff = unified_diff(path, old, new)
    return {
        "file_diffs": [{
            "header": {"file": {"path": path}, "misc_line": None},
            "index_line": {"old_commit_hash": archive.blob_sha(old.encode())[:7],
                           "new_commit_hash": archive.blob_sha(new.encode())[:7], "mode": "100644"},
            "is_binary_file": False, "binary_line": None,
            "minus_file": {"path": f"a/{path}"}, "plus_file": {"path": f"b/{path}"},
            "old_file_content": old, "new_file_content": new,
            "hunks": _hunks(diff),
        }],
        "old_commit_hash": old_sha,
        "new_commit_hash": new_sha,
        "commit_message": message,
        "commit_date": COMMIT_DATE,
        "metadata": {},
    }


def _is_test_file(path: str) -> bool:
    parts = path.split("/")
    return (path.endswith("_test.py") or parts[-1].startswith("test_")
            or any(p in ("tests", "Tests", "test", "Test") for p in parts))


def _render_hunks(fd: dict) -> str:
    path = fd["header"]["file"]["path"]
    out = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
    for h in fd.get("hunks") or []:
        d = h["descriptor"]
        rng = lambda r: f"{r['start']}" if r.get("length") is None else f"{r['start']},{r['length']}"
        out += f"@@ -{rng(d['old_range'])} +{rng(d['new_range'])} @@" + (f" {d['section']}" if d.get("section") else "") + "\n"
        for ln in h["line_group"]["all_lines"]:
            out += {"context": " ", "added": "+", "deleted": "-", "note": "\\ "}[ln["type"]] + ln["content"] + "\n"
    return out


def gold_patch(task_row: dict, include_tests: bool = False) -> str:
    """The gold patch of a tasks-table row as a unified diff that `git apply` accepts in /testbed.

    Works for mini rows and for R2E-Gym rows: each file diff is rebuilt from its old and
    new contents when the row has them, else from its hunks. Test files are left out
    (R2E-Gym's hidden tests come with the environment), unless include_tests.
    """
    iid = task_row.get("instance_id")
    raw = task_row.get("parsed_commit_content")
    try:
        commit = json.loads(raw) if isinstance(raw, str) else raw
        diffs = commit["file_diffs"]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"task {iid!r}: parsed_commit_content is not a ParsedCommit JSON object ({e})") from None
    out = []
    for fd in diffs:
        path = fd["header"]["file"]["path"]
        if _is_test_file(path) and not include_tests:
            continue
        if "old_file_content" in fd and "new_file_content" in fd:
            out.append(unified_diff(path, fd["old_file_content"] or "", fd["new_file_content"] or ""))
        else:
            out.append(_render_hunks(fd))
    return "".join(out)


# ----------------------------------------------------------------------------- candidates
@dataclass
class _Candidate:
    family: str
    target: Rendered
    bug_index: int
    buggy_source: str
    fixed_lines: list[str]
    buggy_lines: list[str]
    fails: list[tuple]  # (args, expected outcome, buggy outcome)
    passes: list[tuple]
    statement: str
    level: int
    keys: tuple


def _changed(a: str, b: str) -> list[str]:
    """Lines of `b` that are not lines of `a` (a one-site edit: the edited lines)."""
    sm = difflib.SequenceMatcher(None, a.splitlines(), b.splitlines(), autojunk=False)
    return [ln for tag, _i1, _i2, j1, j2 in sm.get_opcodes() if tag != "equal" for ln in b.splitlines()[j1:j2]]


def _candidate(tpl: Template, bug_index: int, rng: random.Random, level: int,
               prefer: set[str] = frozenset(), consts: dict | None = None,
               foreign_names: float = 0.0) -> _Candidate | None:
    r = _render(tpl, rng, set(), prefer, consts, foreign_names)
    if r is None:
        return None
    bug = tpl.bugs[bug_index]
    plain = {k: v for k, v in r.mapping.items() if k != "_consts"}
    old, new = _sub(bug.old, plain), _sub(bug.new, plain)
    if r.source.count(old) != 1:
        return None
    buggy = r.source.replace(old, new)
    good_fn, bad_fn = _compile(r, r.source), _compile(r, buggy)
    fails, passes = [], []
    for args in tpl.case_list(r.mapping["_consts"]):
        expected = _outcome(good_fn, args)
        if not _expected_ok(r, expected):
            continue
        got = _outcome(bad_fn, args)
        (passes if _passes(got, expected) else fails).append((args, expected, got))
    buggy_lines = _changed(r.source, buggy)
    if any(buggy.splitlines().count(ln) != 1 for ln in buggy_lines):
        return None  # the agent's str_replace needs a unique old line
    if not fails:  # some bugs change every output (an accumulator's start): then no test passes both ways
        return None
    args, expected, actual = rng.choice(fails)
    path = f"{tpl.package}/{tpl.module}.py"
    statement = _problem_statement(rng, level, r, path, f"{tpl.package}.{tpl.module}", args, actual, expected)
    fixed_lines = _changed(buggy, r.source)
    if any(ln.strip() and ln.strip() in statement for ln in fixed_lines):
        return None  # the issue must never show the fix
    # Repro case first: the failing test that matches the issue.
    fails.sort(key=lambda f: f[0] != args)
    consts = tuple(sorted(r.mapping["_consts"].items()))
    keys = (("fn", tpl.package, r.name, bug.family), ("body", buggy),
            ("const", tpl.key, bug_index, repr(consts)), ("issue", statement))
    return _Candidate(bug.family, r, bug_index, buggy, fixed_lines, buggy_lines, fails, passes,
                      statement, level, keys)


def leakage_keys(row: dict) -> dict[str, str]:
    """The keys no validation row may share with a training row, recomputed from its content
    (for tests and audits); which keys depends on the dataset's split rule."""
    meta = json.loads(row["parsed_commit_content"])["metadata"]
    keys = {"fn": f"{row['repo_name']}|{meta['function']}|{row['bug_family']}",
            "body": meta["buggy_function"],
            "const": f"{meta['template']}|{meta['bug_site']}|{meta['constants']}",
            "issue": row["problem_statement"]}
    return {k: v for k, v in keys.items() if k in HELD_OUT[meta.get("split_rule", "bug_site")]}


# ----------------------------------------------------------------------------- assembling a task
def _test_line(fn: str, args: tuple, expected) -> str:
    call = _call(fn, args)
    if expected[0] == "raise":
        return f"    with pytest.raises({_exc(expected)}):\n        {call}\n"
    if expected[1] is None or isinstance(expected[1], bool):
        return f"    assert {call} is {expected[1]!r}\n"
    return f"    assert {call} == {repr(expected[1])}\n"


def _distractors(tpl: Template, target: Rendered, rng: random.Random, difficulty: float) -> dict[str, list[Rendered]]:
    """Correct neighbour functions, per module of the package (the target's module first)."""
    taken = {target.name}
    modules: dict[str, list[Rendered]] = {tpl.module: []}
    same_pkg = [t for t in TEMPLATES if t.package == tpl.package and t is not tpl]
    other_modules = sorted({t.module for t in same_pkg} - {tpl.module})
    keep_module = {m: rng.random() < difficulty for m in other_modules}
    for t in same_pkg:
        if t.module != tpl.module and not keep_module[t.module]:
            continue
        if rng.random() >= 0.25 + 0.75 * difficulty and t.module == tpl.module:
            continue
        for _ in range(5):
            d = _render(t, rng, taken)
            if d is not None:
                break
        if d is None:
            continue
        taken.add(d.name)
        modules.setdefault(t.module, []).append(d)
    return modules


def _assemble(c: _Candidate, rng: random.Random, difficulty: float, docker_image: str, split: str,
              split_rule: str) -> MiniTask:
    tpl, target = c.target.tpl, c.target
    pkg, path = tpl.package, f"{tpl.package}/{tpl.module}.py"
    modules = _distractors(tpl, target, rng, difficulty)
    neighbours = modules[tpl.module]
    while True:
        funcs = list(neighbours)
        funcs.insert(rng.randrange(len(funcs) + 1) if funcs else 0, target)
        fixed = _module_text(pkg, tpl.module, funcs)
        buggy_funcs = [Rendered(tpl, target.name, target.mapping, c.buggy_source) if f is target else f for f in funcs]
        buggy = _module_text(pkg, tpl.module, buggy_funcs)
        lines = buggy.splitlines()
        unique = all(lines.count(ln) == 1 for ln in c.buggy_lines)
        if (unique and len(lines) <= MAX_MODULE_LINES) or not neighbours:
            break
        neighbours = neighbours[:-1]  # a neighbour repeats the buggy line, or the file is too long
    if not all(buggy.splitlines().count(ln) == 1 for ln in c.buggy_lines):
        raise GenerationError(f"{tpl.key}: buggy line not unique in its own function")
    modules[tpl.module] = neighbours

    files = {f"{pkg}/__init__.py": f'"""{PACKAGE_DOCS[pkg]}"""\n',
             "README.md": f"# {pkg}\n\n{PACKAGE_DOCS[pkg]} Pure Python, standard library only.\n"}
    for mod, fs in modules.items():
        if mod != tpl.module and fs:
            files[f"{pkg}/{mod}.py"] = _module_text(pkg, mod, fs)
    files[path] = buggy

    # Hidden tests: the failing ones (the case first), some that pass both ways,
    # and one for a neighbour function (it must keep working).
    n_fail = 1 + (len(c.fails) > 1 and rng.random() < 0.5)
    chosen = c.fails[:n_fail] + rng.sample(c.passes, min(len(c.passes), rng.randint(2, 3)))
    if not c.passes:  # nothing passes both ways: a second failing case instead
        chosen = c.fails[:2]
    rng.shuffle(chosen)
    tests = [(target.name, args, exp) for args, exp, _got in chosen]
    imports = [target.name]
    if neighbours:
        d = rng.choice(neighbours)
        good = _compile(d, d.source)
        for args in rng.sample(d.tpl.case_list(d.mapping["_consts"]), len(d.tpl.case_list(d.mapping["_consts"]))):
            exp = _outcome(good, args)
            if _expected_ok(d, exp):
                tests.append((d.name, args, exp))
                imports.append(d.name)
                break
    counters: dict[str, int] = {}
    bodies = []
    for fn, args, exp in tests:
        counters[fn] = counters.get(fn, 0) + 1
        bodies.append((f"test_{fn}_{counters[fn]}", _test_line(fn, args, exp)))
    test_src = ("import pytest\n\n" if any(e[0] == "raise" for _f, _a, e in tests) else "")
    test_src += f"from {pkg}.{tpl.module} import {', '.join(sorted(set(imports)))}\n"
    test_src += "".join(f"\n\ndef {name}():\n{body}" for name, body in bodies)
    expected_output = {name: "PASSED" for name, _ in bodies}

    message = f"Initial import of {pkg}"
    blob, old_sha = archive.build_reproducible_archive(files, {"test_1.py": test_src}, message)
    fixed_files = dict(files, **{path: fixed})
    fix_message = f"Fix {target.name} in {path}"
    # The fix commit's parent is the (unique) buggy state, so its sha is unique too.
    new_sha = archive.commit_sha({p: s.encode() for p, s in fixed_files.items()}, fix_message, parent=old_sha)
    commit = parsed_commit(path, buggy, fixed, old_sha, new_sha, fix_message)
    commit["metadata"] = {
        "generator": GENERATOR_VERSION, "template": tpl.key, "bug_site": c.bug_index,
        "function": target.name, "constants": repr(tuple(sorted(target.mapping["_consts"].items()))),
        "buggy_function": c.buggy_source, "issue_level": c.level, "split_rule": split_rule,
    }
    row = {
        "instance_id": f"{pkg}__{new_sha[:12]}",
        "split": split,
        "repo_name": pkg,
        "docker_image": docker_image,
        "commit_hash": new_sha,
        "problem_statement": c.statement,
        "parsed_commit_content": json.dumps(commit, sort_keys=True),
        "expected_output_json": json.dumps(expected_output),
        "modified_files": [path],
        "relevant_files": [path],
        "prompt": None,
        "environment_uri": None,
        "bug_family": c.family,
    }
    return MiniTask(row, blob)


# ----------------------------------------------------------------------------- the dataset
def family_weights(difficulty: float) -> dict[str, float]:
    return {f: (0.5 + difficulty if f in HARD_FAMILIES else 1.5 - difficulty) for f in FAMILIES}


def _quotas(n: int, weights: dict[str, float]) -> dict[str, int]:
    """Largest-remainder apportionment with at least one task per family (when n allows)."""
    total = sum(weights.values())
    floor = 1 if n >= len(weights) else 0
    spare = n - floor * len(weights)
    raw = {f: spare * w / total for f, w in weights.items()}
    out = {f: floor + int(v) for f, v in raw.items()}
    for f in sorted(raw, key=lambda f: (-(raw[f] - int(raw[f])), f))[: n - sum(out.values())]:
        out[f] += 1
    return out


def _level(rng: random.Random, d: float) -> int:
    return rng.choices((0, 1, 2), weights=((1 - d) ** 2, 2 * d * (1 - d), d * d))[0]


def _const_combos(tpl: Template) -> list[dict]:
    keys = sorted(tpl.consts)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(tpl.consts[k] for k in keys))]


def _plan(rng: random.Random, val_fraction: float, split_rule: str) -> dict:
    """(split, family) -> {(template index, bug site): [constants...]}: which bug sites each split draws from.

    A bug site with given constants (a "group") belongs to one split, so a validation task
    always differs from every training task by more than its names. Per family, about
    `val_fraction` of the groups (at least 4) go to validation; no template is left
    without training groups (a function body never trained on is not what validation tests).
    """
    groups = [(b.family, t, i, c) for t, tpl in enumerate(TEMPLATES) for i, b in enumerate(tpl.bugs)
              for c in _const_combos(tpl)]
    if "const" not in HELD_OUT[split_rule]:  # every group is open to both splits
        plan: dict = {}
        for family, t, i, c in groups:
            for split in ("train", "validation"):
                plan.setdefault((split, family), {}).setdefault((t, i), []).append(c)
        return plan
    split_of = {}
    for family in FAMILIES:
        per_tpl: dict[int, list] = {}
        for g in groups:
            if g[0] == family:
                per_tpl.setdefault(g[1], []).append(g)
        for gs in per_tpl.values():
            rng.shuffle(gs)
        order = list(per_tpl)
        rng.shuffle(order)
        # Round-robin over the functions, so validation sees many functions of the family
        # rather than all the constant variants of a few.
        fam = [gs[k] for k in range(max(map(len, per_tpl.values()))) for t in order
               for gs in [per_tpl[t]] if k < len(gs)]
        n_val = min(len(fam) - 1, max(4, round(len(fam) * val_fraction)))
        for k, g in enumerate(fam):
            split_of[id(g)] = "validation" if k < n_val else "train"
    for t in range(len(TEMPLATES)):
        mine = [g for g in groups if g[1] == t]
        if all(split_of[id(g)] == "validation" for g in mine):
            split_of[id(rng.choice(mine))] = "train"
    plan: dict = {}
    for g in groups:
        family, t, i, c = g
        plan.setdefault((split_of[id(g)], family), {}).setdefault((t, i), []).append(c)
    return plan


def generate(cfg, docker_image: str = DEFAULT_IMAGE, max_attempts_per_task: int = 400) -> list[MiniTask]:
    """All tasks of the mini benchmark for a DatasetConfig (seed, num_train, num_validation, difficulty)."""
    rng = random.Random(f"{GENERATOR_VERSION}:{cfg.seed}")
    weights = family_weights(cfg.difficulty)
    slots = [(s, f) for s, n in (("train", cfg.num_train), ("validation", cfg.num_validation))
             for f, q in _quotas(n, weights).items() for _ in range(q)]
    rng.shuffle(slots)
    plan = _plan(rng, cfg.num_validation / (cfg.num_train + cfg.num_validation), cfg.split)
    tasks = _fill(slots, plan, rng, cfg, docker_image, {}, max_attempts_per_task)
    # Train first, then validation; generation order inside a split (it is already random).
    tasks.sort(key=lambda t: t.row["split"] != "train")
    return tasks


def generate_pool(cfg, n: int, benchmark_rows: list[dict], docker_image: str = DEFAULT_IMAGE,
                  max_attempts_per_task: int = 400, foreign_names: float = 0.0) -> list[MiniTask]:
    """`n` more training-distribution tasks for the warm start (SFT), none of them in the benchmark.

    The benchmark's 700 training tasks are what RL trains on; a tiny model that imitates only
    their demonstrations memorises them (measured: it writes a training function's line as
    `old_str` in 246 of 256 failed validation edits). The pool gives the warm start more
    instances of the same families and sites, so copying from the file pays and recalling does
    not. With `foreign_names` > 0, each argument/local name of a pool task's function is, with
    that probability, any name of the shared vocabulary instead of one of the function's own
    few: a model that recalls which names go with which function is then wrong, and only
    copying from the viewed file is right. Every pool task obeys the split rule against the
    benchmark's validation tasks (shares none of the rule's HELD_OUT keys with them), and
    duplicates no benchmark task.
    """
    if "const" in HELD_OUT[cfg.split]:
        raise ValueError("a warm-start pool needs dataset.split='instance' or 'text' (under 'bug_site' the "
                         "pool would draw from the training sites only; use pool size 0)")
    rng = random.Random(f"{GENERATOR_VERSION}:{cfg.seed}:pool" + (f":{foreign_names}" if foreign_names else ""))
    owner: dict = {}
    for row in benchmark_rows:
        meta = json.loads(row["parsed_commit_content"])["metadata"]
        for key in (("fn", row["repo_name"], meta["function"], row["bug_family"]),
                    ("body", meta["buggy_function"]), ("issue", row["problem_statement"])):
            # a benchmark training task's fn key stays open to the pool; body/issue never repeat
            owner[key] = "train" if key[0] == "fn" and row["split"] == "train" else "validation"
    slots = [("train", f) for f, q in _quotas(n, family_weights(cfg.difficulty)).items() for _ in range(q)]
    rng.shuffle(slots)
    plan = _plan(rng, 0.0, cfg.split)
    # A family whose sites run out of new instances yields fewer tasks than its quota.
    return _fill(slots, plan, rng, cfg, docker_image, owner, max_attempts_per_task, strict=False,
                 foreign_names=foreign_names)


def _fill(slots, plan, rng, cfg, docker_image, owner, max_attempts_per_task, strict=True,
          foreign_names: float = 0.0) -> list[MiniTask]:
    """One task per (split, family) slot, in order; `owner` maps leakage key -> split (updated)."""
    split_rule = cfg.split
    used = {"train": {}, "validation": {}}  # split -> template key -> function names of its tasks
    per_template = [0] * len(TEMPLATES)  # training tasks so far
    tasks: list[MiniTask] = []
    exhausted: set[str] = set()
    for split, family in slots:
        if family in exhausted:
            continue
        sites = list(plan[(split, family)].items())
        # Training spreads over the functions (few tasks of a function -> many of another would leave
        # validation tasks of the first with little to learn from).
        site_weights = [1.0 / (1 + per_template[t]) if split == "train" else 1.0 for (t, _i), _c in sites]
        for attempt in range(max_attempts_per_task):
            (t, bug_index), combos = rng.choices(sites, site_weights)[0]
            tpl = TEMPLATES[t]
            # Keep function names shared: validation reuses names training has used for this
            # function; training picks up any name only validation has so far.
            seen_train = used["train"].get(tpl.key, set())
            if attempt >= max_attempts_per_task // 2:  # a crowded family: any name will do
                prefer = set()
            elif split == "validation":
                prefer = seen_train
            else:
                prefer = used["validation"].get(tpl.key, set()) - seen_train
            c = _candidate(tpl, bug_index, rng, _level(rng, cfg.difficulty), prefer, rng.choice(combos),
                           foreign_names)
            if c is None:
                continue
            # body/issue keys must be new everywhere (no duplicate instances);
            # the rule's other held-out keys (fn, const) may repeat, but only inside one split.
            if any(k in owner for k in c.keys if k[0] in ("body", "issue")):
                continue
            keys = [k for k in c.keys if k[0] in HELD_OUT[split_rule]]
            if any(owner.get(k, split) != split for k in keys):
                continue
            for k in keys:
                owner[k] = split
            used[split].setdefault(tpl.key, set()).add(c.target.name)
            per_template[t] += split == "train"
            tasks.append(_assemble(c, rng, cfg.difficulty, docker_image, split, split_rule))
            break
        else:
            if not strict:
                exhausted.add(family)
                continue
            raise GenerationError(f"could not place a new '{family}' task in split '{split}' after "
                                  f"{max_attempts_per_task} attempts: too few distinct bug sites for "
                                  f"{cfg.num_train}+{cfg.num_validation} tasks")
    return tasks
