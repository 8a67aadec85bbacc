"""`CacheSteps`: the `views.StepSource` of a `PagedCache`, what a batch's views call.

A forward over the views of one `views()` / `step()` call starts a step at
the first layer that touches the cache (`BatchState.plan`). `begin_step`
reserves pages when nothing is pending (mlx-lm's `generate_step` feeds its
own tokens: their ids are placeholders, kept out of the prefix trie),
applies the queued plans, puts the step's tokens in flight and plans every
layer group's indices once (`step_plan.plan_step`), shared by all layers.
The step then counts (`commit_step`) or never happened (`rollback_step`).
In between, the views read the computed counts (their offsets), a token
context's ids, the pages' bytes, and trim (`trim_batch`: mlx-lm's `trim`;
within the open speculation for the views a `SpeculativeModel` feeds).

The counts are the cache's `ComputedCounts`, the pools its `GroupStorage`,
the bookkeeping its `GroupedStore`; what a step asks of the cache's own
sequence calls (each queues its plan) is `StepHost`. One `CacheSteps` per
batch, referred to by that batch only: the cache refers to a batch while
one of its steps is in flight, so a cache whose steps are settled is in no
reference cycle and frees its pools when dropped.

Costs: `begin_step` one flush plus O(rows x pages) numpy work per group
(the plans); the other calls O(rows).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx

from blockmgr import GroupedStore
from blockmgr.errors import IntegrityError, InvalidArgument
from blockmgr.ops import Plan
from blockmgr.validation import check_count
from cache.computed_counts import ComputedCounts
from cache.group_storage import GroupStorage
from cache.recurrent_backend import RecurrentBackend
from cache.step_plan import StepPlan, plan_step
from cache.views import BatchState


class StepHost(Protocol):
    """The cache's sequence calls a step makes (`PagedCache`): each has the
    store's meaning and queues its plan."""

    def append(self, seq_id: Hashable, new_tokens: Iterable[int]) -> Plan: ...
    def truncate(self, seq_id: Hashable, num_tokens: int) -> Plan: ...
    def commit_speculation(self, accepted: Mapping[Hashable, int]) -> frozenset[Hashable]: ...
    def flush(self) -> None: ...


class CacheSteps:
    """The steps of one batch's views over a cache; see the module doc."""

    __slots__ = ("_host", "_store", "_counts", "_storage", "_recurrent", "_reads_token_ids",
                 "paged_attention")

    def __init__(self, host: StepHost, store: GroupedStore, counts: ComputedCounts,
                 storage: GroupStorage, recurrent: RecurrentBackend | None, *,
                 reads_token_ids: bool, paged_attention: bool) -> None:
        """`reads_token_ids`: a layer reads input ids from the cache (a token
        context), so a step cannot reserve placeholder ids; `paged_attention`:
        attention calls are served from the pools in place."""
        self._host = host
        self._store = store
        self._counts = counts
        self._storage = storage
        self._recurrent = recurrent
        self._reads_token_ids = reads_token_ids
        self.paged_attention = paged_attention

    def begin_step(self, batch: BatchState, n: int | None, num_new) -> dict[int, StepPlan]:
        """Start a forward of `n` input positions over the batch's sequences
        (None: the model never said its input width; the pending tokens):
        reserve pages if nothing is pending (generate_step), apply queued
        ops, plan every group's indices. The step's tokens are in flight
        until `commit_step`."""
        seq_ids = batch.seq_ids
        n, new, reserve = self._counts.step_widths(seq_ids, n, num_new)
        if reserve:
            # Nothing reserved (generate_step feeds tokens itself): reserve N each.
            if self._reads_token_ids:
                raise InvalidArgument(
                    f"{list(seq_ids)!r}: this model reads its input ids from the cache; "
                    "reserve them first (allocate / append)")
            for s in seq_ids:
                # Placeholder ids (the manager takes only token ids), marked
                # so to keep them out of the trie.
                num_before = self._store.num_tokens(s)
                self._host.append(s, [0] * n)
                self._counts.placeholders(s, num_before)
        self._host.flush()
        offsets = self._counts.start_step(batch, new)
        store, block_size = self._store, self._store.block_size
        return {gi: plan_step([store.block_table(s, gi) for s in seq_ids], offsets, new, n,
                              block_size, g.num_pages, g.window)
                for gi, g in enumerate(self._storage.groups)}

    def commit_step(self, batch: BatchState) -> None:
        """The batch's last step finished (`ComputedCounts.commit_step`)."""
        self._counts.commit_step(batch)

    def rollback_step(self, batch: BatchState) -> None:
        """The batch's last step failed (`ComputedCounts.rollback_step`)."""
        self._counts.rollback_step(batch)

    def recurrent_views(self, seq_ids: Sequence, plan: StepPlan) -> Mapping[int, Any]:
        """The backend's views for a started step: each row's slot (after the
        step's appends), padded rows' real token counts."""
        if self._recurrent is None:
            return {}
        slots = [self._slot(s) for s in seq_ids]
        n = plan.num_queries
        lengths = list(plan.n_new) if any(k != n for k in plan.n_new) else None
        return self._recurrent.views(slots, lengths)

    def computed_counts(self, seq_ids: Sequence) -> list[int]:
        """Computed tokens of each sequence, counting a step in flight (the
        views' offsets after a layer wrote its part of the step)."""
        return self._counts.computed_counts(seq_ids)

    def token_context(self, seq_ids: Sequence, offsets: Sequence[int], width: int) -> mx.array:
        """Each row's last `width` token ids before `offsets`
        (`ComputedCounts.token_context`; never placeholders for a model
        whose tokens are reserved first, see `begin_step`)."""
        return self._counts.token_context(seq_ids, offsets, width)

    def can_trim(self, batch: BatchState) -> bool:
        """mlx-lm's `is_trimmable` for the batch's views: attention-only
        storage (`truncate`), or views a `SpeculativeModel` feeds (a trim
        within its open speculation; recurrent state cannot be cut otherwise)."""
        return batch.speculative or not self._store.is_hybrid

    def trim_batch(self, batch: BatchState, n: int) -> int:
        """Drop the last `n` computed tokens of every sequence (mlx-lm's
        `trim`); returns how many were dropped. For views a
        `SpeculativeModel` feeds: within the open speculation, a commit
        keeping all but the last `n` (a hybrid sequence gets its checkpoint
        back, and the tokens since it are computed again before the next
        input); without one, a hybrid batch drops nothing (0, as mlx-lm's
        caches for state they cannot trim). Raises `InvalidArgument`
        (nothing changed) for a trim past a speculation's start."""
        seq_ids = batch.seq_ids
        counts = self._counts
        if batch.speculative and any(
                self._store.speculation_start(s) is not None for s in seq_ids):
            return self._trim_speculation(seq_ids, n)
        if self._store.is_hybrid:
            return 0  # recurrent state cannot be cut outside a speculation
        n = min([n] + counts.computed_counts(seq_ids))
        for s in seq_ids:
            self._host.truncate(s, counts.state(s).progress.num_computed - n)
        return n

    def _trim_speculation(self, seq_ids: Sequence, n: int) -> int:
        n = check_count("n", n)
        kept = {}
        for s in seq_ids:
            start = self._store.speculation_start(s)
            if start is None:
                raise InvalidArgument(f"cannot trim {s!r}: it has no speculation open")
            tail = self._store.num_tokens(s) - start
            if n > tail:
                raise InvalidArgument(
                    f"cannot trim {n} tokens of {s!r}: its speculation holds {tail}")
            kept[s] = tail - n
        self._host.commit_speculation(kept)
        self._counts.replay(kept)
        return n

    def held_bytes(self, group: int, layer: int, seq_ids: Sequence) -> int:
        """Bytes of the pages the sequences hold in `layer` (shared counted once)."""
        page_nbytes = self._storage.page_nbytes(group, layer)
        if not page_nbytes:
            return 0
        store = self._store
        pages = {p for s in seq_ids for p in store.block_table(s, group) if p is not None}
        return len(pages) * page_nbytes

    def _slot(self, seq_id: Hashable) -> int:
        """The recurrent slot of a live sequence of a hybrid model."""
        slot = self._store.slot(seq_id)
        if slot is None:
            raise IntegrityError(f"{seq_id!r} has no recurrent slot")
        return slot
