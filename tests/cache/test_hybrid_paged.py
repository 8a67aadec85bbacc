"""Hybrid models (tiny random-weight LFM2 and Qwen3-Next) on `PagedCache`.

Attention layers run on paged KV views, recurrent layers on slot views, all
built by `PagedCache.for_model(model, num_slots=...)`. Every reference is the
same model on its own `make_cache()` caches, one sequence at a time; nothing
is hard-coded.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from blockmgr.errors import InvalidArgument, NoSnapshot
from cache import PagedCache
from recurrent import RecurrentPools
from tests.recurrent.test_recurrent_models import MODELS, TOL, tokens
from tests.tiny_models import built

get = built


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return get(request.param)


def paged(model, num_slots=8, num_blocks=96, **kwargs):
    return PagedCache.for_model(model, num_blocks=num_blocks, block_size=8,
                                num_slots=num_slots, **kwargs)


def reference(model, seq: list[int], chunks: list[int] | None = None) -> np.ndarray:
    """Logits at every position of `seq`, mlx-lm caches, fed in `chunks` sizes."""
    cache = model.make_cache()
    out, i = [], 0
    for n in chunks or [len(seq)]:
        out.append(np.array(model(mx.array([seq[i : i + n]]), cache=cache)[0]))
        i += n
    assert i == len(seq)
    return np.concatenate(out)


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)


def run(pc, model, seq_id, toks) -> np.ndarray:
    """One forward of `toks` (already reserved) for `seq_id`."""
    return np.array(model(mx.array([toks]), cache=pc.views([seq_id]))[0])


def decode(pc, model, seq_id, toks) -> np.ndarray:
    out = []
    for t in toks:
        pc.append(seq_id, [t])
        out.append(run(pc, model, seq_id, [t]))
    return np.concatenate(out)




def test_for_model_builds_the_recurrent_backend(model):
    pc = paged(model)
    assert isinstance(pc.recurrent, RecurrentPools)
    assert set(pc.recurrent.layers) == {
        i for i, c in enumerate(model.make_cache()) if type(c).__name__ == "ArraysCache"
    }
    with pytest.raises(InvalidArgument):
        PagedCache.for_model(model, num_blocks=16, block_size=8)  # no slots


def test_chunked_prefill_then_decode_matches_mlx_lm(model):
    seq = tokens(1, 40)
    want = reference(model, seq[:36], chunks=[13, 9, 14])
    want_dec = reference(model, seq)[36:]
    pc = paged(model)
    pc.allocate("a", seq[:36])
    views = pc.views(["a"])  # one set of views for all chunks
    got = [np.array(model(mx.array([seq[i:j]]), cache=views)[0])
           for i, j in ((0, 13), (13, 22), (22, 36))]
    close(np.concatenate(got), want)
    close(decode(pc, model, "a", seq[36:]), want_dec)
    pc.check_integrity()


def test_conversation_turn_two_reuses_turn_one(model):
    prompt1, answer, text2 = tokens(2, 21), tokens(3, 5), tokens(4, 7)
    pc = paged(model)
    pc.allocate("t1", prompt1)
    run(pc, model, "t1", prompt1)
    decode(pc, model, "t1", answer)
    pc.free("t1")
    turn2 = prompt1 + answer + text2
    alloc = pc.allocate("t2", turn2)
    assert alloc.num_cached_tokens == len(prompt1) + len(answer)
    got = run(pc, model, "t2", text2)
    close(got, reference(model, turn2)[alloc.num_cached_tokens :])
    pc.check_integrity()


def test_fork_after_prefill_continuations_match_and_parent_untouched(model):
    prompt, cont_a, cont_b = tokens(5, 19), tokens(6, 4), tokens(7, 4)
    pc = paged(model)
    pc.allocate("a", prompt)
    run(pc, model, "a", prompt)
    pc.fork("a", "b")
    assert pc.block_manager.slot("a") == pc.block_manager.slot("b")
    got_b = decode(pc, model, "b", cont_b)  # the child writes first
    assert pc.block_manager.slot("a") != pc.block_manager.slot("b")
    got_a = decode(pc, model, "a", cont_a)
    close(got_b, reference(model, prompt + cont_b)[len(prompt) :])
    close(got_a, reference(model, prompt + cont_a)[len(prompt) :])
    pc.check_integrity()


def test_recycled_slot_equals_fresh_slot(model):
    seq = tokens(9, 15)
    fresh = paged(model, num_slots=1)
    fresh.allocate("x", seq)
    want = np.concatenate([run(fresh, model, "x", seq[:6]), run(fresh, model, "x", seq[6:])])

    pc = paged(model, num_slots=1)  # one slot: the next sequence recycles it
    pc.allocate("old", tokens(8, 12))
    run(pc, model, "old", tokens(8, 12))
    pc.free("old")  # its state goes to the trie, then is evicted for "x"
    pc.allocate("x", seq)
    got = np.concatenate([run(pc, model, "x", seq[:6]), run(pc, model, "x", seq[6:])])
    np.testing.assert_array_equal(got, want)
    close(got, reference(model, seq))
    pc.check_integrity()


def test_batched_prefill_and_decode_of_mixed_lengths_equal_each_alone(model):
    lengths = [9, 3, 17, 12, 1]
    ids = [f"s{i}" for i in range(len(lengths))]
    prompts = [tokens(20 + i, n) for i, n in enumerate(lengths)]
    steps = [tokens(40 + i, 3) for i in range(len(lengths))]
    pc = paged(model)
    for sid, p in zip(ids, prompts):
        pc.allocate(sid, p)
    width = max(lengths)
    logits = np.array(model(mx.array([p + [0] * (width - len(p)) for p in prompts]),
                            cache=pc.views(ids)))
    for b, p in enumerate(prompts):
        close(logits[b, : len(p)], reference(model, p))
    views = None
    for k in range(3):
        for sid, s in zip(ids, steps):
            pc.append(sid, [s[k]])
        views = views or pc.views(ids)  # views serve the whole batch
        out = np.array(model(mx.array([[s[k]] for s in steps]), cache=views))
        for b, p in enumerate(prompts):
            close(out[b, 0], reference(model, p + steps[b][: k + 1])[-1])
    pc.check_integrity()


def test_checkpoint_at_chunk_end_is_reused(model):
    shared, rest_a, rest_b = tokens(10, 21), tokens(11, 10), tokens(12, 6)
    pc = paged(model)
    pc.allocate("a", shared + rest_a)
    views = pc.views(["a"])
    model(mx.array([shared]), cache=views)  # first prefill chunk
    pc.cache_prefix("a")  # scheduler-style checkpoint at the chunk end
    model(mx.array([rest_a]), cache=views)
    alloc = pc.allocate("b", shared + rest_b)
    assert alloc.num_cached_tokens == len(shared)
    got = run(pc, model, "b", rest_b)
    close(got, reference(model, shared + rest_b)[len(shared) :])
    # "a" kept computing in its own slot after the checkpoint
    close(decode(pc, model, "a", rest_b[:2]),
          reference(model, shared + rest_a + rest_b[:2])[-2:])
    pc.check_integrity()


def test_hybrid_refuses_cuts_without_a_snapshot():
    model = get("lfm2")
    seq = tokens(13, 20)
    pc = paged(model)
    pc.allocate("a", seq)
    run(pc, model, "a", seq)
    with pytest.raises(InvalidArgument):
        pc.cache_prefix("a", 10)  # no recurrent state after 10 tokens
    with pytest.raises(NoSnapshot):
        pc.truncate("a", 10)
    assert pc.num_tokens("a") == 20 and pc.num_computed("a") == 20
    close(decode(pc, model, "a", [5]), reference(model, seq + [5])[-1:])
    views = pc.views(["a"])
    assert not views[0].is_trimmable()  # mlx-lm's can_trim_prompt_cache says no


def test_generate_step_on_hybrid_views(model):
    prompt = tokens(14, 19)
    want = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=6), range(6))]
    pc = paged(model)
    pc.allocate("a", prompt)
    got = [t for (t, _), _ in zip(
        generate_step(mx.array(prompt), model, max_tokens=6, prompt_cache=pc.views(["a"]),
                      prefill_step_size=8), range(6))]
    assert got == want
    pc.free("a")  # generated ids are unknown: the slot (state after them) is not cached
    assert pc.block_manager.stats.num_trie_slots == 0
    pc.check_integrity()
