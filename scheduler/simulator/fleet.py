"""A fleet: N replicas of one simulated server behind a router.

Each replica is a whole `Simulation` (the real `Scheduler` over the real
store, the same objects one server runs), with its own simulated clock.
The fleet reads the workload's one `Arrivals` queue and hands each request,
when it arrives, to the replica its router (`routers.py`) names; a
replica's finished requests queue their sessions' follow-ups back into the
same queue, so a conversation's next turn is routed again.

Events run in simulated time order: a replica's step ends, requests arrive,
a replica's step begins (at equal times in that order, as one server's loop
does). A step is scheduled when it begins and updated when it ends; a
request routed to a replica in the middle of a step joins its queue at the
step's end, as it would on one server. So the router sees each replica as
it is at the request's arrival (a step in flight shows its scheduled
state), and a fleet of one makes exactly one server's run (tested).

With `cores` (`FleetSpec`), the replicas share one machine's cores
(`shared_cores.py`): a step's priced time is its work, and while more
steps are in flight than there are cores they share them, so every step
in flight ends later than priced. Without it each replica has a machine
of its own.

With `step_jitter` σ (`FleetSpec`), each step's priced time is multiplied
by a draw of a log-normal factor of mean 1 (its log has standard deviation
σ), from the fleet's own generator (`seed`): real steps of one shape vary
by some 10 % (a calibration measures it), and in a closed loop which
replica a session's next turn reaches under round robin depends on which
step ended first, so the real fleet's outcome varies from run to run; seeds
of a jittered fleet give that spread. σ = 0 (the default) draws nothing:
the fleet runs exactly as the priced steps say.

Costs: per event O(log replicas) plus the replica's step (with `cores`:
plus O(steps in flight x log replicas)); per request the router's cost
(`routers.py`).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import cast

import numpy as np

from blockmgr.errors import InvalidArgument
from blockmgr.kv_store import KVStore
from blockmgr.validation import check_int, check_number
from scheduler.simulator.arrivals import Arrivals
from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.memory import snapshot
from scheduler.simulator.metrics import MetricsRecorder
from scheduler.simulator.prefix_bound import PrefixBound
from scheduler.simulator.routers import (
    RouteRequest,
    RouterSettings,
    check_router,
    make_router,
)
from scheduler.simulator.runner import (
    PendingStep,
    ProgressFn,
    Simulation,
    SimulationError,
    SimulationResult,
    sessions_of,
)
from scheduler.simulator.shared_cores import SharedCores
from scheduler.simulator.workloads import RequestSpec

#: Event priorities at equal times: a step ends, then requests arrive, then a step begins.
_END, _ARRIVAL, _BEGIN = 0, 1, 2

#: The most replicas one simulated fleet may have.
MAX_REPLICAS = 4096
#: The largest step jitter (a step's time factor's log's standard deviation).
MAX_STEP_JITTER = 1.0


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The fleet around one server's `SimulationConfig`: how many replicas,
    which router (a name of `routers.ROUTERS`), and `cores`: the cores of
    the one machine all replicas run on (None: a machine each), beside
    `background` runnable threads of other work (`shared_cores.py`);
    `step_jitter`: the standard deviation of the log of each step's time
    factor (0: none; see the module doc), drawn from `seed`.
    Raises `InvalidArgument`."""

    num_replicas: int = 1
    router: str = "round_robin"
    cores: float | None = None
    background: float = 0.0
    step_jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        n = self.num_replicas
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLICAS:
            raise InvalidArgument(f"replicas must be an int in [1, {MAX_REPLICAS}], got {n!r}")
        check_router(self.router)
        if self.cores is not None:
            SharedCores(self.cores, self.background)  # raises for bad counts
        elif self.background:
            raise InvalidArgument("background threads need the fleet's cores")
        if check_number("step_jitter", self.step_jitter, 0.0) > MAX_STEP_JITTER:
            raise InvalidArgument(f"step_jitter must be <= {MAX_STEP_JITTER}, "
                                  f"got {self.step_jitter!r}")
        # Frozen: the checked seed is stored back (a numpy integer becomes
        # the int that `random.Random` takes).
        object.__setattr__(self, "seed", check_int("seed", self.seed, None))

    def to_dict(self) -> dict:
        data = {"replicas": self.num_replicas, "router": self.router}
        if self.cores is not None:
            data["cores"] = self.cores
        if self.background:
            data["background"] = self.background
        if self.step_jitter:
            data["step_jitter"] = self.step_jitter
            data["seed"] = self.seed
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "FleetSpec":
        keys = {"replicas", "router", "cores", "background", "step_jitter", "seed"}
        if not isinstance(data, dict) or set(data) - keys:
            raise InvalidArgument(f"a fleet is {{'replicas': N, 'router': NAME[, 'cores': C, "
                                  f"'background': B, 'step_jitter': S, 'seed': N]}}, "
                                  f"got {data!r:.80}")
        return cls(data.get("replicas", 1), data.get("router", "round_robin"),
                   data.get("cores"), data.get("background", 0.0),
                   data.get("step_jitter", 0.0), data.get("seed", 0))


@dataclass(slots=True)
class FleetResult:
    """A finished fleet run: the server config, the fleet, the fleet's
    summary (with each replica's), each replica's result, and the replica
    every request was routed to."""

    config: SimulationConfig
    fleet: FleetSpec
    summary: dict
    replicas: list[SimulationResult]
    routes: dict[Hashable, int]
    num_requests: int


class _Replica:
    """One replica: its simulation, a step in flight, the requests routed
    to it during that step (they join at its end). A `ReplicaView`."""

    __slots__ = ("index", "sim", "step", "pending", "num_routed", "version")

    def __init__(self, index: int, sim: Simulation) -> None:
        self.index = index
        self.sim = sim
        self.step: PendingStep | None = None
        self.pending: list[tuple] = []
        self.num_routed = 0
        self.version = 0  # bumped whenever its next event changes

    @property
    def load(self) -> int:
        return self.sim.num_live + len(self.pending)

    @property
    def store(self) -> KVStore:
        return self.sim.bm

    @property
    def num_waiting(self) -> int:
        """Queued in its scheduler, and routed during its step (they queue
        at its end)."""
        return self.sim.scheduler.num_waiting + len(self.pending)

    @property
    def token_usage(self) -> float:
        """Distinct pages its live sequences hold over its pool. O(pages held)."""
        pool = self.sim.config.block_manager.num_blocks
        return snapshot(self.sim.bm).physical_pages / pool

    def event(self) -> tuple[float, int] | None:
        """(time, priority) of its next event; None when idle."""
        if self.step is not None:
            return self.sim.now + self.step.dt, _END
        if self.sim.has_unfinished:
            return self.sim.now, _BEGIN
        return None

    def run_event(self) -> None:
        sim = self.sim
        if self.step is None:
            self.step = sim.begin_step()  # None: a request was dropped; begin again
            return
        step, self.step = self.step, None
        sim.end_step(step)
        pending, self.pending = self.pending, []
        for args in pending:
            sim.add(*args)


class Fleet:
    """One fleet run. `run()` once; deterministic for its config and fleet."""

    def __init__(
        self,
        config: SimulationConfig,
        fleet: FleetSpec,
        sessions: Iterable[list[RequestSpec]] | None = None,
        progress: ProgressFn | None = None,
        settings: RouterSettings | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        source = iter(sessions) if sessions is not None else sessions_of(config)
        self.arrivals = Arrivals(source, config.workload.concurrency)
        self.replicas = [_Replica(i, Simulation(config, arrivals=self.arrivals, bound=False))
                         for i in range(fleet.num_replicas)]
        if settings is None:
            settings = RouterSettings(fleet.num_replicas, config.block_manager.num_blocks,
                                      config.block_manager.block_size)
        self.router = make_router(fleet.router, settings)
        self.routes: dict[Hashable, int] = {}
        self.now = 0.0
        self._events: list[tuple[float, int, int, int]] = []  # time, priority, replica, version
        self._bound = PrefixBound() if config.trace is not None else None
        self._progress = progress
        self._num_events = 0
        self._cores = None if fleet.cores is None else SharedCores(fleet.cores, fleet.background)
        self._jitter = random.Random(fleet.seed) if fleet.step_jitter else None

    # -------------------------------------------------------------- routing

    def _route(self, when: float, session: list[RequestSpec], index: int, closed: bool) -> None:
        spec = session[index]
        replicas = self.replicas
        prompt = replicas[0].sim.prompt_of(spec) if self.router.needs_tokens else None
        target = self.router.route(
            RouteRequest(spec.request_id, prompt or (), spec.namespace, self.now), replicas)
        if isinstance(target, bool) or not isinstance(target, int) \
                or not 0 <= target < len(replicas):
            raise SimulationError(f"router {self.fleet.router} named replica {target!r} of "
                                  f"{len(replicas)}")
        if self._bound is not None:
            self._bound.observe(spec)
        self.routes[spec.request_id] = target
        replica = replicas[target]
        replica.num_routed += 1
        if replica.step is not None:  # joins at the step's end, as on one server
            replica.pending.append((when, session, index, closed, prompt))
            return
        idle = not replica.sim.has_unfinished
        if idle:
            replica.sim.now = max(replica.sim.now, self.now)
        replica.sim.add(when, session, index, closed, prompt)
        if idle:
            self._schedule(replica)

    def _schedule(self, replica: _Replica) -> None:
        replica.version += 1
        event = replica.event()
        if event is not None:
            heapq.heappush(self._events, (*event, replica.index, replica.version))

    # ----------------------------------------------------------------- loop

    def run(self) -> FleetResult:
        """Run to the last request; raises as `Simulation.run` does."""
        wall_start = time.perf_counter()
        while self._advance():
            pass
        return self._result(time.perf_counter() - wall_start)

    def _advance(self) -> bool:
        self.arrivals.admit(self.now, self._route)
        events, replicas = self._events, self.replicas
        while events and events[0][3] != replicas[events[0][2]].version:
            heapq.heappop(events)  # superseded
        arrival = self.arrivals.next_time(self.now)
        if not events:
            if arrival is None:
                return False
            self.now = max(self.now, arrival)
            return True
        when, priority, index, _ = events[0]
        if arrival is not None and (arrival, _ARRIVAL) < (when, priority):
            self.now = max(self.now, arrival)
            return True
        heapq.heappop(events)
        self.now = when
        replica = replicas[index]
        ending = replica.step is not None
        replica.run_event()
        if self._jitter is not None and not ending and replica.step is not None:
            replica.step.dt *= self._jitter_factor()
        self._schedule(replica)
        if self._cores is not None:
            self._share(replica, ending)
        self._num_events += 1
        if self._progress is not None and self._num_events % 256 == 0:
            self._report_progress()
        return True

    def _jitter_factor(self) -> float:
        """A step's time factor: log-normal, mean 1 (`FleetSpec.step_jitter`)."""
        assert self._jitter is not None
        sigma = self.fleet.step_jitter
        return self._jitter.lognormvariate(-sigma * sigma / 2, sigma)

    def _share(self, replica: _Replica, ending: bool) -> None:
        """A step of `replica` ended (`ending`) or began: every step in
        flight that shares the cores gets its new end."""
        cores = self._cores
        assert cores is not None
        if ending:
            cores.end(replica.index, self.now)
        elif replica.step is not None:
            cores.begin(replica.index, self.now, replica.step.dt)
        for index in cores.in_flight():
            if cores.shared(index):
                other = self.replicas[cast(int, index)]  # the fleet's keys are indices
                assert other.step is not None
                other.step.dt = cores.end_time(index) - other.sim.now
                self._schedule(other)

    def _report_progress(self) -> None:
        assert self._progress is not None
        sims = [r.sim for r in self.replicas]
        done = sum(s.num_done for s in sims)
        self._progress(done, len(self.routes), self.now)

    # --------------------------------------------------------------- ending

    def _result(self, wall: float) -> FleetResult:
        if self._progress is not None:
            self._report_progress()
        results = [r.sim.result(wall) for r in self.replicas]
        summary = fleet_summary(results, wall)
        summary["routing"] = {
            "router": self.fleet.router,
            "replicas": self.fleet.num_replicas,
            "requests": [r.num_routed for r in self.replicas],
        }
        if self._bound is not None:
            summary["prefix_cache"]["infinite_cache_hit_rate"] = self._bound.hit_rate
        if self.fleet.step_jitter:
            summary["step_jitter"] = {"sigma": self.fleet.step_jitter, "seed": self.fleet.seed}
        if self._cores is not None:
            summary["machine"] = {
                "cores": self._cores.cores, "background": self._cores.background,
                "background_cpu_s": self._cores.background_seconds(self.now),
                "seconds": self.now}
        summary["replicas"] = [r.summary for r in results]
        return FleetResult(self.config, self.fleet, summary, results, self.routes,
                           len(self.routes))


def fleet_summary(results: list[SimulationResult], wall: float) -> dict:
    """The fleet's metrics over its replicas' runs: requests, throughput
    and latency over every request (throughput over the fleet's makespan);
    prefix-cache tokens, preemptions, evictions and steps summed; page
    usage the replicas' mean (peaks their max). Shaped as one server's
    summary for the metrics they share (a fleet of one: the same values).
    O(requests + steps)."""
    merged = MetricsRecorder.merged([r.metrics for r in results])
    steps = [r.metrics.step_arrays() for r in results]
    arrivals = merged.request_arrays()["arrival"]
    start = float(arrivals.min()) if len(arrivals) else 0.0
    end = max((float(s["time"][-1]) for s in steps if len(s["time"])), default=0.0)
    makespan = max(end - start, 0.0)
    requests, throughput, latency = merged.request_sections(makespan, "simulated_seconds")
    prefill = sum(float(s["prefill_tokens"].sum()) for s in steps)
    computed = prefill + sum(float(s["decode_tokens"].sum()) for s in steps)
    throughput["computed_tokens_per_s"] = computed / makespan if makespan > 0 else 0.0
    summaries = [r.summary for r in results]
    requests["submitted"] = sum(s["requests"]["submitted"] for s in summaries)
    step_time = np.concatenate([s["step_time"] for s in steps])
    batch = np.concatenate([s["prefill_tokens"] + s["decode_tokens"] for s in steps])
    bookkeeping = np.concatenate([s["bookkeeping"] for s in steps])
    summary = {
        "requests": requests,
        "throughput": throughput,
        "latency": latency,
        "prefix_cache": _prefix(summaries, merged, prefill),
        "memory": _memory(summaries),
        "preemptions": _summed(summaries, "preemptions"),
        "evictions": _summed(summaries, "evictions"),
        "steps": {
            "count": int(len(step_time)),
            "mean_step_time_s": float(step_time.mean()) if len(step_time) else 0.0,
            "mean_batch_tokens": float(batch.mean()) if len(batch) else 0.0,
        },
        "bookkeeping": {
            "seconds_total": float(bookkeeping.sum()),
            "per_step_us": {"mean": float(bookkeeping.mean() * 1e6) if len(bookkeeping) else None},
            "wall_seconds": wall,
        },
    }
    if all("checks" in s for s in summaries):
        summary["checks"] = {
            "integrity_checks": sum(s["checks"]["integrity_checks"] for s in summaries),
            "leaks": "ok" if all(s["checks"]["leaks"] == "ok" for s in summaries) else "failed",
        }
    return summary


def _prefix(summaries: list[dict], merged: MetricsRecorder, prefill: float) -> dict:
    hit = sum(s["prefix_cache"]["hit_tokens"] for s in summaries)
    query = sum(s["prefix_cache"]["query_tokens"] for s in summaries)
    req = merged.request_arrays()
    prompt = float(req["prompt_tokens"].sum())
    first = float(req["cached_tokens"].sum())
    return {
        "hit_rate": hit / query if query else 0.0,
        "hit_tokens": hit,
        "query_tokens": query,
        "queries": sum(s["prefix_cache"]["queries"] for s in summaries),
        "hits": sum(s["prefix_cache"]["hits"] for s in summaries),
        "first_admission_hit_rate": first / prompt if prompt else 0.0,
        "prompt_tokens_computed": int(prefill),
    }


def _memory(summaries: list[dict]) -> dict:
    mems = [s["memory"] for s in summaries]
    return {
        "num_blocks": mems[0]["num_blocks"],
        "block_size": mems[0]["block_size"],
        "page_usage_peak": max(m["page_usage_peak"] for m in mems),
        "page_usage_mean": float(np.mean([m["page_usage_mean"] for m in mems])),
        "pages_used_peak": max(m["pages_used_peak"] for m in mems),
        "fragmentation_mean": float(np.mean([m["fragmentation_mean"] for m in mems])),
    }


def _summed(summaries: list[dict], section: str) -> dict:
    return {key: sum(s[section][key] for s in summaries) for key in summaries[0][section]}


def run_fleet(
    config: SimulationConfig,
    fleet: FleetSpec,
    sessions: Iterable[list[RequestSpec]] | None = None,
    progress: ProgressFn | None = None,
    settings: RouterSettings | None = None,
) -> FleetResult:
    """Run one fleet (see `Fleet`)."""
    return Fleet(config, fleet, sessions, progress, settings).run()
