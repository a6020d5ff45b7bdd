"""Reproducibility reruns: the report on real smoke-run tables, drift failing the flow run in the Prefect
API, and a scheduled deployment producing a report. Copies of the run go to a temporary store, so the
real run's folder is never written."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from tests.fixtures.smoke_run import REPO, SMOKE_STORE_ROOT, copy_run


@pytest.fixture
def two_copies(tmp_path, smoke_run):
    from tasks.storage import Store

    src, dst = Store(SMOKE_STORE_ROOT), Store(f"file://{tmp_path}/store")
    copy_run(src, dst, smoke_run, "base")
    copy_run(src, dst, smoke_run, "again")
    return dst


def test_identical_runs_reproduce(two_copies):
    from flows.reproducibility import REPORT, compare_runs, report_markdown

    report = compare_runs(two_copies, "base", "again")
    REPORT.validate(report)
    rows = report.to_pylist()
    assert all(r["ok"] for r in rows if r["gated"]), [r for r in rows if r["gated"] and not r["ok"]]
    metrics = {r["metric"] for r in rows}
    assert {"config", "dataset", "base_checkpoint", "batch_membership", "prompt_agreement", "pass_at_k",
            "train_reward_mean", "time_to_train_s", "trajectory_agreement"} <= metrics
    # T=1.0, seeded: step 1 sampled from the same base in both, so it is gated; step 2 sampled from
    # checkpoint 1, whose weights these copies lack: information only.
    traj = {r["step"]: r for r in rows if r["metric"] == "trajectory_agreement"}
    assert traj[1]["gated"] and traj[1]["rerun"] == 1.0 and "seeded, from identical weights" in traj[1]["detail"]
    assert not traj[2]["gated"] and "not in the store" in traj[2]["detail"]
    two_copies.write_table("runs/again/reproducibility.parquet", report, stage="reproducibility")
    assert "**reproduced**" in report_markdown(report)


@pytest.fixture
def two_copies_with_weights(tmp_path, smoke_run):
    from tasks.storage import Store

    src, dst = Store(SMOKE_STORE_ROOT), Store(f"file://{tmp_path}/store")
    copy_run(src, dst, smoke_run, "base", weights=True)
    copy_run(src, dst, smoke_run, "again", weights=True)
    return dst


def _edit_trajectory(store, run_id: str, step: int, edit) -> None:
    from schemas.tables import TRAJECTORIES

    rows = store.read_stage(run_id, step, "trajectories").to_pylist()
    rows = sorted(rows, key=lambda r: r["rollout_id"])
    edit(rows[0])
    store.write_stage(run_id, step, "trajectories", TRAJECTORIES.from_rows(rows), overwrite=True)


def test_seeded_reruns_are_gated_where_both_sampled_from_identical_weights(two_copies_with_weights):
    """The three verdicts a step can get, on real smoke tables and weights: identical; the same tokens with
    other numbers (logprobs, weights); other tokens, which fail the gate where both runs sampled seeded from
    identical weights and are information where they did not."""
    import torch
    from safetensors.torch import load, save

    from flows.reproducibility import compare_runs, report_markdown
    from flows.stages import checkpoint_key

    store = two_copies_with_weights

    def rows_of():
        return {(r["metric"], r["step"]): r for r in compare_runs(store, "base", "again").to_pylist()}

    rows = rows_of()
    assert rows[("trajectory_agreement", 2)]["gated"]  # checkpoint 1 identical: step 2 is pinned too
    assert rows[("update_agreement", 1)]["detail"].startswith("identical")

    def other_logprob(r):  # the same tokens, other numbers
        i = r["loss_mask"].index(1)
        r["generation_logprobs"][i] += 1e-6

    _edit_trajectory(store, "again", 1, other_logprob)
    rows = rows_of()
    assert rows[("trajectory_agreement", 1)]["ok"] and "1 same tokens with other logprobs" in rows[
        ("trajectory_agreement", 1)]["detail"]
    assert rows[("update_agreement", 1)]["detail"].startswith("same tokens, different numbers")

    def other_token(r):
        i = r["loss_mask"].index(1)
        r["token_ids"][i] = (r["token_ids"][i] + 1) % 1000

    _edit_trajectory(store, "again", 1, other_token)
    rows = rows_of()
    t1 = rows[("trajectory_agreement", 1)]
    assert t1["gated"] and not t1["ok"] and t1["rerun"] == 7 / 8, t1
    assert rows[("update_agreement", 1)]["detail"].startswith("different tokens")

    key = checkpoint_key("again", 1) + "/model.safetensors"  # checkpoint 1 one ulp-ish apart
    tensors = load(store.get_bytes(key))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += torch.tensor(1e-3, dtype=tensors[name].dtype)
    store.put_bytes(key, save(tensors))
    rows = rows_of()
    t2 = rows[("trajectory_agreement", 2)]
    assert not t2["gated"] and f"1 of {len(tensors)} tensors differ" in t2["detail"], t2
    md = report_markdown(compare_runs(store, "base", "again"))
    assert "**DRIFT**" in md and "- step 1: different tokens" in md


def _drift(store, run_id: str, step: int, **values):
    from schemas.tables import EVAL_SUMMARY

    row = store.read_stage(run_id, step, "eval_summary").to_pylist()[0]
    store.write_stage(run_id, step, "eval_summary", EVAL_SUMMARY.from_rows([dict(row, **values)]), overwrite=True)


def test_tolerance_is_honest_about_sample_size():
    from flows.reproducibility import Tolerances, _binomial_tol

    # 8 tasks: one task more solved (0 -> 1/8) is noise; 0 -> 1.0 is not.
    assert _binomial_tol(0.0, 0.125, 8, Tolerances()) > 0.125
    assert _binomial_tol(0.0, 1.0, 8, Tolerances()) < 1.0
    # 251 tasks (the benchmark): 3 sigma is ~0.13 near 0.5: 0.50 vs 0.65 is drift, 0.50 vs 0.55 is not.
    assert _binomial_tol(0.5, 0.65, 251, Tolerances()) < 0.15
    assert _binomial_tol(0.5, 0.55, 251, Tolerances()) > 0.05


def test_drift_fails_the_flow_run_visibly(prefect_api, two_copies):
    from flows.reproducibility import ReproducibilityDrift, reproducibility

    _drift(two_copies, "again", 1, pass_at_k=1.0, pass_at_1=1.0)
    with pytest.raises(ReproducibilityDrift, match=r"pass_at_k@1"):
        reproducibility(baseline_run_id="base", rerun_id="again", store_root=two_copies.root)
    report = two_copies.read_stage("again", None, "reproducibility").to_pylist()
    bad = {(r["metric"], r["step"]) for r in report if r["gated"] and not r["ok"]}
    assert ("pass_at_k", 1) in bad and ("pass_at_1", 1) in bad
    runs = prefect_api.api("POST", "/flow_runs/filter", json={"flows": {"name": {"any_": ["reproducibility"]}},
                                                               "sort": "START_TIME_DESC", "limit": 1})
    assert runs[0]["state"]["type"] == "FAILED" and "drifted" in runs[0]["state"]["message"]
    arts = prefect_api.api("POST", "/artifacts/filter", json={"artifacts": {"key": {"any_": ["base-reproducibility"]}}})
    assert arts and "**DRIFT**" in arts[0]["data"]


def test_scheduled_reruns_write_reports(prefect_ui, two_copies):
    """The reproducibility deployment on a 10 s schedule, deployed to the session's work pool: the worker runs
    scheduled flow runs without anyone starting them and each writes the report table and the artifact."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "flows.deployments", "--only", "reproducibility", "--repro-baseline", "base",
           "--repro-rerun-id", "again", "--repro-store", two_copies.root, "--repro-interval", "10"]
    out = subprocess.run(cmd, cwd=REPO, env=prefect_ui.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    dep = prefect_ui.deployment("reproducibility", "reproducibility")
    try:
        assert dep["work_pool_name"] == prefect_ui.pool
        assert dep["schedules"] and dep["schedules"][0]["schedule"]["interval"] == 10

        def completed():
            runs = prefect_ui.flow_runs(dep["id"])
            bad = [r for r in runs if r["state"]["type"] in ("FAILED", "CRASHED")]
            assert not bad, bad[0]["state"]
            return [r for r in runs if r["state"]["type"] == "COMPLETED" and r["auto_scheduled"]]

        done = prefect_ui.wait_for_run(completed, 180, "a scheduled reproducibility run completed")
        assert done[0]["parameters"]["baseline_run_id"] == "base"
        prefect_ui.assert_ran_on_worker(done[0])
        c = [c for c in two_copies.commits("runs/again") if c.stage == "reproducibility"]
        assert c and c[-1].committed_at > t0
        arts = prefect_ui.api("POST", "/artifacts/filter",
                              json={"artifacts": {"flow_run_id": {"any_": [done[0]["id"]]}}})
        assert any("**reproduced**" in (a["data"] or "") for a in arts)
    finally:
        # Pausing deletes its scheduled runs: the session's worker takes no more of them. The deployment
        # stays: a worker that fetched a run of a deleted deployment never frees that run's slot
        # (prefect.workers.base._submit_run returns early), and the session's worker has one slot.
        prefect_ui.api("POST", f"/deployments/{dep['id']}/pause_deployment")


def test_sampling_note_says_whether_both_runs_were_seeded():
    from flows.reproducibility import _sampling_note

    seeded = {"agent.seeded_sampling": True}
    assert "seeded per request" in _sampling_note(seeded, seeded)
    # A baseline made before seeded sampling has no such option: its T > 0 tokens differ by design.
    assert "differs by design" in _sampling_note({}, seeded)
    assert "differs by design" in _sampling_note(seeded, {"agent.seeded_sampling": False})
