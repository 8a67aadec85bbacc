"""The views of one batch, laid out as the model's cache positions and layers.

`batch_views` gives the object `PagedCache.views` / `step` hands the model:
per cache position (`layers.layer_specs`, flat) an `AttentionView` over its
layer group's pool, a `RecurrentLayerView` or a `TokenContextView`; nested
into the model's layers by the layout (`layers.cache_layout`: an mlx-lm
``CacheList`` where a layer keeps several caches, a `CompressedLayerView`
for a declared composite). It also tells the batch which views write in
every forward (`BatchState.expect_writes`): the step counts only once all
of them wrote. The pools come through `ViewPools` (`GroupStorage`).

Cost: O(cache positions) objects per call; nothing is allocated or read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from blockmgr.errors import IntegrityError
from cache.compressed_view import CompressedLayerView
from cache.layers import CompressedLayer, LayerKind, LayerSpec, LayoutEntry
from cache.page_format import PageStore
from cache.page_pool import PagePool
from cache.views import (
    AttentionView,
    BatchState,
    RecurrentLayerView,
    TokenContextView,
    nest_views,
)


class ViewPools(Protocol):
    """What the views need of the page storage (`group_storage.GroupStorage`)."""

    def group_of(self, layer: int) -> int: ...
    def pool_for(self, layer: int, keys: mx.array | None,
                 values: mx.array | None) -> PageStore | None: ...
    def plain_pool_for(self, layer: int, keys: mx.array | None,
                       values: mx.array | None) -> PagePool | None: ...


def batch_views(batch: BatchState, specs: Sequence[LayerSpec],
                layout: Sequence[LayoutEntry] | None, pools: ViewPools) -> list[Any]:
    """One view per cache position of `specs` for `batch`, nested by
    `layout` (None: one position per layer); the views that write every
    forward declared to the batch."""
    out: list[Any] = [None] * len(specs)
    for i, spec in enumerate(specs):
        if spec.kind is LayerKind.RECURRENT:
            out[i] = RecurrentLayerView(batch, i)
        elif spec.kind is LayerKind.TOKENS:
            out[i] = TokenContextView(batch, _token_width(spec))
        else:
            out[i] = AttentionView(batch, pools.group_of(i), i, pools.pool_for, spec.window)
    if layout is None:
        batch.expect_writes(_written_views(specs, out, range(len(out))))
        return out
    composites: list[CompressedLayerView] = []

    def composite(entry: CompressedLayer) -> CompressedLayerView:
        composites.append(_compressed_view(batch, entry, out, pools))
        return composites[-1]

    nested = nest_views(out, layout, composite)
    handed = [i for e in layout if not isinstance(e, CompressedLayer)
              for i in ((e,) if isinstance(e, int) else e)]
    batch.expect_writes(_written_views(specs, out, handed) + composites)
    return nested


def _written_views(specs: Sequence[LayerSpec], views: list[Any],
                   positions: Iterable[int]) -> list[Any]:
    """The views at `positions` that every forward writes: attention and
    recurrent ones (a token context stores nothing; a declared unused
    cache is never written)."""
    return [views[i] for i in positions
            if specs[i].written and specs[i].kind is not LayerKind.TOKENS]


def _compressed_view(batch: BatchState, layer: CompressedLayer, flat: list[Any],
                     pools: ViewPools) -> CompressedLayerView:
    window, *rest = layer.positions
    entries = (pools.group_of(rest[0]), rest[0]) if layer.compresses else None
    return CompressedLayerView(batch, layer, (flat[window], pools.group_of(window)), entries,
                               pools.plain_pool_for)


def _token_width(spec: LayerSpec) -> int:
    """The tokens a token-context layer keeps (its window, always set)."""
    if spec.window is None:
        raise IntegrityError(f"token-context layer {spec!r:.80} has no window")
    return spec.window
