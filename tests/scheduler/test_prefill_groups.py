"""Prefill chunks of one step share forwards, with bounded padding.

`prefill_groups` is checked against its specification (every chunk once, at
most `max_rows` per forward, padding within the bound, a group closed only
when the next chunk would break the bound); the Engine's forwards are
recorded on a wave of one long and several short prompts (the short ones
share a forward, none is padded to the long one) and its outputs compared
with mlx-lm's greedy decode, with a fault in one group too.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from scheduler import Engine, RequestStatus, SamplingParams
from scheduler.core.prefill_groups import PAD_FRACTION, PAD_TOKENS, prefill_groups
from tests.cache.test_store_faults import FailingModel, tokens
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built


@dataclass(eq=False)
class Chunk:
    num_tokens: int


def _over_bound(lengths: list[int]) -> bool:
    padded = len(lengths) * max(lengths)
    waste = padded - sum(lengths)
    return waste > PAD_TOKENS and waste > PAD_FRACTION * padded


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), max_size=40), max_rows=st.integers(1, 8))
def test_groups_hold_every_chunk_once_within_the_bounds(lengths, max_rows):
    chunks = [Chunk(n) for n in lengths]
    groups = prefill_groups(chunks, max_rows)
    flat = [c for g in groups for c in g]
    assert sorted(map(id, flat)) == sorted(map(id, chunks))
    for group in groups:
        assert 1 <= len(group) <= max_rows
        assert not _over_bound([c.num_tokens for c in group])
    for group, following in zip(groups, groups[1:]):
        if len(group) < max_rows:  # closed early: the next chunk would break the bound
            assert _over_bound([c.num_tokens for c in group] + [following[0].num_tokens])


def test_equal_lengths_fill_whole_groups_and_long_chunks_go_alone():
    assert [len(g) for g in prefill_groups([Chunk(12) for _ in range(32)], 8)] == [8] * 4
    assert [len(g) for g in prefill_groups([Chunk(12) for _ in range(32)], 32)] == [32]
    groups = prefill_groups([Chunk(12)] * 3 + [Chunk(2000)] + [Chunk(12)] * 4, 8)
    assert [[c.num_tokens for c in g] for g in groups] == [[2000], [12] * 7]


class RecordingModel(FailingModel):
    """The model, with the input shape of every forward after `arm()`."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, inputs, cache=None):
        if self.calls is not None:
            self.shapes.append(tuple(inputs.shape))
        return super().__call__(inputs, cache=cache)


def _wave(vocab):
    short = [tokens(vocab, 8, 20 + i) for i in range(3)]
    return short[:2] + [tokens(vocab, 100, 30)] + short[2:]


@pytest.mark.parametrize("name, vocab", [("llama", ATTENTION_VOCAB), ("lfm2", HYBRID_VOCAB)])
def test_a_wave_pads_no_short_prompt_to_a_long_one(name, vocab):
    model = RecordingModel(built(name))
    engine = Engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=256,
                    prefill_batch=4)
    if not (engine.batching.decode and engine.batching.prefill):
        pytest.skip(f"{name} does not batch here")
    prompts = _wave(vocab)
    ids = [engine.add_request(p, SamplingParams(max_tokens=5)) for p in prompts]
    got = [engine.get_request(i) for i in ids]
    model.arm()
    engine.step()
    # heads: the long one alone, the three short ones together; then the
    # decode forward with every prompt's last token
    assert sorted(model.shapes) == [(1, 99), (3, 7), (4, 1)]
    while engine.has_unfinished():
        engine.step()
    assert [r.outputs[0] for r in got] == [greedy_reference(model.model, p, 5) for p in prompts]
    assert_no_leak(engine)


def test_a_failing_group_leaves_the_other_group_correct():
    """Every forward holding the long prompt raises: its request ends aborted
    with the error once it fails alone; the short prompts' group runs and
    their outputs equal mlx-lm's; nothing leaks."""
    prompts = _wave(ATTENTION_VOCAB)
    poison = prompts[2][5]
    assert all(poison not in p for i, p in enumerate(prompts) if i != 2)
    model = FailingModel(built("llama"), poison=poison)
    engine = Engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=256,
                    prefill_batch=4, max_forward_retries=2)
    ids = [engine.add_request(p, SamplingParams(max_tokens=5)) for p in prompts]
    got = [engine.get_request(i) for i in ids]
    model.arm()
    while engine.has_unfinished():
        engine.step()
    assert got[2].finish_reasons[0] is RequestStatus.FINISHED_ABORTED
    assert isinstance(got[2].error, RuntimeError)
    short = [0, 1, 3]
    assert [got[i].outputs[0] for i in short] == \
        [greedy_reference(model.model, prompts[i], 5) for i in short]
    assert_no_leak(engine)


def test_the_served_engine_runs_a_wave_in_few_forwards(tmp_path):
    """`load_engine` (what `blockmgr serve` runs) groups a wave of
    equal-length prompts 8 at a time: 16 prompts make two head forwards
    plus the decode forward, not 16 plus one, and the outputs equal
    mlx-lm's greedy decode."""
    from scheduler.serving.serve import load_engine, serve_config
    from tests.serve_model import build_model_dir

    engine, _ = load_engine(build_model_dir(tmp_path / "tiny"),
                            serve_config(num_blocks=256, block_size=8))
    if not (engine.batching.decode and engine.batching.prefill):
        pytest.skip("the tiny llama does not batch here")
    prompts = [tokens(engine.vocab_size, 12, 40 + i) for i in range(16)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = [engine.get_request(engine.add_request(p, greedy)) for p in prompts]
    before = engine.stats.num_forwards
    engine.step()
    assert engine.stats.num_forwards - before == 2 + 1
    while engine.has_unfinished():
        engine.step()
    assert [r.outputs[0] for r in requests] == \
        [greedy_reference(engine.model, p, 4) for p in prompts]
    assert_no_leak(engine)
