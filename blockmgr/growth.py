"""`Growth`: what adding tokens to a live sequence takes, planned once for
the check and the act (`BlockManager.append`, `can_append`, the decode
step, the speculation transaction).

Every page group's table has the same length, so new pages are the same
number in each; a group copies its last page when that page is partly
filled and shared (copy-on-write: a full page is never written again), and
a shared slot is copied before the first write (LFM2's EnsureWritable).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from blockmgr.errors import IntegrityError
from blockmgr.ops import CopySlot, MemoryOp
from blockmgr.page_group import PageGroup
from blockmgr.pool import RefCountedPool
from blockmgr.sequence import Sequence


@dataclass(slots=True)
class Growth:
    """num_pages: new pages in every group; copies[i]: group i copies its
    shared last page; copy_slot: the shared slot is copied; needs[i]: pages
    group i takes (the new ones plus its copy); grows: it takes any page or
    slot. Built by `plan_growth`, which fills the derived fields once (read
    per decoded row)."""

    num_pages: int
    copies: list[bool]
    copy_slot: bool
    needs: list[int]
    grows: bool


def plan_growth(
    groups: Seq[PageGroup], slots: RefCountedPool | None, seq: Sequence, num_new_tokens: int
) -> Growth:
    """What adding `num_new_tokens` tokens to the resident `seq` takes. Pure;
    O(groups)."""
    num_tokens = len(seq.tokens)
    block_size = groups[0].block_size
    num_pages = -(-(num_tokens + num_new_tokens) // block_size) - len(seq.tables[0])
    if num_tokens % block_size:  # a partly filled last page: copied when shared
        copies = []
        tables = seq.tables
        for group in groups:
            last_page = tables[group.index][-1]  # past the released pages: never None
            copies.append(group.pages.refcount(last_page) > 1)  # type: ignore[arg-type]
        needs = [num_pages + copy for copy in copies]
    else:  # a full last page is never written again: no copy
        copies = [False] * len(groups)
        needs = [num_pages] * len(groups)
    copy_slot = seq.slot is not None and slots is not None and slots.refcount(seq.slot) > 1
    return Growth(num_pages, copies, copy_slot, needs,
                  bool(num_pages or copy_slot or True in copies))


def copy_slot(slots: RefCountedPool | None, seq: Sequence, ops: list[MemoryOp]) -> None:
    """Give the sequence its own copy of its shared slot (reserved)."""
    src = seq.slot
    if slots is None or src is None:
        raise IntegrityError(f"sequence {seq.seq_id!r} has no slot to copy")
    dst = seq.slot = slots.take_one()
    slots.release(src)  # shared, so it stays alive for the copy
    ops.append(CopySlot(src, dst))


def grow(
    groups: Seq[PageGroup],
    slots: RefCountedPool | None,
    seq: Sequence,
    growth: Growth,
    ops: list[MemoryOp],
) -> None:
    """Act on `growth` (its memory is reserved): copy what is shared, add
    the new pages in every group. O(groups + new pages)."""
    for group, copy in zip(groups, growth.copies):
        group.grow(seq, copy, growth.num_pages, ops)
    if growth.copy_slot:
        copy_slot(slots, seq, ops)
