"""`PageGroup`: the pages of one layer group, and every rule that works on
one group's page table of a sequence.

A model's layers form groups (full attention, one per sliding window); each
group has its own page pool (and host pool for swap) and every sequence has
one page table per group, all of the same length (`blockmgr.sequence`).
A `BlockManager` keeps a tuple of groups, the first alone for a plain
manager, and coordinates them; every rule here is written once for every
group. Every method assumes the manager checked the call and reserved the
pages it takes: none can fail. Costs are O(pages touched).
"""

from __future__ import annotations

from dataclasses import dataclass

from blockmgr.config import BlockManagerConfig
from blockmgr.errors import IntegrityError, OutOfBlocks
from blockmgr.ops import CopyBlock, MemoryOp, SwapIn, SwapOut
from blockmgr.pool import RefCountedPool
from blockmgr.sequence import Sequence, held, held_page
from blockmgr.trie_node import PageList, PrefixMatch


@dataclass(slots=True, eq=False)
class PageGroup:
    """One layer group's pools and window.

    index: its position in the manager's groups (and in every sequence's
        `tables`, every trie node's `pages`); group: the number its page
        ops carry (`CopyBlock.group`, ...); config: its
        `BlockManagerConfig` (pages, window, host pages, watermark).
    """

    index: int
    group: int
    config: BlockManagerConfig
    pages: RefCountedPool
    host_pages: RefCountedPool
    block_size: int
    window: int | None
    num_watermark_pages: int

    @classmethod
    def build(cls, index: int, group: int, config: BlockManagerConfig) -> PageGroup:
        return cls(
            index,
            group,
            config,
            RefCountedPool(config.num_blocks),
            RefCountedPool(config.num_host_blocks),
            config.block_size,
            config.sliding_window,
            config.num_watermark_blocks,
        )

    @property
    def num_usable_pages(self) -> int:
        """Pages one sequence may hold in an empty pool (past the watermark)."""
        return self.config.num_blocks - self.num_watermark_pages

    # ------------------------------------------------------------------ room

    def fits(self, num_pages: int) -> bool:
        """Are `num_pages` pages free now (no eviction)? O(1)."""
        return num_pages <= self.pages.num_free

    def room_error(self, what: str, num_pages: int, num_groups: int) -> OutOfBlocks:
        """The error of a call that `what` ("need", ...) `num_pages` pages
        this group cannot have (named when the manager keeps several)."""
        of_group = f" of group {self.group}" if num_groups > 1 else ""
        return OutOfBlocks(
            f"{what} {num_pages} pages{of_group}: {self.pages.num_free} free of "
            f"{self.pages.num_items}, not enough reclaimable from the prefix cache"
        )

    # -------------------------------------------------------------- allocate

    def hold_match(self, match: PrefixMatch) -> None:
        """The new sequence's references to the matched pages past the locked
        path (a node the hit ends inside stays evictable past the hit)."""
        pages = match.pages[self.index]
        first_owned = match.released[self.index]  # the larger of the two, without a max() call
        if first_owned < match.num_locked_pages:
            first_owned = match.num_locked_pages
        if len(pages) > first_owned:  # past the released pages: never None
            self.pages.incref_all(pages[first_owned:])  # type: ignore[arg-type]

    def release_match(self, match: PrefixMatch) -> None:
        """Undo `hold_match` (the trie still holds the pages: none is freed)."""
        pages = match.pages[self.index]
        self.pages.release_all(
            held(pages[max(match.num_locked_pages, match.released[self.index]) :])
        )

    def new_table(self, match: PrefixMatch, num_tokens: int, ops: list[MemoryOp]) -> PageList:
        """The new sequence's table: the held matched pages (the last one
        copied when the hit ends inside it: the next token goes there), then
        fresh pages up to `num_tokens`."""
        table: PageList = match.pages[self.index] if match.num_tokens else []
        if table and match.num_tokens % self.block_size:
            self._copy_last_page(table, ops)  # past the locked path, so owned
        table += self.pages.take(-(-num_tokens // self.block_size) - len(table))
        return table

    # ---------------------------------------------------------------- append

    def grow(self, seq: Sequence, copy_page: bool, num_pages: int, ops: list[MemoryOp]) -> None:
        """Copy the shared last page and add `num_pages` pages (reserved)."""
        table = seq.tables[self.index]
        if copy_page:
            self._copy_last_page(table, ops)
        if num_pages:
            table.extend(self.pages.take(num_pages))

    def _copy_last_page(self, table: PageList, ops: list[MemoryOp]) -> None:
        src = held_page(table[-1])
        dst = table[-1] = self.pages.take_one()
        self.pages.release(src)  # after the take: src cannot be handed out here
        ops.append(CopyBlock(src, dst, self.group))

    def release_out_of_window(self, seq: Sequence, first_new_position: int) -> None:
        """Release the pages the token at `first_new_position` can no longer
        see. A query at p sees keys (p - W, p]; page j ends at
        (j + 1) * bs - 1, so it is dead once (j + 1) * bs <= p - W + 1."""
        window = self.window
        if window is None:
            return
        index = self.index
        num_released = seq.released[index]
        num_dead = max(0, first_new_position - window + 1) // self.block_size
        if num_dead <= num_released:
            return
        table = seq.tables[index]
        num_dead = min(num_dead, len(table))
        for position in range(num_released, num_dead):
            if position >= seq.num_borrowed:
                self.pages.release(held_page(table[position]))
            table[position] = None
        seq.released[index] = num_dead

    def window_keeps(self, seq: Sequence, num_tokens: int) -> bool:
        """Are the pages the token at `num_tokens` attends to still held?"""
        num_released = seq.released[self.index]
        if self.window is None or num_released == 0:
            return True
        first_needed = max(0, num_tokens - self.window + 1) // self.block_size
        return num_tokens > 0 and first_needed >= num_released

    # ---------------------------------------------------- truncate / speculate

    def truncate(self, seq: Sequence, keep: int, num_borrowed: int) -> None:
        """Drop the pages from `keep` on; own the borrowed pages from
        `num_borrowed` on (the new end falls inside one of them: the next
        write copies it). Runs before the manager updates `seq.num_borrowed`."""
        index = self.index
        table = seq.tables[index]
        num_released = seq.released[index]
        self.pages.release_all(held(table[max(keep, num_released, seq.num_borrowed) :]))
        del table[keep:]
        self.pages.incref_all(held(table[max(num_borrowed, num_released) : seq.num_borrowed]))
        seq.released[index] = min(num_released, keep)

    def keep_pages(self, seq: Sequence, num_pages: int) -> None:
        """Release the pages from index `num_pages` on (owned: past any borrow)."""
        table = seq.tables[self.index]
        self.pages.release_all(held(table[num_pages:]))
        del table[num_pages:]

    # -------------------------------------------------------- fork/free/lock

    def share(self, seq: Sequence) -> list[int | None]:
        """A copy of the table, with a fork's references to the pages the
        sequence owns."""
        table = seq.tables[self.index]
        self.pages.incref_all(held(table[seq.first_owned(self.index) :]))
        return table[:]

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references (it ends; resident)."""
        index = self.index
        first_owned = seq.first_owned(index)
        table = seq.tables[index]
        owned = table[first_owned:] if first_owned else table  # past the released: no None
        self.pages.release_all(owned)  # type: ignore[arg-type]

    def own_borrowed(self, seq: Sequence) -> None:
        """Own references to the borrowed pages (the manager then sets
        `seq.num_borrowed` to 0: its lock moves or goes)."""
        table = seq.tables[self.index]
        self.pages.incref_all(held(table[seq.released[self.index] : seq.num_borrowed]))

    # ------------------------------------------------------------------- swap

    def num_held_pages(self, seq: Sequence) -> int:
        return len(seq.tables[self.index]) - seq.released[self.index]

    def move(self, seq: Sequence, to_host: bool, ops: list[MemoryOp]) -> None:
        """Move the sequence's pages to host memory (or back): the target
        pool has room, and the sequence borrows none."""
        pages_from, pages_to = self.pages, self.host_pages
        op: type[SwapOut] | type[SwapIn] = SwapOut
        if not to_host:
            pages_from, pages_to, op = pages_to, pages_from, SwapIn
        table = seq.tables[self.index]
        group = self.group
        for position in range(seq.released[self.index], len(table)):
            page = held_page(table[position])
            new_page = pages_to.take_one()
            ops.append(op(page, new_page, group))
            pages_from.release(page)
            table[position] = new_page

    def release_host_copy(self, seq: Sequence) -> None:
        self.host_pages.release_all(held(seq.tables[self.index][seq.released[self.index] :]))

    # --------------------------------------------------------------- checking

    def check_sequence(self, seq: Sequence, page_refs: list[int], where: str) -> None:
        """The table covers the tokens, released pages first (only with a
        window), and each page past the borrowed ones is counted in
        `page_refs`."""
        index = self.index
        table = seq.tables[index]
        num_released = seq.released[index]
        num_pages = -(-len(seq.tokens) // self.block_size)
        if len(table) != num_pages:
            raise IntegrityError(f"{where} has {len(table)} pages of group {self.group} for "
                                 f"{len(seq.tokens)} tokens")
        if num_released and self.window is None:
            raise IntegrityError(
                f"{where} released pages of group {self.group} without a sliding window")
        # Tested at C speed, the position found only on failure: this runs per page.
        if table[:num_released].count(None) != num_released or None in table[num_released:]:
            position = next(
                p for p, page in enumerate(table) if (page is None) != (p < num_released))
            raise IntegrityError(
                f"{where}: page {position} of group {self.group} released out of order")
        for page in table[seq.first_owned(index):]:
            page_refs[page] += 1  # type: ignore[index]  # past the released: a page


def windows_keep(groups: tuple[PageGroup, ...], seq: Sequence, num_tokens: int) -> bool:
    """Are the pages the token at `num_tokens` attends to still held in
    every group? O(groups)."""
    return all(group.window_keeps(seq, num_tokens) for group in groups)
