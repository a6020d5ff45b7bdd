"""Deployments for the Prefect UI: train, evaluate, prepare, reproducibility, served by this process.

    python -m flows.deployments [--repro-baseline RUN_ID --repro-interval SECONDS]

(`make ui` starts a local Prefect server and runs this; `make ui-stop` stops both.)
Served with `prefect.serve`: no work pool, no worker; each flow run is a
subprocess of this one, in this working directory and environment.

The entry flows here carry the flows' names (`train`, ...) and typed parameters,
so the UI renders a form: `preset` is a drop-down of the preset names and
`overrides` a list of `section.field=value` lines, as on the command line.
They call the flows' functions (`train.fn`), so a run from the UI is one flow
run with the same tasks and subflows as `make run`, plus its UI artifacts.
"""

from __future__ import annotations

import argparse
import time
import types
from typing import Literal

from prefect import flow

from schemas.presets import PRESETS

PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the form's drop-down follows PRESETS

# Defaults are plain values (not None) so the form shows a text box, not a "str / None" switch;
# the list defaults are never mutated.
def _config(preset: str, overrides: list[str]):
    """Validate before anything starts: a bad override fails the flow run in its first second.
    RLVR_UI_STORE (set for `infra/ui.sh start`) is the store runs use unless an override names one."""
    import os

    from schemas.presets import load_config, parse_overrides

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
        preset: smoke (minutes, what the tests run), mini (the embedded default), qwen35_397b_grpo (GPU cluster)
        run_id: reuse one to resume a killed run; empty = PRESET-DATE-TIME
        overrides: section.field=value, one per item (e.g. max_steps=1, grpo.prompts_per_step=4)
    """
    from flows.artifacts import publish_run, publish_steps
    from flows.train import train
    from tasks.storage import Store

    cfg, ov = _config(preset, overrides)
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
    """The RunnerDeployments `make ui` serves. The reproducibility deployment is scheduled only
    when given a baseline run (rerunning a pinned config costs a whole training run)."""
    from flows.reproducibility import reproducibility

    params, schedule = {}, {}
    if repro_baseline:
        params["baseline_run_id"] = repro_baseline
        if repro_rerun_id:
            params["rerun_id"] = repro_rerun_id
        if repro_store:
            params["store_root"] = repro_store
        schedule["interval"] = repro_interval or 7 * 24 * 3600
    out = {"train": lambda: train_entry.to_deployment(name="train", tags=["rlvr"]),
           "evaluate": lambda: evaluate_entry.to_deployment(name="evaluate", tags=["rlvr"]),
           "prepare": lambda: prepare_entry.to_deployment(name="prepare", tags=["rlvr"]),
           "reproducibility": lambda: reproducibility.to_deployment(name="reproducibility", tags=["rlvr"],
                                                                   parameters=params, **schedule)}
    return [make() for name, make in out.items() if not only or name in only]


def main(argv: list[str] | None = None) -> None:
    import os

    from flows.main import prefect_defaults

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repro-baseline", help="schedule reproducibility reruns of this run's configuration")
    ap.add_argument("--repro-interval", type=float, help="seconds between reruns (default: weekly)")
    ap.add_argument("--repro-rerun-id", help="compare with this existing run instead of training a new one")
    ap.add_argument("--repro-store", help="object store of the baseline (default file://.rlvr/store)")
    ap.add_argument("--only", help="comma-separated subset of train,evaluate,prepare,reproducibility")
    ap.add_argument("--limit", type=int, default=1, help="flow runs at once (one run fills a small machine)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")  # the UI shows the flows' progress lines
    prefect_defaults()
    from prefect import serve

    serve(*deployments(args.repro_baseline, args.repro_interval, args.repro_rerun_id,
                       args.only.split(",") if args.only else None, args.repro_store), limit=args.limit)


if __name__ == "__main__":
    main()
