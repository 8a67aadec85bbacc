"""The report folder of a run: report.json, plots, report.md; the summary table.

report.json holds the full config (rerun with `blockmgr simulate --config
report.json`), every summary metric, and the timelines downsampled to at
most `TIMELINE_POINTS` points. Writing is O(steps + requests).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from blockmgr.kv_format import format_bytes
from scheduler.simulator.group_usage import group_rows
from scheduler.simulator.kv_memory import KVMemory
from scheduler.simulator.layout import ModelLayout, describe_layout
from scheduler.simulator.metrics import MEMORY_FIELDS, STEP_FIELDS
from scheduler.simulator.plots import PlottingUnavailable, plot_run

REPORT_VERSION = 1
TIMELINE_POINTS = 400

#: Summary sections that depend on the machine (real time), not on the seed.
NONDETERMINISTIC = ("bookkeeping",)


def downsample(series: dict[str, np.ndarray], points: int = TIMELINE_POINTS) -> dict[str, list]:
    """Every series sampled at the same <= `points` evenly spaced indices."""
    lengths = {len(v) for v in series.values()}
    n = max(lengths) if lengths else 0
    if n == 0:
        return {name: [] for name in series}
    index = np.unique(np.linspace(0, n - 1, min(points, n)).round().astype(int))
    return {name: [_num(x) for x in np.asarray(values)[index]] for name, values in series.items()}


def _num(x) -> float | int:
    x = float(x)
    return int(x) if x.is_integer() and abs(x) < 2**53 else x


def build_report(result, plots: list[str]) -> dict:
    """The JSON document of a run."""
    metrics = result.metrics
    return {
        "version": REPORT_VERSION,
        "config": result.config.to_dict(),
        "summary": result.summary,
        "timeline": {
            "steps": downsample({k: v for k, v in metrics.step_arrays().items()
                                 if k in STEP_FIELDS}),
            "memory": downsample({k: v for k, v in metrics.memory_arrays().items()
                                  if k in MEMORY_FIELDS}),
        },
        "plots": plots,
        "environment": {"python": platform.python_version(), "machine": platform.machine()},
    }


def write_report(
    result, out_dir: str | Path, plots: bool = True
) -> tuple[Path, list[str], str | None]:
    """Write report.json, the PNGs and report.md into `out_dir` (created).

    Returns (folder, plot file names, a note if plots were skipped).
    """
    def plot(out: Path) -> list[str]:
        metrics = result.metrics
        return plot_run(metrics.step_arrays(), metrics.memory_arrays(), metrics.request_arrays(),
                        result.config.block_manager.num_blocks, out,
                        groups=(metrics.groups.windows, metrics.groups.arrays()))

    return write_folder(out_dir, plot if plots else None,
                        lambda names: build_report(result, names), render_markdown)


def write_folder(out_dir: str | Path, plot: Callable[[Path], list[str]] | None,
                 build: Callable[[list[str]], dict],
                 render: Callable[[dict, str | None], str]) -> tuple[Path, list[str], str | None]:
    """A report folder: `plot(folder)` draws the PNGs (None: no plots),
    `build(plot names)` is report.json, `render(report, note)` report.md.
    Returns (folder, plot file names, a note if plots were skipped)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    note = None
    if plot is not None:
        try:
            names = plot(out)
        except PlottingUnavailable as exc:
            note = str(exc)
    report = build(names)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    (out / "report.md").write_text(render(report, note))
    return out, names, note


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """(metric, value) rows of the headline numbers, for tables."""
    req = summary["requests"]
    pc, mem, pre = summary["prefix_cache"], summary["memory"], summary["preemptions"]
    book = summary["bookkeeping"]
    rows = [
        ("requests finished / aborted", f"{req['finished']} / {req['aborted']}"),
        *time_rows(summary),
        ("prefix hit rate (token-weighted)", f"{pc['hit_rate'] * 100:.1f} %"),
        *_bound_rows(pc),
        ("page usage peak / mean",
         f"{mem['page_usage_peak'] * 100:.1f} % / {mem['page_usage_mean'] * 100:.1f} %"
         f" of {mem['num_blocks']} pages"),
        ("internal fragmentation mean", f"{mem['fragmentation_mean'] * 100:.2f} %"),
        ("pages saved by sharing mean / peak", f"{mem['sharing_saved_mean'] * 100:.1f} % / "
                                               f"{mem['sharing_saved_peak'] * 100:.1f} %"),
        *group_rows(mem.get("groups", [])),
        *_slot_rows(summary.get("slots")),
        ("preemptions recompute / swap", f"{pre['recompute']} / {pre['swap']}"),
        ("evicted pages / trie nodes",
         f"{summary['evictions']['pages']} / {summary['evictions']['nodes']}"),
        ("trie nodes final / peak",
         f"{summary['trie']['nodes_final']} / {summary['trie']['nodes_peak']}"),
        ("steps", f"{summary['steps']['count']}"),
        ("bookkeeping per step mean / p99", format_pair(book["per_step_us"], "us", fmt="{:.0f}")),
        ("wall time", f"{book['wall_seconds']:.2f} s"),
    ]
    rows += abort_rows(req)
    if "checks" in summary:
        checks = summary["checks"]
        rows.append(("integrity checks / leak check",
                     f"{checks['integrity_checks']} / {checks['leaks']}"))
    return rows


def time_rows(summary: dict) -> list[tuple[str, str]]:
    """The rows of simulated time, throughput and latency."""
    thr, lat = summary["throughput"], summary["latency"]
    return [
        ("simulated time", f"{thr['simulated_seconds']:.1f} s"),
        ("throughput",
         f"{thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.0f} out tok/s"),
        ("TTFT p50 / p99", format_pair(lat["ttft_s"], "s")),
        ("time per output token p50 / p99",
         format_pair(lat["tpot_s"], "ms", scale=1000, fmt="{:.1f}")),
        ("end-to-end p50 / p99", format_pair(lat["e2e_s"], "s")),
    ]


def abort_rows(requests: dict) -> list[tuple[str, str]]:
    """One row per reason requests were aborted, with their count."""
    return [(f"aborted x{count}", reason)
            for reason, count in requests.get("abort_reasons", {}).items()]


def _bound_rows(pc: dict) -> list[tuple[str, str]]:
    """The trace's infinite-cache hit rate beside the first-admission one."""
    bound = pc.get("infinite_cache_hit_rate")
    if bound is None:
        return []
    return [("first-admission hit rate / infinite cache",
             f"{pc['first_admission_hit_rate'] * 100:.1f} % / {bound * 100:.1f} %")]


def _slot_rows(slots: dict | None) -> list[tuple[str, str]]:
    if not slots:
        return []
    return [("recurrent slots used peak / mean",
             f"{slots['used_peak']} / {slots['used_mean']:.0f} of {slots['num_slots']}")]


def format_pair(dist: dict, unit: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    """"p50 / p99 unit" of a distribution dict."""
    if dist.get("p50") is None:
        return "n/a"
    return f"{fmt.format(dist['p50'] * scale)} / {fmt.format(dist['p99'] * scale)} {unit}"


def format_table(rows: list[tuple[str, str]], title: str | None = None) -> str:
    """A plain two-column table for the terminal."""
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def render_markdown(report: dict, note: str | None = None) -> str:
    cfg = report["config"]
    wl = cfg["workload"]
    bm = cfg["block_manager"]
    lines = [
        "# blockmgr simulation report",
        "",
        f"Workload {_mix(wl['mix'])}, {wl['num_requests']} requests, arrival {wl['arrival']}"
        + (f" at {wl['rate']} sessions/s" if wl["arrival"] == "poisson"
           else f", {wl['concurrency']} clients")
        + f", seed {wl['seed']}" + _trace_note(cfg) + ".",
        *_layout_line(cfg.get("layout")),
        f"Pool {bm['num_blocks']} pages x {bm['block_size']} tokens"
        + (" per page group" if _num_groups(cfg.get("layout")) > 1 else "")
        + (f", {bm['num_slots']} recurrent slots (hybrid)" if bm.get("num_slots") else "")
        + _kv_memory_note(cfg)
        + (", prefix cache on" if bm["enable_prefix_cache"] else ", prefix cache off") + ".",
        _time_note(report["summary"]),
        "Every metric and the full config are in `report.json`.",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(report["summary"])]
    lines.append("")
    kinds = report["summary"]["requests"]["by_workload"]
    if len(kinds) > 1:
        lines += ["| workload | requests | mean prompt | hit rate (first admission) "
                  "| TTFT p50 / p99 s | e2e p50 s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {v['requests']} | {v['mean_prompt_tokens']:.0f} | "
                  f"{v['first_admission_hit_rate'] * 100:.1f} % | {v['ttft_p50_s']:.3f} / "
                  f"{v['ttft_p99_s']:.3f} | {v['e2e_p50_s']:.2f} |" for k, v in kinds.items()]
        lines.append("")
    if note:
        lines += [f"*{note}*", ""]
    captions = {
        "page_usage.png": "Page usage over time",
        "queues.png": "Queue lengths",
        "prefix_hit_rate.png": "Prefix hit rate over time",
        "preemptions.png": "Preemptions",
        "memory.png": "Sharing and fragmentation",
        "latency.png": "Latency distributions (CDF; dotted: p50, p99)",
    }
    for name in report.get("plots", []):
        lines += [f"## {captions.get(name, name)}", "",
                  f"![{captions.get(name, name)}]({name})", ""]
    return "\n".join(lines)


def _layout_line(layout: dict | None) -> list[str]:
    """"Layout <name> (<ratio>; page groups: ...)." ([] for a report
    without one)."""
    if layout is None:
        return []
    return [f"Layout {describe_layout(ModelLayout.from_dict(layout))}."]


def _num_groups(layout: dict | None) -> int:
    return 1 if layout is None else len(ModelLayout.from_dict(layout).windows)


def _time_note(summary: dict) -> str:
    engine = summary.get("engine")
    if engine is None:
        return ("All times are simulated seconds from the cost model, except bookkeeping "
                "and wall time.")
    blas = engine["machine"]["blas"]
    return (f"Real engine on {engine['model']}: all times are engine step times on this machine "
            f"(idle gaps between arrivals skipped), BLAS {blas['name']} "
            f"({blas['matmul_1024_gflops']:.0f} GFLOPS).")


def _kv_memory_note(cfg: dict) -> str:
    """", k8v4-g64 pages of 1.50 MiB from a KV memory of 4.00 GiB" when the
    pool was sized by a KV memory (`KVMemory`), else nothing."""
    if cfg.get("kv_memory") is None:
        return ""
    memory = KVMemory.from_dict(cfg["kv_memory"])
    page = memory.page_bytes(cfg["block_manager"]["block_size"])
    return (f", {memory.format.name} pages of {format_bytes(page)} from a KV memory of "
            f"{format_bytes(memory.budget)}")


def _trace_note(cfg: dict) -> str:
    if not cfg.get("trace"):
        return ""
    note = f", replayed from `{cfg['trace']}`"
    if cfg.get("trace_block_tokens"):
        note += f" with {cfg['trace_block_tokens']}-token prefix blocks"
    if cfg.get("time_scale", 1.0) != 1.0:
        note += f", times x {cfg['time_scale']:g}"
    return note


def _mix(mix: dict) -> str:
    if len(mix) == 1:
        return next(iter(mix))
    total = sum(mix.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in mix.items())



#: (label, path into the summary) of the metrics two runs are compared on.
COMPARED = (
    ("throughput, output tok/s", ("throughput", "output_tokens_per_s")),
    ("throughput, requests/s", ("throughput", "requests_per_s")),
    ("TTFT p50, s", ("latency", "ttft_s", "p50")),
    ("TTFT p90, s", ("latency", "ttft_s", "p90")),
    ("TTFT p99, s", ("latency", "ttft_s", "p99")),
    ("TPOT p50, s", ("latency", "tpot_s", "p50")),
    ("TPOT p90, s", ("latency", "tpot_s", "p90")),
    ("mean step time, s", ("steps", "mean_step_time_s")),  # the cost model alone, no queueing
    ("prefix hit rate", ("prefix_cache", "hit_rate")),
    ("peak pages used", ("memory", "pages_used_peak")),
    ("preemptions", ("preemptions", "total")),
)


def comparison_rows(
    first: dict, second: dict
) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, first, second, second / first - 1) for every `COMPARED` metric;
    the difference is None when either value is missing or the first is 0."""
    rows = []
    for label, path in COMPARED:
        a, b = _at(first, path), _at(second, path)
        diff = b / a - 1 if a and b is not None else None
        rows.append((label, a, b, diff))
    return rows


def _at(summary: dict, path: tuple[str, ...]) -> float | None:
    value: Any = summary  # a nested section, then the number at the path
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)


def format_comparison(rows, first_name: str, second_name: str) -> str:
    """A markdown table of `comparison_rows`."""
    lines = [f"| metric | {first_name} | {second_name} | difference |", "|---|---|---|---|"]
    for label, a, b, diff in rows:
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | "
                     f"{'n/a' if diff is None else f'{diff * 100:+.1f} %'} |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}"
