"""Index and mask planning for one forward step of one page group.

Pure bookkeeping on numpy (no pool access): which (page, row) each new token
goes to, which pages each sequence gathers, the attention mask, and the
(row, head, page) pairs `cache.paged_attention` reads. Built
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

# Masked scores: finite (so a query row with no visible key, which only
# padding rows can have, gives a finite mean instead of NaN) and far below
# any real score once the softmax runs in float32.
MASKED = -1e30


@dataclass(frozen=True, slots=True)
class PairIndex:
    """Ragged (row, head, page) pairs of one step for one kv-head count, for
    `cache.paged_attention`. Pairs are ordered row b, then head h, then page j:

        pair k:  rows[k] = h * num_blocks + page[b, j]   (pool row, head-major)
                 bh[k]   = b * H + h                     (query group)
        pad[bh * P + j] = k, or num_pairs where row b has no page j, which
        indexes one extra row appended to a per-pair tensor (zeros or MASKED)
        so that per-(b, h) reductions become a take + reshape + reduce.
    """

    num_pairs: int
    n_kv_heads: int
    max_pages: int  # P: most pages any row sees
    rows: mx.array  # [num_pairs] int32 head-major pool rows
    bh: mx.array  # [num_pairs] int32 query group b * H + h
    pad: mx.array  # [B * H * P] int32 pair of (bh, j), num_pairs if none
    mask: mx.array  # [num_pairs, block_size, 1, N] float32, 0 visible / MASKED


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
    pages: np.ndarray  # [B, P] int32 gathered pages (padding columns point at page 0)
    base: np.ndarray  # [B] absolute position of gathered column 0
    valid: np.ndarray  # [B] gathered columns that hold real pages
    write_pages: np.ndarray  # [B, N] int32 page of each new token (-1 in padded slots)
    write_cols: np.ndarray  # [B, N] int32 row inside the page
    _index: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.offsets)

    @property
    def dense(self) -> bool:
        """Every row has `num_queries` new tokens (no padded query rows)."""
        return all(n == self.num_queries for n in self.n_new)

    @property
    def exact(self) -> bool:
        return self.batch == 1 and self.n_new[0] == self.num_queries

    @property
    def length(self) -> int:
        """T: gathered history length (columns), before any exact slicing."""
        return self.pages.shape[1] * self.block_size

    @property
    def first_run_page(self) -> int | None:
        """Exact mode: the first gathered page when the gathered pages are
        consecutive ids (a fresh pool hands a lone sequence such runs), so
        the history is a strided view of the pool; else None. O(P) once per
        step (cached)."""
        if "run" not in self._index:
            self._index["run"] = self._find_run()
        return self._index["run"]

    def _find_run(self) -> int | None:
        if not self.exact:
            return None
        row = self.pages[0]
        first = int(row[0])
        return first if int(row[-1]) - first == len(row) - 1 and (np.diff(row) == 1).all() else None

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
        pages, cols = self.write_pages, self.write_cols  # [B, N] int32
        rows = head_rows(pages, h, self.num_blocks)  # [B, H, N]
        cols = cols[:, None, :] + np.zeros((1, h, 1), dtype=cols.dtype)  # [B, H, N]
        if self.dense:
            return None, mx.array(rows.ravel()), mx.array(cols.ravel())
        b, j = np.nonzero(pages >= 0)  # real tokens only
        n = self.num_queries
        src = (b[:, None] * h + np.arange(h)[None]) * n + j[:, None]  # [M, H]
        return _i32(src), _i32(rows[b, :, j]), _i32(cols[b, :, j])

    def gather_rows(self, n_kv_heads: int) -> mx.array:
        """Head-major pool rows of the gathered pages, ``[B * H * P]``."""
        key = ("g", n_kv_heads)
        if key not in self._index:
            self._index[key] = mx.array(head_rows(self.pages, n_kv_heads, self.num_blocks).ravel())
        return self._index[key]

    def pair_index(self, n_kv_heads: int) -> PairIndex:
        """The step's (row, head, page) pairs and their masks (cached).

        O(pairs * block_size * N) numpy work, once per step, shared by every
        layer with `n_kv_heads`."""
        key = ("p", n_kv_heads)
        if key not in self._index:
            self._index[key] = self._build_pair_index(n_kv_heads)
        return self._index[key]

    def _build_pair_index(self, h: int) -> PairIndex:
        bsz, width = self.pages.shape
        bs = self.block_size
        counts = (self.valid // bs).astype(np.int64)  # real pages per row
        per_row = counts * h
        num_pairs = int(per_row.sum())
        b = np.repeat(np.arange(bsz), per_row)
        within = np.arange(num_pairs) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        head = within // counts[b]
        j = within % counts[b]
        rows = head * self.num_blocks + self.pages[b, j]
        bh = b * h + head
        pad = np.full(bsz * h * width, num_pairs, dtype=np.int64)
        pad[bh * width + j] = np.arange(num_pairs)
        keys = (self.base[b] + j * bs)[:, None] + np.arange(bs)[None]  # [pairs, bs]
        offsets = np.asarray(self.offsets, dtype=np.int64)
        queries = offsets[b][:, None] + np.arange(self.num_queries)[None]  # [pairs, N]
        visible = keys[:, :, None] <= queries[:, None, :]
        if self.window is not None:
            visible &= keys[:, :, None] > queries[:, None, :] - self.window
        mask = np.where(visible, 0.0, MASKED).astype(np.float32)[:, :, None, :]
        return PairIndex(num_pairs, h, width, _i32(rows), _i32(bh), _i32(pad), mx.array(mask))

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
    starts, stops, rows, write_pages, write_cols = [], [], [], [], []
    for b, (table, off, n) in enumerate(zip(tables, offsets, n_new)):
        end = off + n
        if end < 1:
            raise InvalidArgument(f"row {b} has no tokens to attend to")
        first = 0 if window is None else max(0, off - window + 1) // block_size
        stop = (end - 1) // block_size + 1
        row = table[first:stop]
        if len(row) < stop - first or None in row:
            raise InvalidArgument(f"row {b}: a page this step needs is missing or released")
        starts.append(first)
        stops.append(stop)
        rows.append(row)
        padding = num_queries - n
        write_pages.append([table[p // block_size] for p in range(off, end)] + [-1] * padding)
        write_cols.append([p % block_size for p in range(off, end)] + [0] * padding)
    width = max(map(len, rows))
    pages = np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)
    starts_np, stops_np = np.array(starts), np.array(stops)
    return StepPlan(
        list(offsets), list(n_new), num_queries, block_size, num_blocks, window,
        pages, starts_np * block_size, (stops_np - starts_np) * block_size,
        np.array(write_pages, dtype=np.int32), np.array(write_cols, dtype=np.int32),
    )


def head_rows(pages: np.ndarray, n_kv_heads: int, num_blocks: int) -> np.ndarray:
    """Head-major pool rows for `pages` (any shape ``[..., P]``).

    Returns ``[..., n_kv_heads, P]`` with ``rows[..., h, j] = h * num_blocks
    + pages[..., j]``, i.e. the order `PagePool.gather` expects once flattened,
    in the pages' integer dtype.
    """
    heads = np.arange(n_kv_heads, dtype=pages.dtype)[:, None] * num_blocks
    return heads + pages[..., None, :]


def _i32(x: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(x).reshape(-1).astype(np.int32))
