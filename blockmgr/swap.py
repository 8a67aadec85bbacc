"""`HostSwap`: a sequence's pages and slot moved to host pools and back.

Preemption by swap (`BlockManager.swap_out` / `swap_in`): every page a
sequence holds (in every page group) and its slot are copied to host pools
(`SwapOut`, `SwapOutSlot`) and the device ones released; `swap_in` gives it
fresh device ones (`SwapIn`, `SwapInSlot`). Shared pages are copied like
the others: sharing is given up while the sequence is out.

The manager owns one `HostSwap` over its own pools. It checks ids, drops
the sequence's trie lock and borrowed pages and reserves device memory
(with eviction) itself; the calls here assume that was done and cannot
fail. `swap_in_needs` is the planning function its check and its act
share.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockmgr.ops import MemoryOp, SwapIn, SwapInSlot, SwapOut, SwapOutSlot
from blockmgr.page_group import PageGroup
from blockmgr.pool import RefCountedPool
from blockmgr.sequence import Sequence


@dataclass(slots=True, eq=False)
class HostSwap:
    """Moves sequences between a manager's device and host pools.

    `pages` / `slots` (None: no recurrent state) are the device pools of
    the manager's own page group `group`, `host_pages` / `host_slots` their
    host pools, `more` the further page groups (each with its host pool).
    """

    pages: RefCountedPool
    slots: RefCountedPool | None
    host_pages: RefCountedPool
    host_slots: RefCountedPool
    more: tuple[PageGroup, ...]
    group: int

    def can_swap_out(self, seq: Sequence) -> bool:
        """Is there host memory for every page and the slot the resident
        `seq` holds? Pure. O(groups)."""
        num_pages = len(seq.block_table) - seq.num_released
        num_slots = 1 if seq.slot is not None else 0
        return (
            self.host_pages.can_take(num_pages)
            and self.host_slots.can_take(num_slots)
            and all(
                group.host_pages.can_take(group.num_held_pages(seq, index))
                for index, group in enumerate(self.more)
            )
        )

    def swap_out(self, seq: Sequence) -> list[MemoryOp]:
        """Move `seq`'s pages and slot to host memory (`can_swap_out` holds;
        it borrows no page) and mark it swapped; the copy ops. O(pages)."""
        return self._move_sequence(seq, to_host=True)

    def swap_in_needs(self, seq: Sequence) -> tuple[int, int, list[int] | None]:
        """(pages, slots, pages of each further group or None) that
        swapping the swapped-out `seq` in takes on the device. Pure."""
        num_pages = len(seq.block_table) - seq.num_released
        more = None
        if self.more:
            more = [group.num_held_pages(seq, index) for index, group in enumerate(self.more)]
        return num_pages, 1 if seq.slot is not None else 0, more

    def swap_in(self, seq: Sequence) -> list[MemoryOp]:
        """Move the swapped-out `seq` back to device pools (`swap_in_needs`
        is reserved) and mark it resident; the copy ops. O(pages)."""
        return self._move_sequence(seq, to_host=False)

    def release_host_copy(self, seq: Sequence) -> None:
        """Give back the host pages and slot of the swapped-out `seq` (freed)."""
        self.host_pages.release_all(seq.block_table[seq.num_released :])
        for index, group in enumerate(self.more):
            group.release_host_copy(seq, index)
        if seq.slot is not None:
            self.host_slots.release(seq.slot)

    def _move_sequence(self, seq: Sequence, to_host: bool) -> list[MemoryOp]:
        """Move every page and the slot of `seq` (in every page group) to the
        host pools or back, with the copy ops; the target pools have room."""
        if to_host:
            ops = self._move(seq, (self.pages, self.host_pages, SwapOut),
                             (self.slots, self.host_slots, SwapOutSlot))
        else:
            ops = self._move(seq, (self.host_pages, self.pages, SwapIn),
                             (self.host_slots, self.slots, SwapInSlot))
        for index, group in enumerate(self.more):
            group.move(seq, index, to_host, ops)
        seq.swapped = to_host
        return ops

    def _move(self, seq: Sequence, pages: tuple, slots: tuple) -> list[MemoryOp]:
        """Give the sequence new pages (and slot) from another pool, with the
        copy ops. `pages` / `slots`: (from pool, to pool, op type). The target
        pools are known to have room."""
        pages_from, pages_to, page_op = pages
        group = self.group
        ops: list[MemoryOp] = []
        table = seq.block_table
        for index in range(seq.num_released, len(table)):
            new_page = pages_to.take_one()
            ops.append(page_op(table[index], new_page, group))
            pages_from.release(table[index])
            table[index] = new_page
        if seq.slot is not None:
            slots_from, slots_to, slot_op = slots
            new_slot = slots_to.take_one()
            ops.append(slot_op(seq.slot, new_slot))
            slots_from.release(seq.slot)
            seq.slot = new_slot
        return ops
