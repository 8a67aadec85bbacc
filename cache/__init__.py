"""MLX storage for paged KV caches: page pools and mlx-lm-compatible views.

* `page_pool`: `PagePool`, one attention layer's K/V pages (head-major).
* `page_format`: `KVFormat`, how pages store K/V (model dtype or affine-
  quantized, keys and values apart), and `PageStore`, the pools' protocol.
* `quantized_pool`: `QuantizedPagePool`, pages of quantized K/V rows;
  `quantized_attention`: attention on them with quantized matmuls.
* `layers`: which cache kind each model layer needs.
* `step_plan`: per-step scatter/gather indices and masks for a page group.
* `views`: `AttentionView` / `RecurrentLayerView`, mlx-lm's cache protocol
  over the pools (recurrent layers forward to an injected backend).
* `paged_attention`: attention read from the pools in place (`gather_mm`).
* `attention_hook`: routes mlx-lm's attention call to the views (installed
  by `PagedCache` unless ``paged_attention=False``).
* `host_pool`: `HostPagePool`, host copies of pages (swap space).
* `buckets`: `length_buckets`, decode batches split by length.
* `paged_cache`: `PagedCache`, the pools and grouped store of one model
  (the facade over the four below).
* `group_storage`: `GroupStorage`, each layer group's pools and the plan queue.
* `computed_counts`: `ComputedCounts`, what moves each sequence's computed count (the store's).
* `batch_views`: the views of one batch, laid out as the model's layers.
* `step_source`: `CacheSteps`, what a batch's views call (`StepSource`).
* `cache_tiers`, `tier_setup`, `disk_tier`, `page_records`: the prefix
  cache's host and disk tiers; `prefix_file`: one cached prefix as a file.
* `recurrent_backend`: `RecurrentBackend`, what `PagedCache` needs of the
  slot storage of recurrent layers.
* `model_storage`: what `PagedCache.for_model` reads of a model (its cache
  positions, their nesting, its recurrent backend).

Imports go one way: `cache` -> `recurrent` -> `blockmgr`. `recurrent`
never imports `cache`; `cache.model_storage` is where they meet.
"""

from cache.buckets import length_buckets
from cache.host_pool import HostPagePool
from cache.layers import LayerKind, LayerSpec, layer_specs
from cache.page_format import KVFormat, PageStore
from cache.page_pool import PagePool, PoolShape, copy_waves
from cache.paged_cache import PagedCache, RecurrentBackend
from cache.quantized_pool import QuantizedPagePool
from cache.views import AttentionView, RecurrentLayerView

__all__ = [
    "AttentionView",
    "HostPagePool",
    "KVFormat",
    "LayerKind",
    "LayerSpec",
    "PagePool",
    "PageStore",
    "PagedCache",
    "PoolShape",
    "QuantizedPagePool",
    "RecurrentBackend",
    "RecurrentLayerView",
    "copy_waves",
    "length_buckets",
    "layer_specs",
]
