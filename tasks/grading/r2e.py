"""R2E-Gym's reward, reproduced behaviour for behaviour.

Reference: R2E-Gym at 69bc953, `repo_analysis/execution_log_parser.py::parse_log_pytest`,
`decolor_dict_keys`, and `agenthub/runtime/docker.py::run_tests` / `_calculate_reward_r2e`.
`expected_output_json` in the published rows was produced by that parser, so every quirk
below is kept on purpose (tests/test_grading_r2e.py pins each one):

1. Only the text between the first and the second "short test summary info" is read.
2. A line's status is decided by substring, in the order PASSED, FAILED, ERROR: a FAILED
   line whose message contains "PASSED" counts as PASSED.
3. The key is the node id after the file path, its "::" parts joined by "."; a line
   without "::" gets the key "" (e.g. a collection error of a whole file).
4. FAILED and ERROR keys are cut at the first " - " (the message); PASSED keys are not, but
   the reward cuts every key at " - " again, on both sides.
5. The reward strips colour codes of the form ESC[<digits>m from keys (not ESC[1;31m).
6. Cutting keys can merge two keys; the one that sorts last wins.
7. Reward 1 iff both maps have the same number of keys and every parsed status equals the
   expected one. An empty log against an empty expectation is a 1.
8. The test command's output has ESC[...m codes and carriage returns removed first; a run
   that hit the timeout is replaced by a fixed message (so it parses to {}).

One deviation: where R2E-Gym would raise KeyError (same key count, but a parsed key absent
from the expectation), this returns 0.
"""

from __future__ import annotations

import json
import re

SUMMARY_MARKER = "short test summary info"
# Order matters (quirk 2): the first status word found in a line decides.
_STATUS_WORDS = ("PASSED", "FAILED", "ERROR")
_OUTPUT_ANSI = re.compile(r"\x1b\[[0-9;]*m|\r")
_KEY_ANSI = re.compile("\x1b\\[\\d+m")


def clean_test_output(output: str, timed_out: bool, timeout_s: float) -> str:
    """The test log as R2E-Gym hands it to the parser (quirk 8)."""
    if timed_out:
        return f"The command took too long to execute (>{timeout_s:g}s)"
    return _OUTPUT_ANSI.sub("", output)


def parse_log_pytest(log: str | None) -> dict[str, str]:
    """Test key -> PASSED/FAILED/ERROR from pytest's `-rA` short test summary."""
    if log is None or SUMMARY_MARKER not in log:
        return {}
    section = log.split(SUMMARY_MARKER)[1].strip()  # quirk 1
    result: dict[str, str] = {}
    for line in section.split("\n"):
        status = next((w for w in _STATUS_WORDS if w in line), None)  # quirk 2
        if status is None:
            continue
        key = ".".join(line.split("::")[1:])  # quirk 3
        if status != "PASSED":
            key = key.split(" - ")[0]  # quirk 4
        result[key] = status
    return result


def decolor_keys(d: dict[str, str]) -> dict[str, str]:
    return {_KEY_ANSI.sub("", k): v for k, v in d.items()}  # quirk 5


def _normalise(d: dict[str, str]) -> dict[str, str]:
    d = decolor_keys(d)
    return {k.split(" - ")[0]: d[k] for k in sorted(d)}  # quirks 4 and 6


def r2e_reward(parsed: dict[str, str], expected: dict[str, str] | str) -> float:
    """1.0 iff the parsed statuses match the expected ones exactly (quirk 7), else 0.0."""
    if isinstance(expected, str):
        expected = json.loads(expected)
    p, e = _normalise(parsed), _normalise(expected)
    if len(p) != len(e):
        return 0.0
    return 1.0 if all(k in e and p[k] == e[k] for k in p) else 0.0
