"""The full configuration of one simulation, and its JSON form.

A `SimulationConfig` bundles the workload, the model layout, the block
manager, the scheduler and the cost model. `to_dict()` goes into report.json; `from_dict()` of that
dict runs the same simulation again (same seed, same result).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from blockmgr import BlockManagerConfig
from blockmgr.errors import InvalidArgument, WrongArgumentType
from blockmgr.validation import check_int, check_number
from scheduler.core.config import SchedulerConfig
from scheduler.simulator.cost_model import CostModel
from scheduler.simulator.kv_memory import KVMemory
from scheduler.simulator.layout import ModelLayout
from scheduler.simulator.workloads import WorkloadConfig


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """One simulation; validated on construction
    (`InvalidArgument`, a `ValueError`).

    layout: the model's layer kinds (`ModelLayout`): the store gets one
        layer group per attention window, with `block_manager`'s pages
        each, and its slots.
    vocab_size: token ids are drawn from [0, vocab_size).
    check_every: run `check_integrity()` every this many steps (and at the
        end, plus the leak check); None: no checks.
    sample_every: take a memory snapshot (fragmentation, sharing) every this
        many steps.
    trace: a trace file to replay instead of generating the workload (the
        workload's arrival/concurrency settings still apply to requests
        without arrival times).
    trace_block_tokens: tokens per prefix-id block of the trace (None: the
        trace's header, else 512 with a warning).
    time_scale: multiplies the trace's arrival and think times (0.5: twice
        as fast).
    kv_memory: the KV memory that sizes the pool (`KVMemory`: budget, the
        model's KV shape, the page format); `block_manager.num_blocks` must
        be the pages it holds (`apply_kv_memory` sets them). None: the pool
        is `num_blocks` pages, of no stated size.
    """

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    block_manager: BlockManagerConfig = field(
        default_factory=lambda: BlockManagerConfig(num_blocks=4096, block_size=16)
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cost: CostModel = field(default_factory=CostModel)
    layout: ModelLayout = field(default_factory=ModelLayout)
    vocab_size: int = 32000
    check_every: int | None = None
    sample_every: int = 32
    trace: str | None = None
    trace_block_tokens: int | None = None
    time_scale: float = 1.0
    kv_memory: KVMemory | None = None

    def __post_init__(self) -> None:
        for name, kind in (
            ("workload", WorkloadConfig),
            ("block_manager", BlockManagerConfig),
            ("scheduler", SchedulerConfig),
            ("cost", CostModel),
            ("layout", ModelLayout),
        ):
            if not isinstance(getattr(self, name), kind):
                raise WrongArgumentType(f"{name} must be a {kind.__name__}")
        check_int("vocab_size", self.vocab_size, 2, strict=True)
        check_int("sample_every", self.sample_every, 1, strict=True)
        if self.check_every is not None:
            check_int("check_every", self.check_every, 1, strict=True)
        if self.trace is not None and not isinstance(self.trace, str):
            raise WrongArgumentType(f"trace must be a path, got {self.trace!r:.80}")
        if self.trace_block_tokens is not None:
            check_int("trace_block_tokens", self.trace_block_tokens, 1, strict=True)
        check_number("time_scale", self.time_scale, above=0.0)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if self.trace is None and self.workload.max_context > capacity:
            raise InvalidArgument(
                f"max_context {self.workload.max_context} tokens does not fit the pool "
                f"({self.block_manager.num_blocks} pages x {self.block_manager.block_size} tokens)"
            )
        bm, sched = self.block_manager, self.scheduler
        if bm.num_slots and bm.num_slots < 2:
            raise InvalidArgument("a hybrid simulation needs num_slots >= 2")
        if sched.preemption == "swap" and bm.num_host_blocks == 0:
            raise InvalidArgument("preemption 'swap' needs host pages (num_host_blocks > 0)")
        self.layout.store_config(bm)  # raises InvalidArgument when they do not fit
        if self.kv_memory is not None:
            if not isinstance(self.kv_memory, KVMemory):
                raise WrongArgumentType("kv_memory must be a KVMemory")
            pages = self.kv_memory.num_blocks(bm.block_size, bm.num_slots)
            if bm.num_blocks != pages:
                raise InvalidArgument(f"num_blocks {bm.num_blocks} is not the {pages} pages the KV "
                                      f"memory holds; give one or the other")

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_dict(),
            "block_manager": _fields(self.block_manager),
            "scheduler": _fields(self.scheduler),
            "cost": self.cost.to_dict(),
            "layout": self.layout.to_dict(),
            "vocab_size": self.vocab_size,
            "check_every": self.check_every,
            "sample_every": self.sample_every,
            "trace": self.trace,
            "trace_block_tokens": self.trace_block_tokens,
            "time_scale": self.time_scale,
            # only when given, so that configs and reports without it stay as they were
            **({} if self.kv_memory is None else {"kv_memory": self.kv_memory.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SimulationConfig":
        """Inverse of `to_dict`; missing keys take defaults. Raises `InvalidArgument`."""
        if not isinstance(data, dict):
            raise InvalidArgument("a simulation config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"unknown config keys: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        if "workload" in data:
            values["workload"] = WorkloadConfig.from_dict(data["workload"])
        if "layout" in data:
            values["layout"] = ModelLayout.from_dict(data["layout"])
        if data.get("kv_memory") is not None:
            values["kv_memory"] = KVMemory.from_dict(data["kv_memory"])
        for name, kind in (
            ("block_manager", BlockManagerConfig),
            ("scheduler", SchedulerConfig),
            ("cost", CostModel),
        ):
            if name in data:
                values[name] = _build(kind, data[name], name)
        for name in ("vocab_size", "check_every", "sample_every", "trace", "trace_block_tokens",
                     "time_scale"):
            if name in data:
                values[name] = data[name]
        return cls(**values)


def apply_kv_memory(data: dict[str, Any]) -> None:
    """Set the `block_manager.num_blocks` of a config dict (`to_dict`'s
    form) to the pages its `kv_memory` holds at its block size and slots;
    nothing without one. Raises `InvalidArgument`."""
    bm = data["block_manager"]
    size, slots = bm.get("block_size"), bm.get("num_slots") or 0
    if data.get("kv_memory") is None or not (_is_int(size) and size >= 1 and _is_int(slots)):
        return  # a bad block size or slot count is the block manager's own error
    bm["num_blocks"] = KVMemory.from_dict(data["kv_memory"]).num_blocks(size, slots)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fields(obj) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _build(kind, data, name: str):
    if not isinstance(data, dict):
        raise InvalidArgument(f"{name} must be a JSON object")
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidArgument(f"unknown {name} settings: {', '.join(unknown)}")
    try:
        return kind(**data)
    except TypeError as exc:
        raise InvalidArgument(f"{name}: {exc}") from None
