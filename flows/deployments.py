"""Deployments for the Prefect UI: train, evaluate, prepare, reproducibility, on a process work pool.

    python -m flows.deployments [--pool rlvr] [--repro-baseline RUN_ID --repro-interval SECONDS]

creates the process work pool (unless it exists) and deploys the four flows to it from this
checkout (`flow.from_source(<this directory>)`: no image, no remote storage), then exits.
A worker runs the flow runs: `prefect worker start --pool rlvr` on a machine with this checkout
at the same path (`make ui` starts one; `make ui-stop` stops it). Each flow run is a subprocess
of the worker, in this directory, with the worker's environment.

The entry flows here carry the flows' names (`train`, ...) and typed parameters,
so the UI renders a form: `preset` is a drop-down of the preset names and
`overrides` a list of `section.field=value` lines, as on the command line.
They call the flows' functions (`train.fn`), so a run from the UI is one flow
run with the same tasks and subflows as `make run`, plus its UI artifacts.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
import types
from typing import Literal

from prefect import flow

from flows.artifacts import publish_run, publish_steps
from flows.process import prefect_defaults
from schemas.presets import PRESETS, load_config, parse_overrides

REPO = pathlib.Path(__file__).resolve().parents[1]
POOL = "rlvr"
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the form's drop-down follows PRESETS

# Defaults are plain values (not None) so the form shows a text box, not a "str / None" switch;
# the list defaults are never mutated.
def _config(preset: str, overrides: list[str]):
    """Validate before anything starts: a bad override fails the flow run in its first second.
    RLVR_UI_STORE (set for `infra/ui.sh start`) is the store runs use unless an override names one."""
    ov = parse_overrides(overrides or [])
    store = os.environ.get("RLVR_UI_STORE")
    if store and "root" not in ov.get("storage", {}):  # the tests' UI: runs go to the test store, not the user's
        ov = {**ov, "storage": {**ov.get("storage", {}), "root": store}}
    return load_config(preset, ov), ov


@flow(name="train", description="GRPO training until pass@k reaches the target (or max_steps); "
                                "the run's tables and MLPerf log go to the object store.")
def train_entry(preset: PresetName = "mini", run_id: str = "", overrides: list[str] = []) -> dict:  # noqa: B006
    """Train with GRPO.

    Args:
        preset: smoke (minutes, what the tests run), mini (the embedded default), qwen35_397b_grpo (GPU
            cluster); smoke-hybrid, mini-hybrid: smoke and mini with Qwen3.5's architecture, in bf16
        run_id: reuse one to resume a killed run; empty = PRESET-DATE-TIME
        overrides: section.field=value, one per item (e.g. max_steps=1, grpo.prompts_per_step=4)
    """
    from flows.check import require
    from flows.train import train
    from tasks.storage import Store

    cfg, ov = _config(preset, overrides)
    require(cfg)  # what `make run` checks first: a missing part fails the flow run in seconds, named
    run_id = run_id or f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    summary = train.fn(preset=preset, overrides=ov, run_id=run_id)
    # Publishing is idempotent per flow run: a train() that already published makes these no-ops.
    ctx = types.SimpleNamespace(store=Store.from_config(cfg.storage), run_id=run_id, cfg=cfg)
    publish_steps(ctx)
    publish_run(ctx, summary)
    return summary


@flow(name="evaluate", description="pass@k of a checkpoint on the validation split.")
def evaluate_entry(preset: PresetName = "mini", checkpoint: str = "", run_id: str = "", step: int = 0,
                   overrides: list[str] = []) -> dict:  # noqa: B006
    """Evaluate a checkpoint.

    Args:
        preset: the configuration (validation split, sampling, sandboxes)
        checkpoint: a model directory, object-store URI or key; empty = the preset's warm-started base
        run_id: where the evaluation tables go; empty = eval-<time>
        step: the step number the tables are filed under
        overrides: section.field=value, one per item
    """
    from flows.evaluate import evaluate

    _, ov = _config(preset, overrides)
    return evaluate.fn(preset=preset, overrides=ov, checkpoint=checkpoint or None, run_id=run_id or None, step=step)


@flow(name="prepare", description="Dataset, base model, demonstrations and warm start (cached).")
def prepare_entry(preset: PresetName = "mini", overrides: list[str] = []) -> dict:  # noqa: B006
    """Build (or find cached) what a training run starts from.

    Args:
        preset: the configuration to prepare for
        overrides: section.field=value, one per item
    """
    from flows.prepare import prepare

    _, ov = _config(preset, overrides)
    return prepare.fn(preset=preset, overrides=ov)


def deployments(repro_baseline: str | None = None, repro_interval: float | None = None,
                repro_rerun_id: str | None = None, only: list[str] | None = None,
                repro_store: str | None = None) -> list:
    """The RunnerDeployments `make ui` deploys, their code this checkout. The reproducibility
    deployment is scheduled only when given a baseline run (rerunning a pinned config costs a
    whole training run)."""
    params, schedule = {}, {}
    if repro_baseline:
        params["baseline_run_id"] = repro_baseline
        if repro_rerun_id:
            params["rerun_id"] = repro_rerun_id
        if repro_store:
            params["store_root"] = repro_store
        schedule["interval"] = repro_interval or 7 * 24 * 3600
    entrypoints = {"train": "flows/deployments.py:train_entry", "evaluate": "flows/deployments.py:evaluate_entry",
                   "prepare": "flows/deployments.py:prepare_entry",
                   "reproducibility": "flows/reproducibility.py:reproducibility"}
    out = []
    for name, entrypoint in entrypoints.items():
        if only and name not in only:
            continue
        # A local source: the worker runs the entrypoint from this directory (a set_working_directory pull step).
        source = flow.from_source(source=str(REPO), entrypoint=entrypoint)
        extra = {"parameters": params, **schedule} if name == "reproducibility" else {}
        out.append(source.to_deployment(name=name, tags=["rlvr"], **extra))
    return out


def ensure_pool(name: str) -> None:
    """Create the process work pool `name` unless it exists; a pool of another type is an error."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
            return
    if pool.type != "process":
        raise SystemExit(f"work pool {name!r} exists with type {pool.type!r}, not process: "
                         f"pick another name with --pool")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", default=POOL, help=f"process work pool to deploy to (default {POOL}; created if missing)")
    ap.add_argument("--repro-baseline", help="schedule reproducibility reruns of this run's configuration")
    ap.add_argument("--repro-interval", type=float, help="seconds between reruns (default: weekly)")
    ap.add_argument("--repro-rerun-id", help="compare with this existing run instead of training a new one")
    ap.add_argument("--repro-store", help="object store of the baseline (default file://.rlvr/store)")
    ap.add_argument("--only", help="comma-separated subset of train,evaluate,prepare,reproducibility")
    args = ap.parse_args(argv)
    prefect_defaults()
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # else Prefect would deploy to a temporary server that vanishes on exit
        raise SystemExit("PREFECT_API_URL is not set: deployments need a Prefect server (make ui starts one)")
    ensure_pool(args.pool)
    for dep in deployments(args.repro_baseline, args.repro_interval, args.repro_rerun_id,
                           args.only.split(",") if args.only else None, args.repro_store):
        dep.apply(work_pool_name=args.pool)
        print(f"deployed {dep.flow_name}/{dep.name} to work pool {args.pool}", flush=True)


if __name__ == "__main__":
    main()
