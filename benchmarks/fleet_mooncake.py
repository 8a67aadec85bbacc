"""Simulated fleets on the Mooncake traces: every router at each fleet size.

    python benchmarks/fleet_mooncake.py [--trace FILE ...] [--replicas 16,64]
        [--routers round_robin,least_load,cache_aware,precise] [--requests K]
        [--num-blocks 65536] [--jobs 1] [--out DIR]

Runs `blockmgr simulate --trace FILE --num-blocks B --replicas N --router P
--no-plots --json` once per (trace, N, P) in a child process and prints one
markdown table: prompt tokens computed (of the trace's), the token-weighted
hit rate, TTFT p50 / p90, throughput, and the run's wall and CPU seconds
(the child's user + sys). `--requests K` replays the first K requests of
each trace (a prefix written to a temporary file) when a whole trace takes
too long. Default trace: /work/shared/traces/mooncake_synthetic_trace.jsonl
(Mooncake's FAST'25 synthetic trace); Mooncake's conversation trace is
`FAST25-release/traces/conversation_trace.jsonl` of its repository (not
stored here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"
ROUTERS = ("round_robin", "least_load", "cache_aware", "precise")


def prefix(trace: Path, num_requests: int | None, folder: Path) -> Path:
    """The trace, or its first `num_requests` lines in a file of `folder`."""
    if num_requests is None:
        return trace
    lines = trace.read_text().splitlines(keepends=True)[:num_requests]
    out = folder / f"{trace.stem}.first{num_requests}.jsonl"
    out.write_text("".join(lines))
    return out


def run_one(trace: Path, replicas: int, router: str, num_blocks: int, out: Path) -> dict:
    """One fleet run in a child process: its summary, wall and CPU seconds."""
    argv = [sys.executable, "-m", "scheduler.cli", "simulate", "--trace", str(trace),
            "--num-blocks", str(num_blocks), "--replicas", str(replicas), "--router", router,
            "--no-plots", "--no-progress", "--json", "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout", "w+") as stdout, open(out / "stderr", "w+") as stderr:
        start = time.perf_counter()
        child = subprocess.Popen(argv, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own CPU time
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{stderr.read()}")
        stdout.seek(0)
        summary = json.load(stdout)
    return {"trace": trace.name, "replicas": replicas, "router": router, "summary": summary,
            "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_rss_mb": usage.ru_maxrss / 1024}


def row(run: dict) -> str:
    s = run["summary"]
    pc, lat, thr, req = s["prefix_cache"], s["latency"], s["throughput"], s["requests"]
    counts = s["routing"]["requests"]
    return (f"| {run['trace']} | {run['replicas']} | {run['router']} | "
            f"{pc['prompt_tokens_computed'] / 1e6:.2f}M of {req['prompt_tokens'] / 1e6:.2f}M | "
            f"{pc['hit_rate'] * 100:.1f} % | {lat['ttft_s']['p50']:.2f} / "
            f"{lat['ttft_s']['p90']:.2f} | {thr['requests_per_s']:.2f} / "
            f"{thr['output_tokens_per_s']:.0f} | {min(counts)}-{max(counts)} | "
            f"{run['wall_s']:.0f} s | {run['cpu_s']:.0f} s |")


HEADER = ("| trace | replicas | router | prompt tokens computed | hit rate | TTFT p50 / p90 s | "
          "req/s / out tok/s | requests a replica | wall | CPU |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", type=Path, help="a trace (repeatable)")
    p.add_argument("--replicas", default="16,64", help="fleet sizes (default 16,64)")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--requests", type=int, help="replay each trace's first K requests")
    p.add_argument("--num-blocks", type=int, default=65536, help="pages a replica (16 tokens)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--out", type=Path, help="write every run's summary here (JSON)")
    args = p.parse_args(argv)
    traces = args.trace or [SHARED_TRACE]
    sizes = [int(n) for n in args.replicas.split(",")]
    routers = args.routers.split(",")
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
          f"python {platform.python_version()}; pool {args.num_blocks} pages x 16 tokens a "
          f"replica" + (f"; first {args.requests} requests" if args.requests else ""),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plan = [(prefix(t, args.requests, folder), n, r) for t in traces for n in sizes
                for r in routers]
        print(HEADER, flush=True)
        runs = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_one, t, n, r, args.num_blocks, folder / f"rep{i}")
                       for i, (t, n, r) in enumerate(plan)]
            for future in futures:
                runs.append(future.result())
                print(row(runs[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
