"""The object store every stage reads and writes through (fsspec: file:// or s3://).

Layout under the store's root:
    runs/{run_id}/manifest.json
    runs/{run_id}/step-{k:05d}/{stage}.parquet            the table (zstd)
    runs/{run_id}/step-{k:05d}/{stage}.parquet.commit     its commit marker (JSON)
    datasets/..., models/..., environments/...            blobs and run-independent tables

A table is visible only once its commit marker exists, and the marker is written
after the data, so a process killed between the two leaves the stage invisible
and the next attempt simply writes it again. Committing the same content twice
is a no-op; different content is an error unless `overwrite=True`. A read checks
the bytes against the marker's length and sha256 (CorruptTableError otherwise).
Run ids name directories (`runs/<id>/` here, `<work>/<id>/` on disk): `check_run_id`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import re
import time
import uuid
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import STORE_SCHEMES as SCHEMES
from schemas.manifest import RunManifest
from schemas.presets import PermanentError
from schemas.tables import SCHEMAS, TableValidationError, schema_for
from tasks.supervise import owner_gone

COMMIT_SUFFIX = ".commit"
# A silent S3 endpoint fails in S3FS_RETRIES x S3_ATTEMPTS x S3_READ_TIMEOUT_S (~40 s), not botocore's ~7 min.
S3_CONNECT_TIMEOUT_S, S3_READ_TIMEOUT_S, S3_ATTEMPTS, S3FS_RETRIES = 5, 10, 2, 2
RUN_ID_MAX = 128
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class StorageError(RuntimeError):
    """The store itself is unusable or a stage is in the wrong state: the message says which."""


class StageNotCommittedError(StorageError):
    pass


class StageConflictError(StorageError):
    pass


class CorruptTableError(StorageError):
    """A committed table's bytes no longer match the sha256 its commit marker recorded."""


class StoreRootError(StorageError, PermanentError):
    """The store root names a scheme the store does not support."""


class RunIdError(PermanentError, ValueError):
    """A run id that is not one plain path component (it names directories in the store and the work dir)."""


def check_run_id(run_id: str) -> str:
    """The run id itself, or RunIdError: it becomes `runs/<id>/` in the store and `<work>/<id>/` on disk."""
    if (not isinstance(run_id, str) or len(run_id) > RUN_ID_MAX or ".." in run_id
            or not _RUN_ID.fullmatch(run_id)):
        raise RunIdError(f"invalid run id {run_id!r}: use 1-{RUN_ID_MAX} letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit, with no '..'")
    return run_id


def stage_key(run_id: str, step: int | None, stage: str) -> str:
    check_run_id(run_id)
    if step is None:
        return f"runs/{run_id}/{stage}.parquet"
    return f"runs/{run_id}/step-{step:05d}/{stage}.parquet"


def _stage_name(key: str) -> str:
    """The stage a table key holds: its file name, less a part number (`trajectories_partial-00003`)."""
    name = pathlib.PurePosixPath(key).name.removesuffix(".parquet")
    stem, _, part = name.rpartition("-")
    return stem if part.isdigit() and stem in SCHEMAS else name


@dataclass(frozen=True)
class Commit:
    key: str
    stage: str
    sha256: str
    rows: int
    bytes: int
    committed_at: float


class Store:
    def __init__(self, root: str = "file://.rlvr/store", endpoint_url: str | None = None):
        scheme, _, rest = root.partition("://")
        if not rest:
            scheme, rest = "file", root
        if scheme not in SCHEMES:
            raise StoreRootError(f"unknown URI scheme '{scheme}://' in store root {root!r}; supported: file://, s3://")
        self.scheme = scheme
        self.endpoint_url = endpoint_url
        if scheme == "file":
            self.fs = fsspec.filesystem("file")
            self.base = os.path.abspath(rest)
            os.makedirs(self.base, exist_ok=True)
        else:
            # Credentials come from the usual AWS variables; the endpoint may be moto, MinIO or a region.
            client_kwargs = {"endpoint_url": endpoint_url} if endpoint_url else {}
            config_kwargs = {"connect_timeout": S3_CONNECT_TIMEOUT_S, "read_timeout": S3_READ_TIMEOUT_S,
                             "retries": {"total_max_attempts": S3_ATTEMPTS, "mode": "standard"}}
            self.fs = fsspec.filesystem("s3", client_kwargs=client_kwargs, config_kwargs=config_kwargs,
                                        skip_instance_cache=True)
            self.fs.retries = S3FS_RETRIES  # s3fs's own retry loop around botocore's (not a constructor argument)
            self.base = rest.rstrip("/")
            bucket = self.base.split("/", 1)[0]
            where = endpoint_url or "AWS"
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                raise StorageError(f"S3 bucket '{bucket}' does not exist at {where} (store root {root!r})") from None
            except PermissionError:
                raise StorageError(f"access to S3 bucket '{bucket}' at {where} denied: check AWS credentials") from None
            except Exception as e:  # botocore's exceptions are many; one clear message is better than its stack
                if type(e).__name__ == "NoCredentialsError":
                    raise StorageError(f"no AWS credentials for S3 bucket '{bucket}' at {where}: set "
                                       "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
                raise StorageError(f"cannot reach S3 bucket '{bucket}' at {where}: {type(e).__name__}: {e}") from None
        self.root = f"{scheme}://{self.base}"

    @classmethod
    def from_config(cls, cfg) -> "Store":
        return cls(cfg.root, cfg.endpoint_url)

    # -- paths --------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """Filesystem path (for fsspec) of a key or of a full URI inside this store."""
        if "://" in key:
            scheme, _, rest = key.partition("://")
            if scheme != self.scheme:
                raise StorageError(f"URI {key!r} is not in this store ({self.root})")
            return os.path.abspath(rest) if scheme == "file" else rest
        return f"{self.base}/{key}"

    def uri(self, key: str) -> str:
        return key if "://" in key else f"{self.scheme}://{self.path(key)}"

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    # -- blobs --------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> str:
        self._atomic_write(self.path(key), data)
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        try:
            with self.fs.open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise StorageError(f"no object at {self.uri(key)}") from None

    def put_json(self, key: str, obj) -> str:
        return self.put_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def get_json(self, key: str):
        return json.loads(self.get_bytes(key))

    def local_path(self, key: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
        """A local file with the object's bytes: the file itself on file://, a cached download on s3://."""
        if self.scheme == "file":
            p = pathlib.Path(self.path(key))
            if not p.exists():
                raise StorageError(f"no object at {self.uri(key)}")
            return p
        cache = pathlib.Path(cache_dir or os.environ.get("RLVR_CACHE", ".rlvr/cache")) / "objects"
        name = hashlib.sha256(self.uri(key).encode()).hexdigest()[:32] + "-" + pathlib.PurePosixPath(key).name
        target = cache / name
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + f".{uuid.uuid4().hex}.part")
            tmp.write_bytes(self.get_bytes(key))
            os.replace(tmp, target)
        return target

    def put_dir(self, key: str, local_dir: str | os.PathLike) -> str:
        """Upload a directory (e.g. a checkpoint) file by file; the directory's files are immutable once written."""
        local_dir = pathlib.Path(local_dir)
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                self.put_bytes(f"{key}/{p.relative_to(local_dir).as_posix()}", p.read_bytes())
        return self.uri(key)

    def get_dir(self, key: str, local_dir: str | os.PathLike) -> pathlib.Path:
        local_dir = pathlib.Path(local_dir)
        src = self.path(key)
        files = [f for f in self.fs.find(src) if not f.endswith("/")]
        if not files:
            raise StorageError(f"no objects under {self.uri(key)}")
        for f in files:
            rel = f[len(src.rstrip("/")) + 1:]
            dest = local_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open(f, "rb") as fh:
                dest.write_bytes(fh.read())
        return local_dir

    # -- tables -------------------------------------------------------------------------
    def write_table(self, key: str, table: pa.Table, stage: str | None = None, overwrite: bool = False) -> Commit:
        """Validate, write and commit a table. Returns its commit record."""
        stage = stage or _stage_name(key)
        table = schema_for(stage).validate(table, stage=f"{stage} @ {key}")
        buf = io.BytesIO()
        # Dictionaries and min/max statistics pay off for ids and labels, not for token/logprob lists:
        # skipping them there halves write time and thirds read time at the same size.
        scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
        pq.write_table(table, buf, compression="zstd", use_dictionary=scalar, write_statistics=scalar)
        data = buf.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        marker = self.path(key) + COMMIT_SUFFIX
        previous = self._read_marker(marker)
        if previous is not None:
            if previous["sha256"] == digest:
                return Commit(key=key, **{k: previous[k] for k in ("stage", "sha256", "rows", "bytes", "committed_at")})
            if not overwrite:
                raise StageConflictError(
                    f"stage '{stage}' at {self.uri(key)} is already committed with different content "
                    f"(sha256 {previous['sha256'][:12]} != {digest[:12]}); pass overwrite=True to replace it")
            # Un-commit first: a crash from here on leaves the stage invisible, never half-replaced.
            self.fs.rm(marker)
        self._atomic_write(self.path(key), data)
        commit = Commit(key=key, stage=stage, sha256=digest, rows=table.num_rows, bytes=len(data), committed_at=time.time())
        self._atomic_write(marker, json.dumps(commit.__dict__, sort_keys=True).encode())
        return commit

    def read_table(self, key: str, stage: str | None = None, validate: bool = True,
                   columns: list[str] | None = None) -> pa.Table:
        """A committed table. `columns` decodes only those (a training step's trajectories are mostly
        token columns that a reader of rewards or patches does not need); their types are checked
        against the schema, the row rules were checked on the whole table when it was committed."""
        stage = stage or _stage_name(key)
        marker = self._read_marker(self.path(key) + COMMIT_SUFFIX)
        if marker is None:
            state = "written but not committed" if self.exists(key) else "missing"
            raise StageNotCommittedError(f"stage '{stage}' at {self.uri(key)} is {state}")
        # One GET of the whole object: far faster on S3 than parquet's ranged reads.
        data = self.get_bytes(key)
        if len(data) != marker["bytes"]:
            raise CorruptTableError(f"stage '{stage}' at {self.uri(key)} has {len(data)} bytes but its commit says "
                                    f"{marker['bytes']}: the object was changed outside the store")
        digest = hashlib.sha256(data).hexdigest()
        if digest != marker["sha256"]:  # a flipped bit would otherwise decode as data
            raise CorruptTableError(f"stage '{stage}' at {self.uri(key)} has sha256 {digest} but its commit "
                                    f"records {marker['sha256']}: the object was changed outside the store")
        present = pq.read_schema(pa.BufferReader(data)).names if columns else []
        later = set(schema_for(stage).added_later) if stage in SCHEMAS else set()
        missing = [c for c in columns or [] if c not in present and c not in later]
        if missing:
            raise TableValidationError(f"{stage} @ {key} (on read)", missing[0], None, "column_present",
                                       "column is missing")
        table = pq.read_table(pa.BufferReader(data), columns=[c for c in columns if c in present] if columns else None)
        for name in [c for c in columns or [] if c not in present]:  # added to the schema after this was written
            typ = schema_for(stage).columns[name][0]
            table = table.append_column(pa.field(name, typ), pa.nulls(table.num_rows, typ))
        if columns:
            table = table.select(columns)
        if validate and columns is not None:
            schema = schema_for(stage)
            for name in columns:
                want = schema.columns[name][0] if name in schema.columns else None
                if table.schema.field(name).type != want:
                    raise TableValidationError(f"{stage} @ {key} (on read)", name, None, "dtype",
                                               f"expected {want}, got {table.schema.field(name).type}")
        elif validate:
            try:
                table = schema_for(stage).validate(table, stage=f"{stage} @ {key}")
            except TableValidationError as e:
                raise TableValidationError(e.table + " (on read)", e.column, e.row_id, e.rule, e.detail) from None
        return table

    def is_committed(self, key: str) -> bool:
        return self._read_marker(self.path(key) + COMMIT_SUFFIX) is not None

    def commits(self, prefix: str) -> list[Commit]:
        """Every committed table under a prefix (e.g. `runs/{run_id}`), oldest first."""
        base = self.path(prefix)
        if not self.fs.exists(base):
            return []
        out = []
        for m in self.fs.find(base):
            if m.endswith(".parquet" + COMMIT_SUFFIX):
                rec = self._read_marker(m)
                key = m[: -len(COMMIT_SUFFIX)]
                key = key[len(self.base) + 1:] if key.startswith(self.base) else key
                out.append(Commit(key=key, **{k: rec[k] for k in ("stage", "sha256", "rows", "bytes", "committed_at")}))
        return sorted(out, key=lambda c: c.committed_at)

    # -- run-level convenience ----------------------------------------------------------
    def write_stage(self, run_id: str, step: int | None, stage: str, table: pa.Table, overwrite: bool = False) -> Commit:
        return self.write_table(stage_key(run_id, step, stage), table, stage=stage, overwrite=overwrite)

    def read_stage(self, run_id: str, step: int | None, stage: str, columns: list[str] | None = None) -> pa.Table:
        return self.read_table(stage_key(run_id, step, stage), stage=stage, columns=columns)

    def stage_committed(self, run_id: str, step: int | None, stage: str) -> bool:
        return self.is_committed(stage_key(run_id, step, stage))

    def write_manifest(self, manifest: RunManifest) -> str:
        return self.put_json(f"runs/{check_run_id(manifest.run_id)}/manifest.json", manifest.model_dump())

    def read_manifest(self, run_id: str) -> RunManifest | None:
        """The run's manifest; a `running` attempt whose owner process is gone reads `killed` (it was
        killed outright and could not record its end), and so does the run if that was its last."""
        key = f"runs/{check_run_id(run_id)}/manifest.json"
        if not self.exists(key):
            return None
        manifest = RunManifest.model_validate(self.get_json(key))
        for a in manifest.attempts:
            if a.status == "running" and owner_gone(a.host, a.pid, a.pid_start):
                a.status, a.reason = "killed", f"ended without a word: process {a.pid} on {a.host} is gone"
        if manifest.status == "running" and manifest.attempts and manifest.attempts[-1].status == "killed":
            manifest.status = "killed"
        return manifest

    # -- internals ----------------------------------------------------------------------
    def _read_marker(self, marker_path: str) -> dict | None:
        try:
            with self.fs.open(marker_path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def _atomic_write(self, path: str, data: bytes) -> None:
        if self.scheme == "file":
            # write-then-rename: a reader never sees a partial file at `path`
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            # A single S3 PUT is atomic: the object appears whole or not at all.
            try:
                self.fs.pipe_file(path, data)
            except FileNotFoundError:
                raise StorageError(f"S3 bucket for {self.uri(path)} does not exist") from None
