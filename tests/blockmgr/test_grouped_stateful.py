"""Stateful property tests of `GroupedStore`: random calls against shadow storage.

The same rules as `test_stateful.py`, driven on stores with several layer
groups (full attention, sliding windows, recurrent slots). After every step
`check_integrity()` holds (every group's invariants and their agreement)
and every live sequence reads back exactly its own tokens in every group's
pages. Every refused call, the bad calls of `bad_call` included, leaves
`debug_state()` unchanged. At the end nothing leaks in any group.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import initialize, precondition, rule

from blockmgr import (
    DuplicateSequence,
    GroupedStore,
    GroupedStoreConfig,
    InvalidArgument,
    SequenceSwapped,
    SpeculationInFlight,
    UnknownSequence,
)
from tests.blockmgr.test_stateful import BlockManagerMachine, _test_case
from tests.shadow import GroupedShadowStorage

#: Calls no store may accept: each must raise and change nothing.
BAD_CALLS = [
    ("allocate an empty prompt", lambda s, live: s.allocate("new", [])),
    ("allocate a str prompt", lambda s, live: s.allocate("new", "abc")),
    ("allocate an int prompt", lambda s, live: s.allocate("new", 5)),
    ("allocate a live id", lambda s, live: s.allocate(live, [1, 2])),
    ("allocate an unhashable id", lambda s, live: s.allocate(["x"], [1, 2])),
    ("allocate in an unhashable namespace", lambda s, live: s.allocate("new", [1], ["ns"])),
    ("append to an unknown id", lambda s, live: s.append("nobody", [1])),
    ("fork an unknown id", lambda s, live: s.fork("nobody", "new")),
    ("fork onto a live id", lambda s, live: s.fork(live, live)),
    ("truncate past the end", lambda s, live: s.truncate(live, 10_000)),
    ("truncate to a negative length", lambda s, live: s.truncate(live, -1)),
    ("cache more than the tokens", lambda s, live: s.cache_prefix(live, 10_000)),
    ("free more than the tokens", lambda s, live: s.free(live, 10_000)),
    ("free an unknown id", lambda s, live: s.free("nobody")),
    ("swap in a resident sequence", lambda s, live: s.swap_in(live)),
    ("ask a missing group", lambda s, live: s.block_table(live, 99)),
    ("speculate with a str draft", lambda s, live: s.begin_speculation({live: "ab"})),
    ("speculate on an unknown id", lambda s, live: s.begin_speculation({"nobody": [1]})),
    ("speculate with a list", lambda s, live: s.begin_speculation([(live, [1])])),
    ("speculate from a negative count",
     lambda s, live: s.begin_speculation({live: [1]}, {live: -1})),
    ("speculate from past the tokens",
     lambda s, live: s.begin_speculation({live: [1]}, {live: 10_000})),
    ("speculate from a count without drafts",
     lambda s, live: s.begin_speculation({live: [1]}, {"nobody": 0})),
    ("append with computed past the tokens", lambda s, live: s.append(live, [1], 10_000)),
    ("commit an unknown id", lambda s, live: s.commit_speculation({"nobody": 0})),
    ("commit a negative count", lambda s, live: s.commit_speculation({live: -1})),
    ("commit past the drafts", lambda s, live: s.commit_speculation({live: 10_000})),
    ("abort a str", lambda s, live: s.abort_speculation("ab")),
    ("shorten past the drafts", lambda s, live: s.shorten_speculation({live: 10_000})),
    ("shorten a negative count", lambda s, live: s.shorten_speculation({live: -1})),
    ("shorten an unknown id", lambda s, live: s.shorten_speculation({"nobody": 0})),
    ("shorten with a list", lambda s, live: s.shorten_speculation([(live, 0)])),
]
REFUSALS = (
    InvalidArgument, UnknownSequence, DuplicateSequence, SequenceSwapped, SpeculationInFlight
)


class GroupedMachine(BlockManagerMachine):
    """Full attention + two sliding windows (one shorter than a page pair)."""

    config = GroupedStoreConfig(
        num_blocks=24, block_size=4, windows=(None, 6, 9), window_blocks=18, num_host_blocks=8
    )

    @initialize()
    def start(self) -> None:
        self.bm = GroupedStore(self.config)
        self.shadow = GroupedShadowStorage(self.bm)
        self.next_id = 0
        self.seen: list[list[int]] = []
        self.speculating: dict[str, tuple[int, int]] = {}
        self.pins: list[str] = []

    @rule(data=st.data(), which=st.integers(0, len(BAD_CALLS) - 1))
    def bad_call(self, data, which) -> None:
        name, call = BAD_CALLS[which]
        # Every call is bad whatever the target, but swapping in needs one
        # that is not swapped out, and the duplicate-id calls a live one.
        live = self.resident() if name == "swap in a resident sequence" else self.live()
        target = data.draw(st.sampled_from(live)) if live else "nobody"
        if not live and name in ("fork onto a live id", "allocate a live id"):
            return
        before = self.bm.debug_state()
        try:
            call(self.bm, target)
        except REFUSALS:
            assert self.bm.debug_state() == before, f"refused call {name!r} changed the state"
        else:
            raise AssertionError(f"bad call {name!r} was accepted")

    @precondition(lambda self: self.speculating)
    @rule(data=st.data())
    def shorten_speculation(self, data) -> None:
        """Undo appends whose forward never ran: drop some uncomputed
        speculative tokens (the transactions stay open)."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.speculating)), min_size=1,
                                 max_size=3, unique=True))
        kept = {}
        for seq_id in ids:
            start, _ = self.speculating[seq_id]
            # Never below what was computed: the slot holds the state there.
            low = max(0, self.shadow.computed[seq_id] - start)
            kept[seq_id] = data.draw(st.integers(low, self.bm.num_tokens(seq_id) - start))
        self.bm.shorten_speculation(kept)
        for seq_id, num in kept.items():
            assert self.bm.num_tokens(seq_id) == self.speculating[seq_id][0] + num
            assert self.bm.speculation_start(seq_id) == self.speculating[seq_id][0]


class HybridSlidingMachine(GroupedMachine):
    """gemma3-like full + sliding groups with recurrent slots (group 0)."""

    config = GroupedStoreConfig(
        num_blocks=24, block_size=4, windows=(None, 6), num_slots=6,
        num_host_blocks=8, num_host_slots=2,
    )


class SlidingRecurrentMachine(GroupedMachine):
    """recurrent_gemma-like: a sliding window and slots in one group."""

    config = GroupedStoreConfig(
        num_blocks=24, block_size=4, windows=(7,), num_slots=6, num_host_blocks=8,
        num_host_slots=2,
    )


class SlidingPressureMachine(GroupedMachine):
    """A sliding group far smaller than the full one: its pressure alone
    evicts (and refuses) while the full group has room."""

    config = GroupedStoreConfig(
        num_blocks=40, block_size=4, windows=(None, 5), window_blocks=9, num_host_blocks=6
    )


class TieredGroupedMachine(GroupedMachine):
    """gemma3-like groups over host and disk tiers (restarts included)."""

    config = GroupedStoreConfig(
        num_blocks=18, block_size=4, windows=(None, 6), window_blocks=14, num_host_blocks=6,
        num_host_cache_blocks=5, num_disk_blocks=9,
    )


class TieredHybridSlidingMachine(GroupedMachine):
    config = GroupedStoreConfig(
        num_blocks=20, block_size=4, windows=(None, 6), num_slots=6, num_host_blocks=6,
        num_host_slots=2, num_disk_blocks=10, num_disk_slots=4,
    )


TestGrouped = _test_case(GroupedMachine)
TestTieredGrouped = _test_case(TieredGroupedMachine)
TestTieredHybridSliding = _test_case(TieredHybridSlidingMachine)
TestSlidingPressure = _test_case(SlidingPressureMachine)
TestHybridSliding = _test_case(HybridSlidingMachine)
TestSlidingRecurrent = _test_case(SlidingRecurrentMachine)


def test_a_raising_listener_on_a_grouped_store_changes_no_outcome():
    """The listener follows group 0; what it raises is kept for its owner and
    the calls (free of a live id included) succeed in every group."""

    class Raising:
        def __init__(self) -> None:
            self.calls = 0

        def stored(self, pages, tokens):
            self.calls += 1
            raise RuntimeError("listener fault")

        def removed(self, pages):
            raise RuntimeError("listener fault")

    listener = Raising()
    store = GroupedStore(GroupedStoreConfig(num_blocks=8, block_size=4, windows=(None, 6)),
                         listener)
    shadow = GroupedShadowStorage(store)
    shadow.apply(store.allocate("a", list(range(10))).ops)
    shadow.computed["a"] = 0
    shadow.compute("a")
    shadow.apply(store.free("a"))
    assert "a" not in store and listener.calls == 1
    errors = store.take_listener_errors()
    assert [event for event, _ in errors] == ["stored"]
    store.check_integrity()
    alloc = store.allocate("b", list(range(10)) + [99])  # the trie kept "a" in every group
    assert alloc.num_cached_tokens == 10
    store.check_integrity()
