"""Demoting a node of a hybrid trie to a full colder tier: making room there
may evict the node's own children (the frontier of that tier, in LRU order),
and a tombstone left with no child is worth nothing (no match can end in
it), so it must go too, not move."""

from __future__ import annotations

from blockmgr import BlockManager, BlockManagerConfig


def _hits(bm: BlockManager, prompts: list[list[int]]) -> list[int]:
    return [bm.cached_prefix_length(prompt) for prompt in prompts]


def test_a_tombstone_whose_children_made_room_for_it_is_dropped_not_moved():
    config = BlockManagerConfig(num_blocks=20, block_size=4, num_slots=6, num_disk_blocks=5,
                                num_disk_slots=3)
    bm = BlockManager(config)
    a = list(range(1, 18))  # 17 tokens: a node [0, 17) with a snapshot
    b = a[:7] + [100]  # splits it: a tombstone [0, 7) over [7, 17) and [7, 8)
    for seq_id, prompt in (("a", a), ("b", b)):
        bm.allocate(seq_id, prompt)
        bm.free(seq_id)
    bm.allocate("again", a + [0])  # a hit through [7, 17): [7, 8) is the LRU leaf now
    bm.free("again", 17)
    prompts = [a + [0], b + [0]]
    assert _hits(bm, prompts) == [17, 8]

    # The disk's 5 pages take both leaves (4 + 1 pages); the tombstone's 2
    # pages then need room, which evicts both leaves in LRU order.
    bm.flush_to_disk()

    bm.check_integrity()  # before the fix: "node [0, 7) is a tombstone leaf"
    assert bm.disk_entries() == []
    assert _hits(bm, prompts) == [0, 0]
    restored = BlockManager(config)
    assert restored.restore_disk(bm.disk_entries()) == []
    restored.check_integrity()
    assert _hits(restored, prompts) == [0, 0]
