"""Engine on tiny random-weight mlx-lm models (float32) vs mlx-lm's own generation.

The reference for every prompt is mlx-lm's `generate_step` on the model's
own caches, one prompt at a time; nothing is hard-coded.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Engine, RequestStatus, SamplingParams
from tests.leaks import assert_only_the_cache_holds
from tests.reference import greedy_reference
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built

MAX_TOKENS = 10
BUILDERS = {"llama": ATTENTION_VOCAB, "lfm2": HYBRID_VOCAB}
_cache: dict = {}


def get(name):
    """(model, vocab, 16 prompts, mlx-lm greedy outputs), built once."""
    if name not in _cache:
        vocab = BUILDERS[name]
        model = built(name)
        prompts = make_prompts(vocab)
        want = [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
        _cache[name] = (model, vocab, prompts, want)
    return _cache[name]


def make_prompts(vocab, seed=0):
    """16 prompts of 2..69 tokens; most share one of two prefixes."""
    rng = np.random.default_rng(seed)
    shared = [rng.integers(0, vocab, n).tolist() for n in (40, 23)]
    prompts = []
    for i in range(16):
        head = shared[i % 2] if i % 3 else []
        prompts.append(head + rng.integers(0, vocab, int(rng.integers(2, 30))).tolist())
    return prompts


def assert_no_leak(engine):
    engine.check_integrity()
    assert_only_the_cache_holds(engine.cache.store)


def test_greedy_equals_mlx_lm_on_16_prompts(name):
    model, _, prompts, want = get(name)
    engine = Engine(model, num_blocks=256, block_size=8, max_num_batched_tokens=96,
                    max_num_seqs=16)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outs] == want
    assert all(o.finish_reasons == [RequestStatus.FINISHED_LENGTH] for o in outs)
    assert engine.scheduler.stats.num_prefix_hit_tokens_total > 0  # shared prefixes hit
    for o in outs:
        m = o.metrics
        assert m.time_to_first_token is not None and m.time_to_first_token >= 0
        assert m.time_per_output_token is not None and m.time_per_output_token >= 0
    assert_no_leak(engine)


def preempting_engine(model, preemption: str) -> Engine:
    """An engine whose pool of 12 pages of 8 makes 16 prompts preempt."""
    return Engine(model, num_blocks=12, block_size=8, max_num_batched_tokens=64,
                  max_num_seqs=8, preemption=preemption, num_host_blocks=64,
                  num_host_slots=16)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_tiny_pool_preempts_and_outputs_stay_equal(name, preemption):
    model, _, prompts, want = get(name)
    engine = preempting_engine(model, preemption)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outs] == want
    assert_preempted(engine, preemption)
    assert_no_leak(engine)


def assert_preempted(engine, preemption):
    """The engine preempted at least once, the way it was told to."""
    stats = engine.scheduler.stats
    if preemption == "swap":
        assert stats.num_preempted_swap_total > 0
    else:
        assert stats.num_preempted_recompute_total > 0


def test_n4_stores_the_prompt_pages_once():
    model, _, prompts, _ = get("llama")
    prompt = (prompts[1] + prompts[2])[:32]  # 4 full pages of 8
    engine = Engine(model, num_blocks=64, block_size=8, enable_prefix_cache=False)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=3))
    bm = engine.cache.block_manager
    used = []
    while engine.has_unfinished():
        engine.step()
        used.append(bm.config.num_blocks - bm.num_free_blocks)
    # prompt pages once + one page per sample for its generated tokens
    assert max(used) == 4 + 4
    separate = Engine(model, num_blocks=64, block_size=8, enable_prefix_cache=False)
    for i in range(4):
        separate.add_request(prompt, SamplingParams(max_tokens=4, seed=i))
    peak = 0
    while separate.has_unfinished():
        separate.step()
        sbm = separate.cache.block_manager
        peak = max(peak, sbm.config.num_blocks - sbm.num_free_blocks)
    assert peak == 4 * (4 + 1)
    assert engine.get_request(rid) is None
    assert_no_leak(engine)


def test_n4_greedy_samples_all_equal_mlx_lm():
    model, _, prompts, want = get("lfm2")
    engine = Engine(model, num_blocks=128, block_size=8)
    (out,) = engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, n=4))
    assert out.outputs == [want[2]] * 4
    assert_no_leak(engine)


def test_streaming_yields_the_generated_tokens_in_order():
    model, _, prompts, want = get("llama")
    engine = Engine(model, num_blocks=256, block_size=8)
    seen: dict = {}
    for out in engine.stream(prompts[:4], SamplingParams(max_tokens=MAX_TOKENS)):
        seen.setdefault(str(out.request_id), []).extend(out.new_tokens.get(0, []))
    assert [seen[f"req-{i}"] for i in range(4)] == want[:4]
    got = []
    engine.add_request(prompts[5], SamplingParams(max_tokens=MAX_TOKENS),
                       callback=lambda o: got.extend(o.new_tokens.get(0, [])))
    while engine.has_unfinished():
        engine.step()
    assert got == want[5]


def test_top_p_tiny_is_greedy_and_seeds_reproduce():
    model, _, prompts, want = get("llama")
    engine = Engine(model, num_blocks=256, block_size=8)
    outs = engine.generate(prompts[:3], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0,
                                                       top_p=1e-6))
    assert [o.tokens for o in outs] == want[:3]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, seed=11)
    a = engine.generate([prompts[4]], params)[0].tokens
    b = engine.generate([prompts[4], prompts[6]], [params, SamplingParams(seed=2)])[0].tokens
    assert a == b


def test_stop_token_and_abort_free_everything(name):
    model, _, prompts, want = get(name)
    engine = Engine(model, num_blocks=64, block_size=8, max_num_batched_tokens=32)
    stop = want[0][3]
    first = want[0].index(stop)
    outs = []
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=MAX_TOKENS,
                                                        stop_token_ids=(stop,)),
                             callback=outs.append)
    victim = engine.add_request(prompts[1], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    engine.abort(victim)  # mid-prefill
    while engine.has_unfinished():
        engine.step()
    tokens = [t for o in outs for t in o.new_tokens.get(0, [])]
    assert tokens == want[0][: first + 1]
    assert outs[-1].status is RequestStatus.FINISHED_STOPPED
    assert engine.get_request(rid) is None
    assert_no_leak(engine)
