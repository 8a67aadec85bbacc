"""The report folder of a fleet run: report.json, report.md, plots; its tables.

report.json holds one server's config (`config`: rerun one replica's setup
with `blockmgr simulate --config report.json`, and the fleet with
`--replicas N --router NAME`), the fleet (`fleet`), the fleet's summary
with each replica's (`summary.replicas`) and the routing, and each
replica's timelines downsampled. Plots: per replica (requests routed, hit
rate, TTFT, page usage), page usage and hit rate over time per replica,
and the fleet's latency distributions. Writing is O(steps + requests).
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from scheduler.simulator.fleet import FleetResult
from scheduler.simulator.metrics import MetricsRecorder
from scheduler.simulator.plots import plot_latency, pyplot, save_figure
from scheduler.simulator.report import (
    REPORT_VERSION,
    abort_rows,
    downsample,
    format_pair,
    render_markdown,
    time_rows,
    write_folder,
)

#: Step series of each replica kept in report.json.
_REPLICA_SERIES = ("time", "page_usage", "running", "waiting", "query_tokens", "hit_tokens")


def fleet_rows(summary: dict) -> list[tuple[str, str]]:
    """(metric, value) rows of the fleet's headline numbers."""
    req = summary["requests"]
    pc, mem, routing = summary["prefix_cache"], summary["memory"], summary["routing"]
    counts = routing["requests"]
    fleet = f"{routing['replicas']} replicas, router {routing['router']}"
    if "step_jitter" in summary:
        jitter = summary["step_jitter"]
        fleet += f", step jitter {jitter['sigma']:g} (seed {jitter['seed']})"
    rows = [
        ("fleet", fleet),
        ("requests finished / aborted", f"{req['finished']} / {req['aborted']}"),
        ("requests per replica min / max", f"{min(counts)} / {max(counts)}"),
        *time_rows(summary),
        ("prefix hit rate (token-weighted)", f"{pc['hit_rate'] * 100:.1f} %"),
        ("prompt tokens computed", f"{pc['prompt_tokens_computed']:,} of "
                                   f"{req['prompt_tokens']:,}"),
        *_bound_row(pc),
        ("page usage peak / mean", f"{mem['page_usage_peak'] * 100:.1f} % / "
                                   f"{mem['page_usage_mean'] * 100:.1f} % of "
                                   f"{mem['num_blocks']} pages a replica"),
        ("preemptions", f"{summary['preemptions']['total']}"),
        ("evicted pages", f"{summary['evictions']['pages']}"),
        ("steps (all replicas)", f"{summary['steps']['count']}"),
        ("wall time", f"{summary['bookkeeping']['wall_seconds']:.2f} s"),
    ]
    rows += abort_rows(req)
    if "checks" in summary:
        checks = summary["checks"]
        rows.append(("integrity checks / leak checks",
                     f"{checks['integrity_checks']} / {checks['leaks']}"))
    return rows


def _bound_row(pc: dict) -> list[tuple[str, str]]:
    bound = pc.get("infinite_cache_hit_rate")
    if bound is None:
        return []
    return [("infinite-cache hit rate (one server, no eviction)", f"{bound * 100:.1f} %")]


#: (title, value of a replica's summary) of the per-replica table.
REPLICA_COLUMNS = (
    ("requests", lambda s: f"{s['requests']['finished'] + s['requests']['aborted']}"),
    ("hit %", lambda s: f"{s['prefix_cache']['hit_rate'] * 100:.1f}"),
    ("TTFT p50 / p99 s", lambda s: format_pair(s["latency"]["ttft_s"], "").strip()),
    ("out tok/s", lambda s: f"{s['throughput']['output_tokens_per_s']:.0f}"),
    ("pages mean %", lambda s: f"{s['memory']['page_usage_mean'] * 100:.1f}"),
    ("preempt", lambda s: f"{s['preemptions']['total']}"),
    ("evicted", lambda s: f"{s['evictions']['pages']}"),
)


def replica_table(summary: dict) -> list[str]:
    """Markdown lines of one row per replica."""
    lines = ["| replica | " + " | ".join(t for t, _ in REPLICA_COLUMNS) + " |",
             "|---" * (len(REPLICA_COLUMNS) + 1) + "|"]
    for i, s in enumerate(summary["replicas"]):
        lines.append(f"| {i} | " + " | ".join(cell(s) for _, cell in REPLICA_COLUMNS) + " |")
    return lines


def build_fleet_report(result: FleetResult, plots: list[str]) -> dict:
    return {
        "version": REPORT_VERSION,
        "config": result.config.to_dict(),
        "fleet": result.fleet.to_dict(),
        "summary": result.summary,
        "timeline": {
            "replicas": [downsample({k: v for k, v in r.metrics.step_arrays().items()
                                     if k in _REPLICA_SERIES}) for r in result.replicas],
        },
        "plots": plots,
        "environment": {"python": platform.python_version(), "machine": platform.machine()},
    }


def write_fleet_report(result: FleetResult, out_dir: str | Path,
                       plots: bool = True) -> tuple[Path, list[str], str | None]:
    """report.json, the PNGs and report.md into `out_dir` (created).
    Returns (folder, plot file names, a note if plots were skipped)."""
    return write_folder(out_dir, (lambda out: plot_fleet(result, out)) if plots else None,
                        lambda names: build_fleet_report(result, names), render_fleet_markdown)


def render_fleet_markdown(report: dict, note: str | None = None) -> str:
    """report.md: one server's setup (as a one-server report says it), the
    fleet table, the replica table, the plots."""
    fleet = report["fleet"]
    one = render_markdown({**report, "summary": report["summary"]["replicas"][0], "plots": []})
    setup = one.split("\n| metric | value |")[0].replace(
        "# blockmgr simulation report", "# blockmgr fleet simulation report")
    lines = [setup.rstrip(), "",
             f"{fleet['replicas']} replicas of that server behind the `{fleet['router']}` "
             "router; the pool is each replica's. Metrics of the whole fleet:", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in fleet_rows(report["summary"])]
    lines += ["", "Each replica:", "", *replica_table(report["summary"]), ""]
    if note:
        lines += [f"*{note}*", ""]
    for name in report.get("plots", []):
        title = _CAPTIONS.get(name, name)
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    return "\n".join(lines)


_CAPTIONS = {
    "replicas.png": "Each replica: requests, hit rate, TTFT, page usage",
    "replica_pages.png": "Page usage over time, each replica",
    "replica_hit_rate.png": "Cumulative prefix hit rate over time, each replica",
    "latency.png": "Latency distributions of the fleet (CDF; dotted: p50, p99)",
}


def plot_fleet(result: FleetResult, out_dir: Path) -> list[str]:
    """The fleet's PNGs; returns their names. Raises `PlottingUnavailable`."""
    plt = pyplot()
    summaries = result.summary["replicas"]
    x = np.arange(len(summaries))
    series = (
        ("requests routed", [s["requests"]["finished"] + s["requests"]["aborted"]
                             for s in summaries]),
        ("prefix hit rate %", [s["prefix_cache"]["hit_rate"] * 100 for s in summaries]),
        ("TTFT p50 s", [s["latency"]["ttft_s"]["p50"] or 0 for s in summaries]),
        ("page usage mean %", [s["memory"]["page_usage_mean"] * 100 for s in summaries]),
    )
    fig, axes = plt.subplots(len(series), 1, figsize=(max(6, 0.25 * len(x) + 3), 2.2 * len(series)))
    for ax, (title, values) in zip(axes, series):
        ax.bar(x, values)
        ax.set_title(title, fontsize=9)
        if len(x) <= 32:  # one tick a replica while they stay readable
            ax.set_xticks(x)
    axes[-1].set_xlabel("replica")
    names = [save_figure(fig, out_dir / "replicas.png")]
    steps = [r.metrics.step_arrays() for r in result.replicas]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, s in enumerate(steps):
        ax.plot(s["time"], s["page_usage"] * 100, lw=0.8, label=f"replica {i}")
    ax.set(xlabel="simulated time (s)", ylabel="% of its pool", title="Page usage, each replica",
           ylim=(0, 105))
    _legend(ax, len(steps))
    names.append(save_figure(fig, out_dir / "replica_pages.png"))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, s in enumerate(steps):
        rate = np.divide(s["hit_tokens"], s["query_tokens"], out=np.zeros_like(s["time"]),
                         where=s["query_tokens"] > 0)
        ax.plot(s["time"], rate * 100, lw=0.8, label=f"replica {i}")
    ax.set(xlabel="simulated time (s)", ylabel="% of prompt tokens",
           title="Cumulative prefix hit rate, each replica", ylim=(0, 100))
    _legend(ax, len(steps))
    names.append(save_figure(fig, out_dir / "replica_hit_rate.png"))
    merged = MetricsRecorder.merged([r.metrics for r in result.replicas])
    names.append(plot_latency(merged.request_arrays(), out_dir))
    return names


def _legend(ax, num_lines: int) -> None:
    if num_lines <= 8:  # more lines than that: a legend hides the plot
        ax.legend(fontsize=7)

