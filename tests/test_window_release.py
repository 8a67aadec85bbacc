"""A sliding-window sequence releases each page exactly when it leaves the window.

Reference: the first token of an append, at position q, attends to keys
(q - W, q]; page j (positions j*bs .. (j+1)*bs - 1) is dead once its last
position is at most q - W. Counted here page by page, against the
manager's table after every append (chunks of 1 to 5 tokens, with and
without a prefix cache, from prompts of several lengths).
"""

from __future__ import annotations

import pytest

from blockmgr import BlockManager, BlockManagerConfig

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
