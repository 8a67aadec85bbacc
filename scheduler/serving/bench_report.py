"""The report folder of a `blockmgr bench` run, in the simulator's format.

report.json holds `version`, `config` (the workload, rerun with
`blockmgr bench --config report.json`), `summary` with the simulator's
`requests`, `throughput`, `latency` and `prefix_cache` sections (so
`blockmgr compare` reads a bench report beside a simulation or another
server's bench), `bench` (server URL, model, API, prompt format, time
scale) and `plots`; report.md the headline table; latency.png the CDFs.
A bench has no step or memory timeline: the server's pages are not visible
to a client. Writing is O(requests).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from scheduler.serving.bench_checks import load_warnings
from scheduler.simulator.plots import PlottingUnavailable, plot_latency
from scheduler.simulator.report import REPORT_VERSION, format_pair


def build_bench_report(result, plots: list[str]) -> dict:
    options = result.options
    return {
        "version": REPORT_VERSION,
        "config": result.config.to_dict(),
        "bench": {"url": options.base, "model": result.model, "api": options.api,
                  "prompt_format": options.prompt_format, "time_scale": options.time_scale,
                  "ignore_eos": options.ignore_eos, "cache_salt": options.cache_salt},
        "summary": result.summary,
        "timeline": {},
        "plots": plots,
        "environment": {"python": platform.python_version(), "machine": platform.machine()},
    }


def write_bench_report(result, out_dir: str | Path, plots: bool = True
                       ) -> tuple[Path, list[str], str | None]:
    """Write report.json, latency.png and report.md into `out_dir` (created).
    Returns (folder, plot names, a note if plots were skipped)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    note = None
    if plots and result.summary["requests"]["finished"]:
        try:
            names = [plot_latency(result.metrics.request_arrays(), out)]
        except PlottingUnavailable as exc:
            note = str(exc)
    report = build_bench_report(result, names)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(report, note))
    return out, names, note


def bench_rows(summary: dict) -> list[tuple[str, str]]:
    """(metric, value) rows of a bench summary, for tables."""
    req, thr, lat, pc = (summary["requests"], summary["throughput"], summary["latency"],
                         summary["prefix_cache"])
    rows = [
        ("requests finished / failed", f"{req['finished']} / {req['aborted']}"),
        ("prompt / output tokens (server usage)",
         f"{req['prompt_tokens']} / {req['output_tokens']}"),
        ("requests with usage / cached tokens reported",
         f"{req['usage_reported']} / {req['cached_tokens_reported']}"),
        ("wall time", f"{thr['seconds']:.1f} s"),
        ("throughput",
         f"{thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.1f} out tok/s"),
        ("TTFT p50 / p99", format_pair(lat["ttft_s"], "s")),
        ("time per output token p50 / p99", format_pair(lat["tpot_s"], "ms", 1000, "{:.1f}")),
        ("end-to-end p50 / p99", format_pair(lat["e2e_s"], "s")),
        ("cached prompt tokens (server-reported)", f"{pc['hit_rate'] * 100:.1f} %"),
    ]
    rows += load_rows(summary.get("load"))
    for error, count in summary.get("errors", {}).items():
        rows.append((f"error x{count}", error))
    return rows


def load_rows(load: dict | None) -> list[tuple[str, str]]:
    """The offered and served rates, and the warnings (`bench_checks`)."""
    if load is None:
        return []
    rows = []
    if load["offered_sessions_per_s"] is not None:
        rows.append(("offered / served sessions per s",
                     f"{load['offered_sessions_per_s']:.2f} / "
                     f"{load['served_sessions_per_s']:.2f}"))
    rows += [("WARNING", line) for line in load_warnings(load)]
    return rows


def render_markdown(report: dict, note: str | None = None) -> str:
    bench, wl = report["bench"], report["config"]["workload"]
    arrival = (f"Poisson at {wl['rate']} sessions/s" if wl["arrival"] == "poisson"
               else f"closed loop, {wl['concurrency']} clients")
    source = f"trace `{report['config']['trace']}`" if report["config"].get("trace") else \
        f"workload {', '.join(wl['mix'])}, {wl['num_requests']} requests, {arrival}, " \
        f"seed {wl['seed']}"
    lines = [
        "# blockmgr bench report",
        "",
        f"{bench['url']} model `{bench['model']}`, {bench['api']} API, {bench['prompt_format']} "
        f"prompts, {source}, times x {bench['time_scale']:g}.",
        "Times are wall-clock seconds measured by the client; token counts and cached tokens are "
        "the server's `usage`. Every metric and the full config are in `report.json`.",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in bench_rows(report["summary"])]
    lines.append("")
    if note:
        lines += [f"*{note}*", ""]
    for name in report.get("plots", []):
        lines += ["## Latency distributions (CDF; dotted: p50, p99)", "", f"![latency]({name})", ""]
    return "\n".join(lines)
