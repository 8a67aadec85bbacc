"""Records of the block manager: a sequence's progress, a live sequence,
the table of live sequences, and an allocation result."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol, cast

from blockmgr.errors import (
    DuplicateSequence,
    InvalidArgument,
    SequenceSwapped,
    SpeculationInFlight,
    UnknownSequence,
)
from blockmgr.ops import MemoryOp
from blockmgr.trie_node import PageList, TrieNode


class Progress(Protocol):
    """How many of a live sequence's tokens are computed: the one record of
    that count (design/ARCHITECTURE.md, "A sequence's computed count").

    A token is computed once the forward that writes its K/V (and
    recurrent state) finished. The store hands its record of a sequence out
    (`Allocation.progress`, `BlockManager.progress`: the live `Sequence`
    itself, of which this is all a caller may touch); whoever learns that
    tokens were computed sets `num_computed`, to the absolute count: the
    store at the calls that say so (an `append` takes every token before
    it as computed, unless a restored checkpoint holds the count back),
    `cache.PagedCache` when a forward finishes, a scheduler when a step's
    results come in. Everything else reads it: where a chunk starts, a
    view's offset, what a sliding window keeps. The store checks it at its
    calls (within the tokens).
    """

    num_computed: int


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
    """A live sequence: its tokens, the pages holding them in every page
    group, its slot.

    `tables[g][j]` is the page of group g holding token positions
    `[j * block_size, (j + 1) * block_size)`; every group's table has
    `ceil(len(tokens) / block_size)` entries, the first `released[g]` of
    them None (released by that group's sliding window).
    `locked_node` is the deepest trie node this sequence keeps from
    eviction; `anchored` says that node spells exactly
    `tokens[:locked_node.end]`, so `free` can insert from there without
    comparing that prefix again. The first `num_borrowed` pages of every
    group (full pages, all inside the locked path, at most
    `locked_node.end // block_size`) are *borrowed*: a locked trie node
    holds each of them and locked nodes are never evicted, so the sequence
    takes no reference of its own. It owns a reference to every other page
    of its tables (from index `first_owned(g)`).
    While `swapped`, the tables and slot name host pages and a host slot.
    `packed` is `tokens[:len(packed) // 8]` packed as the trie stores them
    (the prompt's, from `allocate`), so caching them packs nothing again.
    `speculation` is the open speculation transaction, if any.
    `retention` is its retention priority: the cached prefixes it hits and
    caches take it (a lower one is evicted first, see `PrefixTrie`).
    `num_computed` counts its computed tokens (the sequence is its own
    `Progress` record, handed out as such). `recompute_hold`:
    a restored recurrent checkpoint (or a count given to `append`) put
    that count below the tokens, which are computed again from there: the
    sliding windows keep the pages it attends to, and an `append` without
    a count leaves it (see `append`).
    `branch_point` is its allocation's (`Allocation.branch_point`): a
    snapshot there is one a sibling hits, not a mere checkpoint (see
    `BlockManager.cache_prefix`). `forked`: it forked or was forked (a
    prompt and its samples, n > 1): what it leaves at its end is a
    checkpoint too (`BlockManager.free`).
    """

    seq_id: Hashable
    namespace: Hashable
    tokens: list[int]
    tables: list[PageList]
    released: list[int]
    slot: int | None = None
    locked_node: TrieNode | None = None
    swapped: bool = False
    anchored: bool = False
    num_borrowed: int = 0
    packed: bytes = b""
    speculation: Speculation | None = None
    num_computed: int = 0
    recompute_hold: bool = False
    retention: int = 0
    branch_point: int | None = None
    forked: bool = False

    def first_owned(self, index: int) -> int:
        """Index of the first page of group `index` the sequence holds a
        reference to. O(1), without a max() call: this runs per request."""
        first = self.released[index]
        return first if first > self.num_borrowed else self.num_borrowed


def held(pages: PageList) -> list[int]:
    """Entries of a page table from its first held index on (past the pages
    a window released): pages, never None; the same list, typed so."""
    return cast("list[int]", pages)


def held_page(page: int | None) -> int:
    """An entry of a page table past the released ones: a page, never None."""
    return cast(int, page)


class SequenceTable(dict[Hashable, "Sequence"]):
    """The live sequences of a manager by id (a `dict`: lookups at C speed),
    with the lookups that raise the manager's typed errors. The manager and
    its helpers (`blockmgr.speculation`, `blockmgr.swap`) share one."""

    def live(self, seq_id: Hashable) -> Sequence:
        """The live sequence; `UnknownSequence` otherwise. O(1)."""
        try:
            seq: Sequence = self[seq_id]
            return seq
        except (KeyError, TypeError):
            raise UnknownSequence(f"no live sequence {seq_id!r}") from None

    def resident(self, seq_id: Hashable) -> Sequence:
        """The live sequence, which must not be swapped out."""
        try:
            seq: Sequence = self[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"no live sequence {seq_id!r}") from None
        if seq.swapped:
            raise SequenceSwapped(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def idle(self, seq_id: Hashable) -> Sequence:
        """The resident sequence, which must have no speculation open."""
        seq = self.resident(seq_id)
        if seq.speculation is not None:
            raise SpeculationInFlight(
                f"sequence {seq_id!r} has a speculation open; commit or abort it first"
            )
        return seq

    def swapped_out(self, seq_id: Hashable) -> Sequence:
        """The live sequence, which must be swapped out."""
        seq = self.live(seq_id)
        if not seq.swapped:
            raise InvalidArgument(f"sequence {seq_id!r} is not swapped out")
        return seq

    def check_new_id(self, seq_id: Hashable) -> None:
        """Raise unless `seq_id` is hashable and not live."""
        try:
            exists = seq_id in self
        except TypeError:
            raise InvalidArgument(f"sequence id must be hashable, got {seq_id!r}") from None
        if exists:
            raise DuplicateSequence(f"sequence {seq_id!r} is already live")


@dataclass(slots=True)
class Allocation:
    """What `BlockManager.allocate` did.

    block_table: pages for every prompt token in the first page group (a
        copy; the manager's own table changes as the sequence grows).
    slot: the sequence's recurrent slot (None for attention-only models).
    ops: the memory-op plan to apply before the next forward pass.
    num_cached_tokens: tokens already computed (reused from the prefix trie);
        always at most len(tokens) - 1, so there is a token to compute.
    progress: the sequence's computed count (`Progress`, the live
        sequence's record), starting at `num_cached_tokens`: the one record a
        caller reads and sets.
    branch_point: where the prompt leaves the cached prefix when the hit
        stops before it (hybrid: no recurrent snapshot there; sliding
        window: the window's pages missing). End a prefill chunk at this
        position and `cache_prefix` it, and the next prompt sharing the
        prefix hits it. None when there is nothing to gain.
    cached_tokens_by_tier: the hit's tokens by the tier (`Tier`: device,
        host, disk) they were in before this allocation loaded them; None
        when the store has no colder tiers.
    """

    seq_id: Hashable
    block_table: PageList
    slot: int | None
    ops: tuple[MemoryOp, ...]
    num_cached_tokens: int
    progress: Progress
    branch_point: int | None = None
    cached_tokens_by_tier: tuple[int, int, int] | None = None
