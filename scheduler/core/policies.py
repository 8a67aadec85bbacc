"""Scheduling policies: the order of the waiting queue and of the running list.

A policy is a `Policy` in the registry `POLICIES` (by name; the CLI's
`--policy` choices): the `WaitingQueue` it builds over the KV store and
where an admitted sequence enters the running list. The running list's
order is a contract the scheduler relies on (design/scheduler.md): it is
the order in which running sequences are scheduled (and decode rows
batched), and its last sequence is the next preemption victim.

* "fcfs": arrival order; a preempted sequence goes back to the front. The
  running list is in admission order (the last admitted is preempted first).
* "priority": lower `Request.priority` first, then arrival. The running
  list is kept sorted the same way (the lowest priority is preempted first).
* "lpm": longest cached prefix first (SGLang's "lpm"): at each look the
  waiting sequence whose prompt the prefix cache serves most (a swapped
  one: all it holds) is admitted first, ties in FCFS order. Over
  `LPM_MAX_WAITING` waiting sequences it falls back to FCFS, as SGLang does
  (each look costs one trie match per waiting sequence). Running list as FCFS.

Every queue removes lazily: a sequence's `queue_tag` marks its live entry
(0: not queued), so `remove` is O(1) at any point.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from blockmgr.errors import InvalidArgument
from blockmgr.kv_store import KVStore
from blockmgr.sequence import Progress
from blockmgr.validation import check_choice

#: Above this many waiting sequences "lpm" orders them FCFS (SGLang: 128).
LPM_MAX_WAITING = 128


class Queued(Protocol):
    """What a waiting queue reads of a sequence."""

    key: tuple  # (priority, arrival time, admission counter): unique
    queue_tag: int  # the tag of its live entry; 0: not queued
    swapped: bool  # preempted by swap: comes back with all it computed
    progress: Progress  # its computed count (the store's record)

    def admission_prompt(self) -> tuple[list[int], Hashable]:
        """The tokens `allocate` takes for it, and its namespace."""
        ...


S = TypeVar("S", bound=Queued)


class WaitingQueue(Protocol[S]):
    """The waiting sequences of one policy, in admission order.

    `pop()` removes and returns the sequence the last `peek()` returned
    when nothing was pushed or removed in between."""

    def __len__(self) -> int: ...

    def push(self, seq: S, front: bool = False) -> None:
        """Queue `seq`; `front`: a preempted sequence (FCFS puts it first)."""
        ...

    def peek(self) -> S | None: ...

    def pop(self) -> S: ...

    def remove(self, seq: S) -> None:
        """Drop `seq`'s entry (lazily; a sequence not queued: nothing). O(1)."""
        ...

    def first(self, num: int) -> list[S]:
        """The next `num` sequences in admission order (at most), none removed."""
        ...

    def __iter__(self) -> Iterator[S]: ...


class _LazyQueue(Generic[S]):
    """What the FCFS and priority queues share: a count of live entries,
    the tags that mark them, `pop` as peek + drop the head, lazy `remove`."""

    __slots__ = ("_len", "_tags")

    def __init__(self) -> None:
        self._len = 0
        self._tags = itertools.count(1)

    def __len__(self) -> int:
        return self._len

    def _tag(self, seq: S) -> int:
        """Mark `seq` queued under a new tag, which its entry carries."""
        seq.queue_tag = tag = next(self._tags)
        self._len += 1
        return tag

    def peek(self) -> S | None:
        raise NotImplementedError

    def _drop_head(self) -> None:
        """Drop the entry `peek` just returned."""
        raise NotImplementedError

    def pop(self) -> S:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty waiting queue")
        self._drop_head()
        self.remove(seq)
        return seq

    def remove(self, seq: S) -> None:
        if seq.queue_tag:
            seq.queue_tag = 0
            self._len -= 1


class FcfsQueue(_LazyQueue[S]):
    """Arrival order with a front for preempted sequences: a deque of
    `(tag, seq)`. push, pop and remove O(1) (stale entries popped lazily)."""

    __slots__ = ("_deque",)

    def __init__(self) -> None:
        super().__init__()
        self._deque: deque[tuple[int, S]] = deque()

    def push(self, seq: S, front: bool = False) -> None:
        if front:
            self._deque.appendleft((self._tag(seq), seq))
        else:
            self._deque.append((self._tag(seq), seq))

    def peek(self) -> S | None:
        dq = self._deque
        while dq and dq[0][0] != dq[0][1].queue_tag:
            dq.popleft()
        return dq[0][1] if dq else None

    def _drop_head(self) -> None:
        self._deque.popleft()

    def first(self, num: int) -> list[S]:
        """O(num + stale entries)."""
        out: list[S] = []
        for tag, seq in self._deque:
            if len(out) == num:
                break
            if tag == seq.queue_tag:
                out.append(seq)
        return out

    def __iter__(self) -> Iterator[S]:
        for tag, seq in self._deque:
            if tag == seq.queue_tag:
                yield seq

    def compact(self) -> None:
        """Drop the stale entries. O(entries)."""
        self._deque = deque(entry for entry in self._deque if entry[0] == entry[1].queue_tag)


class PriorityQueue(_LazyQueue[S]):
    """Lowest `key` first (priority, then arrival): a heap of
    `(key, tag, seq)`. push, pop O(log n); remove O(1) (stale entries
    popped lazily); a preempted sequence goes back by its key."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[tuple, int, S]] = []

    def push(self, seq: S, front: bool = False) -> None:
        heapq.heappush(self._heap, (seq.key, self._tag(seq), seq))

    def peek(self) -> S | None:
        heap = self._heap
        while heap and heap[0][1] != heap[0][2].queue_tag:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _drop_head(self) -> None:
        heapq.heappop(self._heap)

    def first(self, num: int) -> list[S]:
        """O(n log num)."""
        live = (entry for entry in self._heap if entry[1] == entry[2].queue_tag)
        return [entry[2] for entry in heapq.nsmallest(num, live, key=lambda e: e[:2])]

    def __iter__(self) -> Iterator[S]:
        for _, tag, seq in sorted(self._heap, key=lambda e: e[:2]):
            if tag == seq.queue_tag:
                yield seq


class LongestPrefixQueue(Generic[S]):
    """Longest cached prefix first, ties in FCFS order (module doc).

    Kept as an FCFS queue plus its order by cached prefix, recomputed at a
    look after a push or a change of the prefix cache (`kv.cache_version`):
    O(W log W + W trie matches) for W waiting; pop and remove O(1)."""

    __slots__ = ("_fcfs", "_kv", "_order", "_version")

    def __init__(self, kv: KVStore) -> None:
        self._fcfs: FcfsQueue[S] = FcfsQueue()
        self._kv = kv
        self._order: list[tuple[int, S]] | None = None  # reversed: the head last
        self._version: int | None = None

    def __len__(self) -> int:
        return len(self._fcfs)

    def push(self, seq: S, front: bool = False) -> None:
        self._fcfs.push(seq, front)
        self._order = None

    def _ordered(self) -> list[tuple[int, S]] | None:
        """The live entries, head last; None: FCFS (too many waiting)."""
        if len(self._fcfs) > LPM_MAX_WAITING:
            return None
        version = self._kv.cache_version
        if self._order is None or version != self._version:
            self._fcfs.compact()
            seqs = list(self._fcfs)
            matches = [self._match(seq) for seq in seqs]
            ranked = sorted(range(len(seqs)), key=lambda i: (-matches[i], i), reverse=True)
            self._order = [(seqs[i].queue_tag, seqs[i]) for i in ranked]
            self._version = version
        order = self._order
        while order and order[-1][0] != order[-1][1].queue_tag:
            order.pop()
        return order

    def _match(self, seq: S) -> int:
        if seq.swapped:
            return seq.progress.num_computed
        tokens, namespace = seq.admission_prompt()
        return self._kv.cached_prefix_length(tokens, namespace)

    def peek(self) -> S | None:
        order = self._ordered()
        if order is None:
            return self._fcfs.peek()
        return order[-1][1] if order else None

    def pop(self) -> S:
        order = self._order if self._order is not None else self._ordered()
        if order is None or len(self._fcfs) > LPM_MAX_WAITING:
            return self._fcfs.pop()
        while order and order[-1][0] != order[-1][1].queue_tag:
            order.pop()
        if not order:
            raise IndexError("pop from an empty waiting queue")
        seq = order.pop()[1]
        self._fcfs.remove(seq)
        return seq

    def remove(self, seq: S) -> None:
        self._fcfs.remove(seq)

    def first(self, num: int) -> list[S]:
        order = self._ordered()
        if order is None:
            return self._fcfs.first(num)
        out: list[S] = []
        for tag, seq in reversed(order):
            if len(out) >= num:
                break
            if tag == seq.queue_tag:
                out.append(seq)
        return out

    def __iter__(self) -> Iterator[S]:
        order = self._ordered()
        if order is None:
            yield from self._fcfs
            return
        for tag, seq in reversed(order):
            if tag == seq.queue_tag:
                yield seq


_KEY = operator.attrgetter("key")


def append_running(running: list, seq: Queued) -> None:
    """Admission order: the last admitted runs last and is preempted first."""
    running.append(seq)


def insort_running(running: list, seq: Queued) -> None:
    """Key order (priority, then arrival): the lowest priority is preempted first.
    O(running)."""
    bisect.insort(running, seq, key=_KEY)


@dataclass(frozen=True, slots=True)
class Policy:
    """One scheduling policy: its waiting queue and its running order."""

    name: str
    help: str
    new_queue: Callable[[KVStore], WaitingQueue]
    #: puts an admitted sequence into the running list (its order: module doc)
    insert_running: Callable[[list, Queued], None]


#: The registry, by name: the choices of `SchedulerConfig.policy` and `--policy`.
POLICIES: dict[str, Policy] = {}


def register_policy(policy: Policy) -> None:
    """Add `policy` to the registry (`InvalidArgument` for a name taken)."""
    if not isinstance(policy, Policy):
        raise InvalidArgument(f"expected a Policy, got {policy!r:.80}")
    if policy.name in POLICIES:
        raise InvalidArgument(f"policy {policy.name!r} is already registered")
    POLICIES[policy.name] = policy


def policy_named(name: str) -> Policy:
    """The registered policy `name` (`InvalidArgument` naming the choices)."""
    return POLICIES[check_choice("policy", name, POLICIES)]


register_policy(Policy("fcfs", "first come, first served (preempted ones first)",
                       lambda kv: FcfsQueue(), append_running))
register_policy(Policy("priority", "lower Request.priority first, then arrival",
                       lambda kv: PriorityQueue(), insort_running))
register_policy(Policy("lpm", "longest cached prefix first, then arrival (as SGLang's lpm)",
                       LongestPrefixQueue, append_running))
