"""Attention over affine-quantized pages with quantized matmuls.

A quantized pool (`QuantizedPagePool`) can always hand the model a
dequantized history (any model, any kernel, sinks included); these kernels
skip that dequantization where it pays:

* `quantized_sdpa`: mlx-lm's ``quantized_scaled_dot_product_attention`` over
  a dense packed history ``[B, H, T, *]`` (one row's exact pages), keys and
  values each with their own bits: scores by ``quantized_matmul(q, K^T)``,
  a precise softmax, then ``quantized_matmul(p, V)``.
* `paged_quantized_attention`: the ragged (row, kv head, page) pairs of
  `paged_attention`, with `gather_qmm` reading the packed pool rows in
  place: nothing is gathered or dequantized.

When they pay (`use_quantized_matmul`, measured in design/cache.md): on the
CPU quantized matmuls win for a few queries only (decode, short speculative
verification steps), and only in float32 (half precision ran 3-4x slower
than dequantize-then-attend).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from blockmgr.errors import IntegrityError
from cache.paged_attention import per_group
from cache.step_plan import MASKED, PairIndex

#: Most queries per step quantized matmuls serve, for one row and for a
#: batch (`paged_quantized_attention`): past that the CPU's quantized
#: matmul loses to dequantize + the fused kernel. Measured, one layer of
#: Qwen3-0.6B's shape, quantized / dequantized time (BENCHMARKS.md, "kv
#: quantization"): one row at 4k context 0.40 (1 query), 0.41 (2), 0.58-0.98
#: (4), 1.32 (8); 8 rows of 200..4000: 0.14 (1), 0.20 (2), 0.49 (4), 0.66
#: (8), 1.59 (16).
ONE_ROW_MAX_QUERIES = 2
BATCH_MAX_QUERIES = 8


def use_quantized_matmul(dtype: mx.Dtype, num_queries: int, batch: int) -> bool:
    """Whether quantized matmuls beat dequantizing the history for a step of
    `batch` rows of `num_queries` queries on pools of `dtype` on the default
    device. On the CPU only float32 (half precision quantized matmuls ran
    3-4x slower than dequantize-then-attend); elsewhere mlx-lm's choice."""
    limit = ONE_ROW_MAX_QUERIES if batch == 1 else BATCH_MAX_QUERIES
    if num_queries > limit:
        return False
    return dtype == mx.float32 or mx.default_device().type != mx.cpu


def supports_gather_qmm(dtype: mx.Dtype) -> bool:
    """Whether the device's `gather_qmm` runs on `dtype` (probed once per
    device and dtype with a one-group product)."""
    return _probe(str(mx.default_device()), dtype)


@functools.cache
def _probe(device: str, dtype: mx.Dtype) -> bool:
    w = mx.quantize(mx.ones((1, 1, 32), dtype=dtype), 32, 8)
    x = mx.ones((1, 1, 32), dtype=dtype)
    try:
        mx.eval(mx.gather_qmm(x, *w, rhs_indices=mx.zeros((1,), dtype=mx.uint32),
                              transpose=True, group_size=32, bits=8))
    except (RuntimeError, ValueError):
        return False
    return True


Packed = tuple[mx.array, mx.array, mx.array]
"""One side's quantized rows: packed values, scales, biases (`mx.quantize`)."""


def packed(parts: tuple[mx.array, ...]) -> Packed:
    """`parts` as the three arrays of an affine-quantized side."""
    if len(parts) != 3:
        raise IntegrityError(f"a quantized side has 3 parts, got {len(parts)}")
    return parts[0], parts[1], parts[2]


def _head_groups(parts: Packed) -> Packed:
    """Each part with an axis for the query heads sharing a KV head."""
    return (mx.expand_dims(parts[0], -3), mx.expand_dims(parts[1], -3),
            mx.expand_dims(parts[2], -3))


def quantized_sdpa(
    queries: mx.array,
    key_parts: Packed,
    value_parts: Packed,
    scale: float,
    mask,
    group_size: int,
    key_bits: int,
    value_bits: int,
) -> mx.array:
    """Attention of `queries` ``[B, Hq, N, Dk]`` over packed keys and values
    ``[B, H, T, *]`` (packed values, scales, biases), as mlx-lm's quantized
    SDPA computes it. `mask`: None, "causal" (the last N keys are the
    queries'), or an array over the T keys (bool: visible; else added).
    Returns ``[B, Hq, N, Dv]`` in the queries' dtype. Cost: O(B Hq N T D)
    quantized multiply-adds, no dequantized history."""
    bsz, hq, n, dk = queries.shape
    h = key_parts[0].shape[-3]
    g = hq // h
    q = queries * scale
    if g > 1:
        q = q.reshape(bsz, h, g, n, dk)
        key_parts = _head_groups(key_parts)
        value_parts = _head_groups(value_parts)
    scores = mx.quantized_matmul(q, *key_parts, transpose=True, group_size=group_size,
                                 bits=key_bits)
    if mask is not None:
        if isinstance(mask, str):
            num_keys = scores.shape[-1]
            mask = mx.arange(num_keys - n, num_keys)[:, None] >= mx.arange(num_keys)[None]
        if g > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *value_parts, transpose=False, group_size=group_size,
                              bits=value_bits)
    return out.reshape(bsz, hq, n, out.shape[-1])


def paged_quantized_attention(
    queries: mx.array,
    key_parts: Packed,
    value_parts: Packed,
    index: PairIndex,
    scale: float,
    group_size: int,
    key_bits: int,
    value_bits: int,
) -> mx.array:
    """`paged_attention` over quantized head-major pools (packed values,
    scales, biases, each ``[H * num_blocks, block_size, *]``, read in place
    by `gather_qmm`). Per pair: scores ``q K_page^T`` (``[pairs, G*N, bs]``),
    a float32 softmax over each (row, head)'s pages, then ``p V_page``.
    Returns ``[B, Hq, N, Dv]`` in the queries' dtype. Cost: O(real keys * D)
    reads of packed rows plus O(pairs) small ops."""
    bsz, hq, n, dk = queries.shape
    h = index.n_kv_heads
    g = hq // h
    pairs = index.num_pairs
    dtype = key_parts[1].dtype  # the scales': the dtype of the multiply
    q = (queries * scale).reshape(bsz * h, g * n, dk).astype(dtype)
    scores = mx.gather_qmm(q, *key_parts, lhs_indices=index.bh, rhs_indices=index.rows,
                           transpose=True, group_size=group_size, bits=key_bits)
    bs = scores.shape[-1]
    mask = index.mask.transpose(0, 2, 3, 1)  # [pairs, 1, N, bs]
    scores = (scores.astype(mx.float32).reshape(pairs, g, n, bs) + mask).reshape(pairs, g * n, bs)
    top = per_group(scores.max(axis=2), index, MASKED).max(axis=1)  # [B*H, G*N]
    weights = mx.exp(scores - mx.take(top, index.bh, axis=0)[:, :, None])
    total = per_group(weights.sum(axis=2), index, 0.0).sum(axis=1)  # [B*H, G*N]
    parts = mx.gather_qmm(weights.astype(value_parts[1].dtype), *value_parts,
                          rhs_indices=index.rows, transpose=False, group_size=group_size,
                          bits=value_bits)  # [pairs, G*N, Dv]
    dv = parts.shape[-1]
    out = per_group(parts.astype(mx.float32), index, 0.0).sum(axis=1) / total[..., None]
    return out.reshape(bsz, h, g, n, dv).reshape(bsz, hq, n, dv).astype(queries.dtype)
