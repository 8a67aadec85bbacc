"""Continuous-batching scheduler (vLLM v1 style), bookkeeping only.

Each `schedule()` picks what the next forward pass computes under a token
budget (`max_num_batched_tokens`) and a cap on live sequences
(`max_num_seqs`):

1. running sequences first, in queue order: each gets its remaining tokens
   (a decode token, or the next prefill chunk) up to the budget. When the
   KV store cannot grow a sequence, the last running sequence (the policy
   keeps the running list in its order: `scheduler.core.policies`) is
   preempted, by recompute (`free` with the computed count, so the trie
   keeps what it can; recomputed later from the prompt and its outputs) or
   by swap (pages copied to host memory, brought back later);
2. then, if nothing was preempted, waiting sequences in policy order
   (preempted ones first): admission allocates the whole prompt (refused,
   changing nothing, where `can_allocate` says no: it keeps the watermark
   of free pages) and counts only the tokens the prefix trie did not have
   against the budget.

Prefills are chunked. A chunk ends at the allocation's `branch_point` (where
a hybrid or sliding-window store could serve more after a checkpoint), for
hybrid models (recurrent slots) a chunk that must be cut ends on a page
boundary, and every prefill chunk end is snapshotted (`cache_prefix`), so
long prompts leave reusable checkpoints and siblings hit the shared prefix.

`update()` takes the sampled tokens, applies stop conditions, forks a
request with `n > 1` samples after its prompt (the prompt's pages are
stored once) and frees finished sequences.

The KV store `kv` is anything that satisfies `blockmgr.KVStore`: a
`BlockManager` or a `GroupedStore` (the simulator), a `cache.PagedCache`
(the engine). Plans its calls return are collected, in call order, in
`SchedulerOutput.ops` (for storage to apply; a `PagedCache` applies its
own). No MLX here.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blockmgr.errors import (
    BlockManagerError,
    IntegrityError,
    InvalidArgument,
    OutOfBlocks,
    OutOfSlots,
    WrongArgumentType,
)
from blockmgr.kv_store import KVStore
from blockmgr.sequence import Progress
from blockmgr.validation import check_int, token_list
from scheduler.core.config import SchedulerConfig
from scheduler.core.policies import WaitingQueue, policy_named
from scheduler.core.records import (
    AcceptedTokens,
    DecodeRows,
    RequestOutput,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    SequenceInfo,
)
from scheduler.core.request import Request, RequestStatus

# ----------------------------------------------------------------- errors


class RequestTooLarge(InvalidArgument):
    """A request that could never be admitted (see `Scheduler.check_admissible`)."""


class StaleSchedulerOutput(InvalidArgument):
    """`update()` got a `SchedulerOutput` that is not the last `schedule()`'s,
    or one already applied."""


# -------------------------------------------------------------- sequences


class _NoProgress:
    """The computed count of a sequence the store does not hold (0): a
    record of its own, so nothing set on it reaches another sequence."""

    __slots__ = ("num_computed",)

    def __init__(self) -> None:
        self.num_computed = 0


@dataclass(slots=True, eq=False)
class _Seq:
    """Scheduler state of one KV-store sequence (a prompt or one sample).

    Its tokens are the prompt followed by the sample's outputs;
    `progress.num_computed` of them are computed (the store's record of
    the count, which the store, its cache and this scheduler share: a
    fresh one at 0 while not allocated), `num_reserved` have pages in the
    store (0: not allocated). `key` orders it under the priority policy.
    """

    seq_id: Hashable
    request: Request
    index: int | None  # sample index; None: a prompt shared by n > 1 samples
    key: tuple
    max_num_outputs: int  # the sample stops by length at this many outputs
    progress: Progress = field(default_factory=_NoProgress)
    num_reserved: int = 0
    branch_point: int | None = None
    swapped: bool = False
    in_flight: bool = False  # scheduled in the last step, not yet updated
    done: bool = False  # finished, aborted or replaced by its forks
    queue_tag: int = 0  # which waiting-queue entry is current (lazy removal)

    @property
    def num_tokens(self) -> int:
        req = self.request
        if self.index is None:
            return len(req.prompt_tokens)
        return len(req.prompt_tokens) + len(req.outputs[self.index])

    def tokens(self, start: int, stop: int) -> list[int]:
        prompt = self.request.prompt_tokens
        p = len(prompt)
        if stop <= p:
            return prompt[start:stop]
        index = self.index
        if index is None:
            raise IntegrityError(f"prompt sequence {self.seq_id!r} asked for tokens past its "
                                 f"prompt ({start}:{stop} of {p})")
        out = self.request.outputs[index]
        if start >= p:
            return out[start - p : stop - p]
        return prompt[start:] + out[: stop - p]

    def admission_prompt(self) -> tuple[list[int], Hashable]:
        """The tokens `allocate` takes for it (the prompt itself when that is
        all: no copy) and its namespace."""
        prompt = self.request.prompt_tokens
        num_tokens = self.num_tokens
        tokens = prompt if num_tokens == len(prompt) else self.tokens(0, num_tokens)
        return tokens, self.request.namespace

    @property
    def in_prefill(self) -> bool:
        num_computed = self.progress.num_computed
        return self.num_tokens - num_computed > 1 or num_computed < len(self.request.prompt_tokens)


# ---------------------------------------------------------------- scheduler


class Scheduler:
    """Decides each step's work over a KV store; see the module doc.

    Not thread-safe. Per step the cost is O(scheduled sequences) plus the
    store's own calls (a decode sequence: one `append`), plus O(running)
    list upkeep in `update`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise WrongArgumentType(f"config must be a SchedulerConfig, got {config!r:.80}")
        self.config = config
        self.kv = kv
        self.clock = clock
        self._block_size = kv.block_size
        self._hybrid = kv.is_hybrid
        self._prefix_cache = kv.enable_prefix_cache
        self._max_model_len = _length_limit(config.max_model_len, kv)
        policy = policy_named(config.policy)
        self._waiting: WaitingQueue[_Seq] = policy.new_queue(kv)
        self._insert = policy.insert_running
        self._running: list[_Seq] = []
        self._requests: dict[Hashable, Request] = {}
        self._seqs_of: dict[Hashable, list[_Seq]] = {}
        self._pending_ops: list = []
        self._order = itertools.count()
        self._step = 0
        self._applied_step: int | None = None  # the step `update` last applied
        self._scheduled: SchedulerOutput | None = None  # the last `schedule()`'s output
        self._row_seqs: list[_Seq] = []  # the sequence of each of its decode rows
        self._rows_disturbed = False  # a row of it may have been aborted, stopped or unscheduled
        self._num_swapped = 0
        self.stats = SchedulerStats()
        self._totals = SchedulerStats()

    # ------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def max_model_len(self) -> int | None:
        """The most prompt + output tokens of a sequence in effect: the
        config's, or what the store holds (`pool_length`) for None."""
        return self._max_model_len

    def waiting_prompts(self, num: int) -> list[tuple[list[int], Hashable]]:
        """The tokens and namespace of the next `num` waiting sequences to
        be allocated (swapped-out ones left out: they come back by swap),
        in admission order; for reading their cached prefixes ahead."""
        out: list[tuple[list[int], Hashable]] = []
        for seq in self._waiting.first(num):
            if not seq.swapped:
                out.append(seq.admission_prompt())
        return out

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._running) or len(self._waiting) > 0

    def get_request(self, request_id: Hashable) -> Request | None:
        return self._requests.get(request_id)

    def running_ids(self) -> list[Hashable]:
        return [s.seq_id for s in self._running]

    def waiting_ids(self) -> list[Hashable]:
        return [s.seq_id for s in self._waiting]

    def request_ids(self) -> list[Hashable]:
        """The ids of the live requests (added, not finished or aborted), in
        the order they were added. O(live requests)."""
        return list(self._requests)

    def sequence_info(self, seq_id: Hashable) -> SequenceInfo | None:
        """What the scheduler tracks of sequence `seq_id` (a live request's
        prompt or sample: `Request.seq_id`), None for an id of no live
        request. A snapshot: it does not follow later steps. O(samples of
        its request)."""
        request_id = seq_id[0] if isinstance(seq_id, tuple) else seq_id
        for seq in self._seqs_of.get(request_id, ()):
            if seq.seq_id == seq_id:
                return SequenceInfo(seq.seq_id, request_id, seq.num_tokens,
                                    seq.progress.num_computed, seq.num_reserved, seq.swapped,
                                    seq.in_flight, seq.done)
        return None

    def check_counts(self) -> None:
        """Raise `IntegrityError` unless every sequence the store holds for
        this scheduler reads the store's own record of its computed count
        (`KVStore.progress`: one count, no copy) and every other live one
        counts none. O(live sequences)."""
        kv = self.kv
        for seqs in self._seqs_of.values():
            for seq in seqs:
                if seq.done:
                    continue
                if seq.num_reserved or seq.swapped:
                    if seq.progress is not kv.progress(seq.seq_id):
                        raise IntegrityError(
                            f"{seq.seq_id!r}: the scheduler reads another count than its store")
                elif seq.progress.num_computed:
                    raise IntegrityError(f"{seq.seq_id!r} counts computed tokens it does not hold")

    def debug_state(self) -> tuple:
        """Everything the scheduler tracks, as plain values: equal before and
        after any call that was refused. For tests; O(requests)."""
        requests = tuple(
            (
                rid,
                req.status,
                tuple(tuple(out) for out in req.outputs),
                tuple(req.finish_reasons),
                tuple(
                    (q.seq_id, q.progress.num_computed, q.num_reserved, q.swapped, q.in_flight,
                     q.done)
                    for q in self._seqs_of[rid]
                ),
            )
            for rid, req in self._requests.items()
        )
        return (
            requests,
            tuple(self.running_ids()),
            tuple(self.waiting_ids()),
            self._step,
            self._applied_step,
            self._num_swapped,
            len(self._pending_ops),
        )

    # ------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING). O(log waiting).

        Refuses, changing nothing: a non-`Request` (`WrongArgumentType`), an
        id that is already live or a request already scheduled
        (`InvalidArgument`), and a request that could never run
        (`RequestTooLarge`: see `check_admissible`).
        """
        if not isinstance(request, Request):
            raise WrongArgumentType(f"expected a Request, got {request!r:.80}")
        rid = request.request_id
        if rid in self._requests:
            raise InvalidArgument(f"request {rid!r} is already live")
        if request.status is not RequestStatus.WAITING:
            raise InvalidArgument(
                f"request {rid!r} was already scheduled ({request.status.name})"
            )
        self.check_admissible(request)
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        request.metrics.arrival_time = request.arrival_time
        index = None if request.sampling.n > 1 else 0
        key = (request.priority, request.arrival_time, next(self._order))
        seq = _Seq(request.seq_id(index), request, index, key, self._max_num_outputs(request))
        self._requests[rid] = request
        self._seqs_of[rid] = [seq]
        self._waiting.push(seq)

    def check_admissible(self, request: Request) -> None:
        """Raise `RequestTooLarge` if `request` could never be admitted, even
        into an empty store: more samples than `max_num_seqs` (or, for a
        hybrid model, than recurrent slots), a prompt reaching
        `max_model_len`, or a prompt with more pages than the pool has past
        its watermark. O(1)."""
        cfg = self.config
        usable, num_slots = self._store_capacity()
        rid, n = request.request_id, request.sampling.n
        if n > cfg.max_num_seqs:
            raise RequestTooLarge(
                f"request {rid!r} asks for n={n} samples; max_num_seqs is {cfg.max_num_seqs}"
            )
        if self._hybrid and n > num_slots:
            raise RequestTooLarge(
                f"request {rid!r} asks for n={n} samples; there are {num_slots} recurrent slots"
            )
        num_prompt = request.num_prompt_tokens
        limit = self._max_model_len
        if limit is not None and num_prompt >= limit:
            raise RequestTooLarge(
                f"request {rid!r}: prompt of {num_prompt} tokens does not fit "
                f"max_model_len {limit}" + (" (what the pool holds past its watermark)"
                                             if cfg.max_model_len is None else "")
            )
        num_pages = -(-num_prompt // self._block_size)
        if num_pages > usable:
            raise RequestTooLarge(
                f"request {rid!r}: prompt of {num_prompt} tokens needs {num_pages} pages; "
                f"the pool has {usable} past its watermark"
            )

    def _max_num_outputs(self, request: Request) -> int:
        """Outputs after which a sample of `request` stops by length: its
        `max_tokens`, or fewer when `max_model_len` comes first."""
        max_tokens = request.sampling.max_tokens
        limit = self._max_model_len
        if limit is None:
            return max_tokens
        return min(max_tokens, limit - request.num_prompt_tokens)

    def _store_capacity(self) -> tuple[int, int]:
        """(pages a prompt may take in an empty store: the pool past its
        watermark; recurrent slots) of the store's main layer group."""
        return self.kv.num_usable_blocks, self.kv.num_slots

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        """End a request wherever it is and free everything it holds.

        Returns its final output (None for an unknown or finished id). Safe
        between `schedule()` and `update()`: the aborted sequences' work in
        that step is ignored (for a hybrid model such a sequence leaves
        nothing in the trie, since its slot may or may not hold the step's
        state). O(sequences of the request + running).
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self._rows_disturbed = True  # it may have a row in the step scheduled last
        seqs = self._seqs_of.pop(request_id)
        dropped = set()
        for seq in seqs:
            if seq.done:
                continue
            seq.done = True
            self._waiting.remove(seq)
            if seq.in_flight and self._hybrid:
                # Between schedule() and update() the slot may or may not hold
                # the step's state: give the trie nothing rather than a wrong one.
                self._release(seq, num_computed=0)
            else:
                self._release(seq)
            dropped.add(id(seq))
        if dropped:
            self._running = [s for s in self._running if id(s) not in dropped]
        for i, reason in enumerate(request.finish_reasons):
            if reason is None:
                request.finish_reasons[i] = RequestStatus.FINISHED_ABORTED
        request.status = RequestStatus.FINISHED_ABORTED
        request.metrics.finish_time = self.clock()
        self._totals.num_aborted_total += 1
        return RequestOutput(
            request_id, {}, True, request.status, list(request.finish_reasons)
        )

    def stop_sample(self, request_id: Hashable, index: int) -> RequestOutput | None:
        """End sample `index` of a live request as stopped (FINISHED_STOPPED),
        between steps: a stop string the engine found in its text. Its
        sequence is freed (computed tokens go into the trie); the request
        finishes when all its samples have. Returns the request's output
        (None for an unknown id or a sample already ended). O(running)."""
        request = self._requests.get(request_id)
        if request is None or request.finish_reasons[index] is not None:
            return None
        seqs = self._seqs_of[request_id]
        seq = next((s for s in seqs if s.index == index and not s.done), None)
        if seq is None:
            return None  # a prompt not forked yet has no sample to stop
        seq.done = True
        self._rows_disturbed = True  # it may be a row of the step scheduled last
        self._waiting.remove(seq)
        self._release(seq)
        self._running = [s for s in self._running if s is not seq]
        request.finish_reasons[index] = RequestStatus.FINISHED_STOPPED
        out = RequestOutput(request_id, {}, False, request.status, list(request.finish_reasons))
        if all(r is not None for r in request.finish_reasons):
            self._finish_request(request, self.clock())
            self._totals.num_finished_total += 1
            out.finished = True
            out.status = request.status
        return out

    # ------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; reserve its pages. See the module doc."""
        self._step += 1
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(self._step)
        self._scheduled, self._row_seqs, self._rows_disturbed = out, [], False
        stats = SchedulerStats(step=self._step)
        ops = self._pending_ops
        self._pending_ops = []
        budget = self._schedule_running(budget, out, stats, ops)
        if not out.preempted:
            self._schedule_waiting(budget, out, stats, ops)
        out.ops = tuple(ops)
        self._finish_stats(stats, out)
        return out

    def _schedule_running(self, budget, out, stats, ops) -> int:
        """Schedule the running sequences in order until the budget is spent.
        Runs of decode rows take one store call (`append_decode`); after the
        store refuses a run, rows go one by one (a batch of one), preempting
        from the back of the running list as each row or chunk needs."""
        running = self._running
        i = 0
        batched = True
        while i < len(running) and budget > 0:
            seqs, tokens, positions, indices, reqs, stale = _decode_rows(
                running, i, budget if batched else 1)
            if seqs:
                num_rows = len(seqs)
                seq_ids = list(map(_SEQ_ID, seqs))
                if self._reserve_decode_rows(seq_ids, tokens, ops):
                    self._row_seqs += seqs
                    out.rows.extend(seq_ids, tokens, positions, indices, reqs)
                    out.num_batched_tokens += num_rows
                    out.num_decode_tokens += num_rows
                    budget -= num_rows
                    i += num_rows
                    continue
                _unmark_decode_rows(running, i, num_rows, stale)
                if batched:
                    batched = False  # row by row from here
                    continue
                if self._preempt_last(running[i], out, stats, ops):
                    return budget
                continue
            seq = running[i]
            num_new = self._chunk(seq, budget)
            while not self._reserve(seq, seq.progress.num_computed + num_new, ops):
                if self._preempt_last(seq, out, stats, ops):
                    return budget
            self._emit(seq, num_new, out)
            budget -= num_new
            i += 1
        return budget

    def _preempt_last(self, seq: _Seq, out: SchedulerOutput, stats: SchedulerStats,
                      ops: list) -> bool:
        """Preempt the last running sequence to make room for `seq`; True
        when that was `seq` itself (nothing left to make room with)."""
        victim = self._running.pop()
        self._preempt(victim, out, stats, ops)
        return victim is seq

    def _schedule_waiting(self, budget, out, stats, ops) -> None:
        cfg = self.config
        waiting = self._waiting
        if budget <= 0 or not len(waiting):
            return  # the loop below would not start: skip its O(running) counts
        running = self._running
        partial = self._count_partial_prefills()  # None exactly when there is no limit
        max_partial = cfg.max_num_partial_prefills
        num_seqs = len(running) + sum(  # an unforked prompt counts n
            s.request.sampling.n - 1 for s in running if s.index is None)
        while budget > 0 and len(waiting):
            seq = waiting.peek()
            if seq is None:
                raise IntegrityError(f"the waiting queue counts {len(waiting)} but has none")
            width = _width(seq)
            if num_seqs + width > cfg.max_num_seqs:
                break
            if partial is not None and max_partial is not None and partial >= max_partial:
                break
            if not self._admit(seq, stats, ops):
                if running or not out.is_empty or not self._drop_prefix_cache():
                    break
                if not self._admit(seq, stats, ops):
                    break
            waiting.pop()
            num_seqs += width
            seq.request.status = RequestStatus.RUNNING
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = self.clock()
            self._insert_running(seq)
            if partial is not None and seq.num_tokens - seq.progress.num_computed > 1:
                partial += 1
            num_new = self._chunk(seq, budget)
            if not self._reserve(seq, seq.progress.num_computed + num_new, ops):
                continue  # swapped back in but no page to grow: next step
            self._emit(seq, num_new, out)
            budget -= num_new

    def _drop_prefix_cache(self) -> bool:
        """Last resort when nothing runs and the head still does not fit: its
        own prefix hit can pin cached pages it needs. Drops every cached
        prefix; True if there was a cache to drop."""
        if not self.kv.num_cached_blocks:
            return False
        self.kv.reset_prefix_cache()
        return True

    def _count_partial_prefills(self) -> int | None:
        """Running sequences with more than one token left (None: no limit set)."""
        if self.config.max_num_partial_prefills is None:
            return None
        return sum(1 for s in self._running if s.num_tokens - s.progress.num_computed > 1)

    def _admit(self, seq: _Seq, stats: SchedulerStats, ops: list) -> bool:
        """Give a waiting sequence its pages (swap in, or allocate). False when
        the store cannot; nothing changes then."""
        kv = self.kv
        if seq.swapped:
            if not kv.can_swap_in(seq.seq_id):
                return False
            _extend(ops, kv.swap_in(seq.seq_id))
            seq.swapped = False
            self._num_swapped -= 1
            return True
        num_tokens, prompt = seq.num_tokens, seq.request.prompt_tokens
        # The prompt itself when that is all: `allocate` checks and copies what it keeps.
        tokens = prompt if num_tokens == len(prompt) else seq.tokens(0, num_tokens)
        try:  # refused (nothing changed) exactly when `can_allocate` says no: one trie match
            alloc = kv.allocate(seq.seq_id, tokens, seq.request.namespace,
                                retention=seq.request.sampling.retention_priority)
        except (OutOfBlocks, OutOfSlots):
            return False
        _extend(ops, alloc.ops)
        seq.progress = alloc.progress
        seq.num_reserved = len(tokens)
        seq.branch_point = alloc.branch_point
        metrics = seq.request.metrics
        if metrics.num_cached_tokens is None:
            metrics.num_cached_tokens = alloc.num_cached_tokens
            metrics.cached_tokens_by_tier = alloc.cached_tokens_by_tier
        stats.num_prefix_hit_tokens += alloc.num_cached_tokens
        stats.num_admitted += 1
        return True

    def _insert_running(self, seq: _Seq) -> None:
        self._insert(self._running, seq)

    def _chunk(self, seq: _Seq, budget: int) -> int:
        """Tokens of `seq` to compute this step (>= 1 when budget >= 1)."""
        start = seq.progress.num_computed
        remaining = seq.num_tokens - start
        num_new = min(remaining, budget)
        limit = self.config.long_prefill_token_threshold
        if limit is not None and num_new > limit:
            num_new = limit
        if remaining > 1:
            num_new = self._snapshot_chunk(seq, start, num_new, remaining)
        return num_new

    def _snapshot_chunk(self, seq: _Seq, start: int, num_new: int, remaining: int) -> int:
        """End a chunk at the branch point; for hybrid models end a chunk that
        is cut anyway on a page boundary, so its end is a reusable snapshot."""
        bp = seq.branch_point
        if bp is not None and start < bp < start + num_new:
            return bp - start
        if self._hybrid and num_new < remaining:
            end = start + num_new
            aligned = end - end % self._block_size
            if aligned > start:
                return aligned - start
        return num_new

    def _reserve(self, seq: _Seq, end: int, ops: list) -> bool:
        """Make sure the store holds `seq`'s tokens up to `end`. False (nothing
        changed) when it has no room."""
        if end <= seq.num_reserved:
            return True
        return self._store_tokens(seq, seq.tokens(seq.num_reserved, end), end, ops)

    def _store_tokens(self, seq: _Seq, tokens: list[int], end: int, ops: list) -> bool:
        """Append `tokens` (`seq`'s tokens from `num_reserved` to `end`) to the
        store. False (nothing changed) when it has no room."""
        try:
            plan = self.kv.append(seq.seq_id, tokens)
        except (OutOfBlocks, OutOfSlots):
            return False
        if plan:
            ops.extend(plan)
        seq.num_reserved = end
        return True

    def _reserve_decode_rows(self, seq_ids: list, tokens: list[int], ops: list) -> bool:
        """Reserve the next token of every decode row (`_decode_rows`) in the
        store, in one call, whole or not at all: False (nothing changed) when the
        store refuses."""
        try:
            plan = self.kv.append_decode(seq_ids, tokens)
        except (OutOfBlocks, OutOfSlots):
            return False
        if plan:
            ops.extend(plan)
        return True

    def _emit(self, seq: _Seq, num_new: int, out: SchedulerOutput) -> None:
        start = seq.progress.num_computed
        end = start + num_new
        sample = end == seq.num_tokens
        seq.in_flight = True
        prefill = seq.in_prefill
        req = seq.request
        out.item_rows.append(len(out.rows.seq_ids))
        out.items.append(
            ScheduledSeq(
                seq.seq_id,
                req.request_id,
                seq.tokens(start, end),
                start,
                prefill,
                sample,
                req.sampling.n if (sample and seq.index is None) else 1,
                seq.index,
                req,
            )
        )
        out.num_batched_tokens += num_new
        if prefill:
            out.num_prefill_tokens += num_new
        else:
            out.num_decode_tokens += num_new

    def _preempt(self, seq: _Seq, out: SchedulerOutput, stats: SchedulerStats, ops: list) -> None:
        """Take a running sequence off the store (swap or recompute) and put
        it at the front of the waiting queue."""
        kv = self.kv
        if self.config.preemption == "swap" and _can_swap_out(kv, seq.seq_id):
            _extend(ops, kv.swap_out(seq.seq_id))
            seq.swapped = True
            self._num_swapped += 1
            stats.num_preempted_swap += 1
        else:
            self._release(seq)
            stats.num_preempted_recompute += 1
        req = seq.request
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        out.preempted.append(seq.seq_id)
        self._waiting.push(seq, front=True)

    def _release(self, seq: _Seq, num_computed: int | None = None) -> None:
        """Free `seq` in the store: its computed tokens (or its first
        `num_computed`) go into the trie."""
        if seq.swapped:
            self._num_swapped -= 1
        if seq.num_reserved or seq.swapped:
            if num_computed is None:
                num_computed = seq.progress.num_computed
            _extend(self._pending_ops, self.kv.free(seq.seq_id, num_computed=num_computed))
        seq.progress = _NoProgress()
        seq.num_reserved = 0
        seq.branch_point = None
        seq.swapped = False

    # --------------------------------------------------------------- update

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[Hashable, int | Sequence[int]],
        *,
        deltas: bool = True,
        row_tokens: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Record a computed step: `sampled[seq_id]` for every scheduled seq
        with `sample` set (an int, or `num_samples` ints for a prompt with
        n > 1 samples; numpy integers accepted). Returns one output per
        request that gained tokens or finished. O(scheduled + running).

        `row_tokens`: the tokens of `output.rows`, one per row in row order
        (as a batched decode forward yields them), standing for those rows'
        entries in `sampled`, which are then not read.

        `deltas=False`: only the outputs of requests a sample of which ended
        in this step, with no `new_tokens` (a caller that reads the tokens
        from its `Request`s, the simulator, skips building a delta per
        request per step); everything else is the same.

        Transactional: the output must be the last `schedule()`'s, not yet
        applied (`StaleSchedulerOutput` otherwise), and every sampled value
        is checked (`InvalidArgument`, naming it) before anything changes.
        """
        self._check_output(output, sampled)
        rows, sampled = self._plan_rows(output, sampled, row_tokens)
        row_seqs: list[_Seq]
        tokens_of_rows: Sequence[int]
        if rows is None:  # every row goes through the generic checks, as a record
            row_seqs, tokens_of_rows = [], []
            plan = self._plan_items(output.seqs, None, sampled)
        else:
            row_seqs, tokens_of_rows = rows
            plan = self._plan_items(output.items, output.item_rows, sampled)
        self._applied_step = output.step
        now = self.clock()
        results: dict[Hashable, RequestOutput] = {}
        forks: dict[int, list[_Seq]] = {}
        finished: set[int] = set()
        done = 0  # rows applied: items and rows go in running order
        for mark, item, seq, tokens in plan:
            if mark > done:
                self._add_sampled(row_seqs, tokens_of_rows, done, mark, now, results, finished,
                                  deltas, rows=True)
                done = mark
            if type(tokens) is int and not item.is_prefill:  # a decode row given as a record
                self._add_sampled([seq], [tokens], 0, 1, now, results, finished, deltas,
                                  rows=True)
            else:
                self._apply_item(item, seq, tokens, now, results, forks, finished, deltas)
        self._add_sampled(row_seqs, tokens_of_rows, done, len(row_seqs), now, results, finished,
                          deltas, rows=True)
        if forks or finished:
            self._rebuild_running(forks, finished)
        self._totals.num_finished_total += sum(1 for r in results.values() if r.finished)
        return list(results.values())

    def _add_sampled(self, seqs: Sequence[_Seq], tokens: Sequence[int], start: int, stop: int,
                     now: float, results: dict, finished: set[int], deltas: bool,
                     *, rows: bool = False) -> None:
        """Add `tokens[i]` to the sample of `seqs[i]` for i in `start:stop`
        (and to its request's output in `results` with `deltas`); a sample
        that stops at its token ends (its sequence's id into `finished`).
        The one path of every sampled token: decode rows (`rows`: each also
        counts its computed token and leaves flight), a prefill chunk's
        sample, the first tokens of a prompt's forks, accepted speculative
        tokens. Each sequence is one sample's. O(stop - start): this loop
        runs once per decoded token."""
        for seq, token in zip(itertools.islice(seqs, start, stop),
                              itertools.islice(tokens, start, stop)):
            req = seq.request
            metrics = req.metrics
            if rows:
                seq.in_flight = False
                # Set, not added to: a cache that ran the forward set it already.
                seq.progress.num_computed = seq.num_reserved
                metrics.num_computed_tokens += 1
            index: int = seq.index  # type: ignore[assignment]  # one sample's: set
            outputs = req.outputs[index]
            outputs.append(token)
            last = metrics.last_token_time
            if last is None:  # the request's first token (both times are set together)
                metrics.first_token_time = now
            elif now - last > metrics.max_token_gap:
                metrics.max_token_gap = now - last
            metrics.last_token_time = now
            metrics.num_generated_tokens += 1
            if deltas:
                _add_delta(results, req, index, token)
            params = req.sampling
            if len(outputs) < seq.max_num_outputs and token not in params.stop_token_ids:
                continue  # the common token: `_stop_reason` is None, decided inline
            if self._end_sample(seq, req, index, token, now, results):
                finished.add(id(seq))

    def _apply_item(self, item: ScheduledSeq, seq: _Seq, tokens, now: float, results: dict,
                    forks: dict[int, list[_Seq]], finished: set[int], deltas: bool) -> None:
        """Apply one checked record that is not a decode row: a prefill chunk
        (checkpointed; its sample, or the forks of a prompt with n > 1
        samples) or a speculative row (`AcceptedTokens`)."""
        seq.in_flight = False
        num_tokens = len(item.token_ids)
        seq.request.metrics.num_computed_tokens += num_tokens
        if type(tokens) is AcceptedTokens:
            self._add_accepted(seq, tokens, now, results, finished, deltas)
            return
        # Set, not added to: a cache that ran the forward set it already.
        seq.progress.num_computed = item.start_position + num_tokens
        if item.is_prefill:
            self._checkpoint(seq)
        if tokens is None:
            return
        if seq.index is None:
            forks[id(seq)] = self._fork(seq, tokens, now, results, finished, deltas)
        else:
            self._add_sampled([seq], [tokens], 0, 1, now, results, finished, deltas)

    def unschedule(self, items: Sequence[ScheduledSeq]) -> None:
        """The forward of these scheduled items did not run (it raised): the
        next `schedule()` gives their sequences the same work again. Their
        pages stay reserved. O(len(items))."""
        self._rows_disturbed = True
        for item in items:
            seq = self._live_seq(item)
            if seq is not None:
                seq.in_flight = False

    def _check_output(self, output: SchedulerOutput, sampled: object) -> None:
        """`update`'s argument checks that need no row: the types, and the
        output being the last `schedule()`'s, not applied yet."""
        if not isinstance(output, SchedulerOutput):
            raise WrongArgumentType(f"output must be a SchedulerOutput, got {output!r:.80}")
        if output.step != self._step or self._applied_step == output.step:
            raise StaleSchedulerOutput(
                f"SchedulerOutput of step {output.step} is stale: the last schedule() "
                f"was step {self._step}"
                + (", already applied" if self._applied_step == self._step else "")
            )
        if not isinstance(sampled, Mapping):
            raise WrongArgumentType(f"sampled must be a mapping, got {sampled!r:.80}")

    def _plan_rows(self, output: SchedulerOutput, sampled: Mapping,
                   row_tokens: Sequence[int] | None
                   ) -> tuple[tuple[list[_Seq], Sequence[int]] | None, Mapping]:
        """The decode rows of the last `schedule()`'s own output with their
        sampled tokens, checked at C speed: ((sequences, tokens), sampled).
        None in place of the rows when `_plan_items` must check them one by
        one as records (with `sampled` then holding `row_tokens` too): the
        output is another object, an abort, stop or `unschedule` since
        `schedule()` may have dropped a row, or a value is missing or not a
        plain token id (`_plan_items` then raises, naming it, or takes an
        accepted speculative row). Raises only for a `row_tokens` that is
        not one token per row. Changes nothing."""
        seq_ids = output.rows.seq_ids
        own = output is self._scheduled and not self._rows_disturbed
        tokens: Sequence[Any] | None = row_tokens  # whatever `sampled` holds: checked below
        if row_tokens is not None:
            if not isinstance(row_tokens, (list, tuple)):
                raise WrongArgumentType(
                    f"row_tokens must be a list of token ids, got {row_tokens!r:.80}")
            if len(row_tokens) != len(seq_ids):
                raise InvalidArgument(
                    f"row_tokens needs one token per row ({len(seq_ids)}), got {len(row_tokens)}")
        elif own:
            tokens = list(map(sampled.get, seq_ids))  # None for a missing id: checked below
        # `tokens` is set whenever `own` is; the rows are taken when every value is a plain int >= 0
        if own and tokens is not None and (
                not tokens or (set(map(type, tokens)) <= _INT_TYPE and min(tokens) >= 0)):
            return (self._row_seqs, tokens), sampled
        if row_tokens is not None:
            sampled = {**sampled, **dict(zip(seq_ids, row_tokens))}
        return None, sampled

    def _plan_items(self, items: Sequence[ScheduledSeq], item_rows: Sequence[int] | None,
                    sampled: Mapping) -> list[_PlannedItem]:
        """Check records of an `update` call; (rows before it, item, live
        seq, sampled tokens or None) per record whose sequence is still live
        and in flight. `item_rows`: the output's, or None for records that
        stand for every row themselves. Changes nothing."""
        plan: list[_PlannedItem] = []
        add_step, sampled_value = plan.append, sampled.get  # bound once: a call per record
        live_seq = self._live_seq
        marks = itertools.repeat(0) if item_rows is None else item_rows
        for item, mark in zip(items, marks):
            seq = live_seq(item)
            if seq is None or not seq.in_flight:
                continue  # aborted, or unscheduled after a failed forward: ignored
            tokens: int | list[int] | AcceptedTokens | None = None
            if item.sample:
                value = sampled_value(item.seq_id, _MISSING)
                if value is _MISSING:
                    raise InvalidArgument(f"sampled has no token for {item.seq_id!r}")
                if type(value) is int and value >= 0 and item.num_samples == 1:
                    tokens = value  # the common case, checked inline
                elif type(value) is AcceptedTokens:
                    tokens = _checked_accepted(item, seq, value)
                else:
                    tokens = _sampled_tokens(item, value)
            add_step((mark, item, seq, tokens))
        return plan

    def _live_seq(self, item: ScheduledSeq) -> _Seq | None:
        """The live sequence `item` was scheduled for; None when it ended
        or was aborted since. O(samples of its request)."""
        seqs = self._seqs_of.get(item.request_id)
        if seqs is None:
            return None  # aborted since
        for seq in seqs:
            if seq.seq_id == item.seq_id and not seq.done:
                return seq
        return None

    def _checkpoint(self, seq: _Seq) -> None:
        """Snapshot a prefill chunk end into the trie (best effort)."""
        if not (self.config.checkpoint_prefill and self._prefix_cache):
            return
        num_computed = seq.progress.num_computed
        if num_computed > len(seq.request.prompt_tokens):
            return  # recomputing outputs: the prompt's snapshot is what others share
        try:
            plan = self.kv.cache_prefix(seq.seq_id, num_computed)
        except (OutOfSlots, OutOfBlocks):
            return
        _extend(self._pending_ops, plan)

    def _fork(self, parent: _Seq, tokens, now: float, results, finished: set[int],
              deltas: bool) -> list[_Seq]:
        """The prompt of an n-sample request is done: one sequence per sample,
        sharing the prompt's pages (and slot) copy-on-write."""
        req = parent.request
        n = req.sampling.n
        kv = self.kv
        children = []
        for i in range(n):
            child_id = req.seq_id(i)
            _extend(self._pending_ops, kv.fork(parent.seq_id, child_id))
            children.append(_Seq(child_id, req, i, parent.key, parent.max_num_outputs,
                                 kv.progress(child_id), parent.num_reserved))
        num_computed = parent.progress.num_computed
        _extend(self._pending_ops, kv.free(parent.seq_id, num_computed=num_computed))
        parent.progress = _NoProgress()
        parent.done = True
        self._seqs_of[req.request_id] = children
        self._add_sampled(children, tokens, 0, n, now, results, finished, deltas)
        return children

    def _end_sample(
        self, seq: _Seq, req: Request, index: int, token: int, now: float, results
    ) -> bool:
        """`_add_sampled`'s end: if sample `index` stops at its new `token`,
        finish it (and its request when it was the last); True if it did."""
        reason = _stop_reason(seq, req, index, token)
        if reason is None:
            return False
        req.finish_reasons[index] = reason
        out = results.get(req.request_id)
        if out is None:
            out = results[req.request_id] = RequestOutput(req.request_id, {}, False, req.status)
        out.finish_reasons = list(req.finish_reasons)
        seq.done = True
        _extend(self._pending_ops,
                self.kv.free(seq.seq_id, num_computed=seq.progress.num_computed))
        seq.num_reserved = 0
        if all(r is not None for r in req.finish_reasons):
            self._finish_request(req, now)
            out.finished = True
        out.status = req.status
        return True

    def _add_accepted(self, seq: _Seq, accepted: AcceptedTokens, now: float, results,
                      finished: set[int], deltas: bool) -> None:
        """A speculative row's tokens, one by one until a stop condition; the
        store kept the accepted drafts (all but the last token) as reserved."""
        if seq.index is None:  # `_checked_accepted` admits one-sample rows only
            raise IntegrityError(f"accepted tokens for prompt sequence {seq.seq_id!r}")
        seq.progress.num_computed = accepted.num_computed
        seq.num_reserved += len(accepted.tokens) - 1
        for token in accepted.tokens:
            self._add_sampled([seq], [token], 0, 1, now, results, finished, deltas)
            if seq.done:
                return

    def _finish_request(self, req: Request, now: float) -> None:
        reasons = req.finish_reasons
        stopped = any(r is RequestStatus.FINISHED_STOPPED for r in reasons)
        all_stopped = all(r is RequestStatus.FINISHED_STOPPED for r in reasons)
        req.status = (
            RequestStatus.FINISHED_STOPPED
            if all_stopped or (stopped and len(reasons) == 1)
            else RequestStatus.FINISHED_LENGTH
        )
        req.metrics.finish_time = now
        del self._requests[req.request_id]
        del self._seqs_of[req.request_id]

    def _rebuild_running(self, forks: dict[int, list[_Seq]], finished: set[int]) -> None:
        if not forks:  # the common case: sequences ended, none forked
            self._running = [seq for seq in self._running if not seq.done]
            return
        running: list[_Seq] = []
        for seq in self._running:
            children = forks.get(id(seq))
            if children is not None:
                running.extend(c for c in children if not c.done)
            elif not seq.done:
                running.append(seq)
        self._running = running

    # ---------------------------------------------------------------- stats

    def _finish_stats(self, stats: SchedulerStats, out: SchedulerOutput) -> None:
        totals = self._totals
        totals.num_preempted_recompute_total += stats.num_preempted_recompute
        totals.num_preempted_swap_total += stats.num_preempted_swap
        totals.num_prefix_hit_tokens_total += stats.num_prefix_hit_tokens
        stats.num_preempted_recompute_total = totals.num_preempted_recompute_total
        stats.num_preempted_swap_total = totals.num_preempted_swap_total
        stats.num_prefix_hit_tokens_total = totals.num_prefix_hit_tokens_total
        stats.num_finished_total = totals.num_finished_total
        stats.num_aborted_total = totals.num_aborted_total
        stats.num_waiting = len(self._waiting)
        stats.num_running = len(self._running)
        stats.num_swapped = self._num_swapped
        stats.num_scheduled_seqs = len(out.items) + len(out.rows.seq_ids)
        stats.num_scheduled_tokens = out.num_batched_tokens
        stats.num_prefill_tokens = out.num_prefill_tokens
        stats.num_decode_tokens = out.num_decode_tokens
        stats.page_usage = self.kv.usage
        stats.num_free_blocks = self.kv.num_free_blocks
        self.stats = stats


_MISSING = object()  # no entry in `sampled`
# One record of `update`'s plan: (rows before it, the record, its live sequence,
# its checked sampled value: a token, one per sample, accepted drafts, or None)
_PlannedItem = tuple[int, ScheduledSeq, _Seq, int | list[int] | AcceptedTokens | None]
_INT_TYPE = {int}  # the type of a plain sampled token id


def pool_length(kv: KVStore) -> int | None:
    """The most tokens one sequence can hold in an empty store: the pool past
    its watermark when a page group keeps every page (full attention); None
    when every group slides (its pages are released as it goes: any length
    fits). O(groups)."""
    if all(usage.window is not None for usage in kv.group_usage()):
        return None
    return kv.num_usable_blocks * kv.block_size


def _length_limit(max_model_len: int | None, kv: KVStore) -> int | None:
    """`max_model_len` in effect over `kv`: what the pool holds for None;
    `InvalidArgument` for more than that (such a sequence would wait for
    pages for ever)."""
    longest = pool_length(kv)
    if max_model_len is None or longest is None:
        return longest if max_model_len is None else max_model_len
    if max_model_len > longest:
        raise InvalidArgument(
            f"max_model_len {max_model_len} is more than the pool can hold ({longest} tokens "
            f"past the watermark): such a sequence could never finish")
    return max_model_len


def _stop_reason(seq: _Seq, req: Request, index: int, token: int) -> RequestStatus | None:
    """Why sample `index` stops at its new `token` (None: it goes on)."""
    if token in req.sampling.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if len(req.outputs[index]) >= seq.max_num_outputs:
        return RequestStatus.FINISHED_LENGTH
    return None


def _add_delta(results: dict, req: Request, index: int, token: int) -> None:
    """Add `token` of sample `index` to `req`'s output of this update."""
    rid = req.request_id
    out = results.get(rid)
    if out is None:
        results[rid] = RequestOutput(rid, {index: [token]}, False, req.status,
                                     list(req.finish_reasons))
        return
    new_tokens = out.new_tokens.get(index)
    if new_tokens is None:
        out.new_tokens[index] = [token]
    else:
        new_tokens.append(token)


def _width(seq: _Seq) -> int:
    return seq.request.sampling.n if seq.index is None else 1


def _decode_rows(running: list[_Seq], start: int, limit: int) -> tuple[list, ...]:
    """The decode rows of `running` from `start` on, up to the first other
    sequence and at most `limit`: sequences of one sample whose tokens are
    all computed but the last sampled one, and whose store holds exactly
    their computed tokens. Each is marked (its token reserved, in flight) in
    this one pass: the store's `append_decode` of the rows' ids and tokens almost
    never refuses, and `_unmark_decode_rows` undoes the marks when it does.
    Returns the rows' sequences, tokens, positions, sample indices and
    requests, and the rows that were in flight already."""
    seqs: list[_Seq] = []
    tokens: list[int] = []
    stale: list[_Seq] = []
    positions: list[int] = []
    indices: list[int] = []
    reqs: list[Request] = []
    add_seq, add_token = seqs.append, tokens.append  # bound once
    add_position, add_index, add_req = positions.append, indices.append, reqs.append
    for seq in itertools.islice(running, start, start + limit):
        index = seq.index
        if index is None:
            break
        req = seq.request
        outputs = req.outputs[index]
        num_computed = seq.progress.num_computed
        if (not outputs or num_computed != len(req.prompt_tokens) + len(outputs) - 1
                or seq.num_reserved != num_computed):
            break
        if seq.in_flight:
            stale.append(seq)
        seq.in_flight = True
        seq.num_reserved = num_computed + 1
        add_seq(seq)
        add_token(outputs[-1])
        add_position(num_computed)
        add_index(index)
        add_req(req)
    return seqs, tokens, positions, indices, reqs, stale


_SEQ_ID = operator.attrgetter("seq_id")


def _unmark_decode_rows(running: list[_Seq], start: int, num_rows: int, stale: list[_Seq]) -> None:
    """Undo `_decode_rows`' marks on `running[start:start + num_rows]` (the
    store refused their batch): each reserves its computed tokens again, and
    is in flight only if it was before."""
    for seq in itertools.islice(running, start, start + num_rows):
        seq.num_reserved = seq.progress.num_computed
        seq.in_flight = False
    for seq in stale:
        seq.in_flight = True




def _extend(ops: list, plan) -> None:
    if plan:
        ops.extend(plan)


def _sampled_tokens(item: ScheduledSeq, value: int | Sequence[int]) -> int | list[int]:
    """The sampled value of one scheduled sequence, checked: an int for one
    sample, a list of `num_samples` ints for a prompt with several (one int
    there means that token for each)."""
    name = f"sampled[{item.seq_id!r}]"
    if isinstance(value, (int, np.integer)):
        token = check_int(name, value)
        return token if item.num_samples == 1 else [token] * item.num_samples
    tokens = token_list(value, name)
    if len(tokens) != item.num_samples:
        raise InvalidArgument(f"{name} needs {item.num_samples} tokens, got {len(tokens)}")
    return tokens[0] if item.num_samples == 1 else tokens


def _checked_accepted(item: ScheduledSeq, seq: _Seq, value: AcceptedTokens) -> AcceptedTokens:
    """A speculative row's result: one sample's row, at least one token id,
    a computed count within the tokens the store holds after the commit."""
    name = f"sampled[{item.seq_id!r}]"
    tokens = token_list(value.tokens, f"{name}.tokens")
    num_stored = seq.num_reserved + len(tokens) - 1
    if item.num_samples != 1 or not tokens:
        raise InvalidArgument(f"{name}: accepted tokens need a one-sample row and a token")
    check_int(f"{name}.num_computed", value.num_computed, 0, num_stored)
    return value


def _can_swap_out(kv: KVStore, seq_id: Hashable) -> bool:
    try:
        return kv.can_swap_out(seq_id)
    except BlockManagerError:
        return False


__all__ = [
    "AcceptedTokens",
    "DecodeRows",
    "RequestOutput",
    "RequestTooLarge",
    "StaleSchedulerOutput",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
