"""Replicas sharing one machine's cores: `SharedCores` against a fine
time-stepped processor-sharing reference, and a fleet's step times against
schedules worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockmgr import BlockManagerConfig
from scheduler.core.scheduler import SchedulerConfig
from scheduler.simulator import SimulationConfig, WorkloadConfig
from scheduler.simulator.cost_model import CostModel
from scheduler.simulator.fleet import FleetSpec, run_fleet
from scheduler.simulator.shared_cores import SharedCores
from scheduler.simulator.workloads import RequestSpec, generate
from tests.summaries import deterministic

# ------------------------------------------------------------ SharedCores


def ticked_ends(jobs: list[tuple[float, float]], cores: float, background: float,
                tick: float) -> list[float]:
    """The reference: time moves in ticks; in each, every started, unfinished
    job does tick x min(1, cores / (running + background)) of its work."""
    remaining = [work for _, work in jobs]
    ends: list[float | None] = [None] * len(jobs)
    now = 0.0
    while any(end is None for end in ends):
        running = [i for i, (start, _) in enumerate(jobs)
                   if start <= now + 1e-12 and ends[i] is None]
        rate = min(1.0, cores / (len(running) + background)) if running else 1.0
        for i in running:
            remaining[i] -= tick * rate
            if remaining[i] <= 1e-12:
                ends[i] = now + tick
        now += tick
    return [end for end in ends if end is not None]


def event_ends(jobs: list[tuple[float, float]], cores: float, background: float) -> list[float]:
    """The same jobs through `SharedCores`: begin each at its start, end the
    earliest `end_time` whenever it comes before the next start."""
    shared = SharedCores(cores, background)
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    ends = [0.0] * len(jobs)
    while pending or shared.in_flight():
        first = min(shared.in_flight(), key=shared.end_time, default=None)
        if pending and (first is None or jobs[pending[0]][0] < shared.end_time(first)):
            i = pending.pop(0)
            shared.begin(i, jobs[i][0], jobs[i][1])
        else:
            assert first is not None
            ends[first] = shared.end_time(first)
            shared.end(first, ends[first])
    return ends


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=6),
       st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0, 3.0]), st.sampled_from([0.0, 0.5, 2.0]))
def test_steps_end_as_processor_sharing_gives(raw, cores, background):
    jobs = [(start / 10, work / 10) for start, work in raw]  # whole ticks of 0.1 s
    tick = 0.0025
    expected = ticked_ends(jobs, cores, background, tick)
    got = event_ends(jobs, cores, background)
    for end, reference in zip(got, expected):
        assert end == pytest.approx(reference, abs=3 * tick)
        assert end >= min(start for start, _ in jobs)


def test_a_step_alone_or_on_enough_cores_keeps_its_time():
    shared = SharedCores(2)
    shared.begin("a", 1.0, 0.3)
    shared.begin("b", 1.1, 0.5)
    assert not shared.shared("a") and shared.end_time("a") == 1.3
    shared.begin("c", 1.2, 0.4)  # three on two cores: all slow down
    assert shared.shared("a") and shared.shared("c")
    assert shared.end_time("a") == pytest.approx(1.2 + 0.1 / (2 / 3))


def test_bad_calls_change_nothing():
    shared = SharedCores(1)
    shared.begin("a", 1.0, 2.0)
    for call in (lambda: shared.begin("a", 1.5, 1.0), lambda: shared.end("b", 1.5),
                 lambda: shared.begin("b", 0.5, 1.0), lambda: shared.begin("b", 1.5, -1.0),
                 lambda: shared.begin("b", 1.5, float("nan"))):
        with pytest.raises(ValueError):
            call()
        assert shared.in_flight() == ("a",) and shared.end_time("a") == 3.0
    for cores in (0, -1, float("inf"), True, "2"):
        with pytest.raises(ValueError):
            SharedCores(cores)
    for background in (-1, float("nan"), True):
        with pytest.raises(ValueError):
            SharedCores(2, background)
    with pytest.raises(ValueError):
        FleetSpec(2, "round_robin", cores=0)
    with pytest.raises(ValueError):
        FleetSpec(2, "round_robin", background=1.0)  # background needs the cores
    spec = FleetSpec(2, "round_robin", cores=1.5, background=0.5)
    assert FleetSpec.from_dict(spec.to_dict()) == spec


def test_background_threads_take_their_share_and_count_it():
    shared = SharedCores(2, background=2)
    assert shared.background_seconds(1.0) == 2.0  # nothing of ours: two threads, two cores
    shared.begin("a", 1.0, 1.0)  # three runnable on two cores: two thirds each
    assert shared.end_time("a") == pytest.approx(2.5)
    shared.end("a", 2.5)
    assert shared.background_seconds(3.0) == pytest.approx(2.0 + 2 * 1.5 * 2 / 3 + 2 * 0.5)


# ------------------------------------------------------------ in a fleet

#: Every step costs one second alone, whatever it holds.
ONE_SECOND = CostModel(step_overhead=1.0, prefill_per_token=0.0, decode_per_token=0.0,
                       attention_per_context_token=0.0, copy_per_page=0.0, copy_per_slot=0.0,
                       swap_per_page=0.0, host_move_per_page=0.0, disk_load_per_page=0.0)


def unit_config(**workload) -> SimulationConfig:
    return SimulationConfig(
        workload=WorkloadConfig(**{"max_context": 2048, **workload}),
        block_manager=BlockManagerConfig(num_blocks=256, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8),
        cost=ONE_SECOND, check_every=None)


def request(rid: str, arrival: float) -> list[RequestSpec]:
    """One request of 4 output tokens: a prefill step, then 3 decode steps."""
    return [RequestSpec(rid, ((hash(rid) & 0xFFFF, 40),), 4, 7, arrival=arrival)]


def finish_times(cores: float | None, arrivals: tuple[float, ...],
                 background: float = 0.0) -> dict:
    sessions = [request(f"r{i}", t) for i, t in enumerate(arrivals)]
    fleet = FleetSpec(len(arrivals), "round_robin", cores, background)
    result = run_fleet(unit_config(), fleet, sessions)
    times = {}
    for replica in result.replicas:
        req = replica.metrics.request_arrays()
        for arrival, ttft, e2e in zip(req["arrival"], req["ttft"], req["e2e"]):
            times[float(arrival)] = (float(arrival + ttft), float(arrival + e2e))
    return times


def test_two_replicas_on_one_core_take_turns():
    # Alone, 4 one-second steps each: first token at 1 s, done at 4 s.
    assert finish_times(None, (0.0, 0.0)) == {0.0: (1.0, 4.0)}
    # Both at once on one core: every step takes 2 s.
    alone, shared = finish_times(None, (0.0, 1.0)), finish_times(1, (0.0, 1.0))
    assert alone == {0.0: (1.0, 4.0), 1.0: (2.0, 5.0)}
    # r0's first step runs alone [0, 1]; from 1 s both share: r0's three
    # decode steps take 2 s each (done at 7), as do r1's first three (1 to
    # 7); r1's last step runs alone (7 to 8).
    assert shared[0.0] == pytest.approx((1.0, 7.0))
    assert shared[1.0] == pytest.approx((3.0, 8.0))


def test_three_replicas_on_two_cores_run_at_two_thirds():
    times = finish_times(2, (0.0, 0.0, 0.0))
    assert times[0.0] == pytest.approx((1.5, 6.0))


def test_a_share_of_a_core_slows_even_a_lone_replica():
    # what other work leaves of one core: a quarter, and a lone step too
    assert finish_times(0.25, (0.0,))[0.0] == pytest.approx((4.0, 16.0))
    # one replica beside two runnable threads of other work on one core: a third
    assert finish_times(1, (0.0,), background=2.0)[0.0] == pytest.approx((3.0, 12.0))
    result = run_fleet(unit_config(), FleetSpec(1, "round_robin", 1, 2.0), [request("r", 0.0)])
    machine = result.summary["machine"]  # the two threads had two thirds of the core
    assert machine["seconds"] == pytest.approx(12.0)
    assert machine["background_cpu_s"] == pytest.approx(8.0)


def test_a_fleet_on_as_many_cores_as_replicas_runs_as_without_sharing():
    cfg = replace(unit_config(mix={"chat": 1, "multiturn": 1}, num_requests=120, rate=3.0,
                              seed=5), cost=CostModel())
    for router in ("round_robin", "cache_aware"):
        free = run_fleet(cfg, FleetSpec(3, router), generate(cfg.workload)).summary
        own = run_fleet(cfg, FleetSpec(3, router, cores=3), generate(cfg.workload)).summary
        assert [deterministic(r) for r in own["replicas"]] == \
            [deterministic(r) for r in free["replicas"]]
        fewer = run_fleet(cfg, FleetSpec(3, router, cores=1), generate(cfg.workload)).summary
        assert fewer["latency"]["ttft_s"]["p50"] > free["latency"]["ttft_s"]["p50"]
