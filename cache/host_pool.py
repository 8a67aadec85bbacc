"""Host-side copies of KV pages (swap space), one store per attention layer.

Preemption by swap (`BlockManager.swap_out` / `swap_in`) moves a sequence's
pages to host memory and back. A `HostPagePool` holds the stored parts of
`num_host_blocks` pages (K and V; for a quantized pool their packed values,
scales and biases) as numpy arrays in the same head-major layout as the
device pool (`[n_kv_heads * num_host_blocks, block_size, *]`), so a batch
of pages moves with one device gather and one host fancy-index write per
part (swap out) or one host gather and one device scatter (swap in).

Values are stored bit for bit (as unsigned integers of the dtype's size), so
dtypes numpy lacks (bfloat16) round-trip exactly and quantized rows are
never re-quantized. The arrays are allocated on the first swap out, shaped
like the parts the pool hands out, zeroed (`np.zeros`, which the OS backs
lazily: untouched host pages take no resident memory).

A host page no swap out wrote reads as zeros, what a fresh device page
holds. Such pages are swapped in: a sequence swapped out before any
forward created this layer's pool holds host pages nothing was copied to
(`PagedCache` skips pools that do not exist yet), and once another
sequence's swap out allocates the arrays, its swap in copies them to the
device. Uninitialized bytes there (NaN scales, say) would sit in rows the
sequence has not written yet, which a batched step reads under its mask
(a masked NaN is still NaN).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument
from cache.page_format import PageStore
from cache.step_plan import head_rows

_RAW = {1: (mx.uint8, np.uint8), 2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32),
        8: (mx.uint64, np.uint64)}


class HostPagePool:
    """Host copies of one layer's pages; see the module doc."""

    __slots__ = ("num_host_blocks", "_parts", "_dtypes")

    def __init__(self, num_host_blocks: int) -> None:
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) \
                or num_host_blocks < 1:
            raise InvalidArgument(
                f"num_host_blocks must be a positive int, got {num_host_blocks!r}"
            )
        self.num_host_blocks = num_host_blocks
        self._parts: list[np.ndarray] = []  # raw bytes of each stored part
        self._dtypes: list[mx.Dtype] = []  # each part's device dtype

    @property
    def nbytes(self) -> int:
        """Bytes reserved for host pages (0 before the first swap)."""
        return sum(p.nbytes for p in self._parts)

    def swap_out(self, pool: PageStore, pages: list[int], host_pages: list[int]) -> None:
        """Copy device `pages[i]` of `pool` into host page `host_pages[i]`.

        One gather of the device rows, evaluated (the copy must hold the
        current contents before the device pages are reused), then one
        numpy write per part. Cost: O(bytes moved).
        """
        s = pool.shape
        parts = pool.read_pages(_rows(pages, s.n_kv_heads, s.num_blocks))
        self._ensure(parts, s.n_kv_heads)
        raw = [p.view(_RAW[p.dtype.size][0]) for p in parts]
        mx.eval(raw)
        rows = _np_rows(host_pages, s.n_kv_heads, self.num_host_blocks)
        for host, part in zip(self._parts, raw):
            host[rows] = np.asarray(part)

    def swap_in(self, pool: PageStore, host_pages: list[int], pages: list[int]) -> None:
        """Copy host page `host_pages[i]` into device page `pages[i]` of `pool`
        (one host gather, one in-place device write per part, lazy). Cost:
        O(bytes moved).

        A pool that never received pages copies nothing: the pages swapped out
        before any forward wrote this layer held no data."""
        if not self._parts:
            return
        s = pool.shape
        rows = _np_rows(host_pages, s.n_kv_heads, self.num_host_blocks)
        parts = [mx.array(host[rows]).view(dtype) for host, dtype in zip(self._parts, self._dtypes)]
        pool.write_pages(_rows(pages, s.n_kv_heads, s.num_blocks), *parts)

    def _ensure(self, parts: tuple[mx.array, ...], n_kv_heads: int) -> None:
        if self._parts:
            return
        n = n_kv_heads * self.num_host_blocks
        self._parts = [np.zeros((n, *p.shape[1:]), _RAW[p.dtype.size][1]) for p in parts]
        self._dtypes = [p.dtype for p in parts]


def _np_rows(pages: list[int], n_kv_heads: int, num_blocks: int) -> np.ndarray:
    return head_rows(np.asarray(pages, dtype=np.int64), n_kv_heads, num_blocks).reshape(-1)


def _rows(pages: list[int], n_kv_heads: int, num_blocks: int) -> mx.array:
    return mx.array(_np_rows(pages, n_kv_heads, num_blocks).astype(np.int32))
