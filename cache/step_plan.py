"""Index and mask planning for one forward step of one page group.

Pure bookkeeping on numpy (no pool access): which (page, row) each new token
goes to, which pages each sequence gathers, and the attention mask. Built
once per step per group and shared by every layer of the group, so a layer's
work is one scatter and one gather per pool array.

Batches are right-padded: row b's new tokens are query positions
``[0, n_new[b])`` of the step; its history is gathered from the first page
its window still needs and padded at the end to the longest row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument
from cache.paged_attention import PairIndex, pair_index


@dataclass(slots=True)
class StepPlan:
    """One group's plan for one step; see the module doc for the layout.

    `exact` (one sequence, no padding): the history handed to the model is
    sliced to exactly the keys it may see, so mlx-lm's own masks (None for a
    single query, "causal") apply unchanged, as with `KVCache`.
    """

    offsets: list[int]  # tokens already computed, per row
    n_new: list[int]  # new tokens this step, per row (<= num_queries)
    num_queries: int  # N: query length of the step (padded)
    block_size: int
    num_blocks: int
    window: int | None
    pages: np.ndarray  # [B, P] gathered pages (padding rows point at page 0)
    base: np.ndarray  # [B] absolute position of gathered column 0
    valid: np.ndarray  # [B] gathered columns that hold real pages
    write_pages: np.ndarray  # [B, N] page of each new token (-1 = padding)
    write_cols: np.ndarray  # [B, N] row inside the page
    _index: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.offsets)

    @property
    def exact(self) -> bool:
        return self.batch == 1 and self.n_new[0] == self.num_queries

    @property
    def length(self) -> int:
        """T: gathered history length (columns), before any exact slicing."""
        return self.pages.shape[1] * self.block_size

    def history_slice(self) -> tuple[int, int]:
        """Gathered columns [start, stop) handed to the model in exact mode."""
        off, base = self.offsets[0], int(self.base[0])
        start = 0 if self.window is None else max(0, off - self.window + 1)
        return start - base, off + self.num_queries - base

    def write_index(self, n_kv_heads: int) -> tuple[mx.array | None, mx.array, mx.array]:
        """(src rows of keys.reshape(-1, D) or None if dense, pool rows, page cols)."""
        key = ("w", n_kv_heads)
        if key not in self._index:
            self._index[key] = self._build_write_index(n_kv_heads)
        return self._index[key]

    def _build_write_index(self, h: int):
        pages, cols = self.write_pages, self.write_cols  # [B, N]
        heads = np.arange(h, dtype=np.int64)[None, :, None]
        rows = heads * self.num_blocks + pages[:, None, :]  # [B, H, N]
        cols = np.broadcast_to(cols[:, None, :], rows.shape)
        if (pages >= 0).all():
            return None, _i32(rows), _i32(cols)
        b, j = np.nonzero(pages >= 0)  # real tokens only
        n = self.num_queries
        src = (b[:, None] * h + heads[0, :, 0][None]) * n + j[:, None]  # [M, H]
        return _i32(src), _i32(rows[b, :, j]), _i32(cols[b, :, j])

    def gather_rows(self, n_kv_heads: int) -> mx.array:
        """Head-major pool rows of the gathered pages, ``[B * H * P]``."""
        key = ("g", n_kv_heads)
        if key not in self._index:
            heads = np.arange(n_kv_heads, dtype=np.int64)[:, None] * self.num_blocks
            self._index[key] = _i32(heads[None] + self.pages[:, None, :])
        return self._index[key]

    def pair_index(self, n_kv_heads: int) -> PairIndex:
        """The step's (row, head, page) pairs for `paged_attention` (cached)."""
        key = ("p", n_kv_heads)
        if key not in self._index:
            self._index[key] = pair_index(
                self.pages, self.valid // self.block_size, self.base,
                np.asarray(self.offsets, dtype=np.int64), self.num_queries,
                self.block_size, self.num_blocks, n_kv_heads, self.window,
            )
        return self._index[key]

    def made_mask(self, window: int | None):
        """The array `mask` last returned for `window` (None if none was built)."""
        return self._index.get(("m", window))

    def offset_value(self, after: bool) -> int | mx.array:
        """mlx-lm's `offset`: an int for one sequence, else an int32 array."""
        offs = [o + n for o, n in zip(self.offsets, self.n_new)] if after else self.offsets
        return offs[0] if self.batch == 1 else mx.array(offs, dtype=mx.int32)

    def mask(self, n: int, window: int | None, return_array: bool):
        """Attention mask for `n` queries, as mlx-lm's `make_mask` returns it.

        Exact mode mirrors `KVCache` / `RotatingKVCache` (None, "causal" or a
        bool array); otherwise a bool ``[B, 1, N, T]`` array with causal,
        padding and window terms. Cost O(B * N * T) when an array is built.
        """
        if n != self.num_queries:
            raise InvalidArgument(f"mask for {n} queries in a step of {self.num_queries}")
        window = window or self.window
        made = self._mask(n, window, return_array)
        if isinstance(made, mx.array):
            self._index[("m", window)] = made
        return made

    def _mask(self, n: int, window: int | None, return_array: bool):
        if self.exact:
            start, stop = self.history_slice()
            seen = self.offsets[0] - (start + int(self.base[0]))  # keys before query 0
            if n == 1 and (window is None or seen + 1 <= window):
                return None
            if window is None and not return_array:
                return "causal"
            return causal_mask(n, seen, window)
        q = np.asarray(self.offsets)[:, None] + np.arange(n)[None]  # [B, N] absolute
        k = self.base[:, None] + np.arange(self.length)[None]  # [B, T] absolute
        ok = k[:, None, :] <= q[:, :, None]
        ok &= (np.arange(self.length)[None] < self.valid[:, None])[:, None, :]
        if window is not None:
            ok &= k[:, None, :] > q[:, :, None] - window
        return mx.array(ok[:, None])


def causal_mask(n: int, offset: int, window: int | None) -> mx.array:
    """Bool ``[n, offset + n]`` mask: query i (at offset + i) sees keys <= it,
    and with a window only the last `window` of them (itself included)."""
    q = np.arange(offset, offset + n)[:, None]
    k = np.arange(offset + n)[None]
    ok = k <= q
    if window is not None:
        ok &= k > q - window
    return mx.array(ok)


def plan_step(
    tables: list[list[int | None]],
    offsets: list[int],
    n_new: list[int],
    num_queries: int,
    block_size: int,
    num_blocks: int,
    window: int | None,
) -> StepPlan:
    """Plan one step for rows with block `tables`; O(B * (N + P)) Python work.

    Raises `InvalidArgument` when a row has nothing to attend to or needs a
    page its window already released.
    """
    bsz = len(tables)
    starts, stops = [], []
    for b, (off, n) in enumerate(zip(offsets, n_new)):
        end = off + n
        if end < 1:
            raise InvalidArgument(f"row {b} has no tokens to attend to")
        first = 0 if window is None else max(0, off - window + 1) // block_size
        starts.append(first)
        stops.append((end - 1) // block_size + 1)
    width = max(s - f for f, s in zip(starts, stops))
    pages = np.zeros((bsz, width), dtype=np.int64)
    write_pages = np.full((bsz, num_queries), -1, dtype=np.int64)
    write_cols = np.zeros((bsz, num_queries), dtype=np.int64)
    for b, table in enumerate(tables):
        row = table[starts[b] : stops[b]]
        if len(row) < stops[b] - starts[b] or None in row:
            raise InvalidArgument(f"row {b}: a page this step needs is missing or released")
        pages[b, : len(row)] = row
        pos = np.arange(offsets[b], offsets[b] + n_new[b])
        write_pages[b, : n_new[b]] = [table[p] for p in pos // block_size]
        write_cols[b, : n_new[b]] = pos % block_size
    base = np.asarray(starts, dtype=np.int64) * block_size
    valid = (np.asarray(stops) - np.asarray(starts)) * block_size
    return StepPlan(
        list(offsets), list(n_new), num_queries, block_size, num_blocks, window,
        pages, base, valid, write_pages, write_cols,
    )


def _i32(x: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(x).reshape(-1).astype(np.int32))
