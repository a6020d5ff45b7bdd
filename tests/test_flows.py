"""The benchmark end to end: a real smoke run through Prefect, resume after SIGKILL, the MLPerf log."""

import json
import subprocess
import time

import pytest

from schemas.presets import ConfigError, load_config, load_recipe
from schemas.recipe import stages
from tasks.mlperf import check, read_log_times
from tests.fixtures.smoke import REPO, flow_env, main_command, smoke_overrides

STAGES = ("trajectories", "rewards", "advantages", "eval_trajectories", "eval_rewards", "eval_samples",
          "eval_summary")


def test_invalid_config_fails_before_anything_starts(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(main_command("never", {"grpo": {"generations_per_prompt": 1}}), cwd=REPO,
                          capture_output=True, text=True, env=flow_env(tmp_path), timeout=120)
    assert proc.returncode == 2 and "grpo.generations_per_prompt" in proc.stderr
    assert time.monotonic() - t0 < 60
    with pytest.raises(ConfigError, match="agent.max_turns"):
        load_config("smoke", ["agent.max_turns=0"])


def test_smoke_train_end_to_end(smoke_train_run):
    store, run_id, cfg = smoke_train_run["store"], smoke_train_run["run_id"], smoke_train_run["config"]
    manifest = store.read_manifest(run_id)
    assert manifest.status in ("succeeded", "target_not_reached") and len(manifest.attempts) == 1
    for step in range(1, cfg.max_steps + 1):
        for stage in STAGES:
            table = store.read_stage(run_id, step, stage)  # committed and valid on read
            assert table.num_rows > 0, (step, stage)
        assert store.exists(f"runs/{run_id}/checkpoints/step-{step:05d}.commit")
        traj = store.read_stage(run_id, step, "trajectories")
        assert traj.num_rows == cfg.grpo.global_batch_size
        # the policy version on every trajectory: on-policy or at most max_trajectory_age old
        versions = traj["policy_version"].to_pylist()
        assert all(step - 1 - cfg.grpo.max_trajectory_age <= v <= step - 1 for v in versions), versions
        summary = store.read_stage(run_id, step, "eval_summary").to_pylist()[0]
        assert summary["num_tasks"] == cfg.dataset.num_validation and summary["k"] == 4
        assert summary["samples_count"] == step * cfg.grpo.global_batch_size
    times = read_log_times(store.get_bytes(f"runs/{run_id}/mlperf.log").decode())
    assert times["run_seconds"] > 0 and len(times["evals"]) == cfg.max_steps
    assert "run summary" in smoke_train_run["log"] and "time to train" in smoke_train_run["log"]


def test_the_server_launched_at_the_start_is_the_one_the_run_uses(smoke_train_run):
    """make run's shape: the vLLM server launched in the run's first seconds (it loads while Prefect's API
    starts and prepare runs) is adopted by the run; no other server is started, and it is gone after."""
    import re

    text = smoke_train_run["log"]
    launched = re.search(r"vLLM server launched at (\S+), loading \S+ while the run prepares \(log (\S+)\)", text)
    assert launched, text[-4000:]
    assert text.index(launched[0]) < text.index("prepare: tasks table")  # before prepare's work, not after it
    assert f"using the server launched at the start ({launched[1]})" in text
    assert re.search(rf"vLLM serving policy v0 at {re.escape(launched[1])} ", text), text[-4000:]
    assert "starting 1 vLLM server" not in text
    logs = list((REPO / ".rlvr" / "work" / smoke_train_run["run_id"] / "logs").glob("vllm-*.log"))
    assert [str(p) for p in logs] == [launched[2]]  # the one server of the run
    port = launched[1].rsplit(":", 1)[1]
    assert not subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True).stdout.split()


def test_mlperf_log_of_a_real_run_passes_the_checker_except_the_target(smoke_train_run, tmp_path):
    log = tmp_path / "smoke.log"
    log.write_bytes(smoke_train_run["store"].get_bytes(f"runs/{smoke_train_run['run_id']}/mlperf.log"))
    ok, out = check(str(log))
    best = max(v for _, v in read_log_times(log.read_text())["evals"])
    if best > 0.69:
        assert ok, out
    else:
        # A smoke run's policy is far from the target: the only complaint may be the accuracy target.
        errors = [ln for ln in out.splitlines() if "ERROR" in ln or "FAIL" in ln.upper()]
        assert errors and all("0.69" in ln or "ATLEAST_ONE_CHECK" in ln or "eval_accuracy" in ln
                              or "FAILED" in ln for ln in errors), out


def test_rerun_of_a_finished_run_does_nothing(smoke_train_run, tmp_path):
    store, run_id = smoke_train_run["store"], smoke_train_run["run_id"]
    before = {c.key: c.committed_at for c in store.commits(f"runs/{run_id}")}
    proc = subprocess.run(main_command(run_id, smoke_train_run["overrides"]), cwd=REPO, capture_output=True, text=True,
                          env=flow_env(tmp_path), timeout=600)
    assert "already finished" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vLLM server launched" not in proc.stdout  # nothing to serve: no server loads
    assert {c.key: c.committed_at for c in store.commits(f"runs/{run_id}")} == before


@pytest.mark.slow
def test_resume_after_stops_mid_rollout_mid_update_mid_eval(interrupted_run, smoke_train_run):
    """The session's interrupted run (tests/fixtures/interrupted_run.py): SIGINT and SIGKILL in step 1's
    rollouts, SIGKILL at its update, SIGTERM in step 2's evaluation, then resumed to its end."""
    store, run_id, stops = interrupted_run["store"], interrupted_run["run_id"], interrupted_run["stops"]
    resume = interrupted_run["resume"]
    assert resume["rc"] in (0, 1), resume["out"][-6000:]
    partial = stops["SIGINT"]["partial"]
    # every episode reported finished before the stop was committed by it
    assert len(partial) >= stops["SIGINT"]["at"] > 0

    manifest = store.read_manifest(run_id)
    assert manifest.status in ("succeeded", "target_not_reached")
    # each stopped or killed attempt is recorded as such by the attempt that read the manifest after it
    assert [a.status for a in manifest.attempts[:4]] == ["stopped", "killed", "killed", "stopped"]
    assert [a.resumed_at_step for a in manifest.attempts] == [0, 1, 1, 1, 3]
    final = {c.key: (c.committed_at, c.sha256) for c in store.commits(f"runs/{run_id}")}
    for name, stop in stops.items():  # nothing committed before a stop was redone after it
        for c in stop["commits"]:
            if "_partial" not in c.key:
                assert final[c.key] == (c.committed_at, c.sha256), (name, c.key)
    # no trajectory lost: every episode committed by the first stop is in the final table, unchanged
    traj = {r["rollout_id"]: r for r in store.read_stage(run_id, 1, "trajectories").to_pylist()}
    for row in partial.values():
        assert traj[row["rollout_id"]]["token_ids"] == row["token_ids"]
    # Seeded sampling: this run, stopped and resumed mid-rollout, sampled the session smoke run's step 1 token
    # for token (the same base, run seed and batch; request seeds leave out the run id).
    other = {(r["instance_id"], r["sample_index"]): r["token_ids"]
             for r in store.read_stage(smoke_train_run["run_id"], 1, "trajectories").to_pylist()}
    mine = {(r["instance_id"], r["sample_index"]): r["token_ids"] for r in traj.values()}
    assert mine.keys() == other.keys() and all(mine[k] == other[k] for k in mine), \
        sum(mine[k] != other.get(k) for k in mine)
    log = store.get_bytes(f"runs/{run_id}/mlperf.log").decode()
    keys = [json.loads(ln[9:])["key"] for ln in log.splitlines() if ln.startswith(":::MLLOG")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
    assert keys.count("block_start") == keys.count("block_stop") == 2  # a redone step is logged once
    # every stage's time counts once, whichever attempt ran it
    for step in (1, 2):
        times = store.get_json(f"runs/{run_id}/step-{step:05d}/timings.json")
        assert all(times[s] > 0 for s in ("rollouts", "grading", "advantages", "update", "weight_sync")), times


def test_prepare_builds_the_sandbox_image_a_fresh_machine_lacks(monkeypatch):
    # A fresh clone has no rootfs: prepare must build it (the tests' fixtures build it too,
    # which once hid that `make run` did not).
    from flows import prepare
    from tasks.sandbox import image

    calls = []
    monkeypatch.setattr(image, "ensure_image", lambda docker_too: calls.append(docker_too) or "/rootfs")
    prepare.sandbox_image.fn(load_config("mini"))
    prepare.sandbox_image.fn(load_config("mini", ["sandbox.backend=docker"]))
    prepare.sandbox_image.fn(load_config("qwen35_397b_grpo"))  # R2E tasks bring their own images
    assert calls == [False, True]


def test_a_rootfs_build_in_the_background_fails_prepare_with_its_reason(tmp_path, monkeypatch, capfd):
    # `make run` starts the build before Prefect's API (flows/main.py); prepare's sandbox_image
    # waits for it: its failure must fail prepare as a build in place would, and a rerun builds.
    from flows import prepare
    from tasks.sandbox import image

    script = tmp_path / "build-rootfs.sh"
    script.write_text("sleep 1; echo 'debootstrap: cannot reach the mirror' >&2; exit 3\n")
    monkeypatch.setattr(image, "BUILD_SCRIPT", script)
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(image, "_background", None)
    t0 = time.monotonic()
    image.start_rootfs_build()
    assert time.monotonic() - t0 < 0.5  # the caller goes on while it builds
    with pytest.raises(subprocess.CalledProcessError, match="exit status 3"):
        prepare.sandbox_image.fn(load_config("mini"))
    assert "cannot reach the mirror" in capfd.readouterr().err
    (tmp_path / "cache" / "sandbox" / "rootfs.tmp-1").mkdir()  # a build killed outright
    script.write_text('mkdir "$1"\n')
    monkeypatch.setattr(image, "_background", None)
    image.start_rootfs_build()
    prepare.sandbox_image.fn(load_config("mini"))
    assert image.rootfs_ready() and not list((tmp_path / "cache" / "sandbox").glob("rootfs.tmp-*"))


def test_warm_start_can_leave_the_rl_tasks_unseen(smoke_prepared):
    # sft.demonstrations_per_task=0: demonstrations come from the generated pool only, so no task
    # GRPO trains on was fine-tuned on (GRPO on fine-tuned prompts learned instances, README).
    from flows.prepare import demonstrations
    from flows.runtime import load_tasks
    from tasks.storage import Store

    cfg = load_config("smoke", smoke_overrides())
    first = stages(load_recipe("smoke", {"demonstrations_per_task": 0, "pool_tasks": 4}))[0]
    store = Store.from_config(cfg.storage)
    key = demonstrations.fn(cfg, store, smoke_prepared["tasks"], smoke_prepared["model"], first.demonstrations)
    assert key != smoke_prepared["demonstrations"]
    demos = store.read_table(key, columns=["instance_id", "finish_reason"], stage="demonstrations").to_pylist()
    benchmark = load_tasks(store, smoke_prepared["tasks"])
    assert 0 < len(demos) <= 4 and all(d["finish_reason"] == "submitted" for d in demos)
    assert not {d["instance_id"] for d in demos} & set(benchmark)
    with pytest.raises(ConfigError, match="sft.demonstrations_per_task=0 needs sft.pool_tasks"):
        load_recipe("smoke", {"demonstrations_per_task": 0})


def test_warm_start_chain_restart_cycles_then_the_habit_phase(smoke_prepared):
    # The mini preset's base: warm start -> restart cycles (fresh AdamW each, one cosine of
    # max_steps / cosine_cycles steps) -> habit phase on pool demonstrations that edit unread code.
    import sys

    from flows.prepare import _local_model, demonstrations_key, tokenizer_digest, warm_start_chain
    from flows.runtime import load_tasks
    from tasks.storage import Store

    sys.path.insert(0, str(REPO / "research"))
    from first_action import first_action

    # Steps only (the smoke recipe's 15-s budget cut stages short on a loaded machine).
    sft = {"pool_tasks": 4, "max_steps": 8, "minutes": None, "cosine_decay": True, "cosine_cycles": 2,
           "restart_cycles": 1, "habit_steps": 3, "habit_lr": 2e-4, "habit_blind_edits": 1.0}
    cfg = load_config("smoke", smoke_overrides())
    chain = stages(load_recipe("smoke", sft))
    assert [s.name for s in chain] == ["warm start", "restart cycle 1/1", "habit phase"]
    store = Store.from_config(cfg.storage)
    args = (smoke_prepared["tasks"], smoke_prepared["model"], chain)
    key = warm_start_chain(cfg, store, *args)
    habit = store.get_json(key + ".commit")
    cycle = store.get_json(habit["from"] + ".commit")
    plain = store.get_json(cycle["from"] + ".commit")
    assert (habit["stage"], cycle["stage"], plain["stage"]) == ("habit phase", "restart cycle 1/1", "warm start")
    assert plain["from"] == smoke_prepared["model"] and plain["sft"]["max_steps"] == 8
    assert cycle["demonstrations"] == plain["demonstrations"] == demonstrations_key(
        smoke_prepared["tasks"], tokenizer_digest(_local_model(cfg, store, smoke_prepared["model"])),
        cfg.agent.prompt_style, chain[0].demonstrations)
    assert (cycle["sft"]["max_steps"], cycle["sft"]["cosine_cycles"], cycle["metrics"]["steps"]) == (4, 1, 4)
    assert (habit["sft"]["lr"], habit["metrics"]["steps"]) == (2e-4, 3)
    # The habit phase's demonstrations: pool tasks only, every one an edit straight away.
    demos = store.read_table(habit["demonstrations"], columns=["instance_id", "messages"],
                             stage="demonstrations").to_pylist()
    assert demos and not {d["instance_id"] for d in demos} & set(load_tasks(store, smoke_prepared["tasks"]))
    assert {first_action(d["messages"]) for d in demos} == {"str_replace"}
    # Cached: a second call trains nothing and names the same checkpoint.
    assert warm_start_chain(cfg, store, *args) == key
    assert store.get_json(key + ".commit")["built_at"] == habit["built_at"]
