"""Failures across layer groups and forwards: nothing leaks, nothing wrong is served.

Regression tests for the cases that used to leave pages behind or poison
the prefix cache: allocation under memory pressure on a sliding-window
model, a hybrid + sliding store whose groups cannot serve the same hit, a
forward that raises in layer k (then free, or retry), a swap before the
first forward, and an Engine whose forward raises once. References are
mlx-lm's own caches (or greedy generation) on the same tiny models.
"""

from __future__ import annotations

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from mlx_lm.models.cache import make_prompt_cache

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    GroupedStore,
    GroupedStoreConfig,
    OutOfBlocks,
)
from cache import PagedCache
from scheduler import Engine, RequestStatus, SamplingParams
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak
from tests.shadow import GroupedShadowStorage
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built

TOL = 1e-4
FAULT = "injected fault"

#: name -> (vocabulary, slots): attention, sliding-window and hybrid models.
MODELS = {
    "llama": (ATTENTION_VOCAB, 0),
    "gemma3": (ATTENTION_VOCAB, 0),
    "lfm2": (HYBRID_VOCAB, 8),
    "qwen3_next": (HYBRID_VOCAB, 8),
    "recurrent_gemma": (HYBRID_VOCAB, 8),
}


def tokens(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def reference(model, toks):
    return model(mx.array([toks]), cache=make_prompt_cache(model))[0]


def close(got, want):
    diff = mx.abs(got - want).max().item()
    assert diff < TOL, diff


class FailingLayer:
    """Stands for a layer's cache view: reading or writing its cache raises
    `error` (a RuntimeError unless told otherwise)."""

    def __init__(self, view, error=RuntimeError) -> None:
        self._view = view
        self._error = error

    def __bool__(self) -> bool:
        return True

    def __getattr__(self, name):
        if name in ("offset", "make_mask", "max_size", "lengths"):
            return getattr(self._view, name)  # what models read before the layer runs
        raise self._error(FAULT)

    def __getitem__(self, index):
        raise self._error(FAULT)


def run_failing(pc, model, seq, toks, layer):
    """A forward over `toks` whose cache access at `layer` raises."""
    with pytest.raises(RuntimeError, match=FAULT):
        with pc.step([seq]) as views:
            views = list(views)
            views[layer] = FailingLayer(views[layer])
            model(mx.array([toks]), cache=views)


def forward(pc, model, seq, toks):
    with pc.step([seq]) as views:
        logits = model(mx.array([toks]), cache=views)[0]
        mx.eval(logits)
    return logits


def storage(model, slots, **kwargs):
    return PagedCache.for_model(model, 64, 4, num_slots=slots, **kwargs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_forward_failing_in_any_layer_computes_nothing(name):
    vocab, slots = MODELS[name]
    model = built(name)
    prompt = tokens(vocab, 23, 1)
    want = reference(model, prompt)
    for layer in range(len(model.layers)):
        pc = storage(model, slots)
        pc.allocate("a", prompt)
        run_failing(pc, model, "a", prompt, layer)
        assert pc.num_computed("a") == 0
        pc.check_integrity()
        close(forward(pc, model, "a", prompt), want)  # the retry recomputes
        pc.free("a")
        pc.check_integrity()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_failed_forward_never_reaches_the_prefix_cache(name):
    vocab, slots = MODELS[name]
    model = built(name)
    prompt = tokens(vocab, 21, 2)
    pc = storage(model, slots)
    pc.allocate("a", prompt[:12])
    forward(pc, model, "a", prompt[:12])  # 12 tokens really computed
    pc.append("a", prompt[12:])
    run_failing(pc, model, "a", prompt[12:], len(model.layers) - 1)
    pc.free("a")  # only the 12 computed tokens may enter the trie
    alloc = pc.allocate("b", prompt)
    assert alloc.num_cached_tokens <= 12
    close(forward(pc, model, "b", prompt[alloc.num_cached_tokens :]),
          reference(model, prompt)[alloc.num_cached_tokens :])
    pc.free("b")
    pc.reset_prefix_cache()
    pc.check_integrity()
    assert all(g.num_free_pages == g.num_pages for g in pc.store.group_usage())
    assert pc.store.num_free_slots == slots


@pytest.mark.parametrize("name", ["llama", "gemma3", "lfm2"])
def test_swap_before_the_first_forward(name):
    vocab, slots = MODELS[name]
    model = built(name)
    prompt = tokens(vocab, 18, 3)
    pc = storage(model, slots, num_host_blocks=16, num_host_slots=2 if slots else 0)
    pc.allocate("a", prompt)
    pc.swap_out("a")
    pc.flush()
    pc.swap_in("a")
    close(forward(pc, model, "a", prompt), reference(model, prompt))
    pc.check_integrity()


def test_allocate_under_pressure_on_a_sliding_model_changes_nothing():
    model = built("gemma3")
    pc = PagedCache.for_model(model, 12, 4, window_blocks=12)
    first = tokens(ATTENTION_VOCAB, 30, 4)
    pc.allocate("a", first)
    forward(pc, model, "a", first)
    before = pc.store.debug_state()
    with pytest.raises(OutOfBlocks):
        pc.allocate("b", tokens(ATTENTION_VOCAB, 30, 5))  # 8 pages, 4 free
    assert pc.store.debug_state() == before
    assert "b" not in pc.store
    pc.check_integrity()
    pc.free("a")
    second = tokens(ATTENTION_VOCAB, 30, 5)
    alloc = pc.allocate("b", second)  # a retry works once there is room
    close(forward(pc, model, "b", second[alloc.num_cached_tokens :]),
          reference(model, second)[alloc.num_cached_tokens :])
    pc.check_integrity()


def test_sliding_pressure_evicts_every_groups_pages_of_the_lru_leaves():
    """The full group holds a snapshot at 24, then the sliding pool runs
    short: the least recently used leaves go, with every group's pages
    (design/grouped_store.md, "Eviction"), and the hit falls to the
    snapshot both groups still serve (12)."""
    store = GroupedStore(GroupedStoreConfig(
        num_blocks=40, block_size=4, windows=(None, 6), num_slots=8, window_blocks=9))
    shadow = GroupedShadowStorage(store)
    stem = list(range(100, 124))

    def run(seq, toks, chunk_ends):
        alloc = store.allocate(seq, toks)
        shadow.apply(alloc.ops)
        shadow.computed[seq] = alloc.num_cached_tokens
        for end in chunk_ends:
            if end > shadow.computed[seq]:
                shadow.compute(seq, end)
                shadow.apply(store.cache_prefix(seq, end))
        shadow.compute(seq)
        return alloc

    run("a", stem + [1, 2, 3], [12, 24])
    shadow.apply(store.free("a", shadow.computed.pop("a")))
    assert store.cached_prefix_length(stem + [5]) == 24
    # Fill the sliding pool: its LRU leaves (the window before 24) go first.
    run("b", [7] * 13, [])
    shadow.apply(store.free("b", shadow.computed.pop("b")))
    num_full_cached = store.group_usage()[0].num_cached_pages
    run("c", [8] * 14, [])
    shadow.apply(store.free("c", shadow.computed.pop("c")))
    # "c" cached 4 full-group pages; the evicted leaves gave some back.
    full, sliding = store.group_usage()
    assert full.num_cached_pages < num_full_cached + 4
    assert full.num_evicted_pages > 0 and sliding.num_evicted_pages > 0
    before = store.debug_state()
    assert store.cached_prefix_length(stem + [5]) == 12
    assert store.debug_state() == before
    alloc = run("d", stem + [5], [])
    assert alloc.num_cached_tokens == 12
    shadow.check_all()
    store.check_integrity()


def test_groups_that_cannot_serve_the_same_hit_agree_on_a_shorter_one():
    """The full group alone could serve 30 tokens of a cached 40-token
    prefix; a sliding group (window 6) only the ends whose window it kept
    (20 and 40): the store serves the longest point both serve (20), what
    plain managers of each group, given the same calls, agree on."""
    stem = list(range(200, 240))
    query = stem[:30] + [1, 2, 3]
    hits = []
    for store in (
        GroupedStore(GroupedStoreConfig(num_blocks=40, block_size=4, windows=(None, 6))),
        BlockManager(BlockManagerConfig(num_blocks=40, block_size=4)),
        BlockManager(BlockManagerConfig(num_blocks=40, block_size=4, sliding_window=6)),
    ):
        store.allocate("a", stem)
        store.cache_prefix("a", 20)
        store.free("a")
        hits.append(store.cached_prefix_length(query))
        store.check_integrity()
    assert hits == [20, 30, 20]


class FailingModel:
    """Wraps a model; the forwards numbered in `fail_at` (counted from
    `arm()`) raise `error` in layer `layer`, and so does every forward whose
    input holds `poison`. Everything else is the model's."""

    def __init__(self, model, fail_at=(), layer=0, error=RuntimeError, poison=None) -> None:
        self.model, self.fail_at, self.layer = model, set(fail_at), layer
        self.error, self.poison = error, poison
        self.calls: int | None = None

    def arm(self) -> None:
        self.calls = 0

    def __call__(self, inputs, cache=None):
        if self.calls is not None:
            self.calls += 1
            poisoned = self.poison is not None and any(self.poison in row
                                                       for row in inputs.tolist())
            if self.calls in self.fail_at or poisoned:
                cache = list(cache)
                cache[self.layer] = FailingLayer(cache[self.layer], self.error)
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def shared_prompts(vocab, count=6):
    shared = tokens(vocab, 30, 6)
    return [shared + tokens(vocab, 3 + i, 10 + i) for i in range(count)]


@pytest.mark.parametrize("name", ["llama", "gemma3", "lfm2", "recurrent_gemma"])
def test_the_engine_retries_a_forward_that_raised(name):
    vocab, _ = MODELS[name]
    model = built(name)
    prompts = shared_prompts(vocab)
    want = [greedy_reference(model, p, 6) for p in prompts]
    failing = FailingModel(model, fail_at=[2, 5, 9], layer=len(model.layers) - 1)
    engine = Engine(failing, num_blocks=128, block_size=4, max_num_batched_tokens=40,
                    max_forward_retries=4)  # a row may fail twice in a row here
    failing.arm()
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))  # no step raises
    assert engine.stats.num_forward_errors == 3
    assert [o.tokens for o in outs] == want
    assert engine.scheduler.stats.num_prefix_hit_tokens_total > 0
    assert_no_leak(engine)


def test_an_interrupt_is_rolled_back_and_reraised_and_the_next_step_continues():
    model = built("lfm2")
    prompts = shared_prompts(HYBRID_VOCAB, 3)
    want = [greedy_reference(model, p, 5) for p in prompts]
    failing = FailingModel(model, fail_at=[3], layer=1, error=KeyboardInterrupt)
    engine = Engine(failing, num_blocks=64, block_size=4)
    failing.arm()
    ids = [engine.add_request(p, SamplingParams(max_tokens=5)) for p in prompts]
    requests = [engine.get_request(rid) for rid in ids]
    interrupted = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupted += 1
            engine.check_integrity()
    assert interrupted == 1
    assert [r.outputs[0] for r in requests] == want
    assert_no_leak(engine)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_request_whose_forward_always_fails_is_aborted_alone(name):
    vocab, _ = MODELS[name]
    model = built(name)
    prompts = shared_prompts(vocab, 5)
    poison = max(set(range(vocab)) - {t for p in prompts for t in p})  # in no prompt yet
    prompts[2] = prompts[2][:-1] + [poison]  # only this request's forward will raise
    want = [greedy_reference(model, p, 6) for p in prompts]
    failing = FailingModel(model, layer=0, poison=poison)
    engine = Engine(failing, num_blocks=128, block_size=4, max_num_batched_tokens=64,
                    prefill_batch=2)
    failing.arm()
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts]
    requests = [engine.get_request(rid) for rid in ids]
    while engine.has_unfinished():
        engine.step()
    bad = requests[2]
    assert bad.status is RequestStatus.FINISHED_ABORTED
    assert isinstance(bad.error, RuntimeError) and FAULT in str(bad.error)
    assert bad.outputs[0] == []
    for i, r in enumerate(requests):
        if i != 2:
            assert r.outputs[0] == want[i] and r.status is not RequestStatus.FINISHED_ABORTED
    assert_no_leak(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["llama", "lfm2"]),
    fail_at=st.sets(st.integers(1, 30), min_size=1, max_size=3),
    layer=st.integers(0, 3),
    tight=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap"]),
)
def test_transient_faults_anywhere_leave_every_output_right(name, fail_at, layer, tight,
                                                            preemption):
    """A forward raising at hypothesis-drawn points (k-th forward, layer j),
    with several requests in flight, a roomy or a tight pool, recompute or
    swap: every request ends with mlx-lm's greedy output, nothing leaks."""
    vocab, _ = MODELS[name]
    model = built(name)
    prompts = shared_prompts(vocab, 4)
    want = _reference_outputs(name, prompts)
    failing = FailingModel(model, fail_at=fail_at, layer=layer)
    engine = Engine(failing, num_blocks=16 if tight else 96, block_size=4,
                    max_num_batched_tokens=32, max_num_seqs=4, preemption=preemption,
                    num_host_blocks=64, num_host_slots=8, max_forward_retries=5)
    failing.arm()
    outs = engine.generate(prompts, SamplingParams(max_tokens=5))
    assert [o.tokens for o in outs] == want
    assert engine.stats.num_forward_errors == len([k for k in fail_at if k <= failing.calls])
    assert_no_leak(engine)


_REFERENCE: dict = {}


def _reference_outputs(name, prompts):
    if name not in _REFERENCE:
        _REFERENCE[name] = [greedy_reference(built(name), p, 5) for p in prompts]
    return _REFERENCE[name]
