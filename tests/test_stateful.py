"""Stateful property tests: random call sequences against the shadow storage.

After every step: `check_integrity()` holds and every live sequence reads back
exactly its own tokens (and recurrent state) through the applied plans. Every
refused call leaves `debug_state()` unchanged. At the end every page and slot
is free or held by the trie, and a reset frees them all.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import numpy as np

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    BlockManagerError,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
)
from tests.shadow import ShadowStorage

# A few shared stems make prefix hits, splits and branch points common.
STEMS = [[], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [5] * 11, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]]
prompts = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 6), min_size=1, max_size=9),
)
namespaces = st.sampled_from([None, "tenant-b"])
# Token lists every call must refuse (typed error, nothing changed).
BAD_TOKENS = [
    [1, None], [1, 2.0], [True], [3, -1], [[1]], [1, {}], "ab", None, 5,
    np.array([1.5]), np.array([[1, 2]]), [1, "x"], list(range(20)) + [None],
]


class BlockManagerMachine(RuleBasedStateMachine):
    config = BlockManagerConfig(num_blocks=24, block_size=4, num_host_blocks=10)

    @initialize()
    def start(self) -> None:
        self.bm = BlockManager(self.config)
        self.shadow = ShadowStorage(self.bm)
        self.next_id = 0
        self.seen: list[list[int]] = []  # every prompt allocated so far

    # ---------------------------------------------------------------- helpers

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def live(self) -> list[str]:
        return sorted(self.shadow.computed)

    def resident(self) -> list[str]:
        """Live sequences that are not swapped out."""
        return [s for s in self.live() if not self.bm.is_swapped(s)]

    def settled(self) -> list[str]:
        """Resident sequences whose reserved tokens are all computed."""
        return [s for s in self.resident() if self.shadow.computed[s] == self.bm.num_tokens(s)]

    def swapped(self) -> list[str]:
        return [s for s in self.live() if self.bm.is_swapped(s)]

    def refused(self, call, *errors) -> bool:
        """Run `call`; if it raises one of `errors`, the state must not move."""
        before = self.bm.debug_state()
        try:
            self.result = call()
        except errors:
            assert self.bm.debug_state() == before, "a refused call changed the state"
            return True
        return False

    # ------------------------------------------------------------------ rules

    @rule(tokens=prompts, namespace=namespaces)
    def allocate(self, tokens, namespace) -> None:
        seq_id = self.new_id()
        self.seen.append(list(tokens))
        expect_ok = self.bm.can_allocate(tokens, namespace)
        expect_cached = self.bm.cached_prefix_length(tokens, namespace)
        if self.refused(
            lambda: self.bm.allocate(seq_id, tokens, namespace), OutOfBlocks, OutOfSlots
        ):
            assert not expect_ok, "can_allocate said yes but allocate refused"
            return
        assert expect_ok, "can_allocate said no but allocate succeeded"
        alloc = self.result
        assert alloc.num_cached_tokens < len(tokens)
        # Eviction to make room never touches the matched (locked) prefix.
        assert alloc.num_cached_tokens == expect_cached
        assert alloc.block_table == self.bm.block_table(seq_id)
        self.shadow.apply(alloc.ops)
        self.shadow.computed[seq_id] = alloc.num_cached_tokens
        self.shadow.check_reads_back(seq_id)  # a hit must hold real data

    @precondition(lambda self: self.seen)
    @rule(
        data=st.data(),
        tail=st.lists(st.integers(0, 6), min_size=1, max_size=5),
        namespace=namespaces,
    )
    def allocate_again(self, data, tail, namespace) -> None:
        """A prompt sharing a prefix with an earlier one, maybe prefilled."""
        base = data.draw(st.sampled_from(self.seen))
        seq_id = f"s{self.next_id + 1}"
        self.allocate(base[: data.draw(st.integers(1, len(base)))] + tail, namespace)
        if seq_id in self.shadow.computed and data.draw(st.booleans()):
            self.shadow.compute(seq_id)

    @rule(tokens=prompts, namespace=namespaces)
    def request(self, tokens, namespace) -> None:
        """A whole request at once (allocate, prefill, free): fills the trie,
        so later prompts hit locked nodes and borrow their pages."""
        seq_id = f"s{self.next_id + 1}"
        self.allocate(tokens, namespace)
        if seq_id in self.shadow.computed:
            self.shadow.compute(seq_id)
            self.shadow.apply(self.bm.free(seq_id, self.shadow.computed.pop(seq_id)))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def compute(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        start, end = self.shadow.computed[seq_id], self.bm.num_tokens(seq_id)
        self.shadow.compute(seq_id, data.draw(st.integers(start, end)))

    @precondition(lambda self: self.settled())
    @rule(data=st.data(), new=st.lists(st.integers(0, 6), min_size=1, max_size=6))
    def append(self, data, new) -> None:
        seq_id = data.draw(st.sampled_from(self.settled()))
        expect_ok = self.bm.can_append(seq_id, len(new))
        if self.refused(lambda: self.bm.append(seq_id, new), OutOfBlocks, OutOfSlots):
            assert not expect_ok
            return
        assert expect_ok
        self.shadow.apply(self.result)

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def fork(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.settled()))
        child = self.new_id()
        self.shadow.apply(self.bm.fork(seq_id, child))
        self.shadow.computed[child] = self.shadow.computed[seq_id]

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.settled()))
        target = data.draw(st.integers(0, self.bm.num_tokens(seq_id)))
        if self.refused(
            lambda: self.bm.truncate(seq_id, target), NoSnapshot, OutOfSlots, ValueError
        ):
            return
        self.shadow.apply(self.result)
        self.shadow.computed[seq_id] = target

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def cache_prefix(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        computed = self.shadow.computed[seq_id]
        # Recurrent state exists only at the computed end; KV at any prefix.
        upto = computed if self.config.num_slots else data.draw(st.integers(0, computed))
        if self.refused(lambda: self.bm.cache_prefix(seq_id, upto), OutOfSlots):
            return
        self.shadow.apply(self.result)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.shadow.apply(self.bm.free(seq_id, self.shadow.computed.pop(seq_id)))

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.settled()))
        expect_ok = self.bm.can_swap_out(seq_id)
        if self.refused(lambda: self.bm.swap_out(seq_id), OutOfHostMemory):
            assert not expect_ok
            return
        assert expect_ok
        self.shadow.apply(self.result)

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.swapped()))
        expect_ok = self.bm.can_swap_in(seq_id)
        if self.refused(lambda: self.bm.swap_in(seq_id), OutOfBlocks, OutOfSlots):
            assert not expect_ok
            return
        assert expect_ok
        self.shadow.apply(self.result)

    @rule(data=st.data(), tokens=st.sampled_from(BAD_TOKENS))
    def bad_call(self, data, tokens) -> None:
        """A refused call of any kind: bad tokens, counts, ids."""
        live = self.live()
        target = data.draw(st.sampled_from(live)) if live else "missing"
        bm = self.bm
        calls = [
            lambda: bm.allocate("bad-new", tokens),
            lambda: bm.allocate("bad-new", []),
            lambda: bm.can_allocate(tokens),
            lambda: bm.cached_prefix_length(tokens),
            lambda: bm.append(target, tokens),
            lambda: bm.allocate(target if live else ["unhashable"], [1]),
            lambda: bm.fork(target, target if live else "x"),
            lambda: bm.free(target, data.draw(st.sampled_from([-1, 1.5, True, 10**6, "1"]))),
            lambda: bm.truncate(target, data.draw(st.sampled_from([-1, 2.0, 10**6, None]))),
            lambda: bm.cache_prefix(target, -3),
            lambda: bm.can_append(target, -1),
            lambda: bm.free("missing"),
        ]
        call = data.draw(st.sampled_from(calls))
        assert self.refused(call, BlockManagerError), "a bad call was accepted"

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    # -------------------------------------------------------------- checking

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_integrity()
        self.shadow.check_all()

    def managers(self) -> list:
        """The block managers whose pools the teardown checks."""
        return [self.bm]

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq_id in self.live():
            self.bm.free(seq_id, self.shadow.computed.pop(seq_id))
        self.bm.check_integrity()
        for m in self.managers():  # nothing leaks: what is not free is held by the trie
            assert m.config.num_blocks - m.num_free_blocks == m.num_cached_blocks
        self.bm.reset_prefix_cache()
        self.bm.check_integrity()
        for m in self.managers():
            assert m.num_free_blocks == m.config.num_blocks
            assert m.num_free_slots == m.config.num_slots
            assert m.num_free_host_blocks == m.config.num_host_blocks
            assert m.num_free_host_slots == m.config.num_host_slots


class HybridMachine(BlockManagerMachine):
    config = BlockManagerConfig(
        num_blocks=24, block_size=4, num_slots=6, num_host_blocks=8, num_host_slots=2
    )


class SlidingWindowMachine(BlockManagerMachine):
    config = BlockManagerConfig(num_blocks=24, block_size=4, sliding_window=6, num_host_blocks=6)


class NoPrefixCacheMachine(BlockManagerMachine):
    config = BlockManagerConfig(num_blocks=16, block_size=3, enable_prefix_cache=False)


class WatermarkMachine(BlockManagerMachine):
    config = BlockManagerConfig(num_blocks=20, block_size=2, watermark=0.2, num_slots=3)


# BLOCKMGR_STATEFUL_EXAMPLES / BLOCKMGR_STATEFUL_STEPS run them harder, e.g.
# 1000 and 60 before a change to the reference counting is merged.
_SETTINGS = dict(
    max_examples=int(os.environ.get("BLOCKMGR_STATEFUL_EXAMPLES", "120")),
    stateful_step_count=int(os.environ.get("BLOCKMGR_STATEFUL_STEPS", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _test_case(machine: type[RuleBasedStateMachine]):
    case = machine.TestCase
    case.settings = settings(**_SETTINGS)
    return case


TestBlockManager = _test_case(BlockManagerMachine)
TestHybrid = _test_case(HybridMachine)
TestSlidingWindow = _test_case(SlidingWindowMachine)
TestNoPrefixCache = _test_case(NoPrefixCacheMachine)
TestWatermark = _test_case(WatermarkMachine)
