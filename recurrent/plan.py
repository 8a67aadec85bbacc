"""Slot plans compiled into one batched remap.

A block-manager plan is a sequence of `ZeroSlot` / `CopySlot` ops with
sequential meaning: each op sees the effect of the ones before it. Storage
applies a whole plan at once, per state array one gather of the copied rows
and at most two writes (copied rows, zeroed rows), however long the plan. So
the ops are first folded into a `SlotRemap`: for every slot whose final
content differs from its current one, either the slot whose *current*
content it receives, or zero. Reading only current contents is what makes
the batched gather-then-write equal to the sequential ops.

Pure Python, no MLX; O(number of ops).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from blockmgr.errors import InvalidArgument
from blockmgr.ops import CopyBlock, CopySlot, MemoryOp, SwapIn, SwapOut, ZeroSlot


@dataclass(frozen=True, slots=True)
class SlotRemap:
    """Net effect of a slot plan, read against the slots' current contents.

    Slot `copy_dst[i]` receives the current content of `copy_src[i]`; every
    slot of `zero` is reset. All destination slots are distinct.
    """

    copy_dst: tuple[int, ...]
    copy_src: tuple[int, ...]
    zero: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.copy_dst) + len(self.zero)


def compile_slot_plan(ops: Iterable[MemoryOp], num_slots: int) -> SlotRemap | None:
    """Fold a plan's slot ops into one `SlotRemap`; `None` when nothing changes.

    Page ops (`CopyBlock`, `SwapOut`, `SwapIn`) are ignored (pages belong to
    the page pool); slot swaps are applied by `RecurrentPools`. Raises
    `InvalidArgument` for an unknown op or a slot outside `[0, num_slots)`;
    nothing is applied in that case (this function never mutates storage).
    Cost: O(len(ops)).
    """
    # slot -> the slot whose current content it ends with; None: it ends zeroed
    content: dict[int, int | None] = {}
    for op in ops:
        if isinstance(op, ZeroSlot):
            content[_check_slot(op.slot, num_slots)] = None
        elif isinstance(op, CopySlot):
            src = _check_slot(op.src, num_slots)
            dst = _check_slot(op.dst, num_slots)
            content[dst] = content.get(src, src)
        elif not isinstance(op, (CopyBlock, SwapOut, SwapIn)):
            raise InvalidArgument(f"not a slot remap op: {op!r}")
    copy_dst: list[int] = []
    copy_src: list[int] = []
    zero: list[int] = []
    for slot, origin in content.items():
        if origin is None:
            zero.append(slot)
        elif origin != slot:  # a slot copied back onto itself is unchanged
            copy_dst.append(slot)
            copy_src.append(origin)
    if not copy_dst and not zero:
        return None
    return SlotRemap(tuple(copy_dst), tuple(copy_src), tuple(zero))


def _check_slot(slot: object, num_slots: int) -> int:
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots:
        raise InvalidArgument(f"slot {slot!r} outside [0, {num_slots})")
    return slot
