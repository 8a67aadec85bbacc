"""What a model's paged storage is made of: its cache positions, their
nesting into layers, and the recurrent backend (when it has recurrent layers).

The one place where `cache` reads a model and meets `recurrent`:
`PagedCache.for_model` builds its storage from `model_storage_parts`.
`recurrent` never imports `cache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache.layers import LayerKind, LayerSpec, LayoutEntry, cache_layout, layer_specs
from cache.recurrent_backend import RecurrentBackend
from recurrent import RecurrentPools


@dataclass(frozen=True, slots=True)
class ModelStorageParts:
    """specs: one per cache position (`layers.layer_specs`); layout: how
    positions nest into model layers (`layers.cache_layout`); recurrent: the
    slot storage of the recurrent layers (None: none, or none asked for)."""

    specs: list[LayerSpec]
    layout: list[LayoutEntry] | None
    recurrent: RecurrentBackend | None


def model_storage_parts(
    model: Any,
    *,
    num_slots: int = 0,
    recurrent: RecurrentBackend | None = None,
    num_host_slots: int = 0,
) -> ModelStorageParts:
    """The layer kinds of `model` (from `model.make_cache()`) and, for a
    hybrid model given `num_slots` > 0 and no backend, its recurrent storage:
    `RecurrentPools.for_model(model, num_slots)` (one 1-token probe forward,
    every slot allocated up front), or declared pools for positions mlx-lm
    does not keep as ``ArraysCache``. O(layers) plus the probe."""
    specs = layer_specs(model)
    has_recurrent = any(s.kind is LayerKind.RECURRENT for s in specs)
    if has_recurrent and recurrent is None and num_slots > 0:
        # Declared positions (not mlx-lm ArraysCaches) allocate on first write.
        declared = {i: s.num_arrays for i, s in enumerate(specs) if s.num_arrays}
        recurrent = (
            RecurrentPools(num_slots, declared, num_host_slots=num_host_slots) if declared
            else RecurrentPools.for_model(model, num_slots, num_host_slots=num_host_slots))
    layout = cache_layout(model)
    return ModelStorageParts(specs, None if layout is None else list(layout), recurrent)
