"""Attention straight from the page pool (no gathered history).

`update_and_fetch` must return a dense ``[B, H, T, D]`` history, and
gathering it copies every visible page once per layer and step. When the
model's attention call reaches the view (see `cache.attention_hook`), the
view computes attention page by page instead, with `mx.gather_mm` reading
the pool rows in place, and the gathered history is never evaluated.

Work is ragged: one "pair" per (row b, kv head h, page j) the row can see,
ordered b, then h, then j. Only real pages are read; a batch padded to its
longest row costs what its real tokens cost.

    pair k:  rows[k] = h * num_blocks + page[b, j]   (pool row, head-major)
             bh[k]   = b * H + h                     (query group)
    pad[bh * P + j] = k, or num_pairs where row b has no page j, which
    indexes one extra row appended to a per-pair tensor (zeros or -1e30)
    so that per-(b, h) reductions become a take + reshape + reduce.

Per layer: one `gather_mm` for scores (``K_page @ q^T``), a float32 softmax
over each (b, h)'s pages (max and sum reduced through `pad`), one
`gather_mm` for ``p @ V_page`` and a padded sum. Cost: O(real keys * D)
reads of the pool plus O(pairs) small ops; no copy of the history.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# Masked scores: finite (so a query row with no visible key, which only
# padding rows can have, gives a finite mean instead of NaN) and far below
# any real score once the softmax runs in float32.
_MASKED = -1e30


def supports(dtype: mx.Dtype) -> bool:
    """Whether `paged_attention` runs on pools of `dtype` on the default
    device (MLX's CPU `gather_mm` is float32-only). Probed once per
    (device, dtype) with a 1x1 product."""
    return _probe(str(mx.default_device()), dtype)


@functools.cache
def _probe(device: str, dtype: mx.Dtype) -> bool:
    one = mx.ones((1, 1, 1), dtype=dtype)
    try:
        mx.eval(mx.gather_mm(one, one, None, mx.zeros((1,), dtype=mx.uint32)))
    except (RuntimeError, ValueError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class PairIndex:
    """Ragged (row, head, page) pairs of one step for one kv-head count."""

    num_pairs: int
    n_kv_heads: int
    max_pages: int  # P: most pages any row sees
    rows: mx.array  # [num_pairs] int32 head-major pool rows
    bh: mx.array  # [num_pairs] int32 query group b * H + h
    pad: mx.array  # [B * H * P] int32 pair of (bh, j), num_pairs if none
    mask: mx.array  # [num_pairs, block_size, 1, N] float32, 0 visible / _MASKED


def pair_index(
    pages: np.ndarray,
    num_pages: np.ndarray,
    base: np.ndarray,
    offsets: np.ndarray,
    num_queries: int,
    block_size: int,
    num_blocks: int,
    n_kv_heads: int,
    window: int | None,
) -> PairIndex:
    """Build the pairs of a step: `pages` ``[B, P]`` (row b's first
    `num_pages[b]` are real, column 0 at absolute position `base[b]`), queries
    of row b at positions ``offsets[b] + [0, num_queries)``. O(pairs * bs * N)
    numpy work, once per step, shared by every layer with `n_kv_heads`."""
    bsz, width = pages.shape
    h = n_kv_heads
    counts = num_pages.astype(np.int64)
    per_row = counts * h
    num_pairs = int(per_row.sum())
    b = np.repeat(np.arange(bsz), per_row)
    within = np.arange(num_pairs) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    head = within // counts[b]
    j = within % counts[b]
    rows = head * num_blocks + pages[b, j]
    bh = b * h + head
    pad = np.full(bsz * h * width, num_pairs, dtype=np.int64)
    pad[bh * width + j] = np.arange(num_pairs)
    keys = (base[b] + j * block_size)[:, None] + np.arange(block_size)[None]  # [pairs, bs]
    queries = offsets[b][:, None] + np.arange(num_queries)[None]  # [pairs, N]
    visible = keys[:, :, None] <= queries[:, None, :]
    if window is not None:
        visible &= keys[:, :, None] > queries[:, None, :] - window
    mask = np.where(visible, 0.0, _MASKED).astype(np.float32)[:, :, None, :]
    return PairIndex(num_pairs, h, width, _i32(rows), _i32(bh), _i32(pad), mx.array(mask))


def paged_attention(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    index: PairIndex,
    scale: float,
) -> mx.array:
    """Attention of `queries` ``[B, Hq, N, Dk]`` over the pages of `index`.

    `key_pool` / `value_pool` are a layer's head-major pools
    ``[H * num_blocks, block_size, D]`` (read in place). Hq may be a multiple
    of H (grouped-query attention). Returns ``[B, Hq, N, Dv]`` in the
    queries' dtype; the softmax runs in float32.
    """
    bsz, hq, n, dk = queries.shape
    h = index.n_kv_heads
    g = hq // h
    bs, dv = value_pool.shape[1], value_pool.shape[2]
    pairs, width = index.num_pairs, index.max_pages
    # q^T per query group: [B*H, Dk, G*N]; scores per pair: [pairs, bs, G*N].
    q_t = (queries * scale).reshape(bsz * h, g * n, dk).swapaxes(1, 2)
    scores = mx.gather_mm(key_pool, q_t.astype(key_pool.dtype), index.rows, index.bh)
    scores = scores.astype(mx.float32).reshape(pairs, bs, g, n) + index.mask
    scores = scores.reshape(pairs, bs, g * n)
    top = _per_group(scores.max(axis=1), index, _MASKED).max(axis=1)  # [B*H, G*N]
    weights = mx.exp(scores - mx.take(top, index.bh, axis=0)[:, None, :])
    total = _per_group(weights.sum(axis=1), index, 0.0).sum(axis=1)  # [B*H, G*N]
    parts = mx.gather_mm(
        weights.swapaxes(1, 2).astype(value_pool.dtype), value_pool, None, index.rows
    )  # [pairs, G*N, Dv]
    out = _per_group(parts.astype(mx.float32), index, 0.0).sum(axis=1) / total[..., None]
    return out.reshape(bsz, h, g, n, dv).reshape(bsz, hq, n, dv).astype(queries.dtype)


def _per_group(x: mx.array, index: PairIndex, fill: float) -> mx.array:
    """Per-pair `x` ``[pairs, ...]`` laid out as ``[B*H, P, ...]`` (missing
    pages filled with `fill`), for reductions over each group's pages."""
    filler = mx.full((1, *x.shape[1:]), fill, dtype=x.dtype)
    padded = mx.take(mx.concatenate([x, filler]), index.pad, axis=0)
    return padded.reshape(-1, index.max_pages, *x.shape[1:])


def _i32(x: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(x).reshape(-1).astype(np.int32))
