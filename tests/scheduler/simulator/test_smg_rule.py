"""The simulator's `cache_aware` router follows SMG's decision rule
(design/fleet.md, "The simulator's cache_aware"), on small cases worked
out by hand: the matched share against `--cache-threshold` (0.3, strictly
above), the least loaded of the replicas holding the match, the spill gate
(load above 1.5x the mean and above the mean plus min(64, max(4, 2
sqrt(mean)))) to the least loaded replica (fewest in flight, then fewest
sent, then the first), and on a miss the least expected wait: (waiting at
the last poll + misses sent since) x 1024 / 2000 + 0.15 k / (1 - k), k the
polled token usage, polls 10 s apart."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.simulator.routers import RouteRequest, RouterSettings, make_router

PAGE = 3
#: P1: two pages, sent first (to replica 0, the fleet being idle).
P1 = [1, 2, 3, 4, 5, 6]
#: 3 of 10 tokens match P1 (one page): a share of exactly 0.3, not above it.
AT_THRESHOLD = [1, 2, 3, 70, 71, 72, 73, 74, 75, 76]
#: 6 of 10 match P1 (two pages): 0.6.
ABOVE = [1, 2, 3, 4, 5, 6, 80, 81, 82, 83]
#: 3 of 6 match (P1's first page): 0.5.
FIRST_PAGE = [1, 2, 3, 90, 91, 92]


@dataclass
class View:
    """A replica as the router reads it: SMG's in-flight count (`load`) and
    its processed count (`num_routed`)."""

    index: int
    load: int = 0
    num_routed: int = 0
    store: object = None
    num_waiting: int = 0
    token_usage: float = 0.0


def fleet(loads, routed=(0, 0, 0), waiting=(0, 0, 0), usage=(0.0, 0.0, 0.0)) -> list[View]:
    return [View(i, load, sent, None, queued, used)
            for i, (load, sent, queued, used) in enumerate(zip(loads, routed, waiting, usage))]


#: The load reports of the poll at time 0: token usage 0, 0.5, 0.2, so
#: expected waits 0, 0.15 x 0.5 / 0.5 = 0.15, 0.15 x 0.2 / 0.8 = 0.0375 s.
USAGE_AT_0 = (0.0, 0.5, 0.2)


def router_with_p1(seed: int = 0):
    """P1 sent at time 0 (a miss: the least expected wait, replica 0)."""
    router = make_router("cache_aware", RouterSettings(3, pool_pages=1000, page_size=PAGE,
                                                       seed=seed))
    first = fleet((0, 0, 0), usage=USAGE_AT_0)
    assert router.route(RouteRequest("p1", P1, None, 0.0), first) == 0
    return router


def route(router, tokens, loads, routed=(0, 0, 0), now=1.0, **reports) -> int:
    return router.route(RouteRequest("q", tokens, None, now), fleet(loads, routed, **reports))


def test_the_settings_are_smg_113_defaults():
    s = RouterSettings(3, pool_pages=10)
    assert (s.cache_threshold, s.balance_abs_threshold, s.balance_rel_threshold,
            s.eviction_interval) == (0.3, 64, 1.5, 60.0)


@pytest.mark.parametrize("tokens, loads, routed, expected", [
    # share 0.3 is not above 0.3: a miss, the least expected wait since the
    # poll at 0: replica 0 0.0 + 1024 / 2000 (P1) = 0.512, 1 0.15, 2 0.0375:
    # replica 2, though it has the most in flight.
    (AT_THRESHOLD, (0, 0, 5), (1, 0, 0), 2),
    # share 0.6: P1's holder, replica 0, though it is the busiest (mean
    # 4/3; 2 is not above 1.5 x 4/3 = 2).
    (ABOVE, (2, 1, 1), (0, 0, 0), 0),
    # mean 2: 6 > 1.5 x 2 = 3 but not > 2 + max(4, 2 sqrt 2 = 2.83) = 6: stays.
    (ABOVE, (6, 0, 0), (0, 0, 0), 0),
    # mean 7/3: 7 > 3.5 and 7 > 7/3 + 4 = 6.33: spills to the least loaded,
    # replicas 1 and 2 tie at 0 in flight; 2 was sent fewer (2 < 3).
    (ABOVE, (7, 0, 0), (1, 3, 2), 2),
    # mean 26: 38 is not > 1.5 x 26 = 39: stays, however far the spread.
    (ABOVE, (38, 20, 20), (0, 0, 0), 0),
    # mean 26: 40 > 39 and 40 > 26 + 2 sqrt 26 = 36.2 (under 64): spills
    # to replica 2 (18 in flight).
    (ABOVE, (40, 20, 18), (0, 0, 0), 2),
])
def test_one_decision_worked_by_hand(tokens, loads, routed, expected):
    assert route(router_with_p1(), tokens, loads, routed) == expected


def test_misses_follow_the_expected_wait_and_the_polls():
    """Misses between polls count what was sent since the poll; a poll
    (10 s on) reads the reports anew and forgets them."""
    router = router_with_p1()
    # 0.512 / 0.15 / 0.0375 -> 2; then 0.512 / 0.15 / 0.5495 -> 1.
    assert route(router, AT_THRESHOLD, (0, 0, 0)) == 2
    assert route(router, [50] * 10, (0, 0, 0)) == 1
    # 10 s after the poll at 0 another: waiting 1, 0, 0 and no usage:
    # 0.512 / 0 / 0 -> 1 or 2 at random, never 0.
    chosen = set()
    for seed in range(40):
        router = router_with_p1(seed)
        chosen.add(route(router, [60] * 10, (0, 0, 0), now=10.0, waiting=(1, 0, 0)))
    assert chosen == {1, 2}


def test_the_least_loaded_holder_wins_and_ties_are_random():
    """P1 on replica 0, then AT_THRESHOLD (a miss) on replica 2: P1's first
    page is held by 0 and 2. FIRST_PAGE matches that page (0.5): of the
    holders the less loaded, though replica 1 is idle; at equal loads either
    holder, at random, never replica 1."""
    def primed(seed: int):
        router = router_with_p1(seed)
        assert route(router, AT_THRESHOLD, (0, 0, 0)) == 2
        return router

    assert route(primed(0), FIRST_PAGE, (2, 0, 1)) == 2
    assert route(primed(0), FIRST_PAGE, (1, 0, 2)) == 0
    chosen = {route(primed(seed), FIRST_PAGE, (1, 0, 1)) for seed in range(40)}
    assert chosen == {0, 2}


def test_a_spilled_request_makes_its_target_a_holder():
    """After a spill to replica 2, replica 2 holds ABOVE's three pages (9
    of 10 tokens), replica 0 only P1's two: the deepest match is replica 2's
    alone, so the next copy goes there although it is the busiest (mean 1:
    2 is not above 1.5) and replica 0 holds most of it."""
    router = router_with_p1()
    assert route(router, ABOVE, (7, 0, 0), (1, 3, 2)) == 2
    assert route(router, ABOVE, (0, 1, 2)) == 2


def test_bad_balance_thresholds_are_refused():
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        RouterSettings(3, pool_pages=10, balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        RouterSettings(3, pool_pages=10, balance_abs_threshold=-1)
