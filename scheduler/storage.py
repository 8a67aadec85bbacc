"""`build_storage`: the paged storage of one mlx-lm model.

The one place where `cache` (page pools, views) and `recurrent` (slot pools)
meet: it reads the model's layer kinds, builds the recurrent backend when
the model has recurrent layers, and hands both to a `cache.PagedCache`
(whose grouped store keeps one layer group per attention window, plus the
slots). `PagedCache.for_model` forwards here.
"""

from __future__ import annotations

from typing import Any

from blockmgr.errors import InvalidArgument
from cache.layers import LayerKind, layer_specs
from cache.paged_cache import PagedCache, RecurrentBackend
from recurrent import RecurrentPools


def build_storage(
    model: Any,
    num_blocks: int,
    block_size: int = 16,
    *,
    num_slots: int = 0,
    recurrent: RecurrentBackend | None = None,
    num_host_slots: int = 0,
    **kwargs: Any,
) -> PagedCache:
    """A `PagedCache` laid out for `model` (layer kinds from `model.make_cache()`).

    For a hybrid model give `num_slots` > 0; the recurrent storage defaults
    to `RecurrentPools.for_model(model, num_slots)` (one 1-token probe
    forward, every slot allocated up front). An attention-only model takes
    no slots (`num_slots` > 0 raises `InvalidArgument`). Other keywords go
    to `PagedCache`.
    """
    specs = layer_specs(model)
    has_recurrent = any(s.kind is LayerKind.RECURRENT for s in specs)
    if not has_recurrent and (num_slots or recurrent is not None):
        raise InvalidArgument(
            f"the model has no recurrent layer: give num_slots=0 (got {num_slots!r}) "
            "and no recurrent backend"
        )
    if has_recurrent and recurrent is None and num_slots > 0:
        recurrent = RecurrentPools.for_model(model, num_slots, num_host_slots=num_host_slots)
    return PagedCache(
        specs, num_blocks, block_size, num_slots=num_slots, recurrent=recurrent,
        num_host_slots=num_host_slots, **kwargs,
    )
