"""Scale benchmark of the stress simulator (bookkeeping only, no MLX).

    python benchmarks/bench_simulator.py                       # 100k chat requests, checks on
    python benchmarks/bench_simulator.py --requests 10000 --profile

Prints wall and CPU time, the time spent inside Scheduler.schedule/update
(including the BlockManager calls they make), and per-step / per-token
costs. `--profile` adds the hottest functions (cProfile, about 2x slower).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

from scheduler.cli import parse_mix
from scheduler.simulator import SimulationConfig, WorkloadConfig, run_simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--check-every", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    cfg = SimulationConfig(
        workload=WorkloadConfig(mix=parse_mix(args.workload), num_requests=args.requests,
                                rate=args.rate),
        check_every=args.check_every or None,
    )
    profiler = cProfile.Profile() if args.profile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profiler:
        profiler.enable()
    result = run_simulation(cfg)
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s = result.summary
    steps = s["steps"]["count"]
    computed = s["throughput"]["computed_tokens_per_s"] * s["throughput"]["simulated_seconds"]
    book = s["bookkeeping"]["seconds_total"]
    print(f"{args.requests} {args.workload} requests, check every {args.check_every} steps")
    print(f"wall {wall:.1f} s, cpu {cpu:.1f} s, max RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print(f"scheduler+blockmgr {book:.1f} s ({book / wall:.0%} of wall), {steps} steps, "
          f"{book / steps * 1e6:.0f} us/step, {book / computed * 1e6:.2f} us/computed token, "
          f"{book / args.requests * 1e3:.2f} ms/request")
    print(f"leaks: {s.get('checks', {}).get('leaks')}, "
          f"hit rate {s['prefix_cache']['hit_rate']:.3f}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
