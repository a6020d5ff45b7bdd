"""R2E-Gym's agent tools, as OpenAI function schemas, executed in a rollout's sandbox.

`file_editor` (view, create, str_replace, insert, undo_edit), `execute_bash`,
`search` and `finish` keep R2E-Gym's names and parameters, so a policy trained
here speaks the same tool language as one trained on the real benchmark. The
editor runs on our side of the sandbox through read_file/write_file: no tool
scripts need to be installed in the image, and its edit history lives with the
episode.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from tasks.sandbox.base import FileTooLargeError, SandboxError, SandboxInfraError

SNIPPET_CONTEXT = 4

_DESCRIPTIONS = {
    "full": {
        "file_editor": (
            "Custom editing tool for viewing, creating and editing files.\n"
            "* State is persistent across command calls and discussions with the user.\n"
            "* If `path` is a file, `view` displays the result of applying `cat -n`. If `path` is a directory, "
            "`view` lists non-hidden files and directories up to 2 levels deep.\n"
            "* The `create` command cannot be used if the specified `path` already exists as a file.\n"
            "* If a `command` generates a long output, it will be truncated.\n"
            "* The `undo_edit` command reverts the last edit made to the file at `path`.\n"
            "Notes for using the `str_replace` command:\n"
            "* The `old_str` parameter should match EXACTLY one or more consecutive lines from the original file. "
            "Be mindful of whitespaces!\n"
            "* If the `old_str` parameter is not unique in the file, the replacement will not be performed. "
            "Include enough context in `old_str` to make it unique.\n"
            "* The `new_str` parameter should contain the edited lines that should replace the `old_str`."
        ),
        "execute_bash": (
            "Execute a bash command in the terminal, with /testbed as the working directory.\n"
            "* Long running commands are stopped after a timeout; run them in the background if needed.\n"
            "* Interactive commands are not supported."
        ),
        "search": (
            "Search for a term in a file or in all files under a directory.\n"
            "* With a directory `path` (default /testbed), lists the matching lines of every file below it.\n"
            "* With a file `path`, lists the matching lines with their line numbers."
        ),
        "finish": "Finish the task: submit the current state of /testbed as your solution.",
    },
    "short": {
        "file_editor": "View, create or edit a file. str_replace replaces old_str (unique, exact) with new_str.",
        "execute_bash": "Run a bash command in /testbed.",
        "search": "Search for a term in a file or directory.",
        "finish": "Submit the current state of /testbed.",
    },
}


def prompt_tools(style: str) -> list[dict] | None:
    """The schemas rendered into the prompt. The short style renders none: a tiny model trained from
    scratch learns its tools from demonstrations and cannot read JSON schemas, and they would be
    most of every episode's tokens (~480 of ~580 prompt tokens here)."""
    return tool_schemas(style) if style == "full" else None


def tool_schemas(style: str = "full") -> list[dict]:
    d, terse = _DESCRIPTIONS[style], style == "short"
    return [
        _fn("file_editor", d["file_editor"], {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                        "description": "The command to run."},
            "path": {"type": "string", "description": "Absolute path to a file or directory, e.g. /testbed/pkg/mod.py."},
            "file_text": {"type": "string", "description": "Content of the file, for create."},
            "view_range": {"type": "array", "items": {"type": "integer"},
                           "description": "Optional [start, end] line range for view; end -1 means to the end."},
            "old_str": {"type": "string", "description": "The exact text to replace, for str_replace."},
            "new_str": {"type": "string", "description": "The replacement text (str_replace) or text to insert (insert)."},
            "insert_line": {"type": "integer", "description": "Insert new_str after this line, for insert."},
        }, ["command", "path"], terse),
        _fn("execute_bash", d["execute_bash"], {
            "cmd": {"type": "string", "description": "The bash command to execute."},
        }, ["cmd"], terse),
        _fn("search", d["search"], {
            "search_term": {"type": "string", "description": "The term to search for."},
            "path": {"type": "string", "description": "File or directory to search in (default /testbed)."},
        }, ["search_term"], terse),
        _fn("finish", d["finish"], {
            "command": {"type": "string", "enum": ["submit"], "description": "Always 'submit'."},
            "result": {"type": "string", "description": "Optional summary of the change."},
        }, [], terse),
    ]


def _fn(name: str, description: str, properties: dict, required: list[str], terse: bool = False) -> dict:
    if terse:  # names and types only: every episode's prompt carries these schemas
        properties = {k: {x: y for x, y in v.items() if x != "description"} for k, v in properties.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


TOOL_NAMES = ("file_editor", "execute_bash", "search", "finish")


class ToolError(Exception):
    """The call was malformed, impossible or failed; its message becomes the observation."""


@dataclass
class ToolBox:
    """The tools bound to one episode's sandbox (it holds the editor's undo history)."""

    sandbox: object
    command_timeout_s: float = 30.0
    observation_cap_chars: int = 8000
    # "short": edits answer in one line instead of R2E-Gym's numbered snippet (fewer tokens per turn).
    style: str = "full"
    history: dict[str, list[str]] = field(default_factory=dict)

    def call(self, name: str, args: dict) -> str:
        """Run one tool call and return its observation. Whatever else the call causes raises
        ToolError (its message is the observation); only the engine failing (SandboxInfraError)
        leaves the episode."""
        try:
            args = check_arguments(name, args)
            return _cap(getattr(self, name)(**args), self.observation_cap_chars)
        except (ToolError, SandboxInfraError):
            raise
        except Exception as e:  # one boundary: a policy can cause any error here, so each is an outcome
            raise ToolError(_failure(name, args, e)) from e

    # -- file_editor ----------------------------------------------------------------------
    def file_editor(self, command: str | None = None, path: str | None = None, file_text: str | None = None,
                    view_range: list | None = None, old_str: str | None = None, new_str: str | None = None,
                    insert_line: int | None = None) -> str:
        if not command or not path:
            raise ToolError("file_editor needs `command` and `path`.")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ToolError(f"The path {path!r} is not an absolute path; it should start with '/'.")
        if command == "view":
            return self._view(path, view_range)
        if command == "create":
            if file_text is None:
                raise ToolError("Parameter `file_text` is required for command: create.")
            if self._is_file(path):
                raise ToolError(f"File already exists at: {path}. Cannot overwrite files using command `create`.")
            self.sandbox.write_file(path, file_text)
            self.history.setdefault(path, []).append(None)
            return f"File created successfully at: {path}"
        if command == "str_replace":
            if old_str is None:
                raise ToolError("Parameter `old_str` is required for command: str_replace.")
            text = self._read(path)
            count = text.count(old_str)
            if count == 0:
                raise ToolError(f"No replacement was performed, old_str `{old_str}` did not appear verbatim in {path}.")
            if count > 1:
                lines = [i + 1 for i, line in enumerate(text.split("\n")) if old_str.split("\n")[0] in line]
                raise ToolError(f"No replacement was performed. Multiple occurrences of old_str `{old_str}` "
                                f"in lines {lines}. Please ensure it is unique.")
            new = text.replace(old_str, new_str or "")
            self.history.setdefault(path, []).append(text)
            self.sandbox.write_file(path, new)
            first = text.split(old_str)[0].count("\n") + 1
            if self.style == "short":
                return f"The file {path} has been edited."
            return (f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of "
                    f"{path}:\n{_snippet(new, first, (new_str or '').count(chr(10)) + 1)}\n"
                    "Review the changes and make sure they are as expected. Edit the file again if necessary.")
        if command == "insert":
            if insert_line is None or new_str is None:
                raise ToolError("Parameters `insert_line` and `new_str` are required for command: insert.")
            text = self._read(path)
            lines = text.split("\n")
            if not isinstance(insert_line, int) or not 0 <= insert_line <= len(lines):
                raise ToolError(f"Invalid `insert_line` {insert_line!r}: it should be within [0, {len(lines)}].")
            new = "\n".join(lines[:insert_line] + new_str.split("\n") + lines[insert_line:])
            self.history.setdefault(path, []).append(text)
            self.sandbox.write_file(path, new)
            if self.style == "short":
                return f"The file {path} has been edited."
            return (f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of the "
                    f"edited file:\n{_snippet(new, insert_line + 1, new_str.count(chr(10)) + 1)}\n"
                    "Review the changes and make sure they are as expected. Edit the file again if necessary.")
        if command == "undo_edit":
            if not self.history.get(path):
                raise ToolError(f"No edit history found for {path}.")
            previous = self.history[path].pop()
            if previous is None:  # undoing a create
                self.sandbox.run(f"rm -f {shlex.quote(path)}", timeout=self.command_timeout_s)
                return f"Removed {path}, which the last edit created."
            self.sandbox.write_file(path, previous)
            return f"Last edit to {path} undone successfully. Here's the result of running `cat -n` on {path}:\n" \
                   + _numbered(previous)
        raise ToolError(f"Unrecognized command {command!r}. The allowed commands for file_editor are: "
                        "view, create, str_replace, insert, undo_edit.")

    def _view(self, path: str, view_range) -> str:
        if self._is_dir(path):
            r = self.sandbox.run(f"find {shlex.quote(path)} -maxdepth 2 -not -path '*/.*' | sort",
                                 timeout=self.command_timeout_s)
            return f"Here's the files and directories up to 2 levels deep in {path}, excluding hidden items:\n{r.output}"
        text = self._read(path)
        start = 1
        if view_range:
            lines = text.split("\n")
            if (not isinstance(view_range, list) or len(view_range) != 2
                    or not all(isinstance(x, int) for x in view_range)):
                raise ToolError("`view_range` should be a list of two integers.")
            lo, hi = view_range
            hi = len(lines) if hi == -1 else hi
            if not 1 <= lo <= len(lines) or hi < lo:
                raise ToolError(f"Invalid `view_range` {view_range}: lines run from 1 to {len(lines)}.")
            text, start = "\n".join(lines[lo - 1:hi]), lo
        return f"Here's the result of running `cat -n` on {path}:\n{_numbered(text, start)}"

    def _read(self, path: str) -> str:
        if not self._is_file(path):
            raise ToolError(f"The path {path} does not exist or is not a file.")
        try:
            return self.sandbox.read_file(path)
        except FileTooLargeError as e:  # whole or not at all: a cut copy written back would lose data
            raise ToolError(f"{e.strerror}; use execute_bash (head, sed -n, grep) to work with it.") from e

    def _is_file(self, path: str) -> bool:
        return self.sandbox.run(f"test -f {shlex.quote(path)}", timeout=self.command_timeout_s).exit_code == 0

    def _is_dir(self, path: str) -> bool:
        return self.sandbox.run(f"test -d {shlex.quote(path)}", timeout=self.command_timeout_s).exit_code == 0

    # -- execute_bash / search --------------------------------------------------------------
    def execute_bash(self, cmd: str | None = None) -> str:
        if not cmd or not isinstance(cmd, str):
            raise ToolError("execute_bash needs a non-empty `cmd`.")
        r = self.sandbox.run(cmd, timeout=self.command_timeout_s)
        if r.timed_out:
            return f"{r.output}\n[The command timed out after {self.command_timeout_s:.0f} seconds and was stopped.]"
        return f"Exit code: {r.exit_code}\nExecution output of [execute_bash]:\n{r.output}"

    def search(self, search_term: str | None = None, path: str | None = None) -> str:
        if not search_term or not isinstance(search_term, str):
            raise ToolError("search needs a non-empty `search_term`.")
        path = path or "/testbed"
        r = self.sandbox.run(
            f"grep -rnIF --exclude-dir=.git --exclude-dir=.venv --exclude-dir=__pycache__ -- "
            f"{shlex.quote(search_term)} {shlex.quote(path)} | head -n 100", timeout=self.command_timeout_s)
        hits = [line for line in r.output.splitlines() if line.strip()]
        if not hits:
            return f'No matches found for "{search_term}" in {path}'
        return f'Found {len(hits)} matches for "{search_term}" in {path}:\n' + "\n".join(hits)


_JSON_TYPES = {"string": str, "integer": int, "array": list}
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in tool_schemas("full")}


def _failure(name: str, args, e: Exception) -> str:
    """The observation of a call that failed: the call (its command, path, cmd, search term) and why."""
    what = ", ".join(f"{k}={_short(args[k])}" for k in ("command", "path", "cmd", "search_term")
                     if isinstance(args, dict) and k in args)
    why = str(e) if isinstance(e, (OSError, SandboxError)) and str(e) else f"{type(e).__name__}: {e}"
    return f"{name}({what}) failed: {why}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# Parameters that travel as argv entries (a path, a command line, a search term): NUL cannot be passed.
ARGV_PARAMETERS = ("path", "cmd", "search_term")
# Linux refuses to exec an argument over MAX_ARG_STRLEN (128 KiB, E2BIG); stay well below it.
MAX_ARGV_BYTES = 100_000


def check_arguments(name: str, args) -> dict:
    """A call's arguments checked against its tool's schema (names, required ones, JSON types):
    what the agent got wrong comes back as a ToolError naming it, before any tool runs."""
    if name not in _SCHEMAS or name == "finish":
        raise ToolError(f"Unknown tool '{name}'. Available tools: {', '.join(TOOL_NAMES)}.")
    if not isinstance(args, dict):
        raise ToolError("Tool arguments must be a JSON object.")
    props = _SCHEMAS[name]["properties"]
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise ToolError(f"Unexpected parameters {unknown}; this tool takes {list(props)}.")
    for key, value in args.items():
        want = props[key]["type"]
        ok = isinstance(value, _JSON_TYPES[want]) and not isinstance(value, bool)
        if ok and want == "array":
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if value is not None and not ok:
            kind = "a list of integers" if want == "array" else f"a JSON {want}"
            raise ToolError(f"Parameter {key} of {name} must be {kind}, got {json.dumps(value)[:100]}.")
        if key in ARGV_PARAMETERS and isinstance(value, str) and "\0" in value:
            raise ToolError(f"Parameter {key} of {name} contains a NUL byte (\\0), which no {key} can hold: "
                            f"{_short(value)}.")
        size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else 0
        if key in ARGV_PARAMETERS and size > MAX_ARGV_BYTES:
            raise ToolError(f"Parameter {key} of {name} is {size} bytes, over the "
                            f"{MAX_ARGV_BYTES}-byte limit for one command argument. Write long content to a file "
                            f"with file_editor create (file_text has no such limit) and run it, e.g. `bash /tmp/x.sh`.")
    return args


def _numbered(text: str, start: int = 1) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), start))


def _snippet(text: str, first_line: int, n_lines: int) -> str:
    lines = text.split("\n")
    lo = max(first_line - 1 - SNIPPET_CONTEXT, 0)
    hi = min(first_line - 1 + n_lines + SNIPPET_CONTEXT, len(lines))
    return _numbered("\n".join(lines[lo:hi]), lo + 1)


def _cap(text: str, cap: int) -> str:
    if len(text) <= cap:
        return text
    half = cap // 2
    return text[:half] + f"\n<response clipped: {len(text) - cap} characters omitted>\n" + text[-half:]
