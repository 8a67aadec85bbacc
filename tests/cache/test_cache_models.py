"""Tiny random-weight mlx-lm models on PagedCache views vs mlx-lm's own caches.

Every reference is the same model run on `model.make_cache()` caches (fresh,
one sequence at a time); nothing is hard-coded.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from cache import PagedCache
from tests.tiny_models import ATTENTION_MODELS, ATTENTION_VOCAB, built

TOL = 1e-4
VOCAB = ATTENTION_VOCAB
get = built


@pytest.fixture(params=sorted(ATTENTION_MODELS))
def model(request):
    return get(request.param)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def reference(model, toks, chunks=None):
    """Logits at every position, mlx-lm caches, prefill in `chunks` sizes."""
    cache = make_prompt_cache(model)
    out, i = [], 0
    for n in chunks or [len(toks)]:
        out.append(model(mx.array([toks[i : i + n]]), cache=cache)[0])
        i += n
    if i < len(toks):
        out.append(model(mx.array([toks[i:]]), cache=cache)[0])
    return mx.concatenate(out)


def close(a, b):
    diff = mx.abs(a - b).max().item()
    assert diff < TOL, diff


def paged(model, num_blocks=128, block_size=8):
    return PagedCache.for_model(model, num_blocks=num_blocks, block_size=block_size)


def decode(pc, model, seq, toks):
    """Append and run `toks` one at a time; logits per token."""
    out = []
    for t in toks:
        pc.append(seq, [t])
        out.append(model(mx.array([[t]]), cache=pc.views([seq]))[0])
    return mx.concatenate(out)


def test_chunked_prefill_then_decode_matches_mlx_lm(model):
    toks = tokens(60, 0)
    ref = reference(model, toks[:50], chunks=[23, 27])
    ref_dec = reference(model, toks)[50:]
    pc = paged(model)
    pc.allocate("a", toks[:50])
    views = pc.views(["a"])
    got = mx.concatenate([model(mx.array([toks[:23]]), cache=views)[0],
                          model(mx.array([toks[23:50]]), cache=views)[0]])
    close(got, ref)
    close(decode(pc, model, "a", toks[50:]), ref_dec)
    pc.check_integrity()


def test_sliding_window_releases_pages():
    model = get("sliding")
    pc = paged(model)
    pc.allocate("a", tokens(30, 1))
    model(mx.array([tokens(30, 1)]), cache=pc.views(["a"]))
    decode(pc, model, "a", tokens(40, 2))
    sliding_table = pc.block_table("a", pc.group_of(0))
    assert sliding_table[0] is None  # out of the window: released
    live = [p for p in sliding_table if p is not None]
    assert len(live) <= 20 // 8 + 2
    assert None not in pc.block_table("a", pc.group_of(1))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_prefix_reuse_computes_only_the_suffix(name):
    model = get(name)
    prefix = tokens(100, 3)
    first, second = prefix + tokens(12, 4), prefix + tokens(9, 5)
    pc = paged(model)
    pc.allocate("a", first)
    model(mx.array([first]), cache=pc.views(["a"]))
    pc.free("a")
    alloc = pc.allocate("b", second)
    assert 96 <= alloc.num_cached_tokens <= 100
    suffix = second[alloc.num_cached_tokens :]
    got = model(mx.array([suffix]), cache=pc.views(["b"]))[0]
    close(got, reference(model, second)[alloc.num_cached_tokens :])
    pc.block_manager.check_integrity()


def test_fork_then_different_continuations(model):
    prompt = tokens(45, 6)  # ends mid-page: the shared last page is copied on write
    pc = paged(model)
    pc.allocate("a", prompt)
    model(mx.array([prompt]), cache=pc.views(["a"]))
    pc.fork("a", "b")
    cont_a, cont_b = tokens(6, 7), tokens(6, 8)
    got_a = decode(pc, model, "a", cont_a)
    got_b = decode(pc, model, "b", cont_b)
    close(got_a, reference(model, prompt + cont_a)[45:])
    close(got_b, reference(model, prompt + cont_b)[45:])
    assert pc.block_table("a")[:5] == pc.block_table("b")[:5]
    assert pc.block_table("a")[5] != pc.block_table("b")[5]


def test_batched_decode_of_8_mixed_lengths_equals_each_alone(model):
    lengths = [5, 17, 33, 8, 40, 24, 1, 29]
    prompts = [tokens(n, 10 + i) for i, n in enumerate(lengths)]
    steps = [tokens(4, 30 + i) for i in range(8)]
    ids = [f"s{i}" for i in range(8)]
    pc = paged(model, num_blocks=256)
    for sid, p in zip(ids, prompts):
        pc.allocate(sid, p)
    # batched ragged prefill: right-padded to the longest prompt
    width = max(lengths)
    batch = mx.array([p + [0] * (width - len(p)) for p in prompts])
    logits = model(batch, cache=pc.views(ids))
    for b, p in enumerate(prompts):
        close(logits[b, : len(p)], reference(model, p))
    for k in range(4):
        for sid, s in zip(ids, steps):
            pc.append(sid, [s[k]])
        views = pc.views(ids)
        assert isinstance(views[0].offset, mx.array)
        out = model(mx.array([[s[k]] for s in steps]), cache=views)
        for b, p in enumerate(prompts):
            want = reference(model, p + steps[b][: k + 1])[-1]
            close(out[b, 0], want)


def test_ragged_chunks_with_explicit_num_new():
    model = get("llama")
    a, b = tokens(30, 40), tokens(12, 41)
    pc = paged(model)
    pc.allocate("a", a)
    pc.allocate("b", b)
    # chunk 1: 10 tokens of a, all 12 of b (padded to 12)
    x = mx.array([a[:10] + [0, 0], b])
    out = model(x, cache=pc.views(["a", "b"], num_new=[10, 12]))
    close(out[0, :10], reference(model, a)[:10])
    close(out[1], reference(model, b))
    # chunk 2: the rest of a alone
    out = model(mx.array([a[10:]]), cache=pc.views(["a"]))
    close(out[0], reference(model, a)[10:])


@pytest.mark.parametrize("name", ["llama", "sliding"])
def test_rollback_then_continue_equals_run_without_drafts(name):
    model = get(name)
    prompt, drafts, accepted_next = tokens(37, 50), tokens(4, 51), tokens(3, 52)
    pc = paged(model)
    pc.allocate("a", prompt)
    model(mx.array([prompt]), cache=pc.views(["a"]))
    # speculative step: write K/V for 4 drafts in one forward, keep the first one
    pc.append("a", drafts)
    views = pc.views(["a"])
    model(mx.array([drafts]), cache=views)
    assert views[0].is_trimmable()
    assert [v.trim(3) for v in views] == [3, 3]  # mlx-lm's trim_prompt_cache path
    assert pc.num_tokens("a") == len(prompt) + 1
    got = decode(pc, model, "a", accepted_next)
    want = reference(model, prompt + drafts[:1] + accepted_next)[-3:]
    close(got, want)
    # and the manager-level truncate
    pc.truncate("a", len(prompt))
    close(decode(pc, model, "a", drafts[1:2]), reference(model, prompt + drafts[1:2])[-1:])


def test_greedy_generate_step_on_views(model):
    prompt = tokens(21, 60)
    want = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=8), range(8))]
    pc = paged(model)
    alloc = pc.allocate("a", prompt)
    views = pc.views(["a"])
    got = [t for (t, _), _ in zip(
        generate_step(mx.array(prompt), model, max_tokens=8, prompt_cache=views,
                      prefill_step_size=8), range(8))]
    assert got == want
    assert alloc.num_cached_tokens == 0
    assert pc.num_computed("a") >= len(prompt) + 6
    pc.free("a")  # generated tokens have no ids here: only the prompt is cached
    pc.check_integrity()


def test_views_report_offsets_and_nbytes():
    model = get("llama")
    pc = paged(model)
    pc.allocate("a", tokens(20, 70))
    views = pc.views(["a"])
    assert views[0].offset == 0
    model(mx.array([tokens(20, 70)]), cache=views)
    assert views[0].offset == 20 and views[1].offset == 20
    per_token = 2 * 2 * 16 * 4  # K+V, 2 kv heads, head_dim 16, float32
    assert views[0].nbytes == 3 * 8 * per_token  # 3 pages of 8 tokens
