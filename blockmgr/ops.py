"""Memory-op plans: the storage work a bookkeeping decision implies.

`blockmgr` never touches tensors. Every call that needs storage work returns a
plan: a sequence of ops that the storage (`cache/`, `recurrent/`) applies, in
order, before the next forward pass. Plans of several calls made between two
forward passes are applied in call order; a page or slot freed by one call and
handed out again by a later one is therefore only written after every earlier
op that read it.

Page ops (`CopyBlock`, `SwapOut`, `SwapIn`, `MovePage`) name the layer group
whose pages they move (`group`, 0 for a single group); slot ops need none: a
model has one slot pool. `MovePage` / `MoveSlot` move a cached prefix between
the tiers of the prefix cache (`Tier`: device, host, disk). Ops are small
frozen records; applying them is the storage's business (one batched
gather/scatter per layer per step, not one per op).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Union


class Tier(IntEnum):
    """Where a cached prefix's pages (and snapshot) live: the device pools
    the model reads, host memory, or disk. Colder tiers have larger numbers."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True, slots=True)
class CopyBlock:
    """Copy every token position of page `src` into page `dst` (copy-on-write).

    `group`: the layer group whose pages these are (0 for a single group).
    """

    src: int
    dst: int
    group: int = 0


@dataclass(frozen=True, slots=True)
class CopySlot:
    """Copy the recurrent state held in slot `src` into slot `dst`."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class ZeroSlot:
    """Reset slot `slot` to the zero state (a fresh or recycled slot)."""

    slot: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Copy device page `src` into host page `dst` (preemption by swap), in `group`."""

    src: int
    dst: int
    group: int = 0


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Copy host page `src` back into device page `dst`, in `group`."""

    src: int
    dst: int
    group: int = 0


@dataclass(frozen=True, slots=True)
class SwapOutSlot:
    """Copy device slot `src` into host slot `dst`."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class SwapInSlot:
    """Copy host slot `src` back into device slot `dst`."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class MovePage:
    """Copy page `src` of tier `src_tier` into page `dst` of tier `dst_tier`,
    in `group`: a cached prefix demoted to a colder tier or loaded back to
    the device (`blockmgr.tiered_trie`). The source is free after the copy."""

    src: int
    dst: int
    group: int
    src_tier: Tier
    dst_tier: Tier


@dataclass(frozen=True, slots=True)
class MoveSlot:
    """Copy slot `src` of tier `src_tier` into slot `dst` of tier `dst_tier`
    (a recurrent snapshot demoted or loaded with its prefix)."""

    src: int
    dst: int
    src_tier: Tier
    dst_tier: Tier


MemoryOp = Union[
    CopyBlock, CopySlot, ZeroSlot, SwapOut, SwapIn, SwapOutSlot, SwapInSlot, MovePage, MoveSlot
]

#: A memory-op plan: the ops of one call, in the order the storage applies them.
Plan = tuple[MemoryOp, ...]

#: The plan returned when no storage work is needed (shared, never mutated).
NO_OPS: Plan = ()
