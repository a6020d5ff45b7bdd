"""`make base`: build a base checkpoint from nothing and freeze it, as models/mini-base/ was made.

    python -m flows.base [--preset mini] [--out models/mini-base] [--from DIR] [section.field=value ...]

    dataset          generated and verified in sandboxes (the same build `make run` does)
    tokenizer+init   a tokenizer trained on the train split's text and the tiny model's random weights
    demonstrations   scripted-solver episodes on the train split and the warm-start pool
    warm-start       the preset's warm-start recipe (schemas/presets.py: RECIPES; `sft.*` overrides),
                     its stages one SFT run each (schemas/recipe.py; flows/prepare.py: warm_start_chain)
    freeze           the weights in bf16 + tokenizer + manifest.json (tasks/policy/base.py)
    evaluate         pass@k on every validation task, recorded in the manifest with the machine

Every stage is cached in the store as `make run` caches it, so a rebuild that was cut
resumes; an SFT stage also keeps its state every 10 minutes beside its output (tasks/policy/sft.py),
so a cut mid-stage loses at most that. `make run` then starts from the frozen base: no SFT runs on a user's machine.
`--from DIR` adds to a frozen base the stages this recipe has beyond its own (more restart
cycles, then the habit phase again; a clean phase), with the demonstrations, settings and checks
a rebuild from nothing uses: minutes to half an hour, not hours.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

from prefect import flow

from flows.prepare import _local_model, dataset_id_of, prepare_config
from flows.process import prefect_defaults
from flows.runtime import RunContext, code_version, load_tasks, log, work_root
from schemas.presets import ConfigError, load_config, load_recipe, parse_overrides, set_dotted
from schemas.recipe import WarmStartRecipe, stages
from tasks.dataset.build import tasks_sha256
from tasks.evaluation import base_eval_id
from tasks.policy import base
from tasks.storage import Store

REPO = pathlib.Path(__file__).resolve().parents[1]


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


def continue_base(cfg, recipe, store, tasks_key: str, base_dir: pathlib.Path) -> tuple[str, str, list[dict], dict]:
    """Extend a frozen base by the stages `recipe` has beyond the recipe that built it: more restart
    cycles (then the habit phase again, as the chain ends with it) and/or a clean phase. The same init
    (its key checked against the base's), demonstrations and stage settings as a rebuild from nothing,
    from the frozen bf16 weights. Returns (init key, the last stage's store key, every stage, what
    it continued from)."""
    from flows.prepare import base_model, warm_start_chain
    manifest = base.read_manifest(base_dir)
    if manifest is None:
        raise base.BaseCheckpointError(f"{base_dir} has no {base.MANIFEST}: only a frozen base can be continued")
    base.check_files(base_dir, manifest)
    base.check_dataset(base_dir, manifest, cfg.dataset.model_dump(),
                       tasks_sha256(store.read_table(tasks_key, stage="tasks")))
    done, built = manifest["recipe"]["stages"], WarmStartRecipe(**manifest["recipe"]["sft"])
    more_cycles = recipe.restart_cycles > built.restart_cycles
    if not more_cycles and (not recipe.clean_steps or any(s["stage"] == "clean phase" for s in done)):
        raise base.BaseCheckpointError(
            f"{base_dir} already ends with every stage of this recipe: raise sft.restart_cycles above "
            f"{built.restart_cycles} or set sft.clean_steps for a clean phase")
    # What may differ: the stages added. Everything else is the recipe the base was built with.
    added = {"restart_cycles", "clean_steps", "clean_lr"}
    want, had = recipe.model_dump(exclude=added), built.model_dump(exclude=added)
    differ = sorted(k for k in want if want[k] != had[k])
    if differ:
        raise base.BaseCheckpointError(f"{base_dir} was built with other sft settings than this recipe's earlier "
                                       f"stages: " + ", ".join(f"{k} {had[k]} != {want[k]}" for k in differ))
    init_key = base_model(cfg, store, tasks_key)
    if init_key != manifest["recipe"]["init"]:
        raise base.BaseCheckpointError(f"{base_dir} starts from {manifest['recipe']['init']}, this config from {init_key}")
    # The frozen bf16 weights under a key of their own: never mistaken for the chain's fp32 stage.
    digest = base.weights_digest(manifest)
    frozen = f"models/frozen-{digest}"
    if not store.exists(frozen + ".commit"):
        store.put_dir(frozen, base_dir)
        store.put_json(frozen + ".commit", {"built_at": time.time(), "imported_from": str(base_dir),
                                            "stages": [s["key"] for s in done]})
    # The restart cycles the base lacks, then the phases (its habit phase again only after new cycles).
    chain = stages(recipe)
    cycles, phases = chain[1:1 + recipe.restart_cycles], chain[1 + recipe.restart_cycles:]
    todo = cycles[built.restart_cycles:] + [s for s in phases if more_cycles or s.name != "habit phase"]
    key = warm_start_chain(cfg, store, tasks_key, init_key, todo, start_key=frozen)
    continued = {"dir": str(base_dir.relative_to(REPO) if base_dir.is_relative_to(REPO) else base_dir),
                 "code_version": manifest["code_version"], "built_at": manifest["built_at"],
                 "build_seconds": manifest.get("build_seconds"), "evaluation": manifest["evaluation"],
                 "sha256": digest}
    return init_key, key, done + _sft_stages(store, key), continued


def base_configs(preset: str, overrides: dict) -> tuple:
    """(run config, warm-start recipe) of `make base`: the `sft` overrides are the recipe's, and the
    base is built, not loaded (model.path None, recorded in `overrides`)."""
    set_dotted(overrides, "model.path", None)
    cfg = load_config(preset, {k: v for k, v in overrides.items() if k != "sft"})
    return cfg, load_recipe(preset, overrides.get("sft"))


def _dotted(tree: dict, prefix: str = ""):
    """{"sft": {"restart_cycles": 3}} -> ("sft.restart_cycles", 3): overrides as they were typed."""
    for k, v in tree.items():
        yield from _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]


@flow(name="base")
def build_base(preset: str = "mini", overrides: dict | None = None, out: str | None = None,
               continue_from: str | None = None) -> dict:
    """Build the preset's base checkpoint from nothing (or by adding the missing stages to the frozen
    base `continue_from`), freeze it into `out` and measure it."""
    overrides = dict(overrides or {})
    cfg, recipe = base_configs(preset, overrides)
    out_dir = pathlib.Path(out or REPO / "models" / f"{preset}-base").resolve()
    t0 = time.monotonic()
    store = Store.from_config(cfg.storage)
    command = "make base"
    if continue_from:
        tasks_key = prepare_config(cfg, dataset_only=True)["tasks"]
        init_key, base_key, stages, continued = continue_base(cfg, recipe, store, tasks_key,
                                                              pathlib.Path(continue_from).resolve())
        command = f"make base ARGS='--from {continued['dir']}"
        command += "".join(f" {k}={v}" for k, v in _dotted(overrides) if k != "model.path" and
                           not k.startswith("storage.")) + "'"
    else:
        prepared = prepare_config(cfg, recipe=recipe)
        tasks_key, init_key, base_key = prepared["tasks"], prepared["model"], prepared["base_model"]
        stages, continued = _sft_stages(store, base_key), None
    tasks = store.read_table(tasks_key, stage="tasks")
    provenance = {
        "built_by": {"command": command, "flow": "flows/base.py", "preset": preset,
                     "overrides": {k: v for k, v in overrides.items() if k != "storage"}},
        "code_version": code_version(),
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dataset": {"id": dataset_id_of(tasks_key), "tasks_sha256": tasks_sha256(tasks),
                    "num_tasks": tasks.num_rows, "config": cfg.dataset.model_dump()},
        "recipe": {"model": cfg.model.model_dump(), "sft": recipe.model_dump(),
                   "prompt_style": cfg.agent.prompt_style, "init": init_key, "stages": stages},
    }
    if continued:
        provenance["continued_from"] = continued
    manifest = base.freeze(_local_model(cfg, store, base_key), out_dir, provenance)
    log(f"base: froze {base_key} into {out_dir} "
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
    ap.add_argument("--from", dest="continue_from", metavar="DIR",
                    help="add the stages this recipe has beyond the frozen base DIR's (restart cycles, clean phase)")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    prefect_defaults()
    try:
        base_configs(args.preset, parse_overrides(args.overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    manifest = build_base(preset=args.preset, overrides=parse_overrides(args.overrides), out=args.out,
                          continue_from=args.continue_from)
    print(json.dumps(manifest["evaluation"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
