"""Shadow storage: replays memory-op plans on token ids instead of tensors.

A numpy array stands for the page pool (one token id per position) and a list
for the slot pool (the token prefix whose recurrent state the slot holds).
"Computing" a token writes its id where the block table says; the recurrent
state of a slot must be exactly the prefix computed so far. Reading a
sequence back through its block table must give its own tokens: any
copy-on-write, sharing or eviction mistake shows up as a wrong id.
"""

from __future__ import annotations

import numpy as np

from blockmgr import (
    BlockManager,
    CopyBlock,
    CopySlot,
    MovePage,
    MoveSlot,
    SwapIn,
    SwapInSlot,
    SwapOut,
    SwapOutSlot,
    ZeroSlot,
)

UNWRITTEN = -1


class ShadowStorage:
    """The pages of page group `group` of `bm` (and, for group 0, its slots)."""

    def __init__(self, bm: BlockManager, group: int = 0) -> None:
        config = bm.config.group_configs()[group]
        self.bm = bm
        self.group = group
        self.window = config.sliding_window
        self.block_size = config.block_size
        self.pages = np.full((config.num_blocks, config.block_size), UNWRITTEN, np.int64)
        self.slots: list[tuple[int, ...] | None] = [None] * config.num_slots
        self.host_pages = np.full((config.num_host_blocks, config.block_size), UNWRITTEN, np.int64)
        self.host_slots: list[tuple[int, ...] | None] = [None] * config.num_host_slots
        # The prefix cache's tiers: device (the pools above), host, disk.
        self.tier_pages = [
            self.pages,
            np.full((config.num_host_cache_blocks, config.block_size), UNWRITTEN, np.int64),
            np.full((config.num_disk_blocks, config.block_size), UNWRITTEN, np.int64),
        ]
        self.tier_slots: list[list] = [
            self.slots, [None] * config.num_host_cache_slots, [None] * config.num_disk_slots
        ]
        self.computed: dict[object, int] = {}

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, MovePage):
                assert op.src_tier != op.dst_tier
                self.tier_pages[op.dst_tier][op.dst] = self.tier_pages[op.src_tier][op.src]
            elif isinstance(op, MoveSlot):
                assert op.src_tier != op.dst_tier
                self.tier_slots[op.dst_tier][op.dst] = self.tier_slots[op.src_tier][op.src]
            elif isinstance(op, CopyBlock):
                assert op.src != op.dst
                self.pages[op.dst] = self.pages[op.src]
            elif isinstance(op, CopySlot):
                assert op.src != op.dst
                self.slots[op.dst] = self.slots[op.src]
            elif isinstance(op, ZeroSlot):
                self.slots[op.slot] = ()
            elif isinstance(op, SwapOut):
                self.host_pages[op.dst] = self.pages[op.src]
            elif isinstance(op, SwapIn):
                self.pages[op.dst] = self.host_pages[op.src]
            elif isinstance(op, SwapOutSlot):
                self.host_slots[op.dst] = self.slots[op.src]
            elif isinstance(op, SwapInSlot):
                self.slots[op.dst] = self.host_slots[op.src]
            else:
                raise AssertionError(f"unknown op {op!r}")

    def take_disk_from(self, other: ShadowStorage) -> None:
        """The disk tier's records of `other` (the files a restart reads)."""
        self.tier_pages[2][:] = other.tier_pages[2]
        self.tier_slots[2][:] = other.tier_slots[2]

    def compute(self, seq_id, upto: int | None = None) -> None:
        """Run the 'forward pass' over the sequence's uncomputed tokens."""
        tokens = self.bm.tokens(seq_id)
        table = self.bm.block_table(seq_id, self.group or None)
        start = self.computed[seq_id]
        upto = len(tokens) if upto is None else upto
        window = self.window
        if window is not None:
            # The first new token attends to keys (start - W, start]: still held.
            for pos in range(max(0, start - window + 1), start):
                assert table[pos // self.block_size] is not None, (
                    f"{seq_id}: position {pos} is inside the window but was released"
                )
        slot = self.bm.slot(seq_id) if self.group == 0 else None
        if slot is not None:
            assert self.slots[slot] == tuple(tokens[:start]), (
                f"{seq_id}: slot {slot} holds the wrong recurrent state before position {start}"
            )
        for pos in range(start, upto):
            page = table[pos // self.block_size]
            assert page is not None, f"{seq_id}: writing into a released page"
            self.pages[page, pos % self.block_size] = tokens[pos]
        if slot is not None:
            self.slots[slot] = tuple(tokens[:upto])
        self.computed[seq_id] = upto
        self.bm.progress(seq_id).num_computed = upto  # as a forward's runner sets it

    def check_reads_back(self, seq_id) -> None:
        """Every computed, still-held position holds the sequence's own token."""
        tokens = self.bm.tokens(seq_id)
        table = self.bm.block_table(seq_id, self.group or None)
        bs = self.block_size
        swapped = self.bm.is_swapped(seq_id)
        pages = self.host_pages if swapped else self.pages
        for pos in range(self.computed[seq_id]):
            page = table[pos // bs]
            if page is None:
                continue
            got = pages[page, pos % bs]
            assert got == tokens[pos], (
                f"{seq_id}: position {pos} reads {got}, expected {tokens[pos]} (page {page})"
            )
        slot = self.bm.slot(seq_id) if self.group == 0 else None
        slots = self.host_slots if swapped else self.slots
        if slot is not None and self.computed[seq_id] == len(tokens):
            assert slots[slot] == tuple(tokens), f"{seq_id}: slot state is wrong"

    def check_all(self) -> None:
        for seq_id in self.computed:
            self.check_reads_back(seq_id)


class GroupedShadowStorage:
    """Shadow storage of a `GroupedStore`: one `ShadowStorage` per layer group.

    Page ops go to the group they name, slot ops to group 0 (the slot pool);
    "computing" a sequence writes its tokens in every group, and reading
    back checks every group's pages (and group 0's slot).
    """

    def __init__(self, store) -> None:
        self.store = store
        self.groups = [ShadowStorage(store, g) for g in range(store.num_groups)]
        self.computed: dict[object, int] = {}
        for group in self.groups:
            group.computed = self.computed  # one computed count per sequence

    def apply(self, ops) -> None:
        for op in ops:
            group = op.group if isinstance(op, (CopyBlock, SwapOut, SwapIn, MovePage)) else 0
            self.groups[group].apply([op])

    def compute(self, seq_id, upto: int | None = None) -> None:
        start = self.computed[seq_id]
        for group in self.groups:
            self.computed[seq_id] = start
            group.compute(seq_id, upto)

    def check_reads_back(self, seq_id) -> None:
        for group in self.groups:
            group.check_reads_back(seq_id)

    def take_disk_from(self, other: GroupedShadowStorage) -> None:
        for group, old in zip(self.groups, other.groups):
            group.take_disk_from(old)

    def check_all(self) -> None:
        for group in self.groups:
            group.check_all()
