"""Prefix reuse on sliding-window models, checked against mlx-lm's own caches.

Tiny random-weight gemma3-, gpt-oss- (attention sinks), cohere2- and
recurrent_gemma-like models (windows of 12..20 tokens, pages of 4) run on
`PagedCache`: a conversation resumed, a shared system prompt and a fork reuse
cached tokens (as many as a full-attention model of the same prompts would),
and the logits of what is computed equal mlx-lm's caches run on the whole
prompt. The reference is always the model on `make_prompt_cache`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cache import PagedCache
from scheduler import Engine, SamplingParams
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak
from tests.tiny_models import SLIDING_MODELS, built

TOL = 1e-4
BLOCK = 4


@pytest.fixture(params=sorted(SLIDING_MODELS))
def case(request):
    name = request.param
    _, vocab = SLIDING_MODELS[name]
    return name, built(name), vocab


def tokens(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def storage(name, model, num_blocks=96):
    hybrid = name == "recurrent_gemma"
    return PagedCache.for_model(model, num_blocks, BLOCK, num_slots=8 if hybrid else 0)


def reference(model, toks):
    """mlx-lm's logits at every position of `toks`, one prefill."""
    return model(mx.array([toks]), cache=make_prompt_cache(model))[0]


def forward(pc, model, seq, toks):
    with pc.step([seq]) as views:
        logits = model(mx.array([toks]), cache=views)[0]
        mx.eval(logits)
    return logits


def greedy(pc, model, seq, logits, n):
    """Decode n greedy tokens after `logits`; returns them (all computed)."""
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[-1]).item())
        out.append(token)
        pc.append(seq, [token])
        logits = forward(pc, model, seq, [token])
    return out


def close(got, want):
    diff = mx.abs(got - want).max().item()
    assert diff < TOL, diff


def test_a_resumed_conversation_reuses_every_computed_token(case):
    name, model, vocab = case
    pc = storage(name, model)
    turn1 = tokens(vocab, 30, 1)
    assert pc.allocate("t1", turn1).num_cached_tokens == 0
    answer = greedy(pc, model, "t1", forward(pc, model, "t1", turn1), 6)
    pc.free("t1")  # 36 computed tokens go into every group's trie
    turn2 = turn1 + answer + tokens(vocab, 9, 2)
    alloc = pc.allocate("t2", turn2)
    assert alloc.num_cached_tokens == len(turn1) + len(answer)
    got = forward(pc, model, "t2", turn2[alloc.num_cached_tokens :])
    close(got, reference(model, turn2)[alloc.num_cached_tokens :])
    pc.check_integrity()


def test_a_shared_system_prompt_is_reused_by_the_next_request(case):
    name, model, vocab = case
    pc = storage(name, model)
    system = tokens(vocab, 26, 3)
    first = system + [1, 2, 3, 4, 5]
    pc.allocate("a", first)
    forward(pc, model, "a", system)  # a prefill chunk ending at the shared part
    pc.cache_prefix("a")
    forward(pc, model, "a", first[len(system) :])
    second = system + [7, 8, 9]
    alloc = pc.allocate("b", second)
    assert alloc.num_cached_tokens == len(system)
    close(forward(pc, model, "b", second[len(system) :]), reference(model, second)[len(system) :])
    pc.check_integrity()


def test_forks_share_the_prompt_and_decode_apart(case):
    name, model, vocab = case
    pc = storage(name, model)
    prompt = tokens(vocab, 27, 4)
    pc.allocate("a", prompt)
    forward(pc, model, "a", prompt)
    pc.fork("a", "b")
    for seq, tail in (("a", [3, 1, 4, 1, 5]), ("b", [2, 7, 1, 8, 2])):
        got = []
        for token in tail:
            pc.append(seq, [token])
            got.append(forward(pc, model, seq, [token]))
        want = reference(model, prompt + tail)[len(prompt) :]
        close(mx.concatenate(got), want)
    pc.check_integrity()


def test_a_long_conversation_keeps_only_window_pages_in_sliding_groups():
    model = built("gemma3")
    pc = storage("gemma3", model, num_blocks=128)
    conversation: list[int] = []
    for turn in range(4):
        conversation = conversation + tokens(101, 20, 10 + turn)
        alloc = pc.allocate("c", conversation)
        logits = forward(pc, model, "c", conversation[alloc.num_cached_tokens :])
        conversation = conversation + greedy(pc, model, "c", logits, 3)
        pc.free("c")
    full, sliding = pc.store.group_usage()
    # The full group keeps the whole history (and, at each earlier turn end
    # inside a page, that page as it was then: the trie keeps every turn end
    # as a node for the sliding group); the sliding group (window 16) the
    # pages of the window before each cached end (one per turn).
    turn_ends = [23 * (turn + 1) for turn in range(4)]
    assert turn_ends[-1] == len(conversation)
    num_straddled = sum(1 for end in turn_ends[:-1] if end % BLOCK)
    assert full.num_cached_pages == -(-len(conversation) // BLOCK) + num_straddled
    window_pages = -(-16 // BLOCK) + 1
    assert sliding.num_cached_pages <= 4 * window_pages < full.num_cached_pages
    pc.check_integrity()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_engine_reuses_shared_prefixes_on_sliding_models(case, preemption):
    """Six prompts sharing a 30-token prefix (windows of 12..20 tokens): the
    engine's greedy outputs are mlx-lm's, later prompts hit the prefix, and a
    pool small enough to preempt leaks nothing."""
    name, model, vocab = case
    shared = tokens(vocab, 30, 20)
    prompts = [shared + tokens(vocab, 2 + i, 30 + i) for i in range(6)]
    want = [greedy_reference(model, p, 8) for p in prompts]
    engine = Engine(model, num_blocks=24, block_size=BLOCK, max_num_batched_tokens=48,
                    max_num_seqs=4, preemption=preemption, num_host_blocks=64,
                    num_host_slots=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.tokens for o in outs] == want
    stats = engine.scheduler.stats
    assert stats.num_preempted_recompute_total + stats.num_preempted_swap_total > 0
    assert stats.num_prefix_hit_tokens_total >= 2 * len(shared)  # two or more reuse it whole
    assert_no_leak(engine)
