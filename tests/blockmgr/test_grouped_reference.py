"""`GroupedStore` against one plain `BlockManager` per group (hypothesis).

Without a prefix cache the grouped store must act exactly as independent
managers, one per layer group, driven with the same calls: the same page
tables, the same ops, the same free pages in every group after every step.
A call succeeds when every group's manager alone takes it, and otherwise
raises and changes nothing (`debug_state()`); `can_X` agrees with every
group's. This covers what the shadow storages cannot see: a page
table that reads back right but differs from what a group alone would
hold, and a refusal where every group had room (or the reverse).
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blockmgr import BlockManager, BlockManagerError, GroupedStore, GroupedStoreConfig

new_tokens = st.lists(st.integers(0, 9), min_size=1, max_size=7)


class GroupedReferenceMachine(RuleBasedStateMachine):
    """Full attention + two sliding windows, one pool smaller than the others."""

    config = GroupedStoreConfig(
        num_blocks=16, block_size=4, windows=(None, 5, 9), window_blocks=11,
        enable_prefix_cache=False, num_host_blocks=7,
    )

    @initialize()
    def start(self) -> None:
        self.store = GroupedStore(self.config)
        self.refs = [
            BlockManager(self.config.group_config(g), group=g)
            for g in range(self.config.num_groups)
        ]
        self.next_id = 0
        self.speculating: dict[str, int] = {}  # seq_id -> token count at begin

    # ---------------------------------------------------------------- helpers

    def live(self) -> list[str]:
        return sorted(self.refs[0].sequence_ids())

    def resident(self) -> list[str]:
        return [s for s in self.live()
                if not self.refs[0].is_swapped(s) and s not in self.speculating]

    def both(self, call) -> None:
        """`call(m)` on copies of the references: when every group alone
        takes it, the store must too, with the same ops (the copies become
        the references); when one refuses, the store must raise and change
        nothing."""
        copies = copy.deepcopy(self.refs)
        try:
            want = [op for ref in copies for op in (call(ref) or ())]
        except BlockManagerError as refusal:
            before = self.store.debug_state()
            try:
                call(self.store)
            except BlockManagerError:
                assert self.store.debug_state() == before, "a refused call changed the store"
            else:
                raise AssertionError(f"the store accepted a call a group refuses: {refusal}")
            return
        got = call(self.store)
        assert Counter(got or ()) == Counter(want), f"ops {got} != {want}"
        self.refs = copies

    # ------------------------------------------------------------------ rules

    @rule(tokens=st.lists(st.integers(0, 9), min_size=1, max_size=30))
    def allocate(self, tokens) -> None:
        self.next_id += 1
        seq_id = f"s{self.next_id}"
        assert self.store.can_allocate(tokens) == all(ref.can_allocate(tokens) for ref in self.refs)
        self.both(lambda m: m.allocate(seq_id, tokens).ops)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), new=new_tokens)
    def append(self, data, new) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        if self.refs[0].is_swapped(seq_id):
            return
        num_tokens = self.refs[0].num_tokens(seq_id)
        computed = None
        if seq_id not in self.speculating:
            computed = data.draw(st.none() | st.integers(0, num_tokens))
        self.both(lambda m: m.append(seq_id, new, computed))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        self.next_id += 1
        child = f"s{self.next_id}"
        self.both(lambda m: m.fork(seq_id, child))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def truncate(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        target = data.draw(st.integers(0, self.refs[0].num_tokens(seq_id)))
        assert self.store.can_truncate(seq_id, target) == all(
            ref.can_truncate(seq_id, target) for ref in self.refs
        )
        self.both(lambda m: m.truncate(seq_id, target))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def begin_speculation(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, max_size=3,
                                 unique=True))
        drafts = {s: data.draw(st.lists(st.integers(0, 9), max_size=6)) for s in ids}
        # A hybrid store's restored checkpoint makes every group compute
        # again from the begin (its window pages held); a group alone has
        # no checkpoint: say where it stands, so each group holds the same.
        num_computed = None
        if self.config.num_slots or data.draw(st.booleans()):
            num_computed = {s: self.refs[0].num_tokens(s) for s in ids}
        assert self.store.can_speculate(drafts, num_computed) == all(
            ref.can_speculate(drafts, num_computed) for ref in self.refs
        )
        self.both(lambda m: m.begin_speculation(drafts, num_computed))
        if self.store.speculation_start(ids[0]) is not None:
            for seq_id, tokens in drafts.items():
                self.speculating[seq_id] = self.refs[0].num_tokens(seq_id) - len(tokens)

    @precondition(lambda self: self.speculating)
    @rule(data=st.data())
    def end_speculation(self, data) -> None:
        """Commit, abort or shorten some open transactions."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.speculating)), min_size=1,
                                 max_size=3, unique=True))
        kept = {
            s: data.draw(st.integers(0, self.refs[0].num_tokens(s) - self.speculating[s]))
            for s in ids
        }
        how = data.draw(st.sampled_from(["commit", "abort", "shorten"]))
        if how == "commit":
            self.both(lambda m: m.commit_speculation(kept) and None)
        elif how == "abort":
            self.both(lambda m: m.abort_speculation(ids))
        else:
            self.both(lambda m: m.shorten_speculation(kept))
            return
        for seq_id in ids:
            del self.speculating[seq_id]

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.resident()))
        assert self.store.can_swap_out(seq_id) == all(ref.can_swap_out(seq_id) for ref in self.refs)
        self.both(lambda m: m.swap_out(seq_id))

    @precondition(lambda self: any(self.refs[0].is_swapped(s) for s in self.live()))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        seq_id = data.draw(st.sampled_from([s for s in self.live() if self.refs[0].is_swapped(s)]))
        assert self.store.can_swap_in(seq_id) == all(ref.can_swap_in(seq_id) for ref in self.refs)
        self.both(lambda m: m.swap_in(seq_id))

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.live()))
        self.speculating.pop(seq_id, None)
        self.both(lambda m: m.free(seq_id))

    # -------------------------------------------------------------- checking

    @invariant()
    def same_as_the_references(self) -> None:
        if not hasattr(self, "store"):
            return
        self.store.check_integrity()
        for g, ref in enumerate(self.refs):
            ref.check_integrity()
            usage = self.store.group_usage()[g]
            assert usage.num_free_pages == ref.num_free_blocks, f"group {g}"
            assert usage.num_free_host_pages == ref.num_free_host_blocks, f"group {g}"
            for seq_id in ref.sequence_ids():
                assert self.store.block_table(seq_id, g) == ref.block_table(seq_id), (seq_id, g)
                assert self.store.tokens(seq_id) == ref.tokens(seq_id)
                assert self.store.is_swapped(seq_id) == ref.is_swapped(seq_id)
        assert self.store.sequence_ids() == self.refs[0].sequence_ids()
        assert self.store.num_free_slots == self.refs[0].num_free_slots


class HybridReferenceMachine(GroupedReferenceMachine):
    """Recurrent slots in group 0 beside a sliding group."""

    config = GroupedStoreConfig(
        num_blocks=14, block_size=4, windows=(None, 6), window_blocks=9, num_slots=5,
        enable_prefix_cache=False, num_host_blocks=6, num_host_slots=2,
    )


_SETTINGS = settings(
    max_examples=int(os.environ.get("BLOCKMGR_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=int(os.environ.get("BLOCKMGR_STATEFUL_STEPS", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestGroupedReference = GroupedReferenceMachine.TestCase
TestGroupedReference.settings = _SETTINGS
TestHybridReference = HybridReferenceMachine.TestCase
TestHybridReference.settings = _SETTINGS
