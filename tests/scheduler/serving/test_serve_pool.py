"""`--kv-memory` sizing (`scheduler.serving.serve.size_pool`): a hybrid model's
recurrent slots come off the budget first, pages take the rest.

The reference bytes are mlx-lm's own caches after a one-token forward: the
`ArraysCache` states (one slot) and the `KVCache` keys and values of one
token, times the page size (one page).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from blockmgr.errors import InvalidArgument
from scheduler.engine.engine import Engine
from scheduler.serving.serve import size_pool
from tests.tiny_models import built

BLOCK = 8
MAX_SEQS = 4


def reference_bytes(model, block_size: int) -> tuple[int, int]:
    """(one slot, one page) from mlx-lm's caches of a one-token forward."""
    caches = model.make_cache()
    mx.eval(model(mx.array([[1]], dtype=mx.int32), cache=caches))
    slot = page = 0
    for cache in caches:
        if isinstance(cache, ArraysCache):
            slot += sum(a.nbytes for a in cache.cache if a is not None)
        else:
            assert isinstance(cache, KVCache)
            assert cache.offset == 1
            keys, values = cache.keys[..., :1, :], cache.values[..., :1, :]
            page += (keys.nbytes + values.nbytes) * block_size
    return slot, page


@pytest.mark.parametrize("name, hybrid", [("lfm2", True), ("qwen3_next", True), ("llama", False)])
def test_the_budget_covers_slots_then_pages(name, hybrid):
    model = built(name)
    slot, page = reference_bytes(model, BLOCK)
    assert (slot > 0) == hybrid
    num_slots = 2 * MAX_SEQS + 2 if hybrid else 0  # the engine's default
    budget = num_slots * slot + 37 * page + page // 2
    size = size_pool(model, budget, BLOCK, MAX_SEQS)
    assert (size.num_slots, size.num_blocks) == (num_slots, 37)
    assert (size.slot_bytes, size.page_bytes) == (slot, page)
    assert size.nbytes <= budget < size.nbytes + page
    engine = Engine(model, num_blocks=size.num_blocks, block_size=BLOCK,
                    num_slots=size.num_slots or None, max_num_seqs=MAX_SEQS)
    assert engine.cache.block_manager.config.num_slots == num_slots
    assert engine.cache.block_manager.config.num_blocks == 37


def test_a_budget_below_the_slots_and_one_page_is_refused():
    model = built("lfm2")
    slot, page = reference_bytes(model, BLOCK)
    need = (2 * MAX_SEQS + 2) * slot + page
    with pytest.raises(InvalidArgument, match=f"at least {need} bytes"):
        size_pool(model, need - 1, BLOCK, MAX_SEQS)
    assert size_pool(model, need, BLOCK, MAX_SEQS).num_blocks == 1
