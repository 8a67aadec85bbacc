"""Prefix-cache scenarios, each checked on the shadow storage.

A sequence's hit is only right if the shared pages (and recurrent snapshot)
hold its own tokens, so every scenario reads the sequences back.
"""

from __future__ import annotations

import pytest

from blockmgr import BlockManager, BlockManagerConfig, CopyBlock, OutOfBlocks
from tests.shadow import ShadowStorage

SYSTEM = list(range(100, 140))  # a 40-token shared system prompt


class Harness:
    """A manager plus its shadow storage; `run` allocates and computes."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("num_blocks", 64)
        kwargs.setdefault("block_size", 4)
        self.bm = BlockManager(BlockManagerConfig(**kwargs))
        self.shadow = ShadowStorage(self.bm)

    def start(self, seq_id, tokens, namespace=None):
        alloc = self.bm.allocate(seq_id, tokens, namespace)
        self.shadow.apply(alloc.ops)
        self.shadow.computed[seq_id] = alloc.num_cached_tokens
        self.shadow.check_reads_back(seq_id)
        return alloc

    def run(self, seq_id, tokens, namespace=None, output=()):
        """Prefill, then decode `output` token by token."""
        alloc = self.start(seq_id, tokens, namespace)
        self.shadow.compute(seq_id)
        for token in output:
            self.shadow.apply(self.bm.append(seq_id, [token]))
            self.shadow.compute(seq_id)
        self.shadow.check_reads_back(seq_id)
        return alloc

    def finish(self, seq_id, num_computed=None):
        computed = self.shadow.computed.pop(seq_id)
        self.bm.free(seq_id, computed if num_computed is None else num_computed)
        self.bm.check_integrity()


@pytest.fixture(params=[False, True], ids=["attention", "hybrid"])
def harness(request) -> Harness:
    return Harness(num_slots=16 if request.param else 0)


def test_conversation_resumption_reuses_everything_but_the_new_text(harness):
    turn1 = SYSTEM + [1, 2, 3, 4, 5]
    answer = [7, 8, 9, 10, 11, 12, 13]
    harness.run("turn1", turn1, output=answer)
    harness.finish("turn1")
    turn2 = turn1 + answer + [20, 21, 22]
    alloc = harness.run("turn2", turn2)
    assert alloc.num_cached_tokens == len(turn1) + len(answer)
    harness.finish("turn2")


def test_full_hit_leaves_one_token_to_compute():
    h = Harness()
    prompt = SYSTEM + [1, 2, 3]
    h.run("a", prompt)
    h.finish("a")
    assert h.run("b", prompt).num_cached_tokens == len(prompt) - 1
    h.finish("b")


def test_branching_and_switching_back(harness):
    left, right = SYSTEM + [1] * 9, SYSTEM + [2] * 9
    harness.run("left", left)
    harness.finish("left")
    assert harness.run("right", right).num_cached_tokens in (0, len(SYSTEM))
    harness.finish("right")
    # Both branches are kept: switching back to either hits all of it.
    assert harness.run("left2", left + [3]).num_cached_tokens == len(left)
    assert harness.run("right2", right + [3]).num_cached_tokens == len(right)
    harness.finish("left2")
    harness.finish("right2")


def test_hybrid_branch_point_makes_the_next_sibling_hit():
    h = Harness(num_slots=16)
    h.run("a", SYSTEM + [1] * 8)
    h.finish("a")
    alloc = h.start("b", SYSTEM + [2] * 8)
    # No recurrent snapshot at the end of SYSTEM: nothing usable yet, but the
    # allocation says where the prompts part.
    assert alloc.num_cached_tokens == 0
    assert alloc.branch_point == len(SYSTEM)
    h.shadow.compute("b", alloc.branch_point)  # a chunk that ends there ...
    h.shadow.apply(h.bm.cache_prefix("b", alloc.branch_point))  # ... checkpointed
    h.shadow.compute("b")
    h.finish("b")
    assert h.run("c", SYSTEM + [3] * 8).num_cached_tokens == len(SYSTEM)
    h.finish("c")


def test_hybrid_match_never_lands_past_the_deepest_snapshot():
    h = Harness(num_slots=16)
    prompt = SYSTEM + list(range(20))
    alloc = h.start("a", prompt)
    h.shadow.compute("a", 12)
    h.shadow.apply(h.bm.cache_prefix("a", 12))
    h.shadow.compute("a")
    h.finish("a")
    # A prompt that diverges at 30 matches 30 tokens, but the only snapshots
    # on that path are at 12 (and at the end of "a", past the divergence).
    alloc = h.start("b", prompt[:30] + [999, 998])
    assert alloc.num_cached_tokens == 12
    assert alloc.branch_point == 30
    h.shadow.compute("b")
    h.finish("b")


def test_a_cancelled_sequence_leaves_only_its_computed_prefix(harness):
    prompt = SYSTEM + list(range(30))
    harness.start("a", prompt)
    harness.shadow.compute("a", 21)  # aborted mid-prefill after 21 tokens
    harness.finish("a")
    alloc = harness.run("b", prompt)
    assert alloc.num_cached_tokens == 21
    harness.finish("b")


def test_namespaces_never_share(harness):
    prompt = SYSTEM + [1, 2, 3]
    harness.run("a", prompt, namespace="tenant-a")
    harness.finish("a")
    assert harness.run("b", prompt, namespace="tenant-b").num_cached_tokens == 0
    assert harness.run("c", prompt, namespace=None).num_cached_tokens == 0
    # Same namespace hits: all but one token, except that a hybrid model's
    # only snapshot is at the very end, which a full hit cannot use.
    hybrid = harness.bm.config.is_hybrid
    expected = 0 if hybrid else len(prompt) - 1
    assert harness.run("d", prompt, namespace="tenant-a").num_cached_tokens == expected
    for seq_id in "bcd":
        harness.finish(seq_id)


def test_eviction_keeps_the_system_prompt_of_active_conversations(harness):
    h = harness
    h.start("turn1", SYSTEM + [1, 2, 3])
    h.shadow.compute("turn1", len(SYSTEM))
    h.shadow.apply(h.bm.cache_prefix("turn1", len(SYSTEM)))  # checkpoint the system prompt
    h.shadow.compute("turn1")
    h.finish("turn1")
    h.run("active", SYSTEM + [1, 2, 3, 4])  # live: its cached path is locked
    for index in range(40):  # many one-off prompts push the pool to its limit
        seq_id = f"other{index}"
        h.run(seq_id, [1000 + index] * 30)
        h.finish(seq_id)
    assert h.bm.stats.num_evicted_pages > 0
    alloc = h.run("next", SYSTEM + [9, 9])
    assert alloc.num_cached_tokens == len(SYSTEM)
    h.finish("active")
    h.finish("next")


def test_eviction_is_least_recently_used_first():
    h = Harness(num_blocks=20, block_size=4)
    prompts = {name: [ord(name)] * 16 for name in "abc"}
    for name in "abc":
        h.run(name, prompts[name])
        h.finish(name)
    h.run("touch-a", prompts["a"])  # "a" becomes the most recent
    h.finish("touch-a")
    h.run("big", list(range(500, 540)))  # needs pages: evicts "b" first
    h.finish("big")
    assert h.run("a2", prompts["a"]).num_cached_tokens == 15
    assert h.run("b2", prompts["b"]).num_cached_tokens == 0
    h.finish("a2")
    h.finish("b2")


def test_allocation_fails_whole_when_eviction_cannot_help():
    h = Harness(num_blocks=8, block_size=4)
    h.run("a", list(range(28)))  # 7 pages, live
    before = h.bm.debug_state()
    with pytest.raises(OutOfBlocks):
        h.bm.allocate("b", list(range(100, 110)))
    assert h.bm.debug_state() == before


def test_slot_pressure_drops_snapshots_but_keeps_pages():
    h = Harness(num_blocks=64, block_size=4, num_slots=4)
    prompt = SYSTEM + list(range(12))
    h.start("a", prompt)
    for point in (8, 16, 24):  # three snapshots along one path
        h.shadow.compute("a", point)
        h.shadow.apply(h.bm.cache_prefix("a", point))
        if point == 8:
            h.bm.check_integrity()
    h.shadow.compute("a")
    h.finish("a")  # its slot becomes the snapshot at the end
    stats = h.bm.stats
    assert stats.num_trie_slots == 4 and h.bm.num_free_slots == 0
    pages_before = stats.num_trie_pages
    h.run("b", [7, 7, 7])  # needs a slot: the oldest snapshot goes
    stats = h.bm.stats
    assert stats.num_trie_slots == 3
    assert stats.num_trie_pages == pages_before  # pages stay: a tombstone
    h.finish("b")


def test_merge_after_a_branch_is_evicted():
    h = Harness(num_blocks=40, block_size=4)
    h.run("a", SYSTEM[:20] + [1] * 8)
    h.finish("a")
    h.run("b", SYSTEM[:20] + [2] * 8)
    h.finish("b")
    assert h.bm.stats.num_trie_nodes == 3  # a shared stem and two branches
    h.run("big", list(range(500, 560)))  # evicts the older branch
    h.finish("big")
    h.bm.check_integrity()  # includes: no mergeable parent/child pair left
    assert h.run("b2", SYSTEM[:20] + [2] * 8 + [5]).num_cached_tokens == 28


def test_reset_prefix_cache_drops_everything_unlocked():
    h = Harness()
    h.run("live", SYSTEM + [1])
    h.run("done", [5] * 20)
    h.finish("done")
    h.bm.reset_prefix_cache()
    h.bm.check_integrity()
    assert h.bm.num_cached_blocks == 0  # the live sequence locked nothing cached
    assert h.run("again", [5] * 20).num_cached_tokens == 0
    h.finish("live")
    h.finish("again")
    h.bm.reset_prefix_cache()
    assert h.bm.num_free_blocks == h.bm.config.num_blocks


def test_listener_follows_what_is_cached():
    class Recorder:
        def __init__(self):
            self.refs: dict[int, int] = {}

        def stored(self, pages, tokens):
            assert len(pages) >= 1 and len(tokens) >= 1
            for page in pages:
                self.refs[page] = self.refs.get(page, 0) + 1

        def removed(self, pages):
            for page in pages:
                self.refs[page] -= 1

    recorder = Recorder()
    bm = BlockManager(BlockManagerConfig(num_blocks=24, block_size=4), listener=recorder)
    for index in range(12):
        tokens = [index % 3] * 10 + [index] * (index + 1)
        bm.allocate(index, tokens)
        bm.free(index)
    assert bm.stats.num_evicted_nodes > 0
    # Splits and merges move pages between nodes; what the listener was told
    # is stored and not removed is still held by the trie.
    # With no sequence live, a page with references is held by the trie alone.
    assert bm.num_sequences == 0
    told = {page for page, refs in recorder.refs.items() if refs > 0}
    assert told <= {p for p in range(24) if bm.page_refcount(p) > 0}


def test_stats_count_queries_and_hits():
    h = Harness()
    h.run("a", SYSTEM + [1])
    h.finish("a")
    h.run("b", SYSTEM + [2])
    h.finish("b")
    stats = h.bm.stats
    assert stats.num_queries == 2 and stats.num_hits == 1
    assert stats.num_query_tokens == 2 * (len(SYSTEM) + 1)
    assert stats.num_hit_tokens == len(SYSTEM)
    assert stats.hit_rate == pytest.approx(len(SYSTEM) / (2 * (len(SYSTEM) + 1)))


def test_a_hit_inside_a_node_leaves_the_rest_of_it_evictable():
    # 8 pages of 4 tokens; the cache holds one 28-token prompt (7 pages).
    h = Harness(num_blocks=8, block_size=4)
    h.run("a", list(range(28)))
    h.finish("a")
    # Shares 8 tokens (2 pages) and needs 4 more pages with 1 free: only the
    # unshared tail of the cached node can make room, and it must.
    prompt = list(range(8)) + [99] * 16
    assert h.bm.can_allocate(prompt)
    alloc = h.run("b", prompt)
    assert alloc.num_cached_tokens == 8
    assert h.bm.stats.num_evicted_pages >= 3
    h.finish("b")


# ------------------------------------------------------------- borrowed pages
#
# A sequence locking a cached path takes no page references of its own for
# the full pages inside that path (the locked nodes hold them). Every call
# that could let the lock go, or write into such a page, must first take the
# references itself; check_integrity recounts them after each step.


def cached_system(h: Harness) -> None:
    """Cache SYSTEM as a node of its own (two prompts branch right after it)."""
    for seq_id, token in (("sys1", 1), ("sys2", 2)):
        h.run(seq_id, SYSTEM + [token])
        h.finish(seq_id)


def borrowing(h: Harness, seq_id, tokens) -> list[int]:
    """Start `seq_id` on the cached SYSTEM; return its borrowed pages."""
    alloc = h.run(seq_id, tokens)
    assert alloc.num_cached_tokens == len(SYSTEM)
    h.bm.check_integrity()
    # A sliding window starts the sequence with the pages before its window
    # released (None): only the pages of the window are borrowed.
    borrowed = [page for page in alloc.block_table[: len(SYSTEM) // 4] if page is not None]
    assert borrowed
    assert all(h.bm.page_refcount(page) == 1 for page in borrowed)  # the trie's only
    return borrowed


def test_a_hit_on_locked_nodes_takes_no_page_references():
    h = Harness()
    cached_system(h)
    free_before = h.bm.num_free_blocks
    borrowed = borrowing(h, "a", SYSTEM + [3, 4, 5])
    assert h.bm.num_free_blocks == free_before - 1  # only its own last page
    h.finish("a")
    assert all(h.bm.page_refcount(page) == 1 for page in borrowed)
    h.bm.reset_prefix_cache()
    assert h.bm.num_free_blocks == h.bm.config.num_blocks


@pytest.mark.parametrize("target", [38, 36, 20, 0])
def test_truncate_into_borrowed_pages_then_write_other_tokens(target):
    h = Harness()
    cached_system(h)
    borrowing(h, "a", SYSTEM + [3, 4, 5])
    h.shadow.apply(h.bm.truncate("a", target))
    h.shadow.computed["a"] = target
    h.bm.check_integrity()
    ops = h.bm.append("a", [77, 78, 79])
    # A page the new end falls inside is the trie's: it is copied, not written.
    assert any(isinstance(op, CopyBlock) for op in ops) == bool(target % 4)
    h.shadow.apply(ops)
    h.shadow.compute("a")
    h.bm.check_integrity()
    h.shadow.check_reads_back("a")
    assert h.run("b", SYSTEM + [9]).num_cached_tokens == len(SYSTEM)  # reads back intact
    h.finish("a")
    h.finish("b")


def test_a_fork_borrows_under_the_same_lock():
    h = Harness()
    cached_system(h)
    borrowed = borrowing(h, "a", SYSTEM + [3, 4, 5])
    h.shadow.apply(h.bm.fork("a", "child"))
    h.shadow.computed["child"] = h.shadow.computed["a"]
    h.bm.check_integrity()
    assert all(h.bm.page_refcount(page) == 1 for page in borrowed)
    h.finish("a")
    h.bm.reset_prefix_cache()  # the child's lock keeps the borrowed pages
    h.bm.check_integrity()
    h.shadow.check_reads_back("child")
    h.finish("child")


def test_swap_out_of_a_borrowing_sequence_leaves_the_cache_intact():
    h = Harness(num_host_blocks=16)
    cached_system(h)
    borrowed = borrowing(h, "a", SYSTEM + [3, 4, 5])
    h.shadow.apply(h.bm.swap_out("a"))
    h.bm.check_integrity()
    assert all(h.bm.page_refcount(page) == 1 for page in borrowed)  # still cached
    h.bm.reset_prefix_cache()
    h.bm.check_integrity()
    h.shadow.apply(h.bm.swap_in("a"))
    h.shadow.check_reads_back("a")
    h.finish("a")


def test_moving_the_lock_up_takes_the_borrowed_pages():
    h = Harness()
    cached_system(h)
    h.run("short", SYSTEM[:8] + [55] * 5)  # splits SYSTEM after 8 tokens
    h.finish("short")
    borrowing(h, "a", SYSTEM + [3, 4, 5])
    h.shadow.apply(h.bm.truncate("a", 38))  # below its lock: no longer anchored
    h.shadow.computed["a"] = 38
    h.shadow.apply(h.bm.cache_prefix("a", 8))  # locks [0, 8) instead
    h.bm.check_integrity()
    h.bm.reset_prefix_cache()  # the rest of SYSTEM is no longer locked
    h.bm.check_integrity()
    h.shadow.check_reads_back("a")
    h.finish("a")


def test_a_sliding_window_never_releases_borrowed_pages():
    h = Harness(sliding_window=8)
    cached_system(h)
    borrowed = borrowing(h, "a", SYSTEM + [3])
    for token in range(12):
        h.shadow.apply(h.bm.append("a", [token]))
        h.shadow.compute("a")
        h.bm.check_integrity()
    assert h.bm.block_table("a")[0] is None  # the window moved past them
    assert all(h.bm.page_refcount(page) == 1 for page in borrowed)
    h.finish("a")
    h.bm.check_integrity()
