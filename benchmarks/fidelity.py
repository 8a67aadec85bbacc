"""Simulator fidelity: calibrated simulations against real-engine replays.

Calibrate once on the grid of `blockmgr calibrate` (micro-batches, no
workload), then run held-out workloads twice: through the real engine
(`run_replay`) and through the simulator with the profile. Prints one
comparison table per workload and a summary of the relative errors against
the 10 % target (throughput, TTFT p50/p90, TPOT p50).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/fidelity.py --preset qwen3-0.6b --layers 4 \\
        [--profile cost-profile.json] [--out fidelity.json] [--only chat-low,...] \\
        [--clock cpu]   # with OPENBLAS_NUM_THREADS=1 in the environment
        [--interleave]  # re-measure anchor grid points between replays
    python benchmarks/fidelity.py --profile P --real earlier.json   # simulations only

`--real` takes the real engine's summaries from an earlier run's `--out`
file instead of replaying, so a refitted profile (benchmarks/refit_profile.py)
is judged against the same real runs.

The simulations get the model's layout (its window groups), as the replay's
engine has. Real times are step times on a shared machine, by the wall clock or by
this process's CPU time (`--clock cpu`, the same clock for calibration and
replay); the load average before and after each replay is recorded.

`--interleave` measures a few of the grid's points again (`calibrate.Anchors`)
right after the calibration and after every replay, and reports how far their
step times have moved from the profile's (the drift): a workload whose mean
step time is off by as much as the anchors drifted missed because the machine
changed, not because the cost model is wrong. About 30 s of CPU per set.

Each replay's own steps (shape and seconds) and each request's arrival,
queueing and TTFT, real and simulated, are kept in the output. The profile
prices the replay's steps by kind (decode rows only, chunks beside decode
rows, chunks alone): the cost model's error on the steps the engine ran,
without the queue; and the per-request TTFT difference by arrival quarter
shows whether the simulated queue drifts away step by step (an overloaded
queue adds up every step's error until it drains) or at one step. With
`--real`, the earlier run's steps are priced by the new profile.

With anchors, a second table repeats each simulation with every coefficient
scaled by the anchors' mean drift over the replay (the mean of the drift
before and after it): what is left of a miss once the machine's change of
speed, as the anchors saw it, is taken out. The first table is the
prediction; the second only says which misses the machine explains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import asdict  # noqa: E402

from blockmgr import BlockManagerConfig  # noqa: E402
from scheduler.core.config import SchedulerConfig  # noqa: E402
from scheduler.simulator import SimulationConfig, WorkloadConfig, parse_length, run_simulation  # noqa: E402
from scheduler.simulator.cost_model import CostModel, StepShape, step_shape  # noqa: E402
from scheduler.simulator.report import comparison_rows, format_comparison  # noqa: E402

#: Metrics held to the target, by comparison-row label.
TARGETED = ("throughput, output tok/s", "TTFT p50, s", "TTFT p90, s", "TPOT p50, s")
TARGET = 0.10
STEP = "mean step time, s"


def workload(name: str, **overrides) -> tuple[str, SimulationConfig]:
    wl = dict(mix={"chat": 1.0}, num_requests=32, rate=1.0, seed=11, max_context=2048,
              system_len=parse_length("lognormal:mean=300,sigma=0.5,min=32,max=1024"),
              user_len=parse_length("lognormal:mean=80,sigma=0.6,min=8,max=512"),
              output_len=parse_length("lognormal:mean=20,sigma=0.5,min=4,max=64"))
    bm = dict(num_blocks=512, block_size=16)
    sched = dict(max_num_batched_tokens=512, max_num_seqs=16)
    for key, value in overrides.items():
        target = bm if key in BlockManagerConfig.__dataclass_fields__ else (
            sched if key in SchedulerConfig.__dataclass_fields__ else wl)
        target[key] = (parse_length(value) if key.endswith("_len") and isinstance(value, str)
                       else value)
    return name, SimulationConfig(workload=WorkloadConfig(**wl),
                                  block_manager=BlockManagerConfig(**bm),
                                  scheduler=SchedulerConfig(**sched), vocab_size=32000)


WORKLOADS = dict([
    workload("chat-low", rate=0.3),
    workload("chat-high", rate=2.0, num_requests=40),
    workload("long-shared", rate=0.5, num_system_prompts=2,
             system_len="lognormal:mean=1200,sigma=0.3,min=256,max=1800"),
    workload("no-sharing", rate=0.5, enable_prefix_cache=False),
    workload("parallel-4", mix={"parallel": 1.0}, rate=0.4, num_requests=16),
    workload("multiturn", mix={"multiturn": 1.0}, rate=0.15, num_requests=30, think_time=1.0),
    workload("small-pool", rate=1.0, num_blocks=96, max_context=1024),
])


def workload_config(name: str, cost, layout, num_slots: int,
                    max_requests: int | None = None) -> SimulationConfig:
    """Workload `name` priced by `cost` on the store of `layout` (the model's),
    cut to its first `max_requests` requests when given."""
    data = WORKLOADS[name].to_dict()
    data["block_manager"]["num_slots"] = num_slots
    if max_requests is not None:
        data["workload"]["num_requests"] = min(data["workload"]["num_requests"], max_requests)
    data["layout"] = layout.to_dict()
    return SimulationConfig.from_dict({**data, "cost": cost.to_dict()})


def step_kind(shape: StepShape) -> str:
    if not shape.prefill_chunks:
        return "decode rows only"
    return "chunks beside decode rows" if shape.decode_rows else "chunks alone"


def priced_steps(cost: CostModel, steps: list[dict]) -> list[tuple[str, int, float, float]]:
    """(kind, steps, measured s, predicted s) of a replay's `steps` ({"shape",
    "seconds"}) priced by `cost`, per `step_kind` and over all."""
    totals: dict[str, list[float]] = {}
    for step in steps:
        shape = StepShape(**step["shape"])
        for kind in (step_kind(shape), "all"):
            entry = totals.setdefault(kind, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += step["seconds"]
            entry[2] += cost.time_of(shape)
    return [(kind, int(n), measured, predicted) for kind, (n, measured, predicted) in sorted(
        totals.items(), key=lambda item: item[0] == "all")]


def ttft_lag(real: dict, sim: dict, parts: int = 4) -> list[float]:
    """Mean simulated minus real TTFT (s) per arrival quarter (`parts`):
    requests matched by arrival order."""
    import numpy as np

    order_real, order_sim = np.argsort(real["arrival"]), np.argsort(sim["arrival"])
    lag = np.asarray(sim["ttft"])[order_sim] - np.asarray(real["ttft"])[order_real]
    return [float(part.mean()) for part in np.array_split(lag, parts) if len(part)]


def print_diagnosis(name: str, entry: dict, cost: CostModel) -> None:
    """The cost model on the replay's own steps, and the TTFT lag by arrival quarter."""
    if "steps" in entry:
        print(f"\n{name}: the profile on the replay's own steps")
        print("| steps | count | measured, s | predicted, s | error |\n|---|---|---|---|---|")
        for kind, n, measured, predicted in priced_steps(cost, entry["steps"]):
            print(f"| {kind} | {n} | {measured:.2f} | {predicted:.2f} "
                  f"| {(predicted / measured - 1) * 100:+.1f} % |")
    if "requests" in entry:
        lag = ttft_lag(entry["requests"]["real"], entry["requests"]["simulated"])
        print(f"{name}: simulated - real TTFT by arrival quarter: "
              + ", ".join(f"{value:+.2f} s" for value in lag))


def drift_corrected(name: str, entry: dict, cost: CostModel, layout, args) -> None:
    """Add to `entry` (with "drift" [before, after]) the comparison rows of a
    simulation whose coefficients are scaled by 1 + the mean drift."""
    factor = 1 + sum(entry["drift"]) / len(entry["drift"])
    scaled = cost.scaled(factor)
    sim = run_simulation(workload_config(name, scaled, layout, args.num_slots,
                                         args.max_requests)).summary
    entry["drift_corrected"] = {"factor": factor, "rows": comparison_rows(entry["real"], sim)}


def request_times(result) -> dict[str, list[float]]:
    arrays = result.metrics.request_arrays()
    return {key: arrays[key].tolist() for key in ("arrival", "queue", "ttft")}


def main() -> int:
    from scheduler.simulator.calibrate import (
        CalibrationGrid,
        calibrate,
        drift,
        machine_info,
        measure_anchors,
    )
    from scheduler.simulator.engine_models import ModelSpec, load_model, model_layout
    from scheduler.simulator.profile import (
        format_fit,
        read_cost,
        read_fit,
        read_layout,
        write_profile,
    )
    from scheduler.simulator.replay import run_replay

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--profile", help="use this profile (else calibrate first and write one)")
    parser.add_argument("--out", default="fidelity.json")
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--num-slots", type=int, default=0,
                        help="recurrent slots for every workload (hybrid models)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (run with OPENBLAS_NUM_THREADS=1)")
    parser.add_argument("--real", metavar="FILE",
                        help="real summaries from an earlier --out file "
                             "(no replay; needs --profile)")
    parser.add_argument("--max-requests", type=int, metavar="N",
                        help="run at most N requests of each workload (a shorter run)")
    parser.add_argument("--interleave", action="store_true",
                        help="re-measure anchor grid points after calibrating and after each "
                             "replay; report their drift from the profile")
    args = parser.parse_args()

    if args.real:
        return simulate_only(args, read_cost(args.profile), read_layout(args.profile))
    model, description = load_model(ModelSpec(preset=args.preset, layers=args.layers))
    grid = CalibrationGrid()
    if args.profile and Path(args.profile).is_file():
        cost, points = read_cost(args.profile), read_fit(args.profile)["points"]
    else:
        start = time.perf_counter()
        profile = calibrate(model, description, grid, clock=args.clock,
                            progress=lambda label: print(f"  calibrated {label}", file=sys.stderr))
        print(f"calibration: {time.perf_counter() - start:.0f} s wall\n" + format_fit(profile.fit))
        write_profile(args.profile or "cost-profile.json", profile)
        cost, points = profile.cost, profile.fit["points"]
    names = args.only.split(",") if args.only else list(WORKLOADS)
    layout = model_layout(model)  # the simulated store is the engine's
    results = {"machine": machine_info(), "model": description | {"config": None},
               "layout": layout.to_dict(), "clock": args.clock, "cost": cost.to_dict(),
               "workloads": {}, "anchors": []}

    def anchors(after: str) -> float | None:
        """The drift now (mean over the anchors), recorded after `after`."""
        if not args.interleave:
            return None
        samples = measure_anchors(model, description, grid, clock=args.clock)
        entry = {"after": after, "load_average": os.getloadavg(), "drift": drift(points, samples)}
        if not entry["drift"]:
            raise SystemExit("fidelity.py: the profile has none of the anchor grid points")
        entry["mean_drift"] = sum(entry["drift"].values()) / len(entry["drift"])
        results["anchors"].append(entry)
        print(f"drift after {after} (load {entry['load_average'][0]:.1f}): " + ", ".join(
            f"{label} {value * 100:+.1f} %" for label, value in entry["drift"].items())
            + f"; mean {entry['mean_drift'] * 100:+.1f} %")
        return entry["mean_drift"]

    drift_before = anchors("calibration")
    for name in names:
        config = workload_config(name, cost, layout, args.num_slots, args.max_requests)
        load_before = os.getloadavg()
        start = time.perf_counter()
        steps: list[dict] = []
        replayed = run_replay(config, model, description, clock=args.clock,
                              step_listener=lambda out, seconds: steps.append(
                                  {"seconds": seconds,
                                   "shape": asdict(step_shape(out, layout.attended))}))
        wall = time.perf_counter() - start
        load_after = os.getloadavg()
        simulated = run_simulation(config)
        real, sim = replayed.summary, simulated.summary
        rows = comparison_rows(real, sim)
        results["workloads"][name] = {
            "rows": rows, "replay_wall_s": wall,
            "load_average_before": load_before, "load_average_after": load_after,
            "real": real, "simulated": sim, "steps": steps,
            "requests": {"real": request_times(replayed), "simulated": request_times(simulated)},
        }
        print(f"\n### {name} (replay {wall:.0f} s wall, "
              f"load {load_before[0]:.1f} -> {load_after[0]:.1f})")
        print(format_comparison(rows, "real", "simulated"))
        print_diagnosis(name, results["workloads"][name], cost)
        drift_after = anchors(name)
        if drift_after is not None:
            results["workloads"][name]["drift"] = [drift_before, drift_after]
            drift_corrected(name, results["workloads"][name], cost, layout, args)
            drift_before = drift_after
        Path(args.out).write_text(json.dumps(results, indent=1, default=float) + "\n")
    print_targets(results)
    return 0


def simulate_only(args, cost, layout) -> int:
    """The simulations of an earlier run's workloads with `cost`, against its real summaries."""
    earlier = json.loads(Path(args.real).read_text())
    names = args.only.split(",") if args.only else list(earlier["workloads"])
    results = {**earlier, "layout": layout.to_dict(), "cost": cost.to_dict(),
               "real_from": args.real, "workloads": {}}
    for name in names:
        entry = earlier["workloads"][name]
        simulated = run_simulation(workload_config(name, cost, layout, args.num_slots,
                                                   args.max_requests))
        sim = simulated.summary
        rows = comparison_rows(entry["real"], sim)
        results["workloads"][name] = {**entry, "rows": rows, "simulated": sim}
        if "drift" in entry:
            drift_corrected(name, results["workloads"][name], cost, layout, args)
        if "requests" in entry:
            results["workloads"][name]["requests"] = {"real": entry["requests"]["real"],
                                                      "simulated": request_times(simulated)}
        print(f"\n### {name} (real from {args.real})")
        print(format_comparison(rows, "real", "simulated"))
        print_diagnosis(name, results["workloads"][name], cost)
    Path(args.out).write_text(json.dumps(results, indent=1, default=float) + "\n")
    print_targets(results)
    return 0


def print_targets(results: dict) -> None:
    """The summary table: each targeted metric's relative error, the mean
    step time's (the cost model without queueing), the anchors' drift
    before and after the replay when measured, and the verdict; then the
    same for the drift-corrected simulations, when there are any."""
    print_table(results["workloads"], "rows")
    corrected = {name: {**entry, **entry["drift_corrected"]}
                 for name, entry in results["workloads"].items() if "drift_corrected" in entry}
    if corrected:
        print("\nWith every coefficient scaled by 1 + the anchors' mean drift over the replay "
              "(the machine's change taken out):")
        print_table(corrected, "rows")


def print_table(workloads: dict, key: str) -> None:
    drifted = any("drift" in entry for entry in workloads.values())
    extra = [STEP] + (["anchor drift before -> after"] if drifted else [])
    print("\n| workload | " + " | ".join(TARGETED + tuple(extra)) + " | within 10 % |")
    print("|---|" + "---|" * (len(TARGETED) + len(extra) + 1))
    for name, entry in workloads.items():
        diffs = {label: diff for label, _, _, diff in entry[key]}
        cells = [f"{diffs[m] * 100:+.1f} %" if diffs.get(m) is not None else "n/a"
                 for m in TARGETED + (STEP,)]
        if drifted:
            cells.append(" -> ".join(f"{d * 100:+.1f} %" for d in entry.get("drift", ())) or "n/a")
        ok = all(diffs[m] is not None and abs(diffs[m]) <= TARGET for m in TARGETED)
        print(f"| {name} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |")


if __name__ == "__main__":
    raise SystemExit(main())
