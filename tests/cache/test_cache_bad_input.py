"""`PagedCache` refuses bad calls with typed errors and changes nothing.

A tiny llama and a tiny gemma3 (full + sliding groups) on paged storage
with two live sequences (one computed, one not); every bad call raises the
expected `blockmgr.errors` type and leaves `debug_state()` (the store's
every group, and each sequence's computed count) exactly as it was.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from blockmgr.errors import (
    DuplicateSequence,
    InvalidArgument,
    SequenceSwapped,
    UnknownSequence,
    WrongArgumentType,
)
from cache import PagedCache
from tests.tiny_models import built

BAD_CALLS = [
    ("allocate an empty prompt", lambda pc: pc.allocate("x", []), InvalidArgument),
    ("allocate a str prompt", lambda pc: pc.allocate("x", "hello"), WrongArgumentType),
    ("allocate None", lambda pc: pc.allocate("x", None), WrongArgumentType),
    ("allocate nested ids", lambda pc: pc.allocate("x", [[1, 2], [3]]), WrongArgumentType),
    ("allocate float ids", lambda pc: pc.allocate("x", [1.0, 2.0]), WrongArgumentType),
    ("allocate a negative id", lambda pc: pc.allocate("x", [1, -2]), InvalidArgument),
    ("allocate a huge id", lambda pc: pc.allocate("x", [1, 2**70]), InvalidArgument),
    ("allocate a live id", lambda pc: pc.allocate("done", [1, 2]), DuplicateSequence),
    ("allocate an unhashable id", lambda pc: pc.allocate(["x"], [1, 2]), InvalidArgument),
    ("allocate in an unhashable namespace", lambda pc: pc.allocate("x", [1], ["ns"]),
     InvalidArgument),
    ("append to an unknown id", lambda pc: pc.append("nobody", [1]), UnknownSequence),
    ("append a str", lambda pc: pc.append("done", "ab"), WrongArgumentType),
    ("append a negative id", lambda pc: pc.append("done", [-1]), InvalidArgument),
    ("append a float id", lambda pc: pc.append("done", [1.5]), WrongArgumentType),
    ("fork an unknown id", lambda pc: pc.fork("nobody", "x"), UnknownSequence),
    ("fork onto a live id", lambda pc: pc.fork("done", "pending"), DuplicateSequence),
    ("truncate past the end", lambda pc: pc.truncate("done", 10_000), InvalidArgument),
    ("truncate to a negative length", lambda pc: pc.truncate("done", -1), InvalidArgument),
    ("truncate to a float", lambda pc: pc.truncate("done", 2.0), InvalidArgument),
    ("cache more than computed", lambda pc: pc.cache_prefix("pending", 5), InvalidArgument),
    ("cache a negative count", lambda pc: pc.cache_prefix("done", -1), InvalidArgument),
    ("free more than computed", lambda pc: pc.free("pending", 5), InvalidArgument),
    ("free an unknown id", lambda pc: pc.free("nobody"), UnknownSequence),
    ("swap in a resident sequence", lambda pc: pc.swap_in("done"), InvalidArgument),
    ("views of no sequence", lambda pc: pc.views([]), InvalidArgument),
    ("views of a repeated id", lambda pc: pc.views(["done", "done"]), InvalidArgument),
    ("views of an unknown id", lambda pc: pc.views(["nobody"]), UnknownSequence),
    ("views with num_new of the wrong length", lambda pc: pc.views(["done"], num_new=[1, 2]),
     InvalidArgument),
    ("views of an unhashable id", lambda pc: pc.views([["x"]]), InvalidArgument),
]


@pytest.fixture(params=["llama", "gemma3"])
def cache(request):
    model = built(request.param)
    pc = PagedCache.for_model(model, 64, 4, num_host_blocks=16)
    prompt = np.random.default_rng(0).integers(0, 101, 23).tolist()
    pc.allocate("done", prompt)
    with pc.step(["done"]) as views:
        mx.eval(model(mx.array([prompt]), cache=views))
    pc.allocate("pending", prompt[:9] + [7, 7])
    return model, pc


@pytest.mark.parametrize("name, call, error", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_bad_call_is_refused_and_changes_nothing(cache, name, call, error):
    _, pc = cache
    before = pc.debug_state()
    with pytest.raises(error):
        call(pc)
    assert pc.debug_state() == before, name
    pc.check_integrity()


def test_a_forward_with_more_new_tokens_than_pending_changes_nothing(cache):
    model, pc = cache
    before = pc.debug_state()
    with pytest.raises(InvalidArgument):
        with pc.step(["pending"], num_new=[50]) as views:
            model(mx.array([[1] * 50]), cache=views)
    assert pc.debug_state() == before
    pc.check_integrity()


def test_a_swapped_sequence_refuses_views_and_writes(cache):
    _, pc = cache
    pc.swap_out("done")
    before = pc.debug_state()
    for call in (lambda: pc.views(["done"]), lambda: pc.append("done", [1]),
                 lambda: pc.fork("done", "x"), lambda: pc.cache_prefix("done")):
        with pytest.raises(SequenceSwapped):
            call()
        assert pc.debug_state() == before
    pc.swap_in("done")
    pc.check_integrity()
