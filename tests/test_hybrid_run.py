"""The benchmark's architecture end to end: the smoke-hybrid preset (a tiny Qwen3.5, Gated DeltaNet +
full attention + MoE with a shared expert) sampled by vLLM CPU in bf16 and trained in bf16 on fp32
master weights, through `python -m flows.main`: rollouts, grading, update, weight sync and an offline
evaluation of the last checkpoint on the training server."""

import json
import re
import subprocess
import sys
import time

import pytest

from tests.fixtures.smoke import REPO, cli_overrides, flow_env, smoke_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hybrid_run(smoke_prepared, tmp_path_factory):
    from tasks.storage import Store

    run_id = f"test-hybrid-{int(time.time())}"
    overrides = smoke_overrides(**{"eval.mode": "offline", "eval.offline_order": "between_steps",
                                   "eval.start_step": 2, "eval.max_tasks": 4})
    cmd = [sys.executable, "-m", "flows.main", "--preset", "smoke-hybrid", "--run-id", run_id,
           *cli_overrides(overrides)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env=flow_env(tmp_path_factory.mktemp("prefect-home")))
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), f"exit {proc.returncode}:\n{out[-6000:]}"
    return {"run_id": run_id, "store": Store(overrides["storage"]["root"]), "out": out}


def test_hybrid_is_served_and_trained_in_bf16(hybrid_run, smoke_prepared):
    store, run_id, out = hybrid_run["store"], hybrid_run["run_id"], hybrid_run["out"]
    manifest = store.read_manifest(run_id)
    assert manifest.status in ("succeeded", "target_not_reached"), manifest.status
    # Its own base (another architecture), warm-started on the smoke base's demonstrations: one tokenizer.
    assert manifest.prepared["base_model"] != smoke_prepared["base_model"]
    assert manifest.prepared["demonstrations"] == smoke_prepared["demonstrations"], manifest.prepared
    config = json.loads(store.get_bytes(manifest.prepared["base_model"] + "/config.json"))
    assert config["model_type"].startswith("qwen3_5"), config["model_type"]
    kinds = set(config["layer_types"])
    assert kinds == {"linear_attention", "full_attention"} and config["shared_expert_intermediate_size"] > 0
    assert config["num_experts_per_tok"] > 1, config
    vllm_log = re.search(r"vLLM serving policy v0 at \S+ \(ready \d+ s after this run asked, logs (\S+)\)", out)
    assert vllm_log, out[-4000:]
    log = open(vllm_log[1]).read()
    assert "dtype=torch.bfloat16" in log and "GDN" in log, log[-3000:]
    for step in (1, 2):
        commit = store.get_json(f"runs/{run_id}/checkpoints/step-{step:05d}.commit")
        m = commit["metrics"]
        assert m["precision"] == "bf16", m
        # The trainer (bf16 on the bf16 rounding of its fp32 weights) against vLLM (bf16), on the
        # step's rollouts: measured token_mult_prob_error 1.0005, no sequence outside [0.999, 1.002].
        assert 1.0 <= m["token_mult_prob_error"] < 1.01, m
        assert m["is_oob_ratio"] <= 0.125, m  # at most 1 of the step's 8 sequences masked by seq-mask-tis


def test_hybrid_checkpoint_is_evaluated_offline_after_the_sync(hybrid_run):
    store, run_id, out = hybrid_run["store"], hybrid_run["run_id"], hybrid_run["out"]
    assert store.stage_committed(run_id, 2, "eval_summary"), out[-4000:]
    assert not store.stage_committed(run_id, 1, "eval_summary")  # offline from step 2 only
    versions = set(store.read_stage(run_id, 2, "eval_trajectories", columns=["policy_version"])
                   .column("policy_version").to_pylist())
    assert versions == {2}, versions  # the server answered with checkpoint 2's weights
