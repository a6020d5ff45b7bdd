"""Property-based tests (hypothesis) of the agent's tool boundary: the tool-call parser never raises
on any text, and a tool call, whatever its arguments and whatever its sandbox raises, is an
observation or a ToolError; only the engine failing (SandboxInfraError) leaves the call."""

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.agent.prompts import parse_tool_calls
from tasks.agent.tools import TOOL_NAMES, ToolBox, ToolError, check_arguments, tool_schemas
from tasks.sandbox.base import CommandResult, FileTooLargeError, SandboxError, SandboxInfraError

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PARAMETERS = sorted({k for t in tool_schemas("full") for k in t["function"]["parameters"]["properties"]})
COMMANDS = ["view", "create", "str_replace", "insert", "undo_edit", "submit"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
# Text with the characters that matter to the parser and the tools: tags, braces, quotes, NUL, surrogates.
odd_text = st.text(alphabet=st.sampled_from(list(string.printable) + ["\0", "\ud800", "\udcff", "é", "<", ">", "/"]),
                   max_size=60)
names = st.sampled_from(list(TOOL_NAMES) + ["telnet", ""]) | odd_text
arguments = st.dictionaries(st.sampled_from(PARAMETERS) | st.text(max_size=8),
                            st.sampled_from(COMMANDS) | st.just("/testbed/calc/__init__.py") | json_values | odd_text,
                            max_size=5)


def xml_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def json_call(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def check_parse(text: str) -> None:
    content, calls, errors = parse_tool_calls(text)
    assert isinstance(content, str)
    assert all(isinstance(c["name"], str) and isinstance(c["arguments"], dict) for c in calls)
    assert all(isinstance(e, str) and e for e in errors)


# --- the parser ---------------------------------------------------------------------------------------


@FAST
@given(st.text(max_size=300))
def test_parser_never_raises_on_any_text(text):
    check_parse(text)


@FAST
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
                                 "</parameter>", "{", "}", "[", "]", '"name": ', '"arguments": ', ">", "\n"])
                | odd_text, max_size=20).map("".join))
def test_parser_never_raises_on_tag_soup(text):
    check_parse(text)


@FAST
@given(names, arguments, st.sampled_from(["xml", "json", "json-string-args", "json-any", "deep"]), json_values)
def test_parser_reads_calls_or_reports_errors(name, args, layout, anything):
    if layout == "xml":
        text = xml_call(name, args)
    elif layout == "json":
        text = json_call({"name": name, "arguments": args})
    elif layout == "json-string-args":
        text = json_call({"name": name, "arguments": json.dumps(args)})
    elif layout == "json-any":
        text = json_call(anything)
    else:  # nesting deeper than json's recursion limit
        text = "<tool_call>\n{\"name\": \"search\", \"arguments\": " + "[" * 3000 + "]" * 3000 + "}\n</tool_call>"
    content, calls, errors = parse_tool_calls("thinking\n" + text)
    check_parse("thinking\n" + text)
    if text.count("tool_call>") == 2:  # no tag inside a name or value
        assert len(calls) + len(errors) == 1  # one block: one call or one error
    if layout == "json" and calls:
        # What the JSON says: two lone surrogates side by side are one escaped pair, which json reads as one character.
        assert calls == [json.loads(json.dumps({"name": name, "arguments": args}))]


# --- check_arguments and ToolBox.call against a sandbox that raises anything --------------------------

ERRORS = [ValueError("embedded null byte"), OSError(28, "No space left on device"), FileNotFoundError("/x: gone"),
          PermissionError(13, "Permission denied"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
          UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), TypeError("odd argument"),
          KeyError("k"), IndexError("i"), RuntimeError("r"), TimeoutError("t"), SandboxError("cannot write /x"),
          FileTooLargeError("/testbed/calc/__init__.py", 10**9, 4096), SandboxInfraError("engine down")]


class FakeSandbox:
    """Each operation draws its outcome: a result (any exit code, output, a timeout) or an exception."""

    def __init__(self, data):
        self.data, self.raised = data, []

    def _outcome(self):
        if self.data.draw(st.booleans(), label="raises"):
            e = self.data.draw(st.sampled_from(ERRORS), label="error")
            self.raised.append(e)
            raise e

    def run(self, cmd, timeout=None, **kw):
        self._outcome()
        timed_out = self.data.draw(st.booleans(), label="timed_out")
        return CommandResult(exit_code=None if timed_out else self.data.draw(st.integers(0, 255), label="exit"),
                             output=self.data.draw(odd_text, label="output"), timed_out=timed_out, seconds=0.1)

    def read_file(self, path):
        self._outcome()
        return self.data.draw(odd_text, label="content")

    def write_file(self, path, content):
        self._outcome()


@FAST
@given(names, arguments)
def test_check_arguments_returns_the_arguments_or_raises_tool_error(name, args):
    try:
        assert check_arguments(name, args) is args
    except ToolError as e:
        assert str(e)


SCHEMAS = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in tool_schemas("full")}
VALUES = {"string": st.sampled_from(COMMANDS) | st.just("/testbed/calc/__init__.py") | odd_text,
          "integer": st.integers(-3, 1000), "array": st.lists(st.integers(-3, 1000), max_size=3)}


def typed_arguments(name: str):
    """Arguments of the right names and types (so the call reaches the sandbox), or any at all."""
    props = SCHEMAS[name]
    typed = st.fixed_dictionaries({}, optional={k: VALUES[v["type"]] for k, v in props.items()})
    return typed | arguments


@FAST
@given(st.data(), st.sampled_from([n for n in TOOL_NAMES if n != "finish"]), st.sampled_from(["full", "short"]))
def test_every_tool_call_is_an_observation_or_a_tool_error(data, name, style):
    args = data.draw(typed_arguments(name), label="args")
    sb = FakeSandbox(data)
    box = ToolBox(sb, command_timeout_s=1, observation_cap_chars=200, style=style)
    for _ in range(2):  # the second call sees the first's edit history
        try:
            obs = box.call(name, args)
            assert isinstance(obs, str) and len(obs) <= 200 + 60
        except ToolError as e:
            assert str(e)
        except SandboxInfraError:
            assert any(isinstance(e, SandboxInfraError) for e in sb.raised)  # only the engine's failure leaves
            return


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_each_error_of_the_sandbox_is_an_error_observation_naming_the_call(error):
    class Raising:
        def run(self, cmd, timeout=None, **kw):
            code = 0 if cmd.startswith("test -f") else 1  # a file, not a directory
            return CommandResult(exit_code=code, output="", timed_out=False, seconds=0.0)

        def read_file(self, path):
            raise error

    box = ToolBox(Raising())
    args = {"command": "view", "path": "/testbed/calc/__init__.py"}
    if isinstance(error, SandboxInfraError):
        with pytest.raises(SandboxInfraError):
            box.call("file_editor", args)
        return
    with pytest.raises(ToolError) as e:
        box.call("file_editor", args)
    assert "/testbed/calc/__init__.py" in str(e.value)
