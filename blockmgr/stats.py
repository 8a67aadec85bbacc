"""Counters of the prefix cache, for metrics and routers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """A snapshot of the prefix-cache counters (`BlockManager.stats`).

    num_queries / num_hits: allocations, and those that reused >= 1 token.
    num_query_tokens / num_hit_tokens: prompt tokens asked for, and reused.
    num_evicted_pages: pages freed by eviction; num_evicted_nodes: nodes removed.
    num_trie_nodes: nodes now in the trie; num_trie_pages: distinct pages it holds.
    num_trie_slots: recurrent snapshots it holds.
    """

    num_queries: int = 0
    num_hits: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_pages: int = 0
    num_evicted_nodes: int = 0
    num_trie_nodes: int = 0
    num_trie_pages: int = 0
    num_trie_slots: int = 0

    @property
    def hit_rate(self) -> float:
        """Token-weighted hit rate: reused tokens over asked tokens."""
        if self.num_query_tokens == 0:
            return 0.0
        return self.num_hit_tokens / self.num_query_tokens


@dataclass(frozen=True, slots=True)
class PageGroupUsage:
    """One page group's pages right now (`BlockManager.group_usage()`).

    group: the number its page ops carry; window: its sliding window (None:
    full attention); num_pages / num_free_pages: the device pool and its
    free pages; num_cached_pages: distinct pages the prefix trie holds (some
    shared with sequences); num_evicted_pages: pages evictions freed so far;
    num_host_pages / num_free_host_pages: the host pool (swap space).
    """

    group: int
    window: int | None
    num_pages: int
    num_free_pages: int
    num_cached_pages: int
    num_evicted_pages: int
    num_host_pages: int
    num_free_host_pages: int

    @property
    def usage(self) -> float:
        """Fraction of the device pages in use by sequences or the trie."""
        return 1.0 - self.num_free_pages / self.num_pages if self.num_pages else 0.0
