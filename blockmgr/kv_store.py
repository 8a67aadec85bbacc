"""`KVStore`: what a scheduler needs of the KV bookkeeping it drives.

Both `BlockManager` (one layer group) and `GroupedStore` (a model whose
layers form several groups) satisfy it, and so does `cache.PagedCache`
(storage that applies the plans it returns itself). Every call that implies
storage work returns its memory-op plan; a scheduler collects them, in call
order, into its step output. Every call either succeeds whole or raises a
`blockmgr.errors` error and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from blockmgr.ops import MemoryOp
from blockmgr.sequence import Allocation

Plan = Sequence[MemoryOp]


class KVStore(Protocol):
    """The calls `scheduler.Scheduler` makes, with their meaning in `BlockManager`."""

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
    def num_usable_blocks(self) -> int:
        """Pages one sequence may hold in an empty store: the pool past its
        watermark (the smallest group's)."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of pages in use (the fullest group's)."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int:
        """Pages held by the prefix cache (0: nothing to drop)."""
        ...

    def can_allocate(self, tokens: Sequence[int], namespace: Hashable = None) -> bool: ...

    def allocate(
        self, seq_id: Hashable, tokens: Sequence[int], namespace: Hashable = None
    ) -> Allocation: ...

    def append(self, seq_id: Hashable, new_tokens: Sequence[int]) -> Plan: ...

    def append_decode(self, seq_ids: Sequence[Hashable], tokens: Sequence[int]) -> Plan:
        """One token for each of `seq_ids` (a decode step), whole or not at all."""
        ...

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> Plan: ...

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> Plan: ...

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan: ...

    def can_swap_out(self, seq_id: Hashable) -> bool: ...

    def swap_out(self, seq_id: Hashable) -> Plan: ...

    def can_swap_in(self, seq_id: Hashable) -> bool: ...

    def swap_in(self, seq_id: Hashable) -> Plan: ...

    def reset_prefix_cache(self) -> None: ...
