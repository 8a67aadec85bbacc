"""Side by side: CPU time of one `blockmgr simulate` run from two checkouts.

Run: python benchmarks/compare_simulate_cpu.py BASE_DIR [--rounds 3] -- SIMULATE_ARGS...
e.g. python benchmarks/compare_simulate_cpu.py /tmp/base --rounds 3 -- \\
         --workload chat -n 10000 --rate 5 --check

Each round runs the simulation once from BASE_DIR and once from this
checkout (order alternating; the machine is shared and its load drifts), and
measures each child's user + system CPU time. Prints per side the best and
the median, and their ratios (this checkout / base).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def cpu_seconds(checkout: Path, args: list[str]) -> float:
    """User + system CPU seconds of one simulate run from `checkout`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "scheduler.cli", "simulate", *args,
             "--no-plots", "--no-progress", "--json", "--out", out],
            cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args(argv[:split])
    sim_args = argv[split + 1:]
    sides = {"base": opts.base.resolve(), "this": HERE}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(opts.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(cpu_seconds(sides[name], sim_args))
        print(f"round {r + 1}: base {times['base'][-1]:.1f} s, this {times['this'][-1]:.1f} s",
              flush=True)
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"best   base {best['base']:.1f} s  this {best['this']:.1f} s  "
          f"ratio {best['this'] / best['base']:.2f}")
    print(f"median base {median['base']:.1f} s  this {median['this']:.1f} s  "
          f"ratio {median['this'] / median['base']:.2f}")


if __name__ == "__main__":
    main()
