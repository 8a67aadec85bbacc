"""Bookkeeping-only stress simulator: the real `Scheduler` and `BlockManager`
on synthetic or traced workloads, with a cost model instead of a model.

No MLX import anywhere under this package. Entry points: `run_simulation`
(one run), `scheduler.simulator.sweep` (grids), `write_report` (the report
folder), and the `blockmgr simulate` command (`scheduler.cli`).
"""

from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.cost_model import CostModel
from scheduler.simulator.lengths import LengthDist, parse_length
from scheduler.simulator.report import write_report
from scheduler.simulator.runner import (
    LeakError,
    Simulation,
    SimulationError,
    SimulationResult,
    run_simulation,
)
from scheduler.simulator.trace import TraceError, read_trace, write_trace
from scheduler.simulator.workloads import RequestSpec, WorkloadConfig, generate

__all__ = [
    "CostModel",
    "LeakError",
    "LengthDist",
    "RequestSpec",
    "Simulation",
    "SimulationConfig",
    "SimulationError",
    "SimulationResult",
    "TraceError",
    "WorkloadConfig",
    "generate",
    "parse_length",
    "read_trace",
    "run_simulation",
    "write_report",
    "write_trace",
]
