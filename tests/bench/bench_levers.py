"""Rollout levers side by side: one GRPO step's rollouts under each variant, interleaved (a benchmark).

    python tests/bench/bench_levers.py --variant mp inference.cpu_executor=mp --variant uni \
        --variant c64 agent.concurrency=64 inference.max_num_seqs=64

Each variant is a name and config overrides on the mini preset (key=value, as `make run` takes them) (inference.* starts its own vLLM
server, agent.* changes how episodes run). All servers serve the same checkpoint (default: the
shipped base) and stay up; each round runs every variant, in turn, on the same training batch
(`grpo.prompts_per_step` tasks x `generations_per_prompt` samples at `agent.concurrency`, real
sandboxes), so that all variants see the same tasks and the same machine load. Reported per
variant, medians over rounds: rollout wall time, episodes/min, generated tokens/s, where an
episode's time goes, CPU seconds of the vLLM server, of the sandboxes and of this process, and
with speculation the draft acceptance rate and mean accepted length (from vLLM's /metrics).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def server_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each process of a vLLM server (API server, engine core, worker), by name."""
    import psutil

    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, float] = {}
    for p in procs:
        try:
            t = p.cpu_times()
            name = p.name() if p.name() != "python" else " ".join(p.cmdline()[1:3])[-40:]
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def own_cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total", "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total")


def spec_counters(base_url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for name in SPEC_METRICS:
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
        out[name] = sum(vals)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", nargs="+", required=True, metavar="NAME [KEY=VALUE ...]",
                    help="a variant: its name, then its overrides of the mini preset (repeat)")
    ap.add_argument("--checkpoint", help="model dir (default: the shipped base)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    from flows.grpo_iteration import training_batch_ids
    from flows.prepare import prepare_run_context
    from flows.stages import collect_rollouts
    from schemas.presets import load_config, parse_overrides
    from tasks.inference import PolicyClient, VLLMServer
    from tasks.policy.tokenizer import IM_END
    from tasks.sandbox.base import sandbox_cpu_seconds

    variants = {name: parse_overrides(overrides) for name, *overrides in args.variant}
    ctx, base = prepare_run_context("mini", {}, f"bench-levers-{int(time.time())}")
    model_dir = pathlib.Path(args.checkpoint or base["base_model_dir"])
    ctx.start_policy(model_dir, version=0, trainer=False)  # the tokenizer, the loop; its server is "base"'s
    default_server = ctx.server
    runs = {}
    try:
        for name, over in variants.items():
            cfg = load_config("mini", over)
            if cfg.inference == ctx.cfg.inference:
                server = default_server
            else:
                t0 = time.monotonic()
                server = VLLMServer(model_dir, cfg.inference, log_dir=ctx.workdir / "logs").start()
                ctx.servers.append(server)
                print(f"{name}: server up in {time.monotonic() - t0:.0f} s ({server.log_path})", flush=True)
            client = PolicyClient([server.base_url], stop_token_ids=[ctx.tokenizer.convert_tokens_to_ids(IM_END)],
                                  version=0)
            runs[name] = dict(cfg=cfg, server=server, client=client, rounds=[])
        for r in range(args.rounds):
            ids = training_batch_ids(ctx, r + 1)
            for name, v in runs.items():
                ctx.cfg, ctx.client = v["cfg"], v["client"]
                spec0 = spec_counters(v["server"].base_url)
                cpu0 = (server_cpu_seconds(v["server"].pid), sandbox_cpu_seconds(), own_cpu_seconds())
                t0 = time.perf_counter()
                table = ctx.loop.call(collect_rollouts(ctx, 100 * (r + 1), ids, "train",
                                                       v["cfg"].grpo.generations_per_prompt, f"levers_{name}"))
                wall = time.perf_counter() - t0
                cpu1 = (server_cpu_seconds(v["server"].pid), sandbox_cpu_seconds(), own_cpu_seconds())
                spec1 = spec_counters(v["server"].base_url)
                rows = table.to_pylist()
                gen = sum(x["generation_seconds"] for x in rows)
                sbx = sum(x["sandbox_seconds"] for x in rows)
                tot = sum(x["total_seconds"] for x in rows)
                toks = sum(x["num_generated_tokens"] for x in rows)
                d = {k: spec1[k] - spec0[k] for k in SPEC_METRICS}
                res = dict(variant=name, round=r, episodes=len(rows), wall_s=round(wall, 1),
                           episodes_per_min=round(60 * len(rows) / wall, 1), generated_tok_per_s=round(toks / wall, 1),
                           generated_tokens=toks, mean_turns=round(sum(x["num_turns"] for x in rows) / len(rows), 2),
                           reward_proxy_submitted=sum(x["finish_reason"] == "submitted" for x in rows),
                           share_model=round(gen / tot, 3), share_sandbox=round(sbx / tot, 3),
                           cpu_vllm_s=round(sum(cpu1[0].values()) - sum(cpu0[0].values()), 1),
                           cpu_vllm_by_process={k: round(v - cpu0[0].get(k, 0.0), 1) for k, v in cpu1[0].items()},
                           cpu_sandbox_s=round(cpu1[1] - cpu0[1], 1),
                           cpu_own_s=round(cpu1[2] - cpu0[2], 1))
                if d["vllm:prefix_cache_queries_total"]:  # prompt tokens found in the cache / looked up
                    res["prefix_cache_hit_rate"] = round(d["vllm:prefix_cache_hits_total"] / d["vllm:prefix_cache_queries_total"], 3)
                drafts = d["vllm:spec_decode_num_draft_tokens_total"]
                if drafts:
                    res["acceptance_rate"] = round(d["vllm:spec_decode_num_accepted_tokens_total"] / drafts, 3)
                    # tokens per verification step: the accepted drafts plus the one the target samples
                    res["mean_accepted_length"] = round(
                        1 + d["vllm:spec_decode_num_accepted_tokens_total"] / max(d["vllm:spec_decode_num_drafts_total"], 1), 2)
                v["rounds"].append(res)
                print(json.dumps(res), flush=True)
    finally:
        ctx.close()
    keys = ["wall_s", "episodes_per_min", "generated_tok_per_s", "share_model", "share_sandbox", "cpu_vllm_s",
            "cpu_sandbox_s", "cpu_own_s", "prefix_cache_hit_rate", "acceptance_rate", "mean_accepted_length"]
    first = next(iter(runs))
    print(f"\nmedians over {args.rounds} rounds ({len(training_batch_ids(ctx, 1))} tasks x "
          f"{ctx.cfg.grpo.generations_per_prompt} samples a round); ratio = {first}'s wall / the variant's")
    summary = {}
    for name, v in runs.items():
        med = {k: round(statistics.median([x[k] for x in v["rounds"]]), 3) for k in keys if all(k in x for x in v["rounds"])}
        med["speedup_vs_" + first] = round(statistics.median(
            [a["wall_s"] / b["wall_s"] for a, b in zip(runs[first]["rounds"], v["rounds"])]), 2)
        summary[name] = med
        print(name, json.dumps(med))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps({"variants": variants, "summary": summary,
                                                           "rounds": {n: v["rounds"] for n, v in runs.items()}},
                                                          indent=1))


if __name__ == "__main__":
    main()
