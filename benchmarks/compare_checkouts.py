"""Side by side: `blockmgr_table.py` cases from two checkouts, alternately.

Run: python benchmarks/compare_checkouts.py BASE_DIR [--only d1,b1] [--rounds 8]

The machine is shared, so load drifts within minutes: each round runs the
table once from BASE_DIR and once from this checkout (order alternating),
and the summary gives, per case, the best, the lower quartile and the
median us/unit of each side and their ratios (this checkout / base).
Best-of and the lower quartile are the steadier figures on a loaded
machine; a ratio is meaningful only across rounds of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_table(checkout: Path, only: str, repeats: int) -> dict[str, float]:
    """us/unit per case key, from one run of that checkout's table script."""
    script = checkout / "benchmarks" / "blockmgr_table.py"
    out = subprocess.run(
        [sys.executable, str(script), "--only", only, "--repeats", str(repeats)],
        capture_output=True, text=True, check=True, cwd=checkout,
    ).stdout
    times = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and cells[1] in only.split(","):
            times[cells[1]] = float(cells[4])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the other checkout (e.g. /work/main)")
    parser.add_argument("--only", default="b1,d1", help="comma-separated case keys")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="repeats inside one table run")
    args = parser.parse_args()
    sides = {"base": args.base.resolve(), "this": HERE}
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for round_index in range(args.rounds):
        order = ("base", "this") if round_index % 2 == 0 else ("this", "base")
        for side in order:
            for key, us in run_table(sides[side], args.only, args.repeats).items():
                samples[side].setdefault(key, []).append(us)
    print(f"{args.rounds} alternating rounds, base {sides['base']}, this {sides['this']}")
    print("| case | base best | this best | ratio best | ratio q25 | ratio median |")
    print("|---|---|---|---|---|---|")
    for key in args.only.split(","):
        base, this = samples["base"].get(key), samples["this"].get(key)
        if not base or not this:
            continue
        b_min, t_min = min(base), min(this)
        b_q25, t_q25 = _lower_quartile(base), _lower_quartile(this)
        b_med, t_med = statistics.median(base), statistics.median(this)
        print(f"| {key} | {b_min:.3f} | {t_min:.3f} | {t_min / b_min:.2f} "
              f"| {t_q25 / b_q25:.2f} | {t_med / b_med:.2f} |")


def _lower_quartile(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 4]


if __name__ == "__main__":
    main()
