"""Preemption by swap on PagedCache: out to host memory, back in, continue.

References are the same models on mlx-lm's own caches, never swapped.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from blockmgr.errors import OutOfHostMemory, SequenceSwapped
from cache import PagedCache
from cache.host_pool import HostPagePool
from cache.page_pool import PagePool, PoolShape
from tests.cache.test_cache_models import get as get_attention
from tests.cache.test_hybrid_paged import get as get_hybrid
from tests.cache.test_hybrid_paged import reference

TOL = 1e-4


def build(name):
    return get_hybrid(name) if name in ("lfm2", "qwen3_next") else get_attention(name)


def paged(model, name, num_slots=1, **kwargs):
    hybrid = name in ("lfm2", "qwen3_next")
    return PagedCache.for_model(
        model, num_blocks=12, block_size=8,
        num_slots=num_slots if hybrid else 0, num_host_slots=2 if hybrid else 0, **kwargs,
    )


def toks(seed, n, vocab=61):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def step(pc, model, seq_id, chunk):
    return np.array(model(mx.array([chunk]), cache=pc.views([seq_id]))[0])


def decode(pc, model, seq_id, chunk):
    out = []
    for t in chunk:
        pc.append(seq_id, [t])
        out.append(step(pc, model, seq_id, [t]))
    return np.concatenate(out)


@pytest.mark.parametrize("name", ["llama", "sliding", "lfm2", "qwen3_next"])
def test_swap_out_in_then_continue_equals_never_swapping(name):
    model = build(name)
    prompt, cont, other = toks(1, 37), toks(2, 5), toks(3, 90)
    pc = paged(model, name, num_host_blocks=8)
    pc.allocate("a", prompt)
    step(pc, model, "a", prompt)
    decode(pc, model, "a", cont[:2])
    assert pc.can_swap_out("a")
    old_pages, old_slot = pc.block_table("a"), pc.block_manager.slot("a")
    pc.swap_out("a")
    assert pc.is_swapped("a") and pc.can_swap_in("a")
    with pytest.raises(SequenceSwapped):
        pc.views(["a"])
    # Another sequence takes (and overwrites) the device pages and slot "a" left.
    pc.allocate("b", other)  # all 12 pages (and the only slot)
    assert set(old_pages) <= set(pc.block_table("b"))
    assert pc.block_manager.slot("b") == old_slot
    step(pc, model, "b", other)
    pc.free("b")
    pc.block_manager.reset_prefix_cache()
    pc.swap_in("a")
    assert not pc.is_swapped("a")
    got = decode(pc, model, "a", cont[2:])
    want = reference(model, prompt + cont)[-3:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    pc.check_integrity()


def test_swap_out_without_host_space_changes_nothing():
    model = build("lfm2")
    pc = paged(model, "lfm2", num_host_blocks=2)  # 5 pages needed
    prompt = toks(4, 37)
    pc.allocate("a", prompt)
    step(pc, model, "a", prompt)
    before = pc.block_table("a")
    assert not pc.can_swap_out("a")
    with pytest.raises(OutOfHostMemory):
        pc.swap_out("a")
    assert pc.block_table("a") == before and not pc.is_swapped("a")
    np.testing.assert_allclose(decode(pc, model, "a", [3]), reference(model, prompt + [3])[-1:],
                               atol=TOL, rtol=0)


def test_swapped_forks_keep_their_own_continuations():
    model = build("qwen3_next")
    prompt, ca, cb = toks(5, 21), toks(6, 3), toks(7, 3)
    pc = paged(model, "qwen3_next", num_slots=3, num_host_blocks=8)
    pc.allocate("a", prompt)
    step(pc, model, "a", prompt)
    pc.fork("a", "b")  # shares pages and slot
    pc.swap_out("a")
    pc.swap_out("b")
    pc.flush()
    pc.swap_in("b")
    pc.swap_in("a")
    got_a, got_b = decode(pc, model, "a", ca), decode(pc, model, "b", cb)
    np.testing.assert_allclose(got_a, reference(model, prompt + ca)[-3:], atol=TOL, rtol=0)
    np.testing.assert_allclose(got_b, reference(model, prompt + cb)[-3:], atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_host_pages_round_trip_bit_for_bit(dtype):
    shape = PoolShape(num_blocks=6, block_size=4, n_kv_heads=2, k_head_dim=8, v_head_dim=4,
                      dtype=dtype)
    pool = PagePool(shape)
    k = mx.random.normal((2 * 3, 4, 8)).astype(dtype)
    v = mx.random.normal((2 * 3, 4, 4)).astype(dtype)
    rows = mx.array([0 * 6 + 1, 0 * 6 + 4, 0 * 6 + 5, 1 * 6 + 1, 1 * 6 + 4, 1 * 6 + 5])
    pool.write_pages(rows, k, v)
    host = HostPagePool(3)
    host.swap_out(pool, [1, 4, 5], [2, 0, 1])
    pool.write_pages(rows, mx.zeros_like(k), mx.zeros_like(v))
    host.swap_in(pool, [2, 0, 1], [1, 4, 5])
    got_k, got_v = pool.read_pages(rows)
    assert mx.array_equal(got_k, k).item() and mx.array_equal(got_v, v).item()
    assert got_k.dtype == dtype
