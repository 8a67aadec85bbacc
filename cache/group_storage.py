"""`GroupStorage`: the page pools of a model's layer groups, and the plan queue.

A model's attention positions fall into layer groups, one per distinct
attention window (`layer_windows`); group g's pages are numbered by the
store's page group g. Per group, `GroupStorage` keeps each position's page
pool (created from the first K/V its layer writes, or up front from known
shapes: `allocate`), the host pages swapped-out pages go to, and the memory
ops the store's plans queued for it; slot ops are queued beside them.

`apply` runs the queue in call order, each group's ops as maximal runs of
one op type (one gather/scatter per pool array per run): copy-on-write
copies (`copy_waves`), swaps to and from host pages (`HostPagePool`), and
tier moves handed to `TierMoves` (the prefix cache's `CacheTiers`); slot
ops go, in runs, to the tiers (`MoveSlot`) or to the slot storage
(`SlotPlans`, the recurrent backend). An id freed by one call and handed
out by a later one is therefore written only after every earlier op read
it (design/ARCHITECTURE.md, "Decide, then apply").

Costs: `queue` O(ops); `apply` O(ops) Python work plus one evaluation per
wave of copies and per swap run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from blockmgr.errors import IntegrityError, InvalidArgument
from blockmgr.ops import CopyBlock, MemoryOp, MovePage, MoveSlot, SwapIn, SwapOut
from cache.host_pool import HostPagePool
from cache.layers import LayerSpec
from cache.page_format import KVFormat, KVShape, PageStore, make_pool
from cache.page_pool import PagePool, PoolShape, copy_waves, page_rows

PageOp = CopyBlock | SwapOut | SwapIn | MovePage
"""The ops that move a group's pages (every other op moves a slot)."""


def layer_windows(specs: Sequence[LayerSpec]) -> tuple[int | None, ...]:
    """The layer groups of a model: full attention first, then each distinct
    sliding window. Group 0 also keeps the slots; a model without full
    attention layers starts with its first window, one without attention
    layers at all keeps a (page-less in practice) full group."""
    attention = {s.window for s in specs if s.kind.paged}
    windows = sorted(w for w in attention if w is not None)
    if None in attention or not windows:
        return (None, *windows)
    return tuple(windows)


class TierMoves(Protocol):
    """Where `apply` hands tier moves (`cache_tiers.CacheTiers`)."""

    def move_pages(self, group: int, ops: Sequence[MovePage]) -> None: ...
    def move_slots(self, ops: Sequence[MoveSlot]) -> None: ...


class SlotPlans(Protocol):
    """Where `apply` hands the other slot ops (`recurrent_backend.RecurrentBackend`)."""

    def apply_plan(self, ops: Iterable[MemoryOp]) -> None: ...


@dataclass(slots=True)
class PageGroup:
    """Storage of one layer group: its layers' page pools and host copies,
    and the page ops queued for it."""

    window: int | None
    layers: list[int]
    num_pages: int
    pools: dict[int, PageStore] = field(default_factory=dict)
    host: dict[int, HostPagePool] = field(default_factory=dict)
    pending: list[PageOp] = field(default_factory=list)


class GroupStorage:
    """Page pools per layer group and the queue of memory ops; see the module doc."""

    __slots__ = ("groups", "block_size", "kv_format", "num_host_blocks", "_group_of",
                 "_slot_ops")

    def __init__(self, specs: Sequence[LayerSpec], num_pages: Sequence[int], block_size: int,
                 kv_format: KVFormat, num_host_blocks: int) -> None:
        """`num_pages[g]`: the pages of group g (the store's), groups in
        `layer_windows(specs)` order; `num_host_blocks`: host pages per
        group for swaps. Allocates nothing."""
        windows = layer_windows(specs)
        self.groups = [
            PageGroup(w, [i for i, s in enumerate(specs) if s.kind.paged and s.window == w], n)
            for w, n in zip(windows, num_pages)
        ]
        self.block_size = block_size
        self.kv_format = kv_format
        self.num_host_blocks = num_host_blocks
        self._group_of = {i: g for g, grp in enumerate(self.groups) for i in grp.layers}
        self._slot_ops: list[MemoryOp] = []

    # --- pools ------------------------------------------------------------------

    def group_of(self, layer: int) -> int:
        """The layer group of attention position `layer`; `InvalidArgument`
        for a position that keeps no pages. O(1)."""
        try:
            return self._group_of[layer]
        except (KeyError, TypeError):
            raise InvalidArgument(f"cache position {layer!r} keeps no pages") from None

    def pool_for(self, layer: int, keys: mx.array | None,
                 values: mx.array | None) -> PageStore | None:
        """The layer's pool, created on its first write from the K/V shapes
        in `kv_format` (`InvalidArgument` naming the layer when the format
        cannot store its head sizes; nothing is created). None before the
        first write when no K/V are given."""
        g = self.groups[self._group_of[layer]]
        pool = g.pools.get(layer)
        if pool is None and keys is not None and values is not None:
            shape = PoolShape(g.num_pages, self.block_size, keys.shape[1],
                              keys.shape[-1], values.shape[-1], keys.dtype)
            pool = g.pools[layer] = make_pool(self.kv_format, shape, layer)
        return pool

    def plain_pool_for(self, layer: int, keys: mx.array | None,
                       values: mx.array | None) -> PagePool | None:
        """`pool_for` of a layer stored at the model's dtype (compressed
        layers read and write token rows, which only a plain pool has)."""
        pool = self.pool_for(layer, keys, values)
        if pool is not None and not isinstance(pool, PagePool):
            raise InvalidArgument(f"layer {layer}: compressed layers need the model's dtype pages")
        return pool

    def allocate(self, kv_shapes: Mapping[int, KVShape]) -> None:
        """Allocate every attention position's pool now, from its shape
        (the cache tiers load into them before any forward). Raises
        `InvalidArgument` for a position `kv_shapes` does not name."""
        for layer, g in self._group_of.items():
            shape = kv_shapes.get(layer)
            if shape is None:
                raise InvalidArgument(f"kv_shapes has no shape for attention position {layer}")
            group = self.groups[g]
            group.pools[layer] = make_pool(self.kv_format, PoolShape(
                group.num_pages, self.block_size, shape.n_kv_heads, shape.k_head_dim,
                shape.v_head_dim, shape.dtype), layer)

    @property
    def ready(self) -> bool:
        """Is every attention position's pool allocated?"""
        return not any(g.layers and not g.pools for g in self.groups)

    def pools(self) -> dict[int, PageStore]:
        """Every allocated pool, by attention position."""
        return {layer: pool for g in self.groups for layer, pool in g.pools.items()}

    def pools_by_group(self) -> list[dict[int, PageStore]]:
        """Each group's allocated pools, by attention position (live dicts)."""
        return [g.pools for g in self.groups]

    @property
    def nbytes(self) -> int:
        """Bytes of every allocated pool array (all pages, used or not)."""
        return sum(p.nbytes for g in self.groups for p in g.pools.values())

    def used_nbytes(self, num_used_pages: Sequence[int]) -> int:
        """Bytes of `num_used_pages[g]` pages of each group, every layer's."""
        return sum(used * sum(p.page_nbytes for p in g.pools.values())
                   for g, used in zip(self.groups, num_used_pages))

    def page_nbytes(self, group: int, layer: int) -> int:
        """One page's bytes in `layer`'s pool (0 before its first write)."""
        pool = self.groups[group].pools.get(layer)
        return 0 if pool is None else pool.page_nbytes

    def eval(self) -> None:
        """Evaluate every pool's pending writes."""
        mx.eval([pool.arrays() for g in self.groups for pool in g.pools.values()])

    # --- the plan queue ---------------------------------------------------------

    def queue(self, ops: Iterable[MemoryOp]) -> None:
        """Queue a plan's ops for the next `apply`, in call order. O(ops)."""
        for op in ops:
            if isinstance(op, (CopyBlock, SwapOut, SwapIn, MovePage)):
                self.groups[op.group].pending.append(op)
            else:
                self._slot_ops.append(op)

    def apply(self, tiers: TierMoves | None, slots: SlotPlans | None) -> None:
        """Apply every queued op (see the module doc); the queue is empty after.

        Page ops of a group whose pools do not exist yet are dropped: no
        forward has written any page of that group, so there is nothing to
        copy. A swap out dropped so leaves its host pages unwritten; they
        swap back in as zeros, what a fresh pool holds (`HostPagePool`).
        `tiers` None: a tier move is an `IntegrityError` (the store made
        one without tiers)."""
        for gi, g in enumerate(self.groups):
            if not g.pending or not g.pools:
                g.pending.clear()
                continue
            for kind, ops in _runs_by_kind(g.pending):
                if kind is CopyBlock:
                    _copy_blocks(g, ops)
                elif kind is MovePage:
                    _tier_moves(tiers).move_pages(gi, ops)
                else:
                    self._swap_pages(g, kind, ops)
            g.pending.clear()
        if self._slot_ops:
            ops, self._slot_ops = self._slot_ops, []
            for kind, run in _runs_by_kind(ops, MoveSlot):
                if kind is MoveSlot:
                    _tier_moves(tiers).move_slots(run)
                elif slots is not None:
                    slots.apply_plan(run)

    def _swap_pages(self, g: PageGroup, kind: type, ops: list) -> None:
        """Apply a run of SwapOut (device -> host) or SwapIn (host -> device)
        ops to every layer of the group: one batched move per pool array."""
        src, dst = [op.src for op in ops], [op.dst for op in ops]
        for layer, pool in g.pools.items():
            host = g.host.get(layer)
            if host is None:
                host = g.host[layer] = HostPagePool(self.num_host_blocks)
            if kind is SwapOut:
                host.swap_out(pool, src, dst)
            else:
                host.swap_in(pool, src, dst)


def _tier_moves(tiers: TierMoves | None) -> TierMoves:
    """The tiers, where a path runs only with them (a tier move)."""
    if tiers is None:
        raise IntegrityError("a cache without tiers was handed a tier move")
    return tiers


def _runs_by_kind(
    ops: Sequence[MemoryOp], apart: type | None = None
) -> list[tuple[type, list]]:
    """Maximal runs of consecutive ops of one type, in call order (each run
    is applied as one batch; runs keep the plan's sequential meaning).
    With `apart`: runs of that type and runs of everything else."""
    runs: list[tuple[type, list]] = []
    for op in ops:
        kind = type(op) if apart is None or type(op) is apart else object
        if runs and runs[-1][0] is kind:
            runs[-1][1].append(op)
        else:
            runs.append((kind, [op]))
    return runs


def _copy_blocks(g: PageGroup, ops: list[CopyBlock]) -> None:
    for src, dst in copy_waves(ops):
        # Read every layer's sources, evaluate once, then write (see
        # PagePool.read_pages for why the read is evaluated first). The
        # parts are stored bytes: quantized rows are copied, not re-quantized.
        reads = {layer: pool.read_pages(page_rows(pool, src)) for layer, pool in g.pools.items()}
        mx.eval(list(reads.values()))
        for layer, parts in reads.items():
            pool = g.pools[layer]
            pool.write_pages(page_rows(pool, dst), *parts)
