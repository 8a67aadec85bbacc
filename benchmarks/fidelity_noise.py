"""How far the real engine moves between replays of one workload, and the
simulation against the real engine's median.

    python benchmarks/fidelity_noise.py RUN.json [RUN.json ...] [--sim RUN.json]

Each RUN.json is a `benchmarks/fidelity.py --out` file that replayed the real
engine (not a `--real` rerun) on the same model and engine code. Per workload
and metric (throughput, TTFT p50/p90, TPOT p50) it prints the real engine's
values over the runs, their spread (the largest deviation from their median:
how well one real replay predicts another), and the simulation of `--sim`
(default: the last file) against that file's own real run and against the
median of all real runs. Reads files only: no engine, no machine time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = ("throughput", "ttft_p50", "ttft_p90", "tpot_p50")


def metrics_of(summary: dict) -> dict[str, float]:
    """The four compared metrics of one report summary."""
    latency = summary["latency"]
    return {
        "throughput": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50": latency["ttft_s"]["p50"],
        "ttft_p90": latency["ttft_s"]["p90"],
        "tpot_p50": latency["tpot_s"]["p50"],
    }


def load_runs(paths: list[Path]) -> list[dict]:
    """The runs, refusing one that reused another's real replays."""
    runs = []
    for path in paths:
        run = json.loads(path.read_text())
        if "real_from" in run:
            raise SystemExit(f"{path}: its real results come from {run['real_from']}, not a replay")
        runs.append(run)
    return runs


def rows(runs: list[dict], sim: dict) -> list[tuple[str, str, list[float], float, float, float]]:
    """(workload, metric, real values, spread, sim vs its run, sim vs median) per cell
    of the workloads every run replayed."""
    names = [name for name in sim["workloads"] if all(name in run["workloads"] for run in runs)]
    out = []
    for name in names:
        reals = [metrics_of(run["workloads"][name]["real"]) for run in runs]
        own = metrics_of(sim["workloads"][name]["real"])
        simulated = metrics_of(sim["workloads"][name]["simulated"])
        for metric in METRICS:
            values = [real[metric] for real in reals]
            median = statistics.median(values)
            spread = max(abs(value / median - 1) for value in values)
            out.append((name, metric, values, spread, simulated[metric] / own[metric] - 1,
                        simulated[metric] / median - 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--sim", type=Path,
                        help="the run whose simulation is judged (default: the last)")
    args = parser.parse_args()
    runs = load_runs(args.runs)
    sim = json.loads((args.sim or args.runs[-1]).read_text())
    print(f"real replays: {', '.join(path.name for path in args.runs)}; simulation: "
          f"{(args.sim or args.runs[-1]).name}\n")
    print("| workload | metric | real runs | real spread | sim vs its run | sim vs real median |")
    print("|---|---|---|---|---|---|")
    for name, metric, values, spread, own, median in rows(runs, sim):
        shown = " / ".join(f"{value:.3g}" for value in values)
        print(f"| {name} | {metric} | {shown} | ±{spread * 100:.1f} % | {own * 100:+.1f} % | "
              f"{median * 100:+.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
