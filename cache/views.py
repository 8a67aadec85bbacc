"""Per-layer views over the page pools, following mlx-lm's cache protocol.

`PagedCache.views(ids)` returns one view per layer; all attention views of
one call share a `BatchState`, which starts a step (reserves pages if
needed, applies pending memory ops, plans indices once per page group) the
first time any layer of a forward pass touches the cache. A view therefore
costs one scatter and one gather per pool array per step.

mlx-lm reads ``cache.offset`` before ``update_and_fetch`` (RoPE) and calls
``make_mask`` once per forward, before the layers; both see the offsets from
before the step until the layer has written it, as with `KVCache`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Protocol, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

from blockmgr.errors import IntegrityError, InvalidArgument
from cache.page_format import PageStore
from cache.step_plan import StepPlan

PoolFor = Callable[[int, mx.array | None, mx.array | None], PageStore | None]
"""A layer's pool: created from the first write's K/V shapes, None before it."""


class StepSource(Protocol):
    """What the views need from their owner (the `PagedCache`)."""

    @property
    def paged_attention(self) -> bool: ...
    def begin_step(self, batch: BatchState, n: int | None, num_new) -> dict[int, StepPlan]: ...
    def commit_step(self, batch: BatchState) -> None: ...
    def rollback_step(self, batch: BatchState) -> None: ...
    def recurrent_views(self, seq_ids: Sequence, plan: StepPlan) -> Mapping[int, Any]: ...
    def computed_counts(self, seq_ids: Sequence) -> list[int]: ...
    def token_context(self, seq_ids: Sequence, offsets: Sequence[int], width: int) -> mx.array: ...
    def can_trim(self, batch: BatchState) -> bool: ...
    def trim_batch(self, batch: BatchState, n: int) -> int: ...
    def held_bytes(self, group: int, layer: int, seq_ids: Sequence) -> int: ...


class BatchState:
    """Step bookkeeping shared by the views of one `views()` call.

    A step is *complete* once every view that writes (`expect_writes`: the
    attention, recurrent and composite views the model was handed) wrote its
    part of it (`wrote`). A step that is not (the forward raised between two
    layers) counts as never run: the next step, or the owner's next call
    about these sequences, rolls it back instead of committing it."""

    __slots__ = ("owner", "seq_ids", "auto_commit", "steps", "trims", "last_trim", "plans",
                 "recurrent", "masked", "speculative", "closed", "_num_new", "_writers",
                 "_written")

    def __init__(
        self, owner: StepSource, seq_ids: Sequence, num_new=None, auto_commit: bool = True
    ) -> None:
        """`auto_commit`: a step counts as finished once the next one starts
        (or the owner is called about its sequences); else only when the
        owner's `commit_step` is called."""
        self.owner = owner
        self.seq_ids = tuple(seq_ids)
        self.auto_commit = auto_commit
        self.steps = 0  # steps started
        self.trims = 0  # trims performed
        self.last_trim = 0
        self.plans: dict[int, StepPlan] = {}
        self.recurrent: Mapping[int, Any] = {}  # backend views of the current step
        self.masked = False  # the model builds masks: they start the steps
        # Fed by a `SpeculativeModel` only: every step's widths come from it.
        self.speculative = False
        # Set when a step that did not complete was rolled back outside a
        # forward: the views' own counters no longer follow the storage.
        self.closed = False
        self._num_new = num_new  # explicit chunk lengths for the next step only
        self._writers: tuple[int, ...] = ()  # ids of the views that write every step
        self._written: set[int] = set()  # ... that wrote in the current step

    def expect_writes(self, views: Sequence[object]) -> None:
        """The views the model writes in every forward (one entry each)."""
        self._writers = tuple(id(v) for v in views)

    def wrote(self, view: object) -> None:
        """`view` wrote its part of the current step. O(1)."""
        self._written.add(id(view))

    @property
    def complete(self) -> bool:
        """Did every expected view write in the current step? O(views)."""
        written = self._written
        return all(w in written for w in self._writers)

    def feed(self, num_new: Sequence[int] | None) -> None:
        """The real input tokens of each row in the next step (None: the
        pending ones); `SpeculativeModel` says it before every forward."""
        self._num_new = None if num_new is None else list(num_new)

    def plan(self, calls: int, group: int, n: int | None) -> StepPlan:
        """The plan of the view's next step, starting the step if it is the
        first. `n` (input width) None: the step covers the pending tokens
        (for models that never tell their caches how many tokens they feed)."""
        if self.closed:
            raise InvalidArgument(
                f"{list(self.seq_ids)!r}: the last forward through these views did not "
                "finish and was rolled back; take new views for the next one")
        if calls == self.steps:
            if self.speculative and self._num_new is None:
                raise InvalidArgument(
                    f"{list(self.seq_ids)!r}: these views are fed by a SpeculativeModel; "
                    "call the model through it (it records the input ids)")
            if self.steps:  # the model is past the last step: it counts if it completed
                if self.complete:
                    self.owner.commit_step(self)
                else:
                    self.owner.rollback_step(self)
            self.plans = self.owner.begin_step(self, n, self._num_new)
            self._written = set()
            self.recurrent = self.owner.recurrent_views(self.seq_ids, self.plans[0])
            self._num_new = None
            self.steps += 1
        return self.plans[group]

    def trim(self, num_view_trims: int, n: int) -> int:
        """mlx-lm trims every layer's cache: the first view's call (its
        `num_view_trims`-th) trims the batch, the others get its result."""
        if num_view_trims == self.trims:
            self.last_trim = self.owner.trim_batch(self, n)
            self.trims += 1
        return self.last_trim


class AttentionView:
    """One attention layer's cache for a batch of sequences (mlx-lm protocol).

    `offset`: int for one sequence, else an int32 ``mx.array`` of per-sequence
    offsets. `update_and_fetch(keys, values)` with keys ``[B, n_kv_heads, N,
    head_dim]`` (right-padded when rows have fewer new tokens) writes the new
    K/V into their pages in place and returns the gathered history
    ``[B, n_kv_heads, T, head_dim]``; `make_mask` masks causality, padding
    and the sliding window. `trim(n)` rolls every sequence back n tokens
    through the manager's truncate.
    """

    __slots__ = ("_batch", "_group", "_layer", "_pool_for", "_window", "_calls", "_trims",
                 "_fetched")

    def __init__(
        self,
        batch: BatchState,
        group: int,
        layer: int,
        pool_for: PoolFor,
        window: int | None,
    ) -> None:
        self._batch = batch
        self._group = group
        self._layer = layer
        self._pool_for = pool_for
        self._window = window
        self._calls = 0
        self._trims = 0
        # Weak refs to the last history handed out, so `attend` can tell the
        # model passed it on unchanged (strong refs would keep the pool
        # referenced and turn the next in-place write into a pool copy).
        self._fetched: tuple[weakref.ref, weakref.ref] | None = None

    def __bool__(self) -> bool:  # mlx-lm tests `if cache` before make_mask
        return True

    @property
    def offset(self) -> int | mx.array:
        batch = self._batch
        if self._calls < batch.steps:  # step started, this layer not written yet
            return batch.plans[self._group].offset_value(after=False)
        offs = batch.owner.computed_counts(batch.seq_ids)
        return offs[0] if len(offs) == 1 else mx.array(offs, dtype=mx.int32)

    @property
    def max_size(self) -> int | None:
        """The sliding window (RotatingKVCache's name for it), else None."""
        return self._window

    @property
    def start_position(self) -> int | mx.array:
        """Position of the first key the history holds before this step's
        write (`ChunkedKVCache`'s name: llama4 builds its chunk mask from it):
        the window's first key for the step's first query, 0 without window."""
        offset = self.offset
        if self._window is None:
            return 0 if isinstance(offset, int) else mx.zeros_like(offset)
        if isinstance(offset, int):
            return max(0, offset - (self._window - 1))
        return mx.maximum(offset - (self._window - 1), 0)

    def maybe_trim_front(self) -> None:
        """`ChunkedKVCache` protocol: nothing to do, the window's block
        manager releases pages that fall out of it."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        plan = self._batch.plan(self._calls, self._group, keys.shape[2])
        pool = self._pool(keys, values)
        h = keys.shape[1]
        src, rows, cols = plan.write_index(h)
        num_rows = keys.shape[0] * keys.shape[1] * keys.shape[2]  # no -1: widths may be 0
        k = keys.reshape(num_rows, keys.shape[-1])
        v = values.reshape(num_rows, values.shape[-1])
        if src is not None:  # padded rows: keep real tokens only
            k, v = mx.take(k, src, axis=0), mx.take(v, src, axis=0)
        pool.write(rows, cols, k, v)
        self._batch.wrote(self)
        self._calls += 1
        if plan.exact and plan.offsets[0] == 0:
            # A fresh prefill: the history is exactly the new keys (as the
            # pool stores them), no gather.
            k_hist, v_hist = pool.stored(keys, values)
        else:
            k_hist, v_hist = _history(plan, pool)
        self._fetched = (weakref.ref(k_hist), weakref.ref(v_hist))
        return k_hist, v_hist

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The history the last `update_and_fetch` returned (mlx-lm's protocol
        for KV-shared layers: a later layer attends over this layer's keys).
        Cost: nothing while the model still holds that history, else one
        gather of the step's pages."""
        if self._fetched is not None:
            k_hist, v_hist = self._fetched[0](), self._fetched[1]()
            if k_hist is not None and v_hist is not None:
                return k_hist, v_hist
        if self._calls == 0:
            raise InvalidArgument(f"layer {self._layer}: keys_and_values before any update")
        return _history(self._batch.plans[self._group], self._pool())

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask
    ) -> mx.array | None:
        """Attention over this step's pages read in place (the pool's
        `attend`: `paged_attention`, or quantized matmuls on quantized
        pages), or None when the call is not one it can serve exactly:
        `keys`/`values` must be what `update_and_fetch` just returned and the
        mask what this step's `make_mask` gives. The pool declines (None)
        where the model's kernel on the gathered history is faster.
        """
        batch = self._batch
        fetched, self._fetched = self._fetched, None
        if fetched is None or fetched[0]() is not keys or fetched[1]() is not values:
            return None
        if not batch.owner.paged_attention:
            return None
        plan = batch.plans[self._group]
        if not _is_step_mask(mask, plan, self._window):
            return None
        return self._pool().attend(queries, plan, scale, mask)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        self._batch.masked = True
        plan = self._batch.plan(self._calls, self._group, N)
        if N == 1 and window_size is not None and self._window is not None:
            # A RotatingKVCache keeps only max_size keys, so in decode mlx-lm
            # attends over at most that many whatever window it asks for
            # (plamo3 asks for max_size + 1).
            window_size = min(window_size, self._window)
        return plan.mask(N, window_size, return_array)

    # --- the rest of the protocol ------------------------------------------

    @property
    def keys(self) -> mx.array:
        """The step's key history (`KVCache.keys` as `keys_and_values` bounds it)."""
        return self.keys_and_values()[0]

    @keys.setter
    def keys(self, value: mx.array) -> None:
        # mlx-lm models assign only `mx.depends(cache.keys, ...)` of the same
        # arrays, to order evaluation (deepseek_v32, minimax_m3_vl); the pages
        # are the storage and are evaluated with the pools, so nothing to keep.
        pass

    @property
    def values(self) -> mx.array:
        """The step's value history (see `keys`)."""
        return self.keys_and_values()[1]

    @values.setter
    def values(self, value: mx.array) -> None:
        # deepseek_v32's indexer blanks the values it never reads (graph size);
        # see `keys`.
        pass

    def _pool(self, keys: mx.array | None = None, values: mx.array | None = None) -> PageStore:
        """The layer's pool (created from `keys` / `values` on the first write)."""
        pool = self._pool_for(self._layer, keys, values)
        if pool is None:
            raise IntegrityError(f"layer {self._layer} has no pool before its first write")
        return pool

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The layer's pool arrays, for `mx.eval` only (see `PageStore.arrays`)."""
        pool = self._pool_for(self._layer, None, None)
        return () if pool is None else pool.arrays()

    def is_trimmable(self) -> bool:
        """Attention-only storage, or views a `SpeculativeModel` feeds."""
        return self._batch.owner.can_trim(self._batch)

    def trim(self, n: int) -> int:
        """Drop the last n tokens of every sequence (once per batch, not per
        layer; see `PagedCache.trim_batch`)."""
        trimmed = self._batch.trim(self._trims, n)
        self._trims += 1
        return trimmed

    def size(self) -> int:
        offs = self._batch.owner.computed_counts(self._batch.seq_ids)
        return max(offs)

    def empty(self) -> bool:
        return self.size() == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the pages these sequences hold in this layer (shared counted once)."""
        return self._batch.owner.held_bytes(self._group, self._layer, self._batch.seq_ids)

    def __repr__(self) -> str:
        return f"AttentionView(layer={self._layer}, seqs={list(self._batch.seq_ids)})"


def _history(plan: StepPlan, pool: PageStore) -> tuple[mx.array, mx.array]:
    """The step's history ``[B, H, T, D]`` after its write: a strided view of
    the pool when a lone row's pages are one run, else a lazy gather (never
    evaluated when `attend` serves the attention call), sliced to exactly the
    visible keys for a lone row."""
    if (first := plan.first_run_page) is not None:
        return pool.run_view(first, *plan.history_slice())
    k_hist, v_hist = pool.gather(plan.gather_rows(pool.shape.n_kv_heads), plan.batch,
                                 plan.length)
    if plan.exact:
        start, stop = plan.history_slice()
        if start or stop != plan.length:
            k_hist, v_hist = k_hist[:, :, start:stop], v_hist[:, :, start:stop]
    return k_hist, v_hist


def _is_step_mask(mask, plan: StepPlan, window: int | None) -> bool:
    """Whether `mask` is what the step's `make_mask` gives for `window`, so
    that the masks `paged_attention` builds from the plan mean the same."""
    if mask is None:
        return plan.exact and plan.num_queries == 1
    if isinstance(mask, str):
        return mask == "causal" and plan.exact and window is None
    return mask is plan.made_mask(window)


class RecurrentLayerView(ArraysCache):
    """One recurrent layer's cache for a batch (mlx-lm's ``ArraysCache`` protocol).

    A subclass of mlx-lm's ``ArraysCache`` (whose constructor it never runs:
    no state of its own) because some models write their state only into
    caches of that type (mamba). Every method a model calls is overridden.

    Lives as long as the batch, like `AttentionView`; each step it forwards to
    the recurrent backend's view of that step (built when the step starts,
    with the slots the sequences hold after any copy-on-write, and per-row
    `lengths` when rows are padded). A step starts at the first `make_mask`
    of a forward (mlx-lm's models build masks before running any layer) or
    at an attention layer's first call; for models that never build masks
    (mamba, rwkv7), at the first state access of a forward (the step then
    covers the pending tokens, or `num_new`). Cost per call: the backend
    view's.
    """

    __slots__ = ("_batch", "_layer", "_seen", "_written", "_trims")

    def __init__(self, batch: BatchState, layer: int) -> None:
        self._batch = batch
        self._layer = layer
        self._seen = 0  # last step this layer took part in
        self._written: set[int] = set()  # arrays this layer wrote in step `_seen`
        self._trims = 0

    def __bool__(self) -> bool:  # mlx-lm tests `if cache` to use the state at all
        return True

    def _view(self, reading: int | None = None) -> Any:
        batch = self._batch
        if batch.steps == 0 or (not batch.masked and reading in self._written
                                and self._seen == batch.steps):
            # A model that never calls make_mask (mamba, rwkv7): the step
            # starts at the first state access of a forward, i.e. the first
            # access at all or a read of an array this layer already wrote.
            batch.plan(batch.steps, 0, None)
        if self._seen != batch.steps:
            self._seen = batch.steps
            self._written.clear()
        return batch.recurrent[self._layer]

    def make_mask(self, N: int, **_: Any) -> mx.array | None:
        """Right-padding mask ``[B, N]`` (None when no row is padded). Starts
        a step when this layer already took part in the current one."""
        batch = self._batch
        batch.masked = True
        if self._seen == batch.steps:
            batch.plan(batch.steps, 0, N)
        return self._view().make_mask(N)

    def __getitem__(self, i: int) -> mx.array | None:
        return self._view(reading=i)[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self._view()[i] = value
        self._written.add(i)
        self._batch.wrote(self)

    def __len__(self) -> int:
        return len(self._view())

    def __iter__(self):
        """The state arrays in order (models unpack ``a, b = cache``)."""
        view = self._view(reading=0)
        return iter([view[i] for i in range(len(view))])

    @property  # type: ignore[override]  # mlx-lm's ArraysCache types it as its first value, None
    def lengths(self) -> mx.array | None:
        return self._view().lengths

    @lengths.setter
    def lengths(self, value: mx.array | None) -> None:
        self._view().lengths = value

    def advance(self, n: int) -> None:
        self._view().advance(n)

    @property  # type: ignore[misc]  # read-only: a view's state lives in the pools
    def state(self) -> list:
        """The batch's state arrays after the last step (empty before any step)."""
        return self._view().state if self._batch.steps else []

    @property
    def batch_size(self) -> int:
        return len(self._batch.seq_ids)

    def empty(self) -> bool:
        """No sequence of the batch has computed a token (ArraysCache: no state)."""
        return not any(self._batch.owner.computed_counts(self._batch.seq_ids))

    def is_trimmable(self) -> bool:
        """Only views a `SpeculativeModel` feeds: recurrent state cannot be
        cut, a trim restores a checkpoint (see `PagedCache.trim_batch`)."""
        return self._batch.owner.can_trim(self._batch)

    def trim(self, n: int) -> int:
        """As `AttentionView.trim` (one trim per batch); 0 when not trimmable."""
        if not self.is_trimmable():
            return 0
        trimmed = self._batch.trim(self._trims, n)
        self._trims += 1
        return trimmed

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's state for the batch's slots (one slot per row)."""
        if not self._batch.steps:
            return 0
        return self._view().nbytes

    def __repr__(self) -> str:
        return f"RecurrentLayerView(layer={self._layer}, seqs={list(self._batch.seq_ids)})"


class TokenContextView:
    """A `LayerKind.TOKENS` position for a batch: the ``ArraysCache(size=1)``
    protocol as longcat_flash_ngram's n-gram embedding uses it.

    ``view[0]`` is ``[B, width]`` int64: each row's last `width` token ids
    before the forward, left-padded with id 0. mlx-lm's n-gram ids take a
    missing neighbour as id 0, so the padding gives the embedding of a
    shorter history exactly, and rows of a ragged batch each get their own
    ids. The ids come from the block manager (`StepSource.token_context`),
    so prefix reuse, forks and truncation need nothing stored; what the
    model writes back (the same ids, cut from its padded input) is dropped.
    Read it before the forward's step starts (as the model does, before its
    mask) or within it: a forward reads, then writes once. Cost per read:
    one slice of each row's token list and a `[B, width]` array.
    """

    __slots__ = ("_batch", "_width", "_writes")

    def __init__(self, batch: BatchState, width: int) -> None:
        self._batch = batch
        self._width = width
        self._writes = 0  # forwards that wrote (the model writes once per forward)

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> mx.array:
        _check_context_index(i)
        batch = self._batch
        if batch.steps > self._writes:  # this forward's step started: its offsets
            offsets = batch.plans[0].offsets
        else:  # before the step: the computed tokens (a finished step's included)
            offsets = batch.owner.computed_counts(batch.seq_ids)
        return batch.owner.token_context(batch.seq_ids, offsets, self._width)

    def __setitem__(self, i: int, value: mx.array) -> None:
        _check_context_index(i)
        self._writes += 1

    @property
    def state(self) -> list[mx.array]:
        return [self[0]]

    def is_trimmable(self) -> bool:
        return True  # nothing stored: the ids follow the sequence's tokens

    def trim(self, n: int) -> int:
        """Dropped with the attention views' trim (one per batch)."""
        return min([n] + self._batch.owner.computed_counts(self._batch.seq_ids))

    def empty(self) -> bool:
        return not any(self._batch.owner.computed_counts(self._batch.seq_ids))

    @property
    def nbytes(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"TokenContextView(width={self._width}, seqs={list(self._batch.seq_ids)})"


def _check_context_index(i: object) -> None:
    if i not in (0, -1) or isinstance(i, bool):
        raise InvalidArgument(f"token context has one array, not index {i!r}")


def nest_views(flat: list, layout: Sequence, composite: Callable[[Any], Any]) -> list:
    """One entry per model layer: the view of a position, an mlx-lm
    ``CacheList`` of the views of a layer's positions (its own class, so
    models index it as they index theirs), or `composite(entry)` for a
    declared composite entry (`layers.CompressedLayer`)."""
    return [flat[e] if isinstance(e, int)
            else CacheList(*(flat[i] for i in e)) if isinstance(e, tuple)
            else composite(e) for e in layout]
