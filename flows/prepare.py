"""prepare: everything the timed run starts from, each piece cached in the object store.

    sandbox image    the Debian rootfs local sandboxes run in (and its docker image), built once
    dataset          tasks table (+ environment archives), verified in sandboxes
    base model       tokenizer trained on train-split text + a tiny Qwen-family model (random init)
    demonstrations   scripted-solver episodes on train tasks (and on the warm-start pool of extra
                     generated tasks), through the real agent loop and sandboxes
    warm start       the recipe's SFT stages in order (schemas/recipe.py: warm start, restart cycles,
                     habit phase, clean phase), each from the one before -> the base checkpoint

A run with model.path set starts from that checkpoint and builds neither of the last two; one
without builds them with its preset's warm-start recipe, as `make base` (flows/base.py) does.
Every piece is keyed by a hash of what it depends on (stage and demonstration keys:
schemas/recipe.py), so a second `make run` skips it; nothing here ever reads validation tasks
except the dataset build and the warm-start pool, which reads their leakage keys only to keep
every pool task unlike them.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import random
import tarfile
import time

import jinja2
import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NONE

from flows.runtime import (EventLoopThread, Progress, RunContext, config_json, load_tasks, log, shipped_base_dir,
                           work_root)
from schemas.config import RunConfig
from schemas.presets import load_config, load_recipe
from schemas.recipe import STORE_VERSION, Demonstrations, SFTStage, WarmStartRecipe, stages
from tasks.agent.prompts import INSTANCE_PROMPT, SYSTEM_PROMPT
from tasks.agent.tools import prompt_tools
from tasks.dataset.build import build_dataset, build_warm_start_pool, fully_verified
from tasks.dataset.mini import gold_patch
from tasks.dataset.order import training_batch
from tasks.dataset.verify import verify_tasks
from tasks.policy.base import check_dataset, check_files, read_manifest
from tasks.policy.worker import TrainerWorker
from tasks.sandbox import image
from tasks.storage import Store, check_run_id

TOKENIZER_CORPUS_VERSION = 4


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


@task(name="sandbox-image", cache_policy=NONE)
def sandbox_image(cfg: RunConfig) -> None:
    """Environment archives (the mini benchmark's, imported tasks', R2E rows with environment_uri) run
    in our own Debian rootfs; R2E rows without one bring their docker images."""
    if cfg.dataset.source != "mini":
        from tasks.dataset.r2e import DatasetError, read_rows

        try:
            rows = read_rows(cfg.dataset.path, Store.from_config(cfg.storage)) if cfg.dataset.path else []
        except DatasetError:  # the dataset task reports it
            rows = []
        if not any(r.get("environment_uri") for r in rows):
            return

    t0 = time.monotonic()
    root = image.ensure_image(docker_too=cfg.sandbox.backend == "docker")
    log(f"prepare: sandbox image {root} ({time.monotonic() - t0:.0f} s)")


@task(name="dataset", cache_policy=NONE)
def dataset(cfg: RunConfig, store: Store, scope: str = "all") -> str:
    """The tasks table, verified: every task, or (scope "used", the mini) those this run can use."""
    t0 = time.monotonic()
    used = scope == "used" and cfg.dataset.source == "mini"

    def progress(what, total):
        return Progress(what, total, "gradings", every_s=20)

    key = build_dataset(cfg.dataset, store, cfg.sandbox, verify=not used, progress=progress)
    if used and not fully_verified(store, key):
        rows = store.read_table(key, stage="tasks").to_pylist()
        ids = used_task_ids(cfg, rows)
        verify_tasks([r for r in rows if r["instance_id"] in ids], store, cfg.sandbox, progress, cache=True)
        log(f"prepare: {len(ids)} of {len(rows)} tasks verified, those this run can use (the validation split "
            f"and the training batches of steps 1-{cfg.max_steps}); dataset.verify_scope=all verifies every one")
    log(f"prepare: tasks table {store.uri(key)} ({time.monotonic() - t0:.0f} s)")
    return key


def used_task_ids(cfg: RunConfig, rows: list[dict]) -> set[str]:
    """The tasks a run can grade: the validation split and its training batches up to max_steps."""
    train = sorted(r["instance_id"] for r in rows if r["split"] == "train")
    ids = {r["instance_id"] for r in rows if r["split"] == "validation"}
    for step in range(cfg.max_steps):  # training_batch_ids's batches, step 1 at index 0
        ids.update(training_batch(train, step, cfg.grpo.prompts_per_step, cfg.seed, cfg.dataset.order))
    return ids


def _agent_text(style: str) -> str:
    """The agent's fixed text (system prompt, tool schemas, tool-call markup) as the chat template renders it.

    It opens every episode and frames every tool call, so the tokenizer should learn it: with the
    schemas in its corpus the prompt shrinks by more than half, and so does what every rollout and
    update pays for."""
    from tasks.policy.tokenizer import CHAT_TEMPLATE, assistant_text, observation_segment

    env = jinja2.Environment()
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    messages = [{"role": "system", "content": SYSTEM_PROMPT[style]},
                {"role": "user", "content": INSTANCE_PROMPT[style].format(problem_statement="...")}]
    calls = [{"name": "file_editor", "arguments": {"command": "view", "path": "/testbed/pkg/mod.py"}},
             {"name": "file_editor", "arguments": {"command": "str_replace", "path": "/testbed/pkg/mod.py",
                                                   "old_str": "...", "new_str": "..."}},
             {"name": "execute_bash", "arguments": {"cmd": "..."}},
             {"name": "search", "arguments": {"search_term": "...", "path": "/testbed"}},
             {"name": "finish", "arguments": {"command": "submit"}}]
    prompt = env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=prompt_tools(style),
                                                   add_generation_prompt=True)
    return prompt + "".join(assistant_text(None, [c]) + observation_segment(["..."]) for c in calls)


def _train_corpus(store: Store, tasks: dict[str, dict], style: str):
    """Problem statements and repository code of the train split (never validation), and the agent's own text."""
    from tasks.policy.tokenizer import default_corpus

    fixed = _agent_text(style)
    for _ in range(50):  # BPE merges follow frequency: as often as it occurs in training data
        yield fixed
    for t in sorted((t for t in tasks.values() if t["split"] == "train"), key=lambda t: t["instance_id"]):
        yield t["problem_statement"]
        if t.get("environment_uri"):
            with tarfile.open(fileobj=io.BytesIO(store.get_bytes(t["environment_uri"])), mode="r:gz") as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.startswith("testbed/") and m.name.endswith(".py"):
                        yield tar.extractfile(m).read().decode("utf-8", "replace")
    yield from default_corpus(max_chars=1_000_000)


@task(name="base-model", cache_policy=NONE)
def base_model(cfg: RunConfig, store: Store, tasks_key: str) -> str:
    """The untrained policy: a tokenizer trained on the benchmark's train text + random weights."""
    from tasks.policy.model import create_tiny_policy

    key = f"models/init-{_digest(tasks_key, cfg.model.model_dump(), TOKENIZER_CORPUS_VERSION, cfg.agent.prompt_style)}"
    if store.exists(key + ".commit"):
        return key
    t0 = time.monotonic()
    out = work_root() / "prepare" / pathlib.PurePosixPath(key).name
    create_tiny_policy(cfg.model, out, corpus=_train_corpus(store, load_tasks(store, tasks_key), cfg.agent.prompt_style))
    store.put_dir(key, out)
    store.put_json(key + ".commit", {"built_at": time.time(), "model": cfg.model.model_dump()})
    log(f"prepare: tiny {cfg.model.arch} model + tokenizer at {store.uri(key)} ({time.monotonic() - t0:.0f} s)")
    return key


def tokenizer_digest(model_dir: pathlib.Path) -> str:
    """The tokenizer's identity, its files' bytes: bases of two architectures trained on one corpus share
    it, and with it their demonstrations (token ids and chat markup, nothing of the model's)."""
    files = sorted(p for p in model_dir.iterdir()
                   if p.name.startswith(("tokenizer", "chat_template", "special_tokens_map")))
    if not any(p.name == "tokenizer.json" for p in files):
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return _digest(*((p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in files))


def demonstrations_key(tasks_key: str, tokenizer: str, prompt_style: str, demos: Demonstrations) -> str:
    """Demonstrations of the tokenizer (tokenizer_digest) and prompt style with `demos`' own settings."""
    return (f"{tasks_key.rsplit('/', 1)[0]}/demonstrations-"
            f"{_digest(STORE_VERSION, tokenizer, prompt_style, demos.model_dump())}.parquet")


@task(name="demonstrations", cache_policy=NONE)
def demonstrations(cfg: RunConfig, store: Store, tasks_key: str, model_key: str, demos: Demonstrations) -> str:
    """Scripted-solver trajectories on the train split (and the warm-start pool), through the real
    loop, tools and sandboxes."""

    from tasks.agent.scripted import ScriptedSolver
    from tasks.policy.tokenizer import load_tokenizer
    from tasks.rollout import RolloutSpec, collect, scripted_episodes

    model_dir = _local_model(cfg, store, model_key)
    key = demonstrations_key(tasks_key, tokenizer_digest(model_dir), cfg.agent.prompt_style, demos)
    if store.is_committed(key):
        return key
    t0 = time.monotonic()
    tasks = load_tasks(store, tasks_key)
    train = [t for t in tasks.values() if t["split"] == "train"]
    pool_key = build_warm_start_pool(cfg.dataset, demos.pool_tasks, store, cfg.sandbox, demos.pool_foreign_names)
    pool = store.read_table(pool_key, stage="tasks").to_pylist() if pool_key else []
    if pool:
        log(f"prepare: warm-start pool of {len(pool)} generated tasks at {store.uri(pool_key)} "
            f"({time.monotonic() - t0:.0f} s)")
    tokenizer = load_tokenizer(model_dir)

    def solver(task, sample, sandbox):
        rng = random.Random(f"{demos.seed}:{task['instance_id']}:{sample}")
        return ScriptedSolver(task, gold_patch(task), sandbox, tokenizer, rng, max_turns=cfg.agent.max_turns,
                              blind_rate=demos.blind_edits)

    tables = []
    loop = EventLoopThread()
    try:
        for rows, samples in ((train, demos.per_task), (pool, 1)):
            if not rows or not samples:
                continue
            spec = RolloutSpec(run_id="demonstrations", step=0, split="train", samples_per_task=samples,
                               temperature=0.0, top_p=1.0)
            what = "demonstrations: " + ("train tasks" if rows is train else "warm-start pool")
            episodes = scripted_episodes(solver, spec, tokenizer, cfg, store)
            tables.append(loop.call(collect(rows, spec, episodes, max(2, cfg.sandbox.concurrency * 2),
                                            on_episode=Progress(what, len(rows) * samples, "episodes", 20))))
    finally:
        loop.close()
    table = pa.concat_tables(tables)
    # Only the few columns the check needs: the table holds every demonstration's token ids.
    check = table.select(["rollout_id", "finish_reason", "error"]).to_pylist()
    bad = [r for r in check if r["finish_reason"] != "submitted"]
    if bad:
        raise RuntimeError(f"{len(bad)} demonstrations did not submit, e.g. {bad[0]['rollout_id']}: "
                           f"{bad[0]['finish_reason']} {bad[0]['error']}")
    store.write_table(key, table, stage="demonstrations")
    toks = sum(table["num_generated_tokens"].to_pylist())
    log(f"prepare: {table.num_rows} demonstrations ({toks} generated tokens) in {time.monotonic() - t0:.0f} s")
    return key


def sft_stage_key(parent_key: str, demos_key: str, stage: SFTStage) -> str:
    """A stage's checkpoint: its parent's, its demonstrations and its own settings (not its name)."""
    return f"models/base-{_digest(STORE_VERSION, parent_key, demos_key, stage.model_dump(exclude={'name'}))}"


@task(name="sft-stage", cache_policy=NONE)
def sft_stage(cfg: RunConfig, store: Store, parent_key: str, demos_key: str, stage: SFTStage) -> str:
    """One SFT run of the warm start (tasks/policy/sft.py) from checkpoint parent_key: one checkpoint."""
    key = sft_stage_key(parent_key, demos_key, stage)
    if store.exists(key + ".commit"):
        return key
    t0 = time.monotonic()
    out = work_root() / "prepare" / pathlib.PurePosixPath(key).name
    out.parent.mkdir(parents=True, exist_ok=True)
    with TrainerWorker(_local_model(cfg, store, parent_key), cfg, mode="sft",
                       log_path=work_root() / "prepare" / "sft-worker.log") as worker:
        metrics = worker.sft(store.local_path(demos_key), out, stage)
    store.put_dir(key, out)
    store.put_json(key + ".commit", {"built_at": time.time(), "stage": stage.name, "from": parent_key,
                                     "demonstrations": demos_key, "sft": stage.model_dump(), "metrics": metrics})
    log(f"prepare: {stage.name} {store.uri(key)}: {json.dumps(metrics, default=str)[:200]} "
        f"({time.monotonic() - t0:.0f} s)")
    return key


def warm_start_chain(cfg: RunConfig, store: Store, tasks_key: str, model_key: str, chain: list[SFTStage],
                     start_key: str | None = None) -> str:
    """The stages in order (schemas/recipe.py: stages), each from the one before's checkpoint, the first
    from start_key (default: the init model_key, whose tokenizer every demonstration uses)."""
    key = start_key or model_key
    for stage in chain:
        demos_key = demonstrations(cfg, store, tasks_key, model_key, stage.demonstrations)
        key = sft_stage(cfg, store, key, demos_key, stage)
    return key


def _local_model(cfg: RunConfig, store: Store, key: str) -> pathlib.Path:
    from tasks.policy.model import resolve_model_dir

    if "://" in key or key.startswith("/"):
        return resolve_model_dir(key)
    local = work_root() / "models" / pathlib.PurePosixPath(key).name
    if not (local / ".complete").exists():
        store.get_dir(key, local)
        (local / ".complete").touch()
    return local


@flow(name="prepare")
def prepare(preset: str = "mini", overrides: dict | None = None) -> dict:
    """Build (or find cached) dataset, base model, demonstrations and warm-started checkpoint."""
    cfg = load_config(preset, overrides)
    return prepare_config(cfg)


def prepare_config(cfg: RunConfig, dataset_only: bool = False, recipe: WarmStartRecipe | None = None) -> dict:
    """Without model.path the base is built first with `recipe` (default: the preset's, schemas/presets.py)."""
    store = Store.from_config(cfg.storage)
    shipped = shipped_base(cfg) if cfg.model.path and not dataset_only else None
    if not cfg.model.path and not dataset_only:
        recipe = recipe or load_recipe(cfg.preset)
    sandbox_image(cfg)
    # A base built here trains on every training task: all are verified first.
    builds_base = not cfg.model.path and not dataset_only
    tasks_key = dataset(cfg, store, "all" if builds_base else cfg.dataset.verify_scope)
    if dataset_only:
        return {"tasks": tasks_key}
    if shipped is not None:  # a given checkpoint is its own base: no demonstrations, no SFT
        model_dir, manifest = shipped
        out = {"tasks": tasks_key, "model": str(model_dir), "demonstrations": None, "base_model": str(model_dir)}
        if manifest is not None:
            from tasks.dataset.build import tasks_sha256
            from tasks.policy.base import check_dataset, weights_digest

            table = store.read_table(tasks_key, stage="tasks")
            check_dataset(model_dir, manifest, cfg.dataset.model_dump(), tasks_sha256(table))
            out["base_weights"] = weights_digest(manifest)
            log(f"prepare: base checkpoint {model_dir} ({manifest['files']['model.safetensors']['bytes'] / 1e6:.1f} MB, "
                f"built by {manifest['built_by']['command']} at {manifest['code_version']}; files and dataset checked)")
        return out
    model_key = base_model(cfg, store, tasks_key)
    chain = stages(recipe)
    demos_key = demonstrations(cfg, store, tasks_key, model_key, chain[0].demonstrations)
    base_key = warm_start_chain(cfg, store, tasks_key, model_key, chain)
    return {"tasks": tasks_key, "model": model_key, "demonstrations": demos_key, "base_model": base_key}


def dataset_id_of(tasks_key: str) -> str:
    """"datasets/<id>/tasks.parquet" -> "<id>"."""
    return pathlib.PurePosixPath(tasks_key).parent.name


def shipped_base(cfg: RunConfig) -> tuple[pathlib.Path, dict | None]:
    """The local directory of cfg.model.path and its base manifest (None for a checkpoint without one),
    checked before anything starts: every file the manifest lists, with its sha256, and the dataset config."""
    from tasks.policy.model import resolve_model_dir

    path = cfg.model.path if "://" in cfg.model.path else str(shipped_base_dir(cfg.model.path))
    model_dir = resolve_model_dir(path) if "://" in path else pathlib.Path(path)  # a URI: a local copy first
    manifest = read_manifest(model_dir) if model_dir.is_dir() else None
    if manifest is not None:
        check_files(model_dir, manifest)
        check_dataset(model_dir, manifest, cfg.dataset.model_dump())  # the config now, the tasks once built
    resolve_model_dir(model_dir)  # what any checkpoint needs, with or without a manifest
    return model_dir.resolve(), manifest


def prepare_run_context(preset: str, overrides, run_id: str, dataset_only: bool = False) -> tuple[RunContext, dict]:
    check_run_id(run_id)  # before anything is built: the id names a directory under the work root
    cfg = load_config(preset, overrides)
    prepared = prepare_config(cfg, dataset_only)
    store = Store.from_config(cfg.storage)
    workdir = work_root() / run_id
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(cfg=cfg, store=store, run_id=run_id, workdir=workdir, tasks=load_tasks(store, prepared["tasks"]))
    if not dataset_only:
        prepared["base_model_dir"] = str(_local_model(cfg, store, prepared["base_model"]))
    return ctx, prepared


__all__ = ["prepare", "prepare_config", "prepare_run_context", "config_json"]
