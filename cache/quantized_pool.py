"""The K/V pages of one attention layer, affine-quantized (`page_format`).

Same head-major layout as `PagePool` (row ``h * num_blocks + p`` is head h
of page p), but each quantized side (K or V) is three arrays, as mlx-lm's
``QuantizedKVCache`` keeps them: packed values ``[rows, block_size,
D * bits / 32]`` uint32, and one scale and one bias per `group_size`
elements, ``[rows, block_size, D / group_size]`` in the model's dtype. A
token's row is quantized (`mx.quantize` along the head dimension) when it
is written and never again: quantization groups lie inside one row, so
writing a token, copying a page or cutting a sequence never touches
another token's bytes, and page copies and swaps move packed bytes.

Reads hand out dequantized K/V (the history the model attends over with
any kernel), or, through `attend`, attention computed with quantized
matmuls on the packed rows (`cache.quantized_attention`). A side kept
unquantized (bits None) is one array of the model's dtype; a side of width
0 (an index cache's values) stores nothing.

In-place writes hold as for `PagePool`: the arrays are private, handed out
only for evaluation (`arrays`).
"""

from __future__ import annotations

import mlx.core as mx

from blockmgr.errors import InvalidArgument
from cache.page_pool import PoolShape
from cache.quantized_attention import (
    Packed,
    packed,
    paged_quantized_attention,
    quantized_sdpa,
    supports_gather_qmm,
    use_quantized_matmul,
)
from cache.step_plan import StepPlan


class _Side:
    """K or V of a pool: its arrays (0, 1 or 3) and how rows are encoded."""

    __slots__ = ("bits", "group_size", "width", "dtype", "arrays")

    def __init__(self, num_rows: int, block_size: int, width: int, dtype: mx.Dtype,
                 bits: int | None, group_size: int) -> None:
        self.bits = bits
        self.group_size = group_size
        self.width = width
        self.dtype = dtype
        if width == 0:
            self.arrays: list[mx.array] = []
        elif bits is None:
            self.arrays = [mx.zeros((num_rows, block_size, width), dtype)]
        else:
            groups = width // group_size
            self.arrays = [mx.zeros((num_rows, block_size, width * bits // 32), mx.uint32),
                           mx.zeros((num_rows, block_size, groups), dtype),
                           mx.zeros((num_rows, block_size, groups), dtype)]

    @property
    def quantized(self) -> bool:
        return self.bits is not None and self.width > 0

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        """Rows ``[..., width]`` as stored: packed, scales, biases (or the
        rows themselves unquantized, or nothing at width 0)."""
        if not self.arrays:
            return ()
        x = x.astype(self.dtype)
        if self.bits is None:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, parts: tuple[mx.array, ...], lead: tuple[int, ...]) -> mx.array:
        """Stored rows (leading shape `lead`) as ``[*lead, width]`` values."""
        if not self.arrays:
            return mx.zeros((*lead, 0), self.dtype)
        if self.bits is None:
            return parts[0]
        w, scales, biases = packed(parts)
        return mx.dequantize(w, scales, biases, group_size=self.group_size, bits=self.bits)

    def write(self, rows: mx.array, cols: mx.array, x: mx.array) -> None:
        for i, part in enumerate(self.encode(x)):
            self.arrays[i][rows, cols] = part

    def take(self, rows: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.take(a, rows, axis=0) for a in self.arrays)

    def history(self, rows: mx.array, batch: int, heads: int, length: int
                ) -> tuple[mx.array, ...]:
        """Page rows `rows` (batch-major) as stored ``[batch, heads, length, *]``."""
        return tuple(p.reshape(batch, heads, length, p.shape[-1]) for p in self.take(rows))

    def run(self, heads: int, lo: int, hi: int) -> tuple[mx.array, ...]:
        """Flat columns [lo, hi) of each head's span, as strided views."""
        out = []
        for a in self.arrays:
            flat = a.shape[0] // heads * a.shape[1]
            out.append(a.reshape(1, heads, flat, a.shape[-1])[:, :, lo:hi])
        return tuple(out)


class QuantizedPagePool:
    """K and V pages of one attention layer, affine-quantized (see the
    module doc); the `page_format.PageStore` protocol."""

    __slots__ = ("shape", "group_size", "_keys", "_values")

    def __init__(self, shape: PoolShape, key_bits: int | None, value_bits: int | None,
                 group_size: int) -> None:
        if shape.num_blocks < 1 or shape.block_size < 1 or shape.n_kv_heads < 1:
            raise InvalidArgument(f"bad pool shape {shape}")
        self.shape = shape
        self.group_size = group_size
        rows = shape.n_kv_heads * shape.num_blocks
        self._keys = _Side(rows, shape.block_size, shape.k_head_dim, shape.dtype, key_bits,
                           group_size)
        self._values = _Side(rows, shape.block_size, shape.v_head_dim, shape.dtype, value_bits,
                             group_size)
        mx.eval(self.arrays())

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool arrays (every page: packed values, scales, biases)."""
        return sum(a.nbytes for a in self.arrays())

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page, K and V, all heads, scales and biases included."""
        return self.nbytes // self.shape.num_blocks

    def write(self, rows: mx.array, cols: mx.array, keys: mx.array, values: mx.array) -> None:
        """Quantize token rows and scatter them in place: ``pool[rows[i],
        cols[i]] = quantize(keys[i])`` (`keys` ``[n, k_head_dim]``, `values`
        likewise). Lazy; O(n) once evaluated."""
        self._keys.write(rows, cols, keys)
        self._values.write(rows, cols, values)

    def stored(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """New K/V ``[..., D]`` as the pool keeps them (quantized, then
        dequantized): the history of a fresh prefill, bit for bit what a
        later read of the pages gives."""
        return (self._keys.decode(self._keys.encode(keys), keys.shape[:-1]),
                self._values.decode(self._values.encode(values), values.shape[:-1]))

    def gather(self, rows: mx.array, batch: int, length: int) -> tuple[mx.array, mx.array]:
        """Pages `rows` dequantized, K ``[batch, n_kv_heads, length, k_head_dim]``
        and V likewise. Cost: a gather of the packed bytes plus one
        dequantization of them."""
        h = self.shape.n_kv_heads
        lead = (batch, h, length)
        return (self._keys.decode(self._keys.history(rows, batch, h, length), lead),
                self._values.decode(self._values.history(rows, batch, h, length), lead))

    def read_tokens(self, rows: mx.array, cols: mx.array) -> tuple[mx.array, mx.array]:
        """Single tokens dequantized, K ``[n, k_head_dim]`` and V (lazy; as
        `read_pages`, evaluate before the next write into this pool)."""
        lead = (rows.shape[0],)
        return (self._keys.decode(tuple(a[rows, cols] for a in self._keys.arrays), lead),
                self._values.decode(tuple(a[rows, cols] for a in self._values.arrays), lead))

    def run_view(self, first_page: int, start: int, stop: int) -> tuple[mx.array, mx.array]:
        """Columns [start, stop) of the consecutive pages from `first_page`
        on, dequantized ``[1, n_kv_heads, stop - start, D]`` from strided
        views of the pool (no gather). Within one step only (see `PagePool`)."""
        h = self.shape.n_kv_heads
        lo, hi = self._run_span(first_page, start, stop)
        lead = (1, h, hi - lo)
        return (self._keys.decode(self._keys.run(h, lo, hi), lead),
                self._values.decode(self._values.run(h, lo, hi), lead))

    def read_pages(self, rows: mx.array) -> tuple[mx.array, ...]:
        """The stored parts of page rows `rows` (K's, then V's; lazy). Evaluate
        them before `write_pages` into this pool (see `PagePool.read_pages`)."""
        return self._keys.take(rows) + self._values.take(rows)

    def write_pages(self, rows: mx.array, *parts: mx.array) -> None:
        """Overwrite whole page rows in place with the parts `read_pages` gave."""
        num_key_parts = len(self._keys.arrays)
        if len(parts) != num_key_parts + len(self._values.arrays):
            raise InvalidArgument(f"{len(parts)} page parts for a pool of "
                                  f"{len(self.arrays())} arrays")
        for side, chunk in ((self._keys, parts[:num_key_parts]),
                            (self._values, parts[num_key_parts:])):
            for i, part in enumerate(chunk):
                side.arrays[i][rows] = part

    def copy_pages(self, src_rows: mx.array, dst_rows: mx.array) -> None:
        """Copy whole page rows (packed bytes, never re-quantized); evaluates
        the sources first. Cost: one small eval plus O(copied bytes)."""
        parts = self.read_pages(src_rows)
        mx.eval(parts)
        self.write_pages(dst_rows, *parts)

    def arrays(self) -> tuple[mx.array, ...]:
        """The pool arrays, for evaluation only (see `PagePool.arrays`)."""
        return (*self._keys.arrays, *self._values.arrays)

    def attend(self, queries: mx.array, plan: StepPlan, scale: float, mask) -> mx.array | None:
        """Attention with quantized matmuls on the packed pages, or None
        where dequantizing the history and the model's kernel is faster
        (`use_quantized_matmul`: long steps, half precision on the CPU) or
        a side is not quantized. One row: `quantized_sdpa` on its exact
        packed history with the step's `mask`; several rows:
        `paged_quantized_attention` on the pool in place."""
        keys, values = self._keys, self._values
        key_bits, value_bits = keys.bits, values.bits
        if key_bits is None or value_bits is None or not (keys.quantized and values.quantized):
            return None
        if not use_quantized_matmul(self.shape.dtype, plan.num_queries, plan.batch):
            return None
        if plan.batch == 1:
            k_parts, v_parts = self._packed_history(plan)
            return quantized_sdpa(queries, k_parts, v_parts, scale, mask, self.group_size,
                                  key_bits, value_bits)
        if not supports_gather_qmm(self.shape.dtype):
            return None
        index = plan.pair_index(self.shape.n_kv_heads)
        return paged_quantized_attention(
            queries, packed(tuple(keys.arrays)), packed(tuple(values.arrays)),
            index, scale, self.group_size, key_bits, value_bits)

    def _packed_history(self, plan: StepPlan) -> tuple[Packed, Packed]:
        """The packed history `views` hands out dequantized for this step
        (same pages, same slice): a run view, or a gather cut to the visible
        keys for an exact row."""
        h = self.shape.n_kv_heads
        if (first := plan.first_run_page) is not None:
            lo, hi = self._run_span(first, *plan.history_slice())
            return packed(self._keys.run(h, lo, hi)), packed(self._values.run(h, lo, hi))
        rows = plan.gather_rows(h)
        keys = packed(self._keys.history(rows, plan.batch, h, plan.length))
        values = packed(self._values.history(rows, plan.batch, h, plan.length))
        if plan.exact:
            start, stop = plan.history_slice()
            if start or stop != plan.length:
                keys = _cut(keys, start, stop)
                values = _cut(values, start, stop)
        return keys, values

    def _run_span(self, first_page: int, start: int, stop: int) -> tuple[int, int]:
        base = first_page * self.shape.block_size
        return base + start, base + stop


def _cut(parts: Packed, start: int, stop: int) -> Packed:
    """Each part's keys `start:stop` (axis 2)."""
    return parts[0][:, :, start:stop], parts[1][:, :, start:stop], parts[2][:, :, start:stop]
