"""`build_storage`: the paged storage of one mlx-lm model.

The one place where `cache` (page pools, views) and `recurrent` (slot pools)
meet: it reads the model's layer kinds, builds the recurrent backend when
the model has recurrent layers, and hands both to a `cache.PagedCache`
(whose grouped store keeps one layer group per attention window, plus the
slots). `PagedCache.for_model` forwards here.
"""

from __future__ import annotations

from typing import Any

from cache.layers import LayerKind, cache_layout, layer_specs
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
    forward, every slot allocated up front); an attention-only model holds
    no slots whatever `num_slots` says. Layers that keep several caches
    (mlx-lm's ``CacheList``) get one view per cache, nested the same way
    (`cache_layout`). Other keywords go to `PagedCache`.
    """
    specs = layer_specs(model)
    has_recurrent = any(s.kind is LayerKind.RECURRENT for s in specs)
    if has_recurrent and recurrent is None and num_slots > 0:
        # Declared positions (not mlx-lm ArraysCaches) allocate on first write.
        declared = {i: s.num_arrays for i, s in enumerate(specs) if s.num_arrays}
        recurrent = (
            RecurrentPools(num_slots, declared, num_host_slots=num_host_slots) if declared
            else RecurrentPools.for_model(model, num_slots, num_host_slots=num_host_slots))
    return PagedCache(
        specs, num_blocks, block_size, num_slots=num_slots, recurrent=recurrent,
        num_host_slots=num_host_slots, layout=cache_layout(model), **kwargs,
    )
