"""A sequence's computed count is one record (`Progress`: the live
sequence's) that the store hands out and moves where its calls say.

Each test states the count the contract gives after a call (written out
here by hand: a prefix hit's tokens, the tokens before an append, a given
count, a cut, a restored checkpoint's position) and reads it back through
every way a caller has: the record the allocation handed out, `progress`
and `num_computed`. A count a caller set past the tokens is caught by
`check_integrity`.
"""

from __future__ import annotations

import pytest

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    GroupedStore,
    GroupedStoreConfig,
    IntegrityError,
    UnknownSequence,
)

BLOCK = 4


def store(num_slots: int = 0) -> BlockManager:
    return BlockManager(BlockManagerConfig(num_blocks=64, block_size=BLOCK, num_slots=num_slots))


def count(bm: BlockManager, seq_id: str) -> int:
    """The count, read both ways, which must agree."""
    assert bm.progress(seq_id).num_computed == bm.num_computed(seq_id)
    return bm.num_computed(seq_id)


def test_an_allocation_hands_out_the_record_at_its_prefix_hit():
    bm = store()
    first = bm.allocate("a", list(range(10)))
    assert first.progress is bm.progress("a")
    assert count(bm, "a") == 0  # nothing cached yet
    bm.free("a")
    hit = bm.allocate("b", list(range(9)) + [99])
    assert hit.num_cached_tokens == 9  # the tokens it shares with the freed prompt
    assert count(bm, "b") == 9
    assert hit.progress is bm.progress("b") and hit.progress is not first.progress


def test_an_append_takes_the_tokens_before_it_as_computed_or_its_given_count():
    bm = store()
    bm.allocate("a", list(range(6)))
    bm.append("a", [6, 7])  # no count: the 6 tokens before it are computed
    assert count(bm, "a") == 6
    bm.append("a", [8], 5)  # a count below the tokens: it says so, and holds
    assert count(bm, "a") == 5
    assert bm.recompute_from("a") == 5
    bm.append("a", [9])  # held: an append without a count keeps it
    assert count(bm, "a") == 5
    bm.append("a", [10], 10)  # a count reaching the tokens ends the hold
    assert count(bm, "a") == 10 and bm.recompute_from("a") is None
    bm.append_decode(["a"], [11])
    assert count(bm, "a") == 11
    bm.check_integrity()


def test_a_decode_step_counts_every_row_to_the_tokens_before_its_new_one():
    bm = store()
    for i, n in enumerate([3, 4, 9]):
        bm.allocate(f"s{i}", list(range(n)))
    bm.append_decode(["s0", "s1", "s2"], [50, 51, 52])  # s1 grows a page, the others fit
    assert [count(bm, f"s{i}") for i in range(3)] == [3, 4, 9]
    bm.check_integrity()


def test_a_fork_gets_a_record_of_its_own_at_the_same_count():
    bm = store()
    bm.allocate("a", list(range(7)))
    bm.append("a", [7])
    bm.fork("a", "b")
    assert count(bm, "b") == 7 and bm.progress("b") is not bm.progress("a")
    bm.progress("b").num_computed = 8  # b's forward finished; a's did not
    assert count(bm, "a") == 7 and count(bm, "b") == 8
    bm.check_integrity()


def test_a_truncate_cuts_the_count():
    bm = store()
    bm.allocate("a", list(range(12)))
    bm.progress("a").num_computed = 12
    bm.truncate("a", 5)
    assert count(bm, "a") == 5
    bm.truncate("a", 5)
    assert count(bm, "a") == 5


@pytest.mark.parametrize("num_accepted, want", [(0, 9), (2, 9), (3, 12)])
def test_a_commit_restores_a_checkpoints_count_or_keeps_the_accepted(num_accepted, want):
    """Hybrid: a commit keeping less than the whole tail gives the
    checkpoint back (the state after the 9 tokens computed at begin)."""
    bm = store(num_slots=8)
    bm.allocate("a", list(range(9)))
    bm.progress("a").num_computed = 9
    bm.begin_speculation({"a": [1, 2, 3]})
    bm.progress("a").num_computed = 12  # the verifying forward computed the drafts
    restored = bm.commit_speculation({"a": num_accepted})
    assert restored == (frozenset({"a"}) if num_accepted < 3 else frozenset())
    assert count(bm, "a") == want
    assert bm.recompute_from("a") == (9 if 0 < num_accepted < 3 else None)
    bm.check_integrity()


def test_a_shortened_speculation_cuts_the_count_to_the_tokens_kept():
    bm = store()
    bm.allocate("a", list(range(8)))
    bm.progress("a").num_computed = 8
    bm.begin_speculation({"a": [1, 2, 3]})
    bm.progress("a").num_computed = 11
    bm.shorten_speculation({"a": 1})
    assert count(bm, "a") == 9 and bm.speculation_start("a") == 8
    bm.check_integrity()


def test_every_group_of_a_grouped_store_reads_the_one_record():
    grouped = GroupedStore(GroupedStoreConfig(num_blocks=64, block_size=BLOCK,
                                              windows=(None, 8)))
    alloc = grouped.allocate("a", list(range(10)))
    grouped.append("a", [10])
    assert alloc.progress is grouped.progress("a") and grouped.num_computed("a") == 10
    grouped.check_integrity()


def test_a_count_past_the_tokens_is_caught_and_a_freed_sequence_has_none():
    bm = store()
    alloc = bm.allocate("a", list(range(5)))
    alloc.progress.num_computed = 6  # a caller's bug
    with pytest.raises(IntegrityError, match="counts 6 computed of 5"):
        bm.check_integrity()
    alloc.progress.num_computed = 5
    bm.check_integrity()
    bm.free("a")
    with pytest.raises(UnknownSequence):
        bm.progress("a")
    with pytest.raises(UnknownSequence):
        bm.num_computed("a")
