"""How a layer's K/V pages are stored: the page format seam.

A `KVFormat` says how each token's K row and V row are kept in pages: at
the model's dtype (`PagePool`, the default), or affine-quantized along the
head dimension as mlx-lm's ``QuantizedKVCache`` keeps them (`mx.quantize`:
packed unsigned ints, one scale and one bias per `group_size` elements;
`QuantizedPagePool`), keys and values independently (e.g. 8-bit keys and
4-bit values). A row is quantized once, when its token is written; copies
(copy-on-write, the partial last page of a prefix hit), swaps and forks
move the packed bytes, so nothing is ever re-quantized.

Every pool has the `PageStore` protocol, which is all `PagedCache`, the views
and the host swap space use. `KVFormat.page_nbytes` gives a page's bytes for
a layer shape without allocating anything (what a memory budget is divided
by).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from blockmgr.errors import InvalidArgument
from cache.page_pool import PagePool, PoolShape
from cache.quantized_pool import QuantizedPagePool
from cache.step_plan import StepPlan

#: Bits per quantized element (`mx.quantize`'s affine mode; both are exact
#: multiples of a 32-bit word for every allowed group size).
BITS = (4, 8)
#: Elements sharing one scale and bias (mlx-lm's `--kv-group-size` choices).
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64


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
class KVFormat:
    """The storage of K and V rows in pages.

    `key_bits` / `value_bits`: 8 or 4 for affine quantization along the head
    dimension in groups of `group_size` (32, 64 or 128) elements, each group
    with its own scale and bias in the model's dtype (mlx-lm's
    ``QuantizedKVCache`` format); None keeps that side at the model's dtype.
    ``KVFormat()`` is today's full-precision pages; ``KVFormat(8, 4)`` is
    8-bit keys and 4-bit values. A quantized side needs a head size that
    `group_size` divides.

    Cost per token and kv head of a side of head size D at a dtype of s
    bytes: D * s bytes unquantized, D * bits / 8 + 2 * s * D / group_size
    quantized (float16, D = 128, groups of 64: 256 bytes; 136 at 8 bits,
    0.53x; 72 at 4 bits, 0.28x).
    """

    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if bits is not None and (isinstance(bits, bool) or bits not in BITS):
                raise InvalidArgument(f"{name} must be one of {BITS} or None, got {bits!r}")
        size = self.group_size
        if isinstance(size, bool) or size not in GROUP_SIZES:
            raise InvalidArgument(f"kv group size must be one of {GROUP_SIZES}, got {size!r}")

    @classmethod
    def of(cls, kv_format: KVFormat | None = None, kv_bits: int | None = None,
           kv_group_size: int | None = None) -> KVFormat:
        """The format of `PagedCache`'s options: `kv_format` as given, or
        `kv_bits` (keys and values alike, mlx-lm's ``--kv-bits``) with
        `kv_group_size` (default 64), or full precision when neither is
        given. Raises `InvalidArgument` for both, or a group size alone."""
        if kv_format is not None:
            if kv_bits is not None or kv_group_size is not None:
                raise InvalidArgument("give kv_format or kv_bits / kv_group_size, not both")
            if not isinstance(kv_format, KVFormat):
                raise InvalidArgument(f"kv_format must be a KVFormat, got {kv_format!r:.80}")
            return kv_format
        if kv_bits is None:
            if kv_group_size is not None:
                raise InvalidArgument("kv_group_size needs kv_bits")
            return cls()
        size = DEFAULT_GROUP_SIZE if kv_group_size is None else kv_group_size
        return cls(kv_bits, kv_bits, size)

    @property
    def quantized(self) -> bool:
        """Whether keys or values are quantized."""
        return self.key_bits is not None or self.value_bits is not None

    @property
    def name(self) -> str:
        """``"k8v4-g64"``, or ``"model-dtype"`` when nothing is quantized."""
        if not self.quantized:
            return "model-dtype"
        def side(bits: int | None) -> str:
            return "full" if bits is None else str(bits)
        return f"k{side(self.key_bits)}v{side(self.value_bits)}-g{self.group_size}"

    def row_nbytes(self, bits: int | None, head_dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one token's row of one kv head on a side with `bits`."""
        if bits is None:
            return head_dim * dtype.size
        return head_dim * bits // 8 + 2 * (head_dim // self.group_size) * dtype.size

    def page_nbytes(self, block_size: int, n_kv_heads: int, k_head_dim: int,
                    v_head_dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one page of one layer, K and V, every head, scales and
        biases included; exactly what a pool of this format allocates per
        page. Pure arithmetic: nothing is allocated."""
        per_head = (self.row_nbytes(self.key_bits, k_head_dim, dtype)
                    + self.row_nbytes(self.value_bits, v_head_dim, dtype))
        return block_size * n_kv_heads * per_head

    def check_head_dims(self, layer: int, k_head_dim: int, v_head_dim: int) -> None:
        """Raise `InvalidArgument` naming `layer` when a quantized side's head
        size is not a multiple of the group size (`mx.quantize` cannot
        store it). A side of width 0 stores nothing and always passes."""
        for side, bits, dim in (("key", self.key_bits, k_head_dim),
                                ("value", self.value_bits, v_head_dim)):
            if bits is not None and dim % self.group_size:
                raise InvalidArgument(
                    f"layer {layer}: {side} head size {dim} is not a multiple of the kv "
                    f"group size {self.group_size}; quantized pages need one that divides it "
                    f"(try a group size of {_dividing_group_size(dim)})")

    def make_pool(self, shape: PoolShape, layer: int) -> PageStore:
        """A pool of this format for `layer` (`check_head_dims` first).
        Allocates every page (zeros) and evaluates them."""
        if not self.quantized:
            return PagePool(shape)
        self.check_head_dims(layer, shape.k_head_dim, shape.v_head_dim)
        return QuantizedPagePool(shape, self.key_bits, self.value_bits, self.group_size)


def _dividing_group_size(dim: int) -> str:
    fits = [str(g) for g in GROUP_SIZES if dim and dim % g == 0]
    return " or ".join(fits) if fits else "none: keep this side unquantized (bits None)"


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
