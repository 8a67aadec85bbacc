"""Routers of a simulated fleet: which replica serves a request.

A router sees a request (its prompt's token ids, its namespace, the
simulated time) and the replicas (`ReplicaView`: the requests each holds,
the requests it was sent, and its store), and names one replica. A policy
is a class in `ROUTERS`, built with the fleet's size and the replicas'
pool (`RouterSettings`):

round_robin  each replica in turn.
least_load   the replica holding the fewest requests (ties: the one sent the
             fewest, then the lowest index): SMG's shortest queue.
cache_aware  SMG's approximate cache-aware policy (`cache_aware.rs`'s tree
             path, see design/fleet.md for the version): an
             `ApproxPrefixTree` of the prompts it sent where. A prompt whose
             remembered share is above `cache_threshold` goes to the least
             loaded of the replicas holding that prefix (ties: at random),
             unless the spill gate passes it over (then the least loaded
             replica); below it, to the replica of least expected wait
             (below). Blind to what a replica evicted or never computed.
precise      SMG's event-driven policy over the exact view: each replica
             store's own `cached_prefix_length` (what its next allocation
             would reuse: only servable, computed tokens), the longest wins
             (ties: the less loaded, then at random), unless the spill gate
             passes it over; no replica holding any of it: the least loaded.

The spill gate (SMG's `gate_selected_candidate`): the chosen replica is
passed over for the least loaded one when its load exceeds both
`balance_rel_threshold` times the fleet's mean load and the mean plus a
margin: `balance_abs_threshold`, capped at twice the square root of the
mean (the in-flight count's natural swing) but never under 4 (unless the
threshold is). Load is what SMG counts itself: requests it sent a replica
that have not finished.

The expected wait (SMG 1.13's `expected_wait_fallback` branch, its
`least_load` score): from the load report SMG polls every
`load_monitor_interval` seconds (waiting requests, the share of the pool
live sequences hold, `k`) and the requests it sent a replica that way since
that poll, each counted as `mean_prefill_tokens` (an HTTP request's tokens
are unknown to it): (waiting + sent since the poll) x mean_prefill_tokens /
default_throughput + kv_pressure_weight x k / (1 - k), the least wins, ties
at random. So right after a poll the idle replicas tie and a new
conversation lands at random; between polls the misses go round the
replicas it has not just sent one to.

Random ties draw from the router's own generator, seeded by
`RouterSettings.seed`: a run is reproducible, another seed is another of
SMG's runs.

Costs per request: round_robin O(1), least_load O(replicas), cache_aware
O(pages of the prompt + replicas), precise O(replicas x matched prompt).
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from blockmgr.errors import InvalidArgument
from blockmgr.kv_store import KVStore
from blockmgr.validation import check_int, check_number
from scheduler.simulator.approx_tree import ApproxPrefixTree


class ReplicaView(Protocol):
    """What a router reads of one replica."""

    @property
    def index(self) -> int: ...

    @property
    def load(self) -> int:
        """Requests sent to the replica and not finished (SMG's load)."""
        ...

    @property
    def num_routed(self) -> int:
        """Requests sent to the replica so far."""
        ...

    @property
    def store(self) -> KVStore: ...

    @property
    def num_waiting(self) -> int:
        """Requests queued, not running (a load report's `num_waiting_reqs`)."""
        ...

    @property
    def token_usage(self) -> float:
        """The share of the pool live sequences hold (a load report's
        `token_usage`, 0 to 1)."""
        ...


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request as a router sees it. `tokens` is empty for a router whose
    `needs_tokens` is False."""

    request_id: Hashable
    tokens: Sequence[int]
    namespace: Hashable
    now: float


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """How a fleet's routers are tuned. The thresholds and the eviction
    interval are SMG 1.13's defaults (`--cache-threshold 0.3`,
    `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`,
    `--eviction-interval-secs 60`), and so are the expected wait's
    (`--load-monitor-interval 10`, `--least-load-mean-prefill-tokens 1024`,
    `--least-load-default-throughput 2000`, `--least-load-kv-pressure-weight
    0.15`; the replicas report no throughput). `max_tree_pages`: pages a replica keeps
    in the approximate tree (None: the replica's pool, as many as it can
    cache; SMG bounds the whole tree at 2**26 characters or tokens, which
    these runs never reach). `seed`: the random tie breaks'."""

    num_replicas: int
    pool_pages: int
    page_size: int = 16
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval: float = 60.0
    max_tree_pages: int | None = None
    seed: int = 0
    load_monitor_interval: float = 10.0
    mean_prefill_tokens: int = 1024
    default_throughput: float = 2000.0
    kv_pressure_weight: float = 0.15

    def __post_init__(self) -> None:
        check_int("num_replicas", self.num_replicas, 1, strict=True)
        check_int("pool_pages", self.pool_pages, 1, strict=True)
        check_int("page_size", self.page_size, 1, strict=True)
        if check_number("cache_threshold", self.cache_threshold, 0.0) > 1:
            raise InvalidArgument(f"cache_threshold must be <= 1, got {self.cache_threshold!r}")
        check_number("balance_abs_threshold", self.balance_abs_threshold, 0.0)
        check_number("balance_rel_threshold", self.balance_rel_threshold, 1.0)


class Router(Protocol):
    """A routing policy. `route` names the replica for `request` (an index
    into `replicas`); it may remember what it routed."""

    name: ClassVar[str]
    needs_tokens: ClassVar[bool]

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int: ...


def least_loaded(replicas: Sequence[ReplicaView]) -> int:
    """The replica with the fewest requests held, then the fewest sent,
    then the lowest index (SMG's min-load key). O(replicas)."""
    return min(replicas, key=lambda r: (r.load, r.num_routed, r.index)).index


def spill_margin(mean_load: float, settings: RouterSettings) -> float:
    """How far above the mean load a chosen replica may be before the spill
    gate passes it over (with the relative threshold): the absolute
    threshold capped at the in-flight count's natural swing at that mean,
    two standard deviations of a Poisson count, never under 4 unless the
    threshold is (SMG 1.13's `--balance-abs-threshold`). O(1)."""
    swing = max(2.0 * math.sqrt(mean_load), 4.0)
    return min(float(settings.balance_abs_threshold), swing)


def spilled(chosen: int, replicas: Sequence[ReplicaView], settings: RouterSettings) -> int:
    """`chosen`, or the least loaded replica when the spill gate passes
    `chosen` over: its load above `balance_rel_threshold` times the mean
    load and above the mean plus `spill_margin` (SMG's
    `gate_selected_candidate`). O(replicas)."""
    mean = sum(r.load for r in replicas) / len(replicas)
    load = replicas[chosen].load
    if load > mean * settings.balance_rel_threshold and load > mean + spill_margin(mean, settings):
        return least_loaded(replicas)
    return chosen


def least_loaded_of(candidates: Sequence[int], replicas: Sequence[ReplicaView],
                    rng: random.Random) -> int:
    """Of `candidates` (replica indices), the least loaded; ties uniformly
    at random (SMG's `argmax_with_random_ties` at equal scores).
    O(candidates)."""
    low = min(replicas[i].load for i in candidates)
    return one_of([i for i in candidates if replicas[i].load == low], rng)


def one_of(tied: Sequence[int], rng: random.Random) -> int:
    """The one of `tied` (equal scores), drawn uniformly at random when
    there are several (SMG's `argmax_with_random_ties`); no draw for one,
    so the generator moves only on a real tie. O(1)."""
    return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]


class ExpectedWait:
    """SMG 1.13's expected-wait choice (the module docstring): a poll of the
    replicas' load reports every `load_monitor_interval` seconds, and the
    requests chosen since. O(replicas) per choice; a poll O(pages held)."""

    def __init__(self, settings: RouterSettings, rng: random.Random) -> None:
        self.settings = settings
        self._rng = rng
        self._polled_at: float | None = None
        self._reports: list[tuple[int, float]] = []  # (waiting, token usage) per replica
        self._sent: list[int] = []  # chosen since the poll, per replica

    def choose(self, now: float, replicas: Sequence[ReplicaView]) -> int:
        settings = self.settings
        if self._polled_at is None or now - self._polled_at >= settings.load_monitor_interval:
            self._reports = [(r.num_waiting, r.token_usage) for r in replicas]
            self._sent = [0] * len(replicas)
            self._polled_at = now
        scores = []
        for (waiting, usage), sent in zip(self._reports, self._sent):
            k = min(max(usage, 0.0), 0.999)
            work = (waiting + sent) * settings.mean_prefill_tokens
            scores.append(work / settings.default_throughput
                          + settings.kv_pressure_weight * k / (1.0 - k))
        low = min(scores)
        index = one_of([i for i, score in enumerate(scores) if score == low], self._rng)
        self._sent[index] += 1
        return index


class RoundRobin:
    """Replica 0, 1, ..., N-1, 0, ..."""

    name: ClassVar[str] = "round_robin"
    needs_tokens: ClassVar[bool] = False

    def __init__(self, settings: RouterSettings) -> None:
        self._next = 0
        self._num = settings.num_replicas

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        index = self._next
        self._next = (index + 1) % self._num
        return index


class LeastLoad:
    """The least loaded replica (`least_loaded`)."""

    name: ClassVar[str] = "least_load"
    needs_tokens: ClassVar[bool] = False

    def __init__(self, settings: RouterSettings) -> None:
        pass

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return least_loaded(replicas)


class CacheAware:
    """SMG's approximate cache-aware policy (see the module docstring)."""

    name: ClassVar[str] = "cache_aware"
    needs_tokens: ClassVar[bool] = True

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.tree = ApproxPrefixTree(settings.page_size)
        pages = settings.max_tree_pages
        self._max_pages = settings.pool_pages if pages is None else pages
        self._last_eviction = 0.0
        self._rng = random.Random(settings.seed)
        self._expected_wait = ExpectedWait(settings, self._rng)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        settings, tree = self.settings, self.tree
        if request.now - self._last_eviction >= settings.eviction_interval:
            tree.evict(self._max_pages)
            self._last_eviction = request.now
        match = tree.match(request.tokens, request.namespace)
        rate = match.num_tokens / len(request.tokens) if request.tokens else 0.0
        if match.replicas and rate > settings.cache_threshold:
            index = spilled(least_loaded_of(match.replicas, replicas, self._rng),
                            replicas, settings)
        else:
            index = self._expected_wait.choose(request.now, replicas)
        tree.insert(request.tokens, index, request.now, request.namespace)
        return index


class Precise:
    """Routing by each replica store's own servable prefix (see the module
    docstring)."""

    name: ClassVar[str] = "precise"
    needs_tokens: ClassVar[bool] = True

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self._rng = random.Random(settings.seed)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        cached = [r.store.cached_prefix_length(request.tokens, request.namespace)
                  for r in replicas]
        best = max(cached)
        if best == 0:
            return least_loaded(replicas)
        holders = [i for i, n in enumerate(cached) if n == best]
        return spilled(least_loaded_of(holders, replicas, self._rng), replicas, self.settings)


#: Policy name -> its class.
ROUTERS: dict[str, type] = {cls.name: cls for cls in (RoundRobin, LeastLoad, CacheAware, Precise)}


def check_router(name: object) -> str:
    """`name` if it names a router policy of `ROUTERS`; `InvalidArgument`
    naming them otherwise."""
    if not isinstance(name, str) or name not in ROUTERS:
        raise InvalidArgument(f"unknown router {name!r} (one of {', '.join(ROUTERS)})")
    return name


def make_router(name: str, settings: RouterSettings) -> Router:
    """The router of policy `name`. Raises `InvalidArgument` for an unknown one."""
    router: Router = ROUTERS[check_router(name)](settings)
    return router
