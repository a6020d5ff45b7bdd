"""The object store on file:// and on a real S3 API (moto's server on 127.0.0.1)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.manifest import Attempt, RunManifest
from schemas.tables import TRAJECTORIES, TableValidationError
from tasks.storage import (CorruptTableError, StageConflictError, StageNotCommittedError, StorageError, Store,
                           stage_key)
from tests import rows as R


@pytest.fixture(params=["file", "s3"])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


def _trajectories(n=8, **kw):
    return TRAJECTORIES.from_rows([R.trajectory_row(i, **kw) for i in range(n)])


def test_round_trip(store):
    table = _trajectories()
    commit = store.write_stage("run-a", 3, "trajectories", table)
    assert commit.key == "runs/run-a/step-00003/trajectories.parquet" and commit.rows == 8
    back = store.read_stage("run-a", 3, "trajectories")
    assert back.equals(table)
    assert store.stage_committed("run-a", 3, "trajectories")
    assert [c.key for c in store.commits("runs/run-a")] == [commit.key]


def test_read_a_column_subset(file_store):
    table = _trajectories()
    file_store.write_stage("run-c", 1, "trajectories", table)
    back = file_store.read_stage("run-c", 1, "trajectories", columns=["rollout_id", "final_patch"])
    assert back.column_names == ["rollout_id", "final_patch"]
    assert back.equals(table.select(["rollout_id", "final_patch"]))
    with pytest.raises(TableValidationError, match="no_such_column.*column_present"):
        file_store.read_stage("run-c", 1, "trajectories", columns=["rollout_id", "no_such_column"])


def test_layout_is_parquet_zstd(file_store):
    file_store.write_stage("run-a", 1, "trajectories", _trajectories())
    path = os.path.join(file_store.base, stage_key("run-a", 1, "trajectories"))
    meta = pq.ParquetFile(path).metadata
    assert meta.row_group(0).column(0).compression == "ZSTD"


def test_recommit_same_content_is_noop_and_different_is_error(store):
    table = _trajectories()
    first = store.write_stage("run-a", 1, "trajectories", table)
    again = store.write_stage("run-a", 1, "trajectories", table)
    assert again.committed_at == first.committed_at
    other = _trajectories(n=4)
    with pytest.raises(StageConflictError, match="already committed with different content"):
        store.write_stage("run-a", 1, "trajectories", other)
    assert store.read_stage("run-a", 1, "trajectories").num_rows == 8
    store.write_stage("run-a", 1, "trajectories", other, overwrite=True)
    assert store.read_stage("run-a", 1, "trajectories").num_rows == 4


def test_read_refuses_missing_and_uncommitted(store):
    with pytest.raises(StageNotCommittedError, match="is missing"):
        store.read_stage("run-a", 1, "trajectories")
    store.put_bytes(stage_key("run-a", 1, "trajectories"), b"half a parquet file")
    with pytest.raises(StageNotCommittedError, match="written but not committed"):
        store.read_stage("run-a", 1, "trajectories")


def test_write_refuses_schema_violation(store):
    rows = [R.trajectory_row(i) for i in range(3)]
    rows[2]["finish_reason"] = "exploded"
    bad = TRAJECTORIES.from_rows(rows)
    with pytest.raises(TableValidationError) as e:
        store.write_stage("run-a", 1, "trajectories", bad)
    msg = str(e.value)
    assert "trajectories" in msg and "finish_reason" in msg and rows[2]["rollout_id"] in msg
    assert not store.exists(stage_key("run-a", 1, "trajectories"))


def test_read_refuses_schema_violation(file_store):
    # A table committed by something that bypassed validation (an older writer, a hand edit).
    rows = [R.trajectory_row(i) for i in range(3)]
    rows[1]["loss_mask"] = rows[1]["loss_mask"][:-1]
    bad = TRAJECTORIES.from_rows(rows)
    key = stage_key("run-a", 1, "trajectories")
    file_store.write_table = Store.write_table.__get__(file_store)  # keep the real method
    import schemas.tables as st
    orig = st.TableSchema.validate
    try:
        st.TableSchema.validate = lambda self, t, stage=None: t
        file_store.write_table(key, bad)
    finally:
        st.TableSchema.validate = orig
    with pytest.raises(TableValidationError) as e:
        file_store.read_stage("run-a", 1, "trajectories")
    assert "on read" in str(e.value) and "loss_mask" in str(e.value) and rows[1]["rollout_id"] in str(e.value)


def test_unknown_scheme_and_missing_bucket(s3_endpoint):
    with pytest.raises(StorageError, match="unknown URI scheme 'gs://'"):
        Store("gs://bucket/x")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        Store("s3://no-such-bucket/x", endpoint_url=s3_endpoint)


def test_unreachable_endpoint_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with pytest.raises(StorageError, match="cannot reach S3 bucket 'b'"):
        Store("s3://b/x", endpoint_url="http://127.0.0.1:9")


def test_a_flipped_byte_in_a_committed_table_is_an_error(store):
    commit = store.write_stage("run-f", 1, "trajectories", _trajectories())
    data = bytearray(store.get_bytes(commit.key))
    data[len(data) // 2] ^= 0x01  # same length: only the digest can tell
    store.put_bytes(commit.key, bytes(data))
    with pytest.raises(CorruptTableError) as e:
        store.read_stage("run-f", 1, "trajectories")
    import hashlib

    actual = hashlib.sha256(bytes(data)).hexdigest()
    msg = str(e.value)
    assert store.uri(commit.key) in msg and commit.sha256 in msg and actual in msg and isinstance(e.value, StorageError)


@pytest.fixture
def silent_endpoint():
    """An "S3 endpoint" on 127.0.0.1 that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    conns, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:  # the 0.2 s timeout, or the socket closed
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}", conns
    stop.set()
    t.join(5)
    for c in conns:
        c.close()
    srv.close()


@pytest.mark.timeout(90)
def test_silent_endpoint_fails_within_a_minute(monkeypatch, silent_endpoint):
    endpoint, conns = silent_endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        Store("s3://b/x", endpoint_url=endpoint)
    elapsed = time.monotonic() - t0
    assert conns, "the client never connected"
    assert 5 < elapsed < 75, elapsed  # the read timeouts and retries ran, bounded (was 412 s)
    assert f"cannot reach S3 bucket 'b' at {endpoint}" in str(e.value)


@pytest.mark.timeout(60)
def test_refused_endpoint_fails_fast(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=f"cannot reach S3 bucket 'b' at {endpoint}"):
        Store("s3://b/x", endpoint_url=endpoint)
    assert time.monotonic() - t0 < 30


def test_manifest_round_trip(store):
    cfg = {"preset": "smoke", "seed": 1}
    m = RunManifest(run_id="run-m", preset="smoke", config=cfg, config_sha256=RunManifest.config_digest(cfg),
                    attempts=[Attempt(started_at=1.0)])
    store.write_manifest(m)
    assert store.read_manifest("run-m") == m
    assert store.read_manifest("nope") is None


def test_blobs_and_dirs(store, tmp_path):
    uri = store.put_bytes("environments/a.tar.gz", b"abc")
    assert store.get_bytes(uri) == b"abc" and store.get_bytes("environments/a.tar.gz") == b"abc"
    assert store.local_path(uri, cache_dir=tmp_path / "cache").read_bytes() == b"abc"
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"\0\1")
    store.put_dir("models/v1", src)
    out = store.get_dir("models/v1", tmp_path / "out")
    assert (out / "config.json").read_text() == "{}" and (out / "sub" / "w.bin").read_bytes() == b"\0\1"
    with pytest.raises(StorageError, match="no object"):
        store.get_bytes("environments/missing.tar.gz")


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from tasks.storage import Store, COMMIT_SUFFIX
    from schemas.tables import TRAJECTORIES
    from tests import rows as R
    store = Store(sys.argv[1], endpoint_url=sys.argv[2] or None)
    real = store._atomic_write
    def write(path, data):
        if path.endswith(COMMIT_SUFFIX):
            print("DATA_WRITTEN", flush=True)
            time.sleep(60)  # killed here, between the data and its commit marker
        real(path, data)
    store._atomic_write = write
    store.write_stage("run-k", 2, "trajectories", TRAJECTORIES.from_rows([R.trajectory_row(i) for i in range(5)]))
""")


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_sigkill_between_write_and_commit(backend, request, tmp_path):
    if backend == "file":
        root, endpoint = f"file://{tmp_path}/store", ""
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        root = f"s3://{request.getfixturevalue('s3_bucket')}/store"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, root, endpoint], stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout.readline().strip() == "DATA_WRITTEN"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    store = Store(root, endpoint_url=endpoint or None)
    assert store.exists(stage_key("run-k", 2, "trajectories"))  # the data landed ...
    assert not store.stage_committed("run-k", 2, "trajectories")  # ... but is invisible
    with pytest.raises(StageNotCommittedError):
        store.read_stage("run-k", 2, "trajectories")
    table = TRAJECTORIES.from_rows([R.trajectory_row(i) for i in range(5)])
    store.write_stage("run-k", 2, "trajectories", table)  # the next attempt succeeds
    assert store.read_stage("run-k", 2, "trajectories").equals(table)
