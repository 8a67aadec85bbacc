"""The fleet simulator: a fleet of one is one server, every replica leak-free,
session-pinning routers pin, round robin spreads, and the cache-aware
router's approximate tree against a naive longest-common-prefix scan."""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from blockmgr import BlockManagerConfig, WrongArgumentType
from scheduler.cli import main
from scheduler.core.scheduler import SchedulerConfig
from scheduler.simulator import SimulationConfig, WorkloadConfig, generate, run_simulation
from scheduler.simulator.approx_tree import ApproxPrefixTree
from scheduler.simulator.fleet import FleetSpec, run_fleet
from scheduler.simulator.layout import layout_named
from scheduler.simulator.lengths import LengthDist
from scheduler.simulator.routers import ROUTERS
from scheduler.simulator.sweep import grid_points, parse_grid, run_sweep
from scheduler.simulator.trace import write_trace
from scheduler.simulator.workloads import WORKLOAD_KINDS
from tests.summaries import deterministic

#: The sections a fleet's summary shares with one server's.
SHARED = ("requests", "throughput", "latency", "prefix_cache", "preemptions", "evictions")


def config(num_blocks: int = 512, check_every: int | None = 16, **workload) -> SimulationConfig:
    wl: dict[str, Any] = dict(mix=dict.fromkeys(WORKLOAD_KINDS, 1.0), num_requests=150,
                              rate=2.0, seed=3, max_context=2048)
    wl.update(workload)
    return SimulationConfig(
        workload=WorkloadConfig(**wl),
        block_manager=BlockManagerConfig(num_blocks=num_blocks, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=32),
        check_every=check_every,
        sample_every=4,
    )


# ------------------------------------------------------- a fleet of one

ONE_SERVER_CASES = {
    "mixed": config(),
    "preempting": config(num_blocks=300, rate=8.0, mix={"chat": 1, "parallel": 1, "agent": 1}),
    "closed": config(arrival="closed", concurrency=12, mix={"multiturn": 1, "tenants": 1}),
    "hybrid": replace(config(mix={"chat": 1, "agent": 1}), layout=layout_named("qwen3_next"),
                      block_manager=BlockManagerConfig(num_blocks=512, block_size=16,
                                                       num_slots=64)),
}


@pytest.mark.parametrize("case", sorted(ONE_SERVER_CASES))
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_a_fleet_of_one_is_one_server(case, router):
    cfg = ONE_SERVER_CASES[case]
    one = run_simulation(cfg).summary
    fleet = run_fleet(cfg, FleetSpec(1, router)).summary
    assert deterministic(fleet["replicas"][0]) == deterministic(one)
    for section in SHARED:  # every metric one server has, the fleet has alike
        assert {k: v for k, v in fleet[section].items() if k in one[section]} == one[section]
    assert fleet["routing"]["requests"] == [one["requests"]["submitted"]]
    assert one["requests"]["finished"] > 100


def test_a_fleet_of_one_on_a_trace_is_one_server(tmp_path):
    path = tmp_path / "w.jsonl"
    base = config(mix={"multiturn": 1, "chat": 1})
    write_trace(path, generate(base.workload), {"vocab_size": base.vocab_size})
    cfg = replace(base, trace=str(path))
    one = run_simulation(cfg).summary
    fleet = run_fleet(cfg, FleetSpec(1, "precise")).summary
    expected = deterministic(one)  # the bound is the router's: it sees every request
    expected["prefix_cache"] = {k: v for k, v in one["prefix_cache"].items()
                                if k != "infinite_cache_hit_rate"}
    assert deterministic(fleet["replicas"][0]) == expected
    assert fleet["prefix_cache"]["infinite_cache_hit_rate"] == \
        one["prefix_cache"]["infinite_cache_hit_rate"]
    for section in SHARED:
        assert {k: v for k, v in fleet[section].items() if k in one[section]} == one[section]


# ---------------------------------------------------------- every replica


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_every_replica_is_leak_free_under_check(tmp_path, capsys, router):
    out = tmp_path / "rep"
    code = main(["simulate", "--workload", "chat,multiturn,agent,parallel", "-n", "200",
                 "--rate", "6", "--num-blocks", "300", "--max-context", "2048", "--replicas", "3",
                 "--router", router, "--check", "8", "--out", str(out), "--no-progress",
                 "--no-plots"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert report["fleet"] == {"replicas": 3, "router": router}
    assert len(summary["replicas"]) == 3
    for replica, routed in zip(summary["replicas"], summary["routing"]["requests"]):
        assert replica["checks"]["leaks"] == "ok"
        assert replica["checks"]["integrity_checks"] > 1
        assert replica["requests"]["submitted"] == routed
        assert replica["requests"]["finished"] + replica["requests"]["aborted"] == routed
    assert sum(summary["routing"]["requests"]) == 200
    assert summary["evictions"]["pages"] > 0  # the pools were under pressure
    assert summary["checks"]["leaks"] == "ok"


# ----------------------------------------------------------------- routing


def pinned_config() -> SimulationConfig:
    """Conversations whose turns mostly repeat the turn before (long shared
    system prompts, short messages and answers) at a light load, in pools
    that never evict."""
    return config(num_blocks=4096, check_every=None, mix={"multiturn": 1}, num_requests=240,
                  rate=1.0, num_system_prompts=24,
                  system_len=LengthDist("lognormal", 600, 0.3, 64, 2048),
                  user_len=LengthDist("lognormal", 40, 0.5, 1, 200),
                  output_len=LengthDist("lognormal", 30, 0.5, 1, 100))


def sessions_of(cfg: SimulationConfig) -> list[list[str]]:
    return [[spec.request_id for spec in session] for session in generate(cfg.workload)]


@pytest.mark.parametrize("router", ["cache_aware", "precise"])
def test_a_session_stays_on_one_replica(router):
    cfg = pinned_config()
    result = run_fleet(cfg, FleetSpec(4, router))
    sessions = [s for s in sessions_of(cfg) if len(s) > 1]
    assert len(sessions) > 20
    for session in sessions:
        assert len({result.routes[rid] for rid in session}) == 1, session
    assert len(set(result.routes.values())) == 4  # not one replica for everything


def test_round_robin_does_not_pin_sessions():
    """The check above can fail: round robin splits conversations."""
    cfg = pinned_config()
    result = run_fleet(cfg, FleetSpec(4, "round_robin"))
    split = [s for s in sessions_of(cfg) if len({result.routes[rid] for rid in s}) > 1]
    assert len(split) > 20


def test_pinning_routers_hit_more_than_round_robin():
    cfg = pinned_config()
    rates = {name: run_fleet(cfg, FleetSpec(4, name)).summary["prefix_cache"]["hit_rate"]
             for name in ("round_robin", "precise")}
    assert rates["precise"] > rates["round_robin"] + 0.1


@pytest.mark.parametrize("num_replicas", [2, 3, 5])
def test_round_robin_spreads_requests_evenly(num_replicas):
    cfg = config(check_every=None, num_requests=203)
    result = run_fleet(cfg, FleetSpec(num_replicas, "round_robin"))
    counts = result.summary["routing"]["requests"]
    assert sum(counts) == 203 and max(counts) - min(counts) <= 1
    # in arrival order: replica 0, 1, ..., N-1, 0, ...
    assert list(result.routes.values()) == [i % num_replicas for i in range(203)]
    for replica, count in zip(result.summary["replicas"], counts):
        assert replica["requests"]["finished"] + replica["requests"]["aborted"] == count


def test_least_load_never_routes_to_a_busier_replica():
    cfg = config(check_every=None, rate=20.0, num_requests=300, mix={"chat": 1})
    result = run_fleet(cfg, FleetSpec(3, "least_load"))
    counts = result.summary["routing"]["requests"]
    assert max(counts) - min(counts) < 0.2 * max(counts)


def test_a_sweep_over_replicas_and_routers_runs_fleets():
    cfg = config(check_every=None, num_requests=80)
    grid = parse_grid("replicas=1,2;router=round_robin,precise")
    rows = run_sweep(grid_points(cfg, grid, None), jobs=1)
    assert [r["params"] for r in rows] == [
        {"replicas": 1, "router": "round_robin"}, {"replicas": 1, "router": "precise"},
        {"replicas": 2, "router": "round_robin"}, {"replicas": 2, "router": "precise"}]
    for row in rows:
        direct = run_fleet(cfg, FleetSpec(row["params"]["replicas"], row["params"]["router"]))
        assert deterministic(row["summary"]["replicas"][0]) == \
            deterministic(direct.summary["replicas"][0])
        assert row["summary"]["routing"] == direct.summary["routing"]


def test_a_sweep_keeps_the_fleets_machine_and_jitter():
    """The sweep's --cores, --background and --step-jitter reach every
    point's fleet (a point sets only its replicas and router)."""
    cfg = config(check_every=None, num_requests=60)
    base = FleetSpec(1, "round_robin", cores=2.0, background=0.5, step_jitter=0.1, seed=7)
    rows = run_sweep(grid_points(cfg, parse_grid("replicas=3"), None), jobs=1, fleet=base)
    direct = run_fleet(cfg, replace(base, num_replicas=3))
    assert rows[0]["summary"]["machine"] == deterministic(direct.summary)["machine"]
    assert rows[0]["summary"]["step_jitter"] == {"sigma": 0.1, "seed": 7}
    assert deterministic(rows[0]["summary"]["replicas"][1]) == \
        deterministic(direct.summary["replicas"][1])


def test_step_jitter_multiplies_each_priced_step_by_its_draw():
    """Every request arrives before the first step ends, so the steps are
    the same with and without jitter: the jittered fleet's k-th step takes
    the plain one's times the k-th log-normal draw of `seed` (mean 1)."""
    cfg = config(check_every=None, num_requests=40, rate=1e6, mix={"chat": 1})
    plain = run_fleet(cfg, FleetSpec()).replicas[0].metrics.step_arrays()["step_time"]
    jittered = run_fleet(cfg, FleetSpec(step_jitter=0.2, seed=5)).replicas[0]
    times = jittered.metrics.step_arrays()["step_time"]
    draws = random.Random(5)
    expected = [t * draws.lognormvariate(-0.02, 0.2) for t in plain]
    assert len(plain) > 20
    np.testing.assert_allclose(times, expected, rtol=1e-12)
    assert not np.allclose(times, plain)


def test_step_jitter_seeds_spread_a_round_robin_fleets_hit_rate():
    """Under round robin in a closed loop, which replica a session's next
    turn reaches depends on which step ended first: seeds of a jittered
    fleet give different hit rates (as real runs do), an unjittered fleet
    one, whatever its seed."""
    cfg = config(check_every=None, arrival="closed", concurrency=6, num_requests=96,
                 mix={"multiturn": 1})

    def hit_rate(fleet: FleetSpec) -> float:
        return run_fleet(cfg, fleet).summary["prefix_cache"]["first_admission_hit_rate"]

    plain = {hit_rate(FleetSpec(3, seed=seed)) for seed in range(3)}
    jittered = {hit_rate(FleetSpec(3, step_jitter=0.1, seed=seed)) for seed in range(5)}
    assert len(plain) == 1
    assert len(jittered) >= 3


@pytest.mark.parametrize("jitter", [-0.1, math.nan, math.inf, 1.5, True, "0.1"])
def test_a_bad_step_jitter_is_refused(jitter):
    with pytest.raises(ValueError, match="step_jitter"):
        FleetSpec(step_jitter=jitter)


@pytest.mark.parametrize("seed", [1.5, True, "7", None])
def test_a_seed_that_is_not_an_int_is_refused(seed):
    with pytest.raises(WrongArgumentType, match=re.escape(f"seed must be an int, got {seed!r}")):
        FleetSpec(step_jitter=0.1, seed=seed)


def test_a_numpy_seed_is_stored_as_the_int_it_names():
    spec = FleetSpec(step_jitter=0.1, seed=np.int64(7))  # type: ignore[arg-type]
    assert type(spec.seed) is int and spec == FleetSpec(step_jitter=0.1, seed=7)


def test_a_jittered_fleet_round_trips_through_its_dict():
    fleet = FleetSpec(3, "cache_aware", 2.0, 0.5, 0.1, 9)
    assert fleet.to_dict()["step_jitter"] == 0.1 and fleet.to_dict()["seed"] == 9
    assert FleetSpec.from_dict(fleet.to_dict()) == fleet
    assert "step_jitter" not in FleetSpec(3).to_dict()


@pytest.mark.parametrize("argv, words", [
    (["--fleet-seed", "3"], "--fleet-seed needs --step-jitter"),
    (["--replicas", "0"], "--replicas"),
    (["--router", "random"], "unknown router 'random'"),
    (["--sweep", "router=nope"], "unknown router 'nope'"),
    (["--sweep", "replicas=0"], "replicas must be"),
])
def test_bad_fleet_options_are_one_line_errors(tmp_path, capsys, argv, words):
    code = main(["simulate", "-n", "10", "--out", str(tmp_path), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------- the approximate tree

PAGE = 2
tokens = st.lists(st.integers(0, 2), max_size=12)


def aligned_lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // PAGE * PAGE


class TreeAgainstScan(RuleBasedStateMachine):
    """Every prompt sent is remembered (no eviction): the tree's longest
    match and its replicas are a naive scan's over every prompt sent."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = ApproxPrefixTree(PAGE)
        self.sent: list[tuple[object, list[int], int, float]] = []  # ns, tokens, replica, time
        self.now = 0.0

    @rule(seq=tokens, replica=st.integers(0, 3), namespace=st.sampled_from([None, "a"]))
    def insert(self, seq, replica, namespace):
        self.now += 1.0
        self.tree.insert(seq, replica, self.now, namespace)
        self.sent.append((namespace, seq, replica, self.now))

    @rule(query=tokens, namespace=st.sampled_from([None, "a"]))
    def match(self, query, namespace):
        found = self.tree.match(query, namespace)
        best = max([aligned_lcp(query, s) for ns, s, _, _ in self.sent if ns == namespace],
                   default=0)
        assert found.num_tokens == best
        if best == 0:
            assert found.replicas == ()
            return
        holders = {r for ns, s, r, _ in self.sent
                   if ns == namespace and aligned_lcp(query, s) >= best}
        assert found.replicas == tuple(sorted(holders))

    @rule(query=tokens, replica=st.integers(0, 3), namespace=st.sampled_from([None, "a"]))
    def prefix_length(self, query, replica, namespace):
        best = max([aligned_lcp(query, s) for ns, s, r, _ in self.sent
                    if ns == namespace and r == replica], default=0)
        assert self.tree.prefix_length(query, replica, namespace) == best

    @invariant()
    def page_counts(self):
        for replica in range(4):
            prefixes = {(ns, tuple(s[:k])) for ns, s, r, _ in self.sent if r == replica
                        for k in range(PAGE, len(s) + 1, PAGE)}
            assert self.tree.num_pages(replica) == len(prefixes)


TestTreeAgainstScan = TreeAgainstScan.TestCase
TestTreeAgainstScan.settings = settings(max_examples=150, stateful_step_count=30,
                                        deadline=None)


@settings(max_examples=200, deadline=None)
@given(sent=st.lists(st.tuples(tokens, st.integers(0, 2)), max_size=25),
       queries=st.lists(tokens, max_size=5), max_pages=st.integers(0, 6))
def test_eviction_keeps_the_most_recent_pages_within_the_budget(sent, queries, max_pages):
    tree = ApproxPrefixTree(PAGE)
    for t, (seq, replica) in enumerate(sent):
        tree.insert(seq, replica, float(t))
    tree.evict(max_pages)
    for replica in range(3):
        assert tree.num_pages(replica) <= max_pages
        own = [seq for seq, r in sent if r == replica]
        for query in queries + own:
            naive = max([aligned_lcp(query, s) for s in own], default=0)
            assert tree.prefix_length(query, replica) <= naive
        if own and len(own[-1]) // PAGE <= max_pages:  # the last prompt sent is kept whole
            assert tree.prefix_length(own[-1], replica) == len(own[-1]) // PAGE * PAGE
    for query in queries:
        found = tree.match(query)
        for replica in found.replicas:  # replicas that were sent that prefix
            assert tree.prefix_length(query, replica) == found.num_tokens


def test_the_tree_refuses_a_bad_page_size():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="page_size"):
            ApproxPrefixTree(bad)


def test_replicas_on_shared_cores_take_longer_than_on_a_machine_each(tmp_path, capsys):
    """`--cores` puts the replicas on one machine: the same requests, routed
    the same way, finish later when three replicas share two cores (and
    later still beside background work) than with a machine each."""
    def run(*extra: str) -> dict:
        out = tmp_path / "-".join(extra or ("own",))
        code = main(["simulate", "--workload", "chat", "-n", "60", "--rate", "20",
                     "--replicas", "3", "--out", str(out), "--no-progress", "--no-plots",
                     *extra])
        assert code == 0, capsys.readouterr().err
        return json.loads((out / "report.json").read_text())

    own, shared, busy = run(), run("--cores", "2"), run("--cores", "2", "--background", "1")
    assert shared["fleet"] == {"replicas": 3, "router": "round_robin", "cores": 2.0}
    assert shared["summary"]["machine"]["cores"] == 2.0 and "machine" not in own["summary"]
    routed = [r["summary"]["routing"]["requests"] for r in (own, shared, busy)]
    assert routed[0] == routed[1] == routed[2]
    tpot = [r["summary"]["latency"]["tpot_s"]["mean"] for r in (own, shared, busy)]
    assert tpot[0] < tpot[1] < tpot[2]
    assert main(["simulate", "-n", "5", "--background", "1", "--no-progress",
                 "--no-plots", "--out", str(tmp_path / "bad")]) != 0
