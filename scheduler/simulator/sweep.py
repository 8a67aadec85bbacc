"""Parameter sweeps: one base config, a grid of overrides, parallel runs.

A grid spec is ``name=v1,v2;name2=v3,v4``: every combination is one point.
Names are the `SWEEP_PARAMS` below (each maps to one config field), and a
fleet's `replicas` and `router` (each point then a `fleet.Fleet`). Points
run in worker processes (`multiprocessing`, `jobs` at a time); each returns
its summary. The comparison is written as sweep.json, sweep.md and
sweep.png. Cost: one simulation per point, `jobs` in parallel.
"""

from __future__ import annotations

import copy
import itertools
import json
import multiprocessing
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from blockmgr.errors import InvalidArgument
from blockmgr.kv_format import parse_bytes
from scheduler.simulator.config import SimulationConfig, apply_kv_memory
from scheduler.simulator.fleet import FleetSpec, run_fleet
from scheduler.simulator.plots import PlottingUnavailable, plot_sweep
from scheduler.simulator.runner import run_simulation

#: Sweepable name -> (config section, field).
SWEEP_PARAMS: dict[str, tuple[str, str]] = {
    "num_blocks": ("block_manager", "num_blocks"),
    "block_size": ("block_manager", "block_size"),
    "num_slots": ("block_manager", "num_slots"),
    "enable_prefix_cache": ("block_manager", "enable_prefix_cache"),
    "watermark": ("block_manager", "watermark"),
    "sliding_window": ("block_manager", "sliding_window"),
    "num_host_blocks": ("block_manager", "num_host_blocks"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "policy": ("scheduler", "policy"),
    "preemption": ("scheduler", "preemption"),
    "long_prefill_token_threshold": ("scheduler", "long_prefill_token_threshold"),
    "checkpoint_prefill": ("scheduler", "checkpoint_prefill"),
    "rate": ("workload", "rate"),
    "concurrency": ("workload", "concurrency"),
    "arrival": ("workload", "arrival"),
    "workload": ("workload", "mix"),
    "num_requests": ("workload", "num_requests"),
    "seed": ("workload", "seed"),
    # a pool sized by a KV memory (--kv-memory): its page count follows these
    "kv_memory": ("kv_memory", "budget"),
    "kv_bits": ("kv_memory", "format"),
    "kv_key_bits": ("kv_memory", "key_bits"),
    "kv_value_bits": ("kv_memory", "value_bits"),
    "kv_group_size": ("kv_memory", "group_size"),
}

#: Sweepable names of a fleet (`fleet.FleetSpec`), not of a server's config.
FLEET_PARAMS = ("replicas", "router")

DEFAULT_GRID = "num_blocks=1024,2048,4096;enable_prefix_cache=true,false"


class SweepSpecError(ValueError):
    """A grid spec does not parse."""


def parse_grid(spec: str) -> dict[str, list]:
    """``a=1,2;b=x,y`` -> {"a": [1, 2], "b": ["x", "y"]}. Raises `SweepSpecError`."""
    grid: dict[str, list] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, eq, values = part.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or not values.strip():
            raise SweepSpecError(f"sweep entry {part!r} must look like name=v1,v2")
        if name not in SWEEP_PARAMS and name not in FLEET_PARAMS:
            raise SweepSpecError(
                f"cannot sweep {name!r} "
                f"(one of {', '.join(sorted([*SWEEP_PARAMS, *FLEET_PARAMS]))})"
            )
        if name in grid:
            raise SweepSpecError(f"{name!r} appears twice in the sweep")
        sep = "|" if name == "workload" else ","
        grid[name] = [_value(v.strip()) if name != "workload" else v.strip()
                      for v in values.split(sep) if v.strip()]
    if not grid:
        raise SweepSpecError("empty sweep spec")
    return grid


def _value(text: str):
    low = text.lower()
    if low in ("true", "on", "yes"):
        return True
    if low in ("false", "off", "no"):
        return False
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def grid_points(
    base: SimulationConfig, grid: dict[str, list], mix_parser
) -> list[tuple[dict, SimulationConfig]]:
    """Every combination as (params, config). Raises ValueError for a bad point."""
    names = list(grid)
    points = []
    for values in itertools.product(*(grid[n] for n in names)):
        params = dict(zip(names, values))
        data = copy.deepcopy(base.to_dict())
        for name, value in params.items():
            if name in FLEET_PARAMS:
                continue  # the point's fleet (`fleet_of`)
            section, key = SWEEP_PARAMS[name]
            if section == "kv_memory":
                _set_kv_memory(data, params, key, value)
                continue
            if name == "workload":
                value = mix_parser(value)
            if name == "preemption" and value == "swap" \
                    and not data["block_manager"].get("num_host_blocks"):
                data["block_manager"]["num_host_blocks"] = data["block_manager"]["num_blocks"]
            data[section][key] = value
        try:
            apply_kv_memory(data)  # a KV memory's page count at the point's block size
            config = SimulationConfig.from_dict(data)
            fleet_of(params, None)  # a bad replica count or router is refused here
        except ValueError as exc:
            raise InvalidArgument(f"sweep point {params}: {exc}") from None
        points.append((params, config))
    return points


def _set_kv_memory(data: dict, params: dict, key: str, value) -> None:
    """Set a kv_* sweep value in the config dict's kv_memory section:
    `budget` (a size such as 4GiB, or bytes), `format` (kv_bits: both sides;
    none for the model's dtype) or one format field. Raises `InvalidArgument`
    without a KV memory, or when num_blocks is swept beside it."""
    if data.get("kv_memory") is None:
        raise InvalidArgument(f"sweeping kv_* needs a pool sized by --kv-memory (and --kv-shape); "
                              f"got {params}")
    if "num_blocks" in params:
        raise InvalidArgument(
            "sweep num_blocks or the KV memory, not both (the memory sizes the pool)")
    memory = data["kv_memory"]
    if key == "budget":
        memory["budget"] = value if isinstance(value, int) else parse_bytes(str(value))
        return
    fmt = memory.setdefault("format", {})
    if key == "format":
        fmt["key_bits"] = fmt["value_bits"] = value
    else:
        fmt[key] = value


def fleet_of(params: dict, base: FleetSpec | None) -> FleetSpec | None:
    """The fleet of a point: `base` (the sweep's fleet options) with the
    point's `replicas` and `router`; None (one server) when neither gives
    one. Raises ValueError."""
    if base is None and not any(name in params for name in FLEET_PARAMS):
        return None
    base = base or FleetSpec()
    return replace(base, num_replicas=params.get("replicas", base.num_replicas),
                   router=params.get("router", base.router))


def _run_point(args) -> dict:
    index, params, config_dict, fleet_dict = args
    config = SimulationConfig.from_dict(config_dict)
    fleet = fleet_of(params, None if fleet_dict is None else FleetSpec.from_dict(fleet_dict))
    summary = (run_simulation(config) if fleet is None else run_fleet(config, fleet)).summary
    return {"index": index, "params": params, "config": config_dict, "summary": summary}


def run_sweep(
    points: list[tuple[dict, SimulationConfig]],
    jobs: int = 2,
    on_done: Callable[[dict], None] | None = None,
    ray_address: str | None = None,
    fleet: FleetSpec | None = None,
) -> list[dict]:
    """Run every point (on the Ray cluster at `ray_address` when given, "local"
    for a private one of `jobs` CPUs; else in `jobs` processes when > 1);
    rows in grid order. `fleet`: every point is a fleet of this size and
    router, unless the point names its own (`FLEET_PARAMS`)."""
    base = None if fleet is None else fleet.to_dict()
    tasks = [(i, params, cfg.to_dict(), base) for i, (params, cfg) in enumerate(points)]
    rows: list[dict] = []
    if ray_address is not None:
        from scheduler.simulator.sweep_ray import run_on_ray

        rows = run_on_ray(tasks, ray_address, _run_point, on_done, num_cpus=jobs)
    elif jobs <= 1 or len(tasks) == 1:
        for task in tasks:
            rows.append(_run_point(task))
            if on_done:
                on_done(rows[-1])
    else:
        with _context().Pool(processes=min(jobs, len(tasks))) as pool:
            for row in pool.imap_unordered(_run_point, tasks):
                rows.append(row)
                if on_done:
                    on_done(row)
    rows.sort(key=lambda r: r["index"])
    return [_flatten(row) for row in rows]


def _context():
    """fork when safe (fast); spawn when MLX threads live in this process
    (forking them can deadlock) or fork is unavailable."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _flatten(row: dict) -> dict:
    s = row["summary"]
    return {
        **row,
        "requests_per_s": s["throughput"]["requests_per_s"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": s["latency"]["ttft_s"]["p50"],
        "ttft_p99_s": s["latency"]["ttft_s"]["p99"],
        "tpot_p50_s": s["latency"]["tpot_s"]["p50"],
        "hit_rate": s["prefix_cache"]["hit_rate"],
        "page_usage_mean": s["memory"]["page_usage_mean"],
        "fragmentation_mean": s["memory"]["fragmentation_mean"],
        "preemptions": s["preemptions"]["total"],
        "evicted_pages": s["evictions"]["pages"],
        "bookkeeping_us_per_step": s["bookkeeping"]["per_step_us"]["mean"],
        "wall_seconds": s["bookkeeping"]["wall_seconds"],
    }


COLUMNS = (
    ("requests_per_s", "req/s", "{:.2f}"),
    ("output_tokens_per_s", "out tok/s", "{:.0f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("tpot_p50_s", "TPOT p50 ms", "{:.1f}"),
    ("hit_rate", "hit %", "{:.1f}"),
    ("page_usage_mean", "pages %", "{:.1f}"),
    ("fragmentation_mean", "frag %", "{:.2f}"),
    ("preemptions", "preempt", "{}"),
    ("evicted_pages", "evicted", "{}"),
    ("wall_seconds", "wall s", "{:.1f}"),
)
_SCALE = {"hit_rate": 100, "page_usage_mean": 100, "fragmentation_mean": 100, "tpot_p50_s": 1000}


def table_rows(rows: list[dict], params: list[str]) -> tuple[list[str], list[list[str]]]:
    header = list(params) + [title for _, title, _ in COLUMNS]
    body = []
    for row in rows:
        cells = [str(row["params"][p]) for p in params]
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            if value is None:
                cells.append("n/a")
            else:
                cells.append(fmt.format(value * _SCALE.get(key, 1)))
        body.append(cells)
    return header, body


def format_text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def write_sweep(
    rows: list[dict], params: list[str], out_dir: str | Path, plots: bool = True
) -> tuple[Path, str | None]:
    """sweep.json, sweep.md (the table) and sweep.png into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"params": params, "points": rows}, indent=1) + "\n")
    header, body = table_rows(rows, params)
    md = ["# blockmgr sweep", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in body]
    note = None
    if plots:
        try:
            plot_sweep(rows, params, out / "sweep.png")
            md += ["", "![sweep](sweep.png)"]
        except PlottingUnavailable as exc:
            note = str(exc)
    (out / "sweep.md").write_text("\n".join(md) + "\n")
    return out, note
