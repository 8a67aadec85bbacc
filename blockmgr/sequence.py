"""Records of the block manager: a live sequence and an allocation result."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from blockmgr.ops import MemoryOp
from blockmgr.prefix_trie import TrieNode


@dataclass(slots=True)
class Speculation:
    """An open speculation transaction of one sequence (`begin_speculation`).

    start: the sequence's token count at begin; tokens past it are drafts,
        never inserted into the prefix trie.
    checkpoint: hybrid only: the slot holding the recurrent state as it was
        at begin (the sequence writes into a copy); None otherwise.
    recompute_from: the position a commit keeping less than the whole tail
        makes the caller compute again from (a restored checkpoint's: the
        computed count at begin); None when nothing is computed again.
    """

    start: int
    checkpoint: int | None = None
    recompute_from: int | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """A live sequence: its tokens, the pages holding them, its slot.

    block_table[j] holds token positions [j * block_size, (j + 1) * block_size);
    with a sliding window the first `num_released` entries are None (released).
    locked_node is the deepest trie node this sequence keeps from eviction;
    `anchored` says that node spells exactly tokens[:locked_node.end], so
    `free` can insert from there without comparing that prefix again.
    The first `num_borrowed` pages (full pages, all inside the locked path,
    at most `locked_node.end // block_size`) are *borrowed*: a locked trie
    node holds each of them and locked nodes are never evicted, so the
    sequence takes no reference of its own. It owns a reference to every
    other page in its table (from index max(num_released, num_borrowed)).
    While `swapped`, block_table and slot name host pages and a host slot.
    `packed` is `tokens[:len(packed) // 8]` packed as the trie stores them
    (the prompt's, from `allocate`), so caching them packs nothing again.
    `speculation` is the open speculation transaction, if any.
    `recompute_from` is set after a commit restored a recurrent checkpoint:
    the tokens from that position on are computed again, so the sliding
    window keeps the pages that position attends to (see `append`).
    `more_tables` / `more_released`: the page tables (and released counts)
    of the manager's further page groups (`blockmgr.page_group`), one per
    group, as `block_table` / `num_released`; None without such groups.
    """

    seq_id: Hashable
    namespace: Hashable
    tokens: list[int]
    block_table: list[int | None]
    slot: int | None = None
    locked_node: TrieNode | None = None
    num_released: int = 0
    swapped: bool = False
    anchored: bool = False
    num_borrowed: int = 0
    packed: bytes = b""
    speculation: Speculation | None = None
    recompute_from: int | None = None
    more_tables: list[list[int | None]] | None = None
    more_released: list[int] | None = None

    @property
    def first_owned(self) -> int:
        """Index of the first page the sequence holds a reference to."""
        return max(self.num_released, self.num_borrowed)


@dataclass(slots=True)
class Allocation:
    """What `BlockManager.allocate` did.

    block_table: pages for every prompt token (a copy; the manager's own
        table changes as the sequence grows).
    slot: the sequence's recurrent slot (None for attention-only models).
    ops: the memory-op plan to apply before the next forward pass.
    num_cached_tokens: tokens already computed (reused from the prefix trie);
        always at most len(tokens) - 1, so there is a token to compute.
    branch_point: hybrid models only: where the prompt leaves the cached
        prefix when no recurrent snapshot exists there. End a prefill chunk at
        this position and `cache_prefix` it, and the next prompt sharing the
        prefix hits it. None when there is nothing to gain.
    """

    seq_id: Hashable
    block_table: list[int]
    slot: int | None
    ops: tuple[MemoryOp, ...]
    num_cached_tokens: int
    branch_point: int | None = None


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """What one decode step of many sequences (`BlockManager.append_decode`)
    needs beyond a slot in each row's own last page.

    growing: indices of the rows that take the full append path (a new
    page, a copy, a window release, a slot); num_pages / num_slots: the
    pages (new and copies) and slot copies those rows take at most;
    more_pages: the pages of each further page group they take at most
    (None: the manager keeps one group).
    """

    growing: set[int]
    num_pages: int
    num_slots: int
    more_pages: list[int] | None = None
