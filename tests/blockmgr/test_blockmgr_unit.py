"""Unit tests of the block manager, one operation at a time, error paths included.

Every refused call must leave `debug_state()` exactly as it was.
"""

from __future__ import annotations

import copy

import pytest

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    BlockManagerError,
    CopyBlock,
    CopySlot,
    DuplicateSequence,
    GroupedStore,
    GroupedStoreConfig,
    IntegrityError,
    InvalidArgument,
    MemoryLeak,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
    SequenceSwapped,
    UnknownSequence,
    ZeroSlot,
)
from blockmgr.pool import RefCountedPool
from blockmgr.trie_node import pack_tokens
from tests.shadow import ShadowStorage


def make(num_blocks=16, block_size=4, **kwargs) -> BlockManager:
    return BlockManager(BlockManagerConfig(num_blocks=num_blocks, block_size=block_size, **kwargs))


def assert_refused(bm: BlockManager, error: type[Exception], call) -> None:
    before = bm.debug_state()
    with pytest.raises(error):
        call()
    assert bm.debug_state() == before
    bm.check_integrity()


def pages_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# ---------------------------------------------------------------- config/pool


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=0),
        dict(num_blocks=4, block_size=0),
        dict(num_blocks=4, num_slots=-1),
        dict(num_blocks=4, watermark=1.0),
        dict(num_blocks=4, watermark=-0.1),
        dict(num_blocks=4, watermark="0.1"),
        dict(num_blocks=4, sliding_window=0),
        dict(num_blocks=4.0),
        dict(num_blocks=True),
        dict(num_blocks=4, enable_prefix_cache=1),
        dict(num_blocks=4, num_host_slots=2),
        dict(num_blocks=4, num_host_blocks=-1),
    ],
)
def test_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        BlockManagerConfig(**kwargs)


def test_manager_needs_a_config():
    with pytest.raises(InvalidArgument):
        BlockManager({"num_blocks": 4})


def test_pool_take_release_roundtrip():
    pool = RefCountedPool(5)
    taken = pool.take(3)
    assert sorted(taken) == taken and len(set(taken)) == 3
    assert pool.num_free == 2 and all(pool.refcount(i) == 1 for i in taken)
    pool.incref(taken[0])
    assert pool.release_all(taken) == 2  # the increfed one stays
    assert pool.refcount(taken[0]) == 1
    assert pool.release(taken[0]) is True
    assert pool.num_free == 5
    with pytest.raises(ValueError):
        pool.take(6)
    assert pool.num_free == 5


def test_pool_hands_back_the_last_released_id_first():
    pool = RefCountedPool(4)
    first, second = pool.take(2)
    pool.release(first)
    assert pool.take_one() == first


def test_pool_sole_and_planned_releases_match_releasing_for_real():
    # Reference: copies of the pool that really release, one per planned batch.
    pool = RefCountedPool(8)
    a, b, c, d = pool.take(4)
    pool.incref_all([b, c, c])  # refcounts a 1, b 2, c 3, d 1
    assert pool.num_sole([a, b, c, d, a, d]) == 2  # a and d, each once
    assert pool.num_sole([b, c]) == 0
    pending: dict[int, int] = {}
    batches = [[a, b], [b, c], [c, d], [c]]
    shadow = RefCountedPool(8)
    shadow.take(4)
    shadow.incref_all([b, c, c])
    for batch in batches:
        assert pool.tally_release(batch, pending) == shadow.release_all(batch)
    assert [pool.refcount(i) for i in (a, b, c, d)] == [1, 2, 3, 1]  # the pool did not change
    assert pool.num_free == 4


# ------------------------------------------------------------------ allocate


def test_allocate_reserves_pages_for_every_token():
    bm = make(block_size=4)
    alloc = bm.allocate("a", range(10))
    assert len(alloc.block_table) == pages_for(10, 4)
    assert len(set(alloc.block_table)) == len(alloc.block_table)
    assert alloc.num_cached_tokens == 0 and alloc.ops == () and alloc.slot is None
    assert bm.num_tokens("a") == 10 and bm.block_table("a") == alloc.block_table
    assert bm.num_free_blocks == 16 - 3
    assert bm.usage == pytest.approx(3 / 16)
    bm.check_integrity()


def test_allocate_errors_change_nothing():
    bm = make(num_blocks=4, block_size=4)
    bm.allocate("a", range(5))
    assert_refused(bm, DuplicateSequence, lambda: bm.allocate("a", [1]))
    assert_refused(bm, InvalidArgument, lambda: bm.allocate("b", []))
    assert_refused(bm, InvalidArgument, lambda: bm.allocate("b", 7))
    assert_refused(bm, InvalidArgument, lambda: bm.allocate("b", "abc"))
    assert_refused(bm, InvalidArgument, lambda: bm.allocate("b", [1], namespace=[1]))
    assert_refused(bm, InvalidArgument, lambda: bm.allocate(["unhashable"], [1]))
    assert not bm.can_allocate(range(100, 113))
    assert_refused(bm, OutOfBlocks, lambda: bm.allocate("b", range(100, 113)))
    assert bm.can_allocate(range(100, 108))


def test_bad_arguments_are_value_errors_and_blockmanager_errors():
    assert issubclass(InvalidArgument, ValueError)
    assert issubclass(InvalidArgument, BlockManagerError)
    for error in (OutOfBlocks, OutOfSlots, UnknownSequence, DuplicateSequence, NoSnapshot):
        assert issubclass(error, BlockManagerError)


def test_hybrid_allocate_zeroes_a_fresh_slot_and_runs_out_of_slots():
    bm = make(num_slots=2)
    a = bm.allocate("a", [1, 2])
    assert a.ops == (ZeroSlot(a.slot),)
    b = bm.allocate("b", [3])
    assert b.slot != a.slot
    assert bm.num_free_slots == 0
    assert not bm.can_allocate([4])
    assert_refused(bm, OutOfSlots, lambda: bm.allocate("c", [4]))


def test_watermark_keeps_pages_back_for_running_sequences():
    bm = make(num_blocks=10, block_size=1, watermark=0.3)
    assert bm.can_allocate(range(7)) and not bm.can_allocate(range(8))
    assert_refused(bm, OutOfBlocks, lambda: bm.allocate("big", range(8)))
    bm.allocate("a", range(7))
    bm.append("a", [7, 8, 9])  # growth may use the watermark pages
    assert bm.num_free_blocks == 0


# -------------------------------------------------------------------- append


def test_append_grows_one_page_at_each_boundary():
    bm = make(block_size=4)
    bm.allocate("a", range(3))
    for num_tokens in range(4, 14):
        ops = bm.append("a", [num_tokens])
        assert ops == ()
        assert len(bm.block_table("a")) == pages_for(num_tokens, 4)
    bm.check_integrity()
    assert bm.append("a", []) == ()


def test_append_into_a_shared_partial_page_copies_it_first():
    bm = make(block_size=4, enable_prefix_cache=False)
    bm.allocate("a", range(6))
    bm.fork("a", "b")
    shared_last = bm.block_table("a")[-1]
    ops = bm.append("b", [99])
    (op,) = ops
    assert op == CopyBlock(shared_last, bm.block_table("b")[-1])
    assert bm.block_table("a")[-1] == shared_last  # the parent keeps its page
    assert bm.block_table("b")[:-1] == bm.block_table("a")[:-1]
    assert bm.append("a", [7]) == ()  # no longer shared: written in place
    bm.check_integrity()


def test_append_after_a_full_shared_page_needs_no_copy():
    bm = make(block_size=4, enable_prefix_cache=False)
    bm.allocate("a", range(8))
    bm.fork("a", "b")
    assert bm.append("b", [1]) == ()
    assert bm.block_table("b")[:2] == bm.block_table("a")
    bm.check_integrity()


def test_append_errors_change_nothing():
    bm = make(num_blocks=3, block_size=2, enable_prefix_cache=False)
    bm.allocate("a", range(4))
    bm.fork("a", "b")
    assert_refused(bm, UnknownSequence, lambda: bm.append("zz", [1]))
    assert_refused(bm, InvalidArgument, lambda: bm.append("a", 5))
    assert not bm.can_append("a", 5)
    assert_refused(bm, OutOfBlocks, lambda: bm.append("a", range(5)))
    assert bm.can_append("a", 2)
    with pytest.raises(InvalidArgument):
        bm.can_append("a", -1)


def test_hybrid_fork_shares_the_slot_and_the_first_write_copies_it():
    bm = make(num_slots=3, enable_prefix_cache=False)
    a = bm.allocate("a", range(4))
    bm.fork("a", "b")
    assert bm.slot("b") == a.slot
    ops = bm.append("b", [5])
    assert ops == (CopySlot(a.slot, bm.slot("b")),)
    assert bm.slot("b") != a.slot and bm.slot("a") == a.slot
    assert bm.append("a", [6]) == ()  # sole owner again: no copy
    bm.check_integrity()


def test_unknown_sequence_everywhere():
    bm = make()
    calls = [
        lambda: bm.append("x", [1]),
        lambda: bm.fork("x", "y"),
        lambda: bm.truncate("x", 0),
        lambda: bm.cache_prefix("x"),
        lambda: bm.free("x"),
        lambda: bm.block_table("x"),
        lambda: bm.num_tokens("x"),
        lambda: bm.slot("x"),
        lambda: bm.can_append("x"),
        lambda: bm.swap_out("x"),
    ]
    for call in calls:
        assert_refused(bm, UnknownSequence, call)
    assert isinstance(UnknownSequence("x"), KeyError)


# ---------------------------------------------------------------------- fork


def test_fork_shares_every_page_and_checks_ids():
    bm = make(block_size=4)
    bm.allocate("a", range(9))
    free_before = bm.num_free_blocks
    bm.fork("a", "b")
    assert bm.block_table("b") == bm.block_table("a")
    assert bm.tokens("b") == bm.tokens("a")
    assert bm.num_free_blocks == free_before
    assert_refused(bm, DuplicateSequence, lambda: bm.fork("a", "b"))
    bm.free("a")
    bm.free("b")
    bm.check_integrity()


# ------------------------------------------------------------------ truncate


def test_truncate_releases_the_pages_past_the_new_end():
    bm = make(block_size=4, enable_prefix_cache=False)
    bm.allocate("a", range(10))
    assert bm.truncate("a", 5) == ()
    assert bm.num_tokens("a") == 5 and len(bm.block_table("a")) == 2
    assert bm.num_free_blocks == 16 - 2
    assert bm.truncate("a", 5) == ()
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.num_free_blocks == 16
    bm.append("a", [1, 2])
    bm.check_integrity()


def test_truncate_rejects_bad_targets():
    bm = make()
    bm.allocate("a", range(5))
    assert_refused(bm, InvalidArgument, lambda: bm.truncate("a", 6))
    assert_refused(bm, InvalidArgument, lambda: bm.truncate("a", -1))
    assert_refused(bm, InvalidArgument, lambda: bm.truncate("a", 2.0))


def test_hybrid_truncate_needs_a_snapshot():
    bm = make(num_slots=4)
    bm.allocate("a", range(6))
    assert not bm.can_truncate("a", 4)
    assert_refused(bm, NoSnapshot, lambda: bm.truncate("a", 4))
    ops = bm.cache_prefix("a")  # snapshot at 6, then speculate 3 drafts
    assert len(ops) == 1 and isinstance(ops[0], CopySlot)
    snapshot_slot = ops[0].dst
    bm.append("a", [7, 8, 9])
    assert bm.can_truncate("a", 6)
    assert bm.truncate("a", 6) == ()
    assert bm.slot("a") == snapshot_slot  # shared with the trie ...
    ops = bm.append("a", [10])
    assert ops == (CopySlot(snapshot_slot, bm.slot("a")),)  # ... copied on write
    bm.check_integrity()


def test_hybrid_truncate_to_zero_zeroes_the_slot():
    bm = make(num_slots=2)
    a = bm.allocate("a", range(3))
    assert bm.truncate("a", 0) == (ZeroSlot(a.slot),)
    bm.check_integrity()


# ------------------------------------------------------------------ sliding window


def test_sliding_window_releases_pages_the_next_token_cannot_see():
    window, block_size = 6, 4
    bm = make(block_size=block_size, sliding_window=window)
    bm.allocate("a", [0])
    for num_tokens in range(1, 40):
        bm.append("a", [num_tokens])
        table = bm.block_table("a")
        # The token just appended (position num_tokens) sees (p - W, p].
        first_visible = max(0, num_tokens - window + 1)
        for index, page in enumerate(table):
            page_end = (index + 1) * block_size - 1
            visible = page_end >= first_visible
            if visible:
                assert page is not None, (num_tokens, index)
        held = sum(page is not None for page in table)
        assert held <= pages_for(window, block_size) + 1
    bm.check_integrity()
    assert_refused(bm, InvalidArgument, lambda: bm.truncate("a", 3))
    bm.free("a")
    # The trie keeps the pages of the window before the end (40 tokens: a
    # hit at 40 needs positions 35..39, pages 8 and 9), nothing else.
    assert bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 14
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == 16


# ---------------------------------------------------------------------- free


def test_free_checks_num_computed_and_returns_every_page():
    bm = make(enable_prefix_cache=False)
    bm.allocate("a", range(9))
    assert_refused(bm, InvalidArgument, lambda: bm.free("a", 10))
    assert_refused(bm, InvalidArgument, lambda: bm.free("a", -1))
    bm.free("a", 4)
    assert bm.num_free_blocks == 16 and "a" not in bm
    bm.check_integrity()


# ---------------------------------------------------------------------- swap


def test_swap_out_and_in_round_trips_the_data():
    bm = make(num_blocks=6, block_size=2, num_host_blocks=4, num_slots=2, num_host_slots=1)
    shadow = ShadowStorage(bm)
    alloc = bm.allocate("a", range(7))
    shadow.apply(alloc.ops)
    shadow.computed["a"] = 0
    shadow.compute("a")
    shadow.apply(bm.swap_out("a"))
    assert bm.is_swapped("a") and bm.num_free_blocks == 6 - bm.num_cached_blocks
    assert_refused(bm, SequenceSwapped, lambda: bm.append("a", [1]))
    assert_refused(bm, SequenceSwapped, lambda: bm.fork("a", "b"))
    assert_refused(bm, SequenceSwapped, lambda: bm.swap_out("a"))
    shadow.check_reads_back("a")  # from host memory
    shadow.apply(bm.swap_in("a"))
    assert not bm.is_swapped("a")
    shadow.check_reads_back("a")
    assert_refused(bm, InvalidArgument, lambda: bm.swap_in("a"))
    bm.check_integrity()


def test_swap_out_without_host_memory_changes_nothing():
    bm = make(num_host_blocks=1)
    bm.allocate("a", range(9))
    assert not bm.can_swap_out("a")
    assert_refused(bm, OutOfHostMemory, lambda: bm.swap_out("a"))


def test_free_of_a_swapped_sequence_returns_host_memory():
    bm = make(num_host_blocks=4)
    bm.allocate("a", range(9))
    bm.swap_out("a")
    bm.free("a")
    assert bm.num_free_host_blocks == 4 and bm.num_cached_blocks == 0
    bm.check_integrity()


def test_page_refcount_counts_each_owner_of_a_page():
    """One reference per table that owns a page and per trie node holding
    it; a sequence that hits a locked node borrows its full pages (no
    reference of its own); 0 once free. Bad pages and groups are refused."""
    bm = make(num_blocks=8, block_size=4)
    bm.allocate("a", [*range(8), 1])  # pages of 4, 4 and 1 tokens
    first, second, last = bm.block_table("a")
    assert [bm.page_refcount(p) for p in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    bm.fork("a", "b")  # shares every page
    assert [bm.page_refcount(p, 0) for p in (first, second, last)] == [2, 2, 2]
    bm.free("b")
    bm.free("a")  # the trie keeps the three pages, the partial one too
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 5
    assert [bm.page_refcount(p) for p in (first, second, last)] == [1, 1, 1]
    bm.allocate("x", [*range(8), 2])
    bm.free("x")  # [0, 8) is now a node of its own
    bm.allocate("c", [*range(8), 3])  # locks it: borrows its two pages
    first_c, second_c, own = bm.block_table("c")
    assert (first_c, second_c) == (first, second) and own not in (first, second, last)
    assert [bm.page_refcount(p) for p in (first, second, own)] == [1, 1, 1]
    assert sum(bm.page_refcount(p) for p in range(8)) == 5  # x's last page: the trie's
    for page, group in ((8, None), (-1, None), (True, None), (0, 1)):
        with pytest.raises(InvalidArgument):
            bm.page_refcount(page, group)


# ------------------------------------------------------------------ integrity


def test_check_integrity_catches_a_wrong_refcount():
    bm = make()
    bm.allocate("a", range(5))
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    bm._groups[0].pages.incref(bm.block_table("a")[0])
    with pytest.raises(IntegrityError):
        bm.check_integrity()


def test_check_integrity_catches_a_page_both_free_and_used():
    bm = make()
    bm.allocate("a", range(5))
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    bm._groups[0].pages._free.append(bm.block_table("a")[0])
    with pytest.raises(IntegrityError):
        bm.check_integrity()


def test_pool_check_names_each_broken_count():
    """Each of the pool's own checks, alone: the refcounts match the
    references the caller counted, and the free list is wrong."""
    def broken(change) -> RefCountedPool:
        pool = RefCountedPool(6)
        pool.take(2)
        change(pool)
        return pool

    pool = broken(lambda p: None)
    pool.check_integrity(pool.refcounts(), "page")
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    cases = (
        (lambda p: p._free.append(p._free[0]), "on the free list twice"),
        (lambda p: p._refcounts.__setitem__(p._free[1], 1), "is free but referenced"),
        (lambda p: p._free.pop(), "4 pages have refcount 0 but 3 are on the free list"),
    )
    for change, message in cases:
        pool = broken(change)
        with pytest.raises(IntegrityError, match=message):
            pool.check_integrity(pool.refcounts(), "page")


def test_check_integrity_catches_a_wrong_count_of_trie_pages():
    bm = make(block_size=4)
    bm.allocate("a", range(9))
    bm.free("a")
    bm.check_integrity()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    bm._trie._groups[0].num_pages_held -= 1
    with pytest.raises(IntegrityError, match="num_pages_held of group 0"):
        bm.check_integrity()


def test_check_integrity_catches_a_locked_path_that_spells_other_tokens():
    """A sequence that hit the trie is anchored at its locked node and
    borrows the full pages it matched: its tokens must spell that path."""
    for anchored, message in ((True, "anchored at a node that spells other tokens"),
                              (False, "borrows pages that hold other tokens")):
        bm = make(block_size=4)
        bm.allocate("a", range(13))
        bm.free("a")
        bm.allocate("c", [*range(8), 50, 51, 52])  # splits the cached path at 8
        bm.free("c")
        bm.allocate("b", [*range(13), 99])  # locks 13 tokens (two nodes), borrows 3 pages
        bm.check_integrity()
        # private on purpose: corrupts what no public call can, for check_integrity to catch
        seq = bm._seqs["b"]
        seq.anchored = anchored  # not anchored: as after a truncate, borrowing still
        bm.check_integrity()
        seq.tokens[9] += 1000
        seq.packed = pack_tokens(seq.tokens)  # the packed copy agrees with the change
        with pytest.raises(IntegrityError, match=message):
            bm.check_integrity()


def test_check_integrity_catches_a_table_that_does_not_cover_the_tokens():
    bm = make(block_size=4)
    bm.allocate("a", range(5))
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    bm._seqs["a"].tokens.extend(range(10))
    with pytest.raises(IntegrityError):
        bm.check_integrity()


def test_check_integrity_catches_a_page_borrowed_from_no_locked_node():
    bm = make(block_size=4)
    for seq_id, last in (("a", 1), ("b", 2)):
        bm.allocate(seq_id, [*range(8), last])
        bm.free(seq_id)
    bm.allocate("c", [*range(8), 3])  # locks the cached [0, 8): borrows 2 pages
    bm.check_integrity()
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    seq = bm._seqs["c"]
    assert seq.num_borrowed == 2
    seq.num_borrowed = 3  # its last page is its own, held by no trie node
    bm._groups[0].pages.release(seq.tables[0][2])
    with pytest.raises(IntegrityError):
        bm.check_integrity()


def test_check_integrity_catches_a_borrowed_page_that_is_not_the_cached_one():
    bm = make(block_size=4)
    for seq_id, last in (("a", 1), ("b", 2)):
        bm.allocate(seq_id, [*range(8), last])
        bm.free(seq_id)
    bm.allocate("c", [*range(8), 3])
    # private on purpose: corrupts what no public call can, for check_integrity to catch
    seq = bm._seqs["c"]
    (own,) = bm._groups[0].pages.take(1)
    bm._groups[0].pages.release(own)
    seq.tables[0][1] = own  # not the page the trie holds there
    with pytest.raises(IntegrityError):
        bm.check_integrity()


@pytest.mark.parametrize("together", [True, False])
def test_forked_siblings_restored_from_speculation_each_compute_into_their_own_slot(together):
    """A fork shares its slot; both siblings speculate (in one call or two),
    keep one draft of two, get their checkpoints back and compute the kept
    draft again (no append in between): neither may write the other's state."""
    bm = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4, num_slots=8))
    shadow = ShadowStorage(bm)
    shadow.apply(bm.allocate("a", [1, 2, 3, 4, 5]).ops)
    shadow.computed["a"] = 0
    shadow.compute("a")
    shadow.apply(bm.fork("a", "b"))
    shadow.computed["b"] = 5
    assert bm.slot("a") == bm.slot("b")
    drafts = {"a": [7, 8], "b": [9, 4]}
    if together:
        shadow.apply(bm.begin_speculation(drafts))
    else:
        for seq_id, tokens in drafts.items():
            shadow.apply(bm.begin_speculation({seq_id: tokens}))
    bm.check_integrity()
    for seq_id in drafts:
        shadow.compute(seq_id)  # the verification forward
    assert bm.commit_speculation({"a": 1, "b": 1}) == {"a", "b"}
    bm.check_integrity()
    for seq_id in drafts:
        shadow.computed[seq_id] = 5  # back at the checkpoint: the kept draft is pending
        shadow.compute(seq_id)  # asserts the slot holds exactly this sequence's state
    shadow.check_all()
    assert bm.slot("a") != bm.slot("b")
    bm.check_integrity()


def test_forked_siblings_speculating_together_reserve_exactly_the_copies_they_make():
    """Two siblings sharing a slot and a partial last page, in one call: the
    first copies each, the second is then the sole owner. Exactly enough
    free slots (2 working + 1 checkpoint copy) and pages (1 copy) suffice."""
    bm = BlockManager(BlockManagerConfig(num_blocks=3, block_size=4, num_slots=4,
                                         enable_prefix_cache=False))
    bm.allocate("a", [1, 2, 3, 4, 5])  # pages 2 of 3, slot 1 of 4
    bm.fork("a", "b")
    assert (bm.num_free_blocks, bm.num_free_slots) == (1, 3)
    drafts = {"a": [7], "b": [8]}  # both fit the shared last page
    assert bm.can_speculate(drafts)
    ops = bm.begin_speculation(drafts)
    assert sum(isinstance(op, CopyBlock) for op in ops) == 1
    assert sum(isinstance(op, CopySlot) for op in ops) == 3
    assert (bm.num_free_blocks, bm.num_free_slots) == (0, 0)
    bm.check_integrity()


@pytest.mark.parametrize("grouped", [False, True])
def test_a_deep_copy_decides_appends_on_its_own_pages(grouped):
    """A copy of a store (a checkpoint, a reference for comparison) reads
    its own page counts: a page the original stops sharing after the copy
    is still shared in the copy, whose next append copies it
    (copy-on-write)."""
    if grouped:
        store = GroupedStore(GroupedStoreConfig(
            num_blocks=16, block_size=4, windows=(None, 8), enable_prefix_cache=False))
    else:
        store = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4,
                                                enable_prefix_cache=False))
    store.allocate("a", [1, 2])  # a partly filled last page
    store.fork("a", "b")  # shared
    twin = copy.deepcopy(store)
    store.free("b")  # the original's last page is its own again; the copy's is still shared
    num_groups = 2 if grouped else 1
    assert store.append("a", [3]) == ()
    assert [type(op).__name__ for op in twin.append("a", [3])] == ["CopyBlock"] * num_groups
    assert twin.block_table("a") != store.block_table("a")
    store.check_integrity()
    twin.check_integrity()


# ------------------------------------------------------------- leak check


def test_check_no_leaks_passes_when_only_the_prefix_cache_holds_memory():
    bm = make(num_blocks=8, num_host_blocks=4, num_slots=2, num_host_slots=2)
    bm.allocate("a", range(1, 10))
    bm.free("a")
    assert bm.num_cached_blocks == 3  # the 9 tokens' pages cached: held, but by the trie
    bm.check_no_leaks()
    assert bm.num_free_blocks == 8 and bm.num_free_slots == 2 and bm.num_cached_blocks == 0


def test_check_no_leaks_names_a_live_and_a_swapped_sequence():
    bm = make(num_blocks=8, num_host_blocks=4, num_slots=2, num_host_slots=2)
    bm.allocate("live", range(1, 6))
    bm.allocate("swapped", range(50, 55))
    bm.swap_out("swapped")
    with pytest.raises(MemoryLeak) as error:
        bm.check_no_leaks()
    message = str(error.value)
    assert "2 sequences still live" in message
    assert "host pages still in use" in message and "1 host slots still in use" in message
    assert "pages not free after dropping the prefix cache" in message
    assert isinstance(error.value, IntegrityError)
