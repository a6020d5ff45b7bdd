"""What a Ray cluster costs on one box (a benchmark, not a test).

    python tests/bench/bench_cluster.py [--rounds 3] [--episodes 32] [--json-out F]

The mini preset, its shipped base on one vLLM server. A local two-node Ray cluster
(tests/fixtures/ray_cluster.py: head + one more raylet, one CPU each) starts first: its start-up
time, and the machine's used memory before and after (Ray's own processes), are reported.
Then rounds alternate in-process and on the cluster, side by side (ABAB...), each round on its own
train tasks:
- rollouts: `collect_rollouts` of `--episodes` training episodes at the preset's agent
  concurrency, in this process or in the two nodes' episode runners (tasks/cluster.py), the same
  number of episodes at once either way;
- grading: the round's patches graded without dedupe, once by the local thread pool and once as
  Ray tasks (grading_cpus 1: two at once over the two nodes, as sandbox.concurrency is 2 here).
Same cores either way, so no speed-up is expected: the ratio is the cluster's overhead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def used_memory_mib() -> float:
    info = {}
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def ray_rss_mib() -> float:
    """Resident memory of this machine's Ray processes (GCS, raylets, workers, agents)."""
    total = 0
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if "ray::" in argv or "/ray/" in argv or "raylet" in argv or "gcs_server" in argv:
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode")
    ap.add_argument("--episodes", type=int, default=32, help="episodes per round")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    from flows.stages import collect_rollouts
    from flows.prepare import prepare_run_context
    from tasks.cluster import RayGrading, connect
    from tasks.grading import grade_rollouts
    from tests.fixtures.ray_cluster import LocalRayCluster

    mem0 = used_memory_mib()
    cluster = LocalRayCluster().start()
    started_s = cluster.started_s
    time.sleep(5)
    mem_cluster = used_memory_mib() - mem0
    out = {"ray_start_s": round(started_s, 1), "cluster_idle_used_mib": round(mem_cluster),
           "ray_rss_idle_mib": round(ray_rss_mib())}
    print(json.dumps(out), flush=True)
    rounds = []
    try:
        run_id = f"bench-cluster-{int(time.time())}"
        ctx, base = prepare_run_context("mini", [f"cluster.address={cluster.address}"], run_id)
        try:
            ctx.cfg.cluster.grading_cpus = 1.0
            t0 = time.perf_counter()
            connect(ctx.cfg.cluster)
            out["driver_connect_s"] = round(time.perf_counter() - t0, 2)
            ctx.start_policy(pathlib.Path(base["base_model_dir"]), version=0, trainer=False)
            train_ids = ctx.split_ids("train")
            modes = ["in_process", "cluster"]
            for i in range(2 * args.rounds):
                mode = modes[i % 2]
                ids = train_ids[i * args.episodes:(i + 1) * args.episodes]
                address = cluster.address
                ctx.cfg.cluster.address = address if mode == "cluster" else None
                t = time.perf_counter()
                table = ctx.loop.call(collect_rollouts(ctx, i + 1, ids, "train", 1, "trajectories"))
                roll_s = time.perf_counter() - t
                ctx.cfg.cluster.address = address
                rows = table.to_pylist()
                items = [(r["rollout_id"], run_id, i + 1, ctx.tasks[r["instance_id"]], r["final_patch"]) for r in rows]
                grade = {}
                # Both graders on the same patches, the order alternating between rounds.
                for gmode in (modes if (i // 2) % 2 == 0 else modes[::-1]):
                    pool = RayGrading(ctx.cfg.cluster, ctx.cfg.sandbox, ctx.store) if gmode == "cluster" else None
                    t = time.perf_counter()
                    rewards = grade_rollouts(items, ctx.cfg.sandbox, ctx.store, dedupe=False, pool=pool)
                    grade[gmode] = (time.perf_counter() - t, rewards["grading_status"].to_pylist())
                    if pool is not None:
                        pool.shutdown()
                nodes = sorted({r.get("node") or "driver" for r in rows})
                res = dict(round=i + 1, mode=mode, episodes=len(rows), rollout_wall_s=round(roll_s, 1),
                           episodes_per_min=round(60 * len(rows) / roll_s, 1),
                           mean_turns=round(sum(r["num_turns"] for r in rows) / len(rows), 2),
                           rollout_nodes=len(nodes),
                           gradings=len(items),
                           gradings_per_min_in_process=round(60 * len(items) / grade["in_process"][0], 1),
                           gradings_per_min_cluster=round(60 * len(items) / grade["cluster"][0], 1),
                           grading_statuses={g: {s: st.count(s) for s in set(st)} for g, (_, st) in grade.items()},
                           ray_rss_mib=round(ray_rss_mib()))
                rounds.append(res)
                print(json.dumps(res), flush=True)
        finally:
            ctx.close()
    finally:
        import ray

        ray.shutdown()  # before its nodes go, so the driver does not report them as crashed
        cluster.stop()

    def med(key, mode=None):
        return statistics.median(r[key] for r in rounds if mode is None or r["mode"] == mode)

    ep_in, ep_cl = med("episodes_per_min", "in_process"), med("episodes_per_min", "cluster")
    gr_in, gr_cl = med("gradings_per_min_in_process"), med("gradings_per_min_cluster")
    out.update(rounds=rounds, episodes_per_min={"in_process": ep_in, "cluster": ep_cl,
                                                "overhead": round(1 - ep_cl / ep_in, 3)},
               gradings_per_min={"in_process": gr_in, "cluster": gr_cl, "overhead": round(1 - gr_cl / gr_in, 3)},
               ray_rss_after_mib=rounds[-1]["ray_rss_mib"] if rounds else None)
    print(f"\nRay start-up (head + second node joined): {out['ray_start_s']} s; driver connect {out['driver_connect_s']} s")
    print(f"memory: +{out['cluster_idle_used_mib']} MiB used with the idle cluster (Ray processes' RSS "
          f"{out['ray_rss_idle_mib']} MiB idle, {out['ray_rss_after_mib']} MiB after the rounds)")
    print(f"{'median of ' + str(args.rounds) + ' rounds':<24} {'in-process':>10} {'cluster':>8} {'overhead':>8}")
    print(f"{'episodes/min':<24} {ep_in:10.1f} {ep_cl:8.1f} {1 - ep_cl / ep_in:8.1%}")
    print(f"{'gradings/min':<24} {gr_in:10.1f} {gr_cl:8.1f} {1 - gr_cl / gr_in:8.1%}")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
