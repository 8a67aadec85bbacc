"""Host-side copies of KV pages (swap space), one store per attention layer.

Preemption by swap (`BlockManager.swap_out` / `swap_in`) moves a sequence's
pages to host memory and back. A `HostPagePool` holds K and V of
`num_host_blocks` pages as numpy arrays in the same head-major layout as the
device pool (`[n_kv_heads * num_host_blocks, block_size, head_dim]`), so a
batch of pages moves with one device gather and one host fancy-index write
(swap out) or one host gather and one device scatter (swap in).

Values are stored bit for bit (as unsigned integers of the dtype's size), so
dtypes numpy lacks (bfloat16) round-trip exactly. The arrays are allocated
on the first swap (`np.empty`: untouched host pages take no resident memory).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument
from cache.page_pool import PagePool, head_rows

_RAW = {1: (mx.uint8, np.uint8), 2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32),
        8: (mx.uint64, np.uint64)}


class HostPagePool:
    """Host copies of one layer's pages; see the module doc."""

    __slots__ = ("num_host_blocks", "_keys", "_values")

    def __init__(self, num_host_blocks: int) -> None:
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) \
                or num_host_blocks < 1:
            raise InvalidArgument(f"num_host_blocks must be a positive int, got {num_host_blocks!r}")
        self.num_host_blocks = num_host_blocks
        self._keys: np.ndarray | None = None
        self._values: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes reserved for host pages (0 before the first swap)."""
        return 0 if self._keys is None else self._keys.nbytes + self._values.nbytes

    def swap_out(self, pool: PagePool, pages: list[int], host_pages: list[int]) -> None:
        """Copy device `pages[i]` of `pool` into host page `host_pages[i]`.

        One gather of the device rows, evaluated (the copy must hold the
        current contents before the device pages are reused), then one
        numpy write. Cost: O(bytes moved).
        """
        s = pool.shape
        self._ensure(pool)
        raw_mx, _ = _RAW[s.dtype.size]
        k, v = pool.read_pages(_rows(pages, s.n_kv_heads, s.num_blocks))
        k, v = k.view(raw_mx), v.view(raw_mx)
        mx.eval(k, v)
        rows = _np_rows(host_pages, s.n_kv_heads, self.num_host_blocks)
        self._keys[rows] = np.asarray(k)
        self._values[rows] = np.asarray(v)

    def swap_in(self, pool: PagePool, host_pages: list[int], pages: list[int]) -> None:
        """Copy host page `host_pages[i]` into device page `pages[i]` of `pool`
        (one host gather, one in-place device write, lazy). Cost: O(bytes moved).

        A pool that never received pages copies nothing: the pages swapped out
        before any forward wrote this layer held no data."""
        if self._keys is None:
            return
        s = pool.shape
        rows = _np_rows(host_pages, s.n_kv_heads, self.num_host_blocks)
        k = mx.array(self._keys[rows]).view(s.dtype)
        v = mx.array(self._values[rows]).view(s.dtype)
        pool.write_pages(_rows(pages, s.n_kv_heads, s.num_blocks), k, v)

    def _ensure(self, pool: PagePool) -> None:
        if self._keys is not None:
            return
        s = pool.shape
        _, raw_np = _RAW[s.dtype.size]
        n = s.n_kv_heads * self.num_host_blocks
        self._keys = np.empty((n, s.block_size, s.k_head_dim), raw_np)
        self._values = np.empty((n, s.block_size, s.v_head_dim), raw_np)


def _np_rows(pages: list[int], n_kv_heads: int, num_blocks: int) -> np.ndarray:
    return head_rows(np.asarray(pages, dtype=np.int64), n_kv_heads, num_blocks).reshape(-1)


def _rows(pages: list[int], n_kv_heads: int, num_blocks: int) -> mx.array:
    return mx.array(_np_rows(pages, n_kv_heads, num_blocks).astype(np.int32))
