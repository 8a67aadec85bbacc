"""`ComputedCounts`: what `PagedCache` tracks of each live sequence's computation.

A token counts as *computed* once the forward that writes its K/V (and
recurrent state) finished: mlx-lm's cache offset, what a forward reads and
advances. That count is the store's `blockmgr.Progress` record of the
sequence, the one every layer reads (design/ARCHITECTURE.md, "A
sequence's computed count"); the store moves it where its calls cut or
restore tokens (truncate, a speculation's commit), and this module where a
forward finishes. Beside it, per live sequence of one cache, `SeqState`
keeps how many leading ids are real (`known`: a forward over tokens nobody
reserved appends placeholders, which never enter the prefix trie), the
step in flight and the views running it, and a trim's replay end (an open
speculation is the store's: `speculation_start`).

`ComputedCounts` says how the cache's calls move them: a step's tokens go
in flight when it starts (`start_step`), count when it finishes
(`commit_step`) or never (`rollback_step`), and a `views()` step still in
flight is settled the next time its sequences are touched (`state`). It
reads token counts and records from the store (`CountedStore`, a
`blockmgr.GroupedStore`) and holds no reference to the cache; a sequence
refers to its batch only while a step is in flight, so a cache whose steps
are settled is in no reference cycle (design/cache.md, `views.py`).

Costs: O(1) per sequence named, but `token_context` (one copy of each
row's token list) and `check_integrity` / `debug_state` (O(sequences)).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from blockmgr import Progress
from blockmgr.errors import IntegrityError, InvalidArgument, UnknownSequence
from cache.views import BatchState


class CountedStore(Protocol):
    """What the counts read of the store (`blockmgr.GroupedStore`)."""

    def num_tokens(self, seq_id: Hashable) -> int: ...
    def progress(self, seq_id: Hashable) -> Progress: ...
    def tokens(self, seq_id: Hashable) -> list[int]: ...
    def sequence_ids(self) -> list[Hashable]: ...


@dataclass(slots=True)
class SeqState:
    """One live sequence's counts (see the module doc)."""

    progress: Progress  # the store's: tokens whose K/V (and state) a finished forward wrote
    known: int  # leading tokens whose ids are real (views may add placeholders)
    in_flight: int = 0  # tokens of a started step that has not finished yet
    step_end: int = 0  # the computed count once that step finished
    batch: BatchState | None = None  # the views running that step
    replay_end: int | None = None  # a trim restored a checkpoint: tokens up to here computed again


class ComputedCounts:
    """What a cache tracks of its live sequences' computation; see the module doc."""

    __slots__ = ("_store", "_exact", "_seqs")

    def __init__(self, store: CountedStore, exact_snapshots: bool) -> None:
        """`exact_snapshots`: the prefix trie takes exactly the computed
        tokens or none (a hybrid model's slot holds the state after the
        last computed token and cannot be cut)."""
        self._store = store
        self._exact = exact_snapshots
        self._seqs: dict[Hashable, SeqState] = {}

    # --- live sequences -----------------------------------------------------------

    def state(self, seq_id: Hashable) -> SeqState:
        """The sequence's state; a `views()` step in flight is settled first
        (`settle`). Raises `UnknownSequence` for an id that is not live."""
        try:
            state = self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"no live sequence {seq_id!r}") from None
        if state.in_flight and state.batch is not None and state.batch.auto_commit:
            self.settle(state.batch)
        return state

    def add(self, seq_id: Hashable, known: int) -> None:
        """A new live sequence of the store (allocated or forked)."""
        self._seqs[seq_id] = SeqState(self._store.progress(seq_id), known)

    def remove(self, seq_id: Hashable) -> None:
        """The sequence ended."""
        del self._seqs[seq_id]

    def appended(self, seq_id: Hashable, num_before: int) -> None:
        """The store appended real ids to the sequence (an `append`, or a
        speculation's drafts), which held `num_before` tokens: known if every
        id before them is."""
        state = self._seqs[seq_id]
        if state.known == num_before:
            state.known += self._store.num_tokens(seq_id) - num_before

    def placeholders(self, seq_id: Hashable, num_before: int) -> None:
        """The ids appended to the sequence past its first `num_before` are
        placeholders (a forward fed ids the storage was not told): not known."""
        state = self._seqs[seq_id]
        state.known = min(state.known, num_before)

    def clip(self, seq_ids: Iterable[Hashable]) -> None:
        """The store cut the sequences' tokens (truncate, a speculation's
        commit or shortening; it set their counts): nothing past them is
        known."""
        for seq_id in seq_ids:
            state = self._seqs[seq_id]
            state.known = min(state.known, self._store.num_tokens(seq_id))

    def written(self, seq_id: Hashable, num_tokens: int) -> None:
        """The sequence's first `num_tokens` tokens were written outside a
        forward (a prefix import wrote their records into its pages)."""
        self._seqs[seq_id].progress.num_computed = num_tokens

    def trie_count(self, seq_id: Hashable, num_tokens: int | None) -> int:
        """Tokens the trie may take of `num_tokens` (None: all computed):
        computed, with known ids, and with exact snapshots exactly the
        computed ones, else none. Raises `InvalidArgument` for a count
        that is not an int within the computed tokens."""
        state = self.state(seq_id)
        computed = state.progress.num_computed
        limit = min(computed, state.known)
        if num_tokens is None:
            n = limit
        elif isinstance(num_tokens, bool) or not isinstance(num_tokens, int) \
                or not 0 <= num_tokens <= computed:
            raise InvalidArgument(f"{seq_id!r} has {computed} computed tokens, not {num_tokens!r}")
        else:
            n = min(num_tokens, limit)
        if self._exact and n != computed:
            return 0
        return n

    def snapshot_count(self, seq_id: Hashable, num_tokens: int | None) -> int:
        """`trie_count` for a snapshot taken now (`cache_prefix`): with exact
        snapshots, a count other than the computed one raises `InvalidArgument`."""
        computed = self.state(seq_id).progress.num_computed
        if self._exact and num_tokens not in (None, computed):
            raise InvalidArgument(
                f"{seq_id!r}: recurrent state exists only after its {computed} "
                f"computed tokens, not after {num_tokens!r}"
            )
        return self.trie_count(seq_id, num_tokens)

    # --- speculation ------------------------------------------------------------

    def replay(self, seq_ids: Iterable[Hashable]) -> None:
        """A trim restored the sequences' checkpoints: the tokens from their
        computed count to their end are to be computed again (`num_replay`)."""
        for seq_id in seq_ids:
            num_tokens = self._store.num_tokens(seq_id)
            state = self._seqs[seq_id]
            if state.progress.num_computed < num_tokens:
                state.replay_end = num_tokens

    def num_replay(self, seq_id: Hashable) -> int:
        """Tokens a trim's restored checkpoint made pending again."""
        state = self.state(seq_id)
        if state.replay_end is None:
            return 0
        end = min(state.replay_end, self._store.num_tokens(seq_id))
        return max(0, end - state.progress.num_computed)

    # --- steps ------------------------------------------------------------------

    def step_widths(self, seq_ids: Sequence[Hashable], n: int | None,
                    num_new: Sequence[int] | None) -> tuple[int, list[int], bool]:
        """(input width, real new tokens per row, reserve) of a step of `n`
        input positions (None: the model never said; the pending tokens).
        `reserve`: nothing is pending, the step's tokens need `n` pages each
        first (mlx-lm's `generate_step`). Raises `InvalidArgument` for
        `num_new` beyond the pending tokens or `n`, or a width nobody gave."""
        pending = [self._store.num_tokens(s) - self.state(s).progress.num_computed
                   for s in seq_ids]
        if n is None:
            n = max(num_new or pending)
            if n == 0:
                raise InvalidArgument(
                    f"{list(seq_ids)!r}: this model never tells its cache how many tokens "
                    "it feeds; reserve them first (allocate / append)")
        if num_new is not None:
            if any(not 0 <= k <= min(p, n) for k, p in zip(num_new, pending)):
                raise InvalidArgument(f"num_new {num_new} exceeds pending {pending} or N={n}")
            return n, list(num_new), False
        if not any(pending):
            return n, [n] * len(seq_ids), True
        return n, [min(p, n) for p in pending], False

    def start_step(self, batch: BatchState, new: Sequence[int]) -> list[int]:
        """The batch's step started with `new[b]` tokens of row b in flight;
        returns each row's computed count (its offset)."""
        offsets = []
        for seq_id, k in zip(batch.seq_ids, new):
            state = self._seqs[seq_id]
            offset = state.progress.num_computed
            state.in_flight = k
            state.step_end = offset + k
            state.batch = batch
            offsets.append(offset)
        return offsets

    def commit_step(self, batch: BatchState) -> None:
        """The batch's last step finished: its tokens are computed and its
        recurrent writes go to the slots. Idempotent. The count is set to
        the step's end, not added to: a scheduler that ran the step may
        have set it already (a `views()` step settles only at the next
        call)."""
        for view in batch.recurrent.values():
            view.commit()
        for seq_id in batch.seq_ids:
            state = self._seqs.get(seq_id)
            if state is not None and state.in_flight:
                state.progress.num_computed = state.step_end
                state.in_flight = 0
                state.batch = None  # settled; the batch refers to the cache

    def rollback_step(self, batch: BatchState) -> None:
        """The batch's last step failed: nothing of it counts (its recurrent
        writes are dropped; K/V written past the computed tokens are
        overwritten by the retry)."""
        batch.recurrent = {}
        for seq_id in batch.seq_ids:
            state = self._seqs.get(seq_id)
            if state is not None:
                state.in_flight = 0
                state.batch = None

    def settle(self, batch: BatchState) -> None:
        """A `views()` step is still in flight when its sequences are next
        touched: it counts as computed if every layer that writes wrote its
        part of it; else the forward raised midway and the step is rolled
        back, as `step` does (these views then take no further forward: their
        layers' counters are out of step with the storage)."""
        if batch.complete:
            self.commit_step(batch)
        else:
            self.rollback_step(batch)
            batch.closed = True

    def computed_counts(self, seq_ids: Sequence[Hashable]) -> list[int]:
        """Computed tokens of each sequence, counting a step in flight (the
        views' offsets after a layer wrote its part of the step)."""
        counts = []
        for s in seq_ids:
            state = self._seqs.get(s)
            if state is None:
                raise UnknownSequence(f"no live sequence {s!r}")
            counts.append(state.progress.num_computed + state.in_flight)
        return counts

    def token_context(self, seq_ids: Sequence[Hashable], offsets: Sequence[int],
                      width: int) -> mx.array:
        """``[B, width]`` int64: row b's token ids ``[offsets[b] - width,
        offsets[b])``, left-padded with id 0 (see `TokenContextView`).
        Raises `InvalidArgument` where those ids are placeholders.
        Cost: one copy of each row's token list."""
        rows = []
        for s, end in zip(seq_ids, offsets):
            state = self._seqs.get(s)
            if state is None:
                raise UnknownSequence(f"no live sequence {s!r}")
            if end > state.known:
                raise InvalidArgument(f"{s!r}: ids before token {end} are not known")
            ids = self._store.tokens(s)[max(0, end - width):end]
            rows.append([0] * (width - len(ids)) + ids)
        return mx.array(rows, dtype=mx.int64).reshape(len(rows), width)

    # --- checks -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless these are the store's sequences, each
        reading the store's count, within their tokens with a step in
        flight. O(sequences)."""
        store = self._store
        if set(self._seqs) != set(store.sequence_ids()):
            raise IntegrityError("the cache and its store hold different sequences")
        for seq_id, state in self._seqs.items():
            if state.progress is not store.progress(seq_id):
                raise IntegrityError(f"{seq_id!r}: the cache reads another count than its store")
            num_tokens = store.num_tokens(seq_id)
            computed, in_flight = state.progress.num_computed, state.in_flight
            if not 0 <= computed <= num_tokens or computed + in_flight > num_tokens:
                raise IntegrityError(
                    f"{seq_id!r}: {computed} computed + {in_flight} in flight "
                    f"of {num_tokens} tokens"
                )
            if state.known > num_tokens:
                raise IntegrityError(f"{seq_id!r}: {state.known} known of {num_tokens} tokens")

    def debug_state(self) -> tuple[object, ...]:
        """Each sequence's counts as plain values. O(sequences)."""
        return tuple(
            (seq_id, st.progress.num_computed, st.known, st.in_flight, st.replay_end)
            for seq_id, st in self._seqs.items()
        )
