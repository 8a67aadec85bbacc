"""`StatusLine`: the server's periodic status line, on a real engine with a
fake clock; every figure is checked against counts made here (requests
added, tokens returned, pages the store reports)."""

from __future__ import annotations

import pytest

from blockmgr.errors import InvalidArgument
from scheduler import Engine, SamplingParams
from scheduler.serving.metrics import ServingMetrics
from scheduler.serving.status import StatusLine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_status_line_reports_the_interval_and_stays_quiet_when_idle(tiny):
    model, tok = tiny
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tok)
    engine.generate(["warm up"], SamplingParams(max_tokens=3, ignore_eos=True))
    clock = Clock()
    status = StatusLine(2.0, clock=clock)
    metrics = ServingMetrics()
    assert status.poll(engine, metrics) is None  # the baseline: the warm-up is not counted
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = engine.generate(["Hello world", "The quick brown fox"], params)
    generated = sum(len(o.tokens) for o in outs)
    assert generated == 10
    clock.now += 1.0
    assert status.poll(engine, metrics) is None  # not due yet
    clock.now += 1.5
    for i in range(3):  # waiting, never stepped
        engine.add_request(f"prompt {i}", params)
    line = status.poll(engine, metrics)
    assert line is not None
    assert line.startswith("running 0, waiting 3, ")
    used = 100 * (64 - engine.cache.num_free_blocks) / 64
    assert f"KV {used:.1f}% of 64 pages" in line
    assert f"generation {generated / 2.5:.1f} tok/s" in line
    while engine.has_unfinished():
        engine.step()
    clock.now += 2.0
    assert "generation 7.5 tok/s" in status.poll(engine, metrics)  # 3 x 5 tokens in 2 s
    clock.now += 2.0
    assert status.poll(engine, metrics) is None  # idle: nothing ran since


def test_status_line_hit_rate_is_the_metrics(tiny):
    model, tok = tiny
    engine = Engine(model, num_blocks=64, block_size=8)
    metrics = ServingMetrics(num_prompt_tokens=40, num_cached_tokens=10)
    clock = Clock()
    status = StatusLine(1.0, clock=clock)
    status.poll(engine, metrics)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    clock.now += 1.0
    assert "prefix hit 25.0%" in status.poll(engine, metrics)


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), "5"])
def test_bad_intervals_are_refused(interval):
    with pytest.raises((InvalidArgument, TypeError)):
        StatusLine(interval)
