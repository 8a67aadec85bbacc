"""A hit that reaches into a demoted node loads that node whole: when that
and the new pages do not fit on the device together, the allocation uses
a miss instead of failing where a miss would succeed."""

from __future__ import annotations

from blockmgr import BlockManager, BlockManagerConfig


def manager():
    return BlockManager(BlockManagerConfig(num_blocks=12, block_size=8,
                                           num_host_cache_blocks=16))


def test_a_demoted_node_too_big_to_load_beside_the_prompt_falls_back_to_a_miss():
    bm = manager()
    first = [7] + list(range(100, 148))  # 49 tokens: 7 pages
    bm.allocate("x", first)
    bm.free("x")
    bm.allocate("y", list(range(200, 260)))  # 8 pages: x's node goes to the host tier
    bm.free("y")
    prompt = [7] + list(range(300, 354))  # shares 1 token with x; 7 pages of its own
    match = bm.find_prefix(prompt)
    assert match.loads  # the hit reaches x's demoted node (49 tokens, 7 pages)
    before = bm.debug_state()
    assert bm.can_allocate(prompt)
    assert bm.debug_state() == before
    alloc = bm.allocate("z", prompt)
    assert alloc.num_cached_tokens == 0
    bm.check_integrity()
    bm.free("z")
    bm.check_integrity()


def test_a_demoted_hit_that_fits_is_still_loaded():
    bm = manager()
    first = list(range(100, 140))  # 5 pages
    bm.allocate("x", first)
    bm.free("x")
    bm.allocate("y", list(range(200, 260)))
    bm.free("y")
    alloc = bm.allocate("z", first + [1, 2])
    assert alloc.num_cached_tokens == len(first)
    assert any(type(op).__name__ == "MovePage" for op in alloc.ops)
    bm.check_integrity()
