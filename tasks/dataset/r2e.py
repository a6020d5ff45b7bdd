"""Load R2E-Gym rows as published (Parquet or JSON Lines) into the tasks table.

    rows = read_rows("s3://bucket/r2e-gym-subset.parquet", store)
    table, report = to_tasks(rows, num_train=700, num_validation=251, seed=0, source=path)
    print(report.summary())     # kept 951 of 4578 rows; 3 rows with problems: ...

Every row is checked column by column; a row with a missing or malformed field
(e.g. `expected_output_json` that is not a JSON object) is left out and reported
by instance and column in the `LoadReport`, never dropped silently. A file that
cannot be read raises `DatasetError` naming the file.

`instance_id` is `<repo_name>__<commit_hash[:12]>` (stable: it depends only on the
row). Splits are drawn from a seeded order of the valid instances: the first
`num_validation` are validation, the next `num_train` train, the rest unused; so
changing num_train never moves a validation task. R2E-Gym's extra columns
(execution_result_content, modified_entity_summaries, num_non_test_*...) are kept
(nested values as JSON text).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.presets import PermanentError
from schemas.tables import SPLITS, TASKS, TEST_STATUSES
from tasks.dataset.mini import gold_patch
from tasks.dataset.verify import check_tasks

log = logging.getLogger(__name__)


class DatasetError(PermanentError, ValueError):
    """A dataset source cannot be used: the message names the file (or row) and why."""


@dataclass
class RowIssue:
    instance: str
    column: str
    problem: str

    def __str__(self) -> str:
        return f"{self.instance}: column '{self.column}': {self.problem}"


@dataclass
class LoadReport:
    source: str
    total: int = 0
    kept: int = 0
    selected: dict = field(default_factory=dict)  # split -> count
    issues: list[RowIssue] = field(default_factory=list)

    @property
    def rejected_instances(self) -> list[str]:
        return sorted({i.instance for i in self.issues})

    def summary(self) -> str:
        bad = self.rejected_instances
        text = (f"{self.source}: kept {self.kept} of {self.total} rows"
                + (f" ({', '.join(f'{n} {s}' for s, n in self.selected.items())})" if self.selected else ""))
        if bad:
            text += f"; {len(bad)} rows left out:\n" + "\n".join(f"  - {i}" for i in self.issues)
        return text

    def to_json(self) -> dict:
        return {"source": self.source, "total": self.total, "kept": self.kept, "selected": self.selected,
                "issues": [i.__dict__ for i in self.issues]}


# ----------------------------------------------------------------------------- reading
def _read_bytes(path: str, store=None) -> bytes:
    try:
        if store is not None and (path.startswith(store.scheme + "://") or "://" not in path and store.exists(path)):
            return store.get_bytes(path)
        if "://" not in path:
            with open(path, "rb") as f:
                return f.read()
        with fsspec.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DatasetError(f"R2E-Gym rows: no file at {path}") from None
    except DatasetError:
        raise
    except Exception as e:  # storage layers raise many types; the file name is what matters
        if type(e).__name__ == "StorageError" and "no object" in str(e):
            raise DatasetError(f"R2E-Gym rows: no file at {path}") from None
        raise DatasetError(f"R2E-Gym rows: cannot read {path}: {type(e).__name__}: {e}") from None


def read_rows(path: str, store=None, data: bytes | None = None) -> list[dict]:
    """Rows of a Parquet or JSON Lines (or JSON array) file: a local path, a store key or an s3:// URI."""
    data = _read_bytes(path, store) if data is None else data
    name = path.lower().removesuffix(".gz")
    if data[:4] == b"PAR1" or name.endswith((".parquet", ".pq")):
        try:
            return pq.read_table(pa.BufferReader(data)).to_pylist()
        except Exception as e:
            raise DatasetError(f"R2E-Gym rows: {path} is not a readable Parquet file: {e}") from None
    if data[:2] == b"\x1f\x8b":
        import gzip

        data = gzip.decompress(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"R2E-Gym rows: {path} is neither Parquet nor UTF-8 JSON Lines ({e})") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise DatasetError(f"R2E-Gym rows: {path} is not valid JSON: {e}") from None
    else:
        rows = []
        for n, line in enumerate(io.StringIO(text), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise DatasetError(f"R2E-Gym rows: {path} line {n} is not valid JSON: {e}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"R2E-Gym rows: {path} must hold one JSON object per row")
    return rows


# ----------------------------------------------------------------------------- checking
def instance_id_for(row: dict) -> str | None:
    repo, commit = row.get("repo_name"), row.get("commit_hash")
    if not (isinstance(repo, str) and repo and isinstance(commit, str) and commit):
        return None
    return f"{repo}__{commit[:12]}"


def _str_list(value):
    if isinstance(value, str):  # some exports store lists as JSON text
        value = json.loads(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a list of strings")
    return list(value)


def _json_object(value, what: str):
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError(f"must be a JSON object ({what}), got {type(value).__name__}")
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"must be a JSON object ({what}), got JSON {type(obj).__name__}")
    return obj


def _nonempty_str(value):
    if not isinstance(value, str) or not value.strip():
        raise ValueError("is missing or empty")
    return value


def _text(value):
    if not isinstance(value, str):
        raise ValueError(f"must be text, got {type(value).__name__}")
    return value


def _environment_uri(value, store):
    """A store key or a URI under the store's root: the archive is fetched and extracted on the host,
    so a row must not name any other file (file:///etc/shadow) or bucket."""
    if not isinstance(value, str):
        raise ValueError(f"must be a store key or URI (text), got {type(value).__name__}")
    if not value.strip():  # as good as absent: the task runs in its docker_image
        return None
    rel = value
    if "://" in value:
        root = store.root.rstrip("/") + "/" if store is not None else None
        if root is None or not value.startswith(root):
            where = f"the dataset store {store.root}" if store is not None else "a store (none given: use a store key)"
            raise ValueError(f"{value!r} is not inside {where}")
        rel = value[len(root):]
    if rel.startswith("/") or ".." in rel.split("/"):
        raise ValueError(f"{value!r} leaves the dataset store (absolute or '..')")
    return value


def _check_row(row: dict, label: str, store=None) -> tuple[dict | None, list[RowIssue]]:
    """The row with our columns normalised, or None and the problems found (all of them)."""
    issues, out = [], {}

    def check(col: str, fn, required: bool = True):
        value = row.get(col)
        if value is None and not required:
            out[col] = None
            return
        if value is None:
            issues.append(RowIssue(label, col, "is missing"))
            return
        try:
            out[col] = fn(value)
        except (ValueError, TypeError) as e:
            issues.append(RowIssue(label, col, str(e)))

    for col in ("repo_name", "docker_image", "commit_hash", "problem_statement"):
        check(col, _nonempty_str)

    def parsed_commit(v):
        obj = _json_object(v, "R2E-Gym ParsedCommit")
        if not isinstance(obj.get("file_diffs"), list):
            raise ValueError("ParsedCommit has no 'file_diffs' list")
        # What the gold patch is rebuilt from (tasks/dataset/mini.py: gold_patch), entry by entry.
        for i, fd in enumerate(obj["file_diffs"]):
            path = (((fd.get("header") if isinstance(fd, dict) else None) or {}).get("file") or {}).get("path")
            if not isinstance(path, str) or not path:
                raise ValueError(f"file_diffs[{i}] has no header.file.path (the file the diff changes; the "
                                 "gold patch is rebuilt from it)")
            if not ("old_file_content" in fd and "new_file_content" in fd) and not isinstance(fd.get("hunks"), list):
                raise ValueError(f"file_diffs[{i}] ({path}) has neither old/new_file_content nor a 'hunks' list")
        try:
            gold_patch({"instance_id": label, "parsed_commit_content": obj})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"ParsedCommit cannot be rebuilt into the gold patch ({type(e).__name__}: {e})") from None
        return v if isinstance(v, str) else json.dumps(v)

    def expected_output(v):
        obj = _json_object(v, "test name -> status")
        bad = {k: s for k, s in obj.items() if s not in TEST_STATUSES}
        if bad:
            raise ValueError(f"unknown test statuses {bad} (allowed: {', '.join(TEST_STATUSES)})")
        if not obj:
            raise ValueError("maps no tests")
        return v if isinstance(v, str) else json.dumps(v)

    check("parsed_commit_content", parsed_commit)
    check("expected_output_json", expected_output)
    check("modified_files", _str_list)
    check("relevant_files", _str_list, required=False)
    check("prompt", _text, required=False)
    check("environment_uri", lambda v: _environment_uri(v, store), required=False)
    return (None if issues else out), issues


def _extra(value):
    # Keep R2E-Gym's other columns; nested values (entity summaries) travel as JSON text.
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _order_key(seed: int, instance_id: str) -> str:
    return hashlib.sha256(f"{seed}:{instance_id}".encode()).hexdigest()


def to_tasks(rows: list[dict], num_train: int, num_validation: int, seed: int = 0,
             source: str = "rows", store=None) -> tuple[pa.Table, LoadReport]:
    """Check rows, give them ids and splits, and build the validated tasks table.
    `store`: the dataset store, the only place an `environment_uri` may point (None: keys only)."""
    report = LoadReport(source=source, total=len(rows))
    good: dict[str, dict] = {}
    first_seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        iid = instance_id_for(row)
        label = iid or f"row #{i}"
        checked, issues = _check_row(row, label, store)
        if iid is not None and iid in first_seen:
            issues.append(RowIssue(label, "commit_hash", f"duplicate instance (same repo and commit as row #{first_seen[iid]})"))
            checked = None
        report.issues += issues
        if checked is None:
            continue
        first_seen[iid] = i
        extras = {k: _extra(v) for k, v in row.items() if k not in TASKS.columns}
        good[iid] = dict(checked, instance_id=iid, bug_family=row.get("bug_family"), **extras)
    report.kept = len(good)
    need = num_train + num_validation
    if len(good) < need:
        raise DatasetError(f"{source}: only {len(good)} usable rows of {len(rows)}, but the config asks for "
                           f"{num_train} train + {num_validation} validation\n{report.summary()}")
    ordered = sorted(good, key=lambda iid: _order_key(seed, iid))
    chosen = [(iid, "validation") for iid in ordered[:num_validation]]
    chosen += [(iid, "train") for iid in ordered[num_validation:need]]
    report.selected = {"train": num_train, "validation": num_validation, "unused": len(good) - need}
    out_rows = [dict(good[iid], split=split) for iid, split in sorted(chosen, key=lambda c: (c[1] != "train", c[0]))]
    core = TASKS.from_rows([{k: r.get(k) for k in TASKS.columns} for r in out_rows])
    extra_cols = sorted({k for r in out_rows for k in r if k not in TASKS.columns})
    for col in extra_cols:
        try:
            core = core.append_column(col, pa.array([r.get(col) for r in out_rows]))
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types across rows: keep as text
            core = core.append_column(col, pa.array([None if r.get(col) is None else str(r.get(col)) for r in out_rows],
                                                    pa.string()))
    assert set(core["split"].to_pylist()) <= set(SPLITS)
    return TASKS.validate(core), report


# ----------------------------------------------------------------------------- the store
def dataset_id(cfg, content_sha256: str, verified: bool = False) -> str:
    spec = {"source": "r2e", "content": content_sha256, "seed": cfg.seed,
            "num_train": cfg.num_train, "num_validation": cfg.num_validation}
    if verified:  # rows with archives, verified in sandboxes: another table than the unverified one
        spec["verified"] = True
    return "r2e-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def load_r2e_dataset(cfg, store, strict: bool = False, sandbox_cfg=None, progress=None) -> str:
    """Read cfg.path, write `datasets/<id>/tasks.parquet` (+ load_report.json); returns the table's key.

    Cached by content: the same file and config return the committed table at once.
    strict=True refuses a file with any malformed row instead of leaving it out.
    sandbox_cfg: verify the selected rows that have an environment archive in sandboxes (gold
    patch 1 twice, empty patch 0; tasks/dataset/verify.py: check_tasks); a failing row is reported
    (column "verification", with its test log tail) and left out, and the next row in the seeded
    order takes its place. Rows that run in their docker_image are not verified here.
    """
    if not cfg.path:
        raise DatasetError("dataset.source is 'r2e' but dataset.path is not set (a Parquet or JSON Lines file)")
    data = _read_bytes(cfg.path, store)
    rows = read_rows(cfg.path, store, data)
    verify = sandbox_cfg is not None and any(r.get("environment_uri") for r in rows)
    did = dataset_id(cfg, hashlib.sha256(data).hexdigest(), verified=verify)
    key = f"datasets/{did}/tasks.parquet"
    if store.is_committed(key):
        return key
    source = os.path.basename(cfg.path) or cfg.path
    failed: list[RowIssue] = []
    while True:
        keep = [r for r in rows if instance_id_for(r) not in {i.instance for i in failed}]
        try:
            table, report = to_tasks(keep, cfg.num_train, cfg.num_validation, cfg.seed, source=source, store=store)
        except DatasetError as e:
            if failed:  # say which rows verification took out
                raise DatasetError(f"{e}\nleft out by verification:\n" + "\n".join(f"  - {i}" for i in failed)) from None
            raise
        report.total, report.issues = len(rows), report.issues + failed
        if not verify:
            break
        archived = [r for r in table.to_pylist() if r.get("environment_uri")]
        bad = check_tasks(archived, store, sandbox_cfg, progress, gold_runs=2, cache=True)
        if not bad:
            break
        failed += [RowIssue(iid, "verification", why) for iid, why in sorted(bad.items())]
    if strict and report.issues:
        raise DatasetError(report.summary())
    log.info(report.summary())
    store.put_json(f"datasets/{did}/load_report.json", report.to_json())
    store.write_table(key, table, stage="tasks")
    return key
