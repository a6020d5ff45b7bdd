"""The frozen base checkpoint: the shipped one's integrity, `make base` on the smoke preset, and
the guards a run applies before anything starts."""

import json
import pathlib
import shutil

import pytest

from schemas.presets import load_config, load_recipe
from tasks.policy.base import BaseCheckpointError, check_dataset, check_files, read_manifest
from tests.fixtures.smoke import REPO, smoke_overrides

SHIPPED = REPO / "models" / "mini-base"


def test_shipped_base_matches_its_manifest_and_the_mini_dataset(tmp_path):
    from tasks.dataset.build import build_dataset, tasks_sha256
    from tasks.storage import Store

    manifest = read_manifest(SHIPPED)
    assert manifest is not None, "models/mini-base/manifest.json is missing"
    check_files(SHIPPED, manifest)
    assert sum(f["bytes"] for f in manifest["files"].values()) < 40e6
    # The generator still makes the tasks the base was trained on (generating them takes seconds).
    cfg = load_config("mini")
    store = Store(f"file://{tmp_path}/store")
    table = store.read_table(build_dataset(cfg.dataset, store, cfg.sandbox, verify=False), stage="tasks")
    check_dataset(SHIPPED, manifest, cfg.dataset.model_dump(), tasks_sha256(table))
    assert cfg.model.path == "models/mini-base"
    ev = manifest["evaluation"]
    assert ev["num_tasks"] == 251 and ev["k"] == 4 and ev["pass_at_k"] <= cfg.eval.target - 0.10
    assert manifest["built_by"]["command"].startswith("make base")
    from flows.base import _dotted  # the command says every override it was built with
    for k, v in _dotted(manifest["built_by"]["overrides"]):
        assert k == "model.path" or f"{k}={v}" in manifest["built_by"]["command"], (k, v)
    stages = [s["stage"] for s in manifest["recipe"]["stages"]]
    assert stages[:2] == ["warm start", "restart cycle 1/2"] and "habit phase" in stages
    if "continued_from" in manifest:  # stages added to an earlier frozen base (make base --from): say which
        sft = manifest["recipe"]["sft"]
        cycles = [s for s in stages if s.startswith("restart cycle")]
        assert len(cycles) == sft["restart_cycles"] and cycles[-1] == f"restart cycle {sft['restart_cycles']}/" \
            f"{sft['restart_cycles']}"
        assert stages[-1] == ("clean phase" if sft["clean_steps"] else "habit phase")
        assert manifest["continued_from"]["sha256"] and manifest["continued_from"]["evaluation"]["num_tasks"] == 251


@pytest.fixture(scope="module")
def smoke_base(smoke_prepared, smoke_server, tmp_path_factory):
    """`make base` on the smoke preset: the same flow, the smoke recipe, evaluated on the shared server."""
    from flows.base import build_base

    out = tmp_path_factory.mktemp("base") / "smoke-base"
    overrides = smoke_overrides(**{"inference.mode": "external", "inference.base_urls": [smoke_server.base_url]})
    manifest = build_base(preset="smoke", overrides=overrides, out=str(out))
    return out, manifest, overrides


def test_make_base_builds_freezes_and_measures_a_smoke_base(smoke_base, smoke_prepared):
    import torch
    from safetensors import safe_open

    from flows.prepare import _local_model
    from tasks.policy.runtime import load_for_training, init_runtime
    from tasks.storage import Store

    out, manifest, overrides = smoke_base
    assert read_manifest(out) == manifest
    check_files(out, manifest)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    stages = manifest["recipe"]["stages"]
    assert stages[-1]["key"] == smoke_prepared["base_model"] and stages[0]["stage"] == "warm start"
    assert manifest["dataset"]["id"] == pathlib.PurePosixPath(smoke_prepared["tasks"]).parent.name
    ev = manifest["evaluation"]  # measured through vLLM on the frozen files
    assert ev["num_tasks"] == 8 and ev["samples_per_task"] == 4 and 0.0 <= ev["pass_at_k"] <= 1.0
    assert ev["pass_at_1"] <= ev["pass_at_k"] and ev["machine"]
    # Stored in bf16; the trainer loads fp32 master weights equal to them.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        name = next(iter(f.keys()))
        stored = f.get_tensor(name)
    assert stored.dtype == torch.bfloat16
    model, _ = load_for_training(out, init_runtime())
    loaded = dict(model.named_parameters())[name]
    assert loaded.dtype == torch.float32 and torch.equal(loaded.detach(), stored.float())
    # ... and they are the SFT checkpoint's weights, rounded.
    cfg = load_config("smoke", overrides)
    src = _local_model(cfg, Store.from_config(cfg.storage), smoke_prepared["base_model"])
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(name).to(torch.bfloat16), stored)


def test_prepare_starts_from_a_given_base_without_sft(smoke_base, monkeypatch):
    import flows.prepare as prepare
    from tasks.policy.worker import TrainerWorker

    out, manifest, overrides = smoke_base

    def never(*a, **k):
        raise AssertionError("prepare ran a warm-start stage for a run that has its base")

    monkeypatch.setattr(TrainerWorker, "sft", never)
    monkeypatch.setattr(prepare, "demonstrations", never)
    monkeypatch.setattr(prepare, "warm_start_chain", never)
    cfg = load_config("smoke", {**overrides, "model": {"path": str(out)}})
    prepared = prepare.prepare_config(cfg)
    assert prepared["base_model"] == str(out.resolve()) and prepared["demonstrations"] is None
    assert prepared["base_weights"]


def _forbid(monkeypatch, module, *names):
    """Make each named stage of `module` fail the test if it starts: the checks must come first."""
    def never(*a, **k):
        raise AssertionError("a stage started before the base was checked")

    for name in names:
        monkeypatch.setattr(module, name, never)


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def test_guards_fail_before_anything_starts(smoke_base, tmp_path, monkeypatch):
    import flows.prepare as prepare

    out, manifest, overrides = smoke_base
    _forbid(monkeypatch, prepare, "sandbox_image", "dataset")

    def run_with(path):
        return prepare.prepare_config(load_config("smoke", {**overrides, "model": {"path": str(path)}}))

    altered = _copy(out, tmp_path / "altered")
    data = bytearray((altered / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (altered / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(BaseCheckpointError, match=r"model\.safetensors does not match manifest\.json"):
        run_with(altered)

    missing = _copy(out, tmp_path / "missing")
    (missing / "tokenizer.json").unlink()
    with pytest.raises(BaseCheckpointError, match=r"tokenizer\.json is missing"):
        run_with(missing)

    other = _copy(out, tmp_path / "other-dataset")
    m = json.loads((other / "manifest.json").read_text())
    m["dataset"]["config"]["seed"] = 99
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BaseCheckpointError, match=r"with dataset\.seed=99, but this run has dataset\.seed=0\b"):
        run_with(other)


def test_guard_names_both_tasks_tables(smoke_base):
    out, manifest, _ = smoke_base
    with pytest.raises(BaseCheckpointError) as e:
        check_dataset(out, manifest, manifest["dataset"]["config"], tasks_sha256="f" * 64)
    assert manifest["dataset"]["tasks_sha256"] in str(e.value) and "f" * 64 in str(e.value)
    check_dataset(out, manifest, manifest["dataset"]["config"], manifest["dataset"]["tasks_sha256"])


def test_continuing_a_base_checks_its_recipe_before_anything_runs(smoke_base, smoke_prepared, monkeypatch):
    import flows.prepare as prepare
    from flows.base import continue_base
    from tasks.storage import Store

    out, manifest, overrides = smoke_base
    _forbid(monkeypatch, prepare, "base_model", "demonstrations", "warm_start_chain")

    def extend(**sft):
        cfg = load_config("smoke", overrides)
        return continue_base(cfg, load_recipe("smoke", sft), Store.from_config(cfg.storage), smoke_prepared["tasks"],
                             out)

    with pytest.raises(BaseCheckpointError, match=r"already ends with every stage of this recipe"):
        extend()
    # The smoke base had no warm-start pool: a recipe with one is another chain, not a continuation.
    with pytest.raises(BaseCheckpointError, match=r"other sft settings .*pool_tasks 0 != 4"):
        extend(pool_tasks=4, clean_steps=2)


def test_continuing_a_base_adds_a_restart_cycle_from_its_frozen_weights(smoke_base, smoke_prepared):
    from flows.base import continue_base
    from tasks.policy.base import weights_digest
    from tasks.storage import Store

    out, manifest, overrides = smoke_base
    cfg = load_config("smoke", overrides)
    store = Store.from_config(cfg.storage)
    init, key, stages, continued = continue_base(cfg, load_recipe("smoke", {"restart_cycles": 1}), store,
                                                 smoke_prepared["tasks"], out)
    assert init == manifest["recipe"]["init"] and continued["sha256"] == weights_digest(manifest)
    assert [s["stage"] for s in stages] == [s["stage"] for s in manifest["recipe"]["stages"]] + ["restart cycle 1/1"]
    record = store.get_json(key + ".commit")
    assert record["from"] == f"models/frozen-{weights_digest(manifest)}"  # the shipped bf16 weights, not a chain key
    assert record["demonstrations"] == smoke_prepared["demonstrations"] and record["metrics"]["steps"] >= 1
    assert key not in {s["key"] for s in manifest["recipe"]["stages"]}


def test_tasks_sha256_ignores_where_archives_live_and_sees_content():
    import pyarrow as pa

    from tasks.dataset.build import tasks_sha256

    rows = [{"instance_id": "b", "environment_uri": "file:///x/b.tar.gz", "problem_statement": "fix b"},
            {"instance_id": "a", "environment_uri": "file:///x/a.tar.gz", "problem_statement": "fix a"}]
    moved = [dict(r, environment_uri=r["environment_uri"].replace("/x/", "/y/")) for r in rows[::-1]]
    assert tasks_sha256(pa.Table.from_pylist(rows)) == tasks_sha256(pa.Table.from_pylist(moved))
    edited = [dict(rows[0], problem_statement="fix b!"), rows[1]]
    assert tasks_sha256(pa.Table.from_pylist(rows)) != tasks_sha256(pa.Table.from_pylist(edited))


def test_stage_keys_follow_their_parent_and_their_own_settings():
    from flows.prepare import sft_stage_key
    from schemas.recipe import stages

    def keys(**sft):
        key, out = "models/init-x", {}
        for stage in stages(load_recipe("mini", sft)):
            key = out[stage.name] = sft_stage_key(key, f"demos-{stage.demonstrations.per_task}", stage)
        return out

    shipped, more, habit = keys(), keys(restart_cycles=3), keys(habit_lr=1e-4)
    # A stage added keeps the earlier ones' keys: the same settings from the same parent (names aside).
    assert [shipped[k] for k in ("warm start", "restart cycle 1/2", "restart cycle 2/2")] == \
        [more[k] for k in ("warm start", "restart cycle 1/3", "restart cycle 2/3")]
    assert more["habit phase"] != shipped["habit phase"]  # its parent is the third cycle now
    # A stage's own setting changes its key, not its parents'.
    assert {k: v for k, v in habit.items() if k != "habit phase"} == \
        {k: v for k, v in shipped.items() if k != "habit phase"}
    assert habit["habit phase"] != shipped["habit phase"]
    assert len(set(keys(lr=2e-3).values()) & set(shipped.values())) == 0
