"""Continuous-batching scheduler, engine and stress simulator.

* `request`: `Request`, `SamplingParams`, `RequestStatus`, `RequestMetrics`.
* `scheduler`: `Scheduler` and its records (bookkeeping only, no MLX).
* `EngineConfig` (with `CacheConfig`): every engine setting, declared once.
* `engine`: `Engine`, driving an mlx-lm model through the scheduler over a
  `cache.PagedCache` (imported lazily: it needs MLX).
* `async_engine`: `AsyncEngine`, the asyncio front-end (lazily too);
  `server`: the OpenAI-compatible HTTP server (design/serving.md).
"""

from scheduler.core.config import SchedulerConfig
from scheduler.core.records import (
    DecodeRows,
    RequestOutput,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    SequenceInfo,
)
from scheduler.core.request import Request, RequestMetrics, RequestStatus, SamplingParams
from scheduler.core.scheduler import RequestTooLarge, Scheduler, StaleSchedulerOutput
from scheduler.engine.config import CacheConfig, EngineConfig

_LAZY = {"AutoRequestId", "Engine", "GenerationOutput"}
_LAZY_ASYNC = {"AsyncEngine", "QueueFull", "EngineStopped"}


def __getattr__(name: str):
    if name in _LAZY:
        from scheduler.engine import engine

        return getattr(engine, name)
    if name in _LAZY_ASYNC:
        from scheduler.serving import async_engine

        return getattr(async_engine, name)
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")


__all__ = [
    "AsyncEngine",
    "AutoRequestId",
    "CacheConfig",
    "DecodeRows",
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "GenerationOutput",
    "QueueFull",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "RequestTooLarge",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SequenceInfo",
    "StaleSchedulerOutput",
]
