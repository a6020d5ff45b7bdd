"""Rollout generation: G episodes per task, many in flight at once, written as a trajectories table.

Each episode gets its own sandbox. A sandbox that cannot start is retried a few
times and then recorded as an `infra_error` trajectory (masked downstream,
never dropped). An inference server that goes away fails the in-flight episodes,
which are retried; finished episodes are committed as they complete, in small
append-only `<stage>_partial-NNNNN` tables (one per flush: a flush writes only the
episodes finished since the last one), so a crash or kill loses at most the episodes
in flight and a rerun of the same stage picks up where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import pyarrow as pa

from schemas.tables import TRAJECTORIES
from tasks.agent.loop import Episode, EpisodeConfig, ServerMismatchError, run_episode


@dataclass
class RolloutSpec:
    run_id: str
    step: int
    split: str
    samples_per_task: int
    temperature: float
    top_p: float


class InferenceDown(RuntimeError):
    """The inference server stayed unreachable past the retry bound."""


def rollout_id(run_id: str, step: int, instance_id: str, sample: int) -> str:
    return f"{run_id}/s{step:05d}/{instance_id}/{sample}"


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


def read_partial(store, partial_key: str) -> dict[str, dict]:
    """rollout id -> row of every finished episode a killed attempt committed (parts, and the one
    table earlier versions rewrote)."""
    keys = ([partial_key] if store.is_committed(partial_key) else []) + partial_parts(store, partial_key)
    done = {}
    for key in keys:
        for row in store.read_table(key, stage="trajectories_partial").to_pylist():
            done[row["rollout_id"]] = row
    return done


async def run_one(task: dict, sample: int, spec: RolloutSpec, policy, tokenizer, cfg, store=None,
                  policy_factory=None) -> dict:
    """One episode in a sandbox of its own -> its trajectory row. A sandbox that cannot start or
    fails mid-episode is retried cfg.sandbox.infra_retries times, then recorded as an infra_error
    row; an inference server that stays away raises InferenceDown."""
    from tasks.inference import InferenceUnavailable
    from tasks.sandbox import SandboxInfraError, open_sandbox

    episode = EpisodeConfig.of(cfg.agent, spec.split, spec.temperature, spec.top_p)
    version = policy.version if policy is not None else -1
    rid = rollout_id(spec.run_id, spec.step, task["instance_id"], sample)
    row, server_failures = None, 0
    for attempt in range(cfg.sandbox.infra_retries + 1):
        try:
            sandbox = await asyncio.to_thread(open_sandbox, task, cfg.sandbox, store, "agent")
        except Exception as e:  # engine down, archive missing, bad image: the task's, not the policy's
            row = infra_error_row(spec, task, sample, f"sandbox could not start: {type(e).__name__}: {e}", version)
            continue
        try:
            actor = policy_factory(task, sample, sandbox) if policy_factory else policy
            ep = await run_episode(task["problem_statement"], sandbox, actor, tokenizer, episode)
            return episode_row(spec, task, sample, ep, actor.version)
        except SandboxInfraError as e:
            row = infra_error_row(spec, task, sample, f"sandbox failed mid-episode: {e}", version)
        except InferenceUnavailable as e:
            server_failures += 1
            if server_failures > cfg.sandbox.infra_retries:
                raise InferenceDown(f"inference server unreachable for rollout {rid} after "
                                    f"{server_failures} tries: {e}") from e
            await asyncio.sleep(min(2.0 * server_failures, 10.0))
        finally:
            await asyncio.to_thread(sandbox.close)
    return row


class PartWriter:
    """Commits rows as they finish, each flush a small append-only part table `<key stem>-NNNNN`:
    rows that finish while one part is written go into the next, so a crash loses only rows not
    yet finished (with every_s=0)."""

    def __init__(self, store, key: str | None, stage: str, schema, every_s: float = 0.0):
        self.store, self.key, self.stage, self.schema, self.every_s = store, key, stage, schema, every_s
        self.parts = len(partial_parts(store, key)) if key and store is not None else 0
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


async def collect(tasks: list[dict], spec: RolloutSpec, policy, tokenizer, cfg, store=None, *,
                  concurrency: int | None = None, partial_key: str | None = None, flush_every_s: float = 0.0,
                  on_episode=None, policy_factory=None, episode_runner=None) -> pa.Table:
    """Run `spec.samples_per_task` episodes of every task; return the trajectories table.

    `cfg` is the RunConfig (agent, sandbox, inference sections). With `partial_key` and a store,
    finished episodes are committed there as they finish and skipped when already present.
    `policy_factory(task, sample, sandbox)`, when given, makes each episode's policy (the scripted
    solver of the demonstrations); otherwise every episode samples from `policy`.
    `episode_runner(task, sample)`, when given, runs each episode elsewhere and returns its row
    (tasks/cluster.py: RayEpisodes, which calls run_one in a Ray actor on another node).
    """
    done = read_partial(store, partial_key) if partial_key and store is not None else {}
    writer = PartWriter(store, partial_key, "trajectories_partial", TRAJECTORIES, flush_every_s)
    work = [(t, i) for t in tasks for i in range(spec.samples_per_task)
            if rollout_id(spec.run_id, spec.step, t["instance_id"], i) not in done]
    sem = asyncio.Semaphore(concurrency or cfg.agent.concurrency)

    async def one(task: dict, sample: int):
        async with sem:
            if episode_runner is not None:
                row = await episode_runner(task, sample)
            else:
                row = await run_one(task, sample, spec, policy, tokenizer, cfg, store, policy_factory)
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
