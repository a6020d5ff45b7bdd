"""The agent loop: one episode of a policy fixing one task in one sandbox.

Token-in, token-out: the episode is one token list that only ever grows. Each turn sends
the whole list to the inference server as the prompt, appends the sampled completion
(loss mask 1, with vLLM's logprobs) and then the tokens of the tool results (loss mask 0).
Nothing is ever re-tokenised, so the trainer sees exactly the tokens the policy sampled
and the server saw.

    for each turn, until `finish`, max_turns, the context or the episode's clock runs out:
        completion = policy(tokens)                      append it (generated)
        calls = parse_tool_calls(completion)             prompts.py
        results = [tools.call(c) for c in calls]         tools.py, in the sandbox
        append the results (observed)
    final patch = sandbox.diff()                         over its cap: finish_reason patch_too_large
                                                         unreadable (its chmod, a full disk): patch_unreadable

Whatever a tool call causes is an observation (ToolBox.call); the caller (tasks/rollout.py run_one)
bounds the episode's wall clock from outside and turns an error of our own code into its row.

Seeded sampling: with a run seed, turn t's request carries vLLM's per-request `seed`,
request_seed(run seed, rollout, t), so a rerun of the same configuration draws the same random
numbers for the same turn and samples the same tokens wherever the logits agree.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Protocol

from tasks.agent.prompts import INSTANCE_PROMPT, SYSTEM_PROMPT, parse_tool_calls
from tasks.agent.tools import ToolBox, ToolError, prompt_tools
from tasks.inference.client import Completion
from tasks.sandbox.base import PatchTooLargeError, PatchUnreadableError


class Policy(Protocol):
    """What the loop needs from a policy: an inference client (tasks/inference) or a scripted solver."""

    version: int

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float,
                       top_p: float, *, seed: int | None = None) -> Completion: ...


def request_seed(run_seed: int, rollout: str, turn: int) -> int:
    """The per-request sampling seed of a rollout's turn: a stable 63-bit hash (never Python's
    hash(), which is salted per process), in vLLM's accepted range."""
    digest = hashlib.sha256(f"{run_seed}:{rollout}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True)
class EpisodeConfig:
    """How an episode runs: its limits, its sampling, its prompt style (from a run's `agent` section)."""

    max_turns: int
    max_context_tokens: int
    max_tokens_per_turn: int
    temperature: float
    top_p: float
    command_timeout_s: float = 30.0
    observation_cap_chars: int = 8000
    episode_timeout_s: float = 600.0
    prompt_style: str = "full"

    @classmethod
    def of(cls, agent, split: str, temperature: float | None = None, top_p: float | None = None) -> "EpisodeConfig":
        """From an AgentConfig: the training or the validation sampling, by split."""
        sampling = agent.validation if split == "validation" else agent.training
        return cls(max_turns=agent.max_turns, max_context_tokens=agent.max_context_tokens,
                   max_tokens_per_turn=sampling.max_tokens_per_turn,
                   temperature=sampling.temperature if temperature is None else temperature,
                   top_p=sampling.top_p if top_p is None else top_p, command_timeout_s=agent.command_timeout_s,
                   observation_cap_chars=agent.observation_cap_chars, episode_timeout_s=agent.episode_timeout_s,
                   prompt_style=agent.prompt_style)


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
    servers: list[str] = field(default_factory=list)  # base URLs that generated its turns, first use order
    generation_seconds: float = 0.0
    sandbox_seconds: float = 0.0
    total_seconds: float = 0.0

    def append(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Generated tokens come with their logprobs (loss mask 1); observed ones without (mask 0)."""
        self.token_ids += ids
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class ServerMismatchError(RuntimeError):
    """The server reports a prompt other than the one we sent: the tokens would not be exact."""


def new_episode(problem_statement: str, tokenizer, cfg: EpisodeConfig) -> Episode:
    """An episode holding its prompt, before its first turn."""
    from tasks.policy.tokenizer import prompt_ids

    messages = [{"role": "system", "content": SYSTEM_PROMPT[cfg.prompt_style]},
                {"role": "user", "content": INSTANCE_PROMPT[cfg.prompt_style].format(problem_statement=problem_statement)}]
    tokens = prompt_ids(tokenizer, messages, prompt_tools(cfg.prompt_style))
    return Episode(messages=messages, token_ids=tokens, loss_mask=[0] * len(tokens), logprobs=[0.0] * len(tokens),
                   prompt_length=len(tokens))


async def run_episode(problem_statement: str, sandbox, policy: Policy, tokenizer, cfg: EpisodeConfig,
                      ep: Episode | None = None, run_seed: int | None = None, rollout: str = "") -> Episode:
    """Play one episode; `ep` (from new_episode) lets the caller keep what it holds should the episode
    not end by itself (an error, a cut from outside). With `run_seed`, each turn's request is seeded
    by request_seed(run_seed, rollout, turn); None leaves sampling to the server's own random state."""
    from tasks.policy.tokenizer import IM_END, observation_segment_ids

    started = time.monotonic()
    ep = ep if ep is not None else new_episode(problem_statement, tokenizer, cfg)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    box = ToolBox(sandbox, cfg.command_timeout_s, cfg.observation_cap_chars, style=cfg.prompt_style)

    for turn in range(cfg.max_turns):
        if time.monotonic() - started > cfg.episode_timeout_s:
            ep.finish_reason = "timeout"
            break
        room = cfg.max_context_tokens - len(ep.token_ids)
        if room < 1:
            ep.finish_reason = "context_limit"
            break
        t0 = time.monotonic()
        seed = request_seed(run_seed, rollout, turn) if run_seed is not None else None
        out = await policy.generate(ep.token_ids, min(cfg.max_tokens_per_turn, room), cfg.temperature, cfg.top_p,
                                    seed=seed)
        ep.generation_seconds += time.monotonic() - t0
        if out.prompt_token_ids is not None and list(out.prompt_token_ids) != ep.token_ids:
            raise ServerMismatchError(f"server saw {len(out.prompt_token_ids)} prompt tokens, we sent "
                                      f"{len(ep.token_ids)} (first difference at "
                                      f"{_first_difference(out.prompt_token_ids, ep.token_ids)})")
        ep.policy_versions.append(out.policy_version)
        if out.base_url and out.base_url not in ep.servers:
            ep.servers.append(out.base_url)
        ep.append(list(out.token_ids), list(out.logprobs))
        ep.num_turns = turn + 1
        content, calls, errors = parse_tool_calls(tokenizer.decode(out.token_ids, skip_special_tokens=False)
                                                  .removesuffix(IM_END))
        ep.messages.append({"role": "assistant", "content": content,
                            "tool_calls": [{"type": "function", "function": {"name": c["name"],
                                            "arguments": json.dumps(c["arguments"])}} for c in calls]})
        if not out.token_ids or out.token_ids[-1] != im_end:
            if len(ep.token_ids) >= cfg.max_context_tokens:
                ep.finish_reason = "context_limit"
                break
            ep.append([im_end])  # cut off at the per-turn limit: we close the turn (never trained on)
            errors.append(f"Your response was cut off after {len(out.token_ids)} tokens.")

        if any(c["name"] == "finish" for c in calls):
            calls = calls[:next(i for i, c in enumerate(calls) if c["name"] == "finish")]
            submitted = True
        else:
            submitted = False
        results = []
        for call in calls:
            t1 = time.monotonic()
            try:
                results.append(await asyncio.to_thread(box.call, call["name"], call["arguments"]))
            except ToolError as e:
                ep.tool_errors += 1
                results.append(f"ERROR: {e}")
            ep.sandbox_seconds += time.monotonic() - t1
        if submitted:
            ep.finish_reason = "submitted"
            break
        ep.tool_errors += len(errors)
        results += [f"ERROR: {e}" for e in errors]
        if not results:
            ep.tool_errors += 1
            results.append("ERROR: No tool call found. Call one of the tools, or `finish` when you are done.")
        results = [_printable(r) for r in results]
        ep.messages += [{"role": "tool", "content": r} for r in results]
        segment = observation_segment_ids(tokenizer, results)
        if len(ep.token_ids) + len(segment) >= cfg.max_context_tokens:
            ep.finish_reason = "context_limit"  # the next request would not fit: stop before sending it
            break
        ep.append(segment)
    t2 = time.monotonic()
    try:
        ep.final_patch = await asyncio.to_thread(sandbox.diff)
    except PatchTooLargeError as e:
        # The policy's own doing, so not masked: the empty patch's honest 0, never a cut (corrupt) one.
        ep.finish_reason, ep.final_patch = "patch_too_large", ""
        ep.error = f"patch_too_large: {e.size - e.cap} bytes over the {e.cap}-byte cap (the patch is {e.size} bytes)"
    except PatchUnreadableError as e:
        # The policy made its own repository unreadable (chmod, a full disk): its empty patch's 0 stands.
        ep.finish_reason, ep.final_patch = "patch_unreadable", ""
        ep.error = f"patch_unreadable: {e}"
    ep.sandbox_seconds += time.monotonic() - t2
    ep.total_seconds = time.monotonic() - started
    return ep


def _printable(text: str) -> str:
    """An observation the tokenizer can encode: lone surrogates (a JSON escape in an argument can make
    them, and observations echo arguments) become '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
