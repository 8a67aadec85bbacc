"""Memory snapshots of a `BlockManager`: sharing and internal fragmentation.

Taken every few steps by the runner (the cost is O(pages held by live
sequences), so not every step). Pages held only by the prefix trie are
reported separately (`trie_pages`): they are a cache, not waste.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

CONTIGUOUS_STEP = 256  # mlx-lm grows a contiguous KVCache in 256-token steps


@dataclass(slots=True, frozen=True)
class MemorySnapshot:
    """Pages of live (device-resident) sequences at one instant.

    logical_pages: sum over sequences of the pages in their tables (what
        unshared paging would need).
    physical_pages: distinct pages they reference (what sharing needs).
    tokens: tokens those sequences hold, counted once per distinct page.
    wasted_slots: token slots allocated but unused (partly filled last pages).
    contiguous_tokens: token slots a contiguous cache grown in 256-token steps
        would hold for the same sequences (one per sequence, no sharing).
    """

    num_sequences: int
    logical_pages: int
    physical_pages: int
    tokens: int
    wasted_slots: int
    contiguous_tokens: int
    block_size: int

    @property
    def fragmentation(self) -> float:
        """Allocated but unused token slots over allocated token slots."""
        slots = self.physical_pages * self.block_size
        return self.wasted_slots / slots if slots else 0.0

    @property
    def sharing_saved_pages(self) -> int:
        return self.logical_pages - self.physical_pages

    @property
    def sharing_saved_fraction(self) -> float:
        return self.sharing_saved_pages / self.logical_pages if self.logical_pages else 0.0


class SequencePages(Protocol):
    """What a snapshot reads of a store (a `BlockManager` or `GroupedStore`):
    its live sequences, their page tables (main group) and token counts."""

    @property
    def block_size(self) -> int: ...

    def sequence_ids(self) -> list[Hashable]: ...

    def block_table(self, seq_id: Hashable) -> list[int | None]: ...

    def num_tokens(self, seq_id: Hashable) -> int: ...

    def is_swapped(self, seq_id: Hashable) -> bool: ...


def snapshot(bm: SequencePages) -> MemorySnapshot:
    """Measure `bm` now. O(pages held by live sequences)."""
    block_size = bm.block_size
    is_swapped = bm.is_swapped
    pages: set[int | None] = set()  # None (a released page) is discarded at the end
    last_fill: dict[int, int] = {}
    logical = 0
    contiguous = 0
    count = 0
    for seq_id in bm.sequence_ids():
        if is_swapped(seq_id):
            continue
        table = bm.block_table(seq_id)
        num_tokens = bm.num_tokens(seq_id)
        count += 1
        contiguous += -(-num_tokens // CONTIGUOUS_STEP) * CONTIGUOUS_STEP
        if not table:
            continue
        pages.update(table)
        logical += len(table) - (table.count(None) if table[0] is None else 0)
        last = table[-1]
        if last is not None:
            fill = num_tokens - (len(table) - 1) * block_size
            if fill > last_fill.get(last, 0):
                last_fill[last] = fill
    pages.discard(None)
    wasted = sum(block_size - fill for fill in last_fill.values())
    physical = len(pages)
    return MemorySnapshot(
        num_sequences=count,
        logical_pages=logical,
        physical_pages=physical,
        tokens=physical * block_size - wasted,
        wasted_slots=wasted,
        contiguous_tokens=contiguous,
        block_size=block_size,
    )
