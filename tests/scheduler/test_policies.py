"""Scheduling policies (`scheduler.core.policies`): each waiting queue against
a naive reference (a plain list, sorted or scanned), the registry, and the
"lpm" policy in a running scheduler against a brute-force longest cached
prefix computed from the store's cached paths."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockmgr import BlockManager, BlockManagerConfig
from blockmgr.errors import InvalidArgument
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.core.policies import (
    LPM_MAX_WAITING,
    POLICIES,
    FcfsQueue,
    LongestPrefixQueue,
    Policy,
    PriorityQueue,
    policy_named,
    register_policy,
)


@dataclass
class Count:
    """A computed count (`blockmgr.Progress`)."""

    num_computed: int = 0


@dataclass(eq=False)
class Seq:
    """A waiting sequence as the queues read it."""

    name: int
    key: tuple
    tokens: list[int] = field(default_factory=list)
    namespace: object = None
    swapped: bool = False
    progress: Count = field(default_factory=Count)
    queue_tag: int = 0

    def admission_prompt(self):
        return self.tokens, self.namespace


class FakeStore:
    """The two prefix-cache queries a queue makes, over a set of cached
    token lists: the longest common prefix with any of them, never the whole
    prompt (as a store keeps one token to compute)."""

    def __init__(self):
        self.paths: list[tuple[object, list[int]]] = []
        self.cache_version = 0

    def add(self, namespace, tokens):
        self.paths.append((namespace, list(tokens)))
        self.cache_version += 1

    def cached_prefix_length(self, tokens, namespace=None):
        return brute_force_match(self.paths, tokens, namespace)


def brute_force_match(paths, tokens, namespace) -> int:
    """The longest prefix of `tokens` that a cached path of `namespace`
    starts with, short of the whole of `tokens`: a scan of every path."""
    best = 0
    for ns, path in paths:
        if ns != namespace:
            continue
        n = 0
        while n < min(len(path), len(tokens)) and path[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return min(best, max(len(tokens) - 1, 0))


class Reference:
    """The waiting sequences in FCFS order (a list; a front push inserts at
    0); each policy's head is read from it by a scan."""

    def __init__(self, policy, store=None):
        self.policy = policy
        self.store = store
        self.items: list[Seq] = []

    def push(self, seq, front):
        self.items.insert(0, seq) if front else self.items.append(seq)

    def remove(self, seq):
        if seq in self.items:
            self.items.remove(seq)

    def ordered(self) -> list[Seq]:
        if self.policy == "fcfs":
            return list(self.items)
        if self.policy == "priority":
            return sorted(self.items, key=lambda s: s.key)
        if len(self.items) > LPM_MAX_WAITING:
            return list(self.items)
        match = {id(s): s.progress.num_computed if s.swapped else
                 brute_force_match(self.store.paths, s.tokens, s.namespace)
                 for s in self.items}
        return sorted(self.items, key=lambda s: -match[id(s)])  # stable: FCFS ties

    def pop(self):
        head = self.ordered()[0]
        self.items.remove(head)
        return head


def new_queue(policy, store):
    return {"fcfs": FcfsQueue, "priority": PriorityQueue,
            "lpm": lambda: LongestPrefixQueue(store)}[policy]()


ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 3), st.lists(st.integers(0, 3), max_size=6),
              st.booleans(), st.booleans()),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.integers(0, 40)),
    st.tuples(st.just("first"), st.integers(0, 5)),
    st.tuples(st.just("cache"), st.lists(st.integers(0, 3), max_size=6)),
), max_size=60)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_each_queue_pops_as_its_naive_reference(policy, ops):
    store = FakeStore()
    queue = new_queue(policy, store)
    ref = Reference(policy, store)
    made: list[Seq] = []
    for op in ops:
        if op[0] == "push":
            _, priority, tokens, front, swapped = op
            seq = Seq(len(made), (priority, len(made)), tokens, swapped=swapped,
                      progress=Count(len(tokens) // 2))
            made.append(seq)
            queue.push(seq, front)
            ref.push(seq, front)
        elif op[0] == "pop":
            if ref.items:
                assert queue.peek() is ref.ordered()[0]
                assert queue.pop() is ref.pop()
            else:
                assert queue.peek() is None
                with pytest.raises(IndexError):
                    queue.pop()
        elif op[0] == "remove":
            if made:
                seq = made[op[1] % len(made)]
                queue.remove(seq)
                ref.remove(seq)
        elif op[0] == "first":
            assert queue.first(op[1]) == ref.ordered()[: op[1]]
        else:
            store.add(None, op[1])
        assert len(queue) == len(ref.items)
        assert list(queue) == ref.ordered()
        assert all((s.queue_tag != 0) == (s in ref.items) for s in made)


def test_lpm_orders_fcfs_over_its_limit():
    store = FakeStore()
    store.add(None, [1, 2, 3, 4])
    queue = LongestPrefixQueue(store)
    seqs = [Seq(i, (0, i), [9] if i else [1, 2, 3, 4, 5]) for i in range(LPM_MAX_WAITING + 1)]
    for seq in seqs[1:]:
        queue.push(seq)
    queue.push(seqs[0])
    assert queue.peek() is seqs[1]  # over the limit: arrival order
    queue.remove(seqs[2])
    assert queue.peek() is seqs[0]  # within it: the longest match
    assert queue.pop() is seqs[0]


def test_registry_names_the_policies_and_refuses_a_name_taken():
    assert tuple(POLICIES) == ("fcfs", "priority", "lpm")
    assert policy_named("lpm") is POLICIES["lpm"]
    with pytest.raises(ValueError, match="policy must be one of"):
        policy_named("sjf")
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="sjf")
    with pytest.raises(InvalidArgument):
        register_policy(POLICIES["fcfs"])
    with pytest.raises(InvalidArgument):
        register_policy("fcfs")  # type: ignore[arg-type]
    assert tuple(POLICIES) == ("fcfs", "priority", "lpm")


def test_a_registered_policy_drives_the_scheduler():
    """A policy added to the registry is a valid `SchedulerConfig.policy`:
    last come, first served, as a check that the scheduler asks the registry."""

    class Lifo(FcfsQueue):
        def push(self, seq, front=False):
            super().push(seq, front=True)

    register_policy(Policy("lifo-test", "last come first", lambda kv: Lifo(),
                           POLICIES["fcfs"].insert_running))
    try:
        bm = BlockManager(BlockManagerConfig(num_blocks=100, block_size=4))
        s = Scheduler(SchedulerConfig(policy="lifo-test", max_num_seqs=1), bm)
        for rid in range(3):
            s.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=1)))
        assert [item.seq_id for item in s.schedule().seqs] == [2]
    finally:
        del POLICIES["lifo-test"]


class RecordingStore:
    """A BlockManager that, before each `allocate`, computes by brute force
    the cached prefix of every waiting sequence (from `cached_paths`) and
    records which of them "lpm" must admit: the longest, ties in the FCFS
    order the test keeps itself."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.fcfs: list = []  # waiting sequence ids, FCFS order
        self.tokens: dict = {}  # sequence id -> its tokens now
        self.checked = 0
        self.skip_next = False

    def __getattr__(self, name):
        return getattr(self.bm, name)

    def __contains__(self, seq_id):
        return seq_id in self.bm

    def reset_prefix_cache(self):
        self.skip_next = True  # the scheduler's last resort retries the head it had
        return self.bm.reset_prefix_cache()

    def allocate(self, seq_id, tokens, namespace=None, **kw):
        paths = self.bm.cached_paths()
        matches = [brute_force_match(paths, self.tokens[sid], None) for sid in self.fcfs]
        for sid, match in zip(self.fcfs, matches):  # the reference agrees with the store
            assert match == self.bm.cached_prefix_length(self.tokens[sid])
        if not self.skip_next:
            best = max(matches)
            assert seq_id == self.fcfs[matches.index(best)], (seq_id, self.fcfs, matches)
            self.checked += 1
        self.skip_next = False
        alloc = self.bm.allocate(seq_id, tokens, namespace, **kw)  # raises when refused
        self.fcfs.remove(seq_id)
        return alloc


@pytest.mark.parametrize("seed", range(6))
def test_lpm_admits_the_longest_cached_prefix_first(seed):
    rng = random.Random(seed)
    bm = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4))
    store = RecordingStore(bm)
    s = Scheduler(SchedulerConfig(policy="lpm", max_num_batched_tokens=24, max_num_seqs=6), store)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(2, 14))] for _ in range(4)]
    requests = {}
    for _ in range(1000):
        if len(requests) < 60 and rng.random() < 0.4:
            rid = len(requests)
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            requests[rid] = Request(rid, tokens, SamplingParams(max_tokens=rng.randint(4, 24)))
            s.add_request(requests[rid])
            store.fcfs.append(rid)
        for sid in store.fcfs:
            req = requests[sid]
            store.tokens[sid] = req.prompt_tokens + req.outputs[0]
        out = s.schedule()
        admitted = set(s.running_ids())
        store.fcfs = [sid for sid in store.fcfs if sid not in admitted]
        store.fcfs[:0] = reversed(out.preempted)  # each preempted one went to the front
        sampled = {item.seq_id: rng.randrange(50) for item in out.seqs if item.sample}
        s.update(out, sampled)
        bm.check_integrity()
        if not s.has_unfinished() and len(requests) >= 60:
            break
    assert not s.has_unfinished()
    assert store.checked >= 40
    assert s.stats.num_preempted_recompute_total > 0  # the pool is small enough to preempt
