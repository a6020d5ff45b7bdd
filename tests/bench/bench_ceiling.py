"""Where a mini GRPO step's time goes, against what this machine can do (a benchmark).

    python tests/bench/bench_ceiling.py --step-dir .rlvr/store/runs/seeds-s1/step-00001

Reads one real step of a run (its trajectories table and timings.json) and measures, with the
shipped base served by vLLM under the mini preset's settings:

1. raw decode: the step's own turns (each turn's context as prompt, exactly its recorded number
   of generated tokens, T as in training) replayed with no tools in between, at concurrency
   1, 8, 32, 64: generated tokens/s, and the time to generate the whole step's tokens at the
   mini's concurrency, the floor of the rollout stage on this machine;
2. per-turn overheads of the agent loop, each alone on an idle machine: an HTTP round trip
   (a 1-token request), tokenising an observation, parsing a completion's tool calls, and the
   sandbox operations an episode makes (start, read, write, diff, close);
3. the step against the sum of its irreducible parts: decode floor + the step's sandbox work
   (its operation counts x their idle latency) + grading + update + weight sync as recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def turns_of(rows: list[dict]) -> list[tuple[list[int], int]]:
    """(context, generated length) of every turn: a turn is a run of loss-mask-1 tokens."""
    out = []
    for r in rows:
        m, ids = r["loss_mask"], r["token_ids"]
        i = 0
        while i < len(m):
            if m[i] == 1:
                j = i
                while j < len(m) and m[j] == 1:
                    j += 1
                out.append((ids[:i], j - i))
                i = j
            else:
                i += 1
    return out


async def replay(base_url: str, turns, concurrency: int, temperature: float) -> tuple[float, int]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        async def one(prompt, n):
            async with sem:
                body = {"model": "policy", "prompt": prompt, "max_tokens": n, "min_tokens": n,
                        "temperature": temperature, "logprobs": 0, "return_token_ids": True}
                r = await http.post(f"{base_url}/v1/completions", json=body)
                r.raise_for_status()
                return len(r.json()["choices"][0]["token_ids"])

        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(one(p, k) for p, k in turns)))
        return time.perf_counter() - t0, n


def median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-dir", required=True, help="a run's step folder in the local store (trajectories.parquet, timings.json)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--turns", type=int, default=64, help="turns replayed at concurrency 1 and 8 (all of them from 32 on)")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from flows.prepare import prepare_run_context
    from tasks.agent.prompts import parse_tool_calls
    from tasks.policy.tokenizer import observation_segment_ids
    from tasks.sandbox import open_sandbox

    step_dir = pathlib.Path(args.step_dir)
    rows = pq.read_table(step_dir / "trajectories.parquet").to_pylist()
    timings = json.loads((step_dir / "timings.json").read_text())
    turns = turns_of(rows)
    total_tokens = sum(n for _, n in turns)
    ctx, base = prepare_run_context("mini", {}, f"bench-ceiling-{int(time.time())}")
    temperature = ctx.cfg.agent.training.temperature
    report: dict = {"step_dir": str(step_dir), "episodes": len(rows), "turns": len(turns),
                    "generated_tokens": total_tokens, "recorded_timings_s": timings}
    try:
        ctx.start_policy(pathlib.Path(base["base_model_dir"]), version=0, trainer=False)
        url = ctx.server.base_url
        asyncio.run(replay(url, turns[:8], 8, temperature))  # warm-up
        decode = []
        for c in args.concurrency:
            sub = turns if c >= 32 else turns[:args.turns]
            wall, n = asyncio.run(replay(url, sub, c, temperature))
            decode.append({"concurrency": c, "turns": len(sub), "tokens": n, "wall_s": round(wall, 1),
                           "tok_per_s": round(n / wall, 1)})
            print(json.dumps(decode[-1]), flush=True)
        report["decode"] = decode
        at_mini = next((d for d in decode if d["concurrency"] == ctx.cfg.agent.concurrency), decode[-1])
        decode_floor = total_tokens / at_mini["tok_per_s"]

        # Per-turn overheads, alone.
        import httpx

        tok = ctx.tokenizer
        one_token = {"model": "policy", "prompt": turns[0][0], "max_tokens": 1, "temperature": temperature}
        with httpx.Client(timeout=60) as http:
            http_ms = median_ms(lambda: http.post(f"{url}/v1/completions", json=one_token))
        completion = tok.decode(rows[0]["token_ids"][rows[0]["prompt_length"]:], skip_special_tokens=False)
        observation = "Here's the result of running `cat -n` on /testbed/pkg/mod.py:\n" + "\n".join(
            f"{i:6d}\tvalue = compute(value, {i})" for i in range(40))
        overheads = {"http_1_token_ms": round(http_ms, 1),
                     "tokenise_observation_ms": round(median_ms(lambda: observation_segment_ids(tok, [observation])), 2),
                     "parse_tool_calls_ms": round(median_ms(lambda: parse_tool_calls(completion)), 3)}
        task = ctx.tasks[rows[0]["instance_id"]]
        ops = {"open": [], "read_file": [], "write_file": [], "diff": [], "close": []}
        for _ in range(10):
            t0 = time.perf_counter()
            sbx = open_sandbox(task, ctx.cfg.sandbox, ctx.store, "agent")
            ops["open"].append(time.perf_counter() - t0)
            path = "/testbed/" + sbx.run("git ls-files '*.py' | grep -v test | head -1").output.strip()
            for name, fn in [("read_file", lambda: sbx.read_file(path)), ("write_file", lambda: sbx.write_file(path, text)),
                             ("diff", sbx.diff), ("close", sbx.close)]:
                if name == "write_file":
                    text = sbx.read_file(path) + "\n"
                t0 = time.perf_counter()
                fn()
                ops[name].append(time.perf_counter() - t0)
        for name, v in ops.items():
            overheads[f"sandbox_{name}_ms"] = round(1000 * statistics.median(v), 1)
        report["overheads"] = overheads
        print(json.dumps(overheads), flush=True)

        # The step's sandbox work: an episode opens, diffs and closes once; each view reads, each edit
        # reads and writes (the editor works through read_file/write_file), bash and search run one command.
        calls = {"view": 0, "edit": 0, "command": 0}
        for r in rows:
            for m in json.loads(r["messages"]):
                for c in m.get("tool_calls") or []:
                    f = c["function"]
                    a = json.loads(f["arguments"]) if f["arguments"] else {}
                    if f["name"] == "file_editor":
                        calls["view" if a.get("command") == "view" else "edit"] += 1
                    elif f["name"] in ("execute_bash", "search"):
                        calls["command"] += 1
        per = {k: overheads[f"sandbox_{k}_ms"] / 1000 for k in ops}
        sandbox_work = (len(rows) * (per["open"] + per["diff"] + per["close"]) + calls["view"] * per["read_file"]
                        + calls["edit"] * (per["read_file"] + per["write_file"]) + calls["command"] * per["read_file"])
        cores = 2  # vLLM's engine holds one of them (VLLM_CPU_OMP_THREADS_BIND auto); sandboxes share the other
        sandbox_floor = sandbox_work / max(cores - 1, 1)
        parts = {"decode_floor_s": round(decode_floor, 1), "sandbox_floor_s": round(sandbox_floor, 1),
                 "grading_s": round(timings.get("grading", 0.0), 1), "update_s": round(timings.get("update", 0.0), 1),
                 "weight_sync_s": round(timings.get("weight_sync", 0.0), 1)}
        step_s = sum(timings.values())
        floor = sum(parts.values())
        report |= {"tool_calls": calls, "irreducible_parts": parts, "step_recorded_s": round(step_s, 1),
                   "sum_of_irreducible_s": round(floor, 1), "step_over_floor": round(step_s / floor, 2),
                   "rollouts_recorded_s": round(timings.get("rollouts", 0.0), 1),
                   "rollouts_over_floor": round(timings.get("rollouts", 0.0) / (decode_floor + sandbox_floor), 2)}
    finally:
        ctx.close()
    print(json.dumps({k: report[k] for k in ("tool_calls", "irreducible_parts", "step_recorded_s",
                                             "sum_of_irreducible_s", "step_over_floor", "rollouts_recorded_s",
                                             "rollouts_over_floor")}, indent=1))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
