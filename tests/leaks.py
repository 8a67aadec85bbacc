"""Checks that a store holds nothing but its prefix cache."""

from __future__ import annotations


def assert_only_the_cache_holds(store) -> None:
    """No live sequence; in every layer group every page not free is held by
    the prefix trie, and every slot not free is a trie snapshot."""
    assert store.num_sequences == 0
    for usage in store.group_usage():
        assert usage.num_free_pages + usage.num_cached_pages == usage.num_pages, usage
    assert store.num_free_slots + store.stats.num_trie_slots == store.config.num_slots
