"""`TieredTrie`: a prefix trie whose evicted entries move to host memory and
disk instead of being dropped (design/tiers.md).

A node lives in one tier (`Tier`: device, host, disk), with its pages (every
page group) and its recurrent snapshot in that tier's pools; a child is
never in a warmer tier than its parent, so the device nodes form a subtree
at the top. Each tier's *frontier* is its unlocked nodes with no child in
the same tier, in LRU order:

* device pressure (`evict_pages`, `evict_slots`) demotes the LRU device
  frontier node to the next colder tier with room (making room there by
  demoting or dropping that tier's own LRU frontier first); when no colder
  tier can take it, the node and the colder nodes below it are dropped.
  Demotion frees the same device pages as a drop, so the room checks of the
  device-only trie hold unchanged;
* a hit counts demoted nodes like device ones (`PrefixMatch.loads`); the
  manager locks the hit's path, reserves device room for them
  (`load_needs`), brings them back (`load`, top down) and matches again;
* an insert whose tokens cover a demoted node gives it the inserter's
  device pages (the same KV) and drops its colder copy (`_refresh`);
* `reset` drops every unlocked node of every tier.

Moves are `MovePage` / `MoveSlot` ops collected in `ops` (the manager puts
them first in the plan of the call that caused them: a demotion reads a
device page before anything reuses it). The colder tiers' pools belong to
the trie alone. Costs: a move is O(pages of the node); making room
O(nodes moved).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from sortedcontainers import SortedList

from blockmgr.errors import IntegrityError
from blockmgr.ops import MemoryOp, MovePage, MoveSlot, Tier
from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import PrefixTrie, TriePageGroup
from blockmgr.trie_node import (
    PageList,
    PrefixCacheListener,
    PrefixMatch,
    TrieNode,
    parent_of,
    path_tokens,
    present_pages,
)

COLD_TIERS = (Tier.HOST, Tier.DISK)


@dataclass(frozen=True, slots=True)
class TierCapacity:
    """What one colder tier holds: pages of each page group and recurrent
    snapshots (slots; 0 without recurrent state)."""

    num_pages: int
    num_slots: int = 0


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """One disk-tier node, as a restart rebuilds it (`TieredTrie.disk_entries`,
    `restore`): its namespace, the tokens of its whole path from the root
    (its own are `tokens[start:]`), per page group its disk pages (one per
    page index from `start // block_size`; None: a window's hole), the
    disk slot of its snapshot (None: none) and whether that snapshot is a
    checkpoint (`TrieNode.checkpoint`: a restart keeps it dropped first)."""

    namespace: Hashable
    tokens: tuple[int, ...]
    start: int
    pages: tuple[tuple[int | None, ...], ...]
    slot: int | None = None
    checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier right now (`TieredTrie.tier_usage`): its nodes and, per page
    group, pages in use and in all; its slots in use and in all."""

    tier: Tier
    num_nodes: int
    num_used_pages: tuple[int, ...]
    num_pages: tuple[int, ...]
    num_used_slots: int
    num_slots: int
    num_demoted_pages: int
    num_loaded_pages: int


class TieredTrie(PrefixTrie):
    """A `PrefixTrie` with host and disk tiers below the device (see the
    module docstring)."""

    def __init__(
        self,
        block_size: int,
        groups: Sequence[tuple[RefCountedPool, int | None]],
        slots: RefCountedPool | None,
        listener: PrefixCacheListener | None = None,
        *,
        host: TierCapacity | None = None,
        disk: TierCapacity | None = None,
        first_group: int = 0,
    ) -> None:
        """`host` / `disk`: the capacity of each colder tier (None: no such
        tier). `first_group`: the number group 0's page ops carry."""
        super().__init__(block_size, groups, slots, listener)
        self._first_group = first_group
        self._capacities: dict[Tier, TierCapacity] = {}
        for tier, capacity in ((Tier.HOST, host), (Tier.DISK, disk)):
            records: tuple[TriePageGroup, ...] = ()
            slot_pool = None
            if capacity is not None:
                self._capacities[tier] = capacity
                records = tuple(
                    TriePageGroup(RefCountedPool(capacity.num_pages), record.window,
                               [0] * capacity.num_pages)
                    for record in self._groups
                )
                if slots is not None:
                    slot_pool = RefCountedPool(capacity.num_slots)
            self._tier_groups.append(records)
            self._tier_slots.append(slot_pool)
            self._frontiers.append(SortedList())
        #: Moves not yet handed to the manager (`take_ops`).
        self.ops: list[MemoryOp] = []
        self._refreshed: list[TrieNode] = []  # by the insert under way
        self._num_nodes = [0, 0, 0]
        self._num_demoted_pages = [0, 0, 0]  # pages moved into each tier by demotion
        self._num_loaded_pages = [0, 0, 0]  # pages loaded back from each tier

    # -------------------------------------------------------------- queries

    def take_ops(self) -> list[MemoryOp]:
        """The moves since the last call, in order, and forget them."""
        ops, self.ops = self.ops, []
        return ops

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The colder tiers this trie has, warmest first."""
        return tuple(tier for tier in COLD_TIERS if tier in self._capacities)

    def tier_usage(self) -> tuple[TierUsage, ...]:
        """Each tier's nodes, pages and slots. O(nodes)."""
        counts = [0, 0, 0]
        for node in self._nodes.values():
            counts[node.tier] += 1
        usage = []
        for tier in (Tier.DEVICE, *self.tiers):
            records = self._tier_groups[tier]
            slot_pool = self._tier_slots[tier]
            usage.append(TierUsage(
                tier, counts[tier],
                tuple(r.num_pages_held for r in records),
                tuple(r.pool.num_items for r in records),
                slot_pool.num_used if slot_pool is not None and tier else self.num_slots_held,
                slot_pool.num_items if slot_pool is not None else 0,
                self._num_demoted_pages[tier], self._num_loaded_pages[tier],
            ))
        return tuple(usage)

    # ------------------------------------------------------------ matching

    def match(
        self, namespace: Hashable, tokens: list[int], limit: int, packed: bytes | None = None
    ) -> PrefixMatch:
        """As `PrefixTrie.match`, with the hit's demoted nodes in `loads`."""
        found = super().match(namespace, tokens, limit, packed)
        if found.num_tokens:
            found.loads = [node for node in found.path if node.tier]
        return found

    def load_needs(self, match: PrefixMatch) -> tuple[list[int], int]:
        """Device pages of each group and slots that bringing `match.loads`
        back takes. Pure; O(their pages)."""
        needs = [0] * len(self._groups)
        num_slots = 0
        for node in match.loads:
            for group in range(len(needs)):
                needs[group] += len(self._group_pages(node, group))
            num_slots += node.slot is not None
        return needs, num_slots

    def load(self, nodes: Sequence[TrieNode]) -> None:
        """Bring `nodes` (demoted nodes of a locked path, root side first) to
        the device: their device pages and slots are reserved. O(pages)."""
        for node in nodes:
            self._num_loaded_pages[node.tier] += self._num_pages(node)
            self._move(node, Tier.DEVICE)
            if self._listener is not None:
                self.events.append(("stored", self._group_pages(node, 0)[:], node.tokens[:]))
            self._try_merge(node.parent)  # a tombstone above may now have one child of its tier

    def disk_loads(self, match: PrefixMatch) -> tuple[list[list[int]], list[int]]:
        """The disk pages of each group and the disk slots that loading
        `match` reads (what a storage verifies or reads ahead). Pure."""
        pages: list[list[int]] = [[] for _ in self._groups]
        slots = []
        for node in match.loads:
            if node.tier == Tier.DISK:
                for group, group_pages in enumerate(pages):
                    group_pages.extend(self._group_pages(node, group))
                if node.slot is not None:
                    slots.append(node.slot)
        return pages, slots

    # --------------------------------------------------------- persistence

    def disk_entries(self) -> list[DiskEntry]:
        """Every disk-tier node, shortest path first (a restart restores
        them in this order). O(disk nodes x depth)."""
        entries = [
            DiskEntry(node.namespace, tuple(path_tokens(node)), node.start,
                      tuple(tuple(pages) for pages in node.pages), node.slot, node.checkpoint)
            for node in self._nodes.values() if node.tier == Tier.DISK
        ]
        entries.sort(key=lambda entry: len(entry.tokens))
        return entries

    def restore(self, entries: Sequence[DiskEntry]) -> list[DiskEntry]:
        """Rebuild disk-tier nodes (a restart: the disk pool's ids are the
        storage's records), shortest path first; returns the entries that
        could not be restored (their path's start is not cached, their pages
        do not fit the node or the pools, or the place is taken): the storage
        forgets those. O(entries x path length)."""
        rejected = []
        for entry in sorted(entries, key=lambda e: len(e.tokens)):
            if not self._restore_one(entry):
                rejected.append(entry)
        if self._hybrid:  # a snapshot-less node whose children were rejected: no use
            for node in [n for n in self._nodes.values() if not n.children and n.slot is None]:
                if node.parent is not None:
                    super()._evict(node)
        return rejected

    def _restore_one(self, entry: DiskEntry) -> bool:
        tokens = list(entry.tokens)
        if not 0 <= entry.start < len(tokens) or not self._restorable(entry):
            return False
        root = self._roots.get(entry.namespace)
        if root is None:
            if entry.start:
                return False
            root = self._new_node(entry.namespace, [], 0, None, [[] for _ in self._groups])
            self._roots[entry.namespace] = root
        parent = root
        if entry.start:
            path, num_matched = self._walk(root, tokens[: entry.start])
            if num_matched != entry.start:
                return False
            parent = path[-1]
            if parent.end > entry.start:
                parent = self._split(parent, entry.start - parent.start)
        if tokens[entry.start] in parent.children:
            return False
        node = self._new_node(entry.namespace, tokens[entry.start:], entry.start, parent,
                              [list(pages) for pages in entry.pages])
        for group, record in enumerate(self._tier_groups[Tier.DISK]):
            held = present_pages(node.pages[group])
            record.pool.claim(held)
            self._hold_pages(node.pages[group], group, Tier.DISK)
            record.pool.release_all(held)  # `claim` took the trie's reference
        if entry.slot is not None:
            self._tier_slot_pool(Tier.DISK).claim([entry.slot])
            node.slot = entry.slot
            node.checkpoint = entry.checkpoint
        node.tier = Tier.DISK
        parent.children[tokens[entry.start]] = node
        if parent.tier == Tier.DISK:
            parent.num_hot_children += 1
        self._reindex(node)
        self._reindex(parent)
        self.version += 1
        self._try_merge(parent)
        return True

    def _restorable(self, entry: DiskEntry) -> bool:
        """Does the entry's shape fit this trie (page counts, holes only
        where a window allows, ids in range, a slot exactly when hybrid)?"""
        block_size = self._block_size
        num_pages = (len(entry.tokens) - 1) // block_size - entry.start // block_size + 1
        records = self._tier_groups[Tier.DISK]
        if len(entry.pages) != len(records):
            return False
        for pages, record in zip(entry.pages, records):
            held = [page for page in pages if page is not None]
            if len(pages) != num_pages or None in pages[pages.count(None):]:
                return False
            if record.window is None and len(held) != num_pages:
                return False
            if any(not 0 <= page < record.pool.num_items for page in held):
                return False
        slot_pool = self._tier_slots[Tier.DISK]
        if entry.slot is None:
            return True
        return slot_pool is not None and 0 <= entry.slot < slot_pool.num_items

    def forget_disk_pages(self, group: int, pages: Sequence[int]) -> None:
        """Drop the disk nodes holding any of `pages` of `group` (their
        records turned out unreadable), with everything below them."""
        bad = set(pages)
        for node in list(self._nodes.values()):
            if node.parent is not None and node.tier == Tier.DISK and not bad.isdisjoint(
                self._group_pages(node, group)
            ):
                self._drop_subtree(node)

    def disable(self, tier: Tier) -> None:
        """Stop using `tier` (its storage failed): drop its nodes and
        everything below them; nothing is demoted there again."""
        if tier not in self._capacities:
            return
        for node in [n for n in self._nodes.values() if n.tier == tier]:
            if node.parent is not None and node.parent.tier < tier:
                self._drop_subtree(node)
        del self._capacities[tier]

    def demote_all(self) -> None:
        """Move every unlocked node of the warmer tiers to disk (a graceful
        shutdown's flush), or drop it when the disk cannot take it."""
        for tier in (Tier.HOST, Tier.DEVICE):
            frontier = self._frontiers[tier]
            while frontier:
                node = self._nodes[frontier[0][-1]]
                if self._demote(node, Tier.DISK) is False:
                    self._drop_subtree(node)

    # ------------------------------------------------------------ eviction

    def _evict(self, node: TrieNode) -> None:
        """Demote an unlocked frontier node to the next colder tier that can
        take it (making room there), else drop it and the nodes below it."""
        self.version += 1
        for tier in self.tiers:
            if tier > node.tier:
                moved = self._demote(node, tier)
                if moved is None or moved:
                    return
        self._drop_subtree(node)

    def _demote(self, node: TrieNode, tier: Tier) -> bool | None:
        """Move an unlocked frontier node to the colder `tier`, making room
        there first: True when moved, False when `tier` cannot take it, None
        when making room took the node itself out of the trie (merged into
        its child, or left a tombstone leaf, which is dropped: nothing left
        to do)."""
        while True:
            # Making room below must not drop or merge the node: locked,
            # merges deferred. The merges that came due may fold a tombstone
            # above into it (more pages): then the room is asked for again.
            self.defer_merges()
            self.lock(node)
            has_room = self._make_room(tier, *self._needs(node))
            self.unlock(node)
            self.resume_merges()
            if node.parent is None:
                return None
            if self._hybrid and not node.children and node.slot is None:
                # Making room evicted the tombstone's last child, and the
                # lock kept the base's cascade from taking the tombstone
                # with it: no match can end in it, so it goes (and the
                # cascade goes on above it).
                self._drop_subtree(node)
                return None
            if not has_room:
                return False
            needs, num_slots = self._needs(node)
            if self._fits(tier, needs, num_slots):
                if not node.tier and self._listener is not None:
                    self.events.append(("removed", self._group_pages(node, 0)[:], None))
                self._num_demoted_pages[tier] += sum(needs)
                self._move(node, tier)
                self._try_merge(node)  # a tombstone may now have one child of its tier
                return True

    def _needs(self, node: TrieNode) -> tuple[list[int], int]:
        """Pages of each group and slots that holding `node` takes in a tier."""
        needs = [len(self._group_pages(node, group)) for group in range(len(self._groups))]
        return needs, 1 if node.slot is not None else 0

    def _fits(self, tier: Tier, needs: list[int], num_slots: int) -> bool:
        """Are `needs[g]` pages of each group and `num_slots` slots free in `tier`?"""
        slot_pool = self._tier_slots[tier]
        return all(need <= r.pool.num_free for need, r in zip(needs, self._tier_groups[tier])) and (
            not num_slots or (slot_pool is not None and num_slots <= slot_pool.num_free)
        )

    def _make_room(self, tier: Tier, needs: list[int], num_slots: int) -> bool:
        """Free `needs[g]` pages of each group and `num_slots` slots in
        `tier`, demoting or dropping its LRU frontier; False when that
        cannot be done (nothing is moved then beyond what fit)."""
        records, slot_pool = self._tier_groups[tier], self._tier_slots[tier]
        if any(need > r.pool.num_items for need, r in zip(needs, records)) or (
            num_slots and (slot_pool is None or num_slots > slot_pool.num_items)
        ):
            return False
        frontier = self._frontiers[tier]
        while not self._fits(tier, needs, num_slots):
            if not frontier:
                return False
            self._evict(self._nodes[frontier[0][-1]])
        return True

    def _drop_subtree(self, node: TrieNode) -> None:
        """Drop `node` (unlocked) and every node below it (colder or as
        cold: unlocked too), leaves first; then the base's cascade above."""
        while node.children:
            leaf = node
            while leaf.children:
                leaf = next(iter(leaf.children.values()))
            self._remove_leaf(leaf)
        super()._evict(node)

    def reset(self) -> None:
        """Drop every unlocked entry of every tier, coldest first."""
        for tier in reversed(range(len(self._frontiers))):
            frontier = self._frontiers[tier]
            while frontier:
                self._drop_subtree(self._nodes[frontier[0][-1]])

    # --------------------------------------------------------------- moving

    def _move(self, node: TrieNode, tier: Tier) -> None:
        """Copy the node's pages and slot into fresh ids of `tier` (room is
        known), drop the old ones, and keep the tier counts and LRU lists.
        The hit is unchanged but its tier is not: `version` grows (KV
        events name each block's tier)."""
        self.version += 1
        source = Tier(node.tier)
        self._unindex(node)
        for group, record in enumerate(self._tier_groups[tier]):
            moved: PageList = []
            for page in node.pages[group]:
                if page is None:
                    moved.append(None)
                    continue
                new_page = record.pool.take_one()
                self.ops.append(
                    MovePage(page, new_page, self._first_group + group, source, tier)
                )
                moved.append(new_page)
            self._drop_pages(self._group_pages(node, group), group, source)
            self._hold_pages(moved, group, tier)
            record.pool.release_all(present_pages(moved))  # the trie's reference is the take's
            node.pages[group] = moved
        if node.slot is not None:
            new_slot = self._tier_slot_pool(tier).take_one()
            self.ops.append(MoveSlot(node.slot, new_slot, source, tier))
            self._tier_slot_pool(source).release(node.slot)
            node.slot = new_slot
            self.num_slots_held += 1 if tier == Tier.DEVICE else -1 if not source else 0
        self._retier(node, tier)

    def insert(
        self,
        namespace: Hashable,
        tokens: list[int],
        tables: Sequence[PageList],
        slot: int | None = None,
        start: TrieNode | None = None,
        packed: bytes = b"",
        *,
        lock: bool = False,
        retention: int = 0,
        checkpoint: bool = False,
    ) -> tuple[TrieNode | None, bool]:
        """`PrefixTrie.insert`; the demoted nodes it covers take the
        inserter's device pages (`_refresh`), and once the insert is done
        each of them but the insert's end, now a device tombstone, merges
        into its only child, and the tombstone above it into it (deepest
        first: a merge below can leave the node above with one child of its
        tier). The end node survives: its children are colder."""
        self._refreshed = []
        result = super().insert(namespace, tokens, tables, slot, start, packed, lock=lock,
                                retention=retention, checkpoint=checkpoint)
        end = result[0]  # the caller may lock it: a merge keeps it (it is the child)
        for node in reversed(self._refreshed):
            parent = node.parent
            if node is not end:
                self._try_merge(node)
            self._try_merge(parent)
        self._refreshed = []
        return result

    def _refresh(self, node: TrieNode, tables: Sequence[PageList]) -> None:
        """Give a demoted node that an insert's tokens cover the inserter's
        device pages for its indices (a window's group keeps those of the
        window before the node's end: the inserter's released pages become
        holes) and drop its colder copies; its snapshot goes (the inserter
        holds no state at its end: a tombstone, or the insert's own slot if
        it ends there)."""
        source = node.tier
        self._unindex(node)
        block_size = self._block_size
        first, end = node.start // block_size, -(-node.end // block_size)
        for group, record in enumerate(self._groups):
            self._drop_pages(self._group_pages(node, group), group, source)
            pages = self._kept_pages(tables[group], first, end, node.end, record.window)
            self._hold_pages(pages, group)
            node.pages[group] = pages
        if node.slot is not None:
            self._tier_slot_pool(source).release(node.slot)
            node.slot = None
            node.checkpoint = False  # as a dropped snapshot's (`_drop_snapshot`)
        self._retier(node, Tier.DEVICE)
        self._refreshed.append(node)

    def _unindex(self, node: TrieNode) -> None:
        """Take the node out of its tier's LRU lists (before its tier changes)."""
        if node.leaf_key is not None:
            self._frontiers[node.tier].remove(node.leaf_key)
            node.leaf_key = None
        if node.slot_key is not None:
            self._slot_lru.remove(node.slot_key)
            node.slot_key = None

    def _retier(self, node: TrieNode, tier: Tier) -> None:
        """Set the node's tier; keep its and its parent's same-tier child
        counts and LRU places."""
        parent = parent_of(node)
        if parent.tier == node.tier:
            parent.num_hot_children -= 1
        node.tier = tier
        if parent.tier == tier:
            parent.num_hot_children += 1
        node.num_hot_children = sum(1 for child in node.children.values() if child.tier == tier)
        self._reindex(node)
        self._reindex(parent)

    def _num_pages(self, node: TrieNode) -> int:
        return sum(len(self._group_pages(node, group)) for group in range(len(self._groups)))

    # -------------------------------------------------------------- checking

    def check_integrity(self, expected_locks: dict[int, int]) -> None:
        """The base trie's invariants over every tier, and each colder tier's
        pools: the trie holds every reference (page and slot)."""
        super().check_integrity(expected_locks)
        for tier in self.tiers:
            for group, record in enumerate(self._tier_groups[tier]):
                record.pool.check_integrity(
                    record.trie_refs, f"page of group {group} in {tier.name}"
                )
            slot_pool = self._tier_slots[tier]
            if slot_pool is not None:
                refs = [0] * slot_pool.num_items
                for node in self._nodes.values():
                    if node.tier == tier and node.slot is not None:
                        refs[node.slot] += 1
                slot_pool.check_integrity(refs, f"slot in {tier.name}")
        if self.ops:
            raise IntegrityError(f"{len(self.ops)} tier moves were never handed to the storage")

    def debug_state(self) -> tuple[object, ...]:
        pools = tuple(
            (tuple(r.pool.free_items()), tuple(r.pool.refcounts()))
            for tier in self.tiers for r in self._tier_groups[tier]
        )
        slots = tuple(
            None if pool is None else tuple(pool.refcounts())
            for pool in (self._tier_slots[tier] for tier in self.tiers)
        )
        return (*super().debug_state(), pools, slots, tuple(self.ops),
                tuple(self._num_demoted_pages), tuple(self._num_loaded_pages))
