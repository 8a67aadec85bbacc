"""The simulation loop: real `Scheduler` + real `GroupedStore`, simulated time.

The store is the one the engine builds for a model of the configured layout
(`ModelLayout`: one layer group per attention window, plus recurrent slots).

Each iteration admits the requests that have arrived, asks the scheduler for
a step, "runs" it (the cost model gives its duration; the sampled tokens are
the workload's deterministic outputs), and hands the result back with
`update()`. Nothing here imports MLX; the cost per step is the scheduler's
and block manager's bookkeeping plus O(scheduled sequences) of our own.

Arrivals: a session head with an `arrival` time arrives then (open loop);
one without waits for a free client (closed loop, `concurrency` clients;
the client is busy until the session's last request finishes). A follow-up
request arrives `think_time` after the request it follows finishes.

A request that can never be admitted (its prompt does not fit the pool
with nothing else running) is aborted and counted, so a run always ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from blockmgr import GroupedStore
from blockmgr.errors import MemoryLeak
from scheduler.core.request import Request
from scheduler.core.scheduler import RequestTooLarge, Scheduler
from scheduler.simulator.arrivals import Arrivals
from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.cost_model import step_shape
from scheduler.simulator.layout import ModelLayout
from scheduler.simulator.memory import snapshot
from scheduler.simulator.metrics import MetricsRecorder, RequestRecord
from scheduler.simulator.prefix_bound import PrefixBound
from scheduler.simulator.tokens import TokenSource, derive_key
from scheduler.simulator.trace import iter_sessions, read_trace
from scheduler.simulator.workloads import RequestSpec, generate, head_arrival

#: Why the simulator aborts a request (the report counts each reason).
NEVER_FITS = ("never fits: its prompt and output need more pages than the pool (or more tokens "
              "than max_model_len) allows")
HEAD_DROPPED = ("did not fit the pool with nothing else running (its prefix-cache hit pinned "
                "pages it needed, or the pool is too small): dropped from the head of the queue")

ProgressFn = Callable[[int, int, float], None]


class SimulationError(RuntimeError):
    """The simulation cannot continue (a scheduler that makes no progress)."""


class LeakError(SimulationError):
    """After the last request, pages or slots are held by nobody."""


@dataclass(slots=True)
class SimulationResult:
    """A finished run: its config, summary dict and raw series."""

    config: SimulationConfig
    summary: dict
    metrics: MetricsRecorder
    num_requests: int


@dataclass(slots=True, eq=False)
class PendingStep:
    """A scheduled step, not yet ended: its output, sampled tokens, simulated
    duration and the real seconds scheduling it took."""

    out: Any
    sampled: dict
    row_tokens: list[int]
    dt: float
    bookkeeping: float


@dataclass(slots=True, eq=False)
class _Live:
    spec: RequestSpec
    session: list[RequestSpec]
    index: int
    request: Request
    outputs: list[list[int]]
    closed: bool  # holds a closed-loop client


class Simulation:
    """One run. `run()` once; not reusable. Deterministic for its config."""

    def __init__(
        self,
        config: SimulationConfig,
        sessions: Iterable[list[RequestSpec]] | None = None,
        progress: ProgressFn | None = None,
        *,
        arrivals: Arrivals | None = None,
        bound: bool = True,
        on_finish: Callable[[Request, bool], None] | None = None,
    ) -> None:
        """`arrivals`: the queue this run's requests come from (a fleet's
        replicas share the router's; None: one of `sessions`, or of the
        config's workload). `bound`: compute a trace's infinite-cache hit
        rate. `on_finish(request, aborted)`: called with each request as it
        finishes or is aborted (its prompt, outputs and metrics final), before
        its follow-up turn arrives; an exception from it ends the run."""
        self.config = config
        self.now = 0.0
        self.bm = GroupedStore(config.layout.store_config(config.block_manager))
        self.scheduler = Scheduler(config.scheduler, self.bm, clock=self._clock)
        self.tokens = TokenSource(config.vocab_size)
        self.metrics = MetricsRecorder()
        if arrivals is None:
            sessions = iter(sessions) if sessions is not None else sessions_of(config)
            arrivals = Arrivals(sessions, config.workload.concurrency)
        self.arrivals = arrivals
        # The infinite-cache bound, for traces (O(distinct texts) memory); a
        # fleet's replica leaves it to its router (it sees every request).
        self._bound = PrefixBound() if config.trace is not None and bound else None
        self._progress = progress
        self._on_finish = on_finish
        self._live: dict[Hashable, _Live] = {}  # by request id
        self._greedy: dict = {}  # output length -> shared one-sample SamplingParams
        self._num_added = 0
        self._num_done = 0
        self._steps = 0
        self._idle_steps = 0
        self._attended = _attended_of(config.layout)  # None: the fast path

    def _clock(self) -> float:
        return self.now

    # ------------------------------------------------------------- arrivals

    def _admit_arrived(self) -> None:
        self.arrivals.admit(self.now, self._add)

    def _add(self, when: float, session: list[RequestSpec], index: int, closed: bool,
             prompt: list[int] | None = None) -> None:
        spec = session[index]
        text = self.tokens.text
        if prompt is None:
            prompt = self.prompt_of(spec)
        request = Request(
            spec.request_id,
            prompt,
            self._sampling(spec),
            namespace=spec.namespace,
            arrival_time=when,
        )
        outputs = [text(derive_key(spec.output_key, i), spec.output_len) for i in range(spec.n)]
        self._live[spec.request_id] = _Live(spec, session, index, request, outputs, closed)
        if self._bound is not None:
            self._bound.observe(spec)
        self._num_added += 1
        try:
            self.scheduler.add_request(request)
        except RequestTooLarge:  # it could never run: aborted on arrival
            request.metrics.arrival_time = when
            self._finish(spec.request_id, aborted=True, reason=NEVER_FITS)

    def prompt_of(self, spec: RequestSpec) -> list[int]:
        """The token ids of `spec`'s prompt (a fresh list). O(prompt)."""
        return list(spec.tokens) if spec.tokens is not None else self.tokens.expand(spec.prompt)

    def _sampling(self, spec: RequestSpec):
        """`spec.sampling()`. A one-sample request's depends on its output
        length alone, so requests of one length share one record (nothing
        here changes it): building and validating one costs about 13 us."""
        if spec.n != 1:
            return spec.sampling()
        params = self._greedy.get(spec.output_len)
        if params is None:
            params = self._greedy[spec.output_len] = spec.sampling()
        return params

    # ----------------------------------------------------------------- loop

    def run(self) -> SimulationResult:
        """Run to the last request. Raises `SimulationError` (or, with checks
        on, `IntegrityError` / `LeakError`) when an invariant breaks."""
        wall_start = time.perf_counter()
        while self._advance():
            pass
        return self.result(time.perf_counter() - wall_start)

    def _advance(self) -> bool:
        """Admit arrivals, then run one step, or move the clock to the next
        arrival when nothing is queued. False once everything is done."""
        self._admit_arrived()
        if self.scheduler.has_unfinished():
            step = self.begin_step()
            if step is not None:
                self.end_step(step)
            return True
        upcoming = self.arrivals.next_time(self.now)
        if upcoming is None:
            return False
        self.now = max(self.now, upcoming)
        return True

    @property
    def has_unfinished(self) -> bool:
        """Requests are running or waiting: a step is due at `now`."""
        return self.scheduler.has_unfinished()

    @property
    def num_done(self) -> int:
        """Requests finished or aborted."""
        return self._num_done

    @property
    def num_live(self) -> int:
        """Requests added and not finished (a router's load)."""
        return len(self._live)

    def add(self, when: float, session: list[RequestSpec], index: int, closed: bool,
            prompt: list[int] | None = None) -> None:
        """Request `session[index]` arrives at `when` (<= `now`); `prompt`:
        its token ids when the caller has them already."""
        self._add(when, session, index, closed, prompt)

    def begin_step(self) -> PendingStep | None:
        """Schedule one step at `now` and price it; None when an empty step
        aborted a request that can never fit (no time passes: begin again).
        `end_step` finishes it at `now + step.dt`."""
        sched, perf = self.scheduler, time.perf_counter
        t0 = perf()
        out = sched.schedule()
        t1 = perf()
        if out.is_empty:
            self._idle_steps += 1
            if self._unstick(self._idle_steps):
                return None
        else:
            self._idle_steps = 0
        sampled, row_tokens = self._sample(out)
        dt = self.config.cost.time_of(step_shape(out, self._attended))
        return PendingStep(out, sampled, row_tokens, dt, t1 - t0)

    def end_step(self, step: PendingStep) -> None:
        """The step's end: the clock moves by its duration, the scheduler
        gets its sampled tokens, finished requests are recorded."""
        self.now += step.dt
        sched, perf = self.scheduler, time.perf_counter
        t2 = perf()
        results = sched.update(step.out, step.sampled, deltas=False,  # only finished ones are read
                               row_tokens=step.row_tokens)
        t3 = perf()
        for result in results:
            if result.finished:
                self._finish(result.request_id, aborted=False)
        self._record(step.out, step.dt, step.bookkeeping + (t3 - t2))

    def _record(self, out, dt: float, bookkeeping: float) -> None:
        """Per-step series; memory snapshots, integrity checks and progress
        at their intervals."""
        self._steps += 1
        step, bm, cfg = self._steps, self.bm, self.config
        self.metrics.on_scheduler_step(self.now, dt, out, bm, self.scheduler,
                                       cfg.block_manager.num_slots, self._num_done, bookkeeping)
        if step % cfg.sample_every == 0:
            self.metrics.on_memory(self.now, snapshot(bm))
        if cfg.check_every is not None and step % cfg.check_every == 0:
            bm.check_integrity()
            self.scheduler.check_counts()
            self.metrics.num_integrity_checks += 1
        if self._progress is not None and step % 64 == 0:
            self._progress(self._num_done, self._num_added, self.now)

    def _sample(self, out) -> tuple[dict, list[int]]:
        """The tokens the model would sample: those of `out.items` by
        sequence id, and those of `out.rows` in row order."""
        live = self._live
        rows = out.rows
        row_tokens: list[int] = []
        add_token = row_tokens.append  # bound once: a call per row
        for req, index in zip(rows.requests, rows.sample_indices):
            # A decode row samples the next output: its position is the count of outputs it has.
            o = live[req.request_id].outputs[index]
            position = len(req.outputs[index])
            add_token(o[position] if position < len(o) else o[-1])
        sampled = {}
        for item in out.items:
            if not item.sample:
                continue
            outputs = live[item.request_id].outputs
            index = item.sample_index
            if index is None:
                position = (item.start_position + len(item.token_ids)
                            - len(item.request.prompt_tokens))
                sampled[item.seq_id] = [o[min(position, len(o) - 1)] for o in outputs]
            else:
                # A sampling chunk ends at the sample's last token: the next
                # output's position is the count of outputs it has.
                position = len(item.request.outputs[index])
                o = outputs[index]
                sampled[item.seq_id] = o[position] if position < len(o) else o[-1]
        return sampled, row_tokens

    def _unstick(self, idle_steps: int) -> bool:
        """An empty step. Abort the head waiting request if nothing runs (it can
        never fit); True if the loop should retry at once."""
        sched = self.scheduler
        if sched.num_running == 0 and sched.num_waiting:
            seq_id = sched.waiting_ids()[0]
            request_id = seq_id[0] if isinstance(seq_id, tuple) else seq_id
            sched.abort(request_id)
            self._finish(request_id, aborted=True, reason=HEAD_DROPPED)
            return True
        if idle_steps > 1000:
            raise SimulationError(
                f"the scheduler made no progress for {idle_steps} steps with "
                f"{sched.num_running} running and {sched.num_waiting} waiting"
            )
        return False

    def _finish(self, request_id: Hashable, aborted: bool, reason: str | None = None) -> None:
        entry = self._live.pop(request_id)
        if self._on_finish is not None:
            self._on_finish(entry.request, aborted)
        self.metrics.on_finish(RequestRecord.of(entry.spec.workload, entry.request, self.now,
                                                aborted, reason))
        self._num_done += 1
        self.arrivals.follow(entry.session, entry.index, entry.closed, self.now)

    # --------------------------------------------------------------- ending

    def result(self, wall: float) -> SimulationResult:
        """The run's summary after its last request (with checks on: the
        final integrity and leak checks, which drop the prefix cache)."""
        cfg = self.config
        bm = self.bm
        stats = bm.stats
        if self._progress is not None:
            self._progress(self._num_done, self._num_added, self.now)
        summary = self.metrics.summary(
            num_blocks=cfg.block_manager.num_blocks,
            block_size=cfg.block_manager.block_size,
            num_slots=cfg.block_manager.num_slots,
            bm_stats=stats,
            wall_seconds=wall,
        )
        summary["requests"]["submitted"] = self._num_added
        if self._bound is not None:
            summary["prefix_cache"]["infinite_cache_hit_rate"] = self._bound.hit_rate
        tiers = bm.tier_usage()
        if tiers:  # the prefix cache's host and disk tiers (design/tiers.md)
            summary["prefix_cache"]["tiers"] = {
                usage.tier.name.lower(): {
                    "nodes": usage.num_nodes,
                    "pages_used": list(usage.num_used_pages),
                    "pages": list(usage.num_pages),
                    "slots_used": usage.num_used_slots,
                    "pages_demoted_in": usage.num_demoted_pages,
                    "pages_loaded_from": usage.num_loaded_pages,
                }
                for usage in tiers
            }
        if cfg.check_every is not None:
            bm.check_integrity()
            self.metrics.num_integrity_checks += 1
            summary["checks"] = {
                "integrity_checks": self.metrics.num_integrity_checks,
                "leaks": check_no_leaks(bm, self.scheduler),
            }
        return SimulationResult(cfg, summary, self.metrics, self._num_added)


def _attended_of(layout: ModelLayout) -> Callable[[int], float] | None:
    """`layout.attended` for `step_shape`, or None (every key before the
    query, summed without a call per row) when every attention layer is full:
    then `attended(end) == end` exactly, so the step times are the same."""
    if layout.full and not layout.sliding:
        return None
    return layout.attended


def check_no_leaks(store: GroupedStore, sched: Scheduler) -> str:
    """After the last request: no request left in the scheduler and nothing
    but the prefix trie holding the store's memory (`check_no_leaks` of
    the store). Returns "ok" or raises `LeakError` naming what is held.
    Changes the store (drops the tries)."""
    problems = []
    if sched.has_unfinished():
        problems.append(f"scheduler still has {sched.num_running} running, "
                        f"{sched.num_waiting} waiting")
    try:
        store.check_no_leaks()
    except MemoryLeak as exc:
        problems.append(str(exc))
    if problems:
        raise LeakError("; ".join(problems))
    return "ok"


def sessions_of(config: SimulationConfig) -> Iterator[list[RequestSpec]]:
    """The run's sessions: generated, or read from its trace (timed heads in
    arrival order)."""
    if config.trace is None:
        return generate(config.workload)
    _, sessions = read_trace(config.trace, config.trace_block_tokens, config.time_scale)
    return iter_sessions(_ordered(sessions))


def _ordered(sessions: list[list[RequestSpec]]) -> list[list[RequestSpec]]:
    """Open-loop heads in arrival order (closed-loop heads keep file order, after)."""
    timed = [s for s in sessions if s[0].arrival is not None]
    untimed = [s for s in sessions if s[0].arrival is None]
    timed.sort(key=head_arrival)
    return timed + untimed


def run_simulation(
    config: SimulationConfig,
    sessions: Iterable[list[RequestSpec]] | None = None,
    progress: ProgressFn | None = None,
) -> SimulationResult:
    """Run one simulation (see `Simulation`)."""
    return Simulation(config, sessions, progress).run()
