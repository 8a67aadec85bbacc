"""The README quotes measured figures only from BENCHMARKS.md's headline table.

Every figure the README states with a unit of measurement (`1.28x`, `65.6 %`, `3.3 s`, `40 us`,
...) in its prose or in a shell comment must stand, with the same value and unit, in the figure
column of the headline table that opens BENCHMARKS.md; a figure edited in one place only fails
here. Numbers that are settings, not measurements, are listed in `NOT_MEASURED` with the reason.
The 100k-request simulation's time is stated in that table alone: the README and `design/` refer
to it and quote no time of their own.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
HEADLINE_HEADING = "## Headline figures"
COLUMNS = ["what", "command", "figure", "machine and BLAS", "commit", "date"]

# a number with a unit of measurement; `1,000` and `0.5` are numbers, `K8V8` is not
FIGURE = re.compile(
    r"(?<![\w.,/])(?<!\D-)(\d+(?:,\d{3})*(?:\.\d+)?)\s?(x|%|s|ms|us|µs|min|GFLOPS|GB/s|tok/s)(?![\w/])")

# README figures that are settings of a command, not measurements: (value, unit) -> why
NOT_MEASURED = {
    ("20", "x"): "the Mooncake example's --time-scale 20, an option the README explains",
}


def figures(text: str) -> set[tuple[str, str]]:
    """The (value, unit) pairs FIGURE finds in `text`; a value's thousands commas dropped."""
    return {(value.replace(",", ""), unit) for value, unit in FIGURE.findall(text)}


def readme_prose(text: str) -> str:
    """The README without its code blocks, plus the comments of its shell blocks (where a
    command's cost is said), with line breaks folded so a figure split over lines is found."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    shell = re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, flags=re.M | re.S)
    comments = [line.split(" #", 1)[1] for block in shell for line in block.splitlines()
                if " #" in line]
    return " ".join((prose + "\n" + "\n".join(comments)).split())


def headline_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table after the headline heading, as column -> cell."""
    assert HEADLINE_HEADING in text, f"BENCHMARKS.md has no {HEADLINE_HEADING!r} section"
    section = text.split(HEADLINE_HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for line in lines[2:]:
        # cells split on bars outside backquotes (commands may hold `a|b`)
        cells = [c.strip() for c in re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip("|"))]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def test_figure_pattern_reads_what_the_documents_write():
    text = ("1.28x tokens/s, 65.6 % of 69.1 %, 3.3 s, 1,140 s, 91-104x, -21.0 %, 0.52 of, K8V8, "
            "4GiB, 2,000 requests, 1e-4")
    assert figures(text) == {("1.28", "x"), ("65.6", "%"), ("69.1", "%"), ("3.3", "s"),
                             ("1140", "s"), ("104", "x")}


def test_headline_table_rows_are_complete():
    rows = headline_rows(BENCHMARKS.read_text())
    assert len(rows) >= 10
    for row in rows:
        assert all(row[column] for column in COLUMNS), row
        assert figures(row["figure"]), f"no figure with a unit: {row}"
        assert re.fullmatch(r"[0-9a-f]{7,40}(, [0-9a-f]{7,40})*", row["commit"]), row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row


def test_readme_figures_stand_in_the_headline_table():
    table = set().union(*(figures(row["figure"])
                          for row in headline_rows(BENCHMARKS.read_text())))
    quoted = figures(readme_prose(README.read_text()))
    assert quoted, "the README quotes no figure: the pattern or the README changed"
    missing = sorted(quoted - table - NOT_MEASURED.keys())
    assert not missing, (
        f"README figures not in BENCHMARKS.md's headline table: {missing}; change both "
        "together, or list a setting in NOT_MEASURED")


def test_settings_listed_as_not_measured_are_still_quoted():
    quoted = figures(readme_prose(README.read_text()))
    stale = sorted(set(NOT_MEASURED) - quoted)
    assert not stale, f"NOT_MEASURED lists figures the README no longer quotes: {stale}"


def test_the_100k_simulation_time_is_stated_once():
    """The headline table times it; the README and design/ name the run without a time."""
    rows = headline_rows(BENCHMARKS.read_text())
    timed = [row for row in rows if re.search(r"-n 100000\b", row["command"])]
    assert len(timed) == 1 and {unit for _, unit in figures(timed[0]["figure"])} & {"s", "min"}
    run = re.compile(r"-n 100000\b|\b100k\b|\b100,000\b")
    for path in [README, *sorted((ROOT / "design").glob("*.md"))]:
        for paragraph in re.split(r"\n\s*\n", path.read_text()):
            for line in paragraph.splitlines():
                if run.search(line):
                    times = {f for f in figures(line) if f[1] in ("s", "min")}
                    assert not times, f"{path.name}: a time for the 100k run: {line.strip()}"
