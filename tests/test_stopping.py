"""Stopping a run: SIGINT and SIGTERM stop it within seconds with the manifest saying so, an attempt
killed outright reads `killed`, and an error a rerun cannot fix is one line and exit 2.

The stopping cases read the session's interrupted run (tests/fixtures/interrupted_run.py): SIGINT to its
process group in step 1's rollouts, SIGKILL in the resumed rollouts and at the update, SIGTERM to the
group in step 2's evaluation."""

import re
import signal
import subprocess

import pytest

from tests.fixtures.smoke import REPO, flow_env, main_command

STOP_S = 15.0  # "within a few seconds", with room for a busy 2-core machine


def _check_stopped(interrupted_run, name: str, index: int):
    stop = interrupted_run["stops"][name]
    assert stop["rc"] == 128 + signal.Signals[name].value, stop["out"][-4000:]
    assert stop["seconds"] < STOP_S, f"{name}: {stop['seconds']:.1f} s to stop\n{stop['out'][-4000:]}"
    assert f"stopped by {name}" in stop["out"] and "Traceback" not in stop["out"], stop["out"][-4000:]
    assert stop["group_gone"], "processes of the stopped run's group are still alive"
    store = interrupted_run["store"]
    # Nothing committed after the stop had begun, and every commit reads back whole (length + sha256).
    late = [c.key for c in stop["commits"] if c.committed_at > stop["sent_at"] + 1.0]
    assert not late, f"committed after {name}: {late}"
    for c in stop["commits"]:
        store.read_table(c.key, stage=c.stage)
    attempt = stop["manifest"].attempts[index]
    assert (attempt.status, attempt.reason) == ("stopped", f"stopped: {name}")
    assert attempt.ended_at is not None and attempt.ended_at - stop["sent_at"] < STOP_S


@pytest.mark.slow
def test_sigint_mid_rollouts_stops_within_seconds(interrupted_run):
    assert interrupted_run["stops"]["SIGINT"]["at"] is not None  # sent while step 1's episodes were running
    _check_stopped(interrupted_run, "SIGINT", 0)


@pytest.mark.slow
def test_sigterm_to_the_process_group_mid_evaluation_stops_within_seconds(interrupted_run):
    assert "step 2 evaluation: start" in interrupted_run["stops"]["SIGTERM"]["out"]
    _check_stopped(interrupted_run, "SIGTERM", 3)


@pytest.mark.slow
def test_sigkilled_attempt_reads_killed(interrupted_run):
    stop = interrupted_run["stops"]["SIGKILL-rollouts"]
    assert stop["rc"] == -signal.SIGKILL and stop["at"] is not None
    manifest = stop["manifest"]
    assert [a.status for a in manifest.attempts] == ["stopped", "killed"]
    assert manifest.status == "killed" and "ended without a word" in manifest.attempts[1].reason
    assert manifest.attempts[1].resumed_at_step == 1 and manifest.attempts[1].pid is not None
    # The stored manifest still says running (the killed process could not write): only a reader decides.
    assert stop["stored_manifest"]["attempts"][1]["status"] == "running"


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
    # found by prepare, after the run launched its vLLM server on the base: that server is stopped
    "a base built for another dataset": (["model.path=models/mini-base"], "models/mini-base"),
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
    launched = re.search(r"vLLM server launched at http://\S+:(\d+),", proc.stdout)
    assert bool(launched) == (case == "a base built for another dataset"), out[-3000:]
    if launched:
        port = launched[1]
        assert not subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True).stdout.split()


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
