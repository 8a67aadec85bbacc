"""`StoreChecks`: a `BlockManager`'s invariants, checked, and its state as
plain values.

`BlockManager.check_integrity` and `debug_state` are the public calls; the
rules behind them live here, apart from the calls that change the store.
The manager owns one `StoreChecks` over its page groups, slot pools and
live sequences, and passes what changes under it (the trie, the pins) to
each call. Nothing here changes the store. Both calls are O(state size):
for tests, the simulator's `--check` and a server's debug endpoint, not for
the per-step path.

What `check` holds the store to: per group, refcounts equal the references
held by sequences, pins and the trie (device and host pools apart); free and
used ids add up; no id is both free and referenced; each table covers
exactly its sequence's tokens, released pages first; borrowed pages lie on
the locked path; an open speculation has its own checkpoint slot; a
recompute hold lies where its window is still held; the trie's own
invariants hold.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from itertools import chain

from blockmgr.errors import IntegrityError
from blockmgr.page_group import PageGroup, windows_keep
from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import PrefixTrie
from blockmgr.sequence import Sequence, SequenceTable, Speculation
from blockmgr.trie_node import TOKEN_BYTES, TrieNode, pack_tokens, path_tokens


@dataclass(slots=True, eq=False)
class StoreChecks:
    """The invariants of a manager's sequences, pools and trie.

    `groups` are the manager's page groups, `slots` / `host_slots` its slot
    pools (`slots` None: no recurrent state), `sequences` its live
    sequences, `block_size` its tokens per page.
    """

    groups: tuple[PageGroup, ...]
    slots: RefCountedPool | None
    host_slots: RefCountedPool
    sequences: SequenceTable
    block_size: int

    def check(self, trie: PrefixTrie | None, pins: Mapping[Hashable, TrieNode]) -> None:
        """Raise `IntegrityError` naming the first broken invariant (see the
        module doc). `pins` maps each pin id to the node it locks."""
        groups = self.groups
        page_refs = [[0] * g.pages.num_items for g in groups]
        host_refs = [[0] * g.host_pages.num_items for g in groups]
        slot_refs = [0] * self.slots.num_items if self.slots is not None else None
        host_slot_refs = [0] * self.host_slots.num_items
        locks: dict[int, int] = {}
        for seq in self.sequences.values():
            where = f"sequence {seq.seq_id!r}"
            if not len(seq.tables) == len(seq.released) == len(groups):
                raise IntegrityError(f"{where} has page tables of other groups than the manager's")
            refs = host_refs if seq.swapped else page_refs
            for group in groups:
                group.check_sequence(seq, refs[group.index], where)
            self._check_sequence(seq, host_slot_refs if seq.swapped else slot_refs, locks, where)
        for node in pins.values():
            if node.parent is None or node.tier:
                raise IntegrityError(f"a pin locks node {node.node_id}, off the device or the trie")
            _count_locks(node, locks)
        if trie is not None:
            trie.check_integrity(locks)  # first: the nodes' shape
            trie.add_references(page_refs, slot_refs)
        for group in groups:
            what = f"page of group {group.group}" if len(groups) > 1 else "page"
            group.pages.check_integrity(page_refs[group.index], what)
            group.host_pages.check_integrity(host_refs[group.index], f"host {what}")
        self.host_slots.check_integrity(host_slot_refs, "host slot")
        if self.slots is not None and slot_refs is not None:
            self.slots.check_integrity(slot_refs, "slot")

    def debug_state(
        self, trie: PrefixTrie | None, pins: Mapping[Hashable, TrieNode], counters: tuple[int, ...]
    ) -> tuple[object, ...]:
        """Everything observable (sequences, pools, the manager's `counters`,
        the trie, the pins) as plain values: equal before and after any call
        that failed."""
        seqs = tuple(
            (
                seq_id,
                seq.namespace,
                tuple(seq.tokens),
                tuple(map(tuple, seq.tables)),
                tuple(seq.released),
                seq.slot,
                seq.locked_node.node_id if seq.locked_node is not None else None,
                seq.swapped,
                seq.anchored,
                seq.num_borrowed,
                None if seq.speculation is None else (
                    seq.speculation.start, seq.speculation.checkpoint,
                    seq.speculation.recompute_from,
                ),
                seq.num_computed,
                seq.recompute_hold,
                seq.branch_point,
                seq.forked,
            )
            for seq_id, seq in self.sequences.items()
        )
        pools = tuple(
            tuple(pool.free_items()) + (None,) + tuple(pool.refcounts())
            for pool in chain(
                (pool for g in self.groups for pool in (g.pages, g.host_pages)),
                [self.slots] if self.slots is not None else [],
                [self.host_slots],
            )
        )
        trie_state = trie.debug_state() if trie is not None else None
        pin_state = tuple((pin_id, node.node_id) for pin_id, node in pins.items())
        return seqs, pools, counters, trie_state, pin_state

    def _check_sequence(
        self, seq: Sequence, slot_refs: list[int] | None, locks: dict[int, int], where: str
    ) -> None:
        """A sequence's own invariants beside its tables: packed tokens,
        slot, lock, borrowed pages, speculation and recompute hold."""
        if seq.packed != pack_tokens(seq.tokens[: len(seq.packed) // TOKEN_BYTES]):
            raise IntegrityError(f"{where} has stale packed tokens")
        if (seq.slot is None) != (self.slots is None):
            raise IntegrityError(f"{where} slot {seq.slot} does not fit the model kind")
        if seq.swapped and seq.locked_node is not None:
            raise IntegrityError(f"{where} is swapped out but locks the trie")
        if seq.slot is not None and slot_refs is not None:
            slot_refs[seq.slot] += 1
        if seq.speculation is not None:
            self._check_speculation(seq, seq.speculation, where, slot_refs)
        num_computed = seq.num_computed
        if type(num_computed) is not int or not 0 <= num_computed <= len(seq.tokens):
            raise IntegrityError(f"{where} counts {num_computed!r} computed of {len(seq.tokens)}")
        if seq.recompute_hold:
            self._check_recompute_hold(seq, num_computed, len(seq.tokens), where)
        node = seq.locked_node
        if node is not None and (node.parent is None or node.tier):
            raise IntegrityError(f"{where} locks a node off the device or the trie")
        if seq.anchored and (node is None or path_tokens(node) != seq.tokens[: node.end]):
            raise IntegrityError(f"{where} is anchored at a node that spells other tokens")
        if seq.num_borrowed:
            self._check_borrowed(seq, where)
        if node is not None:
            _count_locks(node, locks)

    def _check_speculation(
        self, seq: Sequence, spec: Speculation, where: str, slot_refs: list[int] | None
    ) -> None:
        """An open transaction: resident, its start within the tokens, a
        checkpoint slot exactly when hybrid, its own, distinct from the
        working one."""
        if seq.swapped or not 0 <= spec.start <= len(seq.tokens):
            raise IntegrityError(f"{where} speculates from {spec.start} (or while swapped out)")
        if (spec.checkpoint is None) != (seq.slot is None) or (
            spec.checkpoint is not None and spec.checkpoint == seq.slot
        ):
            raise IntegrityError(f"{where}: checkpoint {spec.checkpoint} beside slot {seq.slot}")
        if spec.checkpoint is not None and self.slots is not None and slot_refs is not None:
            slot_refs[spec.checkpoint] += 1
            # A restore makes the sequence compute into it: never shared.
            if self.slots.refcount(spec.checkpoint) != 1:
                raise IntegrityError(f"{where}: checkpoint {spec.checkpoint} is shared")
        if seq.recompute_hold:
            raise IntegrityError(f"{where} holds its count beside its transaction")
        self._check_recompute_hold(seq, spec.recompute_from, spec.start, where)

    def _check_recompute_hold(
        self, seq: Sequence, position: int | None, limit: int, where: str
    ) -> None:
        """A position to compute again from: within `limit`, its window held."""
        if position is not None and not (
            0 <= position <= limit and (seq.swapped or windows_keep(self.groups, seq, position))
        ):
            raise IntegrityError(f"{where} recomputes from {position} but its window is released")

    def _check_borrowed(self, seq: Sequence, where: str) -> None:
        """Borrowed pages are full, inside the locked path, held at their
        index by a node of that path (in every group), and spell the
        sequence's tokens."""
        node, num_borrowed = seq.locked_node, seq.num_borrowed
        end = num_borrowed * self.block_size
        if node is None or seq.swapped or num_borrowed < 0:
            raise IntegrityError(f"{where} borrows pages without a lock (or while swapped out)")
        if end > node.end or end > len(seq.tokens):
            raise IntegrityError(f"{where} borrows {num_borrowed} pages past its lock or end")
        if path_tokens(node)[:end] != seq.tokens[:end]:
            raise IntegrityError(f"{where} borrows pages that hold other tokens")
        held: set[tuple[int, int, int | None]] = set()
        while node.parent is not None:
            first = node.start // self.block_size
            for group, pages in enumerate(node.pages):
                held.update((group, index, page) for index, page in enumerate(pages, first))
            node = node.parent
        for group, (table, released) in enumerate(zip(seq.tables, seq.released)):
            for index in range(released, num_borrowed):
                if (group, index, table[index]) not in held:
                    raise IntegrityError(
                        f"{where}: borrowed page {index} of group {group} is not on its locked path"
                    )


def _count_locks(node: TrieNode, locks: dict[int, int]) -> None:
    """Count one lock on every node from `node` up to (not including) the
    root: a lock holds its whole path."""
    while node.parent is not None:
        locks[node.node_id] = locks.get(node.node_id, 0) + 1
        node = node.parent
