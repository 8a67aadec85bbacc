"""`PageGroup`: a further page group of a `BlockManager` (one trie, one record).

A model with several attention windows keeps one page pool per window. The
`BlockManager` of its first group (`GroupedStore`'s group 0) also keeps the
others as `PageGroup`s: their pages sit beside group 0's in the same trie
nodes (`TrieNode.more`) and in the same sequence records
(`Sequence.more_tables`, one page table per group), so a request walks,
locks, touches the LRU, inserts and records once for all groups; a further
group adds only its own pool takes, page references and window release
(`design/grouped_store.md`, "Costs").

Every method works on table `index` of a sequence's `more_tables` (this
group's) and assumes the manager checked the call and reserved the pages:
none can fail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blockmgr.config import BlockManagerConfig
from blockmgr.errors import IntegrityError
from blockmgr.ops import CopyBlock, MemoryOp, SwapIn, SwapOut
from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import PrefixMatch
from blockmgr.sequence import Sequence


@dataclass(slots=True, eq=False)
class PageGroup:
    """The pages of one further layer group: its pools and window."""

    group: int
    config: BlockManagerConfig
    pages: RefCountedPool
    host_pages: RefCountedPool
    block_size: int
    window: int | None
    num_watermark_blocks: int

    @classmethod
    def build(cls, group: int, config: BlockManagerConfig) -> PageGroup:
        return cls(
            group,
            config,
            RefCountedPool(config.num_blocks),
            RefCountedPool(config.num_host_blocks),
            config.block_size,
            config.sliding_window,
            config.num_watermark_blocks,
        )

    # ------------------------------------------------------------- allocate

    def hold_match(self, match: PrefixMatch, index: int) -> None:
        """The new sequence's references to the matched pages past the
        locked path (as `BlockManager._hold_match`)."""
        pages = match.more_pages[index]
        first_owned = max(match.num_locked_pages, match.more_released[index])
        if len(pages) > first_owned:
            self.pages.incref_all(pages[first_owned:])

    def release_match(self, match: PrefixMatch, index: int) -> None:
        """Undo `hold_match`."""
        pages = match.more_pages[index]
        self.pages.release_all(pages[max(match.num_locked_pages, match.more_released[index]) :])

    def new_table(
        self, match: PrefixMatch, index: int, num_tokens: int, ops: list[MemoryOp]
    ) -> list[int | None]:
        """The new sequence's table: the held matched pages (the last one
        copied when the hit ends inside it), then fresh pages."""
        table = [] if match.more_pages is None else match.more_pages[index]
        block_size = self.block_size
        if table and match.num_tokens % block_size:
            src = table[-1]
            table[-1] = self.pages.take_one()
            self.pages.release(src)  # after the take: src cannot be handed out here
            ops.append(CopyBlock(src, table[-1], self.group))
        table += self.pages.take(-(-num_tokens // block_size) - len(table))
        return table

    # --------------------------------------------------------------- append

    def copies_last_page(self, seq: Sequence, index: int) -> bool:
        """Must the last page be copied before the next token is written?"""
        table = seq.more_tables[index]
        return bool(len(seq.tokens) % self.block_size) and self.pages.refcount(table[-1]) > 1

    def fits_next_token(self, seq: Sequence, index: int, num_tokens: int) -> bool:
        """Does the token at `num_tokens` go into the sequence's own last
        page (the manager checked it is not a new page) with no page
        leaving the window? O(1)."""
        table = seq.more_tables[index]
        if self.pages.refcount(table[-1]) != 1:
            return False
        window = self.window
        return window is None or (num_tokens - window + 1) // self.block_size <= seq.more_released[index]

    def grow(self, seq: Sequence, index: int, copy_page: bool, num_pages: int,
             ops: list[MemoryOp]) -> None:
        """Copy the shared last page (reserved) and add `num_pages` pages."""
        table = seq.more_tables[index]
        if copy_page:
            src = table[-1]
            table[-1] = self.pages.take_one()
            self.pages.release(src)  # shared, so it stays alive for the copy
            ops.append(CopyBlock(src, table[-1], self.group))
        if num_pages:
            table.extend(self.pages.take(num_pages))

    def release_out_of_window(self, seq: Sequence, index: int, first_new_position: int) -> None:
        """Release the pages the token at `first_new_position` can no longer
        see (as `BlockManager._release_out_of_window`)."""
        window = self.window
        if window is None:
            return
        num_released = seq.more_released[index]
        num_dead = max(0, first_new_position - window + 1) // self.block_size
        if num_dead <= num_released:
            return
        table = seq.more_tables[index]
        num_dead = min(num_dead, len(table))
        for position in range(num_released, num_dead):
            if position >= seq.num_borrowed:
                self.pages.release(table[position])
            table[position] = None
        seq.more_released[index] = max(num_released, num_dead)

    def window_keeps(self, seq: Sequence, index: int, num_tokens: int) -> bool:
        """Are the pages the token at `num_tokens` attends to still held?"""
        num_released = seq.more_released[index]
        if self.window is None or num_released == 0:
            return True
        first_needed = max(0, num_tokens - self.window + 1) // self.block_size
        return num_tokens > 0 and first_needed >= num_released

    # ------------------------------------------------- truncate / speculation

    def truncate(self, seq: Sequence, index: int, keep: int, num_borrowed: int) -> None:
        """Drop the pages from `keep` on; own the borrowed pages from
        `num_borrowed` on (the new end falls inside one of them). Runs
        before the manager updates `seq.num_borrowed`."""
        table = seq.more_tables[index]
        num_released = seq.more_released[index]
        self.pages.release_all(table[max(keep, num_released, seq.num_borrowed) :])
        del table[keep:]
        self.pages.incref_all(table[max(num_borrowed, num_released) : seq.num_borrowed])
        seq.more_released[index] = min(num_released, keep)

    def keep_pages(self, seq: Sequence, index: int, num_pages: int) -> None:
        """Release the pages from index `num_pages` on (owned: past any borrow)."""
        table = seq.more_tables[index]
        self.pages.release_all(table[num_pages:])
        del table[num_pages:]

    # ------------------------------------------------------- fork/free/lock

    def share(self, seq: Sequence, index: int) -> None:
        """A fork's references to the pages the sequence owns."""
        table = seq.more_tables[index]
        self.pages.incref_all(table[max(seq.more_released[index], seq.num_borrowed) :])

    def release(self, seq: Sequence, index: int) -> None:
        """Drop the sequence's references (it ends; resident)."""
        table = seq.more_tables[index]
        self.pages.release_all(table[max(seq.more_released[index], seq.num_borrowed) :])

    def own_borrowed(self, seq: Sequence, index: int) -> None:
        """Own references to the borrowed pages (the manager then sets
        `seq.num_borrowed` to 0)."""
        table = seq.more_tables[index]
        self.pages.incref_all(table[seq.more_released[index] : seq.num_borrowed])

    # ------------------------------------------------------------------ swap

    def num_held_pages(self, seq: Sequence, index: int) -> int:
        return len(seq.more_tables[index]) - seq.more_released[index]

    def move(self, seq: Sequence, index: int, to_host: bool, ops: list[MemoryOp]) -> None:
        """Move the sequence's pages to host memory (or back); room is known."""
        pages_from, pages_to = (self.pages, self.host_pages)
        op = SwapOut
        if not to_host:
            pages_from, pages_to, op = pages_to, pages_from, SwapIn
        table = seq.more_tables[index]
        for position in range(seq.more_released[index], len(table)):
            new_page = pages_to.take_one()
            ops.append(op(table[position], new_page, self.group))
            pages_from.release(table[position])
            table[position] = new_page

    def release_host_copy(self, seq: Sequence, index: int) -> None:
        self.host_pages.release_all(seq.more_tables[index][seq.more_released[index] :])

    # -------------------------------------------------------------- checking

    def check_sequence(self, seq: Sequence, index: int, page_refs: list[int], where: str) -> None:
        """The table covers the tokens, released pages first, and each page
        past the borrowed ones counted in `page_refs`."""
        table = seq.more_tables[index]
        num_released = seq.more_released[index]
        num_pages = -(-len(seq.tokens) // self.block_size)
        if len(table) != num_pages:
            raise IntegrityError(
                f"{where} has {len(table)} pages of group {self.group} for {len(seq.tokens)} tokens"
            )
        if num_released and self.window is None:
            raise IntegrityError(f"{where} released pages of group {self.group} without a window")
        first_owned = max(num_released, seq.num_borrowed)
        for position, page in enumerate(table):
            if (page is None) != (position < num_released):
                raise IntegrityError(
                    f"{where}: page {position} of group {self.group} released out of order"
                )
            if position >= first_owned:
                page_refs[page] += 1


class PageGroupView:
    """A further page group seen as a read-only `BlockManager` (what
    `GroupedStore.managers` lists past group 0): its config, pools, tables
    and trie share; the sequence calls are the owner's, not the view's."""

    def __init__(self, owner, group: PageGroup) -> None:
        """`owner`: the `BlockManager` keeping `group`."""
        self._owner = owner
        self._group = group
        self.config = group.config

    @property
    def group(self) -> int:
        return self._group.group

    @property
    def block_size(self) -> int:
        return self._group.block_size

    @property
    def is_hybrid(self) -> bool:
        return False

    @property
    def enable_prefix_cache(self) -> bool:
        return self._owner.enable_prefix_cache

    @property
    def num_usable_blocks(self) -> int:
        return self.config.num_blocks - self.config.num_watermark_blocks

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._owner

    @property
    def num_sequences(self) -> int:
        return self._owner.num_sequences

    def sequence_ids(self) -> list:
        return self._owner.sequence_ids()

    def block_table(self, seq_id) -> list[int | None]:
        return self._owner.block_table(seq_id, self.group)

    def num_tokens(self, seq_id) -> int:
        return self._owner.num_tokens(seq_id)

    def tokens(self, seq_id) -> list[int]:
        return self._owner.tokens(seq_id)

    def slot(self, seq_id) -> None:
        self._owner.slot(seq_id)  # raises for an unknown id
        return None

    def namespace(self, seq_id):
        return self._owner.namespace(seq_id)

    def is_swapped(self, seq_id) -> bool:
        return self._owner.is_swapped(seq_id)

    def speculation_start(self, seq_id) -> int | None:
        return self._owner.speculation_start(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return self._group.pages.num_free

    @property
    def num_free_slots(self) -> int:
        return 0

    @property
    def num_free_host_blocks(self) -> int:
        return self._group.host_pages.num_free

    @property
    def num_free_host_slots(self) -> int:
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return self._owner.num_cached_blocks_in(self.group)

    @property
    def usage(self) -> float:
        pages = self._group.pages
        return pages.num_used / pages.num_items

    @property
    def stats(self):
        """The owner's stats with this group's page counts (no slots)."""
        return replace(
            self._owner.stats,
            num_evicted_pages=self._owner.num_evicted_pages_in(self.group),
            num_trie_pages=self.num_cached_blocks,
            num_trie_slots=0,
        )

    def check_integrity(self) -> None:
        self._owner.check_integrity()
