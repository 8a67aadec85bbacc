"""`PagedCache`: the page pools and block managers of one mlx-lm model.

Layers are grouped by attention window: full-attention layers share one
`BlockManager` (and its page ids), each distinct sliding window gets its own
manager with ``sliding_window`` set, so pages that fall out of the window are
released. Recurrent layers (``ArraysCache``) use slots of the first group's
manager; their storage is a backend (see `RecurrentBackend`) injected into
the constructor. `for_model` builds the default backend
(`recurrent.RecurrentPools`) when the model has recurrent layers and none is
given: the only reference from `cache` to `recurrent`, a lazy import in that
convenience constructor (module imports of `cache` never load `recurrent`).

Every sequence call has the manager's meaning; the memory-op plans it returns
are queued and applied in one batched op per layer before the next forward
(`flush`, called by the views when a step starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Protocol, Sequence

import mlx.core as mx

from blockmgr import Allocation, BlockManager, BlockManagerConfig
from blockmgr.errors import (
    InvalidArgument,
    OutOfBlocks,
    OutOfHostMemory,
    SequenceSwapped,
    UnknownSequence,
)
from blockmgr.ops import CopyBlock, MemoryOp, SwapIn, SwapOut
from cache import attention_hook
from cache.host_pool import HostPagePool
from cache.layers import LayerKind, LayerSpec, LayoutEntry, cache_layout, layer_specs
from cache.page_pool import PagePool, PoolShape, copy_waves, page_rows
from cache.step_plan import StepPlan, plan_step
from cache.views import AttentionView, BatchState, RecurrentLayerView, nest_views


class RecurrentBackend(Protocol):
    """Slot storage for recurrent layers (e.g. `recurrent.RecurrentPools`).

    `apply_plan` gets every slot op (`ZeroSlot`, `CopySlot`, `SwapOutSlot`,
    `SwapInSlot`) in call order; `views(slots, lengths)` gives one
    ArraysCache-like view per recurrent layer for one forward pass.
    """

    @property
    def layers(self) -> tuple[int, ...]: ...
    def apply_plan(self, ops: Iterable[MemoryOp]) -> None: ...
    def views(self, slots: Sequence[int], lengths: Sequence[int] | None = None) -> Mapping[int, Any]: ...


@dataclass(slots=True)
class _Group:
    """Layers sharing one block manager (same window)."""

    window: int | None
    layers: list[int]
    bm: BlockManager
    pools: dict[int, PagePool] = field(default_factory=dict)
    host: dict[int, HostPagePool] = field(default_factory=dict)
    pending: list[CopyBlock | SwapOut | SwapIn] = field(default_factory=list)


@dataclass(slots=True)
class _SeqState:
    computed: int  # tokens whose K/V are written
    known: int  # leading tokens whose ids are real (views may add placeholders)


class PagedCache:
    """Paged KV storage + block managers for one model; see the module doc.

    Tokens given to `allocate`/`append` get pages reserved; the next forward
    through `views` computes them (all pending tokens, or the first N when
    the input has N < pending tokens: chunked prefill). A forward over a
    sequence with nothing pending reserves pages for its N input tokens
    itself (mlx-lm's `generate_step`); their ids are unknown, so they never
    enter the prefix trie.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int = 16,
        *,
        num_slots: int = 0,
        enable_prefix_cache: bool = True,
        watermark: float = 0.0,
        window_blocks: int | None = None,
        recurrent: RecurrentBackend | None = None,
        num_host_blocks: int = 0,
        num_host_slots: int = 0,
        paged_attention: bool = True,
        layout: Sequence[LayoutEntry] | None = None,
    ) -> None:
        """`specs`: one per cache position (`layers.layer_specs`); `layout`
        nests positions into model layers (`layers.cache_layout`; None: one
        position per layer), so `views` gives a ``CacheList`` of views where
        the model keeps several caches in one layer.
        `window_blocks`: pages of each sliding-window group (default num_blocks).
        `num_host_blocks` / `num_host_slots`: swap space per group (host pages) and
        for recurrent state (the backend must have as many host slots).
        `paged_attention`: serve mlx-lm's attention calls from the pool in
        place (`cache.attention_hook`, installed process-wide) instead of
        from a gathered history; False always gathers."""
        specs = list(specs)
        has_recurrent = any(s.kind is LayerKind.RECURRENT for s in specs)
        if has_recurrent and (recurrent is None or num_slots < 1):
            raise InvalidArgument("recurrent layers need num_slots > 0 and a recurrent backend")
        self.specs = specs
        self._layout = None if layout is None else list(layout)
        self.block_size = block_size
        self._paged_attention = paged_attention and attention_hook.install()
        self._recurrent = recurrent if has_recurrent else None
        num_slots = num_slots if has_recurrent else 0  # nothing would hold slot state
        self._slot_ops: list[MemoryOp] = []
        self._seqs: dict[Hashable, _SeqState] = {}
        windows = sorted({s.window for s in specs if s.kind is not LayerKind.RECURRENT},
                         key=lambda w: (w is not None, w or 0))
        if not windows or windows[0] is not None:
            windows.insert(0, None)  # group 0 always exists: it holds tokens and slots
        self._groups: list[_Group] = []
        self._group_of: dict[int, int] = {}
        for gi, w in enumerate(windows):
            cfg = BlockManagerConfig(
                num_blocks=num_blocks if w is None else (window_blocks or num_blocks),
                block_size=block_size,
                num_slots=num_slots if gi == 0 else 0,
                enable_prefix_cache=enable_prefix_cache,
                watermark=watermark,
                sliding_window=w,
                num_host_blocks=num_host_blocks,
                num_host_slots=num_host_slots if gi == 0 else 0,
            )
            layers = [i for i, s in enumerate(specs)
                      if s.kind is not LayerKind.RECURRENT and s.window == w]
            self._groups.append(_Group(w, layers, BlockManager(cfg)))
            for i in layers:
                self._group_of[i] = gi

    @classmethod
    def for_model(
        cls,
        model: Any,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_slots: int = 0,
        recurrent: RecurrentBackend | None = None,
        num_host_slots: int = 0,
        **kwargs,
    ) -> PagedCache:
        """A cache laid out for `model` (layer kinds from `model.make_cache()`).

        For a hybrid model (``ArraysCache`` layers) give `num_slots` > 0; the
        recurrent storage defaults to ``recurrent.RecurrentPools.for_model(
        model, num_slots)`` (one 1-token probe forward, every slot allocated
        up front). Other keywords go to the constructor.
        """
        specs = layer_specs(model)
        if recurrent is None and num_slots > 0 and any(
            s.kind is LayerKind.RECURRENT for s in specs
        ):
            recurrent = default_recurrent_backend(model, num_slots, num_host_slots)
        return cls(specs, num_blocks, block_size, num_slots=num_slots, recurrent=recurrent,
                   num_host_slots=num_host_slots, layout=cache_layout(model), **kwargs)

    # --- inspection ----------------------------------------------------------

    @property
    def block_manager(self) -> BlockManager:
        """The full-attention group's manager (tokens, slots, prefix trie)."""
        return self._groups[0].bm

    @property
    def block_managers(self) -> tuple[BlockManager, ...]:
        return tuple(g.bm for g in self._groups)

    def check_integrity(self) -> None:
        """Run `check_integrity()` on every block manager (raises `IntegrityError`)."""
        for g in self._groups:
            g.bm.check_integrity()

    @property
    def recurrent(self) -> RecurrentBackend | None:
        """The recurrent-state backend (None for attention-only models)."""
        return self._recurrent

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.block_manager.num_tokens(seq_id)

    def num_computed(self, seq_id: Hashable) -> int:
        """Tokens of `seq_id` whose K/V have been written by a forward pass."""
        return self._state(seq_id).computed

    def block_table(self, seq_id: Hashable, layer: int | None = None) -> list[int | None]:
        """Page table of `seq_id` in `layer`'s group (default: full attention)."""
        group = 0 if layer is None else self._group_of[layer]
        return self._groups[group].bm.block_table(seq_id)

    @property
    def nbytes(self) -> int:
        """Bytes of every allocated pool array (all pages, used or not)."""
        return sum(p.nbytes for g in self._groups for p in g.pools.values())

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the pages currently held (by sequences or the prefix trie)."""
        total = 0
        for g in self._groups:
            used = g.bm.config.num_blocks - g.bm.num_free_blocks
            total += used * sum(p.shape.page_nbytes for p in g.pools.values())
        return total

    # --- sequence calls (the manager's meaning; plans applied by flush) -------

    def can_allocate(self, tokens: Iterable[int], namespace: Hashable = None) -> bool:
        tokens = list(tokens)
        return all(g.bm.can_allocate(tokens, namespace) for g in self._groups)

    def allocate(self, seq_id: Hashable, tokens: Iterable[int], namespace: Hashable = None) -> Allocation:
        """Reserve pages for a prompt; reuse the longest prefix every group holds.

        When groups hit different lengths (a sliding-window group keeps no
        prefix once it has released pages), every group is cut to the
        shortest hit. Raises like `BlockManager.allocate`; on failure no
        group keeps the sequence.
        """
        tokens = list(tokens)
        allocs: list[Allocation] = []
        try:
            for g in self._groups:
                allocs.append(g.bm.allocate(seq_id, tokens, namespace))
        except Exception:
            for g, _ in zip(self._groups, allocs):
                g.bm.free(seq_id, num_computed=0)
            raise
        cached = min(a.num_cached_tokens for a in allocs)
        for gi, (g, a) in enumerate(zip(self._groups, allocs)):
            self._queue(gi, a.ops)
            if a.num_cached_tokens > cached:
                self._queue(gi, g.bm.truncate(seq_id, cached))
                self._queue(gi, g.bm.append(seq_id, tokens[cached:]))
        self._seqs[seq_id] = _SeqState(cached, len(tokens))
        first = allocs[0]
        return Allocation(
            seq_id, self.block_manager.block_table(seq_id), first.slot, first.ops,
            cached, first.branch_point,
        )

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        return all(g.bm.can_append(seq_id, num_tokens) for g in self._groups)

    def append(self, seq_id: Hashable, new_tokens: Iterable[int]) -> None:
        """Reserve pages for tokens the next forward computes. Raises
        `OutOfBlocks` (nothing changed) when any group lacks pages."""
        self._append(seq_id, list(new_tokens), known=True)

    def _append(self, seq_id: Hashable, tokens: list, known: bool) -> None:
        state = self._state(seq_id)
        if not tokens:
            return
        if not self.can_append(seq_id, len(tokens)):
            raise OutOfBlocks(f"no pages for {len(tokens)} more tokens of {seq_id!r}")
        num_before = self.num_tokens(seq_id)
        for gi, g in enumerate(self._groups):
            self._queue(gi, g.bm.append(seq_id, tokens))
        if known and state.known == num_before:
            state.known += len(tokens)

    def fork(self, seq_id: Hashable, new_seq_id: Hashable) -> None:
        """`new_seq_id` shares `seq_id`'s pages (and slot) copy-on-write.
        Fork once every reserved token of `seq_id` is computed."""
        state = self._state(seq_id)
        done: list[_Group] = []
        try:
            for gi, g in enumerate(self._groups):
                self._queue(gi, g.bm.fork(seq_id, new_seq_id))
                done.append(g)
        except Exception:
            for g in done:
                g.bm.free(new_seq_id, num_computed=0)
            raise
        self._seqs[new_seq_id] = _SeqState(state.computed, state.known)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Roll `seq_id` back to its first `num_tokens` tokens (speculative
        decoding: keep the accepted prefix). Raises like the manager's
        truncate (e.g. rolling back into released window pages)."""
        state = self._state(seq_id)
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= self.num_tokens(seq_id):
            raise InvalidArgument(f"cannot truncate {seq_id!r} to {num_tokens!r} tokens")
        # Checks first so that no group is cut when another would refuse.
        for g in self._groups:
            if not g.bm.can_truncate(seq_id, num_tokens):
                # Refused: the manager's truncate raises its precise error
                # (InvalidArgument, NoSnapshot, OutOfSlots) and changes nothing.
                g.bm.truncate(seq_id, num_tokens)
        for gi, g in enumerate(self._groups):
            self._queue(gi, g.bm.truncate(seq_id, num_tokens))
        state.computed = min(state.computed, num_tokens)
        state.known = min(state.known, num_tokens)

    def cache_prefix(self, seq_id: Hashable, num_tokens: int | None = None) -> None:
        """Snapshot computed tokens (None: all computed ones) into the trie.

        For a hybrid model the snapshot is the sequence's recurrent state, so
        only the computed end can be snapshot (a prefill chunk's end: call it
        between chunks); an earlier `num_tokens` raises `InvalidArgument`.
        """
        state = self._state(seq_id)
        if self._recurrent is not None and num_tokens not in (None, state.computed):
            raise InvalidArgument(
                f"{seq_id!r}: recurrent state exists only after its {state.computed} "
                f"computed tokens, not after {num_tokens!r}"
            )
        n = self._trie_count(seq_id, num_tokens)
        if n == 0:
            return
        for gi, g in enumerate(self._groups):
            self._queue(gi, g.bm.cache_prefix(seq_id, n))

    def free(self, seq_id: Hashable, num_computed: int | None = None) -> None:
        """End `seq_id`; its computed tokens (None: all) enter the trie."""
        n = self._trie_count(seq_id, num_computed)
        for gi, g in enumerate(self._groups):
            self._queue(gi, g.bm.free(seq_id, n))
        del self._seqs[seq_id]

    def _trie_count(self, seq_id: Hashable, num_tokens: int | None) -> int:
        """Tokens the trie may take: computed, with known ids, and for a hybrid
        model exactly the computed ones (the slot holds the state after the
        last computed token and cannot be cut), else none."""
        state = self._state(seq_id)
        limit = min(state.computed, state.known)
        if num_tokens is None:
            n = limit
        elif not isinstance(num_tokens, int) or num_tokens < 0 or num_tokens > state.computed:
            raise InvalidArgument(f"{seq_id!r} has {state.computed} computed tokens, not {num_tokens!r}")
        else:
            n = min(num_tokens, limit)
        if self._recurrent is not None and n != state.computed:
            return 0
        return n

    # --- swap (preemption to host memory) ------------------------------------------

    def is_swapped(self, seq_id: Hashable) -> bool:
        self._state(seq_id)
        return self.block_manager.is_swapped(seq_id)

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Is there host memory (pages in every group, a host slot) to swap it out?"""
        self._state(seq_id)
        return all(g.bm.can_swap_out(seq_id) for g in self._groups)

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Are there device pages (and a slot) to bring it back? Changes nothing."""
        self._state(seq_id)
        return all(g.bm.can_swap_in(seq_id) for g in self._groups)

    def swap_out(self, seq_id: Hashable) -> None:
        """Move `seq_id`'s pages (and recurrent slot) to host memory, releasing
        the device copies; the sequence stays live but frozen until `swap_in`.

        Raises `OutOfHostMemory` (nothing changed) when any group lacks host
        space, `SequenceSwapped` when already out. The copies are applied by
        the next `flush` (in call order, before the device pages are reused);
        call `flush()` to free the memory now.
        """
        self._state(seq_id)
        for g in self._groups:
            if not g.bm.can_swap_out(seq_id):
                raise OutOfHostMemory(f"not enough host pages or slots to swap {seq_id!r} out")
        for gi, g in enumerate(self._groups):
            self._queue(gi, g.bm.swap_out(seq_id))

    def swap_in(self, seq_id: Hashable) -> None:
        """Bring a swapped-out `seq_id` back to fresh device pages (and a slot).

        Raises like the manager's `swap_in` (`OutOfBlocks` / `OutOfSlots`,
        nothing changed); copies are applied by the next `flush`.
        """
        self._state(seq_id)
        for g in self._groups:
            if not g.bm.can_swap_in(seq_id):
                g.bm.swap_in(seq_id)  # raises the manager's precise error, changes nothing
        for gi, g in enumerate(self._groups):
            self._queue(gi, g.bm.swap_in(seq_id))

    # --- views -----------------------------------------------------------------

    def views(self, seq_ids: Sequence[Hashable], num_new: Sequence[int] | None = None) -> list:
        """One mlx-lm cache object per layer for the batch `seq_ids` (row order).

        Inputs are right-padded: row b's new tokens first. `num_new[b]`
        (first step only) says how many of the N input tokens of row b are
        real; default: min(pending tokens, N). Views live as long as the
        batch does (e.g. a whole `generate_step` run).
        """
        seq_ids = list(seq_ids)
        if not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument(f"need distinct sequence ids, got {seq_ids!r}")
        for s in seq_ids:
            self._state(s)
            if self.block_manager.is_swapped(s):
                raise SequenceSwapped(f"sequence {s!r} is swapped out; swap it in first")
        if num_new is not None and len(num_new) != len(seq_ids):
            raise InvalidArgument("num_new needs one entry per sequence")
        batch = BatchState(self, seq_ids, None if num_new is None else list(num_new))
        out: list = [None] * len(self.specs)
        for i, spec in enumerate(self.specs):
            if spec.kind is LayerKind.RECURRENT:
                out[i] = RecurrentLayerView(batch, i)
            else:
                out[i] = AttentionView(batch, self._group_of[i], i, self._pool_for, spec.window)
        return out if self._layout is None else nest_views(out, self._layout)

    def flush(self) -> None:
        """Apply every queued memory op: one gather + one scatter per pool array
        per batch of copies (usually one), one evaluation for all layers."""
        for g in self._groups:
            if not g.pending or not g.pools:
                g.pending.clear()
                continue
            for kind, ops in _runs_by_kind(g.pending):
                if kind is CopyBlock:
                    _copy_blocks(g, ops)
                else:
                    self._swap_pages(g, kind, ops)
            g.pending.clear()
        if self._slot_ops:
            ops, self._slot_ops = self._slot_ops, []
            self._recurrent.apply_plan(ops)

    def eval_state(self) -> None:
        """Evaluate the K/V (and recurrent state) writes of the last forward
        without its outputs: for prefill chunks whose logits nobody samples,
        this skips the final layers' tail and the LM head."""
        mx.eval([pool.arrays() for g in self._groups for pool in g.pools.values()])
        if self._recurrent is not None:
            self._recurrent.flush()

    # --- StepSource (used by the views) ----------------------------------------

    def _begin_step(self, seq_ids: Sequence, n: int | None, num_new) -> dict[int, StepPlan]:
        states = [self._state(s) for s in seq_ids]
        pending = [self.num_tokens(s) - st.computed for s, st in zip(seq_ids, states)]
        if n is None:  # the model never said its input width: the pending tokens
            n = max(num_new or pending)
            if n == 0:
                raise InvalidArgument(
                    f"{list(seq_ids)!r}: this model never tells its cache how many tokens "
                    "it feeds; reserve them first (allocate / append)")
        if num_new is not None:
            if any(not 0 <= k <= min(p, n) for k, p in zip(num_new, pending)):
                raise InvalidArgument(f"num_new {num_new} exceeds pending {pending} or N={n}")
            new = list(num_new)
        elif not any(pending):
            # Nothing reserved (generate_step feeds tokens itself): reserve N each.
            for s in seq_ids:
                self._append(s, [None] * n, known=False)
            new = [n] * len(seq_ids)
        else:
            new = [min(p, n) for p in pending]
        self.flush()
        offsets = [st.computed for st in states]
        plans = {}
        for gi, g in enumerate(self._groups):
            tables = [g.bm.block_table(s) for s in seq_ids]
            plans[gi] = plan_step(tables, offsets, new, n, self.block_size,
                                  g.bm.config.num_blocks, g.window)
        for st, k in zip(states, new):
            st.computed += k
        return plans

    def _recurrent_views(self, seq_ids: Sequence, plan: StepPlan) -> Mapping[int, Any]:
        """The backend's views for a started step: each row's slot (after the
        step's appends), padded rows' real token counts."""
        if self._recurrent is None:
            return {}
        slots = [self.block_manager.slot(s) for s in seq_ids]
        n = plan.num_queries
        lengths = list(plan.n_new) if any(k != n for k in plan.n_new) else None
        return self._recurrent.views(slots, lengths)

    def _computed(self, seq_ids: Sequence) -> list[int]:
        return [self._state(s).computed for s in seq_ids]

    def _trim_batch(self, seq_ids: Sequence, n: int) -> int:
        n = min([n] + self._computed(seq_ids))
        for s in seq_ids:
            self.truncate(s, self._state(s).computed - n)
        return n

    def _held_bytes(self, group: int, layer: int, seq_ids: Sequence) -> int:
        g = self._groups[group]
        pool = g.pools.get(layer)
        if pool is None:
            return 0
        pages = {p for s in seq_ids for p in g.bm.block_table(s) if p is not None}
        return len(pages) * pool.shape.page_nbytes

    def _pool_for(self, layer: int, keys: mx.array | None, values: mx.array | None) -> PagePool | None:
        """The layer's pool, created on its first write from the K/V shapes."""
        g = self._groups[self._group_of[layer]]
        pool = g.pools.get(layer)
        if pool is None and keys is not None:
            shape = PoolShape(g.bm.config.num_blocks, self.block_size, keys.shape[1],
                              keys.shape[-1], values.shape[-1], keys.dtype)
            pool = g.pools[layer] = PagePool(shape)
        return pool

    # --- internals -------------------------------------------------------------

    def _swap_pages(self, g: _Group, kind: type, ops: list) -> None:
        """Apply a run of SwapOut (device -> host) or SwapIn (host -> device)
        ops to every layer of the group: one batched move per pool array."""
        src, dst = [op.src for op in ops], [op.dst for op in ops]
        for layer, pool in g.pools.items():
            host = g.host.get(layer)
            if host is None:
                host = g.host[layer] = HostPagePool(g.bm.config.num_host_blocks)
            if kind is SwapOut:
                host.swap_out(pool, src, dst)
            else:
                host.swap_in(pool, src, dst)

    def _queue(self, group: int, ops: Iterable[MemoryOp]) -> None:
        for op in ops:
            if isinstance(op, (CopyBlock, SwapOut, SwapIn)):
                self._groups[group].pending.append(op)
            else:
                self._slot_ops.append(op)

    def _state(self, seq_id: Hashable) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"no live sequence {seq_id!r}") from None



def default_recurrent_backend(model: Any, num_slots: int, num_host_slots: int = 0) -> RecurrentBackend:
    """``recurrent.RecurrentPools`` for `model`'s recurrent layers (lazy import:
    `cache` depends on `recurrent` only when a hybrid model asks for it)."""
    from recurrent import RecurrentPools

    return RecurrentPools.for_model(model, num_slots, num_host_slots=num_host_slots)


def _runs_by_kind(ops: Sequence[MemoryOp]) -> list[tuple[type, list]]:
    """Maximal runs of consecutive ops of one type, in call order (each run
    is applied as one batch; runs keep the plan's sequential meaning)."""
    runs: list[tuple[type, list]] = []
    for op in ops:
        if runs and runs[-1][0] is type(op):
            runs[-1][1].append(op)
        else:
            runs.append((type(op), [op]))
    return runs


def _copy_blocks(g: _Group, ops: list[CopyBlock]) -> None:
    for src, dst in copy_waves(ops):
        # Read every layer's sources, evaluate once, then write (see
        # PagePool.read_pages for why the read is evaluated first).
        reads = {layer: pool.read_pages(page_rows(pool, src)) for layer, pool in g.pools.items()}
        mx.eval(list(reads.values()))
        for layer, (k, v) in reads.items():
            pool = g.pools[layer]
            pool.write_pages(page_rows(pool, dst), k, v)
