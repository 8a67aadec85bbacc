"""How a layer's K/V pages are stored: the page format seam.

A `KVFormat` says how each token's K row and V row are kept in pages: at
the model's dtype (`PagePool`, the default), or affine-quantized along the
head dimension as mlx-lm's ``QuantizedKVCache`` keeps them (`mx.quantize`:
packed unsigned ints, one scale and one bias per `group_size` elements;
`QuantizedPagePool`), keys and values independently (e.g. 8-bit keys and
4-bit values). A row is quantized once, when its token is written; copies
(copy-on-write, the partial last page of a prefix hit), swaps and forks
move the packed bytes, so nothing is ever re-quantized.

`KVFormat` itself is pure arithmetic (`blockmgr.kv_format`: the simulator
prices pages with it too); `make_pool` builds a layer's pool of a format.
Every pool has the `PageStore` protocol, which is all `PagedCache`, the views
and the host swap space use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from blockmgr.kv_format import KVFormat
from cache.page_pool import PagePool, PoolShape
from cache.quantized_pool import QuantizedPagePool
from cache.step_plan import StepPlan


class PageStore(Protocol):
    """One attention layer's K/V pages, head-major rows ``h * num_blocks + p``
    (see `page_pool`). Index arguments are flat head-major row indices.
    Writes are in place while nothing else references the pool arrays, so
    callers hold none of them past a step."""

    shape: PoolShape

    @property
    def nbytes(self) -> int: ...  # every pool array, all pages
    @property
    def page_nbytes(self) -> int: ...  # one page, K and V, all heads, scales included
    def write(self, rows: mx.array, cols: mx.array, keys: mx.array, values: mx.array) -> None: ...
    def stored(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]: ...
    def gather(self, rows: mx.array, batch: int, length: int) -> tuple[mx.array, mx.array]: ...
    def read_tokens(self, rows: mx.array, cols: mx.array) -> tuple[mx.array, mx.array]: ...
    def run_view(self, first_page: int, start: int, stop: int) -> tuple[mx.array, mx.array]: ...
    def read_pages(self, rows: mx.array) -> tuple[mx.array, ...]: ...
    def write_pages(self, rows: mx.array, *parts: mx.array) -> None: ...
    def copy_pages(self, src_rows: mx.array, dst_rows: mx.array) -> None: ...
    def arrays(self) -> tuple[mx.array, ...]: ...
    def attend(self, queries: mx.array, plan: StepPlan, scale: float,
               mask: Any) -> mx.array | None: ...


@dataclass(frozen=True, slots=True)
class KVShape:
    """One attention position's pages: kv heads, key and value head sizes, dtype."""

    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype


def make_pool(kv_format: KVFormat, shape: PoolShape, layer: int) -> PageStore:
    """A pool of `kv_format` for `layer` (`KVFormat.check_head_dims` first).
    Allocates every page (zeros) and evaluates them."""
    if not kv_format.quantized:
        return PagePool(shape)
    kv_format.check_head_dims(layer, shape.k_head_dim, shape.v_head_dim)
    return QuantizedPagePool(shape, kv_format.key_bits, kv_format.value_bits,
                             kv_format.group_size)


def model_kv_shapes(model: Any) -> list[tuple[int, int, int, int, mx.Dtype]]:
    """(model layer, kv heads, key head size, value head size, dtype) of every
    mlx-lm ``KVCache`` / ``RotatingKVCache`` / ``ChunkedKVCache`` of `model`,
    read from one one-token forward on the model's own caches (what
    `KVFormat.page_nbytes` needs per layer, without a page pool).
    Model-specific caches are not read. Cost: one one-token forward."""
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=caches))
    shapes = []
    for layer, cache in enumerate(caches):
        members = cache.caches if type(cache).__name__ == "CacheList" else (cache,)
        for member in members:
            if type(member).__name__ not in ("KVCache", "RotatingKVCache", "ChunkedKVCache"):
                continue
            keys, values = member.keys, member.values
            if keys is not None:
                shapes.append((layer, keys.shape[1], keys.shape[-1], values.shape[-1],
                               keys.dtype))
    return shapes


def check_model(model: Any, kv_format: KVFormat) -> None:
    """Raise `InvalidArgument` naming the first layer of `model` whose head
    sizes `kv_format` cannot quantize (nothing to check for full-precision
    formats). Cost: `model_kv_shapes` (one one-token forward)."""
    if not kv_format.quantized:
        return
    for layer, _, k_head_dim, v_head_dim, _ in model_kv_shapes(model):
        kv_format.check_head_dims(layer, k_head_dim, v_head_dim)
