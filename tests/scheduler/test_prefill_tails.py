"""A sampling prefill chunk's last token rides in the step's decode forward.

The step runs each such chunk's head (all but the last token, no logits)
first, then one forward over the decode rows plus the chunks' last tokens,
so a step with P sampling prefills and decode rows makes P + 1 forwards
(`prefill_batch` k: ceil(P / k) + 1), not 2P + 1. Outputs are compared with
mlx-lm's greedy decode, with and without a fault in that shared forward.
"""

from __future__ import annotations

import pytest

from scheduler import Engine, SamplingParams
from tests.cache.test_store_faults import FailingModel, tokens
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built

MAX_TOKENS = 6


def _engine(model, prefill_batch: int) -> Engine:
    return Engine(model, num_blocks=128, block_size=4, max_num_batched_tokens=256,
                  prefill_batch=prefill_batch, max_forward_retries=3)


def _late_arrivals(engine: Engine, early, late):
    """Start `early`, step once so they decode, then add `late`: the next
    step holds the late prompts' whole prefill beside the early decode rows.
    Returns the requests."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in early]
    engine.step()
    ids += [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in late]
    return [engine.get_request(i) for i in ids]


@pytest.mark.parametrize("name, vocab", [("llama", ATTENTION_VOCAB), ("lfm2", HYBRID_VOCAB)])
@pytest.mark.parametrize("prefill_batch, forwards", [(1, 3 + 1), (2, 2 + 1), (3, 1 + 1)])
def test_prefill_tails_join_the_decode_forward(name, vocab, prefill_batch, forwards):
    model = built(name)
    early = [tokens(vocab, 9, 1), tokens(vocab, 12, 2)]
    late = [tokens(vocab, 7, 3), tokens(vocab, 15, 4), tokens(vocab, 10, 5)]
    engine = _engine(model, prefill_batch)
    if not engine.batching.decode or (prefill_batch > 1 and not engine.batching.prefill):
        pytest.skip(f"{name} does not batch here")
    requests = _late_arrivals(engine, early, late)
    before = engine.stats.num_forwards
    engine.step()
    assert engine.stats.num_forwards - before == forwards
    while engine.has_unfinished():
        engine.step()
    outputs = [r.outputs[0] for r in requests]
    assert outputs == [greedy_reference(model, p, MAX_TOKENS) for p in early + late]
    assert_no_leak(engine)


@pytest.mark.parametrize("name, vocab", [("llama", ATTENTION_VOCAB), ("lfm2", HYBRID_VOCAB)])
def test_a_fault_in_the_shared_forward_keeps_the_heads_and_every_output(name, vocab):
    """The forward of decode rows + last tokens raises once: the heads stay
    computed (the late requests' next step is one token each) and every
    output still equals mlx-lm's."""
    model = built(name)
    early = [tokens(vocab, 9, 1), tokens(vocab, 12, 2)]
    late = [tokens(vocab, 7, 3), tokens(vocab, 15, 4)]
    failing = FailingModel(model, layer=len(model.layers) - 1)
    engine = _engine(failing, 1)
    requests = _late_arrivals(engine, early, late)
    failing.fail_at, failing.calls = {3}, 0  # heads are forwards 1 and 2, the shared one 3
    engine.step()
    assert engine.stats.num_forward_errors == 1
    for request, prompt in zip(requests[2:], late):
        assert request.metrics.num_computed_tokens == len(prompt) - 1
        assert request.outputs[0] == []
    while engine.has_unfinished():
        engine.step()
    outputs = [r.outputs[0] for r in requests]
    assert outputs == [greedy_reference(model, p, MAX_TOKENS) for p in early + late]
    assert_no_leak(engine)
