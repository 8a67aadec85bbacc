"""PagePool: in-place writes (no pool copy), batched page copies, gathers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from blockmgr.ops import CopyBlock
from cache import PagePool, PoolShape, copy_waves
from cache.page_pool import head_rows, page_rows
from tests.memory import peak_growth

H, D, BS = 4, 64, 16


def big_pool(num_blocks=2048):  # 2 x 33.5 MB
    return PagePool(PoolShape(num_blocks, BS, H, D, D, mx.float32))


def decode_write(pool, page=7, col=3):
    rows = mx.array(head_rows(np.array([page]), H, pool.shape.num_blocks)
                    .reshape(-1).astype(np.int32))
    cols = mx.full((H,), col, dtype=mx.int32)
    k, v = mx.random.normal((H, D)), mx.random.normal((H, D))
    mx.eval(rows, cols, k, v)

    def run():
        pool.write(rows, cols, k, v)
        mx.eval(pool.arrays())

    return run, k


def test_decode_write_does_not_copy_the_pool():
    pool = big_pool()
    run, k = decode_write(pool)
    run()  # warm up
    grown = peak_growth(run)
    assert grown < pool.nbytes // 8, f"write allocated {grown} bytes: the pool was copied"
    keys, _ = pool.arrays()
    np.testing.assert_array_equal(np.array(keys[mx.arange(H) * 2048 + 7, 3]), np.array(k))


def test_detector_sees_the_copy_an_extra_reference_causes():
    pool = big_pool()
    run, _ = decode_write(pool)
    run()
    alias = pool.arrays()[0].reshape(-1)  # a reshape kept elsewhere
    assert peak_growth(run) >= pool.shape.num_blocks * H * BS * D * 4
    del alias


def test_decode_step_write_then_gather_stays_in_place():
    """A view's step: scatter the new token, gather the history, one graph."""
    pool = big_pool()
    rows = page_rows(pool, list(range(64)))
    token = _one_token(pool)
    mx.eval(rows, *token)

    def step():
        pool.write(*token)
        k, v = pool.gather(rows, 1, 64 * BS)
        mx.eval(k, v)

    step()
    gathered = 2 * 64 * BS * H * D * 4
    assert peak_growth(step) < gathered + pool.nbytes // 8


def _one_token(pool):
    rows = mx.array(np.arange(H, dtype=np.int32) * pool.shape.num_blocks + 5)
    return rows, mx.zeros((H,), mx.int32), mx.ones((H, D)), mx.ones((H, D))


def test_gather_matches_numpy_layout():
    pool = PagePool(PoolShape(10, 4, 2, 3, 5, mx.float32))
    keys, values = pool.arrays()
    kref = np.random.default_rng(0).standard_normal((2 * 10, 4, 3)).astype(np.float32)
    pool.write_pages(mx.arange(20), mx.array(kref), mx.zeros((20, 4, 5)))
    pages = np.array([[3, 1], [9, 0]])
    rows = mx.array(head_rows(pages, 2, 10).reshape(-1).astype(np.int32))
    k, v = pool.gather(rows, 2, 8)
    assert k.shape == (2, 2, 8, 3) and v.shape == (2, 2, 8, 5)
    for b in range(2):
        for h in range(2):
            want = np.concatenate([kref[h * 10 + p] for p in pages[b]])
            np.testing.assert_array_equal(np.array(k[b, h]), want)


def test_copy_pages_batched_and_in_place():
    pool = big_pool()
    keys, _ = pool.arrays()
    src = page_rows(pool, [1, 2, 3])
    pool.write_pages(src, mx.ones((3 * H, BS, D)), mx.ones((3 * H, BS, D)))
    mx.eval(pool.arrays())
    dst = page_rows(pool, [10, 11, 12])
    del keys
    grown = peak_growth(lambda: (pool.copy_pages(src, dst), mx.eval(pool.arrays())))
    assert grown < pool.nbytes // 8
    k, _ = pool.read_pages(dst)
    assert mx.all(k == 1).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_pool_keeps_its_dtype(dtype):
    pool = PagePool(PoolShape(4, 2, 1, 8, 8, dtype))
    pool.write(mx.array([1]), mx.array([0]), mx.ones((1, 8), mx.float32), mx.ones((1, 8)))
    k, v = pool.gather(mx.array([1]), 1, 2)
    assert k.dtype == dtype and v.dtype == dtype and k[0, 0, 0, 0].item() == 1


def test_copy_waves_keep_call_order():
    assert copy_waves([CopyBlock(1, 2), CopyBlock(3, 4)]) == [([1, 3], [2, 4])]
    # read-after-write: 2 is written then read -> two batches
    assert copy_waves([CopyBlock(1, 2), CopyBlock(2, 5)]) == [([1], [2]), ([2], [5])]
    # write-after-write of the same page -> two batches, last write wins
    assert copy_waves([CopyBlock(1, 2), CopyBlock(3, 2)]) == [([1], [2]), ([3], [2])]
    # write-after-read is safe in one batch (reads happen first)
    assert copy_waves([CopyBlock(2, 7), CopyBlock(1, 2)]) == [([2, 1], [7, 2])]
    assert copy_waves([]) == []


def test_a_pool_of_zero_width_values_stores_keys_only():
    """An index cache (minimax_m3_vl) stores keys with values of width 0:
    every pool operation works on it (MLX cannot take from or reshape with
    -1 a zero-width array) and the keys round-trip like a numpy reference."""
    shape = PoolShape(num_blocks=6, block_size=4, n_kv_heads=1, k_head_dim=3, v_head_dim=0,
                      dtype=mx.float32)
    pool = PagePool(shape)
    keys = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    rows = page_rows(pool, [2, 2, 2, 2, 5, 5, 5, 5])
    cols = mx.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=mx.int32)
    pool.write(rows, cols, mx.array(keys), mx.zeros((8, 0)))
    k, v = pool.gather(page_rows(pool, [2, 5]), batch=1, length=8)
    mx.eval(k, v)
    np.testing.assert_array_equal(np.array(k).reshape(8, 3), keys)
    assert v.shape == (1, 1, 8, 0)
    pool.copy_pages(page_rows(pool, [2]), page_rows(pool, [0]))
    k, v = pool.run_view(0, 0, 4)
    mx.eval(k, v)
    np.testing.assert_array_equal(np.array(k).reshape(4, 3), keys[:4])
    assert v.shape == (1, 1, 4, 0)
