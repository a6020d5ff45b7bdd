"""`make base`: build a base checkpoint from nothing and freeze it, as models/mini-base/ was made.

    python -m flows.base [--preset mini] [--out models/mini-base] [section.field=value ...]

    dataset          generated and verified in sandboxes (the same build `make run` does)
    tokenizer+init   a tokenizer trained on the train split's text and the tiny model's random weights
    demonstrations   scripted-solver episodes on the train split and the warm-start pool
    warm-start       the preset's SFT recipe (flows/prepare.py: warm_start_stages)
    freeze           the weights in bf16 + tokenizer + manifest.json (tasks/policy/base.py)
    evaluate         pass@k on every validation task, recorded in the manifest with the machine

Every stage is cached in the store as `make run` caches it, so a rebuild that was cut
resumes. `make run` then starts from the frozen base: no SFT runs on a user's machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from prefect import flow

from flows.runtime import log

REPO = pathlib.Path(__file__).resolve().parents[1]


def code_version() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                              text=True, cwd=REPO).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine() -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, AVX-512' or the like: what a measured score depends on."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
        model = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
        flags = " ".join(ln for ln in info.splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores" + (", AVX-512" if "avx512f" in flags else "")


def _sft_stages(store, key: str) -> list[dict]:
    """The warm-start chain that ended in `key`, first stage first, from the stages' commit records."""
    stages = []
    while key.startswith("models/base-"):
        rec = store.get_json(key + ".commit")
        m = rec.get("metrics", {})
        stages.append({"key": key, "stage": rec.get("stage"), "steps": m.get("steps"), "lr": rec["sft"]["lr"],
                       "demonstrations": rec["demonstrations"], "seconds": round(m.get("seconds", 0.0)),
                       "loss_last10": m.get("loss_last10")})
        key = rec["from"]
    return stages[::-1]


@flow(name="base")
def build_base(preset: str = "mini", overrides: dict | None = None, out: str | None = None) -> dict:
    """Build the preset's base checkpoint from nothing, freeze it into `out` and measure it."""
    from flows.prepare import _local_model, dataset_id_of, prepare_config
    from flows.runtime import RunContext, load_tasks, work_root
    from schemas.presets import load_config, set_dotted
    from tasks.dataset.build import tasks_sha256
    from tasks.evaluation import base_eval_id
    from tasks.policy import base
    from tasks.storage import Store

    overrides = dict(overrides or {})
    set_dotted(overrides, "model.path", None)  # build, do not load
    cfg = load_config(preset, overrides)
    out_dir = pathlib.Path(out or REPO / "models" / f"{preset}-base").resolve()
    t0 = time.monotonic()
    prepared = prepare_config(cfg)
    store = Store.from_config(cfg.storage)
    tasks = store.read_table(prepared["tasks"], stage="tasks")
    provenance = {
        "built_by": {"command": "make base", "flow": "flows/base.py", "preset": preset,
                     "overrides": {k: v for k, v in overrides.items() if k != "storage"}},
        "code_version": code_version(),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dataset": {"id": dataset_id_of(prepared["tasks"]), "tasks_sha256": tasks_sha256(tasks),
                    "num_tasks": tasks.num_rows, "config": cfg.dataset.model_dump()},
        "recipe": {"model": cfg.model.model_dump(), "sft": cfg.sft.model_dump(),
                   "prompt_style": cfg.agent.prompt_style, "init": prepared["model"],
                   "stages": _sft_stages(store, prepared["base_model"])},
    }
    manifest = base.freeze(_local_model(cfg, store, prepared["base_model"]), out_dir, provenance)
    log(f"base: froze {prepared['base_model']} into {out_dir} "
        f"({sum(f['bytes'] for f in manifest['files'].values()) / 1e6:.1f} MB)")

    # Measure what was shipped (the bf16 files), through the same checks and evaluation a run does.
    # Full sampling (no early stop), so the manifest carries pass@1 and pass^k too.
    eval_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(out_dir)}),
                                      "eval": cfg.eval.model_copy(update={"early_stop": False})})
    shipped = prepare_config(eval_cfg)
    run_id = base_eval_id(eval_cfg, shipped)
    ctx = RunContext(cfg=eval_cfg, store=store, run_id=run_id, workdir=work_root() / run_id,
                     tasks=load_tasks(store, shipped["tasks"]))
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    try:
        from flows.evaluate import evaluation

        ctx.start_policy(out_dir, version=0, trainer=False)
        row = evaluation(ctx, 0)
    finally:
        ctx.close()
    a, v = cfg.agent.validation, cfg.eval
    manifest["evaluation"] = {
        "k": row["k"], "pass_at_k": row["pass_at_k"], "pass_at_1": row["pass_at_1"], "pass_hat_k": row["pass_hat_k"],
        "num_tasks": row["num_tasks"], "samples_per_task": v.samples_per_task, "temperature": a.temperature,
        "top_p": a.top_p, "eval_seconds": round(row["eval_seconds"]), "machine": machine(),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "store_run_id": run_id}
    manifest["build_seconds"] = round(time.monotonic() - t0)
    base.write_manifest(out_dir, manifest)
    log(f"base: {out_dir} pass@{row['k']} {row['pass_at_k']:.3f}  pass@1 {row['pass_at_1']:.3f}  "
        f"pass^{row['k']} {row['pass_hat_k']:.3f} on {row['num_tasks']} validation tasks")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--out", help="checkpoint directory to write (default models/<preset>-base)")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    from flows.main import prefect_defaults
    from schemas.presets import ConfigError, load_config, parse_overrides

    prefect_defaults()
    try:
        load_config(args.preset, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    manifest = build_base(preset=args.preset, overrides=parse_overrides(args.overrides), out=args.out)
    print(json.dumps(manifest["evaluation"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
