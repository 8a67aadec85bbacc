"""The prefix trie's records and the token comparisons a match runs.

`TrieNode` (one edge: a token run, its pages per page group, a snapshot),
`PrefixMatch` (what a lookup found), the listener a cache-aware router
plugs in (`PrefixCacheListener`, `PrefixEvent`), and the packed-token
helpers: token ids as unsigned 64-bit words compared with memcmp
(`pack_tokens`, `common_packed_prefix_length`) or as lists at C speed
(`common_prefix_length`). The trie's rules are `blockmgr.prefix_trie`'s
(and `blockmgr.tiered_trie`'s); the manager, sequences and checks read
these records.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

from blockmgr.errors import IntegrityError
from blockmgr.validation import as_words


class PrefixCacheListener(Protocol):
    """Follows what the trie caches (for a cache-aware router).

    Called after the block manager call that stored or evicted the entries
    has finished, in event order, never in the middle of a change: a
    listener may read the manager. An exception a listener raises is caught
    and kept (`BlockManager.take_listener_errors()`); it cannot undo or
    corrupt the change it was told about.
    """

    def stored(self, pages: list[int], tokens: list[int]) -> None: ...

    def removed(self, pages: list[int]) -> None: ...


@dataclass(slots=True, eq=False)
class TrieNode:
    """One edge of the trie: a token run and the pages (and slot) holding it.

    `pages[g]` lists page group g's pages of the node's page indices
    (`start // block_size` on); None is a page no hit needs (sliding window
    only; holes come first). `end` is `start + len(tokens)`, stored: a split
    keeps the lower part, a merge the child, and with it the end; only
    `extend` moves it, on a leaf that one sequence alone locks (its own
    cached tokens). `tier` says where its pages and slot live (`Tier`: the
    device unless a tiered trie demoted it; a child is never in a warmer
    tier than its parent); `num_hot_children` counts the children in the
    node's own tier (a node with none is its tier's eviction frontier).
    `checkpoint`: the snapshot at its end (never set without one) was taken
    by a sequence that went on past it (`insert(..., checkpoint=True)`: a
    prefill chunk end) and no insert has ended there since; under slot
    pressure it is dropped before the other snapshots of its retention
    priority (`_slot_key`).
    """

    node_id: int
    namespace: Hashable
    tokens: list[int]
    start: int
    end: int
    parent: TrieNode | None
    pages: list[list[int | None]]
    children: dict[int, TrieNode] = field(default_factory=dict)
    slot: int | None = None
    lock_count: int = 0
    last_access: int = 0
    retention: int = 0  # the retention priority of the last call that used it
    leaf_key: tuple[int, int, int] | None = None  # in its tier's frontier LRU list
    slot_key: tuple[int, int, int, int] | None = None  # in the slot LRU list
    packed: bytes = b""  # `tokens` as unsigned 64-bit ints: compared with memcmp
    tier: int = 0
    num_hot_children: int = 0
    checkpoint: bool = False

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.tokens


@dataclass(slots=True)
class PrefixMatch:
    """The usable part of a prompt found in the trie (read-only result).

    num_tokens: tokens whose KV (and, in hybrid mode, recurrent state) can be
        reused; never more than the `limit` asked for.
    pages: per page group, the pages holding them, one per page index
        `0 .. ceil(n/bs) - 1` (empty lists when `num_tokens` is 0).
    node: the deepest node wholly inside the usable prefix (to lock), or
        None. A hit may end inside a further node: its pages are shared but
        it stays unlocked, so the part past the hit can still be evicted
        (the sequence's own page references keep what it uses alive).
    slot: in hybrid mode, the snapshot slot at `num_tokens`.
    branch_point: in hybrid mode, where the prompt leaves the trie when that
        is beyond `num_tokens` (a checkpoint there makes siblings hit).
    path: the nodes used, root side first (to touch for LRU).
    num_locked_pages: the first pages, up to `node.end // block_size`, lie
        wholly inside the path to `node`: a node of that path holds each of
        them, so locking `node` keeps them alive without another reference.
    released: per page group, the first pages the hit does not need (sliding
        window only; they are `None` in `pages`): the new sequence starts
        with them released.
    loads: nodes of the hit in a colder tier than the device (a tiered
        trie's): `pages` name no device pages until `TieredTrie.load` brought
        them back and the match is made again.
    """

    num_tokens: int = 0
    pages: list[list[int | None]] = field(default_factory=list)
    node: TrieNode | None = None
    slot: int | None = None
    branch_point: int | None = None
    path: list[TrieNode] = field(default_factory=list)
    num_locked_pages: int = 0
    released: Sequence[int] = ()
    loads: Sequence[TrieNode] = ()


#: A page group's pages of a node or a path, one per page index; None: a
#: page no hit needs (sliding window only, before the held ones).
PageList = list[int | None]
#: A listener call not delivered yet: (method name, pages, tokens or None).
PrefixEvent = tuple[str, list[int], "list[int] | None"]

#: Bytes per token in `TrieNode.packed` and in a packed query.
TOKEN_BYTES = 8


def pack_tokens(tokens: list[int]) -> bytes:
    """A list of token ids (ints in [0, 2**64)) as unsigned 64-bit machine words."""
    return as_words(tokens).tobytes()


def common_packed_prefix_length(edge: bytes, packed: bytes, pos: int) -> int:
    """`common_prefix_length` over packed tokens: how many tokens of `edge`
    equal those of `packed` from token `pos` on. O(L) bytes compared by
    memcmp plus O(log L) slices."""
    start = pos * TOKEN_BYTES
    rest = len(packed) - start  # the shorter of the two, without a min() call (per edge)
    limit = (len(edge) if len(edge) < rest else rest) // TOKEN_BYTES
    lo, hi = 0, limit  # edge[:lo] matches; edge[:hi + 1] does not (or hi == limit)
    if edge[: limit * TOKEN_BYTES] == packed[start : start + limit * TOKEN_BYTES]:
        return limit
    hi = limit - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        a, b = lo * TOKEN_BYTES, mid * TOKEN_BYTES
        if edge[a:b] == packed[start + a : start + b]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def packed_run(tokens: list[int], packed: bytes, pos: int, end: int | None = None) -> bytes:
    """`pack_tokens(tokens[pos:end])`, from `packed` (the first
    `len(packed) // 8` tokens, packed) as far as it reaches."""
    if end is None:
        end = len(tokens)
    num_packed = len(packed) // TOKEN_BYTES
    if num_packed >= end:
        return packed[pos * TOKEN_BYTES : end * TOKEN_BYTES]
    if num_packed <= pos:
        return pack_tokens(tokens[pos:end])
    return packed[pos * TOKEN_BYTES :] + pack_tokens(tokens[num_packed:end])


def common_prefix_length(edge: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of `edge` and `tokens[pos:]`.

    O(L) element compares at C speed plus O(log L) slices: a bisection over
    slice equality instead of a per-token Python loop.
    """
    limit = len(tokens) - pos  # the shorter of the two, without a min() call (per edge)
    if len(edge) < limit:
        limit = len(edge)
    head = edge if limit == len(edge) else edge[:limit]
    if head == tokens[pos : pos + limit]:
        return limit
    lo, hi = 0, limit - 1  # edge[:lo] matches; edge[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[lo:mid] == tokens[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def path_tokens(node: TrieNode) -> list[int]:
    """The tokens the path from the root to `node` spells. O(end)."""
    runs = []
    while node.parent is not None:
        runs.append(node.tokens)
        node = node.parent
    return list(chain.from_iterable(reversed(runs)))  # flattened at C speed


def parent_of(node: TrieNode) -> TrieNode:
    """The parent of a node below a root (every node but the roots has one)."""
    parent = node.parent
    if parent is None:
        raise IntegrityError(f"{node_where(node)} is a root or left the trie")
    return parent


def present_pages(pages: Sequence[int | None]) -> list[int]:
    """The pages of a windowed group's list that are held (not holes)."""
    return [page for page in pages if page is not None]


def node_where(node: TrieNode) -> str:
    """How an integrity error names `node` (built only for the error)."""
    return f"node {node.node_id} [{node.start}, {node.end})"
