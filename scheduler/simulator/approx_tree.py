"""`ApproxPrefixTree`: what a cache-aware router remembers of where it sent
each prompt, as SMG's token tree does (`kv_index::TokenTree`).

One tree of pages (`page_size` tokens, SMG's 16) over every replica: a
node is one page of a prompt after the pages of its path, and holds the
replicas ("tenants") that were sent a prompt with that path, each with the
time it was last sent one. A replica at a node is at every node above it.
Only whole pages are remembered, as in SMG. The tree knows nothing of what
a replica really kept: it is the router's guess, trimmed per replica to
`max_pages` pages, least recently used first (SMG's `evict_tenant_by_size`,
which SMG runs every `eviction_interval_secs`).

Costs: `match` and `insert` O(pages of the prompt); `evict` O(nodes).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from blockmgr.validation import check_int


@dataclass(slots=True, eq=False)
class _Node:
    parent: _Node | None
    key: tuple[int, ...] | None  # the page's tokens (None: the root)
    depth: int  # pages from the root
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    tenants: dict[int, float] = field(default_factory=dict)  # replica -> last sent


@dataclass(frozen=True, slots=True)
class TreeMatch:
    """The longest remembered prefix of a prompt: its tokens (whole pages)
    and the replicas it was sent to (SMG's `matched_tenants`: every tenant
    of the deepest matched node), in index order; empty when nothing
    matched."""

    num_tokens: int
    replicas: tuple[int, ...]


class ApproxPrefixTree:
    """Prompts sent to replicas, per namespace (a tenant's prefixes match
    only its own). Not thread-safe; pure Python."""

    def __init__(self, page_size: int = 16) -> None:
        check_int("page_size", page_size, 1, strict=True)
        self.page_size = page_size
        self._roots: dict[Hashable, _Node] = {}
        self._num_pages: dict[int, int] = {}  # replica -> nodes it is at

    def num_pages(self, replica: int) -> int:
        """Pages remembered for `replica`. O(1)."""
        return self._num_pages.get(replica, 0)

    def _pages(self, tokens: Sequence[int]):
        size = self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            yield tuple(tokens[start:start + size])

    def match(self, tokens: Sequence[int], namespace: Hashable = None) -> TreeMatch:
        """The longest remembered whole-page prefix of `tokens` and the
        replicas at its last page. Pure. O(pages + replicas)."""
        node = self._roots.get(namespace)
        if node is None:
            return TreeMatch(0, ())
        for key in self._pages(tokens):
            child = node.children.get(key)
            if child is None:
                break
            node = child
        if node.key is None:
            return TreeMatch(0, ())
        return TreeMatch(node.depth * self.page_size, tuple(sorted(node.tenants)))

    def prefix_length(self, tokens: Sequence[int], replica: int,
                      namespace: Hashable = None) -> int:
        """The longest remembered whole-page prefix of `tokens` sent to
        `replica`. Pure. O(pages)."""
        node = self._roots.get(namespace)
        depth = 0
        if node is None:
            return 0
        for key in self._pages(tokens):
            child = node.children.get(key)
            if child is None or replica not in child.tenants:
                break
            node, depth = child, depth + 1
        return depth * self.page_size

    def insert(self, tokens: Sequence[int], replica: int, now: float,
               namespace: Hashable = None) -> None:
        """Remember that `tokens` (their whole pages) went to `replica` at
        `now`. O(pages)."""
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node(None, None, 0)
        added = 0
        for key in self._pages(tokens):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key, node.depth + 1)
            if replica not in child.tenants:
                added += 1
            child.tenants[replica] = now
            node = child
        if added:
            self._num_pages[replica] = self._num_pages.get(replica, 0) + added

    def evict(self, max_pages: int) -> None:
        """Trim every replica to at most `max_pages` pages: the least
        recently sent first, deepest first among equals (so a replica stays
        at every node above one it is at). O(nodes log nodes)."""
        over = {r for r, n in self._num_pages.items() if n > max_pages}
        if not over:
            return
        held: dict[int, list[_Node]] = {r: [] for r in over}
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for replica in over.intersection(node.tenants):
                held[replica].append(node)
        for replica, nodes in held.items():
            nodes.sort(key=lambda n: (n.tenants[replica], -n.depth))
            for node in nodes[:len(nodes) - max_pages]:
                del node.tenants[replica]
                self._prune(node)
            self._num_pages[replica] = min(len(nodes), max_pages)

    @staticmethod
    def _prune(node: _Node) -> None:
        """Drop `node` and its ancestors while they hold no replica (they
        have no children then: a child's replicas are its parent's)."""
        while node.key is not None and not node.tenants and not node.children:
            parent = node.parent
            assert parent is not None  # a page node always has one
            del parent.children[node.key]
            node = parent
