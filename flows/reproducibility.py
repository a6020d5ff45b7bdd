"""Reproducibility reruns: train a recorded run's configuration again and compare with it.

    reproducibility(baseline_run_id="smoke-dev1")          rerun as `<baseline>-rerun-<time>`, compare
    reproducibility(baseline_run_id=A, rerun_id=B)         B finished already: compare only (B unfinished: resume it)

The rerun uses the baseline's frozen config (manifest.json) as is: the same
dataset config and seeds, so the same tasks table, the same training batches and
the same cached base checkpoint. The comparison is a table in the object store,
`runs/<rerun>/reproducibility.parquet` (one row per metric and step, schema
REPORT below), and a markdown artifact in the Prefect UI. A gated row outside its
tolerance fails the flow run (after both are written).

What is compared, and how strictly. Sampling is seeded per request (agent.seeded_sampling, on by
default: tasks/agent/loop.py request_seed, from the run seed, the rollout and the turn, not the run
id), so at T > 0 a rerun samples the same tokens wherever the served logits agree. They agree while
both runs sample from bitwise-identical weights: the base checkpoint always, a later checkpoint only
if its update was reproduced bit for bit (in the mini it was not: vLLM's logprobs, which enter the
loss, differ with how requests were batched, and the weights part by ~1e-6 after one update). So
trajectories are gated where sampling is greedy, or seeded from weights with the same digest in both
runs; elsewhere they are information, and the report says for each step which of three it was:
"identical" (same tokens, same logprobs, same update), "same tokens, different numbers" (logprobs,
loss, gradient norm or weights differ; the tokens did not yet) or "different tokens".

    config, pins       exact    configs equal; the same tasks table and base checkpoint, both
                                committed before the baseline started (not rebuilt since)
    batches            exact    each step's (instance, sample) set and the evaluation task set
    prompts            exact    every rollout's first prompt, token for token
    pass@k, pass@1     z-sigma  per evaluation, |delta| <= max(min_abs, z * pooled binomial SE over
                                tasks); a bound on evaluation noise for one fixed policy; it does not
                                cover two training paths drifting apart, which is what it should catch
    reward per step    z-sigma  mean training reward, the same rule over graded rollouts
    time to train      ratio    rerun / baseline within [1/time_ratio, time_ratio] (shared 2-core
                                machines vary a lot: 2.0 by default)
    trajectories       share    identical token sequences: gated (trajectory_agreement) when greedy,
                                gated (seeded_agreement) when seeded and every policy version the
                                step's episodes could sample from has identical weights, otherwise
                                information
    update             info     loss, gradient norm and the checkpoint's tensors per step
"""

from __future__ import annotations

import hashlib
import math
import time

import pyarrow as pa
from prefect import flow
from pydantic import BaseModel, Field

from flows.artifacts import _flow_run_id, artifact_key, publish_run, publish_steps
from flows.runtime import log
from schemas.tables import REPRODUCIBILITY as REPORT  # noqa: E402
from schemas.tables import REPRODUCIBILITY_METRICS as METRICS
from tasks.storage import Store, stage_key


class Tolerances(BaseModel):
    z: float = Field(3.0, gt=0, description="pass@k, pass@1, reward: allowed |delta| in pooled binomial SEs")
    min_abs: float = Field(0.0, ge=0, description="floor for those tolerances (absolute)")
    time_ratio: float = Field(2.0, ge=1, description="time to train: allowed factor either way")
    trajectory_agreement: float = Field(1.0, ge=0, le=1, description="share of identical trajectories required "
                                                                    "when sampling is greedy")
    # Two seeded mini runs agreed on 128 of 128 trajectories a step, two smoke runs on 8 of 8: below
    # 0.95 is more than the odd near-tie flipped by another batch composition.
    seeded_agreement: float = Field(0.95, ge=0, le=1, description="share of identical trajectories required at "
                                    "T > 0 when both runs seed their requests and sample from identical weights")


class ReproducibilityDrift(RuntimeError):
    pass


FINISHED = ("succeeded", "target_not_reached")


# -- comparing two recorded runs ------------------------------------------------------------
def _binomial_tol(p1: float, p2: float, n: int, tol: Tolerances) -> float:
    p = (p1 + p2) / 2  # pooled: never a zero tolerance when the two differ
    return max(tol.min_abs, tol.z * math.sqrt(2 * p * (1 - p) / max(n, 1)))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _base_checkpoint(store: Store, run_id: str) -> str | None:
    from tasks.inspect import Run

    return Run(store=store, run_id=run_id).base_checkpoint()


def _tasks_commit(store: Store, run_id: str):
    """The commit of the tasks table holding the run's first training batch."""
    if not store.stage_committed(run_id, 1, "trajectories"):
        return None
    ids = set(store.read_stage(run_id, 1, "trajectories")["instance_id"].to_pylist())
    for c in store.commits("datasets"):
        if c.stage == "tasks" and ids <= set(store.read_table(c.key, stage="tasks")["instance_id"].to_pylist()):
            return c
    return None


def _steps(store: Store, run_id: str, stage: str) -> list[int]:
    from tasks.inspect import Run

    return Run(store=store, run_id=run_id).steps(stage)


def compare_runs(store: Store, baseline_id: str, rerun_id: str, tol: Tolerances | None = None) -> pa.Table:
    """The reproducibility report of `rerun_id` against `baseline_id` (both in `store`), as a REPORT table."""
    from tasks.mlperf import read_log_times

    tol = tol or Tolerances()
    now = time.time()
    rows: list[dict] = []

    def row(metric, step=None, base=None, rerun=None, delta=None, tolerance=None, rule="exact", gated=True,
            ok=True, detail=None):
        rows.append(dict(row_id=f"{metric}/{'-' if step is None else step}", baseline_run_id=baseline_id,
                         rerun_id=rerun_id, metric=metric, step=step, baseline=base, rerun=rerun, delta=delta,
                         tolerance=tolerance, rule=rule, gated=gated, ok=bool(ok), detail=detail, created_at=now))

    mb, mr = store.read_manifest(baseline_id), store.read_manifest(rerun_id)
    if mb is None or mr is None:
        raise ValueError(f"no manifest for run {baseline_id if mb is None else rerun_id} in {store.root}")
    baseline_start = min(a.started_at for a in mb.attempts) if mb.attempts else mb.created_at

    # Config and pins.
    fb, fr = _flatten(mb.config), _flatten(mr.config)
    diff = sorted(k for k in set(fb) | set(fr) if k != "run_id" and fb.get(k, "<absent>") != fr.get(k, "<absent>"))
    row("config", ok=not diff, detail=("differs: " + ", ".join(f"{k}={fb.get(k)!r}->{fr.get(k)!r}"
                                                                for k in diff[:6])) if diff
        else f"sha256 {mb.config_sha256[:12]}; seed {fb.get('seed')}, dataset.seed {fb.get('dataset.seed')}")
    cb, cr = _tasks_commit(store, baseline_id), _tasks_commit(store, rerun_id)
    same_ds = cb is not None and cr is not None and cb.key == cr.key and cb.sha256 == cr.sha256
    row("dataset", ok=same_ds and cb.committed_at <= baseline_start,
        detail=f"{cb.key} sha256 {cb.sha256[:12]}" if same_ds else f"baseline {cb and cb.key}, rerun {cr and cr.key}")
    kb, kr = _base_checkpoint(store, baseline_id), _base_checkpoint(store, rerun_id)
    db, dr = mb.prepared.get("base_weights"), mr.prepared.get("base_weights")
    if db or dr:  # a shipped base: its files were checked against its manifest's sha256 when each run began
        row("base_checkpoint", ok=db == dr, detail=f"{kb}, weights {db}" if db == dr else
            f"baseline {kb} weights {db}, rerun {kr} weights {dr}")
        kr = kb if db == dr else kr
    else:
        built = (store.get_json(f"models/{kb}.commit").get("built_at") if kb and store.exists(f"models/{kb}.commit")
                 else None)
        row("base_checkpoint", ok=kb is not None and kb == kr and built is not None and built <= baseline_start,
            detail=f"models/{kb}" + ("" if built is None or built <= baseline_start else " (rebuilt after the baseline "
                                     "ran)") if kb == kr else f"baseline {kb}, rerun {kr}")

    # Per training step: batches, prompts, trajectories, rewards, the update.
    weights = _WeightPins(store, baseline_id, rerun_id, same_base=kb is not None and kb == kr)
    seeded = bool(fb.get("agent.seeded_sampling")) and bool(fr.get("agent.seeded_sampling"))
    for split, temperature_key in (("train", "agent.training.temperature"), ("eval", "agent.validation.temperature")):
        greedy = fb.get(temperature_key) == 0 and fr.get(temperature_key) == 0
        stage = "trajectories" if split == "train" else "eval_trajectories"
        metric = "trajectory_agreement" if split == "train" else "eval_trajectory_agreement"
        for step in sorted(set(_steps(store, baseline_id, stage)) | set(_steps(store, rerun_id, stage))):
            tb, tr = (_by_sample(store, r, step, stage) for r in (baseline_id, rerun_id))
            if split == "train":
                row("batch_membership", step, len(tb), len(tr), ok=set(tb) == set(tr),
                    detail=None if set(tb) == set(tr) else f"{len(set(tb) ^ set(tr))} (instance, sample) pairs differ")
            common = set(tb) & set(tr)
            if common:
                if split == "train":
                    same_prompt = sum(tb[k]["token_ids"][:tb[k]["prompt_length"]] == tr[k]["token_ids"][:tr[k]["prompt_length"]]
                                      for k in common) / len(common)
                    row("prompt_agreement", step, None, same_prompt, tolerance=0.0, ok=same_prompt == 1.0, rule="min_share")
                kinds = [_agreement(tb[k], tr[k]) for k in common]
                # A training episode of step k sampled from versions min..k-1 (async rollouts straddle
                # updates), an evaluation of step k from version k.
                versions = {tb[k]["policy_version"] for k in common} | {tr[k]["policy_version"] for k in common}
                versions = range(min(versions), (step - 1 if split == "train" else step) + 1)
                same, need, detail = _trajectory_gate(kinds, versions, greedy, seeded, weights, tol, fb, fr)
                row(metric, step, None, same, tolerance=None if need is None else 1 - need,
                    rule="info" if need is None else "min_share", gated=need is not None,
                    ok=need is None or same >= need, detail=detail)
            if split != "train":
                continue
            rb, rr = (_rewards(store, r, step, "rewards") for r in (baseline_id, rerun_id))
            if rb and rr:
                both = set(rb) & set(rr)
                if both:
                    row("reward_agreement", step, None, sum(rb[k] == rr[k] for k in both) / len(both), rule="info",
                        gated=False)
                gb, gr = [v for v in rb.values() if v is not None], [v for v in rr.values() if v is not None]
                mb_, mr_ = sum(gb) / max(len(gb), 1), sum(gr) / max(len(gr), 1)
                t = _binomial_tol(mb_, mr_, min(len(gb), len(gr)), tol)
                row("train_reward_mean", step, mb_, mr_, mr_ - mb_, t, "binomial", ok=abs(mr_ - mb_) <= t + 1e-12)
            else:
                row("train_reward_mean", step, ok=False, detail=f"rewards missing in {'baseline' if not rb else 'rerun'}")
            ub, ur = (_update_metrics(store, r, step) for r in (baseline_id, rerun_id))
            if ub and ur and common:
                same_update = (ub.get("loss") == ur.get("loss") and ub.get("grad_norm") == ur.get("grad_norm")
                               and weights.same(step) is True)
                row("update_agreement", step, ub.get("loss"), ur.get("loss"), rule="info", gated=False, ok=same_update,
                    detail=f"{_step_kind(kinds, same_update)}: loss {_num(ub.get('loss'))} vs {_num(ur.get('loss'))}, "
                           f"grad_norm {_num(ub.get('grad_norm'))} vs {_num(ur.get('grad_norm'))}; "
                           f"{weights.describe(step)}")

    # Per evaluation: task set, pass@k, pass@1.
    for step in sorted(set(_steps(store, baseline_id, "eval_summary")) | set(_steps(store, rerun_id, "eval_summary"))):
        have = [store.stage_committed(r, step, "eval_summary") for r in (baseline_id, rerun_id)]
        if not all(have):
            row("pass_at_k", step, ok=False, detail=f"evaluation missing in {'baseline' if not have[0] else 'rerun'}")
            continue
        eb, er = (store.read_stage(r, step, "eval_summary").to_pylist()[0] for r in (baseline_id, rerun_id))
        for m in ("pass_at_k", "pass_at_1"):
            t = _binomial_tol(eb[m], er[m], min(eb["num_tasks"], er["num_tasks"]), tol)
            row(m, step, eb[m], er[m], er[m] - eb[m], t, "binomial", ok=abs(er[m] - eb[m]) <= t + 1e-12,
                detail=f"k={eb['k']}, {eb['num_tasks']} tasks" if m == "pass_at_k" else None)
        sb, sr = (_by_sample(store, r, step, "eval_trajectories") for r in (baseline_id, rerun_id))
        tasks_b, tasks_r = {k[0] for k in sb}, {k[0] for k in sr}
        row("eval_tasks", step, len(tasks_b), len(tasks_r), ok=tasks_b == tasks_r)

    # Time to train (MLPerf run_start..run_stop).
    tb_, tr_ = (read_log_times(store.get_bytes(f"runs/{r}/mlperf.log").decode()).get("run_seconds")
                if store.exists(f"runs/{r}/mlperf.log") else None for r in (baseline_id, rerun_id))
    if tb_ and tr_:
        ratio = tr_ / tb_
        row("time_to_train_s", None, tb_, tr_, ratio, tol.time_ratio, "ratio",
            ok=1 / tol.time_ratio <= ratio <= tol.time_ratio, detail=f"rerun/baseline = {ratio:.2f}")
    else:
        row("time_to_train_s", None, tb_, tr_, rule="info", gated=False, detail="no run_stop in an MLPerf log")
    return REPORT.validate(REPORT.from_rows(rows))


def _trajectory_gate(kinds: list, versions: range, greedy: bool, seeded: bool, weights: "_WeightPins",
                     tol: Tolerances, fb: dict, fr: dict) -> tuple[float, float | None, str]:
    """(share with the same tokens, the share required or None when not gated, what differs and why)."""
    same = sum(kind != "different tokens" for kind, _ in kinds) / len(kinds)
    if greedy:
        return same, tol.trajectory_agreement, f"{_kinds_text(kinds)}; greedy"
    if seeded and all(weights.same(v) for v in versions):
        return same, tol.seeded_agreement, (f"{_kinds_text(kinds)}; seeded, from identical weights (policy "
                                            f"{versions[0]}{'' if len(versions) == 1 else f'-{versions[-1]}'})")
    return same, None, f"{_kinds_text(kinds)}; {_sampling_note(fb, fr, weights, versions)}"


def _sampling_note(fb: dict, fr: dict, weights: "_WeightPins | None" = None, versions=()) -> str:
    """Why T > 0 trajectories are not gated; a config without the option predates seeded sampling."""
    if not (fb.get("agent.seeded_sampling") and fr.get("agent.seeded_sampling")):
        return "T > 0 sampling without per-request seeds (agent.seeded_sampling off in a run): differs by design"
    if weights is not None:
        for v in sorted(versions):
            if weights.same(v) is not True:
                known = "other weights" if weights.same(v) is False else "weights not known to be the same"
                return f"T > 0, seeded, sampled from {known}: {weights.describe(v)}"
    return "T > 0, seeded per request: the same tokens wherever the logits agree (information, not gated)"


def _agreement(b: dict, r: dict) -> tuple[str, float]:
    """(kind, max |logprob difference|) of one rollout in two runs."""
    if b["token_ids"] != r["token_ids"]:
        return "different tokens", math.nan
    diff = max((abs(x - y) for x, y in zip(b["generation_logprobs"], r["generation_logprobs"])), default=0.0)
    return ("identical" if diff == 0 else "same tokens, different numbers"), diff


def _step_kind(kinds: list[tuple[str, float]], same_update: bool) -> str:
    """A step's verdict: its trajectories and its update together."""
    if any(kind == "different tokens" for kind, _ in kinds):
        return "different tokens"
    return "identical" if same_update and all(kind == "identical" for kind, _ in kinds) else \
        "same tokens, different numbers"


def _kinds_text(kinds: list[tuple[str, float]]) -> str:
    n = {k: sum(kind == k for kind, _ in kinds) for k in ("identical", "same tokens, different numbers",
                                                           "different tokens")}
    worst = max((d for kind, d in kinds if kind == "same tokens, different numbers"), default=0.0)
    return (f"{n['identical']} identical, {n['same tokens, different numbers']} same tokens with other logprobs"
            + (f" (max |diff| {worst:.2g})" if worst else "") + f", {n['different tokens']} different tokens"
            + f" of {len(kinds)}")


def _num(v) -> str:
    return "-" if v is None else f"{v:.9g}"


def _update_metrics(store: Store, run_id: str, step: int) -> dict:
    from flows.stages import checkpoint_key

    key = checkpoint_key(run_id, step) + ".commit"
    return store.get_json(key).get("metrics", {}) if store.exists(key) else {}


class _WeightPins:
    """Whether both runs sampled from bitwise-identical weights at a policy version: the base (0) when
    both name the same checkpoint, a later version when its checkpoint's tensors are equal."""

    def __init__(self, store: Store, baseline_id: str, rerun_id: str, same_base: bool):
        self.store, self.runs, self.same_base, self.cache = store, (baseline_id, rerun_id), same_base, {}

    def _compare(self, version: int) -> tuple[bool | None, str]:
        if version == 0:
            return (True, "the same base checkpoint") if self.same_base else (None, "base checkpoints differ")
        from flows.stages import checkpoint_key

        keys = [checkpoint_key(r, version) + "/model.safetensors" for r in self.runs]
        if not all(self.store.exists(k) for k in keys):
            return None, f"checkpoint {version}'s weights are not in the store"
        if len({self._sha256(k) for k in keys}) == 1:
            return True, f"checkpoint {version}: identical weights"
        if max(self.store.fs.size(self.store.path(k)) for k in keys) > 2**30:  # too big to load for a detail
            return False, f"checkpoint {version}: the weights differ"
        from safetensors.torch import load

        a, b = (load(self.store.get_bytes(k)) for k in keys)
        if a.keys() != b.keys():
            return False, f"checkpoint {version}: different tensor names"
        differ = [n for n in a if a[n].shape != b[n].shape or not bool((a[n] == b[n]).all())]
        worst = max((float((a[n].float() - b[n].float()).abs().max()) for n in differ if a[n].shape == b[n].shape),
                    default=math.inf)
        return False, f"checkpoint {version}: {len(differ)} of {len(a)} tensors differ (max |diff| {worst:.2g})"

    def _sha256(self, key: str) -> str:
        h = hashlib.sha256()
        with self.store.fs.open(self.store.path(key), "rb") as f:
            while chunk := f.read(1 << 24):  # streamed: a checkpoint may not fit in memory twice
                h.update(chunk)
        return h.hexdigest()

    def same(self, version: int) -> bool | None:
        """True: identical; False: different; None: not known (weights not stored)."""
        if version not in self.cache:
            self.cache[version] = self._compare(version)
        return self.cache[version][0]

    def describe(self, version: int) -> str:
        self.same(version)
        return self.cache[version][1]


def _by_sample(store: Store, run_id: str, step: int, stage: str) -> dict:
    if not store.stage_committed(run_id, step, stage):
        return {}
    t = store.read_stage(run_id, step, stage, columns=["instance_id", "sample_index", "token_ids", "prompt_length",
                                                       "generation_logprobs", "policy_version"])
    return {(r["instance_id"], r["sample_index"]): r for r in t.to_pylist()}


def _rewards(store: Store, run_id: str, step: int, stage: str) -> dict:
    if not store.stage_committed(run_id, step, stage):
        return {}
    # rollout ids embed the run id: key by (instance, sample) via the rollout id's tail
    t = store.read_stage(run_id, step, stage, columns=["rollout_id", "reward"]).to_pylist()
    return {r["rollout_id"].split("/", 1)[1]: r["reward"] for r in t}


def report_markdown(report: pa.Table) -> str:
    rows = report.to_pylist()
    failed = [r for r in rows if r["gated"] and not r["ok"]]
    b, r0 = rows[0]["baseline_run_id"], rows[0]["rerun_id"]
    head = (f"# reproducibility: `{r0}` vs baseline `{b}`: "
            + (f"**DRIFT** ({len(failed)} gated check(s) outside tolerance)" if failed else "**reproduced**"))

    def f(v, nd=3):
        return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    lines = [head, "", "| metric | step | baseline | rerun | delta | tolerance | rule | gated | ok | detail |",
             "|---|---:|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['metric']} | {f(r['step'])} | {f(r['baseline'])} | {f(r['rerun'])} | {f(r['delta'])} | "
                     f"{f(r['tolerance'])} | {r['rule']} | {'yes' if r['gated'] else 'no'} | "
                     f"{'ok' if r['ok'] else ('**FAIL**' if r['gated'] else 'differs')} | {(r['detail'] or '').replace('|', '/')} |")
    steps = [r for r in rows if r["metric"] == "update_agreement"]
    if steps:
        lines += ["", "What differs, step by step (trajectories and update):", ""]
        lines += [f"- step {r['step']}: {r['detail']}" for r in steps]
    lines += ["", "Tolerances: pass@k, pass@1 and reward per step allow z pooled binomial standard errors "
              "(evaluation noise of one policy); trajectory agreement is gated where sampling is greedy, or seeded "
              "from weights identical in both runs; elsewhere it is information: seeded requests give the same tokens "
              "only while the logits agree."]
    return "\n".join(lines)


# -- the flow ------------------------------------------------------------------------------
@flow(name="reproducibility", description="Rerun a recorded run's configuration and compare: pass@k per "
                                          "evaluation, reward per step, time to train, batches, trajectories.")
def reproducibility(baseline_run_id: str, rerun_id: str = "", store_root: str = "file://.rlvr/store",
                    endpoint_url: str = "", tolerances: Tolerances = Tolerances()) -> dict:
    """Rerun a finished run's configuration and compare the two runs.

    Args:
        baseline_run_id: a finished run in the store
        rerun_id: empty = BASELINE-rerun-SCHEDULEDTIME (a new training run); an existing finished run is
            compared as it is, an unfinished one resumed first
        store_root: object store holding the baseline (file:// or s3://)
        endpoint_url: S3 endpoint for s3:// stores that are not AWS
        tolerances: how far the rerun may be from the baseline before the flow run fails
    """
    store = Store(store_root, endpoint_url or None)
    base = store.read_manifest(baseline_run_id)
    if base is None or base.status not in FINISHED:
        raise ValueError(f"baseline {baseline_run_id!r} in {store.root} is "
                         f"{'missing' if base is None else base.status}; it must be a finished run")
    rerun_id = rerun_id or f"{baseline_run_id}-rerun-{_scheduled_stamp()}"
    existing = store.read_manifest(rerun_id)
    if existing is None or existing.status not in FINISHED:
        from types import SimpleNamespace

        from flows.train import train
        from schemas.presets import load_config

        overrides = {k: v for k, v in base.config.items() if k not in ("preset", "run_id")}
        log(f"reproducibility: training {rerun_id} with the configuration of {baseline_run_id}")
        summary = train.fn(preset=base.preset, overrides=overrides, run_id=rerun_id)
        ctx = SimpleNamespace(store=store, run_id=rerun_id, cfg=load_config(base.preset, overrides))
        publish_steps(ctx)
        publish_run(ctx, summary)
    report = compare_runs(store, baseline_run_id, rerun_id, tolerances)
    key = stage_key(rerun_id, None, "reproducibility")
    store.write_table(key, report, stage="reproducibility", overwrite=True)
    md = report_markdown(report)
    if _flow_run_id() is not None:  # .fn() outside a flow run: the table is the record
        try:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(md, key=artifact_key(baseline_run_id, "reproducibility"),
                                     description=f"{rerun_id} vs {baseline_run_id}")
        except Exception as e:
            log(f"reproducibility: could not publish the artifact: {type(e).__name__}: {e}")
    failed = [r for r in report.to_pylist() if r["gated"] and not r["ok"]]
    log(f"reproducibility: report {store.uri(key)}: {len(failed)} gated check(s) outside tolerance")
    if failed:
        raise ReproducibilityDrift(f"{rerun_id} drifted from {baseline_run_id}: " + "; ".join(
            _explain(r) for r in failed[:5]) + f". Report: {store.uri(key)}")
    return {"baseline": baseline_run_id, "rerun": rerun_id, "ok": True, "report": store.uri(key),
            "checks": report.num_rows}


def _explain(r: dict) -> str:
    where = "run" if r["step"] is None else r["step"]
    why = r["detail"] or "baseline {}, rerun {}, tolerance {}".format(r["baseline"], r["rerun"], r["tolerance"])
    return f"{r['metric']}@{where} ({why})"


def _scheduled_stamp() -> str:
    """The flow run's scheduled time: a retried scheduled run keeps its rerun id and resumes it."""
    try:
        from prefect.runtime import flow_run

        t = flow_run.scheduled_start_time
        if t is not None:
            return t.strftime("%Y%m%d-%H%M%S")
    except Exception:
        pass
    return time.strftime("%Y%m%d-%H%M%S")
