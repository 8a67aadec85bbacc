"""Routers of a simulated fleet: which replica serves a request.

A router sees a request (its prompt's token ids, its namespace, the
simulated time) and the replicas (`ReplicaView`: the requests each holds,
the requests it was sent, and its store), and names one replica. A policy
is a class in `ROUTERS`, built with the fleet's size and the replicas'
pool (`RouterSettings`):

round_robin  each replica in turn.
least_load   the replica holding the fewest requests (ties: the one sent the
             fewest, then the lowest index): SMG's shortest queue.
cache_aware  SMG's approximate cache-aware policy: an `ApproxPrefixTree` of
             the prompts it sent where; when the fleet is balanced, the
             replica with the longest remembered prefix if it covers more
             than `cache_threshold` of the prompt, else the least loaded;
             when imbalanced (`balance_abs_threshold`, `balance_rel_threshold`
             on the requests held), the least loaded. Blind to what a
             replica evicted or never computed.
precise      SMG's event-driven policy over the exact view: each replica
             store's own `cached_prefix_length` (what its next allocation
             would reuse: only servable, computed tokens), the longest wins
             (ties: the less loaded); no replica holding any of it, or an
             imbalanced fleet: the least loaded.

Costs per request: round_robin O(1), least_load O(replicas), cache_aware
O(pages of the prompt + replicas), precise O(replicas x matched prompt).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from blockmgr.kv_store import KVStore
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
    """How a fleet's routers are tuned. The thresholds are SMG's defaults
    (`CacheAwareConfig`). `max_tree_pages`: pages a replica keeps in the
    approximate tree (None: the replica's pool, as many as it can cache;
    SMG's default of 10,000 entries is a size for text, not tokens)."""

    num_replicas: int
    pool_pages: int
    page_size: int = 16
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1
    eviction_interval: float = 30.0
    max_tree_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_replicas", "pool_pages", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold!r}")


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


def is_imbalanced(replicas: Sequence[ReplicaView], settings: RouterSettings) -> bool:
    """SMG's test: the most and least loaded differ by more than the
    absolute threshold and by more than the relative one. O(replicas)."""
    loads = [r.load for r in replicas]
    low, high = min(loads), max(loads)
    return (high - low > settings.balance_abs_threshold
            and high > low * settings.balance_rel_threshold)


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

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        settings, tree = self.settings, self.tree
        if request.now - self._last_eviction >= settings.eviction_interval:
            tree.evict(self._max_pages)
            self._last_eviction = request.now
        if is_imbalanced(replicas, settings):
            index = least_loaded(replicas)
        else:
            match = tree.match(request.tokens, request.namespace)
            rate = match.num_tokens / len(request.tokens) if request.tokens else 0.0
            if match.replica is not None and rate > settings.cache_threshold:
                index = match.replica
            else:
                index = least_loaded(replicas)
        tree.insert(request.tokens, index, request.now, request.namespace)
        return index


class Precise:
    """Routing by each replica store's own servable prefix (see the module
    docstring)."""

    name: ClassVar[str] = "precise"
    needs_tokens: ClassVar[bool] = True

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        if is_imbalanced(replicas, self.settings):
            return least_loaded(replicas)
        best, best_key = None, None
        for replica in replicas:
            cached = replica.store.cached_prefix_length(request.tokens, request.namespace)
            if cached == 0:
                continue
            key = (cached, -replica.load, -replica.index)
            if best_key is None or key > best_key:
                best, best_key = replica.index, key
        return least_loaded(replicas) if best is None else best


#: Policy name -> its class.
ROUTERS: dict[str, type] = {cls.name: cls for cls in (RoundRobin, LeastLoad, CacheAware, Precise)}


def make_router(name: str, settings: RouterSettings) -> Router:
    """The router of policy `name`. Raises ValueError for an unknown one."""
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r} (one of {', '.join(ROUTERS)})") from None
    router: Router = cls(settings)
    return router
