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
