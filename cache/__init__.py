"""MLX storage for paged KV caches: page pools and mlx-lm-compatible views.

* `page_pool`: `PagePool`, one attention layer's K/V pages (head-major).
* `layers`: which cache kind each model layer needs.
* `step_plan`: per-step scatter/gather indices and masks for a page group.
* `views`: `AttentionView`, mlx-lm's cache protocol over the pools.
* `paged_cache`: `PagedCache`, pools + block managers for one model.

Imports go one way: `cache` -> `blockmgr`.
"""

from cache.layers import LayerKind, LayerSpec, layer_specs
from cache.page_pool import PagePool, PoolShape, copy_waves
from cache.paged_cache import PagedCache, RecurrentBackend
from cache.views import AttentionView

__all__ = [
    "AttentionView",
    "LayerKind",
    "LayerSpec",
    "PagePool",
    "PagedCache",
    "PoolShape",
    "RecurrentBackend",
    "copy_waves",
    "layer_specs",
]
