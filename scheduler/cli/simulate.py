"""The simulator's commands: simulate (one run, a sweep, a fleet), replay
(the same workload through the real engine), calibrate, compare; and the
report folder and table every run writes (`write_and_print`)."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.cli.arguments import parse_mix
from scheduler.cli.config import build_config, check_pool_sizes, check_trace
from scheduler.cli.options import DEFAULT_OUT


def progress_bar(args, total: int, unit: str, desc: str, **options: Any) -> Any:
    """A tqdm bar on stderr for `total` `unit`s, or None: with
    --no-progress, when stderr is not a terminal, or without tqdm."""
    if args.no_progress or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, **options)


def _simulation_bar(args, total: int):
    """The bar of a simulation and the runner's progress callback advancing
    it (both None without a bar)."""
    bar = progress_bar(args, total, "req", "simulating", dynamic_ncols=True)
    if bar is None:
        return None, None
    state = {"done": 0}

    def update(done: int, submitted: int, sim_time: float) -> None:
        bar.update(done - state["done"])
        state["done"] = done
        bar.set_postfix_str(f"t={sim_time:,.0f}s sim", refresh=False)

    return bar, update


def _total_requests(config) -> int:
    """Requests the run will submit (a trace is read, and validated, once more)."""
    if config.trace is None:
        return config.workload.num_requests
    from scheduler.simulator.trace import TraceWarning, read_trace

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        _, sessions = read_trace(config.trace, config.trace_block_tokens, config.time_scale)
    for warning in caught:
        print(f"blockmgr: warning: {warning.message}", file=sys.stderr)
    return sum(len(session) for session in sessions)


def cmd_simulate(args) -> int:
    from scheduler.simulator.runner import run_simulation
    from scheduler.simulator.trace import write_trace
    from scheduler.simulator.workloads import generate

    config = build_config(args)
    if config.trace is not None:
        check_trace(config)
    if args.sweep is not None:
        return cmd_sweep(args, config)
    for option in ("jobs", "ray"):
        if getattr(args, option) is not None:
            raise ValueError(f"--{option} only applies to --sweep")
    if args.write_trace is not None:
        try:
            write_trace(args.write_trace, generate(config.workload),
                        {"vocab_size": config.vocab_size, "workload": config.workload.to_dict()})
        except OSError as exc:
            raise ValueError(f"cannot write trace {args.write_trace}: {exc.strerror}") from None
    fleet = fleet_of(args)
    if fleet is not None:
        from scheduler.simulator.fleet import run_fleet
        from scheduler.simulator.fleet_report import fleet_rows, write_fleet_report

        result = _run_with_progress(args, config,
                                    lambda update: run_fleet(config, fleet, progress=update))
        return write_and_print(args, result, "blockmgr simulate (fleet)",
                               write=write_fleet_report, rows=fleet_rows)
    result = _run_with_progress(args, config,
                                lambda update: run_simulation(config, progress=update))
    return write_and_print(args, result, "blockmgr simulate")


def fleet_of(args):
    """The fleet `--replicas`, `--router`, `--cores`, `--background`,
    `--step-jitter` and `--fleet-seed` ask for (None: one server)."""
    if args.replicas is None and args.router is None and args.cores is None \
            and args.step_jitter is None:
        if args.background is not None:
            raise ValueError("--background needs --cores (the machine the replicas share)")
        if args.fleet_seed is not None:
            raise ValueError("--fleet-seed needs --step-jitter (the draws it seeds)")
        return None
    from scheduler.simulator.fleet import FleetSpec

    return FleetSpec(args.replicas or 1, args.router or "round_robin", args.cores,
                     args.background or 0.0, args.step_jitter or 0.0, args.fleet_seed or 0)


def cmd_replay(args) -> int:
    from scheduler.simulator.engine_models import load_model, vocab_size
    from scheduler.simulator.replay import run_replay

    if args.write_trace is not None:
        raise ValueError("--write-trace applies to simulate; replay a written trace with --trace")
    config = build_config(args)
    model, description = load_model(model_spec(args))
    if config.vocab_size > vocab_size(description):
        from scheduler.simulator.config import SimulationConfig

        config = SimulationConfig.from_dict({**config.to_dict(),
                                             "vocab_size": vocab_size(description)})
    result = _run_with_progress(args, config,
                                lambda update: run_replay(config, model, description,
                                                          progress=update, clock=args.clock))
    return write_and_print(args, result, "blockmgr replay")


def model_spec(args):
    from scheduler.simulator.engine_models import ModelSpec

    return ModelSpec(path=args.model, preset=args.preset, layers=args.layers,
                     shape=args.shape or {})


def _run_with_progress(args, config, run):
    """`run(progress_callback)` under a progress bar; trace errors become ValueError."""
    from scheduler.simulator.trace import TraceError, TraceWarning

    try:
        bar, update = _simulation_bar(args, _total_requests(config))
        try:
            with warnings.catch_warnings():  # _total_requests has reported them
                warnings.simplefilter("ignore", TraceWarning)
                return run(update)
        finally:
            if bar is not None:
                bar.close()
    except TraceError as exc:
        raise ValueError(str(exc)) from None


def write_and_print(args, result, title: str, write=None, rows=None) -> int:
    """Write the report folder (`write`, default the simulator's) and print
    its table (`rows` of the summary, default `summary_rows`)."""
    from scheduler.simulator.report import format_table, summary_rows, write_report

    write, rows = write or write_report, rows or summary_rows
    out_dir = Path(args.out or DEFAULT_OUT)
    try:
        folder, plots, note = write(result, out_dir, plots=not args.no_plots)
    except OSError as exc:
        raise ValueError(f"cannot write the report to {out_dir}: {exc.strerror}") from None
    if note:
        print(f"blockmgr: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.summary, indent=1))
    else:
        print(format_table(rows(result.summary), title))
        print(f"report: {folder / 'report.md'} ({len(plots)} plots), {folder / 'report.json'}")
    return 0


def _bar_progress(bar: Any) -> Callable[[str], None] | None:
    """A calibration progress callback advancing a tqdm `bar` (None without one)."""
    if bar is None:
        return None

    def progress(label: str) -> None:
        bar.update(1)
        bar.set_postfix_str(label)

    return progress


def cmd_calibrate(args) -> int:
    from dataclasses import replace

    from scheduler.simulator.calibrate import QUICK_GRID, CalibrationGrid, calibrate
    from scheduler.simulator.engine_models import load_model
    from scheduler.simulator.profile import write_profile

    grid = QUICK_GRID if args.quick else CalibrationGrid()
    if args.repeats is not None:
        grid = replace(grid, repeats=args.repeats)
    model, description = load_model(model_spec(args))
    bar = progress_bar(args, grid.num_points, "point", "calibrating")
    try:
        profile = calibrate(model, description, grid, progress=_bar_progress(bar),
                            clock=args.clock, disk_cache=args.disk_cache)
    finally:
        if bar is not None:
            bar.close()
    try:
        write_profile(args.out, profile)
    except OSError as exc:
        raise ValueError(f"cannot write the profile {args.out}: {exc.strerror}") from None
    fit, blas = profile.fit, profile.machine["blas"]
    print(f"blockmgr calibrate: {fit['num_steps']} steps, per-step error median "
          f"{fit['median_abs_rel_error'] * 100:.1f} %, "
          f"mean {fit['mean_abs_rel_error'] * 100:.1f} %; "
          f"BLAS {blas['name']} ({blas['matmul_1024_gflops']:.0f} GFLOPS)")
    worst = sorted(fit["points"], key=lambda p: -abs(p["rel_error"]))[:3]
    print("blockmgr calibrate: worst grid points (mean step, predicted vs measured): "
          + ", ".join(f"{p['label']} {p['rel_error'] * 100:+.1f} %" for p in worst))
    if not blas["optimized"]:
        print("blockmgr calibrate: warning: MLX runs on the reference BLAS; preload an optimized "
              "one (LD_PRELOAD=.../libopenblas.so.0) for realistic figures", file=sys.stderr)
    _print_tier_moves(profile.grid["tier_moves"])
    print(f"profile: {args.out}")
    return 0


def _print_tier_moves(moves: dict) -> None:
    """One line: the tier moves `blockmgr calibrate` timed (per page) and
    the bandwidths they imply."""
    mib = 2**20
    print(f"blockmgr calibrate: tier moves per page of {moves['record_nbytes']} bytes: host "
          f"{moves['host_move_per_page'] * 1e6:.1f} us ({moves['host_copy_bytes_per_s'] / mib:.0f}"
          f" MiB/s), disk store {moves['disk_store_per_page'] * 1e6:.1f} us, disk load "
          f"{moves['disk_load_per_page'] * 1e6:.1f} us; disk write "
          f"{moves['disk_write_bytes_per_s'] / mib:.0f} MiB/s, read "
          f"{moves['disk_read_bytes_per_s'] / mib:.0f} MiB/s"
          f"{'' if moves['cold_reads'] else ' (reads may come from the OS cache)'}")


def cmd_compare(args) -> int:
    from scheduler.simulator.report import comparison_rows, format_comparison

    summaries = [_load_summary(path) for path in args.reports]
    rows = comparison_rows(*summaries)
    if args.json:
        print(json.dumps([dict(zip(("metric", "first", "second", "difference"), r)) for r in rows],
                         indent=1))
    else:
        print(format_comparison(rows, *args.reports))
    return 0


def _load_summary(path: str) -> dict:
    target = Path(path)
    from scheduler.simulator.json_file import read_json

    if target.is_dir():
        target = target / "report.json"
    data = read_json(target, "report")
    if not isinstance(data, dict) or "summary" not in data:
        raise ValueError(f"{target} is not a report.json (no summary)")
    return data["summary"]


def cmd_sweep(args, base) -> int:
    from scheduler.simulator.sweep import (
        DEFAULT_GRID,
        format_text_table,
        grid_points,
        parse_grid,
        run_sweep,
        table_rows,
        write_sweep,
    )

    if args.trace is None and args.write_trace is not None:
        raise ValueError("--write-trace cannot be combined with --sweep")
    spec = DEFAULT_GRID if args.sweep == "default" else args.sweep
    grid = parse_grid(spec)
    if args.num_requests is None and args.config is None and "num_requests" not in grid:
        data = base.to_dict()
        data["workload"]["num_requests"] = 1000  # a sweep runs many points
        from scheduler.simulator.config import SimulationConfig

        base = SimulationConfig.from_dict(data)
    points = grid_points(base, grid, parse_mix)
    for params, point in points:
        try:
            check_pool_sizes(dataclasses.asdict(point.block_manager))
        except ValueError as exc:
            raise ValueError(f"sweep point {params}: {exc}") from None
    jobs = args.jobs or 2
    bar = progress_bar(args, len(points), "run", "sweep")
    rows = run_sweep(points, jobs=jobs, on_done=(lambda row: bar.update(1)) if bar else None,
                     ray_address=args.ray, fleet=fleet_of(args))
    if bar is not None:
        bar.close()
    names = list(grid)
    out_dir = Path(args.out or DEFAULT_OUT)
    folder, note = write_sweep(rows, names, out_dir, plots=not args.no_plots)
    if note:
        print(f"blockmgr: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps([{"params": r["params"], "summary": r["summary"]} for r in rows],
                         indent=1))
    else:
        header, body = table_rows(rows, names)
        print(format_text_table(header, body))
        print(f"sweep: {folder / 'sweep.md'}, {folder / 'sweep.json'}")
    return 0
