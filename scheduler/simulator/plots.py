"""PNG plots of a simulation (matplotlib, Agg backend, imported lazily).

`plot_run` draws page usage, queue lengths, prefix hit rate, preemptions,
memory sharing/fragmentation over simulated time, and latency
distributions; `plot_sweep` draws a sweep's comparison. Without matplotlib
both raise `PlottingUnavailable` with an install hint; the report is then
written without plots.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class PlottingUnavailable(RuntimeError):
    """matplotlib is not installed."""


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlottingUnavailable(
            "plots skipped: matplotlib is not installed (pip install matplotlib)"
        ) from None
    return plt


def save_figure(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def windowed_rate(num: np.ndarray, den: np.ndarray, window: int) -> np.ndarray:
    """Ratio of increments of two cumulative series over a trailing window
    (NaN where the denominator did not grow: no data, no line)."""
    if not len(num):
        return np.zeros(0)
    lag = np.concatenate([np.zeros(window), den])[: len(den)]
    lag_num = np.concatenate([np.zeros(window), num])[: len(num)]
    dd = den - lag
    return np.divide(num - lag_num, dd, out=np.full(len(dd), np.nan), where=dd > 0)


def plot_run(steps: dict, memory: dict, requests: dict, num_blocks: int, out_dir: Path,
             groups: tuple[list, list] = ([], [])) -> list[str]:
    """Write the run's PNGs into `out_dir`; returns their file names.
    `groups`: the windows and use series of a store's page groups
    (`GroupUsage`; empty for one group), each drawn on the page plot."""
    plt = pyplot()
    out_dir = Path(out_dir)
    t = steps["time"]
    names = []
    names.append(plot_page_usage(plt, t, steps, memory, num_blocks, groups, out_dir))


    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, steps["running"], label="running", lw=1)
    ax.plot(t, steps["waiting"], label="waiting (incl. preempted)", lw=1)
    ax.set(xlabel="simulated time (s)", ylabel="sequences", title="Queue lengths")
    ax.legend(fontsize=8)
    names.append(save_figure(fig, out_dir / "queues.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    window = max(1, len(t) // 100)
    ax.plot(t, windowed_rate(steps["hit_tokens"], steps["query_tokens"], window) * 100,
            label=f"last {window} steps", lw=1)
    cumulative = np.divide(steps["hit_tokens"], steps["query_tokens"],
                           out=np.zeros_like(t), where=steps["query_tokens"] > 0)
    ax.plot(t, cumulative * 100, label="cumulative", lw=1.5)
    ax.set(xlabel="simulated time (s)", ylabel="% of prompt tokens",
           title="Prefix hit rate (token-weighted)", ylim=(0, 100))
    ax.legend(fontsize=8)
    names.append(save_figure(fig, out_dir / "prefix_hit_rate.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, steps["preempted_recompute"], label="recompute", lw=1)
    ax.plot(t, steps["preempted_swap"], label="swap", lw=1)
    ax.set(xlabel="simulated time (s)", ylabel="cumulative preemptions", title="Preemptions")
    ax.legend(fontsize=8)
    names.append(save_figure(fig, out_dir / "preemptions.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    if len(memory["time"]):
        ax.plot(memory["time"], memory["sharing_saved"] * 100, label="pages saved by sharing", lw=1)
        ax.plot(memory["time"], memory["fragmentation"] * 100,
                label="internal fragmentation (unused slots)", lw=1)
    ax.set(xlabel="simulated time (s)", ylabel="%",
           title="Sharing and fragmentation (live sequences)")
    ax.legend(fontsize=8)
    names.append(save_figure(fig, out_dir / "memory.png"))

    names.append(plot_latency(requests, out_dir))
    return names


def plot_page_usage(plt, t, steps: dict, memory: dict, num_blocks: int, groups: tuple,
                    out_dir: Path) -> str:
    """page_usage.png. The trie's pages are counted over every page group, so
    they are a share of all groups' pages together; the live sequences' are
    the first group's (their block tables); with several groups each group's
    own use is drawn too."""
    windows, series = groups
    total = num_blocks * max(1, len(windows))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, steps["page_usage"] * 100, label="pages in use, fullest group", lw=1)
    for window, values in zip(windows, series):
        name = "full attention" if window is None else f"window {window}"
        ax.plot(t[: len(values)], values * 100, label=f"group {name}", lw=1, ls="--")
    ax.plot(t, steps["trie_pages"] / total * 100, label="pages held by the prefix trie", lw=1)
    if len(memory["time"]):
        ax.plot(memory["time"], memory["physical_pages"] / num_blocks * 100,
                label="pages of live sequences" + (", first group" if len(windows) > 1 else ""),
                lw=1)
    ylabel = "% of pool" if len(windows) < 2 else "% of pages (trie: of all groups)"
    ax.set(xlabel="simulated time (s)", ylabel=ylabel, title="Page usage", ylim=(0, 105))
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, out_dir / "page_usage.png")


def plot_latency(requests: dict, out_dir: Path) -> str:
    """latency.png: CDFs of TTFT, TPOT and end-to-end time; returns its name."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, title in zip(axes, ("ttft", "tpot", "e2e"),
                              ("time to first token", "time per output token", "end to end")):
        values = requests[key]
        values = np.sort(values[~np.isnan(values)])
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), lw=1.5)
            for q in (50, 99):
                ax.axvline(np.percentile(values, q), ls=":", lw=1, color="gray")
        ax.set(xlabel="seconds", ylabel="fraction of requests", title=title)
    return save_figure(fig, Path(out_dir) / "latency.png")


def plot_sweep(rows: list[dict], params: list[str], out_path: Path) -> str:
    """Bar charts of throughput, TTFT p99, hit rate and preemptions per point."""
    plt = pyplot()
    labels = [", ".join(f"{p}={row['params'][p]}" for p in params) for row in rows]
    series = (
        ("output_tokens_per_s", "output tokens / s"),
        ("ttft_p99_s", "TTFT p99 (s)"),
        ("hit_rate", "prefix hit rate"),
        ("preemptions", "preemptions"),
    )
    fig, axes = plt.subplots(len(series), 1,
                             figsize=(max(6, 0.6 * len(rows) + 3), 2.4 * len(series)))
    x = np.arange(len(rows))
    for ax, (key, title) in zip(axes, series):
        ax.bar(x, [row.get(key) or 0 for row in rows])
        ax.set_title(title, fontsize=9)
        ax.set_xticks(x, labels if ax is axes[-1] else [""] * len(rows), rotation=30, ha="right",
                      fontsize=7)
    return save_figure(fig, Path(out_path))
