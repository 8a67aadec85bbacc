"""The deterministic part of a simulation report's summary."""

from __future__ import annotations

from scheduler.simulator.report import NONDETERMINISTIC


def deterministic(summary: dict) -> dict:
    """`summary` without its wall-clock figures (`NONDETERMINISTIC`): equal for
    two runs of one config and seed, wherever and however fast they ran. A
    fleet's per-replica summaries (`replicas`) are stripped alike."""
    kept = {k: v for k, v in summary.items() if k not in NONDETERMINISTIC}
    if isinstance(kept.get("replicas"), list):
        kept["replicas"] = [deterministic(r) for r in kept["replicas"]]
    return kept
