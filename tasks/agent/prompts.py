"""What the agent reads and writes: its prompts, and the parser of its tool calls.

The prompts come in two styles: "full" (R2E-Gym's wording, tool schemas rendered into the
prompt) and "short" (a tiny model trained from scratch learns its tools from demonstrations).
A completion's tool calls sit in <tool_call> blocks, in Qwen3.5's XML layout (what our chat
template renders) or as JSON objects (Qwen3's hermes layout); both are read.
"""

from __future__ import annotations

import json
import re

from tasks.agent.tools import tool_schemas

SYSTEM_PROMPT = {
    "full": ("You are a programming agent who is provided a GitHub issue and a repository in a bash "
             "environment, and is tasked to resolve the issue by editing the repository's code. Use the tools "
             "to explore the code, make the change, check it, and call `finish` when you are done."),
    "short": ("You fix bugs in Python repositories with the tools file_editor, execute_bash, search and finish. "
              "Call finish when done."),
}
INSTANCE_PROMPT = {
    "full": ("I have uploaded a Python code repository in the /testbed directory. Consider the following "
             "GitHub issue:\n\n<github_issue>\n{problem_statement}\n</github_issue>\n\n"
             "Make the minimal changes to non-test files in /testbed so that the issue is resolved. The tests "
             "have already been taken care of: do not modify any tests. First find the code the issue is about, "
             "then edit it, then (optionally) run a reproduction to confirm the fix, and finally call `finish`."),
    "short": "Repository: /testbed\n\n<github_issue>\n{problem_statement}\n</github_issue>",
}

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


def _typed_parameters() -> dict[tuple[str, str], str]:
    """(tool, parameter) -> JSON type, for the parameters that are not strings (view_range, insert_line)."""
    return {(t["function"]["name"], k): v["type"] for t in tool_schemas("full")
            for k, v in t["function"]["parameters"]["properties"].items() if v["type"] != "string"}


NON_STRING_PARAMETERS = _typed_parameters()


def _parse_xml_call(raw: str) -> tuple[dict | None, str | None]:
    """<function=NAME><parameter=KEY>VALUE</parameter>...</function> (Qwen3.5's layout) -> (call, error)."""
    m = FUNCTION_RE.fullmatch(raw.strip())
    if not m or not m.group(1).strip():
        return None, f"Malformed tool call (expected <function=NAME> ... </function>): {raw[:200]}"
    name, args = m.group(1).strip(), {}
    for key, value in PARAMETER_RE.findall(m.group(2)):
        key = key.strip()
        if (name, key) in NON_STRING_PARAMETERS:
            try:
                value = json.loads(value)
            except ValueError:
                return None, f"Malformed tool call (parameter {key} of {name} is not a JSON {NON_STRING_PARAMETERS[name, key]}): {value[:100]}"
        args[key] = value
    return {"name": name, "arguments": args}, None


def _parse_json_call(raw: str) -> tuple[dict | None, str | None]:
    """{"name": ..., "arguments": {...}} (the hermes layout of Qwen2.5/Qwen3 checkpoints) -> (call, error)."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return None, f"Malformed tool call (invalid JSON: {e.msg} at char {e.pos}): {raw[:200]}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f"Malformed tool call (needs a \"name\" and \"arguments\"): {raw[:200]}"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None, f"Malformed tool call (arguments are not a JSON object): {raw[:200]}"
    if not isinstance(args, dict):
        return None, f"Malformed tool call (arguments are not a JSON object): {raw[:200]}"
    return {"name": obj["name"], "arguments": args}, None


def parse_tool_calls(text: str) -> tuple[str, list[dict], list[str]]:
    """Split a completion into its free text, the well-formed calls and one error per malformed call.

    Reads both layouts a Qwen model may write inside <tool_call>: Qwen3.5's XML-style
    <function=...> blocks (what our template renders) and JSON objects (Qwen3's). Never raises:
    whatever text the model wrote is calls, errors or free text."""
    calls, errors = [], []
    for raw in TOOL_CALL_RE.findall(text):
        try:
            call, error = (_parse_json_call if raw.lstrip().startswith("{") else _parse_xml_call)(raw)
        except Exception as e:  # one boundary: whatever the text makes the parse raise (deep nesting) is its error
            call, error = None, f"Malformed tool call ({type(e).__name__}: {str(e)[:100]}): {raw[:200]}"
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    content = TOOL_CALL_RE.sub("", text).strip()
    if "<tool_call>" in content and not calls and not errors:
        errors.append("Malformed tool call: <tool_call> is never closed by </tool_call>.")
    return content, calls, errors
