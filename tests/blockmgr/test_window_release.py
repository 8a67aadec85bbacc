"""A sliding-window sequence releases each page exactly when it leaves the window.

Reference: the first token of an append, at position q, attends to keys
(q - W, q]; page j (positions j*bs .. (j+1)*bs - 1) is dead once its last
position is at most q - W. Counted here page by page, against the
manager's table after every append (chunks of 1 to 5 tokens, with and
without a prefix cache, from prompts of several lengths).
"""

from __future__ import annotations

import pytest

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    GroupedStore,
    GroupedStoreConfig,
    InvalidArgument,
)

BLOCK = 4
WINDOW = 10


def num_dead_pages(first_new_position: int, num_pages: int) -> int:
    """Pages whose every position is out of the window of the token at
    `first_new_position` (a naive page-by-page count)."""
    dead = 0
    for j in range(num_pages):
        last_position = (j + 1) * BLOCK - 1
        if last_position <= first_new_position - WINDOW:
            dead += 1
    return dead


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("prompt_len", [1, 7, 13])
def test_pages_leave_exactly_with_the_window(prefix_cache, prompt_len):
    bm = BlockManager(BlockManagerConfig(
        num_blocks=64, block_size=BLOCK, sliding_window=WINDOW, enable_prefix_cache=prefix_cache,
    ))
    bm.allocate("s", list(range(100, 100 + prompt_len)))
    chunks = [1, 2, 1, 3, 1, 5, 1, 1, 4]
    for step in range(24):
        num_before = bm.num_tokens("s")
        chunk = chunks[step % len(chunks)]
        bm.append("s", list(range(500, 500 + chunk)))
        table = bm.block_table("s")
        num_released = sum(1 for page in table if page is None)
        assert table[:num_released] == [None] * num_released  # released pages come first
        assert num_released == num_dead_pages(num_before, len(table)), (step, num_before)
        bm.check_integrity()


@pytest.mark.parametrize("accepted", [0, 2])
def test_a_restored_checkpoint_keeps_the_window_of_its_recompute(accepted):
    """recurrent_gemma-like (slots + window): a speculation committed with
    a rejection brings the checkpoint back, from where the tokens are
    computed again; appends until a larger computed count is given release
    only what the checkpoint's position no longer sees (the naive count)."""
    bm = BlockManager(BlockManagerConfig(
        num_blocks=64, block_size=BLOCK, sliding_window=WINDOW, num_slots=8,
    ))
    bm.allocate("s", list(range(100, 130)))  # 30 tokens, all computed, 1 more pending
    bm.append("s", [7])
    bm.begin_speculation({"s": [1, 2, 3, 4, 5]}, {"s": 30})
    assert bm.commit_speculation({"s": accepted}) == {"s"}  # a draft was rejected
    assert bm.recompute_from("s") == 30
    bm.check_integrity()
    num_held_back = 0  # appends where the new tokens alone would release more
    for num_computed in [None, 30, 30, 34]:
        num_before = bm.num_tokens("s")
        bm.append("s", [8, 9, 10], num_computed)
        table = bm.block_table("s")
        first_to_compute = 30 if num_computed in (None, 30) else 34
        num_dead = num_dead_pages(first_to_compute, len(table))
        assert sum(page is None for page in table) == num_dead
        num_held_back += num_dead_pages(num_before, len(table)) > num_dead
        bm.check_integrity()
    assert num_held_back >= 2
    assert bm.recompute_from("s") == 34
    with pytest.raises(ValueError):  # its window is gone: no checkpoint there
        bm.begin_speculation({"s": [1]}, {"s": 20})
    bm.append("s", [1], bm.num_tokens("s"))  # all computed: the hold ends
    assert bm.recompute_from("s") is None
    bm.check_integrity()


@pytest.mark.parametrize("windows", [(WINDOW,), (None, WINDOW)])
def test_a_computed_count_whose_window_was_released_is_refused(windows):
    """`append(..., num_computed)` naming a position whose window pages are
    gone (in any group) raises and changes nothing; one still inside the
    window is taken."""
    store = GroupedStore(GroupedStoreConfig(num_blocks=16, block_size=BLOCK, windows=windows))
    store.allocate("s", list(range(14)))
    store.append("s", [1])  # from 14: page 0 falls out of the window
    released = num_dead_pages(14, 4)
    assert store.block_table("s", len(windows) - 1)[:released] == [None] * released
    before = store.debug_state()
    with pytest.raises(InvalidArgument, match="released"):
        store.append("s", [2], released * BLOCK + WINDOW - 2)  # attends to page released - 1
    assert store.debug_state() == before
    store.append("s", [2], released * BLOCK + WINDOW - 1)  # attends from page `released` on
    store.check_integrity()
