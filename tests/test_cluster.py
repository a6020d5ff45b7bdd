"""Past one machine: rollouts and grading on a real two-node Ray cluster (tests/fixtures/ray_cluster.py),
two vLLM CPU servers, and the two faults: a node lost mid-stage, a server killed mid-step.

The end-to-end tests run the smoke preset through `python -m flows.main` with cluster.address set and
the servers as external base URLs, and read the committed tables: every rollout id exactly once per
step, the Ray node and the server of every row. One run has both faults: two steps on both servers, the
second server killed mid step 1 and the worker node mid step 2 (both are then gone: it is the last
reader of the cluster and of the second server).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures.smoke import REPO, flow_env, main_command, smoke_overrides


# -- fast: configuration and the managed servers -----------------------------------------------
def test_cluster_section_defaults_to_in_process():
    from schemas.config import ClusterConfig, RunConfig
    from schemas.presets import ConfigError, load_config

    assert RunConfig().cluster.address is None and RunConfig().inference.num_servers == 1
    cfg = load_config("smoke", ["cluster.address=127.0.0.1:6379", "cluster.max_task_retries=1",
                                "inference.num_servers=2"])
    assert cfg.cluster == ClusterConfig(address="127.0.0.1:6379", max_task_retries=1)
    for bad in ("cluster.grading_cpus=0", "cluster.max_task_retries=true", "cluster.adress=x",
                "inference.num_servers=0"):
        with pytest.raises(ConfigError):
            load_config("smoke", [bad])


def test_managed_mode_starts_num_servers_and_the_client_spreads_over_them(monkeypatch, tmp_path):
    import tasks.inference as inference
    from flows.runtime import RunContext
    from schemas.presets import load_config

    started, stopped = [], []

    class FakeServer:
        def __init__(self, model_dir, cfg, log_dir=None):
            self.base_url, self.log_path = f"http://127.0.0.1:{9000 + len(started)}", "log"
            self.model_dir = pathlib.Path(model_dir).resolve()

        def launch(self):
            started.append(self)
            return self

        def wait_ready(self):
            return self

        def start(self):
            return self.launch().wait_ready()

        def stop(self, timeout=30.0):
            stopped.append(self)

    class Tok:
        def convert_tokens_to_ids(self, token):
            return 2

    monkeypatch.setattr(inference, "VLLMServer", FakeServer)
    ctx = RunContext(cfg=load_config("smoke", ["inference.num_servers=3"]), store=None, run_id="t",
                     workdir=tmp_path, tokenizer=Tok())
    try:
        ctx.start_policy(tmp_path, 0, trainer=False)
        assert len(started) == 3 and ctx.client.live_urls == [s.base_url for s in started]
    finally:
        ctx.close()
    assert stopped == started


# -- on the two-node cluster -------------------------------------------------------------------
def _lost_on_purpose(task_row, patch, cfg, store):
    os._exit(1)  # the worker process dies, as on a lost node


def _grade_here(task_row, patch, cfg, store):
    from tasks.grading.grader import GradeResult

    time.sleep(0.5)  # long enough for the gradings to spread over both nodes
    return GradeResult(reward=1.0 if patch == "good" else 0.0, grading_status="graded", patch_applied=True)


@pytest.mark.slow
def test_gradings_spread_over_both_nodes_and_a_lost_one_is_an_infra_error(ray_cluster):
    import ray
    import ray.cloudpickle

    from schemas.config import ClusterConfig, SandboxConfig
    from tasks.cluster import RayGrading, episode_runners

    # The fake graders above live in this test module, which the cluster's workers cannot import.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    nodes = ray_cluster.node_ids()
    cluster = ClusterConfig(address=ray_cluster.address, grading_cpus=0.25, max_task_retries=0)
    try:
        pool = RayGrading(cluster, SandboxConfig(), store=None)
        futures = [pool.submit(_grade_here, {"instance_id": f"t{i}"}, "good" if i % 2 else "bad", SandboxConfig())
                   for i in range(8)]
        results = [f.result(timeout=120) for f in futures]
        assert [r.reward for r in results] == [0.0, 1.0] * 4
        assert {r.node for r in results} == set(nodes.values())
        lost = pool.submit(_lost_on_purpose, {"instance_id": "x"}, "", SandboxConfig()).result(timeout=120)
        assert lost.grading_status == "infra_error" and lost.reward is None and "ray:" in lost.error
        # Work no node can take is refused up front (Ray would keep it pending forever).
        with pytest.raises(RuntimeError, match="can take a grading.*'CPU': 2.0"):
            RayGrading(ClusterConfig(address=ray_cluster.address, grading_cpus=2.0), SandboxConfig(), store=None)
        with pytest.raises(RuntimeError, match="can run episodes.*sandbox_docker"):
            episode_runners(ClusterConfig(address=ray_cluster.address, sandbox_resources=True), "docker")
    finally:
        ray.shutdown()


def _wait_for(log, marker: str, proc, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while marker not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"run ended before {marker!r}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout:.0f} s"
        time.sleep(0.5)


def _run(run_id: str, overrides: dict, tmp_path, api, during=None) -> str:
    """The smoke preset through flows.main, reporting to `api`; `during(log, proc)` runs while it does (the fault)."""
    log = tmp_path / f"{run_id}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(main_command(run_id, overrides), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=flow_env(tmp_path / f"prefect-{run_id}", api))
        try:
            if during is not None:
                during(log, proc)
            proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode in (0, 1), f"run failed (exit {proc.returncode}):\n{text[-6000:]}"
    return text


def _tables(run_id: str, overrides: dict) -> tuple:
    """Per step: trajectories and rewards rows, each rollout id once, the same ids in both."""
    from schemas.presets import load_config
    from tasks.storage import Store

    cfg = load_config("smoke", overrides)
    store = Store.from_config(cfg.storage)
    steps = {}
    for step in range(1, cfg.max_steps + 1):
        traj = store.read_stage(run_id, step, "trajectories").to_pylist()
        rew = store.read_stage(run_id, step, "rewards").to_pylist()
        ids = [r["rollout_id"] for r in traj]
        assert len(ids) == len(set(ids)) == cfg.grpo.global_batch_size, (step, len(ids), len(set(ids)))
        assert sorted(r["rollout_id"] for r in rew) == sorted(ids), step
        steps[step] = (traj, rew)
    return cfg, store, steps


@pytest.fixture(scope="module")
def second_server(smoke_server, tmp_path_factory):
    """A second vLLM CPU server of the smoke base (data-parallel generation with smoke_server)."""
    from tasks.inference import VLLMServer

    server = VLLMServer(smoke_server.model_dir, smoke_server.cfg, log_dir=tmp_path_factory.mktemp("vllm-2"))
    server.start()
    yield server
    server.stop()


def _overrides(ray_cluster, servers, **extra) -> dict:
    # Two validation tasks: the in-process smoke test covers the full evaluation; here it is one more
    # dispatch over the cluster, kept short.
    return smoke_overrides(**{"inference.mode": "external", "inference.base_urls": [s.base_url for s in servers],
                              "cluster.address": ray_cluster.address,
                              "cluster.grading_cpus": 0.5, "eval.max_tasks": 2, **extra})


@pytest.mark.slow
def test_smoke_run_on_two_nodes_and_two_servers_survives_a_server_and_a_node_lost(
        ray_cluster, smoke_server, second_server, session_api, tmp_path):
    """Both faults in one run: the second server killed mid step 1, the worker node killed mid step 2's
    rollouts (while one of its episodes runs)."""
    import re

    from tasks.rollout import rollout_id

    run_id = f"test-cluster-{int(time.time())}"
    overrides = _overrides(ray_cluster, [smoke_server, second_server])
    nodes = ray_cluster.node_ids()

    def kill_a_server_then_a_node(log, proc):
        _wait_for(log, "step 1 trajectories: 4/", proc)  # requests in flight on both servers
        os.killpg(second_server.pid, signal.SIGKILL)
        _wait_for(log, "step 2 trajectories: start", proc)
        deadline = time.monotonic() + 300
        # An episode is running on the worker node: its runner has started a sandbox (a child process).
        while not [c for pid in ray_cluster.worker_task_pids("EpisodeRunner") for c in ray_cluster.children(pid)]:
            assert proc.poll() is None and time.monotonic() < deadline, "no episode ever ran on the worker node"
            time.sleep(0.02)
        ray_cluster.kill_worker()

    log = _run(run_id, overrides, tmp_path, session_api, during=kill_a_server_then_a_node)
    assert f"on the Ray cluster at {ray_cluster.address}" in log
    cfg, store, steps = _tables(run_id, overrides)
    assert cfg.max_steps == 2
    traj = [r for t, _ in steps.values() for r in t]
    rew = [r for _, w in steps.values() for r in w]
    assert {r["node"] for r in steps[1][0]} == set(nodes.values()) and {r["node"] for r in rew} <= set(nodes.values())
    # The server: before the kill both generated; the failover and the weight sync left the dead one out.
    assert {u for r in steps[1][0] for u in r["servers"] or []} == {smoke_server.base_url, second_server.base_url}
    assert {u for r in steps[2][0] for u in r["servers"] or []} == {smoke_server.base_url}
    assert not [r for r in traj if r["finish_reason"] == "infra_error"]
    # Synchronous or one step old (grpo.max_trajectory_age): the versions the servers reported.
    for step, (t, _) in steps.items():
        assert {r["policy_version"] for r in t} <= {step - 1, max(0, step - 2)}, step
    # The node: the driver names each episode of the stage it had in flight on the lost node; each ran again
    # on the head, and its row is there once (_tables), with no error. (Later stages may still try the
    # node until Ray marks it dead, and are redone the same way.)
    # (Step 2's rollouts overlap step 1's update and evaluation, grpo.async_rollouts: read up to their end.)
    stage = log[log.index("step 2 trajectories: start"):log.index("step 2 trajectories: 8/8 episodes")]
    redone = {rollout_id(run_id, 2, instance, int(sample)) for instance, sample in re.findall(
        rf"episode (\S+)/(\d+): its runner on node {nodes['worker'][:12]} is lost", stage)}
    assert redone, f"no episode was in flight on the worker node when it died:\n{log[-4000:]}"
    by_id = {r["rollout_id"]: r for r in steps[2][0]}
    assert redone <= set(by_id) and {by_id[i]["node"] for i in redone} == {nodes["head"]}
    assert not [r for r in traj + rew if (r["error"] or "").startswith(("ray:", "infra_error: ray:"))]
    assert all(r["node"] != nodes["worker"] for r in steps[2][1])
