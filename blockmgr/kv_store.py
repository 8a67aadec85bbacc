"""`KVStore`: the one contract of the KV bookkeeping a scheduler drives.

`BlockManager` (one layer group), `GroupedStore` (a model whose layers form
several groups) and `cache.PagedCache` (storage that applies the plans it
returns itself) all satisfy it, with the same names, argument meanings and
return types (`tests/cache/test_kv_store_conformance.py` runs one scripted
scenario against all three; the type checker checks the signatures). It
declares every call the scheduler, the engine, the speculator, the
simulator and the KV-event publisher make of their store.

Every call that implies storage work returns its memory-op plan; a
scheduler collects them, in call order, into its step output. Every call
either succeeds whole or raises a `blockmgr.errors` error and changes
nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Protocol

from blockmgr.ops import Plan
from blockmgr.sequence import Allocation, Progress
from blockmgr.stats import PageGroupUsage, PrefixCacheStats


class KVStore(Protocol):
    """The calls of a store, with their meaning in `BlockManager`."""

    # ----------------------------------------------------------- the store

    @property
    def block_size(self) -> int: ...

    @property
    def is_hybrid(self) -> bool:
        """Sequences carry recurrent state: hits end at snapshots."""
        ...

    @property
    def enable_prefix_cache(self) -> bool: ...

    @property
    def num_slots(self) -> int:
        """Recurrent-state slots (0 for attention-only models)."""
        ...

    @property
    def num_groups(self) -> int:
        """Page groups (a model's layer groups: one per attention window)."""
        ...

    @property
    def num_usable_blocks(self) -> int:
        """Pages one sequence may hold in an empty store: the pool past its
        watermark (the smallest group's)."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of pages in use (the fullest group's)."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Free pages of the group with the fewest."""
        ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int:
        """Pages held by the prefix cache, over every group (0: nothing to drop)."""
        ...

    @property
    def stats(self) -> PrefixCacheStats: ...

    def group_usage(self) -> tuple[PageGroupUsage, ...]:
        """Each page group's pool, free, cached and evicted pages."""
        ...

    # ----------------------------------------------------------- sequences

    @property
    def num_sequences(self) -> int: ...

    def sequence_ids(self) -> list[Hashable]: ...

    def __contains__(self, seq_id: Hashable) -> bool: ...

    def num_tokens(self, seq_id: Hashable) -> int: ...

    def progress(self, seq_id: Hashable) -> Progress:
        """The sequence's computed count, the record itself: the one count
        its store, cache and scheduler read (and set, to the absolute count,
        when they learn tokens were computed)."""
        ...

    def num_computed(self, seq_id: Hashable) -> int: ...

    def tokens(self, seq_id: Hashable) -> list[int]: ...

    def block_table(self, seq_id: Hashable, group: int | None = None) -> list[int | None]:
        """A copy of the sequence's page table in page group `group` (None:
        group 0); None entries are pages a sliding window released."""
        ...

    def slot(self, seq_id: Hashable) -> int | None: ...

    def is_swapped(self, seq_id: Hashable) -> bool: ...

    def speculation_start(self, seq_id: Hashable) -> int | None:
        """The token count at `begin_speculation` (None: no transaction open)."""
        ...

    # ------------------------------------------------------- the prefix cache

    def cached_prefix_length(self, tokens: Iterable[int], namespace: Hashable = None) -> int:
        """How many tokens `allocate` would reuse right now. Pure."""
        ...

    def cached_paths(self) -> list[tuple[Hashable, list[int]]]:
        """`(namespace, tokens)` of every maximal cached prefix. Pure."""
        ...

    @property
    def cache_version(self) -> int:
        """Grows whenever a hit may have changed."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def take_listener_errors(self) -> list[tuple[str, BaseException]]:
        """What prefix-cache listeners raised since the last call."""
        ...

    # ------------------------------------------------------------- the calls

    def can_allocate(self, tokens: Iterable[int], namespace: Hashable = None) -> bool: ...

    def allocate(
        self, seq_id: Hashable, tokens: Iterable[int], namespace: Hashable = None, *,
        retention: int = 0,
    ) -> Allocation: ...

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool: ...

    def append(self, seq_id: Hashable, new_tokens: Iterable[int]) -> Plan: ...

    def can_append_decode(self, seq_ids: list[Hashable] | tuple[Hashable, ...]) -> bool: ...

    def append_decode(
        self, seq_ids: list[Hashable] | tuple[Hashable, ...], tokens: Iterable[int]
    ) -> Plan:
        """One token for each of `seq_ids` (a decode step), whole or not at all."""
        ...

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> Plan: ...

    def can_truncate(self, seq_id: Hashable, num_tokens: int) -> bool: ...

    def truncate(self, seq_id: Hashable, num_tokens: int) -> Plan: ...

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> Plan: ...

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan: ...

    def can_swap_out(self, seq_id: Hashable) -> bool: ...

    def swap_out(self, seq_id: Hashable) -> Plan: ...

    def can_swap_in(self, seq_id: Hashable) -> bool: ...

    def swap_in(self, seq_id: Hashable) -> Plan: ...

    # ---------------------------------------------------------- speculation

    def can_speculate(self, drafts: Mapping[Hashable, Iterable[int]]) -> bool: ...

    def begin_speculation(self, drafts: Mapping[Hashable, Iterable[int]]) -> Plan: ...

    def commit_speculation(self, accepted: Mapping[Hashable, int]) -> frozenset[Hashable]:
        """The ids whose recurrent checkpoint came back (computed again from it)."""
        ...

    def abort_speculation(self, seq_ids: Iterable[Hashable]) -> frozenset[Hashable]: ...

    def shorten_speculation(self, kept: Mapping[Hashable, int]) -> None: ...

    # ------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if an invariant is broken."""
        ...

    def check_no_leaks(self) -> None:
        """At the end of a run: raise `MemoryLeak` if anything but the prefix
        cache holds memory; drops the prefix cache."""
        ...

    def debug_state(self) -> tuple[object, ...]:
        """Everything observable, as plain values: equal before and after a
        refused call."""
        ...
