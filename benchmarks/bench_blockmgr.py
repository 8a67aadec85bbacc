"""Block manager (`blockmgr/`) micro-benchmarks under pytest-benchmark.

Run: python -m pytest benchmarks/bench_blockmgr.py --benchmark-only
     (add --benchmark-columns=min,median,rounds,iterations to shorten)

The cases are those of `blockmgr_table.py` (same factories). pytest-benchmark
reports the time of one call; a call is one unit of work except:

* group b: one decode step over 256 sequences (divide by 256 for the
  per-sequence figure the target is about);
* group e: one match of 1k, 4k or 16k tokens (divide by 1, 4, 16 for us per
  1k tokens).

`extra_info` of each benchmark holds `units_per_call` and `us_per_unit_min`
(and `target_us_per_unit` when the issue sets one). Rounds run back to back
on one state, so stateful cases are built with room for every call.
"""

from __future__ import annotations

import pytest
from blockmgr_table import CASES, Case

ROUNDS = 30
WARMUP_ROUNDS = 2
# pytest-benchmark calls once more after looped rounds (and again for --benchmark-cprofile)
SPARE_ROUNDS = 2


@pytest.mark.parametrize("case", CASES, ids=[f"{c.key}-{c.group}" for c in CASES])
def test_blockmgr(benchmark, case: Case) -> None:
    """Time `case.iterations` calls per round over `ROUNDS` rounds."""
    bench = case.make((ROUNDS + WARMUP_ROUNDS + SPARE_ROUNDS) * case.iterations)
    benchmark.group = f"blockmgr {case.group}"
    benchmark.name = f"{case.key} {case.name}"
    benchmark.pedantic(
        bench.run, rounds=ROUNDS, iterations=case.iterations, warmup_rounds=WARMUP_ROUNDS
    )
    record(benchmark, case, bench.units)


def record(benchmark, case: Case, units: float) -> None:
    """Store the per-unit figure next to pytest-benchmark's per-call stats."""
    info = benchmark.extra_info
    info["unit"] = case.unit
    info["units_per_call"] = units
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        info["us_per_unit_min"] = round(stats.stats.min / units * 1e6, 3)
    if case.target_us is not None:
        info["target_us_per_unit"] = case.target_us
