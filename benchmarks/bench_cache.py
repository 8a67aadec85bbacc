"""pytest-benchmark: decode steps on PagedCache views vs mlx-lm's caches.

Run: pytest benchmarks/bench_cache.py --benchmark-only
Single-sequence decode vs KVCache; batched decode of 8 sequences of
200..4000 tokens vs BatchKVCache, paged views with and without paged
attention. The side-by-side table with ratios and gather throughput is
benchmarks/compare_cache.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from compare_cache import BLOCK, batch_kv_caches, prefill, tiny_llama
from mlx_lm.models.cache import KVCache

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


LENGTHS = np.linspace(200, 4000, 8).astype(int).tolist()


def test_batched_decode_mlx_lm_batchkvcache(benchmark, model):
    batch = batch_kv_caches(model, LENGTHS)
    y = mx.ones((len(LENGTHS), 1), dtype=mx.int32)
    mx.clear_cache()
    benchmark.pedantic(lambda: mx.eval(model(y, cache=batch)), rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("paged_attention", [True, False], ids=["paged", "gathered"])
def test_batched_decode_paged_views(benchmark, model, paged_attention):
    rounds = 20
    need = sum(-(-(n + rounds + 8) // BLOCK) for n in LENGTHS) + len(LENGTHS)
    pc = PagedCache.for_model(model, num_blocks=need, block_size=BLOCK,
                              paged_attention=paged_attention)
    ids = list(range(len(LENGTHS)))
    for i, n in zip(ids, LENGTHS):
        pc.allocate(i, np.random.default_rng(n).integers(0, 1000, n).tolist())
        prefill(model, pc.views([i]), n)
    y = mx.ones((len(ids), 1), dtype=mx.int32)

    def step():
        for i in ids:
            pc.append(i, [1])
        mx.eval(model(y, cache=pc.views(ids)))

    mx.clear_cache()
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=2)
