"""pass@k on the validation split.

With n graded samples of a task of which c succeed, the unbiased estimate of
the chance that at least one of k samples succeeds is

    pass@k = 1 - C(n - c, k) / C(n, k)

(Chen et al., 2021). With n == k it is the plain "any of the k succeeded" that
the MLPerf reference computes. pass^k = C(c, k) / C(n, k) is the chance that
all k succeed: a consistency diagnostic. Samples masked for infrastructure
failures are left out of n; a task with fewer than k valid samples is scored
on the samples it has (k' = n) and counted in `short_tasks`.

Early stop (eval.early_stop). pass@k only asks whether any of k i.i.d. samples succeeds.
Drawing a task's samples one at a time and stopping at its first success gives that
indicator exactly: with the same k draws, "some success among the first k" is decided
by the draws up to the first success, so its distribution is the one of drawing all k.
pass@1 is the first valid sample's reward (unbiased); pass^k needs all k and is not
measured. A task costs 1 episode when its first sample succeeds, k when none does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import pathlib
from collections import defaultdict
from dataclasses import dataclass, field
from math import comb

import pyarrow as pa

from schemas.tables import EVAL_SAMPLES, EVAL_SUMMARY, REWARDS, TRAJECTORIES
from tasks.gate import gate_columns, luck_risk, passes, posterior_q_means
from tasks.grading import GradeResult, grade_patch

# Rollouts broken by infrastructure or by our own code: not graded, never a 0, another sample is drawn.
UNGRADED_FINISH_REASONS = ("infra_error", "agent_error")


def base_eval_id(cfg, prepared: dict) -> str:
    """The run id under which the base checkpoint's evaluation is cached and shared by runs: the
    checkpoint's name and a digest of what the evaluation measured (tasks table, subset, samples,
    agent and sampling), so that a checkpoint given by `model.path` is evaluated again on another
    dataset or subset instead of reporting a stale number."""
    what = {"tasks": prepared["tasks"],
            "eval": cfg.eval.model_dump(include={"k", "samples_per_task", "max_tasks"} | ({"early_stop"} if cfg.eval.early_stop else set())),
            # seeded_sampling picks which draw, not what is measured: caches from before it stay valid.
            "agent": cfg.agent.model_dump(exclude={"training", "concurrency", "partial_flush_s", "seeded_sampling"})}
    if prepared.get("base_weights"):  # a shipped base is named by its directory: key by its content too
        what["weights"] = prepared["base_weights"]
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"base-{pathlib.PurePosixPath(prepared['base_model']).name}-{digest}"


def pass_at_k(n: int, c: int, k: int) -> float:
    if n <= 0:
        return 0.0
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    if n <= 0:
        return 0.0
    k = min(k, n)
    return comb(c, k) / comb(n, k)


@dataclass
class PassSummary:
    pass_at_k: float
    pass_at_1: float
    pass_hat_k: float | None
    num_tasks: int
    num_samples: int
    num_masked: int
    short_tasks: int
    # Per task: the share of its valid samples that succeeded (for spread diagnostics).
    task_success: dict[str, float]
    # Per task: (successes, failures) among the samples counted, for the posterior (tasks/gate.py).
    task_outcomes: dict[str, tuple[int, int]] = field(default_factory=dict)


def summarize(samples: list[dict], k: int, task_ids: list[str] | None = None) -> PassSummary:
    """samples: dicts with instance_id, reward (0/1 or None), masked (bool). Tasks listed in
    task_ids but without any valid sample count as failures (so a broken task cannot raise the score)."""
    n, c, masked = defaultdict(int), defaultdict(int), 0
    for s in samples:
        if s["masked"] or s["reward"] is None:
            masked += 1
            continue
        n[s["instance_id"]] += 1
        c[s["instance_id"]] += int(s["reward"] > 0)
    ids = sorted(set(task_ids or []) | set(n) | {s["instance_id"] for s in samples})
    if not ids:
        raise ValueError("no validation tasks to summarise")
    pk = [pass_at_k(n[i], c[i], k) for i in ids]
    p1 = [pass_at_k(n[i], c[i], 1) for i in ids]
    hk = [pass_hat_k(n[i], c[i], k) for i in ids]
    return PassSummary(
        pass_at_k=sum(pk) / len(ids), pass_at_1=sum(p1) / len(ids), pass_hat_k=sum(hk) / len(ids),
        num_tasks=len(ids), num_samples=sum(n.values()), num_masked=masked,
        short_tasks=sum(1 for i in ids if n[i] < k),
        task_success={i: (c[i] / n[i] if n[i] else 0.0) for i in ids},
        task_outcomes={i: (c[i], n[i] - c[i]) for i in ids},
    )


def summarize_early_stop(samples: list[dict], k: int, task_ids: list[str] | None = None) -> PassSummary:
    """pass@k and pass@1 of samples drawn until each task's first success (at most k valid ones),
    in sample_index order; pass_hat_k is None. Same conventions as `summarize`."""
    by_task: dict[str, list[float]] = defaultdict(list)
    masked = 0
    for s in sorted(samples, key=lambda s: (s["instance_id"], s["sample_index"])):
        if s["masked"] or s["reward"] is None:
            masked += 1
        else:
            by_task[s["instance_id"]].append(float(s["reward"] > 0))
    ids = sorted(set(task_ids or []) | set(by_task) | {s["instance_id"] for s in samples})
    if not ids:
        raise ValueError("no validation tasks to summarise")
    drawn = {i: by_task[i][:k] for i in ids}
    return PassSummary(
        pass_at_k=sum(max(d, default=0.0) for d in drawn.values()) / len(ids),
        pass_at_1=sum(d[0] if d else 0.0 for d in drawn.values()) / len(ids), pass_hat_k=None,
        num_tasks=len(ids), num_samples=sum(len(d) for d in drawn.values()), num_masked=masked,
        short_tasks=sum(1 for d in drawn.values() if len(d) < k and not any(d)),
        task_success={i: max(d, default=0.0) for i, d in drawn.items()},
        task_outcomes={i: (int(sum(d)), len(d) - int(sum(d))) for i, d in drawn.items()},
    )


async def sample_until_solved(tasks: list[dict], spec, policy, tokenizer, cfg, store, k: int, *,
                              partial_key: str | None = None, on_task=None) -> tuple[pa.Table, pa.Table]:
    """For each task, episodes one after another, each graded as soon as it ends, until one succeeds
    or k valid samples are drawn (an infra failure is not a sample: another is drawn, at most 2k
    episodes). Tasks run side by side (cfg.agent.concurrency episodes, cfg.sandbox.concurrency
    gradings), so no task waits for another's slowest sample. Each finished sample is committed
    (trajectory and reward parts next to `partial_key`), so a rerun continues where it stopped.
    Returns (trajectories, rewards) of the samples drawn."""
    from tasks.rollout import PartWriter, read_partial, rollout_id, run_one

    reward_key = partial_key.replace("trajectories_partial", "rewards_partial") if partial_key else None
    done = read_partial(store, partial_key) if partial_key else {}
    graded = _read_parts(store, reward_key, "rewards_partial") if reward_key else {}
    done = {rid: row for rid, row in done.items() if rid in graded}  # a pair is one committed sample
    traj_parts = PartWriter(store, partial_key, "trajectories_partial", TRAJECTORIES)
    reward_parts = PartWriter(store, reward_key, "rewards_partial", REWARDS)
    episodes, gradings = asyncio.Semaphore(cfg.agent.concurrency), asyncio.Semaphore(cfg.sandbox.concurrency)
    results: dict[tuple, asyncio.Future] = {}  # (task, patch) -> grading: low-temperature samples repeat

    async def grade(task: dict, row: dict) -> dict:
        if row["finish_reason"] in UNGRADED_FINISH_REASONS:
            why = row["finish_reason"]
            res = GradeResult(reward=None, grading_status="infra_error", error=f"{why}: rollout: {row['error']}")
        else:
            key = (task["instance_id"], row["final_patch"] or "")
            if key not in results:
                async def run():
                    async with gradings:
                        return await asyncio.to_thread(grade_patch, task, key[1], cfg.sandbox, store)
                results[key] = asyncio.ensure_future(run())
            res = await results[key]
        return res.row(row["rollout_id"], spec.run_id, spec.step, task["instance_id"])

    async def chain(task: dict):
        valid = 0
        for sample in range(2 * k):
            rid = rollout_id(spec.run_id, spec.step, task["instance_id"], sample)
            if rid in done:
                row, rew = done[rid], graded[rid]
            else:
                async with episodes:
                    row = await run_one(task, sample, spec, policy, tokenizer, cfg, store)
                rew = await grade(task, row)
                done[rid], graded[rid] = row, rew
                await reward_parts.add(rew)  # the reward first: a trajectory part without one is redone
                await traj_parts.add(row)
            if rew["grading_status"] == "graded":
                valid += 1
                if rew["reward"] == 1.0 or valid == k:
                    break
        if on_task is not None:
            on_task(task)

    try:
        async with asyncio.TaskGroup() as group:
            for t in tasks:
                group.create_task(chain(t))
    finally:
        await reward_parts.flush()
        await traj_parts.flush()
    ids = sorted(done, key=lambda r: (done[r]["instance_id"], done[r]["sample_index"]))
    return TRAJECTORIES.from_rows([done[r] for r in ids]), REWARDS.from_rows([graded[r] for r in ids])


def _read_parts(store, key: str, stage: str) -> dict[str, dict]:
    from tasks.rollout import partial_parts

    out = {}
    for part in partial_parts(store, key):
        for row in store.read_table(part, stage=stage).to_pylist():
            out[row["rollout_id"]] = row
    return out


def eval_samples_table(trajectories: pa.Table, rewards: pa.Table) -> pa.Table:
    """Join an evaluation's trajectories and rewards into the eval_samples table (one row per sample)."""
    by_id = {r["rollout_id"]: r for r in rewards.select(["rollout_id", "reward", "grading_status", "error"]).to_pylist()}
    rows = []
    cols = ["rollout_id", "run_id", "step", "policy_version", "instance_id", "sample_index", "finish_reason"]
    for t in trajectories.select(cols).to_pylist():
        r = by_id.get(t["rollout_id"])
        if r is None:
            raise ValueError(f"rollout {t['rollout_id']} has no reward row")
        infra = t["finish_reason"] in UNGRADED_FINISH_REASONS or r["grading_status"] == "infra_error"
        env = not infra and r["grading_status"] == "env_error"  # the task's environment ran no test: never a 0
        reason = None
        if infra:
            kind = "agent_error" if t["finish_reason"] == "agent_error" else "infra_error"
            reason = f"{kind}: " + (r["error"] or "rollout failed")
        elif env:
            reason = (r["error"] or "env_error").split("\n", 1)[0]  # its first line: the log tail stays in rewards
        rows.append(dict(t, reward=None if infra or env else r["reward"], masked=infra or env, mask_reason=reason))
    return EVAL_SAMPLES.from_rows(rows)


def eval_summary_row(run_id: str, step: int, policy_version: int, s: PassSummary, k: int, samples_count: int,
                     seconds: float, procedure: str = "full", started_unix: float | None = None,
                     target: float | None = None) -> dict:
    """One eval_summary row; with `target`, P(pass@k > target) too (the intervals need none)."""
    outcomes = [s.task_outcomes[i] for i in sorted(s.task_outcomes)]
    return dict(run_id=run_id, step=step, policy_version=policy_version, k=k, pass_at_k=s.pass_at_k,
                pass_at_1=s.pass_at_1, pass_hat_k=s.pass_hat_k, num_tasks=s.num_tasks, num_samples=s.num_samples,
                num_masked=s.num_masked, samples_count=samples_count, eval_seconds=seconds, procedure=procedure,
                started_unix=started_unix,
                **gate_columns(s.pass_at_k, s.pass_at_1, s.num_tasks, outcomes, k, target))


def summary_table(rows: list[dict]) -> pa.Table:
    return EVAL_SUMMARY.from_rows(rows)


def spread(s: PassSummary) -> dict:
    """How much room RL has: the share of tasks solved sometimes but not always, and pass@k - pass@1."""
    vals = list(s.task_success.values())
    between = sum(1 for v in vals if 0.0 < v < 1.0) / len(vals)
    return {"share_tasks_strictly_between_0_and_1": between, "pass_at_k_minus_pass_at_1": s.pass_at_k - s.pass_at_1,
            "share_tasks_never_solved": sum(1 for v in vals if v == 0.0) / len(vals),
            "share_tasks_always_solved": sum(1 for v in vals if v == 1.0) / len(vals)}


def to_json(s: PassSummary) -> str:
    d = dict(s.__dict__)
    d.pop("task_success")
    d.pop("task_outcomes")
    return json.dumps(d)


def run_luck(store, run_id: str, steps, target: float, margin: float = 0.02) -> dict | None:
    """The luck risk of a run (tasks/gate.py): the chance that a policy `margin` below the target
    passes at least once in as many evaluations as the run made, per-task rates shaped as the
    eval_samples of its first passing checkpoint (else its last evaluated)."""
    rows = [store.read_stage(run_id, s, "eval_summary").to_pylist()[0] for s in steps
            if store.stage_committed(run_id, s, "eval_summary")]
    if not rows:
        return None
    row = next((r for r in rows if passes(r["pass_at_k"], target)), rows[-1])
    if not store.stage_committed(run_id, row["step"], "eval_samples"):
        return None
    samples = store.read_stage(run_id, row["step"], "eval_samples").to_pylist()
    s = (summarize_early_stop if row.get("procedure") == "early_stop" else summarize)(samples, row["k"])
    # Tasks the evaluation listed but no sample reached count as failures, as in its pass@k.
    q = list(posterior_q_means(list(s.task_outcomes.values()), row["k"])) + [0.0] * (row["num_tasks"] - s.num_tasks)
    at = target - margin
    return {"luck_risk": luck_risk(q, len(rows), target, at), "per_evaluation": luck_risk(q, 1, target, at),
            "evaluations": len(rows), "from_step": row["step"], "target": target, "true_pass": at}


def describe_luck(luck: dict) -> str:
    return (f"{luck['luck_risk']:.2f}: chance that a policy with true pass@k {luck.get('true_pass', luck['target']):.2f} "
            f"passes (> {luck['target']:g}) at least "
            f"once in {luck['evaluations']} evaluation(s) ({luck['per_evaluation']:.2f} per evaluation; per-task "
            f"rates shaped as step {luck['from_step']}'s, evaluations taken as independent: an upper bound)")
