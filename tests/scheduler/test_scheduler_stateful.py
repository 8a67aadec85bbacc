"""Hypothesis state machine over add / step / abort.

Every step's plans are replayed on `ShadowStorage` (token ids for KV and
recurrent state), the block manager's integrity is checked after each rule,
the scheduler's own view (which sequences run, wait, are swapped) must match
the block manager's, and at teardown every request is drained or aborted
and nothing may be left held outside the prefix trie.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockmgr import BlockManager, BlockManagerConfig, InvalidArgument
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.core.scheduler import SchedulerOutput
from tests.scheduler.test_scheduler import assert_no_leak, shadow_step
from tests.shadow import ShadowStorage

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26]]


class SchedulerMachine(RuleBasedStateMachine):
    @rule(
        hybrid=st.booleans(),
        preemption=st.sampled_from(["recompute", "swap"]),
        policy=st.sampled_from(["fcfs", "priority"]),
        num_blocks=st.integers(8, 30),
        budget=st.integers(1, 24),
        threshold=st.sampled_from([None, 3, 8]),
    )
    @precondition(lambda self: not hasattr(self, "s"))
    def init(self, hybrid, preemption, policy, num_blocks, budget, threshold):
        self.bm = BlockManager(BlockManagerConfig(
            num_blocks=num_blocks, block_size=4, num_slots=10 if hybrid else 0,
            num_host_blocks=num_blocks, num_host_slots=6 if hybrid else 0))
        self.s = Scheduler(SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=5, policy=policy,
            preemption=preemption, long_prefill_token_threshold=threshold,
            max_model_len=num_blocks * 4), self.bm)
        self.shadow = ShadowStorage(self.bm)
        self.rng = random.Random(0)
        self.next_id = 0
        self.last_output = None  # applied: any update with it is stale

    @precondition(lambda self: hasattr(self, "s"))
    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        suffix=st.lists(st.integers(0, 40), min_size=1, max_size=8),
        n=st.sampled_from([1, 1, 2, 3]),
        max_tokens=st.integers(1, 10),
        priority=st.integers(0, 2),
    )
    def add(self, prefix, suffix, n, max_tokens, priority):
        prompt = PREFIXES[prefix] + suffix
        if -(-len(prompt) // 4) > self.bm.config.num_blocks // 2:
            return  # keep prompts well inside the pool
        self.s.add_request(Request(self.next_id, prompt, SamplingParams(
            max_tokens=max_tokens, n=n, stop_token_ids=(0,)), priority=priority))
        self.next_id += 1

    @precondition(lambda self: hasattr(self, "s"))
    @rule()
    def step(self):
        self.last_output = shadow_step(self.s, self.bm, self.shadow, self.rng)

    @precondition(lambda self: hasattr(self, "s"))
    @rule(kind=st.integers(0, 6), value=st.sampled_from([1.5, None, -1, "x", [1, 2]]))
    def bad_call(self, kind, value):
        """A refused call: nothing in the scheduler or the store may move."""
        s, bm = self.s, self.bm
        live = [rid for rid in range(self.next_id) if s.get_request(rid) is not None]
        calls = [
            lambda: s.add_request(Request(live[0] if live else 0, [1, 2], SamplingParams()))
            if live else s.add_request("not a request"),
            lambda: s.add_request(Request("huge", [1] * (bm.config.num_blocks * 4 + 1))),
            lambda: s.add_request(Request("wide", [1, 2], SamplingParams(n=6))),
            lambda: s.update(SchedulerOutput(s.stats.step + 1, []), {}),  # never scheduled
            # the last step, applied: every rule updates what it schedules
            lambda: s.update(SchedulerOutput(s.stats.step, []), {}) if s.stats.step
            else s.update("not an output", {}),
            lambda: s.update(self.last_output, {x.seq_id: value for x in self.last_output.seqs})
            if self.last_output is not None else s.add_request(None),
            lambda: s.add_request(Request("x", [1, 2], priority=0.5)),
        ]
        before = (s.debug_state(), bm.debug_state())
        try:
            calls[kind]()
        except InvalidArgument:
            pass
        else:
            raise AssertionError("a bad call was accepted")
        assert (s.debug_state(), bm.debug_state()) == before, "a refused call changed the state"

    @precondition(lambda self: hasattr(self, "s") and self.next_id > 0)
    @rule(which=st.integers(0, 1000), between=st.booleans())
    def abort(self, which, between):
        rid = which % self.next_id
        if between:  # abort after the forward pass, before update()
            out = self.s.schedule()
            self.shadow.apply(out.ops)
            for item in out.seqs:
                self.shadow.computed[item.seq_id] = item.start_position
                self.shadow.compute(item.seq_id, item.start_position + item.num_tokens)
            self.s.abort(rid)
            self.s.update(out, {x.seq_id: [1] * x.num_samples if x.num_samples > 1 else 1
                                for x in out.seqs if x.sample})
        else:
            self.s.abort(rid)

    @invariant()
    def consistent(self):
        if not hasattr(self, "s"):
            return
        self.bm.check_integrity()
        running = set(self.s.running_ids())
        waiting = [self.s.sequence_info(seq_id) for seq_id in self.s.waiting_ids()]
        swapped = {q.seq_id for q in waiting if q.swapped}
        held = {q.seq_id for q in waiting if q.num_reserved} - swapped
        assert not held, f"waiting sequences hold pages: {held}"
        assert set(self.bm.sequence_ids()) == running | swapped
        for sid in swapped:
            assert self.bm.is_swapped(sid)
        assert len(running) <= self.s.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(500):
            if not self.s.has_unfinished():
                break
            shadow_step(self.s, self.bm, self.shadow, self.rng)
        for rid in range(self.next_id):
            self.s.abort(rid)  # None for a finished one
        self.shadow.apply(self.s.schedule().ops)
        assert_no_leak(self.bm)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase
