"""Storage benchmark: trajectories as Parquet (validated, committed) vs JSON Lines.

10,000 rollouts shaped like the benchmark's (prompt 500-4,000 tokens, 1-30 turns of
50-600 generated tokens plus tool observations, groups of 16 sharing a prompt),
written and read back with validation on file:// and on moto's S3 server.

    python tests/bench/bench_storage.py [--rows 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from schemas.tables import TRAJECTORIES  # noqa: E402
from tasks.storage import Store  # noqa: E402


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    vocab = 151_000  # Qwen-sized vocabulary: token ids are not small integers
    tokens, masks, logprobs, meta = [], [], [], []
    prompt = None
    for i in range(rows):
        if i % 16 == 0:  # a GRPO group shares its prompt
            prompt = rng.integers(0, vocab, rng.integers(500, 4001), dtype=np.int32)
        parts, mparts, lparts = [prompt], [np.zeros(len(prompt), np.int8)], [np.zeros(len(prompt), np.float32)]
        turns = int(rng.integers(1, 31))
        for t in range(turns):
            n = int(rng.integers(50, 601))
            parts.append(rng.integers(0, vocab, n, dtype=np.int32))
            mparts.append(np.ones(n, np.int8))
            # sampled-token logprobs: mostly near 0, a long tail
            lparts.append(-rng.exponential(0.3, n).astype(np.float32))
            if t < turns - 1:
                o = int(rng.integers(30, 400))
                parts.append(rng.integers(0, vocab, o, dtype=np.int32))
                mparts.append(np.zeros(o, np.int8))
                lparts.append(np.zeros(o, np.float32))
        tokens.append(np.concatenate(parts))
        masks.append(np.concatenate(mparts))
        logprobs.append(np.concatenate(lparts))
        meta.append((i, turns, int(masks[-1].sum()), len(prompt)))

    def lists(arrs, typ):
        offsets = np.zeros(len(arrs) + 1, np.int32)
        np.cumsum([len(a) for a in arrs], out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrs), typ))

    n = rows
    cols = {
        "rollout_id": [f"run-bench/s1/task-{i // 16}/{i % 16}" for i in range(n)],
        "run_id": ["run-bench"] * n,
        "step": pa.array([1] * n, pa.int32()),
        "policy_version": pa.array([0] * n, pa.int32()),
        "instance_id": [f"task-{i // 16}" for i in range(n)],
        "group_id": [f"s1/task-{i // 16}" for i in range(n)],
        "sample_index": pa.array([i % 16 for i in range(n)], pa.int32()),
        "split": ["train"] * n,
        "messages": [json.dumps([{"role": "user", "content": "x" * 200}])] * n,
        "token_ids": lists(tokens, pa.int32()),
        "loss_mask": lists(masks, pa.int8()),
        "generation_logprobs": lists(logprobs, pa.float32()),
        "prompt_length": pa.array([m[3] for m in meta], pa.int32()),
        "num_turns": pa.array([m[1] for m in meta], pa.int32()),
        "num_generated_tokens": pa.array([m[2] for m in meta], pa.int32()),
        "tool_errors": pa.array([0] * n, pa.int32()),
        "finish_reason": ["submitted"] * n,
        "error": pa.array([None] * n, pa.string()),
        "final_patch": ["diff --git a/pkg/mod.py b/pkg/mod.py\n-    return a\n+    return b\n"] * n,
        "generation_seconds": [1.0] * n,
        "sandbox_seconds": [0.5] * n,
        "total_seconds": [1.6] * n,
    }
    return pa.table(cols, schema=TRAJECTORIES.arrow_schema)


CHUNK = 500  # rows per JSON Lines chunk: a fair JSONL pipeline streams, it never holds 10k rows as Python objects


def write_jsonl(store: Store, key: str, table: pa.Table) -> int:
    """Stream the rows as JSON Lines into the store; returns the bytes written."""
    size = 0
    store.fs.makedirs(store.path(key).rsplit("/", 1)[0], exist_ok=True)
    with store.fs.open(store.path(key), "wb") as f:
        for batch in table.to_batches(max_chunksize=CHUNK):
            data = "".join(json.dumps(row) + "\n" for row in batch.to_pylist()).encode()
            f.write(data)
            size += len(data)
    return size


def read_jsonl_validated(store: Store, key: str) -> pa.Table:
    parts, rows = [], []
    with store.fs.open(store.path(key), "rb") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == CHUNK:
                parts.append(TRAJECTORIES.from_rows(rows))
                rows = []
    if rows:
        parts.append(TRAJECTORIES.from_rows(rows))
    table = pa.concat_tables(parts)
    TRAJECTORIES.validate(table)
    return table


def timed(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    t0 = time.perf_counter()
    table = make_table(args.rows)
    mem_mb = table.nbytes / 1e6
    print(f"built {args.rows} rows, {sum(len(x) for x in table['token_ids'].to_numpy(zero_copy_only=False)) / 1e6:.1f}M "
          f"tokens, {mem_mb:.0f} MB in Arrow, in {time.perf_counter() - t0:.1f}s")

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    from moto.server import ThreadedMotoServer
    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0 or 18_555, verbose=False)
    server.start()
    endpoint = "http://127.0.0.1:18555"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"file": Store(f"file://{tmp}/store"), "s3(moto)": Store("s3://bench/store", endpoint_url=endpoint)}
        for name, store in stores.items():
            n = [0]

            def write_parquet():
                n[0] += 1
                return store.write_stage("bench", n[0], "trajectories", table)

            w, commit = timed(write_parquet, args.repeats)
            r, back = timed(lambda: store.read_stage("bench", n[0], "trajectories"), args.repeats)
            assert back.num_rows == args.rows
            jw, jbytes = timed(lambda: write_jsonl(store, "bench/trajectories.jsonl", table), 1)
            jr, jback = timed(lambda: read_jsonl_validated(store, "bench/trajectories.jsonl"), 1)
            assert jback.num_rows == args.rows
            del jback
            store.fs.rm(store.path("bench/trajectories.jsonl"))  # moto keeps objects in memory
            results.append((name, commit.bytes, w, r, jbytes, jw, jr))
    server.stop()

    print(f"\n{'store':10} {'format':8} {'size MB':>8} {'write+validate s':>17} {'MB/s':>7} {'rows/s':>8} "
          f"{'read+validate s':>16} {'MB/s':>7} {'rows/s':>8}")
    for name, pbytes, w, r, jbytes, jw, jr in results:
        for fmt, size, ws, rs in (("parquet", pbytes, w, r), ("jsonl", jbytes, jw, jr)):
            print(f"{name:10} {fmt:8} {size / 1e6:8.1f} {ws:17.2f} {mem_mb / ws:7.0f} {args.rows / ws:8.0f} "
                  f"{rs:16.2f} {mem_mb / rs:7.0f} {args.rows / rs:8.0f}")
        print(f"{name:10} parquet/jsonl size {pbytes / jbytes:.2f}x; read+validate speed-up {jr / r:.1f}x; "
              f"write speed-up {jw / w:.1f}x")
    print(f"\n(MB/s are of the {mem_mb:.0f} MB Arrow in-memory size; parquet times are medians of {args.repeats}, "
          "JSONL single runs)")


if __name__ == "__main__":
    main()
