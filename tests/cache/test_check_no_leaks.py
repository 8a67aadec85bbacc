"""`PagedCache.check_no_leaks`: after a run only the prefix cache may hold
pages and slots; anything else held is named."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from blockmgr.errors import IntegrityError
from cache import PagedCache
from tests.tiny_models import built

HYBRID = ("lfm2",)


def paged(name: str) -> PagedCache:
    hybrid = name in HYBRID
    return PagedCache.for_model(built(name), 12, 8, num_slots=2 if hybrid else 0,
                                num_host_blocks=8, num_host_slots=2 if hybrid else 0)


def run(pc: PagedCache, name: str, seq_id: str, tokens: list[int]) -> None:
    pc.allocate(seq_id, tokens)
    with pc.step([seq_id], num_new=[len(tokens)]) as views:
        mx.eval(built(name)(mx.array([tokens], dtype=mx.int32), cache=views))


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_run_whose_sequences_ended_leaks_nothing(name):
    pc = paged(name)
    run(pc, name, "a", list(range(1, 20)))
    pc.free("a")
    assert pc.num_cached_blocks > 0  # the prefix cache holds pages: not a leak
    pc.check_no_leaks()
    assert pc.num_cached_blocks == 0 and pc.num_free_slots == pc.num_slots


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_live_sequence_is_named(name):
    pc = paged(name)
    run(pc, name, "a", list(range(1, 20)))
    with pytest.raises(IntegrityError, match="1 sequences still live") as error:
        pc.check_no_leaks()
    assert "pages not free after dropping the prefix cache" in str(error.value)
    if name in HYBRID:
        assert "1 slots in use but the prefix cache holds 0" in str(error.value)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_swapped_sequence_holds_host_memory(name):
    pc = paged(name)
    run(pc, name, "a", list(range(1, 20)))
    pc.swap_out("a")
    with pytest.raises(IntegrityError, match="host pages still in use") as error:
        pc.check_no_leaks()
    if name in HYBRID:
        assert "1 host slots still in use" in str(error.value)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_dropped_cache_frees_its_pools_without_the_cycle_collector(name):
    """A settled step leaves nothing that refers back to the cache, so
    dropping it with a live sequence (an engine dropped mid-run, say) frees
    its device pools at once, with the cyclic collector off."""
    model = built(name)
    gc.collect()
    gc.disable()
    try:
        mx.eval(mx.zeros(1))
        before = mx.get_active_memory()
        pc = PagedCache.for_model(model, 4096, 8, num_slots=2 if name in HYBRID else 0)
        run(pc, name, "a", list(range(3, 23)))
        pc.eval_state()
        nbytes = pc.nbytes
        assert mx.get_active_memory() - before >= nbytes
        del pc
        assert mx.get_active_memory() - before < nbytes // 8
    finally:
        gc.enable()
