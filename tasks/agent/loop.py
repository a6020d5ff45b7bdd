"""The agent loop: one episode of a policy fixing one task in one sandbox.

Token-in, token-out: the episode is one token list that only ever grows. Each
turn sends the whole list to the inference server as the prompt, appends the
sampled completion tokens (loss mask 1, with vLLM's logprobs) and then the
tokens of the tool results (loss mask 0). Nothing is ever re-tokenised, so the
trainer sees exactly the tokens the policy sampled and the server saw.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Protocol

from tasks.agent.tools import ToolBox, ToolError, prompt_tools

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


class Policy(Protocol):
    """What the loop needs from an inference client (tasks/inference implements it over vLLM)."""

    version: int

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       top_p: float) -> "Completion": ...


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (ended with the end-of-turn token) or "length"
    prompt_token_ids: list[int] | None = None  # what the server saw, when it says
    mistake: bool = False  # a scripted demonstration's deliberate mistake: kept in the episode, never learned


@dataclass
class Episode:
    messages: list[dict]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    num_turns: int = 0
    tool_errors: int = 0
    finish_reason: str = "max_turns"
    error: str | None = None
    final_patch: str = ""
    policy_versions: list[int] = field(default_factory=list)
    mistake_mask: list[int] | None = None  # set once a completion is a deliberate mistake
    generation_seconds: float = 0.0
    sandbox_seconds: float = 0.0
    total_seconds: float = 0.0


class ServerMismatchError(RuntimeError):
    """The server reports a prompt other than the one we sent: the tokens would not be exact."""


FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


def _typed_parameters() -> dict[tuple[str, str], str]:
    """(tool, parameter) -> JSON type, for the parameters that are not strings (view_range, insert_line)."""
    from tasks.agent.tools import tool_schemas

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
    <function=...> blocks (what our template renders) and JSON objects (Qwen3's)."""
    calls, errors = [], []
    for raw in TOOL_CALL_RE.findall(text):
        call, error = (_parse_json_call if raw.lstrip().startswith("{") else _parse_xml_call)(raw)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    content = TOOL_CALL_RE.sub("", text).strip()
    if "<tool_call>" in content and not calls and not errors:
        errors.append("Malformed tool call: <tool_call> is never closed by </tool_call>.")
    return content, calls, errors


async def run_episode(problem_statement: str, sandbox, policy: Policy, tokenizer, *, max_turns: int,
                      max_context_tokens: int, max_tokens_per_turn: int, temperature: float, top_p: float,
                      command_timeout_s: float = 30.0, observation_cap_chars: int = 8000,
                      episode_timeout_s: float = 600.0, prompt_style: str = "full") -> Episode:
    from tasks.policy.tokenizer import IM_END, observation_segment_ids, prompt_ids

    started = time.monotonic()
    tools = prompt_tools(prompt_style)
    messages = [{"role": "system", "content": SYSTEM_PROMPT[prompt_style]},
                {"role": "user", "content": INSTANCE_PROMPT[prompt_style].format(problem_statement=problem_statement)}]
    tokens = prompt_ids(tokenizer, messages, tools)
    ep = Episode(messages=messages, token_ids=tokens, loss_mask=[0] * len(tokens), logprobs=[0.0] * len(tokens),
                 prompt_length=len(tokens))
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    box = ToolBox(sandbox, command_timeout_s, observation_cap_chars, style=prompt_style)

    def append(ids: list[int], generated: bool, logprobs: list[float] | None = None, mistake: bool = False):
        if mistake and ep.mistake_mask is None:
            ep.mistake_mask = [0] * len(ep.token_ids)
        if ep.mistake_mask is not None:
            ep.mistake_mask += [1 if mistake else 0] * len(ids)
        ep.token_ids += ids
        ep.loss_mask += [1 if generated and not mistake else 0] * len(ids)
        ep.logprobs += logprobs if logprobs is not None and not mistake else [0.0] * len(ids)

    for turn in range(max_turns):
        if time.monotonic() - started > episode_timeout_s:
            ep.finish_reason = "timeout"
            break
        room = max_context_tokens - len(ep.token_ids)
        if room < 1:
            ep.finish_reason = "context_limit"
            break
        t0 = time.monotonic()
        out = await policy.generate(ep.token_ids, min(max_tokens_per_turn, room), temperature, top_p)
        ep.generation_seconds += time.monotonic() - t0
        if out.prompt_token_ids is not None and list(out.prompt_token_ids) != ep.token_ids:
            raise ServerMismatchError(f"server saw {len(out.prompt_token_ids)} prompt tokens, we sent "
                                      f"{len(ep.token_ids)} (first difference at "
                                      f"{_first_difference(out.prompt_token_ids, ep.token_ids)})")
        ep.policy_versions.append(getattr(out, "policy_version", policy.version))
        # Only a scripted demonstration makes deliberate mistakes; inference clients' replies have no such field.
        append(list(out.token_ids), True, list(out.logprobs), mistake=getattr(out, "mistake", False))
        ep.num_turns = turn + 1
        text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
        content, calls, errors = parse_tool_calls(text.removesuffix(IM_END))
        ep.messages.append({"role": "assistant", "content": content,
                            "tool_calls": [{"type": "function", "function": {"name": c["name"],
                                            "arguments": json.dumps(c["arguments"])}} for c in calls]})
        if not out.token_ids or out.token_ids[-1] != im_end:
            if len(ep.token_ids) >= max_context_tokens:
                ep.finish_reason = "context_limit"
                break
            # Cut off at the per-turn limit: close the turn ourselves (mask 0, never trained on).
            append([im_end], False)
            errors.append(f"Your response was cut off after {len(out.token_ids)} tokens.")

        results, submitted = [], False
        for call in calls:
            if call["name"] == "finish":
                submitted = True
                break
            t1 = time.monotonic()
            try:
                obs = await asyncio.to_thread(box.call, call["name"], call["arguments"])
            except ToolError as e:
                ep.tool_errors += 1
                obs = f"ERROR: {e}"
            except TypeError as e:  # wrong parameter types reach the tool as Python errors
                ep.tool_errors += 1
                obs = f"ERROR: invalid arguments for {call['name']}: {e}"
            ep.sandbox_seconds += time.monotonic() - t1
            results.append(obs)
        if submitted:
            ep.finish_reason = "submitted"
            break
        ep.tool_errors += len(errors)
        results += [f"ERROR: {e}" for e in errors]
        if not results:
            ep.tool_errors += 1
            results.append("ERROR: No tool call found. Call one of the tools, or `finish` when you are done.")
        for r in results:
            ep.messages.append({"role": "tool", "content": r})
        segment = observation_segment_ids(tokenizer, results)
        if len(ep.token_ids) + len(segment) >= max_context_tokens:
            # The next request would not fit: stop before sending it.
            ep.finish_reason = "context_limit"
            break
        append(segment, False)
    t2 = time.monotonic()
    ep.final_patch = await asyncio.to_thread(sandbox.diff)
    ep.sandbox_seconds += time.monotonic() - t2
    ep.total_seconds = time.monotonic() - started
    return ep


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
