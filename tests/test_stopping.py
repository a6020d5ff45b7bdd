"""Stopping a run: SIGINT and SIGTERM stop it within seconds with the manifest saying so, an attempt
killed outright reads `killed`, and an error a rerun cannot fix is one line and exit 2.

The stopping cases are one real smoke run (the session's shared vLLM server) stopped three times:
SIGINT mid-rollouts, resumed and SIGTERM to its process group mid-rollouts, resumed and SIGKILL."""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.fixtures.smoke import REPO, flow_env, main_command, smoke_overrides

STOP_S = 15.0  # "within a few seconds", with room for a busy 2-core machine
# Training or evaluation episodes, both the same rollout stage: a resumed attempt may have only a few
# training episodes left, which can all finish between two progress lines.
MID_ROLLOUTS = re.compile(r"step (\d+) (?:eval_)?trajectories: (\d+)/(\d+) episodes")


def _stop_mid_rollouts(cmd, env, sig: int, timeout: float = 1200) -> dict:
    """Start the flow in a process group of its own; at the first rollout progress line with
    episodes still to go, send `sig` to the group. Returns the exit code, the seconds from the
    signal to the exit, the output and the signal's wall time."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    seen, deadline, sent = [], time.monotonic() + timeout, None
    try:
        for line in proc.stdout:
            seen.append(line)
            m = MID_ROLLOUTS.search(line)
            if m and int(m[2]) < int(m[3]):
                sent, t0 = time.time(), time.monotonic()
                os.killpg(proc.pid, sig)
                break
            if time.monotonic() > deadline:
                break
        assert sent is not None, f"never saw rollouts in progress:\n{''.join(seen)[-4000:]}"
        if sig == signal.SIGKILL:
            proc.wait()
        else:
            proc.wait(timeout=300)
        took = time.monotonic() - t0
        seen.append(proc.stdout.read())
        return {"rc": proc.returncode, "seconds": took, "out": "".join(seen), "sent_at": sent, "pgid": proc.pid}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _group_gone(pgid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def stopped_run(smoke_server, tmp_path_factory):
    from tasks.storage import Store

    run_id = f"test-stop-{int(time.time())}"
    overrides = smoke_overrides(**{"inference.mode": "external", "inference.base_urls": [smoke_server.base_url],
                                   "agent.partial_flush_s": 0, "grpo.async_rollouts": False})
    cmd, env = main_command(run_id, overrides), flow_env(tmp_path_factory.mktemp("prefect-home"))
    store = Store(overrides["storage"]["root"])
    stops = {}
    for name, sig in (("SIGINT", signal.SIGINT), ("SIGTERM", signal.SIGTERM), ("SIGKILL", signal.SIGKILL)):
        stops[name] = _stop_mid_rollouts(cmd, env, sig)
        stops[name]["group_gone"] = _group_gone(stops[name]["pgid"])
        stops[name]["commits"] = store.commits(f"runs/{run_id}")
        print(f"{name} to the process group mid-rollouts: exit {stops[name]['rc']} "
              f"{stops[name]['seconds']:.1f} s after the signal")
    return {"run_id": run_id, "store": store, "stops": stops}


def _check_stopped(stopped_run, name: str, index: int):
    stop = stopped_run["stops"][name]
    assert stop["rc"] == 128 + signal.Signals[name].value, stop["out"][-4000:]
    assert stop["seconds"] < STOP_S, f"{name}: {stop['seconds']:.1f} s to stop\n{stop['out'][-4000:]}"
    assert f"stopped by {name}" in stop["out"] and "Traceback" not in stop["out"], stop["out"][-4000:]
    assert stop["group_gone"], "processes of the stopped run's group are still alive"
    store, run_id = stopped_run["store"], stopped_run["run_id"]
    # Nothing committed after the stop had begun, and every commit reads back whole (length + sha256).
    late = [c.key for c in stop["commits"] if c.committed_at > stop["sent_at"] + 1.0]
    assert not late, f"committed after {name}: {late}"
    for c in stop["commits"]:
        store.read_table(c.key, stage=c.stage)
    attempt = store.read_manifest(run_id).attempts[index]
    assert (attempt.status, attempt.reason) == ("stopped", f"stopped: {name}")
    assert attempt.ended_at is not None and attempt.ended_at - stop["sent_at"] < STOP_S


@pytest.mark.slow
def test_sigint_mid_rollouts_stops_within_seconds(stopped_run):
    _check_stopped(stopped_run, "SIGINT", 0)


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_within_seconds(stopped_run):
    _check_stopped(stopped_run, "SIGTERM", 1)


@pytest.mark.slow
def test_sigkilled_attempt_reads_killed(stopped_run):
    store, run_id = stopped_run["store"], stopped_run["run_id"]
    assert stopped_run["stops"]["SIGKILL"]["rc"] == -signal.SIGKILL
    manifest = store.read_manifest(run_id)
    assert [a.status for a in manifest.attempts] == ["stopped", "stopped", "killed"]
    assert manifest.status == "killed" and "ended without a word" in manifest.attempts[2].reason
    assert manifest.attempts[1].resumed_at_step == 1 and manifest.attempts[2].pid is not None
    # The stored manifest still says running (the killed process could not write): only a reader decides.
    assert store.get_json(f"runs/{run_id}/manifest.json")["attempts"][2]["status"] == "running"


def test_an_attempt_is_killed_only_when_its_owner_is_gone(tmp_path):
    from schemas.manifest import Attempt, RunManifest
    from tasks.storage import Store
    from tasks.supervise import owner

    store = Store(f"file://{tmp_path}")
    gone = subprocess.Popen(["true"])
    gone.wait()
    mine = owner()
    attempts = [Attempt(started_at=1.0, **{**mine, "pid": gone.pid}),  # its process exited
                Attempt(started_at=2.0, **{**mine, "pid_start": mine["pid_start"] + 1}),  # the pid was reused
                Attempt(started_at=3.0, **{**mine, "host": "elsewhere", "pid": gone.pid}),  # cannot be checked
                Attempt(started_at=4.0, **mine)]  # alive: this process
    store.write_manifest(RunManifest(run_id="r", preset="smoke", config={}, config_sha256="x", attempts=attempts))
    read = store.read_manifest("r")
    assert [a.status for a in read.attempts] == ["killed", "killed", "running", "running"]
    assert read.status == "running"
    store.write_manifest(RunManifest(run_id="r2", preset="smoke", config={}, config_sha256="x", attempts=attempts[:1]))
    assert store.read_manifest("r2").status == "killed"


PERMANENT = {
    "unsupported store scheme": (["storage.root=gs://bucket/runs"], "storage.root"),
    "r2e without a path": (["dataset.source=r2e"], "dataset.path"),
    "missing model directory": (["model.path=/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
}


@pytest.mark.parametrize("case", sorted(PERMANENT))
def test_an_error_a_rerun_cannot_fix_is_one_line_and_exit_2(case, tmp_path):
    overrides, names = PERMANENT[case]
    store = [] if names == "storage.root" else [f"storage.root=file://{tmp_path / 'store'}"]
    proc = subprocess.run(main_command("never-runs", {}) + store + overrides, cwd=REPO, capture_output=True,
                          text=True, env=flow_env(tmp_path), timeout=300)
    out = proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1 and names in errors[0], out[-3000:]
    assert "Traceback" not in out and "resume" not in out and "rerun" not in out, out[-3000:]


def test_errors_a_rerun_cannot_fix_are_one_type():
    from schemas.presets import ConfigError, PermanentError
    from tasks.dataset.r2e import DatasetError
    from tasks.policy.base import BaseCheckpointError
    from tasks.policy.model import MissingModelFileError
    from tasks.storage import RunIdError, StorageError, Store, StoreRootError

    for cls in (ConfigError, DatasetError, BaseCheckpointError, MissingModelFileError, RunIdError, StoreRootError):
        assert issubclass(cls, PermanentError), cls
    with pytest.raises(StoreRootError, match="gs://"):
        Store("gs://bucket/x")
    assert not issubclass(StorageError, PermanentError)  # an unreachable bucket may answer next time
