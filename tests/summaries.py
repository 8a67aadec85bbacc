"""The deterministic part of a simulation report's summary."""

from __future__ import annotations

from scheduler.simulator.report import NONDETERMINISTIC


def deterministic(summary: dict) -> dict:
    """`summary` without its wall-clock figures (`NONDETERMINISTIC`): equal for
    two runs of one config and seed, wherever and however fast they ran."""
    return {k: v for k, v in summary.items() if k not in NONDETERMINISTIC}
