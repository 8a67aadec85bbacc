"""Pages as records: one page of a layer group, every layer, as raw bytes.

The prefix cache's host and disk tiers (`cache.cache_tiers`) keep a page of
a layer group as one fixed-size record: for each layer of the group, in
layer order, each stored part of the page (K and V; a quantized pool's
packed values, scales and biases), all heads, in the page format's own
bytes (bit for bit: bfloat16 and quantized rows are never converted). A
`PageRecords` reads a batch of device pages into a ``[n, record_nbytes]``
uint8 array (one gather per pool array, one evaluation, one host copy)
and writes such rows back into device pages (one lazy scatter per pool
array), the inverse. The layout (`parts`) is what a disk record's reader
must agree on: it is part of the disk tier's fingerprint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument
from cache.page_format import PageStore
from cache.page_pool import page_rows


@dataclass(frozen=True, slots=True)
class PartLayout:
    """One stored part of one layer's page: per head, `shape` (block size
    first) of `dtype`."""

    layer: int
    shape: tuple[int, ...]
    dtype: mx.Dtype
    n_kv_heads: int

    @property
    def nbytes(self) -> int:
        """Bytes of this part of one page (every head)."""
        n = self.n_kv_heads * self.dtype.size
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"{self.layer}:{self.n_kv_heads}x{'x'.join(map(str, self.shape))}:{self.dtype}"


class PageRecords:
    """Device pages of one layer group <-> records; see the module doc."""

    __slots__ = ("_pools", "parts", "nbytes")

    def __init__(self, pools: Mapping[int, PageStore]) -> None:
        """`pools`: the group's pools by layer (all allocated). Reads page 0
        of each once to learn the parts' shapes (a small lazy gather)."""
        self._pools = dict(sorted(pools.items()))
        parts: list[PartLayout] = []
        for layer, pool in self._pools.items():
            heads = pool.shape.n_kv_heads
            for part in pool.read_pages(page_rows(pool, [0])):
                parts.append(PartLayout(layer, tuple(part.shape[1:]), part.dtype, heads))
        self.parts = tuple(parts)
        self.nbytes = sum(p.nbytes for p in parts)

    def describe(self) -> str:
        """The layout as text (a fingerprint's part)."""
        return ";".join(p.describe() for p in self.parts)

    def read(self, pages: Sequence[int]) -> np.ndarray:
        """Pages `pages[i]` as rows of a ``[len(pages), nbytes]`` uint8 array:
        evaluated and copied to the host, so the device pages may be reused
        right after. Cost: O(bytes moved)."""
        out = np.empty((len(pages), self.nbytes), np.uint8)
        if not pages:
            return out
        raw = []
        for pool in self._pools.values():
            for part in pool.read_pages(page_rows(pool, pages)):
                if not part.size:  # a zero-width side stores nothing
                    continue
                # head-major rows [h * P + i] -> page-major [i, h, ...] bytes
                heads = part.reshape(pool.shape.n_kv_heads, len(pages), *part.shape[1:])
                raw.append(mx.contiguous(heads.swapaxes(0, 1)).view(mx.uint8)
                           .reshape(len(pages), -1))
        mx.eval(raw)
        offset = 0
        for part in raw:
            width = part.shape[1]
            out[:, offset:offset + width] = np.asarray(part)
            offset += width
        return out

    def write(self, pages: Sequence[int], records: np.ndarray) -> None:
        """Write record row i into device page `pages[i]` (lazy, in place:
        evaluated with the next forward). Cost: O(bytes moved)."""
        if records.shape != (len(pages), self.nbytes):
            raise InvalidArgument(
                f"page records {records.shape} for {len(pages)} pages of {self.nbytes} bytes")
        if not pages:
            return
        offset = 0
        layer_parts: dict[int, list[mx.array]] = {}
        for part in self.parts:
            width = part.nbytes
            rows = (part.n_kv_heads * len(pages), *part.shape)
            if not width:  # a zero-width side: nothing stored, nothing to write
                layer_parts.setdefault(part.layer, []).append(mx.zeros(rows, part.dtype))
                continue
            chunk = np.ascontiguousarray(records[:, offset:offset + width])
            value = mx.array(chunk).view(part.dtype).reshape(
                len(pages), part.n_kv_heads, *part.shape)
            layer_parts.setdefault(part.layer, []).append(value.swapaxes(0, 1).reshape(rows))
            offset += width
        for layer, pool in self._pools.items():
            pool.write_pages(page_rows(pool, pages), *layer_parts[layer])
