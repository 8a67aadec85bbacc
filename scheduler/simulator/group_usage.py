"""Per-group page use of a run over a store with several page groups (a
layout with sliding windows: `design/grouped_store.md`).

The headline "page usage" is the fullest group's; a report of a Gemma 3
layout also needs each group's own: the full-attention group fills with
every token while a window group holds only its window. `GroupUsage`
samples `store.group_usage()` once per step (only when there are several
groups) and gives each group's peak and mean use, its prefix-cache pages at
the end, and the series for the page-usage plot. O(groups) per step.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np


def group_label(window: int | None) -> str:
    return "full attention" if window is None else f"window {window}"


class GroupUsage:
    """See the module doc."""

    def __init__(self) -> None:
        self.windows: list[int | None] = []
        self.num_pages: list[int] = []
        self.series: list[array] = []
        self.cached_final: list[int] = []

    def observe(self, store: Any) -> None:
        """One step's use of every group (nothing for a one-group store)."""
        if store.num_groups < 2:
            return
        usage = store.group_usage()
        if not self.series:
            self.windows = [g.window for g in usage]
            self.num_pages = [g.num_pages for g in usage]
            self.series = [array("d") for _ in usage]
        for series, g in zip(self.series, usage):
            series.append((g.num_pages - g.num_free_pages) / g.num_pages)
        self.cached_final = [g.num_cached_pages for g in usage]

    def arrays(self) -> list[np.ndarray]:
        return [np.frombuffer(s, dtype=np.float64) for s in self.series]

    def summary(self, weights: np.ndarray) -> list[dict]:
        """Per group: window, pages, use peak and mean (fractions; the mean
        weighted by `weights`, each step's time, as the headline usage is),
        prefix cache pages at the end. [] for a one-group store."""
        return [{"group": i, "window": window, "num_pages": pages,
                 "usage_peak": float(values.max()) if len(values) else 0.0,
                 "usage_mean": _mean(values, weights[: len(values)]),
                 "cached_pages_final": cached}
                for i, (window, pages, values, cached) in enumerate(
                    zip(self.windows, self.num_pages, self.arrays(), self.cached_final))]


def group_rows(groups: list[dict]) -> list[tuple[str, str]]:
    """Report rows: each group's page use."""
    return [(f"group {g['group']} ({group_label(g['window'])}) pages peak / mean",
             f"{g['usage_peak'] * 100:.1f} % / {g['usage_mean'] * 100:.1f} % of "
             f"{g['num_pages']}, {g['cached_pages_final']} cached at the end")
            for g in groups]


def _mean(values: np.ndarray, weights: np.ndarray) -> float:
    if not len(values):
        return 0.0
    return float(np.average(values, weights=weights)) if weights.sum() else float(values.mean())
