"""Verdicts from outside the tested code: the recorder plugin's evidence against the test log.

The repository's code runs in pytest's own process, so whatever it prints or patches there can
lie to a grader that reads only the log. The grader therefore loads tasks/grading/verdict_plugin.py
into that process before any repository code, under a per-grading nonce, and decides with:

1. the log cut at the plugin's end marker: what the process printed after pytest's session ended
   (an atexit handler, a destructor) is not the test run's;
2. the plugin's record, written as pytest made each report: a test the log calls PASSED must have
   been reported PASSED by pytest;
3. the integrity of pytest itself: the functions that make and report outcomes are the ones
   loaded at start-up, come from pytest's own files, and no file the patch changed was loaded
   by pytest's start-up or registered as a pytest plugin.

Any disagreement makes the verdict `tampering`: reward 0, with what disagreed. An honest patch
never meets one, so R2E-Gym's exact reward stands for it. Where the plugin cannot load at all
(an environment whose pytest refuses it), the pristine state tells: if the plugin does not load
there either, the log alone decides, as in R2E-Gym.
"""

from __future__ import annotations

import json
import pathlib
import secrets
from dataclasses import dataclass, field


PLUGIN_SOURCE = (pathlib.Path(__file__).with_name("verdict_plugin.py")).read_text()
PLACEHOLDER = "@@RLVR_NONCE@@"


@dataclass
class Recorder:
    """One grading's plugin: a module name no repository can shadow (a random token; visible in
    sys.modules once loaded), and the nonce its lines carry (kept out of names)."""

    nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    token: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def module(self) -> str:
        return f"rlvr_verdict_{self.token}"

    @property
    def source(self) -> str:
        return PLUGIN_SOURCE.replace(PLACEHOLDER, self.nonce)

    @property
    def end_marker(self) -> str:
        return f"{self.nonce} end of pytest"

    @property
    def record_marker(self) -> str:  # printed by the grader's shell after pytest, before the record
        return f"{self.nonce} record"


@dataclass
class Evidence:
    loaded: bool = False
    ended: bool = False
    tests: dict[str, set[str]] = field(default_factory=dict)  # R2E key -> statuses pytest reported
    testbed_modules: list[tuple[str, str]] = field(default_factory=list)  # (module, repo path) at start-up
    foreign: list[str] = field(default_factory=list)  # pytest functions not from pytest's files at start-up
    changed: list[str] = field(default_factory=list)  # pytest functions replaced after start-up
    changed_files: list[str] = field(default_factory=list)
    plugins: list[tuple[str, str]] = field(default_factory=list)  # (name, repo path) registered later
    modules: set[str] = field(default_factory=set)  # top-level modules loaded at start-up


def r2e_key(nodeid: str) -> str:
    """R2E-Gym's key of a node id (tasks/grading/r2e.py quirk 3)."""
    return ".".join(nodeid.split("::")[1:])


def read_record(text: str, nonce: str) -> Evidence:
    """The plugin's lines (those that carry the nonce; anything else was written by someone else)."""
    ev = Evidence()
    prefix = nonce + " "
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            e = json.loads(line[len(prefix):])
        except ValueError:
            continue
        kind = e.get("event")
        if kind == "start":
            ev.loaded = True
            ev.testbed_modules = [tuple(m) for m in e.get("testbed_modules", [])]
            ev.foreign = list(e.get("foreign", []))
            ev.modules = set(e.get("modules", []))
        elif kind == "test":
            ev.tests.setdefault(r2e_key(e["nodeid"]), set()).add(e["status"])
        elif kind == "changed":
            ev.changed += e.get("names", [])
            ev.changed_files += e.get("files", [])
        elif kind == "plugin" and e.get("testbed_file"):
            ev.plugins.append((e.get("name", ""), e["testbed_file"]))
        elif kind == "end":
            ev.ended = True
    return ev


def split_record(output: str, rec: Recorder) -> tuple[str, str]:
    """(the test command's output, the record the grader's shell printed after it). Without the
    marker (the command was killed by the clock) there is no record."""
    head, sep, tail = output.rpartition("\n" + rec.record_marker + "\n")
    return (head, tail) if sep else (output, "")


def cut_log(log: str, rec: Recorder) -> tuple[str, str]:
    """(the test run's log, what came after pytest's session ended). Without the marker (pytest
    did not end: a crash, a timeout, os._exit) the whole log is the run's."""
    head, sep, tail = log.rpartition("\n" + rec.end_marker)
    if not sep:
        return log, ""
    return head, tail.split("\n", 1)[1] if "\n" in tail else ""


def touches(path: str, changed: set[str]) -> bool:
    """`path` is one of the changed paths, or inside a new directory git lists once as "dir/"."""
    return path in changed or any(c.endswith("/") and path.startswith(c) for c in changed)


def disagreements(statuses: dict[str, str], ev: Evidence, late: str, changed_paths: set[str]) -> list[str]:
    """What the evidence says against the log's verdict (empty: none). `statuses` is the R2E parse
    of the cut log; `changed_paths` the repo paths the applied patch added or changed."""
    out = []
    for module, path in ev.testbed_modules:
        if touches(path, changed_paths):
            out.append(f"pytest's start-up loaded {path} (module {module}) from the patch")
    for name in ev.foreign:
        out.append(f"pytest's {name} is not pytest's own code at start-up")
    if ev.changed:
        files = ", ".join(sorted(set(ev.changed_files)))[:300]
        out.append(f"pytest functions replaced during the run: {', '.join(ev.changed[:5])}"
                   f"{' ...' if len(ev.changed) > 5 else ''} (now from {files})")
    for name, path in ev.plugins:
        if touches(path, changed_paths):
            out.append(f"the patch's {path} registered a pytest plugin ({name})")
    for key, status in sorted(statuses.items()):
        if status == "PASSED" and key and "PASSED" not in ev.tests.get(key, set()):
            got = "/".join(sorted(ev.tests[key])) if key in ev.tests else "no report"
            out.append(f"the log says {key} PASSED, pytest reported {got}")
    late_claims = [ln for ln in late.splitlines() if "PASSED" in ln and "::" in ln]
    if late_claims:
        out.append(f"output after pytest's session ended claims {len(late_claims)} passed tests")
    return out
