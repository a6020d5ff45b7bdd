"""Seeded sampling: how often two collections of the same episodes sample the same tokens (a
benchmark, not a test).

    python tests/bench/bench_seeded.py [--samples 6] [--concurrency 4 1] [--json-out FILE]

One vLLM CPU server serves the tests' tiny random policy (tests/fixtures/vllm.py); the test tasks
(tests/data/r2e_tasks, bwrap sandboxes) are played `--samples` times each at T=1, as the smoke
preset trains. For each concurrency, four collections of the same rollouts (same step, instance and
sample index, other run ids): two with agent.seeded_sampling and run seed 0, two without. Reports
the share of episodes whose token ids are identical between the two collections of each pair, and
for episodes that differ, the mean position of the first different generated token; then the seeded
collection at each other concurrency against the first's (does batching change what is sampled?).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(a: list[dict], b: list[dict]) -> dict:
    ta = {(r["instance_id"], r["sample_index"]): r for r in a}
    tb = {(r["instance_id"], r["sample_index"]): r for r in b}
    keys = sorted(set(ta) & set(tb))
    same = [k for k in keys if ta[k]["token_ids"] == tb[k]["token_ids"]]
    firsts = [first_difference(ta[k]["token_ids"], tb[k]["token_ids"]) - ta[k]["prompt_length"]
              for k in keys if k not in same]
    return dict(episodes=len(keys), identical=len(same), share_identical=round(len(same) / max(len(keys), 1), 3),
                mean_first_diff_generated_token=round(sum(firsts) / len(firsts), 1) if firsts else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=6, help="episodes per task (3 tasks)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--tokens-per-turn", type=int, default=32)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    from schemas.config import InferenceConfig, RunConfig
    from tasks.inference import PolicyClient, VLLMServer
    from tasks.policy.model import create_tiny_policy
    from tasks.rollout import RolloutSpec, collect, served_episodes
    from tasks.sandbox import image
    from tasks.storage import Store
    from tests.fixtures.sandbox import TASK_DIR, build_task_archive, make_task_row, sandbox_cfg
    from tests.fixtures.vllm import tiny_model_config
    from transformers import AutoTokenizer

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-seeded-"))
    model_dir = create_tiny_policy(tiny_model_config(), work / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    store = Store(f"file://{work / 'store'}")
    image.ensure_rootfs()
    tasks = [make_task_row(d.name, store, store.put_bytes(f"environments/{d.name}.tar.gz", build_task_archive(d.name)))
             for d in sorted(TASK_DIR.iterdir()) if (d / "task.json").exists()]
    icfg = InferenceConfig(max_model_len=4096, max_num_seqs=32, cpu_kvcache_gib=1, startup_timeout_s=900)
    results = []
    with VLLMServer(model_dir, icfg, log_dir=work / "logs") as server:
        client = PolicyClient([server.base_url], stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])

        def run(run_id: str, seeded: bool, conc: int) -> list[dict]:
            cfg = RunConfig.model_validate({
                "seed": 0, "sandbox": sandbox_cfg("bwrap").model_dump(), "inference": {"max_model_len": 4096},
                "agent": {"max_turns": args.max_turns, "max_context_tokens": 4096, "prompt_style": "short",
                          "concurrency": conc, "seeded_sampling": seeded,
                          "training": {"max_tokens_per_turn": args.tokens_per_turn}}})
            spec = RolloutSpec(run_id=run_id, step=1, split="train", samples_per_task=args.samples,
                               temperature=1.0, top_p=1.0)
            rows = asyncio.run(collect(tasks, spec, served_episodes(client, spec, tok, cfg, store), conc)).to_pylist()
            bad = [r["finish_reason"] for r in rows if r["finish_reason"] in ("infra_error", "agent_error")]
            if bad:
                raise SystemExit(f"{len(bad)} episodes failed ({bad[0]}): the comparison would mean nothing")
            return rows

        seeded_at = {}
        for conc in args.concurrency:
            for seeded in (True, False):
                t0 = time.perf_counter()
                a, b = (run(f"bench-{'seeded' if seeded else 'unseeded'}-c{conc}-{x}", seeded, conc) for x in "ab")
                res = dict(concurrency=conc, seeded=seeded, **compare(a, b),
                           generated_tokens=sum(r["num_generated_tokens"] for r in a),
                           seconds=round(time.perf_counter() - t0, 1))
                results.append(res)
                print(json.dumps(res), flush=True)
                if seeded:
                    seeded_at[conc] = a
        first = args.concurrency[0]
        for conc in args.concurrency[1:]:
            res = dict(seeded=True, concurrency=f"{first} vs {conc}", **compare(seeded_at[first], seeded_at[conc]))
            results.append(res)
            print(json.dumps(res), flush=True)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
