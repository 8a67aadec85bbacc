"""`GroupedStore.allocate` when a group lacks room: which error, and nothing changed.

The store checks groups 1.. with `can_allocate` and lets group 0's own
`allocate` check itself; whichever groups lack room, the error raised is
that of the first group in group order that cannot allocate (the same as
checking every group in order), and no group changed. The groups here have
different pool sizes, so the `OutOfBlocks` message ("... free of N") says
which group raised it.
"""

from __future__ import annotations

import pytest

from blockmgr import GroupedStore, GroupedStoreConfig, OutOfBlocks

BLOCK = 4


def store(num_blocks: int, window_blocks: int) -> GroupedStore:
    """Group 0: full attention with `num_blocks` pages; group 1: a 64-token
    window with `window_blocks` pages."""
    return GroupedStore(GroupedStoreConfig(
        num_blocks=num_blocks, block_size=BLOCK, windows=(None, 64), window_blocks=window_blocks,
    ))


@pytest.mark.parametrize(
    ("num_blocks", "window_blocks", "num_pages", "raised_by"),
    [
        (12, 6, 8, "free of 6"),  # only group 1 lacks room
        (6, 12, 8, "free of 6"),  # only group 0
        (10, 6, 12, "free of 10"),  # both: group 0's error
    ],
)
def test_the_first_group_without_room_raises_and_nothing_changes(
    num_blocks, window_blocks, num_pages, raised_by
):
    s = store(num_blocks, window_blocks)
    s.allocate("a", list(range(1000, 1000 + 2 * BLOCK)))  # 2 pages in each group
    s.free("a")  # cached: reclaimable, but not enough
    before = s.debug_state()
    prompt = list(range(2000, 2000 + num_pages * BLOCK))
    assert not s.can_allocate(prompt)
    with pytest.raises(OutOfBlocks, match=raised_by):
        s.allocate("b", prompt)
    assert s.debug_state() == before
    assert "b" not in s
    s.check_integrity()


def test_an_allocation_that_fits_every_group_keeps_each_groups_own_tokens():
    """Group 0 keeps the checked prompt list, the others a copy: appending
    to one sequence extends each group's tokens once, and the caller's list
    is never the store's."""
    s = store(16, 16)
    prompt = list(range(1000, 1010))
    s.allocate("a", prompt)
    prompt.append(7)  # the caller's list is not the sequence's
    s.append("a", [8])
    assert s.tokens("a") == list(range(1000, 1010)) + [8]
    s.check_integrity()
