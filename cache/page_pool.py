"""The KV page pool of one attention layer, as MLX arrays.

Layout (chosen by measurement, see design/cache.md): head-major pages,
``[n_kv_heads * num_blocks, block_size, head_dim]``. Row ``h * num_blocks + p``
holds head ``h`` of page ``p``. Gathering a sequence's pages is then ONE
``take`` along axis 0 whose result reshapes for free into the
``[B, n_kv_heads, T, head_dim]`` layout SDPA wants (no transpose copy).

In-place writes: ``pool[idx] = x`` is in place only while nothing else
references the pool array (a reshape kept elsewhere counts, and so does a
gather of the pool fused into the same graph as the write). The pool arrays
are therefore private: callers get gathered copies, never the arrays, and
`copy_blocks` evaluates the pages it reads before writing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument
from blockmgr.ops import CopyBlock
from cache.paged_attention import PAGED_MAX_QUERIES, gathers_faster, paged_attention, supports
from cache.step_plan import StepPlan, head_rows


@dataclass(frozen=True, slots=True)
class PoolShape:
    """Shape and dtype of one layer's pages (K and V head dims may differ)."""

    num_blocks: int
    block_size: int
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype = mx.float32

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page, K and V, all heads."""
        per_token = self.n_kv_heads * (self.k_head_dim + self.v_head_dim)
        return self.block_size * per_token * self.dtype.size


class PagePool:
    """K and V pages of one attention layer, at the model's dtype (the
    `page_format.PageStore` protocol; `QuantizedPagePool` is the other format).

    All index arguments are head-major row indices (see `head_rows`), built
    once per step and shared by every layer with the same number of kv heads.
    """

    __slots__ = ("shape", "_keys", "_values")

    def __init__(self, shape: PoolShape) -> None:
        if shape.num_blocks < 1 or shape.block_size < 1 or shape.n_kv_heads < 1:
            raise InvalidArgument(f"bad pool shape {shape}")
        self.shape = shape
        rows = shape.n_kv_heads * shape.num_blocks
        self._keys = mx.zeros((rows, shape.block_size, shape.k_head_dim), shape.dtype)
        self._values = mx.zeros((rows, shape.block_size, shape.v_head_dim), shape.dtype)
        mx.eval(self._keys, self._values)

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool arrays (every page, used or not)."""
        return self._keys.nbytes + self._values.nbytes

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page, K and V, all heads."""
        return self.shape.page_nbytes

    def write(self, rows: mx.array, cols: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter token K/V in place: ``pool[rows[i], cols[i]] = keys[i]``.

        `keys` is ``[n, k_head_dim]``, `values` ``[n, v_head_dim]``; `rows`
        are head-major page rows, `cols` the token's row inside its page.
        Lazy; costs O(n) once evaluated (no pool copy, see module doc).
        """
        self._keys[rows, cols] = keys.astype(self.shape.dtype)
        if self.shape.v_head_dim:
            self._values[rows, cols] = values.astype(self.shape.dtype)

    def stored(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """New K/V as the pool keeps them: unchanged (the history of a fresh
        prefill, handed back without reading the pool)."""
        return keys, values

    def gather(self, rows: mx.array, batch: int, length: int) -> tuple[mx.array, mx.array]:
        """Pages `rows` (``[batch * n_kv_heads * pages]``, batch-major) as arrays.

        Returns contiguous K ``[batch, n_kv_heads, length, k_head_dim]`` and V
        likewise, `length` = pages * block_size. One take per array; cost is
        a copy of the gathered bytes.
        """
        s = self.shape
        h = s.n_kv_heads
        # Explicit widths: a -1 beside a zero-width axis (values of width 0,
        # as an index cache stores) divides by zero inside MLX.
        k = mx.take(self._keys, rows, axis=0).reshape(batch, h, length, s.k_head_dim)
        if not s.v_head_dim:
            return k, mx.zeros((batch, h, length, 0), s.dtype)
        v = mx.take(self._values, rows, axis=0).reshape(batch, h, length, s.v_head_dim)
        return k, v

    def read_tokens(self, rows: mx.array, cols: mx.array) -> tuple[mx.array, mx.array]:
        """Copies of single tokens: ``pool[rows[i], cols[i]]`` as K ``[n, k_head_dim]``
        and V ``[n, v_head_dim]`` (lazy; as `read_pages`, evaluate them before
        the next write into this pool)."""
        keys = self._keys[rows, cols]
        if not self.shape.v_head_dim:
            return keys, mx.zeros((rows.shape[0], 0), self.shape.dtype)
        return keys, self._values[rows, cols]

    def run_view(self, first_page: int, start: int, stop: int) -> tuple[mx.array, mx.array]:
        """Columns [start, stop) of the consecutive pages from `first_page` on,
        as strided views ``[1, n_kv_heads, stop - start, D]`` of the pool (no
        copy, like `KVCache`'s slices). Head h, page p, row c is flat column
        ``p * block_size + c`` of head h's ``[num_blocks * block_size]`` span.
        Use within one step only: a view kept alive makes the next write copy
        the pool."""
        s = self.shape
        lo = first_page * s.block_size + start
        hi = first_page * s.block_size + stop
        num_rows = s.num_blocks * s.block_size
        k = self._keys.reshape(1, s.n_kv_heads, num_rows, s.k_head_dim)[:, :, lo:hi]
        if not s.v_head_dim:
            return k, mx.zeros((1, s.n_kv_heads, hi - lo, 0), s.dtype)
        v = self._values.reshape(1, s.n_kv_heads, num_rows, s.v_head_dim)[:, :, lo:hi]
        return k, v

    def read_pages(self, rows: mx.array) -> tuple[mx.array, mx.array]:
        """Copies of page rows `rows` (lazy). Evaluate them before `write_pages`
        into this pool: a gather of the pool in the same graph as a write to
        it makes MLX copy the whole pool."""
        keys = mx.take(self._keys, rows, axis=0)
        if not self.shape.v_head_dim:  # MLX cannot take from a zero-width array
            return keys, mx.zeros((rows.shape[0], self.shape.block_size, 0), self.shape.dtype)
        return keys, mx.take(self._values, rows, axis=0)

    def write_pages(self, rows: mx.array, *parts: mx.array) -> None:
        """Overwrite whole page rows in place (the parts `read_pages` gave:
        keys, values)."""
        keys, values = parts
        self._keys[rows] = keys
        if self.shape.v_head_dim:
            self._values[rows] = values

    def copy_pages(self, src_rows: mx.array, dst_rows: mx.array) -> None:
        """Copy whole page rows ``src_rows[i] -> dst_rows[i]`` (one batched op).

        Evaluates the sources first (see `read_pages`); costs one small eval
        plus O(copied bytes).
        """
        k, v = self.read_pages(src_rows)
        mx.eval(k, v)
        self.write_pages(dst_rows, k, v)

    def arrays(self) -> tuple[mx.array, mx.array]:
        """The pool arrays, for evaluation only: holding them past the next
        write makes that write copy the whole pool."""
        return self._keys, self._values

    def attend(self, queries: mx.array, plan: StepPlan, scale: float, mask) -> mx.array | None:
        """Attention over the step's pages read in place (`paged_attention`),
        or None where the dense kernel on the gathered history is the better
        choice: one row (its exact history and the fused kernel beat
        per-page products, measured ~1.2x), more than `PAGED_MAX_QUERIES`
        queries (compute-bound), a history small enough to gather cheaply
        (`gathers_faster`), or a dtype the device's `gather_mm` lacks.
        `mask` is the step's own (the caller checks that); the plan's masks
        mean the same."""
        if plan.batch == 1 or plan.num_queries > PAGED_MAX_QUERIES:
            return None
        history_nbytes = plan.batch * plan.length * self.shape.page_nbytes // self.shape.block_size
        if gathers_faster(history_nbytes) or not supports(self.shape.dtype):
            return None
        index = plan.pair_index(self.shape.n_kv_heads)
        return paged_attention(queries, self._keys, self._values, index, scale)


def page_rows(pool, pages: Sequence[int]) -> mx.array:
    """Flat head-major rows of whole `pages` in `pool` (any `PageStore`),
    ``[n_kv_heads * len(pages)]``."""
    p = np.asarray(pages, dtype=np.int64)
    rows = head_rows(p, pool.shape.n_kv_heads, pool.shape.num_blocks)
    return mx.array(rows.reshape(-1).astype(np.int32))


def copy_waves(ops: Sequence[CopyBlock]) -> list[tuple[list[int], list[int]]]:
    """Split CopyBlock ops into batches that are safe to apply as one gather+scatter.

    A batch reads all its sources before writing any destination, so ops can
    share it unless an op reads a page an earlier op of the batch writes
    (read-after-write) or writes a page it already writes (write-after-write);
    either starts a new batch, keeping the call-order semantics of plans.
    Usually there is exactly one batch. O(len(ops)).
    """
    waves: list[tuple[list[int], list[int]]] = []
    src: list[int] = []
    dst: list[int] = []
    written: set[int] = set()
    for op in ops:
        if op.src in written or op.dst in written:
            waves.append((src, dst))
            src, dst, written = [], [], set()
        src.append(op.src)
        dst.append(op.dst)
        written.add(op.dst)
    if src:
        waves.append((src, dst))
    return waves
