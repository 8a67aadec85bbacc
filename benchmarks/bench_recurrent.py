"""Recurrent slot storage: CopySlot, batch gather/scatter, hybrid decode step.

Run: python -m pytest benchmarks/bench_recurrent.py --benchmark-columns=min,median,mean,rounds

Layer shapes are those of real checkpoints, float32 (the CPU backend
emulates float16):

* qwen3_next: Qwen3-Next-80B-A3B linear-attention layer: conv tail
  [3, 8192] and delta state [32, 128, 128] (2 MiB + 96 KiB per slot);
  36 of its 48 layers are recurrent.
* lfm2: LFM2-1.2B short-conv layer: conv tail [2, 2048] (16 KiB per slot);
  10 of its 16 layers are recurrent.

Each timed call includes the evaluation (work done, not just graph built).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from blockmgr.ops import CopySlot, ZeroSlot
from recurrent import ArraySpec, RecurrentPools, RecurrentView, StatePool, make_batch

F32 = mx.float32
LAYERS = {
    "qwen3_next": ([ArraySpec((3, 8192), F32), ArraySpec((32, 128, 128), F32)], 36),
    "lfm2": ([ArraySpec((2, 2048), F32)], 10),
}
BATCH = 32
NUM_SLOTS = 64


@pytest.fixture(params=["cache32MiB", "cache1GiB"])
def buffer_cache(request):
    """MLX's buffer-cache limit (32 MiB by default here).

    Above it, every fresh buffer is new memory from the OS and pays its page
    faults on first touch: a 64 MiB gather is ~7x slower than with buffers
    recycled from the cache.
    """
    limit = 32 << 20 if request.param == "cache32MiB" else 1 << 30
    old = mx.set_cache_limit(limit)
    yield
    mx.set_cache_limit(old)
    mx.clear_cache()


@pytest.fixture(params=sorted(LAYERS))
def layer_pool(request, buffer_cache):
    specs, _ = LAYERS[request.param]
    return StatePool(NUM_SLOTS, len(specs), specs)


def test_copy_slot_one_layer(benchmark, layer_pool):
    pairs = [(s, s + NUM_SLOTS // 2) for s in range(NUM_SLOTS // 2)]
    it = iter(range(10**9))

    def copy():
        src, dst = pairs[next(it) % len(pairs)]
        layer_pool.apply_plan([CopySlot(src, dst)])
        layer_pool.flush()

    benchmark(copy)


@pytest.mark.parametrize("model", sorted(LAYERS))
def test_copy_slot_whole_model(benchmark, model, buffer_cache):
    specs, num_layers = LAYERS[model]
    pools = RecurrentPools(8, {i: len(specs) for i in range(num_layers)},
                           {i: specs for i in range(num_layers)})

    def copy():
        pools.apply_plan([CopySlot(1, 2), ZeroSlot(3)])
        pools.flush()

    benchmark(copy)


def _batch(seed: int):
    return make_batch(random.Random(seed).sample(range(NUM_SLOTS), BATCH), None, NUM_SLOTS)


def test_gather_batch32_one_layer(benchmark, layer_pool):
    batch = _batch(0)

    def gather():
        view = RecurrentView(layer_pool, batch)
        mx.eval([a for a in view.state if a is not None])

    benchmark(gather)


def test_scatter_batch32_one_layer(benchmark, layer_pool):
    """Writing a batch's new state back (values already computed)."""
    batch = _batch(1)
    values = [mx.ones((BATCH, *layer_pool.spec(i).shape)) for i in range(layer_pool.num_arrays)]
    mx.eval(values)

    def scatter():
        view = RecurrentView(layer_pool, batch)
        for i, a in enumerate(values):
            view[i] = a
        view.commit()
        layer_pool.flush()  # in place: nothing else holds the pool arrays

    benchmark(scatter)


def test_copy_same_bytes_reference(benchmark, buffer_cache):
    """Reference: a plain copy of one batch's Qwen3-Next state (64 MiB + 3 MiB)."""
    src = [mx.ones((BATCH, 3, 8192)), mx.ones((BATCH, 32, 128, 128))]
    mx.eval(src)
    benchmark(lambda: mx.eval([mx.array(a * 1) for a in src]))


# ---- decode step of a tiny hybrid model: slot views vs mlx-lm's own caches ------------


def _tiny(name: str):
    from tests.recurrent.test_recurrent_models import MODELS  # the tiny test models

    model = MODELS[name]()
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("name", ["lfm2", "qwen3_next"])
@pytest.mark.parametrize("storage", ["mlx_lm", "slots"])
def test_tiny_decode_step(benchmark, name, storage):
    """One decode token, batch of 1, after a 64-token prompt.

    Attention layers use mlx-lm KVCaches in both rows; only the recurrent
    layers' storage differs.
    """
    from mlx_lm.models.cache import KVCache

    model = _tiny(name)
    prompt = mx.array([list(range(1, 65))])
    cache = model.make_cache()
    pools = None
    if storage == "slots":
        pools = RecurrentPools.for_model(model, num_slots=8)
        cache = [None if i in pools else KVCache() for i in range(len(model.layers))]

    views: dict = {}

    def caches():
        if pools is None:
            return cache
        views.clear()
        views.update(pools.views([5]))
        return [views.get(i) or cache[i] for i in range(len(cache))]

    def commit():
        for view in views.values():
            view.commit()

    mx.eval(model(prompt, cache=caches()))
    commit()
    token = mx.array([[7]])

    def step():
        logits = model(token, cache=caches())
        mx.eval(logits)
        if pools is not None:
            commit()
            pools.flush()
        for c in cache:  # keep the attention history fixed between rounds
            if isinstance(c, KVCache):
                c.trim(1)

    benchmark(step)
