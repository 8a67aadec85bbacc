"""pytest-benchmark: scheduler bookkeeping per step (no model, no MLX).

Run: pytest benchmarks/bench_scheduler.py --benchmark-only

One step = `schedule()` + `update()` over a plain BlockManager with 256
running requests in decode (each step appends one token per request, so a
page boundary is crossed every 16 steps). Target: <= 10 us per request.
"""

from __future__ import annotations

import pytest

from blockmgr import BlockManager, BlockManagerConfig
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

NUM_RUNNING = 256


def decoding_scheduler(num_running: int, num_slots: int = 0, preemption: str = "recompute"):
    bm = BlockManager(BlockManagerConfig(num_blocks=65536, block_size=16, num_slots=num_slots))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1 << 20, max_num_seqs=num_running,
                                  preemption=preemption), bm)
    for i in range(num_running):
        s.add_request(Request(i, [i % 97 + t for t in range(200)],
                              SamplingParams(max_tokens=1 << 30)))
    step(s)  # prefill: every request now decodes
    return s


def step(s: Scheduler) -> None:
    out = s.schedule()
    s.update(out, {item.seq_id: 1 for item in out.seqs})


@pytest.mark.parametrize("num_slots", [0, 2 * NUM_RUNNING], ids=["attention", "hybrid"])
def test_decode_step_256_running(benchmark, num_slots):
    s = decoding_scheduler(NUM_RUNNING, num_slots)
    benchmark.extra_info["requests"] = NUM_RUNNING
    benchmark(step, s)
    assert s.num_running == NUM_RUNNING
    per_request_us = benchmark.stats.stats.mean / NUM_RUNNING * 1e6
    benchmark.extra_info["us_per_request"] = round(per_request_us, 2)
    print(f"\n{num_slots=}: {per_request_us:.2f} us per request per step")
