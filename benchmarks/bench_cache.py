"""pytest-benchmark: decode step on PagedCache views vs mlx-lm KVCache.

Run: pytest benchmarks/bench_cache.py --benchmark-only
(the side-by-side table with batched decode and gather throughput is
benchmarks/compare_cache.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from compare_cache import BLOCK, prefill, tiny_llama
from cache import PagedCache

CTX = [1024, 4096]


@pytest.fixture(scope="module")
def model():
    mx.set_cache_limit(1 << 30)
    return tiny_llama()


@pytest.mark.parametrize("ctx", CTX)
def test_decode_mlx_lm_kvcache(benchmark, model, ctx):
    cache = [KVCache() for _ in model.layers]
    prefill(model, cache, ctx)
    y = mx.array([[1]])
    benchmark(lambda: mx.eval(model(y, cache=cache)))


@pytest.mark.parametrize("ctx", CTX)
def test_decode_paged_views(benchmark, model, ctx):
    pc = PagedCache.for_model(model, num_blocks=ctx // BLOCK + 256, block_size=BLOCK)
    pc.allocate("a", np.random.default_rng(ctx).integers(0, 1000, ctx).tolist())
    prefill(model, pc.views(["a"]), ctx)
    y = mx.array([[1]])

    def step():
        pc.append("a", [1])
        mx.eval(model(y, cache=pc.views(["a"])))

    benchmark.pedantic(step, rounds=100, warmup_rounds=3)
