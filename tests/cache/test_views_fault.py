"""`pc.views(ids)` (mlx-lm's usage) when a forward raises between two layers.

A step of `views()` counts as computed at the next forward or the next call
that touches its sequences, `free` included, only if every layer that writes
wrote its part of it; otherwise it is rolled back as `pc.step` rolls back a
forward that raised. The fault case: a forward raises in layer 1 after
layer 0 wrote, the sequence is freed, and a new request with that prefix
runs. Its logits must equal mlx-lm's own caches on the same tiny
random-weight model (an attention, a sliding-window and hybrid models), and
the prefix cache must not hold the failed step's tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from blockmgr.errors import InvalidArgument
from cache import PagedCache
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built

TOL = 1e-4
BLOCK = 8
FIRST = 24  # tokens of the chunk that finishes
FAILED = 16  # tokens of the chunk whose forward raises in layer 1
MORE = 5  # new tokens of the second request

#: model name -> (vocabulary, position of the view that raises: layer 1)
MODELS = {
    "llama": ATTENTION_VOCAB,  # full attention, full attention
    "sliding": ATTENTION_VOCAB,  # sliding window 20, then full attention
    "lfm2": HYBRID_VOCAB,  # conv, attention, conv, conv
    "qwen3_next": HYBRID_VOCAB,  # gated delta x 3, then attention
    "recurrent_gemma": HYBRID_VOCAB,  # recurrent, sliding attention, recurrent
}


class InjectedFault(RuntimeError):
    pass


class RaisingView:
    """A layer's view that raises at the layer's first use of its state in a
    forward (`update_and_fetch`, or reading a recurrent array), after the
    layers before it wrote theirs; everything else is the real view's."""

    def __init__(self, view) -> None:
        self._view = view

    def __getattr__(self, name):
        if name == "update_and_fetch":
            raise InjectedFault("layer 1 failed")
        return getattr(self._view, name)

    def __getitem__(self, index):
        raise InjectedFault("layer 1 failed")

    def __setitem__(self, index, value):
        raise InjectedFault("layer 1 failed")

    def __bool__(self) -> bool:
        return True


def tokens(vocab: int, seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def reference(model, seq: list[int], chunks: list[int]) -> np.ndarray:
    """Logits at every position of `seq` on mlx-lm's own caches, fed in `chunks`."""
    cache = model.make_cache()
    out, i = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([seq[i : i + n]]), cache=cache)[0]))
        i += n
    return np.concatenate(out)


def paged(model) -> PagedCache:
    return PagedCache.for_model(model, num_blocks=64, block_size=BLOCK, num_slots=8)


def forward(model, views, toks) -> np.ndarray:
    return np.array(model(mx.array([toks]), cache=views)[0])


def fail_in_layer_1(model, pc, seq_id, toks) -> list:
    """One forward of `toks` through `pc.views([seq_id])` whose layer 1
    raises; returns the views (layer 0 wrote its part of the step)."""
    views = pc.views([seq_id])
    faulty = list(views)
    faulty[1] = RaisingView(views[1])
    with pytest.raises(InjectedFault):
        model(mx.array([toks]), cache=faulty)
    return views


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_forward_failing_in_layer_1_then_free_caches_nothing_unwritten(name):
    model, vocab = built(name), MODELS[name]
    prompt = tokens(vocab, 1, FIRST + FAILED)
    pc = paged(model)
    pc.allocate("a", prompt)
    forward(model, pc.views(["a"]), prompt[:FIRST])
    fail_in_layer_1(model, pc, "a", prompt[FIRST:])
    assert pc.num_computed("a") == FIRST  # the failed step did not count
    pc.free("a")
    pc.check_integrity()

    second = prompt + tokens(vocab, 2, MORE)
    alloc = pc.allocate("b", second)
    hit = alloc.num_cached_tokens
    assert 0 < hit <= FIRST  # the prefix cache holds the finished chunk at most
    got = forward(model, pc.views(["b"]), second[hit:])
    want = reference(model, second, [hit, len(second) - hit])[hit:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    steps = tokens(vocab, 3, 3)
    for t in steps:  # decode on: the state after the prefix hit is right too
        pc.append("b", [t])
        got = forward(model, pc.views(["b"]), [t])
    want = reference(model, second + steps, [len(second)] + [1] * len(steps))[-1:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    pc.free("b")
    pc.check_integrity()


def test_the_same_views_retry_the_failed_step_when_nothing_touched_it():
    """A retry through the views whose forward raised (no call in between)
    starts the step again from the computed tokens: its logits are mlx-lm's."""
    model = built("llama")
    prompt = tokens(ATTENTION_VOCAB, 4, FIRST + FAILED)
    pc = paged(model)
    pc.allocate("a", prompt)
    views = pc.views(["a"])
    forward(model, views, prompt[:FIRST])
    faulty = list(views)
    faulty[1] = RaisingView(views[1])
    with pytest.raises(InjectedFault):
        model(mx.array([prompt[FIRST:]]), cache=faulty)
    got = forward(model, views, prompt[FIRST:])
    want = reference(model, prompt, [FIRST, FAILED])[FIRST:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    pc.free("a")
    assert pc.allocate("b", prompt + [1]).num_cached_tokens == len(prompt)
    pc.check_integrity()


def test_views_whose_step_a_call_rolled_back_refuse_the_next_forward():
    model = built("llama")
    prompt = tokens(ATTENTION_VOCAB, 5, FIRST + FAILED)
    pc = paged(model)
    pc.allocate("a", prompt)
    forward(model, pc.views(["a"]), prompt[:FIRST])
    views = fail_in_layer_1(model, pc, "a", prompt[FIRST:])
    assert pc.num_computed("a") == FIRST  # this call rolled the step back
    before = pc.debug_state()
    with pytest.raises(InvalidArgument, match="take new views"):
        model(mx.array([prompt[FIRST:]]), cache=views)
    assert pc.debug_state() == before
    got = forward(model, pc.views(["a"]), prompt[FIRST:])  # new views run it
    want = reference(model, prompt, [FIRST, FAILED])[FIRST:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    pc.check_integrity()


def test_a_generate_step_style_forward_that_fails_reserves_nothing_for_the_trie():
    """Nothing reserved (mlx-lm's generate_step feeds its own tokens): the
    failed forward's placeholder tokens stay uncomputed and unknown."""
    model = built("llama")
    prompt = tokens(ATTENTION_VOCAB, 6, FIRST)
    pc = paged(model)
    pc.allocate("a", prompt)
    forward(model, pc.views(["a"]), prompt)
    fail_in_layer_1(model, pc, "a", [7, 8, 9])
    assert pc.num_computed("a") == FIRST
    pc.free("a")
    assert pc.allocate("b", prompt + [3]).num_cached_tokens == FIRST
    pc.check_integrity()


@pytest.mark.parametrize("name, bits", [("llama", (8, 8)), ("sliding", (4, 4)),
                                        ("lfm2", (8, 4)), ("qwen3_next", (4, 4))])
def test_a_failed_views_step_on_quantized_pages_is_rolled_back(name, bits):
    """The same fault on quantized pages (models of head size 32): the step
    layer 0 wrote is not cached, and a prefix hit then decodes as mlx-lm's
    quantized caches (`tests.quant_models.reference_caches`) fed the same
    chunks."""
    from cache import KVFormat
    from tests.quant_models import VOCAB, reference_caches, run_chunks
    from tests.quant_models import built as built_quantizable

    model, fmt = built_quantizable(name), KVFormat(*bits, 32)
    prompt = tokens(VOCAB, 1, FIRST + FAILED)
    pc = PagedCache.for_model(model, num_blocks=64, block_size=BLOCK, num_slots=8,
                              kv_format=fmt)
    pc.allocate("a", prompt)
    forward(model, pc.views(["a"]), prompt[:FIRST])
    fail_in_layer_1(model, pc, "a", prompt[FIRST:])
    assert pc.num_computed("a") == FIRST
    pc.free("a")
    pc.check_integrity()

    second = prompt + tokens(VOCAB, 2, MORE)
    hit = pc.allocate("b", second).num_cached_tokens
    assert 0 < hit <= FIRST
    steps = tokens(VOCAB, 3, 3)
    got = [forward(model, pc.views(["b"]), second[hit:])]
    for t in steps:
        pc.append("b", [t])
        got.append(forward(model, pc.views(["b"]), [t]))
    chunks = [second[:hit], second[hit:]] + [[t] for t in steps]
    want = np.array(run_chunks(model, reference_caches(model, fmt, name), chunks))[hit:]
    np.testing.assert_allclose(np.concatenate(got), want, atol=TOL, rtol=0)
    pc.free("b")
    pc.check_integrity()


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_views_step_whose_runner_set_the_count_first_counts_once(name):
    """A scheduler sets the sequence's count (the store's record, which the
    cache shares) when the step's results come in, before the cache settles
    a `views()` step at its next call: the count is the step's end, not that
    plus the step again, and the next step's logits are mlx-lm's."""
    model = built(name)
    prompt = tokens(MODELS[name], 5, FIRST + FAILED)
    pc = paged(model)
    alloc = pc.allocate("a", prompt[:FIRST])
    views = pc.views(["a"])
    forward(model, views, prompt[:FIRST])
    alloc.progress.num_computed = FIRST  # the runner's set, before the cache's settle
    assert pc.num_computed("a") == FIRST
    pc.check_integrity()
    pc.append("a", prompt[FIRST:])
    got = forward(model, pc.views(["a"]), prompt[FIRST:])
    want = reference(model, prompt, [FIRST, FAILED])[FIRST:]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert pc.num_computed("a") == FIRST + FAILED
