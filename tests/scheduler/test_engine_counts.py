"""The engine has one computed count per sequence: the store's record
(`blockmgr.Progress`), which the storage's forwards move (`PagedCache`,
mlx-lm's cache offset) and the scheduler plans each step from, and
`Engine.check_integrity` checks that the scheduler reads that record for
every sequence it holds. Checked after every step of runs that preempt (by
recompute and by swap), hit the prefix cache, fork samples and decode
speculatively, on an attention and a hybrid model; a count the storage
moves is the one the scheduler plans from; and a sequence replaced behind
the scheduler's back is caught."""

from __future__ import annotations

import pytest

from blockmgr.errors import IntegrityError
from scheduler import Engine, SamplingParams
from tests.scheduler.test_engine import (
    MAX_TOKENS,
    assert_no_leak,
    assert_preempted,
    get,
    preempting_engine,
)
from tests.scheduler.test_speculative import draft, refs
from tests.tiny_models import built


def run_checked(engine: Engine, prompts, params) -> list[list[list[int]]]:
    """Generate with `check_integrity()` after every step; each prompt's
    samples' tokens."""
    ids = [engine.add_request(p, params) for p in prompts]
    samples: dict = {i: {} for i in ids}
    num_checked = 0
    while engine.has_unfinished():
        for out in engine.step():
            for index, tokens in out.new_tokens.items():
                samples[out.request_id].setdefault(index, []).extend(tokens)
        engine.check_integrity()
        num_checked += 1
    assert num_checked > 1
    return [[samples[i][k] for k in sorted(samples[i])] for i in ids]


@pytest.mark.parametrize("name", ["llama", "lfm2"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_counts_agree_after_every_step_of_a_preempting_run(name, preemption):
    model, _, prompts, want = get(name)
    engine = preempting_engine(model, preemption)
    outputs = run_checked(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert outputs == [[w] for w in want]
    assert_preempted(engine, preemption)
    assert_no_leak(engine)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_the_counts_agree_after_every_step_of_a_run_with_prefix_hits(name):
    model, _, prompts, want = get(name)
    engine = Engine(model, num_blocks=256, block_size=8, max_num_batched_tokens=48,
                    max_num_seqs=6)
    outputs = run_checked(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert outputs == [[w] for w in want]
    assert engine.scheduler.stats.num_prefix_hit_tokens_total > 0
    assert_no_leak(engine)


def test_the_counts_agree_after_every_step_of_forked_samples():
    model, _, prompts, want = get("lfm2")
    engine = Engine(model, num_blocks=128, block_size=8, max_num_batched_tokens=16)
    outputs = run_checked(engine, prompts[:3], SamplingParams(max_tokens=MAX_TOKENS, n=3))
    assert outputs == [[w] * 3 for w in want[:3]]
    assert_no_leak(engine)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_the_counts_agree_after_every_step_of_speculative_decoding(name):
    """A draft that disagrees: rejections roll the storage back (a hybrid
    model to its checkpoint, computing the tokens since it again), and the
    scheduler takes the count the storage holds after the commit."""
    prompts, want = refs(name)
    engine = Engine(built(name), num_blocks=256, block_size=8, max_num_batched_tokens=96,
                    max_num_seqs=8, draft_model=draft(name, "disagrees"),
                    num_speculative_tokens=3)
    outputs = run_checked(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert outputs == [[w] for w in want]
    assert (engine.stats.num_recomputed_tokens > 0) == (name == "lfm2")
    assert_no_leak(engine)


def decoding_engine() -> tuple[Engine, list[list[int]]]:
    """An engine with one request past its prefill and first decode step,
    its counts checked; and the test prompts."""
    model, _, prompts, _ = get("llama")
    engine = Engine(model, num_blocks=64, block_size=8)
    engine.add_request(prompts[0], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    engine.step()
    engine.check_integrity()
    return engine, prompts


def test_the_scheduler_plans_from_the_count_the_storage_moves():
    engine, _ = decoding_engine()
    (seq_id,) = engine.scheduler.running_ids()
    num_tokens = engine.cache.num_tokens(seq_id)
    assert engine.scheduler.sequence_info(seq_id).num_computed == num_tokens
    engine.cache.truncate(seq_id, num_tokens - 1)  # the storage forgets a token
    assert engine.cache.num_computed(seq_id) == num_tokens - 1
    assert engine.scheduler.sequence_info(seq_id).num_computed == num_tokens - 1  # no copy


def test_a_sequence_replaced_behind_the_schedulers_back_is_caught():
    engine, _ = decoding_engine()
    (seq_id,) = engine.scheduler.running_ids()
    tokens = engine.cache.tokens(seq_id)
    engine.cache.free(seq_id)
    engine.cache.allocate(seq_id, tokens)  # the same id: another sequence, another count
    engine.cache.check_integrity()  # consistent in itself
    with pytest.raises(IntegrityError, match="the scheduler reads another count than its store"):
        engine.check_integrity()


def test_a_sequence_in_storage_that_no_request_owns_is_caught():
    engine, prompts = decoding_engine()
    engine.cache.allocate("stray", prompts[1])  # behind the scheduler's back
    with pytest.raises(IntegrityError, match="storage holds 'stray', which no live request owns"):
        engine.check_integrity()
