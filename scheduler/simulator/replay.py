"""Real-engine replay: one workload or trace through `scheduler.Engine` on a
real model, recorded exactly as a simulation is, so the two reports can be
compared metric by metric (`report.comparison_rows`).

Time is the engine's own: a replay clock that runs with the wall clock
only inside `Engine.step()` and jumps forward to the next arrival when
nothing is queued (no idle waiting); the replay's own bookkeeping between
steps (building prompts, metrics, memory snapshots) takes no replay time. A request
arrives at its workload time and is added with that arrival, so TTFT counts
the queueing before the step that admits it, as in the simulator.

The prompts are the workload's token texts; the sampled tokens are the
model's (greedy; seeded at temperature 1 for n > 1 samples, so they differ
as the workload's do), so a follow-up turn whose prompt quotes the previous
answer finds the workload's answer text, not the model's, in the trie (a
smaller hit than in the simulator, for multiturn and agent workloads only).
Open-loop arrivals only: a closed-loop workload raises `ReplayError`.
The engine's store has the model's layer groups, so the replay's config
takes the model's layout (`engine_models.model_layout`): its report.json
simulates the store the engine ran. Imports MLX.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from blockmgr.errors import IntegrityError
from blockmgr.kv_format import KVFormat
from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.memory import snapshot
from scheduler.simulator.metrics import MetricsRecorder, RequestRecord
from scheduler.simulator.prefix_bound import PrefixBound
from scheduler.simulator.runner import (
    HEAD_DROPPED,
    NEVER_FITS,
    ProgressFn,
    SimulationResult,
    sessions_of,
)
from scheduler.simulator.tokens import TokenSource
from scheduler.simulator.workloads import RequestSpec, head_arrival


def _kv_format(config: SimulationConfig) -> KVFormat | None:
    """The `KVFormat` of the config's `kv_memory` (None: the model's dtype),
    so a replayed pool stores pages as the simulated one counts them."""
    memory = config.kv_memory
    return None if memory is None else memory.format


class ReplayError(ValueError):
    """The workload cannot be replayed on this engine (names the reason)."""


class ReplayClock:
    """Replay seconds: `timer` time spent inside `running()` blocks, plus
    skips. Stopped otherwise, so only the engine's own steps take time."""

    def __init__(self, timer=time.perf_counter) -> None:
        self._timer = timer
        self._elapsed = 0.0
        self._started: float | None = None

    def now(self) -> float:
        if self._started is None:
            return self._elapsed
        return self._elapsed + self._timer() - self._started

    def skip_to(self, when: float) -> None:
        """Jump forward to `when` (never back); only while stopped."""
        self._elapsed = max(self._elapsed, when)

    @contextmanager
    def running(self):
        self._started = self._timer()
        try:
            yield
        finally:
            self._elapsed += self._timer() - self._started
            self._started = None


class Replay:
    """One replay. `run()` once."""

    def __init__(self, config: SimulationConfig, model: Any, description: dict,
                 progress: ProgressFn | None = None, clock: str = "wall",
                 step_listener: Callable[[Any, float], None] | None = None) -> None:
        from scheduler.engine.config import CacheConfig, EngineConfig
        from scheduler.engine.engine import Engine
        from scheduler.simulator.calibrate import CLOCKS
        from scheduler.simulator.engine_models import model_layout, vocab_size

        if clock not in CLOCKS:
            raise ReplayError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")

        if config.vocab_size > vocab_size(description):
            raise ReplayError(f"the workload's vocab_size {config.vocab_size} exceeds the "
                              f"model's {vocab_size(description)}")
        try:
            config = replace(config, layout=model_layout(model))
        except ValueError as exc:  # the model's layout does not fit the pool's slots
            raise ReplayError(f"the model's layout: {exc}") from None
        self.config = config
        self.description = description
        self.clock_name = clock
        self.clock = ReplayClock(CLOCKS[clock])
        bm = config.block_manager
        self.num_slots = bm.num_slots
        storage = CacheConfig(
            bm.num_blocks, bm.block_size, num_slots=bm.num_slots or None,
            kv_format=_kv_format(config), enable_prefix_cache=bm.enable_prefix_cache,
            watermark=bm.watermark, num_host_blocks=bm.num_host_blocks,
            num_host_slots=bm.num_host_slots)
        self.engine = Engine(model, config=EngineConfig(storage, config.scheduler),
                             clock=self.clock.now, step_listener=self._on_step)
        self.tokens = TokenSource(config.vocab_size)
        self.metrics = MetricsRecorder()
        self._sessions = sessions_of(config)
        self._bound = PrefixBound() if config.trace is not None else None
        self._progress = progress
        self._heap: list = []
        self._order = itertools.count()
        self._next_head: list[RequestSpec] | None = None
        self._live: dict[Hashable, tuple[RequestSpec, list[RequestSpec], int, Any]] = {}
        self._last_step: tuple[Any, float] | None = None
        self._step_listener = step_listener
        self._num_added = self._num_done = self._steps = 0
        self._schedule_seconds = 0.0

    def _on_step(self, out, seconds: float) -> None:
        self._last_step = (out, seconds)
        if self._step_listener is not None:
            self._step_listener(out, seconds)

    # ------------------------------------------------------------- arrivals

    def _head(self) -> list[RequestSpec] | None:
        if self._next_head is None:
            self._next_head = next(self._sessions, None)
            if self._next_head is not None and self._next_head[0].arrival is None:
                raise ReplayError("replay needs open-loop arrivals (a trace with arrival times "
                                  "or --arrival poisson), not a closed loop")
        return self._next_head

    def _next_time(self) -> float | None:
        times = [self._heap[0][0]] if self._heap else []
        head = self._head()
        if head is not None:
            times.append(head_arrival(head))
        return min(times) if times else None

    def _admit(self) -> None:
        now = self.clock.now()
        while (head := self._head()) is not None and head_arrival(head) <= now:
            heapq.heappush(self._heap, (head_arrival(head), next(self._order), head, 0))
            self._next_head = None
        while self._heap and self._heap[0][0] <= now:
            when, _, session, index = heapq.heappop(self._heap)
            self._add(when, session, index)

    def _add(self, when: float, session: list[RequestSpec], index: int) -> None:
        from scheduler.core.request import Request

        spec = session[index]
        prompt = list(spec.tokens) if spec.tokens is not None else self.tokens.expand(spec.prompt)
        sampling = spec.sampling()
        self._num_added += 1
        if self._bound is not None:
            self._bound.observe(spec)
        try:
            self.engine.add_request(prompt, sampling, request_id=spec.request_id,
                                    namespace=spec.namespace, arrival_time=when)
        except ValueError:  # longer than the engine's max_model_len: never fits
            request = Request(spec.request_id, prompt, sampling, arrival_time=when)
            self._done(spec, session, index, request, aborted=True, reason=NEVER_FITS)
            return
        live = self.engine.get_request(spec.request_id)
        if live is None:  # just added: no step ran since
            raise IntegrityError(f"request {spec.request_id!r} was added but is not live")
        self._live[spec.request_id] = (spec, session, index, live)

    def _done(self, spec, session, index, request, aborted: bool,
              reason: str | None = None) -> None:
        self.metrics.on_finish(RequestRecord.of(spec.workload, request, self.clock.now(), aborted,
                                                reason))
        self._num_done += 1
        if index + 1 < len(session):
            follow = session[index + 1]
            heapq.heappush(self._heap, (self.clock.now() + follow.think_time, next(self._order),
                                        session, index + 1))

    # ----------------------------------------------------------------- loop

    def run(self) -> SimulationResult:
        wall = time.perf_counter()
        while True:
            self._admit()
            if self.engine.has_unfinished():
                self._step()
                continue
            upcoming = self._next_time()
            if upcoming is None:
                break
            self.clock.skip_to(upcoming)
        return self._result(time.perf_counter() - wall)

    def _step(self) -> None:
        engine = self.engine
        before = engine.stats.schedule_time
        try:
            with self.clock.running():
                results = engine.step()
        except RuntimeError:
            if engine.scheduler.num_running or not engine.scheduler.num_waiting:
                raise
            self._abort_head()
            return
        for r in results:
            if r.finished:
                spec, session, index, request = self._live.pop(r.request_id)
                self._done(spec, session, index, request, aborted=False)
        if self._last_step is not None:
            self._record(*self._last_step, engine.stats.schedule_time - before)
            self._last_step = None

    def _abort_head(self) -> None:
        """Nothing runs and the head of the queue does not fit: drop it."""
        seq_id = self.engine.scheduler.waiting_ids()[0]
        request_id = seq_id[0] if isinstance(seq_id, tuple) else seq_id
        spec, session, index, request = self._live.pop(request_id)
        self.engine.abort(request_id)
        self._done(spec, session, index, request, aborted=True, reason=HEAD_DROPPED)

    def _record(self, out, seconds: float, bookkeeping: float) -> None:
        self._steps += 1
        cfg, bm = self.config, self.engine.cache
        self.metrics.on_scheduler_step(self.clock.now(), seconds, out, bm, self.engine.scheduler,
                                       self.num_slots, self._num_done, bookkeeping)
        if self._steps % cfg.sample_every == 0:
            self.metrics.on_memory(self.clock.now(), snapshot(bm))
        if cfg.check_every is not None and self._steps % cfg.check_every == 0:
            self.engine.check_integrity()
            self.metrics.num_integrity_checks += 1
        if self._progress is not None and self._steps % 8 == 0:
            self._progress(self._num_done, self._num_added, self.clock.now())

    def _result(self, wall: float) -> SimulationResult:
        from scheduler.simulator.calibrate import machine_info

        cfg, engine = self.config, self.engine
        cache = engine.cache
        if self._progress is not None:
            self._progress(self._num_done, self._num_added, self.clock.now())
        summary = self.metrics.summary(
            num_blocks=cfg.block_manager.num_blocks, block_size=cfg.block_manager.block_size,
            num_slots=cfg.block_manager.num_slots, bm_stats=cache.stats, wall_seconds=wall,
        )
        summary["requests"]["submitted"] = self._num_added
        if self._bound is not None:
            summary["prefix_cache"]["infinite_cache_hit_rate"] = self._bound.hit_rate
        summary["engine"] = {
            "model": {k: v for k, v in self.description.items() if k != "config"},
            "clock": self.clock_name,
            "steps": engine.stats.num_steps,
            "forward_seconds": engine.stats.forward_time,
            "schedule_seconds": engine.stats.schedule_time,
            "machine": machine_info(),
        }
        if cfg.check_every is not None:
            engine.check_integrity()
            self.metrics.num_integrity_checks += 1
            summary["checks"] = {
                "integrity_checks": self.metrics.num_integrity_checks,
                "leaks": _no_leaks(engine),
            }
        return SimulationResult(cfg, summary, self.metrics, self._num_added)


def _no_leaks(engine: Any) -> str:
    """"ok" when nothing is left held (`Engine.check_no_leaks`, which raises)."""
    engine.check_no_leaks()
    return "ok"


def run_replay(config: SimulationConfig, model: Any, description: dict,
               progress: ProgressFn | None = None, clock: str = "wall",
               step_listener: Callable[[Any, float], None] | None = None) -> SimulationResult:
    """Replay `config`'s workload on the real engine (see `Replay`); `clock`
    is "wall" or "cpu" (`calibrate.CLOCKS`). `step_listener(out, seconds)`
    also sees every engine step (its `SchedulerOutput` and duration)."""
    return Replay(config, model, description, progress, clock, step_listener).run()
