"""Bookkeeping-only stress simulator: the real `Scheduler` and `BlockManager`
on synthetic or traced workloads, with a cost model instead of a model.

Importing the package imports no MLX. Entry points: `run_simulation`
(one run), `scheduler.simulator.sweep` (grids), `write_report` (the report
folder), and the `blockmgr simulate` command (`scheduler.cli`). The modules
that drive the real engine (`calibrate`, `replay`, `engine_models`) import
MLX and are imported only by `blockmgr calibrate` / `replay`.
"""

from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.cost_model import CostModel, StepShape, step_shape
from scheduler.simulator.lengths import LengthDist, parse_length
from scheduler.simulator.prefix_bound import PrefixBound, infinite_cache_hit_rate
from scheduler.simulator.profile import CostProfile, ProfileError, read_cost
from scheduler.simulator.report import write_report
from scheduler.simulator.runner import (
    LeakError,
    Simulation,
    SimulationError,
    SimulationResult,
    run_simulation,
)
from scheduler.simulator.trace import TraceError, TraceWarning, read_trace, write_trace
from scheduler.simulator.workloads import RequestSpec, WorkloadConfig, generate

__all__ = [
    "CostModel",
    "CostProfile",
    "PrefixBound",
    "ProfileError",
    "StepShape",
    "TraceWarning",
    "infinite_cache_hit_rate",
    "read_cost",
    "step_shape",
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
