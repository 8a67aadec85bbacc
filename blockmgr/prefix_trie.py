"""Token-level radix trie of cached prefixes: pages plus recurrent snapshots.

Every node stands for the token run `tokens` at absolute positions
`[start, end)` of the prefix spelled by its path from a namespace root. For
every page group of the manager (a model's layer groups: full attention,
each sliding window) it holds one reference to each page that stores any of
those positions, so a page that straddles a node boundary is held by both
sides:

    block_size = 4          parent: tokens [0, 6)      child: tokens [6, 11)
    positions   0 1 2 3 | 4 5 6 7 | 8 9 10
    parent.pages[g] = [p0,  p1]         (indices 0..1)
    child.pages[g]  =      [q1,  q2]    (indices 1..2; q1 may be p1 itself)

Invariant (valid data): a node's page at index j holds correct KV for every
path position in page j below the node's end. A deeper node's page is
therefore the one to use for a straddled index.

In a group with a sliding window W a node keeps only the pages a hit can
use: an insert ending at L keeps the pages of the W tokens before L (a hit
at p needs the keys in [p - W + 1, p)); the others are `None` in that
group's list. A hit at p is served when every page of each window before p
is present along the path (see `design/prefix_trie.md`). A trie with such
a group splits a node where an insert ends (a new hit point) and never
merges nodes.

In hybrid mode (recurrent slots) a node may also hold a slot with the
recurrent state exactly at its end. A node without one is a *tombstone*: its
pages can be shared, but no match may end there. No leaf is a tombstone.

Nodes in use by live sequences are *locked* along their path (reference
counts); only unlocked leaves are evicted, least recently used first, and
under slot pressure unlocked nodes drop their snapshot. A non-root node with
no snapshot and a single child whose lock count equals its own is merged into
that child, so the trie stays compact.

The trie never allocates: it only takes and drops references on pages and
slots of the pools it was given. Costs: a match is linear in the matched
tokens (list slices compared at C speed) plus O(depth); LRU updates are
O(log n) per touched node (sortedcontainers).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import cast

from sortedcontainers import SortedList

from blockmgr.errors import IntegrityError, InvalidArgument
from blockmgr.pool import RefCountedPool
from blockmgr.trie_node import (
    TOKEN_BYTES,
    PageList,
    PrefixCacheListener,
    PrefixEvent,
    PrefixMatch,
    TrieNode,
    common_packed_prefix_length,
    common_prefix_length,
    node_where,
    pack_tokens,
    packed_run,
    parent_of,
    present_pages,
)


@dataclass(slots=True, eq=False)
class TriePageGroup:
    """One page group of the trie in one tier: its pool, window and
    reference counts.

    trie_refs[page]: how many nodes hold `page`; num_pages_held: pages with
    one or more; num_evicted_pages: pages an eviction freed.
    """

    pool: RefCountedPool
    window: int | None
    trie_refs: list[int]
    num_pages_held: int = 0
    num_evicted_pages: int = 0


class PrefixTrie:
    """The prefix cache of one `BlockManager` (see the module docstring).

    `groups` ((pool, window) per page group) are the manager's page groups:
    each node holds one page list per group (`TrieNode.pages`), a hit must
    be servable in every group (the window pages of each sliding group
    present), and evicting a node drops the pages of every group
    (`design/grouped_store.md`). The listener follows group 0's pages.
    """

    def __init__(
        self,
        block_size: int,
        groups: Sequence[tuple[RefCountedPool, int | None]],
        slots: RefCountedPool | None,
        listener: PrefixCacheListener | None = None,
    ) -> None:
        """`groups`: (page pool, sliding window or None) of each page group."""
        if not groups:
            raise InvalidArgument("a prefix trie needs at least one page group")
        self._block_size = block_size
        self._groups = tuple(
            TriePageGroup(pool, window, [0] * pool.num_items) for pool, window in groups
        )
        #: The window of each group that has one, by index: where a hit needs
        #: its window's pages.
        self._windows: dict[int, int] = {
            g: group.window for g, group in enumerate(self._groups) if group.window is not None
        }
        self._windowed_groups = tuple(self._windows)
        # A node end is a hit point whose window pages must stay: split at
        # every insert end, never merge (see `_try_merge`).
        self._windowed = bool(self._windowed_groups)
        #: `PrefixMatch.released` of a hit with no window anywhere (shared, never mutated).
        self._no_release = (0,) * len(self._groups)
        self._group_indexes = range(len(self._groups))
        self._slots = slots
        self._hybrid = slots is not None
        self._listener = listener
        #: Listener calls not delivered yet: (method name, pages, tokens or None).
        self.events: list[PrefixEvent] = []
        self._roots: dict[Hashable, TrieNode] = {}
        self._nodes: dict[int, TrieNode] = {}
        self._next_node_id = 0
        self._clock = 0
        # Unlocked non-root leaves, and unlocked nodes holding a slot, by LRU.
        self._leaf_lru: SortedList = SortedList()
        self._slot_lru: SortedList = SortedList()
        #: Per tier: the page groups' records, the slot pool and the frontier
        #: LRU list (a tiered trie adds the colder tiers).
        self._tier_groups: list[tuple[TriePageGroup, ...]] = [self._groups]
        self._tier_slots: list[RefCountedPool | None] = [slots]
        self._frontiers: list[SortedList] = [self._leaf_lru]
        self._merges_deferred = 0
        self._deferred_merges: list[TrieNode] = []
        self.num_slots_held = 0
        self.num_evicted_nodes = 0
        #: Grows at every insert, eviction and dropped snapshot: unchanged,
        #: no hit changed (a router's view need not be recomputed).
        self.version = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def num_pages_held(self, group: int) -> int:
        """Distinct pages of page group `group` the nodes hold. O(1)."""
        return self._groups[group].num_pages_held

    def num_evicted_pages(self, group: int) -> int:
        """Pages of page group `group` evictions freed so far. O(1)."""
        return self._groups[group].num_evicted_pages

    def match(
        self, namespace: Hashable, tokens: list[int], limit: int, packed: bytes | None = None
    ) -> PrefixMatch:
        """Find the longest usable cached prefix of `tokens`, at most `limit`.

        `packed`, the tokens as `pack_tokens` gives them, makes the edge
        compares byte compares (memcmp) instead of int-object compares.
        Pure: changes nothing. O(matched tokens + depth).
        """
        root = self._roots.get(namespace)
        if root is None or limit <= 0:
            return PrefixMatch()
        path, num_matched = self._walk(root, tokens, packed)
        if self._hybrid:
            return self._hybrid_match(path, num_matched, limit, len(tokens))
        num_usable = num_matched if num_matched < limit else limit
        branch_point = None
        if self._windowed:
            num_usable = self._windows_usable(path, num_usable)
            branch_point = num_matched if num_usable < num_matched < len(tokens) else None
        while path and path[-1].start >= num_usable:
            path.pop()
        return self._make_match(path, num_usable, None, branch_point)

    def _windows_usable(self, path: list[TrieNode], num_tokens: int) -> int:
        """The longest hit <= `num_tokens` every windowed group serves along
        `path` (each asked again with the shorter limit until all agree). Pure."""
        groups = self._windowed_groups
        if num_tokens == 0:
            return 0
        if path[-1].start < num_tokens:
            for group in groups:
                if not self._windowpresent_pages(path, num_tokens, group):
                    break
            else:
                return num_tokens  # the common case: every window is there
        num_agreeing, i = 0, 0
        while num_agreeing < len(groups):
            usable = self._window_usable(path, num_tokens, groups[i])
            if usable < num_tokens:
                num_tokens, num_agreeing = usable, 1
            else:
                num_agreeing += 1
            i = (i + 1) % len(groups)
        return num_tokens

    def _window_usable(self, path: list[TrieNode], num_tokens: int, group: int) -> int:
        """The longest hit <= `num_tokens` whose window pages of `group` are
        all present along `path`. Pure.

        A hit at p needs pages (p - W + 1) // bs .. (p - 1) // bs. When one is
        missing at index j, no hit past j * bs can be served: jump there
        (O(path pages) per jump). `num_tokens` itself is checked first in
        O(depth) (`_window_present`): the common case.
        """
        while path and path[-1].start >= num_tokens:
            path = path[:-1]
        if num_tokens == 0 or self._windowpresent_pages(path, num_tokens, group):
            return num_tokens
        block_size, window = self._block_size, self._windows[group]
        p = num_tokens
        while p > 0:
            while path and path[-1].start >= p:
                path = path[:-1]
            pages = self._pages_along(path, group)
            first = max(0, p - window + 1) // block_size
            last = (p - 1) // block_size
            hole = _last_none(pages, first, last)
            if hole is None:
                return p
            p = hole * block_size
        return 0

    def _windowpresent_pages(self, path: list[TrieNode], p: int, group: int) -> bool:
        """Are the pages of the window before `p` all present along `path`
        (whose last node holds position p - 1)? O(depth).

        Page index j is served by the deepest node covering it; a node's
        holes come first in its pages, so it serves a hole in the window
        exactly when its first index there is one.
        """
        block_size = self._block_size
        first = max(0, p - self._windows[group] + 1) // block_size
        end = (p - 1) // block_size + 1  # indices below `end` are still unchecked
        for node in reversed(path):
            first_index = node.start // block_size
            low = max(first, first_index)
            pages = node.pages[group]
            if low < end and pages[low - first_index] is None:
                return False
            if first_index <= first:
                return True
            end = first_index  # the deeper node served the straddled index
        return end <= first  # an empty path serves nothing

    def cached_paths(self) -> list[tuple[Hashable, list[int]]]:
        """`(namespace, tokens)` of the path to every leaf: every cached
        prefix is a prefix of one of them. Pure; O(sum of the paths' lengths)."""
        paths = []
        for namespace, root in self._roots.items():
            stack: list[tuple[TrieNode, list[int]]] = [
                (child, []) for child in root.children.values()
            ]
            while stack:
                node, above = stack.pop()
                tokens = above + node.tokens
                if node.children:
                    stack.extend((child, tokens) for child in node.children.values())
                else:
                    paths.append((namespace, tokens))
        return paths

    def cached_tier_paths(self) -> list[tuple[Hashable, list[int], list[tuple[int, int]]]]:
        """`cached_paths()` with, for each path, where its tiers begin: a
        list of `(start, tier)` runs, warmest first (the device's at 0; a
        tier's run lasts until the next start). Pure; O(sum of the paths'
        lengths)."""
        paths = []
        for namespace, root in self._roots.items():
            stack: list[tuple[TrieNode, list[int], list[tuple[int, int]]]] = [
                (child, [], []) for child in root.children.values()
            ]
            while stack:
                node, above, runs = stack.pop()
                tokens = above + node.tokens
                if not runs or runs[-1][1] != node.tier:
                    runs = [*runs, (node.start, int(node.tier))]
                if node.children:
                    stack.extend((child, tokens, runs) for child in node.children.values())
                else:
                    paths.append((namespace, tokens, runs))
        return paths

    def find_snapshot(self, namespace: Hashable, tokens: list[int]) -> TrieNode | None:
        """The node ending exactly at `len(tokens)` on this path, if it holds a slot."""
        root = self._roots.get(namespace)
        if root is None or not tokens:
            return None
        path, num_matched = self._walk(root, tokens)
        if num_matched != len(tokens) or not path:
            return None
        node = path[-1]
        if node.end != num_matched or node.slot is None or node.tier:
            return None
        return node

    def _walk(
        self, root: TrieNode, tokens: list[int], packed: bytes | None = None
    ) -> tuple[list[TrieNode], int]:
        """Nodes along `tokens` (the last may match partly) and tokens matched."""
        path: list[TrieNode] = []
        node, pos, num_tokens = root, 0, len(tokens)
        while pos < num_tokens:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            path.append(child)
            if packed is not None:
                packed_edge = child.packed
                start = pos * TOKEN_BYTES
                if packed[start : start + len(packed_edge)] == packed_edge:
                    pos += len(child.tokens)
                    node = child
                    continue
                pos += common_packed_prefix_length(packed_edge, packed, pos)
                break
            edge = child.tokens
            if tokens[pos : pos + len(edge)] == edge:
                pos += len(edge)
                node = child
                continue
            pos += common_prefix_length(edge, tokens, pos)
            break
        return path, pos

    def _hybrid_match(
        self, path: list[TrieNode], num_matched: int, limit: int, num_tokens: int
    ) -> PrefixMatch:
        reach = num_matched if num_matched < limit else limit
        snapshot_depth = None
        for depth, node in enumerate(path):
            if node.end > reach:
                break
            if node.slot is not None:
                snapshot_depth = depth
        while self._windowed and snapshot_depth is not None:
            end = path[snapshot_depth].end
            if self._windows_usable(path[: snapshot_depth + 1], end) == end:
                break
            snapshot_depth = self._shallower_snapshot(path, snapshot_depth)
        num_usable = 0 if snapshot_depth is None else path[snapshot_depth].end
        branch_point = num_matched if num_usable < num_matched < num_tokens else None
        if snapshot_depth is None:
            return PrefixMatch(branch_point=branch_point)
        del path[snapshot_depth + 1 :]
        return self._make_match(path, num_usable, path[-1].slot, branch_point)

    @staticmethod
    def _shallower_snapshot(path: list[TrieNode], depth: int) -> int | None:
        """The depth of the next node above `depth` holding a slot, if any."""
        for shallower in range(depth - 1, -1, -1):
            if path[shallower].slot is not None:
                return shallower
        return None

    def _make_match(
        self, path: list[TrieNode], num_tokens: int, slot: int | None, branch_point: int | None
    ) -> PrefixMatch:
        """The match of the first `num_tokens` tokens along `path`: every
        group's pages (a windowed group's before its window released)."""
        if num_tokens == 0:
            return PrefixMatch(branch_point=branch_point)
        block_size = self._block_size
        num_pages = -(-num_tokens // block_size)
        # Only the last node of the path can end past the hit.
        lock: TrieNode | None = path[-1]
        if path[-1].end > num_tokens:
            lock = path[-2] if len(path) > 1 else None
        num_locked_pages = lock.end // block_size if lock is not None else 0
        pages = []
        for group in self._group_indexes:
            group_pages = self._pages_along(path, group)
            del group_pages[num_pages:]
            pages.append(group_pages)
        released: Sequence[int] = self._no_release
        if self._windowed:
            released = [
                0 if record.window is None
                else self._release_pages(group_pages, num_tokens, record.window)
                for record, group_pages in zip(self._groups, pages)
            ]
        return PrefixMatch(
            num_tokens, pages, lock, slot, branch_point, path, num_locked_pages, released
        )

    def _release_pages(self, pages: PageList, num_tokens: int, window: int) -> int:
        """Pages before the window of the token at `num_tokens` stay
        released: set them None in `pages`; return how many."""
        num_released = max(0, num_tokens - window + 1) // self._block_size
        pages[:num_released] = [None] * num_released
        return num_released

    def _pages_along(self, path: list[TrieNode], group: int) -> list[int | None]:
        """One page of `group` per index; at a straddled index the deeper
        node's page. O(path pages)."""
        pages: list[int | None] = []
        block_size = self._block_size
        for node in path:
            pages[node.start // block_size :] = node.pages[group]
        return pages

    # ------------------------------------------------------------ lock and LRU

    def lock(self, node: TrieNode) -> None:
        """Mark `node` and its ancestors in use. O(depth log n)."""
        while node.parent is not None:
            node.lock_count += 1
            if node.lock_count == 1:
                self._reindex(node)
            node = node.parent

    def unlock(self, node: TrieNode) -> None:
        """Undo one `lock(node)`; merges nodes the lock kept apart."""
        while node.parent is not None:
            parent = node.parent
            node.lock_count -= 1
            if node.lock_count == 0:
                self._reindex(node)
            self._try_merge(node)
            node = parent

    def touch(self, path: Sequence[TrieNode], retention: int = 0) -> None:
        """Mark the nodes of `path` most recently used, with the retention
        priority of the call that used them (see `_reindex`)."""
        self._clock += 1
        clock = self._clock
        for node in path:
            node.last_access = clock
            node.retention = retention
            if node.lock_count == 0:
                self._reindex(node)

    def _reindex(self, node: TrieNode) -> None:
        """Put `node` in the LRU lists it qualifies for, at its current age.

        A node's place in the LRU lists (its key) is `(retention,
        last_access, node_id)`: lowest retention priority first, then least
        recently used (eviction and demotion take the first). A node's
        priority is that of the last call that hit or cached it. The slot
        list's key also ranks checkpoints first within a priority
        (`_slot_key`)."""
        if node.lock_count and node.leaf_key is None and node.slot_key is None:
            return  # locked: in no list, and stays out
        unlocked = node.lock_count == 0 and node.parent is not None
        key = (node.retention, node.last_access, node.node_id)
        leaf_key = key if unlocked and not node.num_hot_children else None
        if leaf_key != node.leaf_key:
            frontier = self._frontiers[node.tier]
            if node.leaf_key is not None:
                frontier.remove(node.leaf_key)
            if leaf_key is not None:
                frontier.add(leaf_key)
            node.leaf_key = leaf_key
        # Slot pressure is the device's: its list holds device snapshots.
        slot_key = _slot_key(node) if unlocked and node.slot is not None and not node.tier else None
        if slot_key != node.slot_key:
            if node.slot_key is not None:
                self._slot_lru.remove(node.slot_key)
            if slot_key is not None:
                self._slot_lru.add(slot_key)
            node.slot_key = slot_key

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        namespace: Hashable,
        tokens: list[int],
        tables: Sequence[list[int | None]],
        slot: int | None = None,
        start: TrieNode | None = None,
        packed: bytes = b"",
        *,
        lock: bool = False,
        retention: int = 0,
        checkpoint: bool = False,
    ) -> tuple[TrieNode | None, bool]:
        """Cache `tokens`, whose KV is in `tables` (per page group, one page
        per page index). `retention`: the inserter's retention priority
        (every node of the path takes it, see `_reindex`). `checkpoint`:
        the inserting sequence goes on past `tokens` (a prefill chunk end):
        a snapshot taken here is a checkpoint (`TrieNode.checkpoint`),
        dropped first under slot pressure; an insert that is not one
        makes the snapshot at its end a checkpoint no more.

        The trie takes its own references to the pages it keeps (and to
        `slot`, the recurrent state at `len(tokens)`, unless a snapshot is
        already there); the caller keeps and later drops its own. Returns the
        deepest node wholly inside `tokens` (None if that is the root) and
        whether the slot was taken.
        `start`, a node known to spell `tokens[:start.end]`, skips comparing
        that part again; `packed`, the first `len(packed) // 8` tokens
        packed (`pack_tokens`), is sliced instead of packing those again.
        O(len(tokens) + depth).

        Sliding window: a windowed group keeps only the pages of the window
        before `len(tokens)` (`None` entries of its table, released pages,
        are skipped), and they also fill the holes of the nodes the insert
        walks through, so the new end is a hit point. `lock`: lock the
        node returned (as `lock(node)`, when it is not None) before the LRU
        update; the same state as locking it after, without moving a new leaf
        into the LRU list and out again.
        """
        self.version += 1
        windowed = self._windowed
        if start is not None:
            node, pos = start, start.end
            path = self._path_to(start)
        else:
            root = self._roots.get(namespace)
            if root is None:
                root = self._new_node(namespace, [], 0, None, [[] for _ in self._groups])
                self._roots[namespace] = root
            node, pos = root, 0
            path = []
        num_tokens = len(tokens)
        while pos < num_tokens:
            child = node.children.get(tokens[pos])
            if child is None:
                parent, node = node, self._add_child(node, tokens, pos, tables, packed)
                path.append(node)
                pos = num_tokens
                if len(parent.children) == 1:
                    # The new leaf may extend a snapshot-less leaf: fold them.
                    self._try_merge(parent)
                break
            num_common = common_prefix_length(child.tokens, tokens, pos)
            if num_common < len(child.tokens):
                if pos + num_common == num_tokens and slot is None and not windowed:
                    path.append(child)  # ends inside: nothing new to store
                    pos = num_tokens
                    break
                child = self._split(child, num_common)
            node = child
            if node.tier:  # covered by the insert: its pages are the inserter's now
                self._refresh(node, tables)
            path.append(node)
            pos += num_common
        if windowed:
            for group in self._windowed_groups:
                self._fill_holes(path, tables[group], num_tokens, group)
        took_slot = False
        if slot is not None and self._slots is not None and node.slot is None and (
            node.parent is not None
        ):
            self._slots.incref(slot)
            node.slot = slot
            node.checkpoint = checkpoint
            self.num_slots_held += 1
            took_slot = True
        elif node.checkpoint and not checkpoint and node.end == num_tokens:
            node.checkpoint = False  # a sequence ended here: no longer a mere chunk end
        result = node if node.parent is not None else None
        if lock and result is not None:
            self.lock(result)  # first: a locked new leaf never enters the LRU list
        self.touch(path, retention)
        return result, took_slot

    def can_extend(self, node: TrieNode, num_tokens: int, slot: int | None) -> bool:
        """Can `extend` store the first `num_tokens` tokens from `node` with
        recurrent state `slot`? True when `node` is a leaf locked once (by
        the caller), holds no snapshot, the insert adds tokens and takes no
        slot, and the trie merges nodes (no windowed group: then the trie
        has one page group, since groups have distinct windows). Pure; O(1)."""
        return (
            num_tokens > node.end
            and node.lock_count == 1
            and not node.children
            and node.slot is None
            and slot is None
            and not self._windowed
        )

    def extend(
        self, node: TrieNode, tokens: list[int], num_tokens: int,
        tables: Sequence[list[int | None]], packed: bytes = b"", *, lock: bool = False,
        retention: int = 0,
    ) -> TrieNode:
        """`insert(node.namespace, tokens[:num_tokens], tables, start=node)`
        followed by the caller's release of its lock on `node` or the move of
        that lock to the insert's end, when `can_extend` says so (`tokens`
        may run past `num_tokens`: only the tokens past `node.end` are read).

        The insert would add one leaf below `node` and the release would merge
        `node` into it; here `node` takes the tokens past its end, their pages
        and the leaf's node id at once (one node built and dropped less per
        cached sequence). The result, the LRU order and the events are the
        same; `node` stays locked until the caller's release. `lock` as in
        `insert`. O(num_tokens - node.end + depth) with no listener; with
        one, also O(node.end) to copy the node's tokens (the listener may
        keep the list it was given).
        """
        self.version += 1
        block_size = self._block_size
        pos = node.end
        (table,) = tables  # one page group, no window: no None entries
        added = table[pos // block_size : -(-num_tokens // block_size)]
        self._hold_pages(added, 0)  # before the drop below: the first may be the same page
        tail = tokens[pos:num_tokens]
        if self._listener is not None:
            self.events.append(("stored", _full(added)[:], tail))
        (pages,) = node.pages
        if pos % block_size:
            self._drop_pages(_full(pages[-1:]), 0)  # the sequence's page supersedes it
            node.pages = [pages[:-1] + added]
        else:
            node.pages = [pages + added]
        if self._listener is None:
            node.tokens += tail  # O(tail): nothing outside the trie holds the list
        else:
            node.tokens = node.tokens + tail  # a new list: a listener may hold the old one
        node.packed = node.packed + packed_run(tokens, packed, pos, num_tokens)
        node.end = num_tokens
        del self._nodes[node.node_id]
        node.node_id = self._next_node_id  # the merged leaf's id, as `insert` + merge give
        self._next_node_id += 1
        self._nodes[node.node_id] = node
        if lock:
            self.lock(node)
        self.touch(self._path_to(node), retention)
        return node

    def _kept_pages(
        self, table: list[int | None], first: int, end: int, num_tokens: int, window: int | None
    ) -> list[int | None]:
        """`table[first:end]`, with `None` for the pages outside the window
        before `num_tokens` (a hit there needs only those). O(end - first)."""
        pages = table[first:end]
        if window is not None:
            num_dropped = max(0, num_tokens - window + 1) // self._block_size - first
            if num_dropped > 0:
                pages[:num_dropped] = [None] * min(num_dropped, len(pages))
        return pages

    def _fill_holes(
        self, path: list[TrieNode], pages: list[int | None], num_tokens: int, group: int
    ) -> None:
        """Give the nodes of `path` (all ending at or before `num_tokens`, so
        the sequence's pages hold their positions) the pages of group
        `group`'s window before `num_tokens` they lack. O(window pages + depth)."""
        block_size = self._block_size
        first = max(0, num_tokens - self._windows[group] + 1) // block_size
        for node in reversed(path):
            if node.end <= first * block_size:
                return  # wholly before the window
            first_index = node.start // block_size
            held = node.pages[group]
            low = max(0, first - first_index)
            if low >= len(held) or held[low] is not None:
                continue  # no hole from `low` on (holes come first): the common case
            for i in range(low, len(held)):
                index = first_index + i
                if held[i] is None and index < len(pages) and pages[index] is not None:
                    held[i] = pages[index]
                    self._hold_pages([held[i]], group)

    def _add_child(
        self,
        parent: TrieNode,
        tokens: list[int],
        pos: int,
        tables: Sequence[list[int | None]],
        packed: bytes,
    ) -> TrieNode:
        """`tables`: the inserting sequence's pages, one table per group; a
        windowed group's node keeps those of the window before the end."""
        block_size = self._block_size
        num_tokens = len(tokens)
        first, end = pos // block_size, -(-num_tokens // block_size)
        pages = []
        groups = self._groups
        for group in self._group_indexes:
            window = groups[group].window
            if window is None:
                held = tables[group][first:end]
            else:
                held = self._kept_pages(tables[group], first, end, num_tokens, window)
            self._hold_pages(held, group)
            pages.append(held)
        child = self._new_node(
            parent.namespace, tokens[pos:], pos, parent, pages, packed_run(tokens, packed, pos)
        )
        parent.children[tokens[pos]] = child
        parent.num_hot_children += 1  # a new node is on the device, as its parent
        if parent.num_hot_children == 1:
            self._reindex(parent)  # it was its tier's frontier
        if self._listener is not None:
            self.events.append(("stored", present_pages(pages[0]), child.tokens))
        return child

    def _split(self, node: TrieNode, num_head_tokens: int) -> TrieNode:
        """Cut `node` after `num_head_tokens`; return the new head (the parent).

        The head gets the pages up to the cut (a straddled page is then held
        by both); `node` keeps the tail, its slot and its identity, so
        sequences locking it stay valid. The head is a tombstone.
        """
        block_size = self._block_size
        first_index = node.start // block_size
        cut = node.start + num_head_tokens
        head_end, tail_start = -(-cut // block_size) - first_index, cut // block_size - first_index
        head_pages = [pages[:head_end] for pages in node.pages]
        node.pages = [pages[tail_start:] for pages in node.pages]
        if cut % block_size:  # the straddled page: both sides hold it
            for group, pages in enumerate(node.pages):
                if pages[0] is not None:
                    self._hold_pages(pages[:1], group, node.tier)
        parent = parent_of(node)
        head = self._new_node(
            node.namespace, node.tokens[:num_head_tokens], node.start, parent, head_pages,
            node.packed[: num_head_tokens * TOKEN_BYTES],
        )
        head.lock_count = node.lock_count
        head.last_access = node.last_access
        head.retention = node.retention
        head.tier, head.num_hot_children = node.tier, 1
        parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[num_head_tokens:]
        node.packed = node.packed[num_head_tokens * TOKEN_BYTES :]
        node.start = cut
        node.parent = head
        head.children[node.tokens[0]] = node
        return head

    def defer_merges(self) -> None:
        """Keep every node where it is until `resume_merges` (a caller holding
        nodes across evictions: a tiered trie's loads). Nests."""
        self._merges_deferred += 1

    def resume_merges(self) -> None:
        """Undo one `defer_merges`; the last one makes the merges that came due."""
        self._merges_deferred -= 1
        if not self._merges_deferred:
            deferred, self._deferred_merges = self._deferred_merges, []
            for node in deferred:
                self._try_merge(node)

    @staticmethod
    def _path_to(node: TrieNode) -> list[TrieNode]:
        """The nodes from below the root down to `node`. O(depth)."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _try_merge(self, node: TrieNode | None) -> None:
        """Merge a non-snapshot node into its only child when locks agree.

        A sliding-window trie never merges: each node end is a hit point whose
        window pages the merged node could not keep. While merges are
        deferred (`defer_merges`) the node is kept for `resume_merges`.
        """
        if node is None or node.parent is None or node.slot is not None:
            return
        if self._windowed:
            return
        if self._merges_deferred:
            self._deferred_merges.append(node)
            return
        if len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.lock_count != node.lock_count or child.tier != node.tier:
            return
        # One page group, no window (a windowed trie never merges).
        (head_pages,), (child_pages,) = node.pages, child.pages
        if child.start % self._block_size:
            self._drop_pages(_full(head_pages[-1:]), 0, node.tier)  # the child's page supersedes it
            head_pages = head_pages[:-1]
        child.pages = [head_pages + child_pages]
        child.tokens = node.tokens + child.tokens
        child.packed = node.packed + child.packed
        child.start = node.start
        child.parent = node.parent
        child.last_access = max(child.last_access, node.last_access)
        child.retention = max(child.retention, node.retention)
        node.parent.children[child.tokens[0]] = child
        self._detach(node)
        self._reindex(child)

    # ---------------------------------------------------------------- eviction

    def can_free_pages(self, num_pages: int, group: int) -> bool:
        """Could evicting unlocked entries free `num_pages` pages of page
        group `group`? Pure.

        Walks unlocked leaves (and parents they expose) until enough pages
        would drop to refcount 0: O(nodes visited).
        """
        if num_pages <= 0:
            return True
        if self._leaf_lru and self._sole_pages(self._leaf_lru[0][-1], group) >= num_pages:
            return True  # the common case: the LRU leaf alone is enough
        pool = self._groups[group].pool
        num_freed = 0
        pending: dict[int, int] = {}
        children_left: dict[int, int] = {}
        exposed: list[TrieNode] = []
        leaves = iter(self._leaf_lru)
        while num_freed < num_pages:
            if exposed:
                node = exposed.pop()
            else:
                key = next(leaves, None)
                if key is None:
                    return False
                node = self._nodes[key[-1]]
            num_freed += pool.tally_release(self._group_pages(node, group), pending)
            parent = parent_of(node)
            if parent.parent is None or parent.lock_count:
                continue
            left = children_left.get(parent.node_id, parent.num_hot_children) - 1
            children_left[parent.node_id] = left
            if left == 0:
                exposed.append(parent)
        return True

    def _sole_pages(self, node_id: int, group: int) -> int:
        """Pages of a node (in page group `group`) that nothing else references."""
        return self._groups[group].pool.num_sole(self._group_pages(self._nodes[node_id], group))

    def _group_pages(self, node: TrieNode, group: int) -> list[int]:
        """The pages `node` holds in page group `group`."""
        pages = node.pages[group]
        if self._groups[group].window is None:
            return pages  # type: ignore[return-value]  # a full-attention group has no holes
        return present_pages(pages)

    def evict_pages(self, num_free_wanted: int, group: int) -> bool:
        """Evict LRU unlocked leaves (every group's pages of each) until the
        pool of page group `group` has `num_free_wanted` free; whether it has."""
        pages = self._groups[group].pool
        while pages.num_free < num_free_wanted and self._leaf_lru:
            self._evict(self._nodes[self._leaf_lru[0][-1]])
        return pages.num_free >= num_free_wanted

    def can_free_slots(self, num_slots: int, *, checkpoint_retention: int | None = None) -> bool:
        """Could dropping unlocked snapshots free `num_slots` slots? Pure.
        `checkpoint_retention`: asked for a checkpoint of that retention
        priority, which may take the slot of a snapshot ranked below an
        end-of-request snapshot of its own priority (a lower priority's, or
        a checkpoint of its own priority): would `evict_slots` drop only
        those on the way? O(snapshots walked).

        A snapshot a new sequence copies from is on its locked path, so it is
        never in the list walked here.
        """
        if num_slots <= 0:
            return True
        num_freed = 0
        refcount = self._slot_pool.refcount
        bound = None if checkpoint_retention is None else (checkpoint_retention, _KEPT)
        for key in self._slot_lru:
            if bound is not None and key[:2] >= bound:
                return False
            node = self._nodes[key[-1]]
            if refcount(_slot_of(node)) == 1:
                num_freed += 1
                if num_freed >= num_slots:
                    return True
        return False

    def evict_slots(self, num_free_wanted: int) -> bool:
        """Drop LRU unlocked snapshots until the slot pool has enough free;
        whether it has.

        An interior node becomes a tombstone and keeps its pages; a leaf is
        evicted whole (no leaf is a tombstone). Each round takes one node
        out of the slot list, so the loop ends.
        """
        slots = self._slot_pool
        while slots.num_free < num_free_wanted and self._slot_lru:
            node = self._nodes[self._slot_lru[0][-1]]
            if node.num_hot_children:
                self._drop_snapshot(node)
            else:
                self._evict(node)
        return slots.num_free >= num_free_wanted

    def reset(self) -> None:
        """Evict every unlocked entry."""
        while self._leaf_lru:
            self._evict(self._nodes[self._leaf_lru[0][-1]])

    def _drop_snapshot(self, node: TrieNode) -> None:
        self.version += 1
        slot = _slot_of(node)
        node.slot = None
        node.checkpoint = False
        self.num_slots_held -= 1
        self._slot_pool.release(slot)
        self._reindex(node)
        self._try_merge(node)

    def _evict(self, node: TrieNode) -> None:
        """Remove an unlocked leaf; cascade to a parent left a tombstone leaf."""
        self.version += 1
        while True:
            parent = self._remove_leaf(node)
            if parent.parent is None:
                if not parent.children:
                    del self._roots[parent.namespace]
                return
            self._reindex(parent)
            if (
                self._hybrid
                and not parent.children
                and parent.slot is None
                and parent.lock_count == 0
            ):
                node = parent  # a tombstone leaf is useless: evict it too
                continue
            self._try_merge(parent)
            return

    def _remove_leaf(self, node: TrieNode) -> TrieNode:
        """Take a leaf out of the trie, dropping its pages and slot (in its
        tier); its parent. O(pages)."""
        parent = parent_of(node)
        del parent.children[node.tokens[0]]
        if node.tier == parent.tier:
            parent.num_hot_children -= 1
        tier = node.tier
        records = self._tier_groups[tier]
        for group in self._group_indexes:
            records[group].num_evicted_pages += self._drop_pages(node.pages[group], group, tier)
        if node.slot is not None:
            self._tier_slot_pool(tier).release(node.slot)
            node.slot = None
            node.checkpoint = False
            if not tier:
                self.num_slots_held -= 1
        self.num_evicted_nodes += 1
        if self._listener is not None and not tier:
            self.events.append(("removed", self._group_pages(node, 0), None))
        self._detach(node)
        return parent

    def _refresh(self, node: TrieNode, tables: Sequence[PageList]) -> None:
        """Give a demoted node on an insert's path the inserter's device pages
        (a tiered trie's; a device-only trie has no demoted node)."""
        raise IntegrityError(f"{node_where(node)} is in tier {node.tier} of a device-only trie")

    def deliver_events(self) -> list[tuple[str, BaseException]]:
        """Call the listener for every queued event, oldest first; return the
        (event name, exception) of each call that raised. Call it once the
        manager's state is consistent. O(events)."""
        errors: list[tuple[str, BaseException]] = []
        events, listener = self.events, self._listener
        if listener is None:  # nothing is queued without one
            return errors
        num_delivered = 0
        try:
            for name, pages, tokens in events:
                num_delivered += 1
                try:
                    if tokens is None:
                        listener.removed(pages)
                    else:
                        listener.stored(pages, tokens)
                except Exception as exc:  # the change stands; the caller reports it
                    errors.append((name, exc))
        finally:  # a BaseException (KeyboardInterrupt) leaves the rest queued
            del events[:num_delivered]
        return errors

    # ------------------------------------------------------------- internals

    def _new_node(
        self,
        namespace: Hashable,
        tokens: list[int],
        start: int,
        parent: TrieNode | None,
        pages: list[list[int | None]],
        packed: bytes | None = None,
    ) -> TrieNode:
        node = TrieNode(
            self._next_node_id, namespace, tokens, start, start + len(tokens), parent, pages,
            packed=pack_tokens(tokens) if packed is None else packed,
        )
        self._next_node_id += 1
        if parent is not None:
            self._nodes[node.node_id] = node
        return node

    @property
    def _slot_pool(self) -> RefCountedPool:
        """The slot pool (a hybrid trie's; the slot paths run only there)."""
        return self._tier_slot_pool(0)

    def _tier_slot_pool(self, tier: int) -> RefCountedPool:
        """The slot pool of `tier` (a hybrid trie's; the slot paths run only there)."""
        pool = self._tier_slots[tier]
        if pool is None:
            raise IntegrityError(f"a trie without recurrent slots in tier {tier} was asked for one")
        return pool

    def _detach(self, node: TrieNode) -> None:
        node.parent = None
        node.children = {}
        self._reindex(node)
        del self._nodes[node.node_id]

    def _hold_pages(self, pages: PageList, group: int, tier: int = 0) -> None:
        """Take the trie's reference to each page (of page group `group` in
        `tier`; a windowed group's holes are skipped). O(len(pages))."""
        record = self._tier_groups[tier][group]
        # A full-attention group's pages have no holes (typed so without a call).
        held: list[int] = pages  # type: ignore[assignment]
        if record.window is not None:
            held = present_pages(pages)
        record.pool.incref_all(held)
        refs = record.trie_refs
        num_new = 0
        for page in held:
            refs[page] += 1
            if refs[page] == 1:
                num_new += 1
        record.num_pages_held += num_new

    def _drop_pages(self, pages: Sequence[int | None], group: int, tier: int = 0) -> int:
        """Drop the trie's reference to each page (of page group `group` in
        `tier`; a windowed group's holes are skipped, as `_hold_pages`
        does); return how many became free."""
        record = self._tier_groups[tier][group]
        held: list[int] = pages  # type: ignore[assignment]
        if record.window is not None:
            held = present_pages(pages)
        refs = record.trie_refs
        num_gone = 0
        for page in held:
            refs[page] -= 1
            if refs[page] == 0:
                num_gone += 1
        record.num_pages_held -= num_gone
        return record.pool.release_all(held)

    # --------------------------------------------------------------- checking

    def debug_state(self) -> tuple[object, ...]:
        """Every node and counter as plain values (see `BlockManager.debug_state`)."""
        nodes = tuple(
            (
                node.node_id,
                node.namespace,
                tuple(node.tokens),
                node.start,
                None if parent_of(node).is_root else parent_of(node).node_id,
                tuple(map(tuple, node.pages)),
                node.slot,
                node.lock_count,
                node.last_access,
                node.retention,
                node.leaf_key,
                node.slot_key,
                tuple(sorted(child.node_id for child in node.children.values())),
                node.tier,
                node.num_hot_children,
                node.checkpoint,
            )
            for node in sorted(self._nodes.values(), key=lambda n: n.node_id)
        )
        counters = (
            self._clock,
            self._next_node_id,
            self.num_slots_held,
            self.num_evicted_nodes,
            tuple(
                (g.num_pages_held, g.num_evicted_pages) for tier in self._tier_groups for g in tier
            ),
        )
        roots = tuple(
            (namespace, tuple(sorted(c.node_id for c in root.children.values())),
             root.num_hot_children)
            for namespace, root in self._roots.items()
        )
        refs = tuple(tuple(g.trie_refs) for tier in self._tier_groups for g in tier)
        return nodes, roots, counters, refs

    def add_references(self, page_refs: Sequence[list[int]], slot_refs: list[int] | None) -> None:
        """Add the trie's page references (`page_refs`: one counter list per
        page group) and slot references to the given counters. O(state)."""
        for node in self._nodes.values():
            if node.tier:
                continue  # a colder tier's pages: the trie alone holds them
            for group, refs in enumerate(page_refs):
                for page in self._group_pages(node, group):
                    refs[page] += 1
            if node.slot is not None and slot_refs is not None:
                slot_refs[node.slot] += 1

    def check_integrity(self, expected_locks: dict[int, int]) -> None:
        """Raise `IntegrityError` if a trie invariant is broken.

        `expected_locks` maps node id to the number of live sequences whose
        locked path contains that node.
        """
        seen: set[int] = set()
        held_refs = [[[0] * len(g.trie_refs) for g in tier] for tier in self._tier_groups]
        for namespace, root in self._roots.items():
            if root.parent is not None or root.tokens or any(root.pages) or root.slot is not None:
                raise IntegrityError(f"root of namespace {namespace!r} is not empty")
            if not root.children:
                raise IntegrityError(f"namespace {namespace!r} has an empty root")
            _check_children(root)
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self._check_node(node, namespace, expected_locks, held_refs)
                seen.add(node.node_id)
                stack.extend(node.children.values())
        if seen != set(self._nodes):
            raise IntegrityError("the node index and the trie disagree")
        for tier, (groups, tier_refs) in enumerate(zip(self._tier_groups, held_refs)):
            for g, (group, refs) in enumerate(zip(groups, tier_refs)):
                where = f"group {g}" if not tier else f"group {g} in tier {tier}"
                if refs != group.trie_refs:
                    raise IntegrityError(f"per-page trie reference counts of {where} are wrong")
                if group.num_pages_held != len(refs) - refs.count(0):
                    raise IntegrityError(f"num_pages_held of {where} is wrong")
        device_slots = sum(1 for n in self._nodes.values() if n.slot is not None and not n.tier)
        if self.num_slots_held != device_slots:
            raise IntegrityError("num_slots_held is wrong")
        slot_keys = sorted(n.slot_key for n in self._nodes.values() if n.slot_key)
        if slot_keys != list(self._slot_lru):
            raise IntegrityError("the slot LRU list and the nodes disagree")
        for tier, frontier in enumerate(self._frontiers):
            keys = sorted(n.leaf_key for n in self._nodes.values() if n.leaf_key and n.tier == tier)
            if keys != list(frontier):
                raise IntegrityError(f"the LRU list of tier {tier} and the nodes disagree")

    def _check_node(
        self,
        node: TrieNode,
        namespace: Hashable,
        expected_locks: dict[int, int],
        held_refs: list[list[list[int]]],
    ) -> None:
        parent = parent_of(node)
        if not node.tokens:
            raise IntegrityError(f"{node_where(node)} has no tokens")
        if node.namespace is not namespace and node.namespace != namespace:  # NaN
            raise IntegrityError(f"{node_where(node)} is in the wrong namespace")
        if parent.children.get(node.tokens[0]) is not node:
            raise IntegrityError(f"{node_where(node)} is not filed under its first token")
        if node.start != parent.end:
            raise IntegrityError(f"{node_where(node)} does not start where its parent ends")
        if node.end != node.start + len(node.tokens):
            raise IntegrityError(f"{node_where(node)} has a stale end")
        if node.packed != pack_tokens(node.tokens):
            raise IntegrityError(f"{node_where(node)} has stale packed tokens")
        block_size = self._block_size
        num_pages = (node.end - 1) // block_size - node.start // block_size + 1
        if len(node.pages) != len(self._groups):
            raise IntegrityError(f"{node_where(node)} holds pages of other groups than the trie's")
        for g, (pages, group) in enumerate(zip(node.pages, self._groups)):
            problem = None  # named only when found: this runs per node and group
            if len(pages) != num_pages:
                problem = f"holds {len(pages)} pages, needs {num_pages}"
            elif group.window is None and None in pages:
                problem = "lacks a page without a sliding window"
            elif None in pages[pages.count(None) :]:
                problem = "holds a page before a hole"
            if problem is not None:
                raise IntegrityError(f"{node_where(node)}, group {g}: {problem}")
            refs = held_refs[node.tier][g]
            for page in pages:
                if page is not None:
                    refs[page] += 1
        if node.lock_count != expected_locks.get(node.node_id, 0):
            raise IntegrityError(
                f"{node_where(node)} lock count {node.lock_count}, "
                f"expected {expected_locks.get(node.node_id, 0)}"
            )
        if self._hybrid and not node.children and node.slot is None:
            raise IntegrityError(f"{node_where(node)} is a tombstone leaf")
        if not self._hybrid and node.slot is not None:
            raise IntegrityError(f"{node_where(node)} holds a slot without recurrent state")
        if node.checkpoint and node.slot is None:
            raise IntegrityError(f"{node_where(node)} is a checkpoint without a snapshot")
        if node.slot is None and len(node.children) == 1 and not self._windowed:
            (child,) = node.children.values()
            if child.lock_count == node.lock_count and child.tier == node.tier:
                raise IntegrityError(f"{node_where(node)} should have been merged into its child")
        _check_children(node)
        key = (node.retention, node.last_access, node.node_id)  # as `_reindex` keys it
        unlocked = node.lock_count == 0
        want_leaf = key if unlocked and not node.num_hot_children else None
        want_slot = (
            _slot_key(node) if unlocked and node.slot is not None and not node.tier else None
        )
        if node.leaf_key != want_leaf or node.slot_key != want_slot:
            raise IntegrityError(f"{node_where(node)} has stale LRU keys")


def _check_children(node: TrieNode) -> None:
    """No child in a warmer tier than `node`; `num_hot_children` counts the
    children in its own."""
    num_hot = 0
    for child in node.children.values():
        if child.tier < node.tier:
            raise IntegrityError(f"{node_where(node)} has a child in a warmer tier")
        num_hot += child.tier == node.tier
    if node.num_hot_children != num_hot:
        raise IntegrityError(f"{node_where(node)} counts {node.num_hot_children} children "
                             f"in its tier, has {num_hot}")


def _slot_key(node: TrieNode) -> tuple[int, int, int, int]:
    """The node's key in the slot LRU list: `(retention, kept,
    last_access, node_id)`, `kept` 0 for a checkpoint (a prefill chunk end,
    `TrieNode.checkpoint`) and 1 for a snapshot a sequence ended at, so
    within one retention priority every checkpoint is dropped before any
    such snapshot, least recently used first within each kind."""
    return (node.retention, _CHECKPOINT if node.checkpoint else _KEPT, node.last_access,
            node.node_id)


#: The second part of a slot key: a checkpoint ranks before a snapshot a
#: sequence ended at (`can_free_slots` bounds its walk by the latter).
_CHECKPOINT, _KEPT = 0, 1


def _full(pages: PageList) -> list[int]:
    """A full-attention group's pages: it has no holes (the same list, typed so)."""
    return cast("list[int]", pages)


def _slot_of(node: TrieNode) -> int:
    """The snapshot slot of a node in a slot list (it holds one)."""
    if node.slot is None:
        raise IntegrityError(f"{node_where(node)} is in the slot list without a slot")
    return node.slot


def _last_none(pages: list[int | None], first: int, last: int) -> int | None:
    """The highest index in [first, last] whose page is None (or missing)."""
    if last >= len(pages):
        return last
    if None not in pages[first : last + 1]:
        return None  # the common case, checked at C speed
    for index in range(last, first - 1, -1):
        if pages[index] is None:
            return index
    return None
