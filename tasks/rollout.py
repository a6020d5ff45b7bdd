"""Rollout generation: G episodes per task, many in flight at once, written as a trajectories table.

Each episode gets its own sandbox. A sandbox that cannot start is retried a few
times and then recorded as an `infra_error` trajectory (masked downstream,
never dropped). An error of our own code inside an episode ends that episode
alone, as an `agent_error` row (masked, its traceback kept); an episode still
running past its wall-clock bound is cut from outside (a `timeout` row). An
inference server that goes away fails the in-flight episodes, which are retried;
finished episodes are committed as they complete, in small
append-only `<stage>_partial-NNNNN` tables (one per flush: a flush writes only the
episodes finished since the last one), so a crash or kill loses at most the episodes
in flight and a rerun of the same stage picks up where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import pyarrow as pa

from schemas.tables import TRAJECTORIES
from tasks.agent.loop import Episode, EpisodeConfig, ServerMismatchError, new_episode, run_episode
from tasks.inference import InferenceUnavailable

# Past episode_timeout_s, which the loop checks between turns: room for the turn in progress (a
# generation, its tool calls) and the final diff before the episode is cut from outside.
EPISODE_GRACE_S = 120.0
AGENT_ERROR_CHARS = 8000  # of an agent_error's message and traceback, kept in the row


@dataclass
class RolloutSpec:
    run_id: str
    step: int
    split: str
    samples_per_task: int
    temperature: float
    top_p: float


# How collect runs one episode: (task, sample index) -> its trajectory row. In this process:
# served_episodes, scripted_episodes, adversary_episodes; on a Ray cluster: tasks.cluster.RayEpisodes.
Episodes = Callable[[dict, int], Awaitable[dict]]


@dataclass(frozen=True)
class PartialTable:
    """Where a stage commits its finished episodes as they finish (append-only parts next to `key`,
    at most one per `flush_every_s`), so that a rerun of the stage skips them."""

    store: Any
    key: str
    flush_every_s: float = 0.0


class InferenceDown(RuntimeError):
    """The inference server stayed unreachable past the retry bound."""


def rollout_id(run_id: str, step: int, instance_id: str, sample: int) -> str:
    return f"{run_id}/s{step:05d}/{instance_id}/{sample}"


def sampling_key(spec: RolloutSpec, instance_id: str, sample: int) -> str:
    """What seeds a rollout's requests (tasks/agent/loop.py request_seed): its rollout id without the
    run id, which a rerun changes, and with the split, so evaluation and training never share seeds."""
    return f"{spec.split}/s{spec.step:05d}/{instance_id}/{sample}"


def episode_row(spec: RolloutSpec, task: dict, sample: int, ep: Episode, policy_version: int) -> dict:
    return dict(
        rollout_id=rollout_id(spec.run_id, spec.step, task["instance_id"], sample), run_id=spec.run_id,
        step=spec.step,
        # An episode can straddle a weight update; its age is that of its oldest turn.
        policy_version=min(ep.policy_versions) if ep.policy_versions else policy_version,
        instance_id=task["instance_id"], group_id=f"s{spec.step:05d}/{task['instance_id']}", sample_index=sample,
        split=spec.split, messages=json.dumps(ep.messages), token_ids=ep.token_ids, loss_mask=ep.loss_mask,
        generation_logprobs=ep.logprobs, prompt_length=ep.prompt_length,
        num_turns=ep.num_turns,
        num_generated_tokens=sum(ep.loss_mask), tool_errors=ep.tool_errors, finish_reason=ep.finish_reason,
        error=ep.error, final_patch=ep.final_patch, generation_seconds=ep.generation_seconds,
        sandbox_seconds=ep.sandbox_seconds, total_seconds=ep.total_seconds, servers=ep.servers or None,
    )


def infra_error_row(spec: RolloutSpec, task: dict, sample: int, reason: str, policy_version: int) -> dict:
    ep = Episode(messages=[], token_ids=[], loss_mask=[], logprobs=[], prompt_length=0, finish_reason="infra_error",
                 error=reason[:2000])
    return episode_row(spec, task, sample, ep, policy_version)


def partial_parts(store, partial_key: str) -> list[str]:
    """The committed part tables of a stage's finished episodes, in order."""
    stem = partial_key.removesuffix(".parquet") + "-"
    folder = partial_key.rsplit("/", 1)[0]
    return sorted(c.key for c in store.commits(folder) if c.key.startswith(stem))


def part_index(part_key: str) -> int:
    """".../trajectories_partial-00002.parquet" -> 2."""
    return int(part_key.removesuffix(".parquet").rsplit("-", 1)[1])


def read_partial(store, partial_key: str) -> dict[str, dict]:
    """rollout id -> row of every finished episode a killed attempt committed (parts, and the one
    table earlier versions rewrote)."""
    keys = ([partial_key] if store.is_committed(partial_key) else []) + partial_parts(store, partial_key)
    done = {}
    for key in keys:
        for row in store.read_table(key, stage="trajectories_partial").to_pylist():
            done[row["rollout_id"]] = row
    return done


def agent_error_text(e: BaseException) -> str:
    """An agent_error's `error`: type, message and traceback, capped (its head and its innermost frames)."""
    text = f"agent_error: {type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e))
    if len(text) <= AGENT_ERROR_CHARS:
        return text
    half = AGENT_ERROR_CHARS // 2
    return text[:half] + f"\n[... {len(text) - AGENT_ERROR_CHARS} characters omitted ...]\n" + text[-half:]


async def run_one(task: dict, sample: int, spec: RolloutSpec, policy, tokenizer, cfg, store=None,
                  make_policy=None) -> dict:
    """One episode in a sandbox of its own -> its trajectory row. A sandbox that cannot start or
    fails mid-episode is retried cfg.sandbox.infra_retries times, then recorded as an infra_error
    row; an inference server that stays away raises InferenceDown. An episode past
    episode_timeout_s + EPISODE_GRACE_S is cut from outside (its sandbox closed, which ends the
    call it hangs in): a timeout row. Any other error of ours ends this episode alone: an
    agent_error row with what the episode held so far. With `make_policy(task, sample, sandbox)`
    the episode's policy is made in its open sandbox; `policy` (or None) then only dates a row
    that no policy played."""
    from tasks.sandbox import SandboxInfraError, open_sandbox

    episode = EpisodeConfig.of(cfg.agent, spec.split, spec.temperature, spec.top_p)
    run_seed = cfg.seed if cfg.agent.seeded_sampling else None
    version = policy.version if policy is not None else -1
    rid = rollout_id(spec.run_id, spec.step, task["instance_id"], sample)
    row, server_failures = None, 0
    for attempt in range(cfg.sandbox.infra_retries + 1):
        try:
            sandbox = await asyncio.to_thread(open_sandbox, task, cfg.sandbox, store, "agent")
        except Exception as e:  # engine down, archive missing, bad image: the task's, not the policy's
            row = infra_error_row(spec, task, sample, f"sandbox could not start: {type(e).__name__}: {e}", version)
            continue
        ep, actor, started = None, policy, time.monotonic()
        try:
            actor = make_policy(task, sample, sandbox) if make_policy else policy
            ep = new_episode(task["problem_statement"], tokenizer, episode)
            bound = episode.episode_timeout_s + EPISODE_GRACE_S
            try:
                async with asyncio.timeout(bound) as clock:
                    await run_episode(task["problem_statement"], sandbox, actor, tokenizer, episode, ep,
                                      run_seed, sampling_key(spec, task["instance_id"], sample))
            except TimeoutError:
                if not clock.expired():
                    raise  # a TimeoutError of the episode's own, not our clock
                sandbox._discard = True  # cut mid-command: never handed to a warm pool
                ep.finish_reason, ep.final_patch = "timeout", ""
                ep.error = (f"timeout: cut from outside the agent loop after {bound:.0f} s (episode_timeout_s "
                            f"{episode.episode_timeout_s:.0f} + {EPISODE_GRACE_S:.0f} s grace); no final patch")
                ep.total_seconds = time.monotonic() - started
            return episode_row(spec, task, sample, ep, getattr(actor, "version", version))
        except SandboxInfraError as e:
            row = infra_error_row(spec, task, sample, f"sandbox failed mid-episode: {e}", version)
        except InferenceUnavailable as e:
            server_failures += 1
            if server_failures > cfg.sandbox.infra_retries:
                raise InferenceDown(f"inference server unreachable for rollout {rid} after "
                                    f"{server_failures} tries: {e}") from e
            await asyncio.sleep(min(2.0 * server_failures, 10.0))
        except ServerMismatchError:
            raise  # the server's tokens are not ours: every episode would be wrong, so the stage fails
        except Exception as e:  # a bug of ours: this episode's outcome, never the stage's failure
            ep = ep or Episode(messages=[], token_ids=[], loss_mask=[], logprobs=[], prompt_length=0)
            ep.finish_reason, ep.error, ep.final_patch = "agent_error", agent_error_text(e), ""
            ep.total_seconds = time.monotonic() - started
            return episode_row(spec, task, sample, ep, getattr(actor, "version", version))
        finally:
            await asyncio.to_thread(sandbox.close)
    return row


class PartWriter:
    """Commits rows as they finish, each flush a small append-only part table `<key stem>-NNNNN`:
    rows that finish while one part is written go into the next, so a crash loses only rows not
    yet finished (with every_s=0)."""

    def __init__(self, store, key: str | None, stage: str, schema, every_s: float = 0.0):
        self.store, self.key, self.stage, self.schema, self.every_s = store, key, stage, schema, every_s
        # Numbered after the last committed part, not by their count: a stop can commit part N+1 (the
        # flush on the way out) while part N's write, cut by the same stop, never committed.
        committed = partial_parts(store, key) if key and store is not None else []
        self.parts = 1 + max((part_index(k) for k in committed), default=-1)
        self.rows: list[dict] = []
        self.last = time.monotonic()
        self.lock = asyncio.Lock()

    async def add(self, row: dict) -> None:
        self.rows.append(row)
        await self.flush(force=False)

    async def flush(self, force: bool = True) -> None:
        if not self.key or self.store is None or not self.rows:
            return
        if not force and time.monotonic() - self.last < self.every_s:
            return
        async with self.lock:
            rows = self.rows[:]
            if not rows:
                return
            del self.rows[:len(rows)]
            key = f"{self.key.removesuffix('.parquet')}-{self.parts:05d}.parquet"
            self.parts += 1
            await asyncio.to_thread(self.store.write_table, key, self.schema.from_rows(rows), self.stage)
            self.last = time.monotonic()


def served_episodes(policy, spec: RolloutSpec, tokenizer, cfg, store=None) -> Episodes:
    """Every episode samples from `policy` (the served model's PolicyClient)."""
    async def run(task: dict, sample: int) -> dict:
        return await run_one(task, sample, spec, policy, tokenizer, cfg, store)
    return run


def scripted_episodes(make_policy, spec: RolloutSpec, tokenizer, cfg, store=None) -> Episodes:
    """Each episode's policy is `make_policy(task, sample, sandbox)`, made once its sandbox is open
    (the demonstrations' scripted solver, a test's script)."""
    async def run(task: dict, sample: int) -> dict:
        return await run_one(task, sample, spec, None, tokenizer, cfg, store, make_policy)
    return run


def adversary_episodes(policy, make_adversary, spec: RolloutSpec, tokenizer, cfg, store=None) -> Episodes:
    """`policy`'s episodes with hostile ones mixed in: `make_adversary(task, sample, sandbox)`
    (tasks/agent/adversary.py policy_factory) wraps `policy` for each episode; a row no policy
    played (its sandbox never started) carries `policy`'s version."""
    async def run(task: dict, sample: int) -> dict:
        return await run_one(task, sample, spec, policy, tokenizer, cfg, store, make_adversary)
    return run


async def collect(tasks: list[dict], spec: RolloutSpec, episodes: Episodes, concurrency: int, *,
                  partial: PartialTable | None = None, on_start=None, on_episode=None) -> pa.Table:
    """Run `spec.samples_per_task` episodes of every task, `concurrency` at once, each through
    `episodes`; return the trajectories table.

    With `partial`, finished episodes are committed there as they finish, and those it already
    holds are not run again. `on_start(committed)` is called once with the number of episodes an
    earlier attempt committed, before any runs; `on_episode(row)` with each finished row.
    """
    store, key, every_s = (partial.store, partial.key, partial.flush_every_s) if partial else (None, None, 0.0)
    done = read_partial(store, key) if partial else {}
    writer = PartWriter(store, key, "trajectories_partial", TRAJECTORIES, every_s)
    work = [(t, i) for t in tasks for i in range(spec.samples_per_task)
            if rollout_id(spec.run_id, spec.step, t["instance_id"], i) not in done]
    sem = asyncio.Semaphore(concurrency)
    if on_start is not None:
        on_start(len(done))

    async def one(task: dict, sample: int):
        async with sem:
            row = await episodes(task, sample)
        done[row["rollout_id"]] = row
        if on_episode is not None:
            on_episode(row)
        await writer.add(row)

    try:
        # A TaskGroup cancels the other episodes when one fails for good (e.g. the server stays down).
        async with asyncio.TaskGroup() as group:
            for t, i in work:
                group.create_task(one(t, i))
    except* (InferenceDown, ServerMismatchError) as eg:
        raise eg.exceptions[0] from None
    finally:
        await writer.flush()
    rows = sorted(done.values(), key=lambda r: (r["instance_id"], r["sample_index"]))
    return TRAJECTORIES.from_rows(rows)
