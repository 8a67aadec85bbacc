"""The trie's shortcuts against the calls they replace: `PrefixTrie.extend`
against `insert` from the node followed by the lock change that merges that
node into the new leaf; `insert(..., lock=True)` against `insert` then
`lock`.

Two tries are driven into the same state; one takes the long path, the
other the shortcut; their whole state (nodes, ids, LRU keys, reference
counts), their pools and the listener events must then be equal.
"""

from __future__ import annotations

import pytest

from blockmgr.pool import RefCountedPool
from blockmgr.prefix_trie import PrefixTrie
from blockmgr.trie_node import pack_tokens

BLOCK = 4
SYSTEM = list(range(100, 110))  # 10 tokens: a shared node ending inside page 2


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def stored(self, pages, tokens):
        self.calls.append(("stored", list(pages), list(tokens)))

    def removed(self, pages):
        self.calls.append(("removed", list(pages)))


class World:
    """A trie with a cached system prompt, a cached sibling, and one
    sequence whose first `prefix` tokens are cached and locked by it."""

    def __init__(self, prefix: int, total: int, listener: bool) -> None:
        self.pool = RefCountedPool(64)
        self.recorder = Recorder() if listener else None
        self.trie = PrefixTrie(BLOCK, [(self.pool, None)], None, self.recorder)
        sibling = SYSTEM + [1, 2, 3, 4, 5]
        self._cache(sibling)
        self.tokens = SYSTEM + list(range(500, 500 + total - len(SYSTEM)))
        self.table = self.pool.take(-(-total // BLOCK))
        self.packed = pack_tokens(self.tokens[:prefix])
        node, _ = self.trie.insert(None, self.tokens[:prefix], [self.table], packed=self.packed)
        self.trie.lock(node)
        self.node = node

    def _cache(self, tokens):
        table = self.pool.take(-(-len(tokens) // BLOCK))
        self.trie.insert(None, tokens, [table])
        self.pool.release_all(table)

    def state(self):
        events = None if self.recorder is None else self.recorder.calls + [
            ("pending", name, list(pages), None if tokens is None else list(tokens))
            for name, pages, tokens in self.trie.events
        ]
        return self.trie.debug_state(), self.pool.refcounts(), self.pool.free_items(), events


@pytest.mark.parametrize("listener", [False, True])
@pytest.mark.parametrize("prefix,total", [(14, 23), (16, 23), (14, 24), (13, 14)])
@pytest.mark.parametrize("then", ["unlock", "move_lock", "locked_move"])
def test_extend_equals_insert_and_the_merge_that_follows(prefix, total, listener, then):
    insert_path, extend_path = World(prefix, total, listener), World(prefix, total, listener)
    assert extend_path.trie.can_extend(extend_path.node, total, None)

    node_a, took = insert_path.trie.insert(
        None, insert_path.tokens, [insert_path.table], None, insert_path.node, insert_path.packed)
    assert not took
    node_b = extend_path.trie.extend(
        extend_path.node, extend_path.tokens + [77, 78], total, [extend_path.table],
        extend_path.packed, lock=then == "locked_move")  # tokens past `total` are not read
    if then == "unlock":  # `free`: the sequence's lock goes
        insert_path.trie.unlock(insert_path.node)
        extend_path.trie.unlock(node_b)
    else:  # `cache_prefix`: the lock moves to the new end
        insert_path.trie.lock(node_a)
        insert_path.trie.unlock(insert_path.node)
        if then == "move_lock":
            extend_path.trie.lock(node_b)
        extend_path.trie.unlock(node_b)
    if listener:
        insert_path.trie.deliver_events()
        extend_path.trie.deliver_events()

    assert extend_path.state() == insert_path.state()
    for world, node in ((insert_path, node_a), (extend_path, node_b)):
        world.pool.release_all(world.table)
        world.trie.check_integrity({} if then == "unlock" else _locks_on_path(node))
    assert extend_path.state() == insert_path.state()


def _locks_on_path(node) -> dict[int, int]:
    """One lock on each node from `node` up (the moved lock)."""
    locks = {}
    while node.parent is not None:
        locks[node.node_id] = 1
        node = node.parent
    return locks


def test_can_extend_only_a_leaf_the_caller_alone_locks():
    world = World(14, 23, False)
    trie, node = world.trie, world.node
    assert trie.can_extend(node, 23, None)
    assert not trie.can_extend(node, 14, None)  # nothing to add
    assert not trie.can_extend(node, 23, 3)  # a snapshot to take
    trie.lock(node)
    assert not trie.can_extend(node, 23, None)  # another sequence locks it too
    trie.unlock(node)
    shared = World(14, 23, False)
    assert not shared.trie.can_extend(shared.node.parent, 23, None)  # the shared system prompt
    pool = RefCountedPool(16)
    windowed = PrefixTrie(BLOCK, [(pool, 8)], None)
    table = pool.take(3)
    leaf, _ = windowed.insert(None, list(range(9)), [table])
    windowed.lock(leaf)
    assert not windowed.can_extend(leaf, 12, None)  # a windowed trie never merges


@pytest.mark.parametrize("listener", [False, True])
@pytest.mark.parametrize("tokens", [
    SYSTEM + [7, 8, 9],  # a new leaf below the shared prompt
    SYSTEM + [1, 2],  # ends inside the sibling: nothing new, the node above is returned
    SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8],  # continues the sibling
    [9, 9, 9, 9, 9],  # a new leaf below the root
    SYSTEM[:6],  # ends inside the first node: the root, None, is returned
])
def test_insert_locking_first_equals_insert_then_lock(tokens, listener):
    after, first = World(14, 23, listener), World(14, 23, listener)
    table_a = after.pool.take(-(-len(tokens) // BLOCK))
    table_b = first.pool.take(-(-len(tokens) // BLOCK))
    node_a, _ = after.trie.insert(None, tokens, [table_a])
    if node_a is not None:
        after.trie.lock(node_a)
    node_b, _ = first.trie.insert(None, tokens, [table_b], lock=True)
    assert (node_a is None) == (node_b is None)
    assert first.state() == after.state()
    if node_a is not None:
        after.trie.unlock(node_a)
        first.trie.unlock(node_b)
    assert first.state() == after.state()
