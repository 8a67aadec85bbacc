"""The simulate report of a layout with several page groups: it names the
layout, gives each group's page use (checked against the headline usage the
store reports, the fullest group's, on its own code path), says why
requests were aborted (checked against the workload's own prompt sizes),
and its page plot stays on its axis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scheduler import cli
from scheduler.simulator import plots
from scheduler.simulator.runner import NEVER_FITS


def _simulate(tmp_path, *args: str) -> dict:
    assert cli.main(["simulate", "--no-progress", "--out", str(tmp_path), *args]) == 0
    return json.loads((tmp_path / "report.json").read_text())


def test_a_gemma3_report_names_its_layout_and_each_groups_use(tmp_path, capsys):
    report = _simulate(tmp_path, "-n", "120", "--layout", "gemma3", "--sliding-window", "128",
                       "--num-blocks", "1024", "--no-plots", "--check")
    md = (tmp_path / "report.md").read_text()
    assert ("Layout gemma3 (1 full : 5 sliding, window 128; page groups: full attention, "
            "window 128).") in md
    assert "1024 pages x 16 tokens per page group" in md
    memory = report["summary"]["memory"]
    full, window = memory["groups"]
    assert (full["window"], window["window"]) == (None, 128)
    assert full["num_pages"] == window["num_pages"] == 1024
    # the headline is the fullest group's use, read through `store.usage` each step
    assert memory["page_usage_peak"] == pytest.approx(max(full["usage_peak"],
                                                          window["usage_peak"]))
    # a window group holds at most what full attention holds of the same tokens
    assert window["usage_mean"] <= full["usage_mean"]
    assert window["usage_peak"] <= full["usage_peak"]
    assert 0 < window["cached_pages_final"] <= full["cached_pages_final"]
    assert "group 1 (window 128) pages peak / mean" in md


def test_a_one_group_report_has_no_group_rows(tmp_path):
    report = _simulate(tmp_path, "-n", "40", "--no-plots")
    assert report["summary"]["memory"]["groups"] == []
    assert "Layout full (1 full; page groups: full attention)." in \
        (tmp_path / "report.md").read_text()


def test_aborted_requests_are_counted_with_their_reason(tmp_path):
    """A trace with prompts that cannot fit a 48-page pool of 16 tokens even
    alone: exactly those are aborted on arrival, for that reason."""
    lengths = [100, 2000, 300, 5000, 120, 2500, 90]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({
        "timestamp": 1000 * i, "input_length": n, "output_length": 8,
        "hash_ids": list(range(100 * i, 100 * i + -(-n // 512)))}) + "\n"
        for i, n in enumerate(lengths)))
    report = _simulate(tmp_path / "out", "--trace", str(trace), "--trace-block-tokens", "512",
                       "--num-blocks", "48", "--no-plots")
    too_big = sum(1 for n in lengths if -(-(n + 8) // 16) > 48)  # 3: 2000, 5000, 2500
    requests = report["summary"]["requests"]
    assert too_big == 3
    assert requests["aborted"] == too_big and requests["finished"] == len(lengths) - too_big
    assert requests["abort_reasons"] == {NEVER_FITS: too_big}
    assert f"| aborted x{too_big} | {NEVER_FITS} |" in \
        (tmp_path / "out" / "report.md").read_text()


def test_the_page_plot_stays_on_its_axis(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn = []
    save = plots.save_figure

    def keep(fig, path):
        if path.name == "page_usage.png":
            ax = fig.axes[0]
            drawn.append((ax.get_ylim(), [line.get_ydata() for line in ax.get_lines()]))
        return save(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    _simulate(tmp_path, "-n", "150", "--layout", "gemma3", "--sliding-window", "128",
              "--num-blocks", "512")
    ((low, high), series), = drawn
    assert len(series) == 5  # headline, two groups, trie, live sequences
    for values in series:
        values = np.asarray(values)
        assert values.min() >= low and values.max() <= high, values.max()
