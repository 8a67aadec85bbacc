"""`HostSwap`: a sequence's pages and slot moved to host pools and back.

Preemption by swap (`BlockManager.swap_out` / `swap_in`): every page a
sequence holds (in every page group) and its slot are copied to host pools
(`SwapOut`, `SwapOutSlot`) and the device ones released; `swap_in` gives it
fresh device ones (`SwapIn`, `SwapInSlot`). Shared pages are copied like
the others: sharing is given up while the sequence is out.

The manager owns one `HostSwap` over its page groups and slot pools. It
checks ids, drops the sequence's trie lock and borrowed pages and reserves
device memory (with eviction) itself; the calls here assume that was done
and cannot fail. `swap_in_needs` is the planning function its check and its
act share.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockmgr.ops import MemoryOp, SwapInSlot, SwapOutSlot
from blockmgr.page_group import PageGroup
from blockmgr.pool import RefCountedPool
from blockmgr.sequence import Sequence


@dataclass(slots=True, eq=False)
class HostSwap:
    """Moves sequences between a manager's device and host pools.

    `groups` are the manager's page groups (each with its host pool),
    `slots` / `host_slots` its slot pools (`slots` None: no recurrent state).
    """

    groups: tuple[PageGroup, ...]
    slots: RefCountedPool | None
    host_slots: RefCountedPool

    def can_swap_out(self, seq: Sequence) -> bool:
        """Is there host memory for every page and the slot the resident
        `seq` holds? Pure. O(groups)."""
        return self.host_slots.can_take(1 if seq.slot is not None else 0) and all(
            group.host_pages.can_take(group.num_held_pages(seq)) for group in self.groups
        )

    def swap_out(self, seq: Sequence) -> list[MemoryOp]:
        """Move `seq`'s pages and slot to host memory (`can_swap_out` holds;
        it borrows no page) and mark it swapped; the copy ops. O(pages)."""
        return self._move(seq, to_host=True)

    def swap_in_needs(self, seq: Sequence) -> tuple[list[int], int]:
        """(pages of each group, slots) that swapping the swapped-out `seq`
        in takes on the device. Pure."""
        return (
            [group.num_held_pages(seq) for group in self.groups],
            1 if seq.slot is not None else 0,
        )

    def swap_in(self, seq: Sequence) -> list[MemoryOp]:
        """Move the swapped-out `seq` back to device pools (`swap_in_needs`
        is reserved) and mark it resident; the copy ops. O(pages)."""
        return self._move(seq, to_host=False)

    def release_host_copy(self, seq: Sequence) -> None:
        """Give back the host pages and slot of the swapped-out `seq` (freed)."""
        for group in self.groups:
            group.release_host_copy(seq)
        if seq.slot is not None:
            self.host_slots.release(seq.slot)

    def _move(self, seq: Sequence, to_host: bool) -> list[MemoryOp]:
        """Move every page (in every group) and the slot of `seq` to the host
        pools or back, with the copy ops; the target pools have room."""
        ops: list[MemoryOp] = []
        for group in self.groups:
            group.move(seq, to_host, ops)
        if seq.slot is not None and self.slots is not None:
            slots_from, slots_to = self.slots, self.host_slots
            if not to_host:
                slots_from, slots_to = slots_to, slots_from
            new_slot = slots_to.take_one()
            ops.append((SwapOutSlot if to_host else SwapInSlot)(seq.slot, new_slot))
            slots_from.release(seq.slot)
            seq.slot = new_slot
        seq.swapped = to_host
        return ops
