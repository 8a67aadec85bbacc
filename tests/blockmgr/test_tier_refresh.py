"""An insert that covers demoted nodes gives them the inserter's device
pages (`TieredTrie._refresh`): they lose their snapshots, and the trie must
fold the tombstones they become into their only children, as eviction and
loading do."""

from __future__ import annotations

from blockmgr import BlockManager, BlockManagerConfig, Tier


def test_refreshed_snapshots_of_a_hybrid_trie_merge_into_one_node():
    bm = BlockManager(BlockManagerConfig(num_blocks=24, block_size=4, num_slots=6,
                                         num_host_cache_blocks=32, num_host_cache_slots=8))
    tokens = list(range(100, 135))
    bm.allocate("running", tokens)  # a miss: nothing is cached yet
    bm.allocate("a", tokens[:26])
    bm.free("a")  # a node [0, 26) with a snapshot
    bm.allocate("b", tokens[:29])
    bm.free("b")  # a node [26, 29) below it
    for i in range(3):  # others push both nodes to the host tier
        other = list(range(1000 * (i + 1), 1000 * (i + 1) + 20))
        bm.allocate(f"o{i}", other)
        bm.free(f"o{i}")
    host = bm.tier_usage()[Tier.HOST]
    assert host.num_nodes == 2
    bm.free("running")  # covers both demoted nodes: they take its device pages
    bm.check_integrity()
    assert bm.tier_usage()[Tier.HOST].num_nodes == 0
    match = bm.find_prefix(tokens + [7])  # a hybrid hit ends at a snapshot before the last token
    assert match.num_tokens == len(tokens) and not match.loads
    assert len(match.path) == 1  # [0, 26) and [26, 29) are tombstones now: one node


def test_a_refreshed_checkpoint_is_no_checkpoint_once_its_snapshot_goes():
    bm = BlockManager(BlockManagerConfig(num_blocks=24, block_size=4, num_slots=6,
                                         num_disk_blocks=32, num_disk_slots=8))
    stem = [2] * 8
    bm.allocate("running", stem + [5] * 8)  # a miss: nothing is cached yet
    bm.allocate("b", stem + [3] * 16)
    bm.cache_prefix("b", 8)  # a checkpoint at the end of [0, 8)
    bm.free("b")  # and [8, 24) below it, with b's end
    bm.flush_to_disk()  # both nodes go to the disk tier
    assert [u.num_nodes for u in bm.tier_usage() if u.tier == Tier.DISK] == [2]
    bm.free("running")  # covers [0, 8): it takes the device pages, its snapshot goes
    # [0, 8) is a tombstone with two children (one on the device, one on
    # disk): a node without a snapshot is no checkpoint.
    bm.check_integrity()
    assert bm.find_prefix(stem + [9]).num_tokens == 0
