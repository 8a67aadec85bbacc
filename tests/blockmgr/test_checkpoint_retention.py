"""Chunk-end checkpoints against the snapshots sequences end at (hybrid).

`cache_prefix` snapshots a sequence that goes on (a prefill chunk end): a
checkpoint. `free` leaves the snapshot a session's next turn continues from.
Under slot pressure checkpoints are dropped first, a checkpoint only takes
the slot of another checkpoint (or of a lower retention priority's
snapshot), and a snapshot at the allocation's branch
point (one a sibling hits) is no checkpoint (`design/prefix_trie.md`).

Each scenario states which snapshots survive as the hits a prompt gets
(`cached_prefix_length`: in hybrid mode the deepest snapshot on its path).
"""

from __future__ import annotations

import pytest

from blockmgr import BlockManager, BlockManagerConfig, OutOfSlots

A = [1] * 12  # an earlier session's whole request (prompt and answer)
B = [2] * 24  # a later request, snapshotted at its chunk ends 8 and 16


def _manager(num_slots: int) -> BlockManager:
    return BlockManager(BlockManagerConfig(num_blocks=64, block_size=4, num_slots=num_slots))


def _hit(bm: BlockManager, prefix: list[int]) -> int:
    """The hit of a prompt that continues `prefix` with a new token."""
    return bm.cached_prefix_length(prefix + [99])


def _full_pool_after_a_and_b() -> BlockManager:
    """Four slots, all in the trie: A's end (the least recently used),
    then B's checkpoints at 8 and 16 and B's end, touched together."""
    bm = _manager(num_slots=4)
    bm.allocate("a", A)
    bm.free("a")
    bm.allocate("b", B)
    bm.cache_prefix("b", 8)
    bm.cache_prefix("b", 16)
    bm.free("b")
    bm.check_integrity()
    assert bm.num_free_slots == 0
    assert [_hit(bm, A), _hit(bm, B[:8]), _hit(bm, B[:16]), _hit(bm, B)] == [12, 8, 16, 24]
    return bm


def test_checkpoints_are_dropped_before_older_end_of_request_snapshots():
    bm = _full_pool_after_a_and_b()
    bm.allocate("x", [3] * 8)  # a slot each: two snapshots go
    bm.allocate("y", [4] * 8)
    bm.check_integrity()
    # Plain LRU would drop A's end first (touched before all of B's);
    # the checkpoints go instead, and both ends still serve their next turn.
    assert _hit(bm, A) == 12
    assert _hit(bm, B) == 24
    assert _hit(bm, B[:16]) == 0 and _hit(bm, B[:8]) == 0
    assert bm.stats.num_trie_slots == 2


def test_a_checkpoint_takes_only_the_slot_of_another_checkpoint():
    bm = _full_pool_after_a_and_b()
    bm.allocate("c", [5] * 20)  # a slot: B's first checkpoint goes
    assert [_hit(bm, A), _hit(bm, B[:8]), _hit(bm, B[:16]), _hit(bm, B)] == [12, 0, 16, 24]
    bm.cache_prefix("c", 8)  # no slot free: it takes B's other checkpoint's
    bm.check_integrity()
    assert [_hit(bm, A), _hit(bm, B[:16]), _hit(bm, B)] == [12, 0, 24]
    assert _hit(bm, [5] * 8) == 8
    before = bm.debug_state()
    with pytest.raises(OutOfSlots):
        bm.cache_prefix("c", 16)  # only the two ends are left to drop: refused
    assert bm.debug_state() == before
    bm.free("c")
    assert [_hit(bm, A), _hit(bm, B), _hit(bm, [5] * 20)] == [12, 24, 20]


def test_a_branch_point_snapshot_is_no_checkpoint():
    bm = _manager(num_slots=3)
    system = [7] * 8
    bm.allocate("old", A)
    bm.free("old")  # A's end: the oldest snapshot
    bm.allocate("s1", system + [1] * 8)
    bm.free("s1")  # one node [0, 16) with a snapshot at 16 only
    alloc = bm.allocate("s2", system + [2] * 8)
    assert alloc.num_cached_tokens == 0 and alloc.branch_point == 8
    assert bm.num_free_slots == 0
    bm.cache_prefix("s2", 8)  # the branch: taken though only ends can be dropped
    bm.check_integrity()
    assert [_hit(bm, A), _hit(bm, system), _hit(bm, system + [1] * 8)] == [0, 8, 16]
    bm.free("s2")
    # s1's end is now the least recently used snapshot; the branch point's,
    # touched with s2's end, goes after it, as a snapshot a sequence ended at.
    bm.allocate("z", [6] * 8)
    bm.check_integrity()
    assert _hit(bm, system + [1] * 8) == 8  # s1's end is gone, the branch serves it
    assert _hit(bm, system + [2] * 8) == 16


def test_a_sequence_ending_at_its_checkpoint_makes_it_an_end():
    bm = _manager(num_slots=4)
    bm.allocate("b", B)
    bm.cache_prefix("b", 8)
    bm.free("b", 8)  # stopped at the chunk end: the checkpoint is its end
    bm.allocate("a", A)
    bm.free("a")
    bm.allocate("d", [6] * 16)
    bm.cache_prefix("d", 12)
    bm.free("d")  # the trie: b's end at 8 (the oldest), A's end, d's checkpoint and end
    assert bm.num_free_slots == 0
    bm.allocate("x", [3] * 8)  # a slot: d's checkpoint goes, not b's older end
    bm.check_integrity()
    assert [_hit(bm, B[:8]), _hit(bm, A), _hit(bm, [6] * 12), _hit(bm, [6] * 16)] == [8, 12, 0, 16]


def test_a_checkpoint_takes_a_lower_priority_snapshot_but_never_a_higher_one():
    bm = _manager(num_slots=3)
    bm.allocate("lo", A, retention=0)
    bm.free("lo")  # A's end, at priority 0
    bm.allocate("hi", B, retention=5)
    bm.cache_prefix("hi", 8)  # the last free slot
    assert bm.num_free_slots == 0
    bm.cache_prefix("hi", 16)  # A's end ranks below its own priority's ends: taken
    bm.check_integrity()
    assert [_hit(bm, A), _hit(bm, B[:8]), _hit(bm, B[:16])] == [0, 8, 16]
    bm.free("hi")  # three snapshots at priority 5: two checkpoints and B's end
    bm.allocate("lo2", [5] * 20, retention=0)  # admission drops a checkpoint for its slot
    assert bm.num_free_slots == 0
    before = bm.debug_state()
    with pytest.raises(OutOfSlots):
        bm.cache_prefix("lo2", 8)  # only priority 5 snapshots left to drop: refused
    assert bm.debug_state() == before
    assert _hit(bm, B) == 24


def test_a_restart_keeps_checkpoints_apart_from_the_snapshots_sequences_ended_at():
    def tiered() -> BlockManager:
        return BlockManager(BlockManagerConfig(num_blocks=64, block_size=4, num_slots=3,
                                               num_disk_blocks=32, num_disk_slots=8))

    old = tiered()
    old.allocate("a", A)
    old.free("a")  # A's end
    old.allocate("b", B)
    old.cache_prefix("b", 16)  # a checkpoint
    old.free("b")
    old.flush_to_disk()
    bm = tiered()
    assert bm.restore_disk(old.disk_entries()) == []
    bm.pin("a", A)  # back on the device: A's end first, then the checkpoint
    bm.pin("b", B[:16])
    bm.unpin("a")
    bm.unpin("b")
    assert bm.num_free_slots == 1
    bm.allocate("x", [3] * 8)
    bm.allocate("y", [4] * 8)  # a slot: the checkpoint goes back to disk, not A's end
    bm.check_integrity()
    assert not bm.find_prefix(A + [99]).loads
    assert bm.find_prefix(B[:16] + [99]).loads


def test_the_ends_of_a_prompts_samples_go_before_a_lone_request_end():
    bm = _manager(num_slots=4)
    bm.allocate("a", A)
    bm.free("a")  # A's end: the least recently used snapshot
    bm.allocate("p", B)
    bm.fork("p", "s1")  # a prompt with two samples
    bm.fork("p", "s2")
    bm.free("p")  # the prompt's end, its state shared by the samples
    bm.append("s1", [3])  # each sample writes its own copy of the state
    bm.append("s2", [4])
    bm.free("s1")
    bm.free("s2")
    assert bm.num_free_slots == 0
    assert [_hit(bm, A), _hit(bm, B), _hit(bm, B + [3]), _hit(bm, B + [4])] == [12, 24, 25, 25]
    bm.allocate("x", [5] * 8)  # a slot each: two snapshots go
    bm.allocate("y", [6] * 8)
    bm.check_integrity()
    # Plain LRU would drop A's end first; the prompt's and the samples' ends
    # go instead (a next turn continues one sample at most), least recent first.
    assert _hit(bm, A) == 12
    assert [_hit(bm, B), _hit(bm, B + [3]), _hit(bm, B + [4])] == [0, 0, 25]
