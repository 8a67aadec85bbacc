"""The engine's model-runner seam (`scheduler.engine.runner`): the engine
asks its `Runner` to run each batch (forward and sampling) and does the
rest. A runner injected in its place that fails (persistently for one
request, or transiently anywhere) leaves every other request's greedy
output equal to mlx-lm's own, and nothing leaked; a runner that only
watches sees every scheduled row exactly once per success."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import pytest

from scheduler import Engine, RequestStatus, SamplingParams
from scheduler.core.scheduler import ScheduledSeq
from scheduler.engine.runner import ModelRunner, Runner, StepSampling
from tests.reference import greedy_reference
from tests.scheduler.test_engine import assert_no_leak
from tests.tiny_models import ATTENTION_VOCAB, HYBRID_VOCAB, built

FAULT = "injected runner fault"
MAX_TOKENS = 6
VOCABS = {"llama": ATTENTION_VOCAB, "lfm2": HYBRID_VOCAB}


class FaultyRunner:
    """A `Runner` around the engine's own that raises, before running, on
    the calls `fail_calls` (1-based) and on any batch holding a request of
    `poisoned`; counts the rows it ran per request."""

    def __init__(self, inner: Runner, fail_calls: Sequence[int] = (),
                 poisoned: frozenset[Hashable] = frozenset()) -> None:
        self.inner = inner
        self.fail_calls = set(fail_calls)
        self.poisoned = poisoned
        self.num_calls = 0
        self.num_failures = 0
        self.rows: dict[Hashable, int] = {}

    def run(self, batch: Sequence[ScheduledSeq], sampling: StepSampling) -> dict[Hashable, Any]:
        self.num_calls += 1
        if self.num_calls in self.fail_calls or any(
                s.request_id in self.poisoned for s in batch):
            self.num_failures += 1
            raise RuntimeError(FAULT)
        sampled = self.inner.run(batch, sampling)
        for s in batch:
            self.rows[s.request_id] = self.rows.get(s.request_id, 0) + 1
        return sampled

    def warm_up(self) -> None:
        self.inner.warm_up()


def prompts_for(vocab: int, count: int) -> list[list[int]]:
    """`count` prompts sharing a 9-token head (prefix hits), lengths 11..."""
    head = [(7 * i + 3) % vocab for i in range(9)]
    return [head + [(13 * k + j + 1) % vocab for j in range(2 + k)] for k in range(count)]


def engine_for(model: Any, **kwargs: Any) -> Engine:
    return Engine(model, num_blocks=96, block_size=4, max_num_batched_tokens=48,
                  max_num_seqs=6, **kwargs)


def test_the_engine_runs_its_batches_through_a_model_runner():
    engine = engine_for(built("llama"))
    assert isinstance(engine.runner, ModelRunner)
    assert engine.runner.model is engine.model and engine.runner.cache is engine.cache


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_a_runner_failing_for_one_request_aborts_it_alone(name):
    model = built(name)
    prompts = prompts_for(VOCABS[name], 5)
    want = [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
    engine = engine_for(model, prefill_batch=2)
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
    runner = FaultyRunner(engine.runner, poisoned=frozenset({ids[3]}))
    engine.runner = runner
    requests = [engine.get_request(rid) for rid in ids]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    bad = requests[3]
    assert bad.status is RequestStatus.FINISHED_ABORTED
    assert isinstance(bad.error, RuntimeError) and FAULT in str(bad.error)
    assert bad.outputs[0] == []
    for i, request in enumerate(requests):
        if i != 3:
            assert request.outputs[0] == want[i], i
            assert request.status is not RequestStatus.FINISHED_ABORTED
    assert engine.stats.num_forward_errors == runner.num_failures > 0
    assert ids[3] not in runner.rows  # none of its rows ever ran
    assert_no_leak(engine)


@pytest.mark.parametrize("name", sorted(VOCABS))
@pytest.mark.parametrize("fail_calls", [(1,), (2, 3), (1, 4, 5, 9)])
def test_transient_runner_faults_leave_every_output_right(name, fail_calls):
    model = built(name)
    prompts = prompts_for(VOCABS[name], 4)
    want = [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
    engine = engine_for(model, max_forward_retries=len(fail_calls) + 1)
    runner = FaultyRunner(engine.runner, fail_calls=fail_calls)
    engine.runner = runner
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.tokens for o in outs] == want
    assert all(o.finish_reasons == [RequestStatus.FINISHED_LENGTH] for o in outs)
    assert engine.stats.num_forward_errors == runner.num_failures == len(fail_calls)
    assert engine.stats.num_forwards == runner.num_calls - runner.num_failures
    assert_no_leak(engine)


def test_an_interrupt_in_the_runner_is_reraised_and_the_next_step_continues():
    model = built("llama")
    prompts = prompts_for(ATTENTION_VOCAB, 3)
    want = [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
    engine = engine_for(model)
    inner = engine.runner

    class Interrupting(FaultyRunner):
        def run(self, batch, sampling):
            if self.num_calls == 1:  # the second call
                self.num_calls += 1
                raise KeyboardInterrupt
            return super().run(batch, sampling)

    engine.runner = Interrupting(inner)
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
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
    engine.runner = inner
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))  # prefix hits now
    assert [o.tokens for o in outs] == want
    assert_no_leak(engine)
