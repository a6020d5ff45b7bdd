"""A scripted solver that plays the policy's part in the real agent loop, to make demonstrations.

It knows the gold patch and turns it into the tool calls a competent agent would
make: (sometimes search for the function,) view the file, `str_replace` each
hunk with just enough context to be unique, (sometimes run the reproduction from
the issue,) then `finish`. Its turns go through the same loop, tools, sandbox
and tokenizer as the policy's, so a demonstration is token-for-token the kind
of trajectory the policy will later sample. Train-split tasks only.

With `blind_rate`, some demonstrations skip looking: no search, no view, straight to the edit.
The solver can, since it holds the gold patch and the file; a student imitating it cannot, and
learns to sometimes edit code it has not read. That is how demonstrations by a privileged expert
go wrong for a student (the imitation gap): no amount of further imitation removes the habit,
while a reward for fixed tests does, which is the lift RL is measured on here.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tasks.inference.client import Completion

IMPORT_RE = re.compile(r">>> from ([\w.]+) import (\w+)")


@dataclass
class Hunk:
    path: str
    before: list[str]  # context lines before the change
    removed: list[str]
    added: list[str]
    after: list[str]


def parse_unified_diff(patch: str) -> list[Hunk]:
    hunks: list[Hunk] = []
    path = None
    lines = patch.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            target = line[4:].strip()
            path = target[2:] if target.startswith("b/") else target
        elif line.startswith("@@") and path:
            body = []
            i += 1
            while i < len(lines) and not lines[i].startswith(("@@", "diff --git", "--- ")):
                body.append(lines[i])
                i += 1
            hunks.extend(_split_hunk(path, body))
            continue
        i += 1
    return hunks


def _split_hunk(path: str, body: list[str]) -> list[Hunk]:
    """One diff hunk can hold several separate changes; each becomes its own edit."""
    out, context, cur = [], [], None
    for raw in body:
        if raw.startswith("\\"):  # "\ No newline at end of file"
            continue
        tag, text = (raw[:1], raw[1:]) if raw else (" ", "")
        if tag == " ":
            if cur is not None:
                cur.after.append(text)
            context.append(text)
        else:
            if cur is None or cur.after:
                if cur is not None:
                    out.append(cur)
                cur = Hunk(path, list(context), [], [], [])
            (cur.removed if tag == "-" else cur.added).append(text)
            context = []
    if cur is not None:
        out.append(cur)
    return out


def unique_edit(text: str, h: Hunk) -> tuple[str, str]:
    """The smallest old_str/new_str pair around the hunk that occurs exactly once in the file."""
    for width in range(0, max(len(h.before), len(h.after)) + 1):
        for b, a in ((width, 0), (0, width), (width, width)):
            if b > len(h.before) or a > len(h.after):
                continue
            before = h.before[len(h.before) - b:] if b else []
            after = h.after[:a]
            old = before + h.removed + after
            if not old:
                continue
            old_str = "\n".join(old)
            if text.count(old_str) == 1:
                return old_str, "\n".join(before + h.added + after)
    raise ValueError(f"no unique str_replace for the hunk in {h.path}")


class ScriptedSolver:
    """Implements the loop's Policy protocol; `version` -1 marks demonstrations in trajectories."""

    version = -1

    def __init__(self, task: dict, gold_patch: str, sandbox, tokenizer, rng: random.Random, max_turns: int = 30,
                 blind_rate: float = 0.0):
        self.task, self.patch, self.sandbox, self.tok, self.rng = task, gold_patch, sandbox, tokenizer, rng
        self.max_turns, self.blind_rate = max_turns, blind_rate
        self.turns: list[dict] | None = None
        self.i = 0

    def _plan(self) -> list[dict]:
        hunks = parse_unified_diff(self.patch)
        if not hunks:
            raise ValueError(f"task {self.task['instance_id']}: gold patch has no hunks")
        m = IMPORT_RE.search(self.task["problem_statement"])
        turns = []
        optional = self.max_turns - (len(hunks) + len({h.path for h in hunks}) + 1)  # turns to spare
        # Drawn only when asked for, so that the other demonstrations' draws stay as they were.
        blind = self.blind_rate > 0 and self.rng.random() < self.blind_rate
        if m and optional >= 1 and not blind and self.rng.random() < 0.25:
            optional -= 1
            turns.append({"name": "search", "arguments": {"search_term": f"def {m.group(2)}", "path": "/testbed"}})
        if optional >= 2 and not blind:
            self.rng.random()  # a retired option's draw, kept: the demonstrations stay the ones make base used
        edits = []
        for path in dict.fromkeys(h.path for h in hunks):
            full = f"/testbed/{path}"
            text = self.sandbox.read_file(full)
            view = {"name": "file_editor", "arguments": {"command": "view", "path": full}}
            if not blind:
                turns.append(view)
            for h in (h for h in hunks if h.path == path):
                old, new = unique_edit(text, h)
                text = text.replace(old, new)
                edits.append({"name": "file_editor", "arguments": {"command": "str_replace", "path": full,
                                                                   "old_str": old, "new_str": new}})
        turns += edits
        if m and optional >= 1 and self.rng.random() < 0.25:
            call = _reproduction(self.task["problem_statement"])
            if call:
                turns.append({"name": "execute_bash", "arguments": {"cmd": call}})
        turns.append({"name": "finish", "arguments": {"command": "submit"}})
        return turns

    async def generate(self, prompt_ids, max_tokens, temperature, top_p, *, seed=None) -> Completion:
        from tasks.policy.tokenizer import assistant_text, encode

        if self.turns is None:
            self.turns = self._plan()
        call = self.turns[min(self.i, len(self.turns) - 1)]
        self.i += 1
        ids = encode(self.tok, assistant_text(None, [call]))
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", policy_version=self.version)


def _reproduction(problem: str) -> str | None:
    """The issue's `>>>` lines as one `python3 -c` command."""
    lines = [ln[4:] for ln in problem.splitlines() if ln.startswith(">>> ")]
    if not lines:
        return None
    last = lines[-1]
    if not last.startswith(("print(", "import ", "from ")) and "=" not in last.split("(")[0]:
        lines[-1] = f"print({last})"
    code = "; ".join(lines).replace("'", "\"")
    return f"python3 -c '{code}'"
