"""Math-library threads under contention: why `make test`'s workers run one thread each (tests/conftest.py).

    python tests/bench/bench_threads.py [--seconds 15] [--rounds 3]

A torch process doing the tiny policy's sized matmuls (64 x 256 @ 256 x 768 @ 768 x 256), alone and two at
once, with torch's default threads (one per core; OpenMP threads spin at each barrier), with
OMP_WAIT_POLICY=PASSIVE (they sleep instead), and with one thread. Prints iterations per second per
process and CPU seconds per 1,000 iterations, medians over rounds. Not a test: these machines are noisy.
"""

import argparse
import os
import statistics
import subprocess
import sys

WORK = """
import resource, time, torch
x, w, w2 = torch.randn(64, 256), torch.randn(256, 768), torch.randn(768, 256)
t0, n = time.time(), 0
while time.time() - t0 < {seconds}:
    for _ in range(100):
        torch.relu(x @ w) @ w2
    n += 100
r = resource.getrusage(resource.RUSAGE_SELF)
print(n / (time.time() - t0), r.ru_utime + r.ru_stime, n, torch.get_num_threads())
"""
SETTINGS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "one thread": {"OMP_NUM_THREADS": "1"}}


def once(env: dict, copies: int, seconds: float) -> list[tuple[float, float, int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")} | env
    procs = [subprocess.Popen([sys.executable, "-c", WORK.format(seconds=seconds)], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(copies)]
    out = []
    for p in procs:
        rate, cpu, n, threads = p.communicate()[0].split()
        out.append((float(rate), 1000 * float(cpu) / int(n), int(threads)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"{'setting':12s} {'copies':>6s} {'threads':>7s} {'it/s per process':>16s} {'CPU s / 1k it':>13s}")
    for copies in (1, 2):
        for name, env in SETTINGS.items():
            rows = [r for _ in range(a.rounds) for r in once(env, copies, a.seconds)]
            print(f"{name:12s} {copies:6d} {rows[0][2]:7d} {statistics.median(r[0] for r in rows):16.0f} "
                  f"{statistics.median(r[1] for r in rows):13.2f}", flush=True)


if __name__ == "__main__":
    main()
