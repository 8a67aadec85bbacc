"""Attention straight from the page pool (no gathered history).

`update_and_fetch` must return a dense ``[B, H, T, D]`` history, and
gathering it copies every visible page once per layer and step. When the
model's attention call reaches the view (see `cache.attention_hook`), the
view computes attention page by page instead, with `mx.gather_mm` reading
the pool rows in place, and the gathered history is never evaluated.

Work is ragged: one "pair" per (row, kv head, page) the row can see (laid
out by `StepPlan.pair_index`, see `PairIndex`). Only real pages are read; a
batch padded to its longest row costs what its real tokens cost.

Per layer: one `gather_mm` for scores (``K_page @ q^T``), a float32 softmax
over each (b, h)'s pages (max and sum reduced through `pad`), one
`gather_mm` for ``p @ V_page`` and a padded sum. Cost: O(real keys * D)
reads of the pool plus O(pairs) small ops; no copy of the history.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from cache.step_plan import MASKED, PairIndex

# Steps with more queries than this (prefill chunks) gather the history and
# use the dense kernel: there the gather is small next to the compute.
PAGED_MAX_QUERIES = 16

#: Per device type: the padded K+V bytes of one layer's gathered history
#: below which gathering it for the model's kernel beats reading the pages
#: in place. On the CPU gathering wins up to 4 MiB and paged attention from
#: 8 MiB (`benchmarks/paged_or_gather.py`, BENCHMARKS.md "cache"). Device
#: types not listed are not measured: every batch is read in place there.
GATHER_BELOW_BYTES: dict[mx.DeviceType, int] = {mx.cpu: 6 * 2**20}


def gathers_faster(history_nbytes: int) -> bool:
    """Would gathering a padded history of `history_nbytes` (K+V, one layer)
    beat paged attention on the default device? O(1)."""
    limit = GATHER_BELOW_BYTES.get(mx.default_device().type)
    return limit is not None and history_nbytes < limit


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
    pairs = index.num_pairs
    # q^T per query group: [B*H, Dk, G*N]; scores per pair: [pairs, bs, G*N].
    q_t = (queries * scale).reshape(bsz * h, g * n, dk).swapaxes(1, 2)
    scores = mx.gather_mm(key_pool, q_t.astype(key_pool.dtype), index.rows, index.bh)
    scores = scores.astype(mx.float32).reshape(pairs, bs, g, n) + index.mask
    scores = scores.reshape(pairs, bs, g * n)
    top = per_group(scores.max(axis=1), index, MASKED).max(axis=1)  # [B*H, G*N]
    weights = mx.exp(scores - mx.take(top, index.bh, axis=0)[:, None, :])
    total = per_group(weights.sum(axis=1), index, 0.0).sum(axis=1)  # [B*H, G*N]
    parts = mx.gather_mm(
        weights.swapaxes(1, 2).astype(value_pool.dtype), value_pool, None, index.rows
    )  # [pairs, G*N, Dv]
    out = per_group(parts.astype(mx.float32), index, 0.0).sum(axis=1) / total[..., None]
    return out.reshape(bsz, h, g, n, dv).reshape(bsz, hq, n, dv).astype(queries.dtype)


def per_group(x: mx.array, index: PairIndex, fill: float) -> mx.array:
    """Per-pair `x` ``[pairs, ...]`` laid out as ``[B*H, P, ...]`` (missing
    pages filled with `fill`), for reductions over each group's pages."""
    filler = mx.full((1, *x.shape[1:]), fill, dtype=x.dtype)
    padded = mx.take(mx.concatenate([x, filler]), index.pad, axis=0)
    return padded.reshape(-1, index.max_pages, *x.shape[1:])
