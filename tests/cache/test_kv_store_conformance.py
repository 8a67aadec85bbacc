"""`BlockManager`, `GroupedStore` and `PagedCache` are one `KVStore`.

Two proofs. The signatures: every member the protocol declares exists on
each store with the protocol's parameters (same names, in order, extra ones
optional) and return annotation; the type checker in CI checks the same
(`conforming_stores` below is type-checked). The behaviour: one scripted
scenario (allocate, decode, a prefix hit, fork, swap, speculation,
truncate, free) runs against all three, on a full-attention model and a
hybrid one; every call's result and every query after it must be equal
across the stores, each sequence's computed count included. `PagedCache`
runs real forwards of a tiny random-weight model (which move the count);
for the others the driver sets the count as a forward's runner does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, get_type_hints

import mlx.core as mx
import pytest

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    GroupedStore,
    GroupedStoreConfig,
    KVStore,
)
from cache import PagedCache
from tests.tiny_models import built

STORES = (BlockManager, GroupedStore, PagedCache)
BLOCK = 4


def conforming_stores(bm: BlockManager, store: GroupedStore, pc: PagedCache) -> list[KVStore]:
    """Type-checked in CI: each store is a `KVStore`."""
    return [bm, store, pc]


def protocol_members() -> list[str]:
    return [
        name for name in vars(KVStore)
        if not name.startswith("_") or name == "__contains__"
        if name not in ("_is_protocol", "_is_runtime_protocol")
    ]


def test_the_protocol_declares_the_calls_the_layers_above_make():
    members = set(protocol_members())
    for name in ("allocate", "append", "append_decode", "fork", "free", "cache_prefix",
                 "swap_out", "swap_in", "begin_speculation", "commit_speculation",
                 "cached_paths", "cached_prefix_length", "cache_version", "group_usage",
                 "take_listener_errors", "check_integrity", "debug_state"):
        assert name in members, name


@pytest.mark.parametrize("store", STORES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("name", protocol_members())
def test_every_store_has_every_member_with_the_protocols_signature(store, name):
    declared = vars(KVStore)[name]
    member = getattr(store, name, None)
    assert member is not None, f"{store.__name__} lacks {name}"
    if isinstance(declared, property):
        assert isinstance(member, property) or not callable(member), name
        want = get_type_hints(declared.fget)["return"]
        if isinstance(member, property):
            assert get_type_hints(member.fget)["return"] == want, name
        return
    want_params = list(inspect.signature(declared).parameters.values())
    have_params = list(inspect.signature(member).parameters.values())
    assert [p.name for p in have_params[: len(want_params)]] == [p.name for p in want_params]
    for extra in have_params[len(want_params):]:
        assert extra.default is not inspect.Parameter.empty, (name, extra.name)
    assert get_type_hints(member)["return"] == get_type_hints(declared)["return"], name


# ------------------------------------------------------------ the scenario


class Driver:
    """One store under the scenario; `compute` runs the forward over the
    sequence's reserved tokens (a real one for a `PagedCache`)."""

    def __init__(self, store: Any, model: Any = None) -> None:
        self.store, self.model = store, model

    def compute(self, seq_id: str) -> None:
        if self.model is None:  # a runner sets the count when its forward finished
            self.store.progress(seq_id).num_computed = self.store.num_tokens(seq_id)
            return
        pc: PagedCache = self.store
        pending = pc.tokens(seq_id)[pc.num_computed(seq_id):]
        if not pending:
            return
        with pc.step([seq_id]) as views:
            mx.eval(self.model(mx.array([pending], dtype=mx.int32), cache=views))


def queries(store: Any, probe: list[int]) -> tuple:
    """Everything a caller can read of a store, as plain values."""
    seqs = tuple(
        (seq_id, store.tokens(seq_id), store.num_tokens(seq_id), store.num_computed(seq_id),
         store.progress(seq_id).num_computed, store.block_table(seq_id),
         store.block_table(seq_id, 0), store.slot(seq_id), store.is_swapped(seq_id),
         store.speculation_start(seq_id), seq_id in store)
        for seq_id in sorted(store.sequence_ids())
    )
    return (
        seqs, store.num_sequences, store.block_size, store.is_hybrid,
        store.enable_prefix_cache, store.num_slots, store.num_groups,
        store.num_usable_blocks, store.usage, store.num_free_blocks, store.num_free_slots,
        store.num_cached_blocks, store.stats, store.group_usage(), store.cache_version,
        sorted(store.cached_paths(), key=repr), store.cached_prefix_length(probe),
        store.take_listener_errors(), "missing" in store,
    )


def scenario(driver: Driver) -> list:
    """The script: each step's result, then every query."""
    s = driver.store
    prompt = list(range(1, 11))
    trace: list = []

    def step(label: str, call: Callable[[], Any]) -> Any:
        result = call()
        trace.append((label, result))
        s.check_integrity()
        trace.append((f"{label}: queries", queries(s, prompt[:9] + [77])))
        return result

    def fields(alloc: Any) -> tuple:
        return (alloc.block_table, alloc.slot, alloc.ops, alloc.num_cached_tokens,
                alloc.progress.num_computed)

    trace.append(("can allocate", s.can_allocate(prompt)))
    step("allocate a", lambda: fields(s.allocate("a", prompt)))
    driver.compute("a")
    step("can append", lambda: s.can_append("a", 3))
    step("append", lambda: s.append("a", [11]))
    driver.compute("a")
    step("can decode", lambda: s.can_append_decode(["a"]))
    step("decode", lambda: s.append_decode(["a"], [12]))
    driver.compute("a")
    step("cache a", lambda: s.cache_prefix("a"))
    step("fork", lambda: s.fork("a", "b"))
    step("allocate c", lambda: fields(s.allocate("c", prompt[:9] + [50, 51])))
    driver.compute("c")
    step("free c", lambda: s.free("c"))
    step("can swap out", lambda: s.can_swap_out("b"))
    step("swap out", lambda: s.swap_out("b"))
    step("can swap in", lambda: s.can_swap_in("b"))
    step("swap in", lambda: s.swap_in("b"))
    step("can speculate", lambda: s.can_speculate({"a": [3, 4]}))
    step("begin", lambda: s.begin_speculation({"a": [3, 4]}))
    driver.compute("a")
    step("commit", lambda: s.commit_speculation({"a": 1}))
    driver.compute("a")  # a restored checkpoint's tokens are computed again
    step("begin again", lambda: s.begin_speculation({"b": [5]}))
    step("shorten", lambda: s.shorten_speculation({"b": 0}))
    step("abort", lambda: s.abort_speculation(["b"]))
    if not s.is_hybrid:
        step("can truncate", lambda: s.can_truncate("a", 9))
        step("truncate", lambda: s.truncate("a", 9))
    step("free a", lambda: s.free("a"))
    step("free b", lambda: s.free("b"))
    step("reset", lambda: s.reset_prefix_cache())
    return trace


def stores_for(model_name: str, num_slots: int) -> list[Driver]:
    model = built(model_name)
    pc = PagedCache.for_model(model, 32, BLOCK, num_slots=num_slots, num_host_blocks=16,
                              num_host_slots=num_slots)
    kwargs: dict[str, Any] = dict(num_blocks=32, block_size=BLOCK, num_slots=num_slots,
                                  num_host_blocks=16, num_host_slots=num_slots)
    return [
        Driver(BlockManager(BlockManagerConfig(**kwargs))),
        Driver(GroupedStore(GroupedStoreConfig(windows=(None,), **kwargs))),
        Driver(pc, model),
    ]


@pytest.mark.parametrize("model_name, num_slots", [("llama", 0), ("lfm2", 8)])
def test_one_scenario_gives_the_same_results_on_every_store(model_name, num_slots):
    drivers = stores_for(model_name, num_slots)
    traces = [scenario(driver) for driver in drivers]
    labels = [label for label, _ in traces[0]]
    for trace in traces[1:]:
        assert [label for label, _ in trace] == labels
        for (label, want), (_, have) in zip(traces[0], trace):
            assert have == want, label
    results = dict(traces[0])
    assert isinstance(results["commit"], frozenset) and isinstance(results["abort"], frozenset)
    # The script exercises what it names: a prefix hit, a swap, a restored checkpoint.
    assert results["allocate c"][3] == (9 if num_slots == 0 else 0)
    assert results["swap out"] and results["swap in"]
    assert results["commit"] == (frozenset({"a"}) if num_slots else frozenset())
