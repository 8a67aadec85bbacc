"""Stateful property tests: random call sequences against the shadow storage.

After every step: `check_integrity()` holds and every live sequence reads back
exactly its own tokens (and recurrent state) through the applied plans. Every
refused call leaves `debug_state()` unchanged. At the end every page and slot
is free or held by the trie, and a reset frees them all.
"""

from __future__ import annotations

import copy
import os

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    BlockManagerError,
    DuplicateSequence,
    NoSnapshot,
    OutOfBlocks,
    OutOfHostMemory,
    OutOfSlots,
)
from blockmgr.ops import CopyBlock, MovePage, SwapIn, SwapOut, Tier
from tests.shadow import ShadowStorage

PAGE_OPS = (CopyBlock, SwapIn, SwapOut, MovePage)  # the ops that name their layer group

# A few shared stems make prefix hits, splits and branch points common.
STEMS = [[], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [5] * 11, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]]
prompts = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 6), min_size=1, max_size=9),
)
namespaces = st.sampled_from([None, "tenant-b"])
retentions = st.sampled_from([0, 0, 1, 2])  # retention priorities: most requests the default
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
        # Open speculations: seq_id -> (token count at begin, computed at begin).
        self.speculating: dict[str, tuple[int, int]] = {}
        self.pins: list[str] = []

    # ---------------------------------------------------------------- helpers

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def live(self) -> list[str]:
        return sorted(self.shadow.computed)

    def resident(self) -> list[str]:
        """Live sequences that are not swapped out, with no speculation open."""
        return [
            s for s in self.live() if not self.bm.is_swapped(s) and s not in self.speculating
        ]

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

    @rule(tokens=prompts, namespace=namespaces, retention=retentions)
    def allocate(self, tokens, namespace, retention=0) -> None:
        seq_id = self.new_id()
        self.seen.append(list(tokens))
        expect_ok = self.bm.can_allocate(tokens, namespace)
        expect_cached = self.bm.cached_prefix_length(tokens, namespace)
        if self.refused(
            lambda: self.bm.allocate(seq_id, tokens, namespace, retention=retention),
            OutOfBlocks, OutOfSlots,
        ):
            assert not expect_ok, "can_allocate said yes but allocate refused"
            return
        assert expect_ok, "can_allocate said no but allocate succeeded"
        alloc = self.result
        assert alloc.num_cached_tokens < len(tokens)
        if alloc.num_cached_tokens != expect_cached:
            # A hit on demoted nodes whose loads do not fit beside the
            # allocation is served as a miss, loading nothing
            # (`cached_prefix_length` does not ask for the room).
            assert self.config.has_cache_tiers and alloc.num_cached_tokens == 0
            assert not any(isinstance(op, MovePage) and op.dst_tier == Tier.DEVICE
                           for op in alloc.ops)
        # Eviction to make room never touches the matched (locked) prefix.
        assert alloc.num_cached_tokens <= expect_cached
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
        self.allocate(base[: data.draw(st.integers(1, len(base)))] + tail, namespace,
                      data.draw(retentions))
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
    def append_decode(self, data) -> None:
        """One decode step of several sequences in one call. Reference: the
        same appends row by row on a copy of the store taken before. A
        batch that succeeds must leave exactly the state (and the plans,
        group by group) of the row-by-row appends; one refused changes nothing."""
        seq_ids = data.draw(st.lists(st.sampled_from(self.settled()), min_size=1, unique=True))
        tokens = data.draw(st.lists(st.integers(0, 6), min_size=len(seq_ids),
                                    max_size=len(seq_ids)))
        expect_ok = self.bm.can_append_decode(seq_ids)
        reference = copy.deepcopy(self.bm)
        if self.refused(lambda: self.bm.append_decode(seq_ids, tokens), OutOfBlocks, OutOfSlots):
            assert not expect_ok, "can_append_decode said yes but append_decode refused"
            return
        assert expect_ok, "can_append_decode said no but append_decode succeeded"
        row_by_row = [op for seq_id, token in zip(seq_ids, tokens)
                      for op in reference.append(seq_id, [token])]
        assert self.bm.debug_state() == reference.debug_state()
        assert _by_group(self.result) == _by_group(row_by_row)
        self.shadow.apply(self.result)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new=st.lists(st.integers(0, 6), min_size=1, max_size=3))
    def append_pending(self, data, new) -> None:
        """The next token of a sequence whose tokens are not all computed
        (after a restored checkpoint: the engine's next decode step), told
        the computed count as `PagedCache` does; the next compute starts
        there, and the shadow asserts its window's pages are still held."""
        seq_id = data.draw(st.sampled_from(self.resident()))
        computed = self.shadow.computed[seq_id]
        if self.refused(lambda: self.bm.append(seq_id, new, computed), OutOfBlocks, OutOfSlots):
            return
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
        self.free_sequence(seq_id)

    def free_sequence(self, seq_id: str) -> None:
        """Free with the computed count; a speculating sequence's is what its
        storage holds once the drafts are gone (hybrid: the checkpoint's)."""
        computed = self.shadow.computed.pop(seq_id)
        if seq_id in self.speculating:
            start, at_begin = self.speculating.pop(seq_id)
            # The abort restores a hybrid checkpoint only when drafts are cut.
            restored = self.config.num_slots and self.bm.num_tokens(seq_id) > start
            computed = at_begin if restored else min(computed, start)
        self.shadow.apply(self.bm.free(seq_id, computed))

    # ------------------------------------------------------------ speculation

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def begin_speculation(self, data) -> None:
        """Drafts for some idle sequences at once (some with pending tokens,
        as a verification forward sees them); maybe "verify" right away."""
        ids = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3,
                                 unique=True))
        drafts = {s: data.draw(st.lists(st.integers(0, 6), max_size=6)) for s in ids}
        # A hybrid checkpoint holds the state after the computed tokens: say
        # so (as `PagedCache` does), else the default (the hold, or all): only
        # true, so only taken, when no sequence has tokens still to compute.
        num_computed = None
        pending = any(self.shadow.computed[s] != self.bm.num_tokens(s) for s in ids)
        if self.config.num_slots and (pending or data.draw(st.booleans())):
            num_computed = {s: self.shadow.computed[s] for s in ids}
        expect_ok = self.bm.can_speculate(drafts, num_computed)
        if self.refused(lambda: self.bm.begin_speculation(drafts, num_computed),
                        OutOfBlocks, OutOfSlots):
            assert not expect_ok, "can_speculate said yes but begin_speculation refused"
            return
        assert expect_ok, "can_speculate said no but begin_speculation succeeded"
        self.shadow.apply(self.result)
        for seq_id, tokens in drafts.items():
            start = self.bm.num_tokens(seq_id) - len(tokens)
            self.speculating[seq_id] = (start, self.shadow.computed[seq_id])
            if data.draw(st.booleans()):
                self.shadow.compute(seq_id)

    @precondition(lambda self: self.speculating)
    @rule(data=st.data(), new=st.lists(st.integers(0, 6), min_size=1, max_size=3))
    def append_draft(self, data, new) -> None:
        """A draft model's next token(s): appended inside the transaction."""
        seq_id = data.draw(st.sampled_from(sorted(self.speculating)))
        if self.shadow.computed[seq_id] != self.bm.num_tokens(seq_id):
            self.shadow.compute(seq_id)
        if self.refused(lambda: self.bm.append(seq_id, new), OutOfBlocks, OutOfSlots):
            return
        self.shadow.apply(self.result)

    @precondition(lambda self: self.speculating)
    @rule(data=st.data())
    def commit_speculation(self, data) -> None:
        """Keep a random number of drafts per sequence (the verification
        forward ran, or not: a commit before it is an abort's case)."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.speculating)), min_size=1,
                                 max_size=3, unique=True))
        accepted = {}
        for seq_id in ids:
            start, _ = self.speculating[seq_id]
            if data.draw(st.booleans()):
                self.shadow.compute(seq_id)
            accepted[seq_id] = data.draw(st.integers(0, self.bm.num_tokens(seq_id) - start))
        tails = {seq_id: self.bm.num_tokens(seq_id) for seq_id in accepted}
        if data.draw(st.booleans()):
            restored = self.bm.commit_speculation(accepted)
        else:
            accepted = dict.fromkeys(accepted, 0)
            self.bm.abort_speculation(list(accepted))
            restored = None
        self.end_speculation(accepted, tails, restored)

    def end_speculation(self, accepted: dict, num_before: dict, restored) -> None:
        """The shadow's side of a commit: tokens past the kept ones are gone;
        a hybrid sequence that kept fewer than all is back at its checkpoint
        (and must compute again from where that state ends)."""
        expected = set()
        for seq_id, num in accepted.items():
            start, at_begin = self.speculating.pop(seq_id)
            end = start + num
            assert self.bm.num_tokens(seq_id) == end
            if self.config.num_slots and end < num_before[seq_id]:
                expected.add(seq_id)
                self.shadow.computed[seq_id] = at_begin
            else:
                self.shadow.computed[seq_id] = min(self.shadow.computed[seq_id], end)
        if restored is not None:
            assert restored == expected, f"restored {set(restored)}, expected {expected}"

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
            lambda: bm.allocate("bad-new", [1], retention=data.draw(
                st.sampled_from([1.5, True, "1", None]))),
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
            lambda: bm.begin_speculation({target: tokens}),
            lambda: bm.begin_speculation([(target, [1])]),
            lambda: bm.begin_speculation({"missing": [1]}),
            lambda: bm.begin_speculation({target: [1]}, {target: -1}),
            lambda: bm.begin_speculation({target: [1]}, {target: 10**6}),
            lambda: bm.begin_speculation({target: [1]}, {"other": 0}),
            lambda: bm.begin_speculation({target: [1]}, [(target, 0)]),
            lambda: bm.append(target, [1], data.draw(st.sampled_from([-1, 10**6, 1.5, True]))),
            lambda: bm.commit_speculation({target: -1}),
            lambda: bm.commit_speculation({target: 10**6}),
            lambda: bm.commit_speculation({"missing": 0}),
            lambda: bm.abort_speculation("ab"),
            lambda: bm.append_decode([target], tokens),
            lambda: bm.append_decode([target, target], [1, 2]),
            lambda: bm.append_decode([target, "missing"], [1, 2]),
            lambda: bm.append_decode([target], [1, 2]),
            lambda: bm.append_decode(target, [1]),
            lambda: bm.can_append_decode([target, "missing"]),
        ]
        speculating = sorted(self.speculating)
        if speculating:  # what an open transaction refuses
            spec = data.draw(st.sampled_from(speculating))
            calls += [
                lambda: bm.begin_speculation({spec: [1]}),
                lambda: bm.fork(spec, "bad-new"),
                lambda: bm.truncate(spec, 0),
                lambda: bm.cache_prefix(spec),
                lambda: bm.swap_out(spec),
                lambda: bm.free(spec, self.speculating[spec][0] + 1),
            ]
        else:  # a commit of a sequence with nothing open
            calls.append(lambda: bm.commit_speculation({target: 0}))
        call = data.draw(st.sampled_from(calls))
        assert self.refused(call, BlockManagerError), "a bad call was accepted"

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    @precondition(lambda self: self.config.enable_prefix_cache and self.seen)
    @rule(data=st.data())
    def pin(self, data) -> None:
        """Pin a prefix: it stays cached (and on the device) whatever comes."""
        tokens = data.draw(st.sampled_from(self.seen))
        self.next_id += 1
        pin_id = f"pin{self.next_id}"
        if self.refused(lambda: self.bm.pin(pin_id, tokens), OutOfBlocks, OutOfSlots):
            return
        self.shadow.apply(self.result)
        if self.bm.pinned().get(pin_id) is None:
            return  # nothing was cached
        self.pins.append(pin_id)
        self.pinned_ends = getattr(self, "pinned_ends", {})
        self.pinned_ends[pin_id] = self.bm.pinned()[pin_id]
        assert isinstance(self.error_of(lambda: self.bm.pin(pin_id, tokens)), DuplicateSequence)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        pin_id = data.draw(st.sampled_from(self.pins))
        # Whatever came since, the pinned node is still cached to its end
        # (integrity: on the device, locked, in the trie).
        assert self.bm.pinned()[pin_id] == self.pinned_ends.pop(pin_id)
        self.bm.unpin(pin_id)
        self.pins.remove(pin_id)

    def unpin_all(self) -> None:
        for pin_id in self.pins:
            self.bm.unpin(pin_id)
        self.pins = []
        self.pinned_ends = {}

    def error_of(self, call):
        """The error `call` raises (the state must not move), or None."""
        before = self.bm.debug_state()
        try:
            call()
        except BlockManagerError as exc:
            assert self.bm.debug_state() == before, "a refused call changed the state"
            return exc
        return None

    @precondition(lambda self: self.config.num_disk_blocks > 0)
    @rule()
    def restart(self) -> None:
        """A graceful shutdown and a new process: every sequence ends, the
        cache goes to disk, a new manager restores it from the disk tier's
        entries and records (the shadow's disk arrays stand for the files);
        every prefix hits as far as before the restart."""
        for seq_id in self.live():
            self.free_sequence(seq_id)
        self.unpin_all()
        self.shadow.apply(self.bm.flush_to_disk())
        self.bm.check_integrity()
        hits = [self.bm.cached_prefix_length(p, ns) for p in self.seen for ns in (None, "tenant-b")]
        new = type(self.bm)(self.config)
        entries = self.bm.disk_entries()
        assert new.restore_disk(entries) == []
        # Every snapshot comes back where it was, a checkpoint still one.
        assert _snapshots(new.disk_entries()) == _snapshots(entries)
        shadow = type(self.shadow)(new)
        shadow.take_disk_from(self.shadow)
        self.bm, self.shadow = new, shadow
        new.check_integrity()
        assert hits == [new.cached_prefix_length(p, ns)
                        for p in self.seen for ns in (None, "tenant-b")]

    # -------------------------------------------------------------- checking

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_integrity()
        self.shadow.check_all()
        for seq_id in self.live():  # the store never counts a token no forward wrote
            assert self.bm.num_computed(seq_id) <= self.shadow.computed[seq_id], seq_id

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq_id in self.live():
            self.free_sequence(seq_id)
        self.unpin_all()
        self.bm.check_integrity()
        for g in self.bm.group_usage():  # nothing leaks: what is not free is held by the trie
            assert g.num_pages - g.num_free_pages == g.num_cached_pages
        self.bm.reset_prefix_cache()
        self.bm.check_integrity()
        for g in self.bm.group_usage():
            assert g.num_free_pages == g.num_pages
            assert g.num_free_host_pages == g.num_host_pages
        config = self.bm.config
        assert self.bm.num_free_slots == config.num_slots
        assert self.bm.num_free_host_slots == config.num_host_slots


def _snapshots(entries) -> set:
    """The disk entries' snapshots: (namespace, path, slot, checkpoint)
    each (a restore may fold tombstones, never a node with a snapshot)."""
    return {(e.namespace, e.tokens, e.slot, e.checkpoint) for e in entries if e.slot is not None}


def _by_group(ops) -> dict:
    """A plan's ops in order, per layer group (slot ops under None): a
    grouped store's plan lists group 0's ops first, row-by-row calls
    interleave the groups; within a group the order is the same."""
    groups: dict = {}
    for op in ops:
        groups.setdefault(op.group if isinstance(op, PAGE_OPS) else None, []).append(op)
    return groups


class HybridMachine(BlockManagerMachine):
    config = BlockManagerConfig(
        num_blocks=24, block_size=4, num_slots=6, num_host_blocks=8, num_host_slots=2
    )


class SlidingWindowMachine(BlockManagerMachine):
    config = BlockManagerConfig(num_blocks=24, block_size=4, sliding_window=6, num_host_blocks=6)


class TieredMachine(BlockManagerMachine):
    """A small device pool over host and disk tiers: prefixes are demoted
    and loaded back all the time; every read-back goes through the moves."""

    config = BlockManagerConfig(
        num_blocks=16, block_size=4, num_host_blocks=6, num_host_cache_blocks=6,
        num_disk_blocks=9,
    )


class TieredHybridMachine(BlockManagerMachine):
    config = BlockManagerConfig(
        num_blocks=20, block_size=4, num_slots=6, num_host_blocks=8, num_host_slots=2,
        num_host_cache_blocks=6, num_host_cache_slots=2, num_disk_blocks=8, num_disk_slots=3,
    )


class TieredSlidingMachine(BlockManagerMachine):
    config = BlockManagerConfig(
        num_blocks=18, block_size=4, sliding_window=6, num_host_blocks=6,
        num_disk_blocks=10,
    )


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
TestTiered = _test_case(TieredMachine)
TestTieredHybrid = _test_case(TieredHybridMachine)
TestTieredSliding = _test_case(TieredSlidingMachine)
TestWatermark = _test_case(WatermarkMachine)
