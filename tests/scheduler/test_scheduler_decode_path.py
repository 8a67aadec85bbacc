"""The decode-row path (the scheduler's `_decode_rows`, one `append_decode`
store call per run of rows; a row is a batch of one after a refusal; the
block manager's `_has_room_for_next_token` / `_rows_without_room` skip of a row that fits
its last page)
against rows one at a time and the store's general growth path.

Each simulation runs twice: as is, and with every row a batch of one and
every append through `_growth`. Every step's series and every request's
record must be equal.
The configurations force page pressure (preemption by recompute and by
swap), forks (n > 1 samples), hybrid slots and sliding windows, so the
shortcuts meet every case they must decline.
"""

from __future__ import annotations

import numpy as np
import pytest

import scheduler.core.scheduler as scheduler_module
from blockmgr import BlockManagerConfig
from blockmgr.errors import OutOfBlocks
from blockmgr.manager import BlockManager
from scheduler.core.request import Request, SamplingParams
from scheduler.core.scheduler import SchedulerConfig
from scheduler.simulator import SimulationConfig, WorkloadConfig, run_simulation
from scheduler.simulator.layout import layout_named

CASES = {
    "all-recompute": dict(mix={"chat": 1.0, "parallel": 1.0, "agent": 1.0}, num_blocks=160),
    "swap": dict(mix={"multiturn": 1.0, "parallel": 1.0}, num_blocks=160, preemption="swap",
                 num_host_blocks=400),
    "hybrid": dict(mix={"chat": 1.0, "parallel": 1.0}, num_blocks=300, num_slots=24,
                   layout="qwen3_next"),
    "sliding": dict(mix={"multiturn": 1.0}, num_blocks=300, layout="gemma3"),
}


def _config(mix, num_blocks, preemption="recompute", num_host_blocks=0, num_slots=0,
            layout="full") -> SimulationConfig:
    return SimulationConfig(
        workload=WorkloadConfig(mix=mix, num_requests=80, rate=6.0, seed=11, max_context=1024),
        block_manager=BlockManagerConfig(num_blocks=num_blocks, block_size=16,
                                         num_slots=num_slots, num_host_blocks=num_host_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=384, max_num_seqs=16,
                                  preemption=preemption),
        layout=layout_named(layout, 64 if layout == "gemma3" else None),
        check_every=4,
    )


def _recorded(config: SimulationConfig) -> tuple[dict, dict, dict]:
    result = run_simulation(config)
    metrics = result.metrics
    summary = {k: v for k, v in result.summary.items() if k != "bookkeeping"}
    steps = {k: v for k, v in metrics.step_arrays().items() if k != "bookkeeping"}
    return summary, steps, metrics.request_arrays()


def _no_decode_rows(running, start, limit) -> tuple[list, ...]:
    """`_decode_rows` finding no row: the batched path off."""
    return [], [], [], [], [], []


def _same_series(a: dict, b: dict) -> bool:
    """Equal keys and arrays (NaN equal to NaN: a TPOT of one token)."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_shortcuts_match_the_generic_path(name, monkeypatch):
    config = _config(**CASES[name])
    taken = {"rows": 0, "batched": 0, "batched_fits": 0}
    # private on purpose: counts or turns off an internal shortcut; no public call can
    decode_rows, plan_decode = scheduler_module._decode_rows, BlockManager._plan_decode

    def counted_decode_rows(running, start, limit):
        rows = decode_rows(running, start, limit)
        taken["batched"] += len(rows[0])
        taken["rows"] += limit == 1 and len(rows[0]) == 1
        return rows

    def counted_plan_decode(self, seqs):
        plan = plan_decode(self, seqs)
        growing = plan[0]
        taken["batched_fits"] += len(seqs) - len(growing)
        return plan

    monkeypatch.setattr(scheduler_module, "_decode_rows", counted_decode_rows)
    monkeypatch.setattr(BlockManager, "_plan_decode", counted_plan_decode)
    fast = _recorded(config)
    assert taken["batched"] > 1000  # the batched path was taken ...
    if config.layout.recurrent == 0 and not config.layout.sliding:
        assert taken["batched_fits"] > 500  # ... and the store's batched shortcut too
    if fast[0]["preemptions"]["total"]:
        assert taken["rows"] > 0  # rows after a refused batch went one by one

    # private on purpose: counts or turns off an internal shortcut; no public call can
    monkeypatch.setattr(scheduler_module, "_decode_rows",
                        lambda running, start, limit: decode_rows(running, start, 1))
    monkeypatch.setattr(BlockManager, "_has_room_for_next_token", lambda self, seq: False)
    monkeypatch.setattr(BlockManager, "_rows_without_room",
                        lambda self, seqs: list(range(len(seqs))))
    generic = _recorded(config)

    assert fast[0]["preemptions"]["total"] > 0 or name in ("hybrid", "sliding")
    assert fast[0]["checks"]["leaks"] == "ok"
    assert fast[0] == generic[0]
    assert _same_series(fast[1], generic[1])
    assert _same_series(fast[2], generic[2])


class _RefusingDecodeStore(BlockManager):
    """A store whose batched decode call refuses every batch of more than
    one row (as a pool with room for some rows only would), so every run of
    decode rows is gathered, refused and undone, then taken row by row."""

    num_refused = 0

    def append_decode(self, seq_ids, tokens):
        if len(seq_ids) > 1:
            self.num_refused += 1
            raise OutOfBlocks("refused for the test")
        return super().append_decode(seq_ids, tokens)


def _drive(monkeypatch, batched: bool) -> list[tuple]:
    """Steps of a small pressured run (forks, preemption) over a refusing
    store; every step's scheduled work and the whole state after it."""
    if not batched:
        # private on purpose: counts or turns off an internal shortcut; no public call can
        monkeypatch.setattr(scheduler_module, "_decode_rows", _no_decode_rows)
    bm = _RefusingDecodeStore(BlockManagerConfig(num_blocks=40, block_size=4))
    sched = scheduler_module.Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    for i in range(12):
        prompt = [7 * i + j for j in range(5 + 3 * i)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=9 + i, n=1 + i % 3)))
    history = []
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {item.seq_id: [11] * item.num_samples if item.num_samples > 1 else 11
                   for item in out.seqs if item.sample}
        sched.update(out, sampled)
        bm.check_integrity()
        history.append(([(s.seq_id, s.token_ids, s.start_position) for s in out.seqs],
                        out.preempted, sched.debug_state(), bm.debug_state()))
    monkeypatch.undo()
    return history, bm.num_refused


def test_a_refused_decode_batch_leaves_every_row_as_it_was(monkeypatch):
    """`_decode_rows` marks its rows before the store's call; when the store
    refuses, `_unmark_decode_rows` must restore them exactly, so the row by
    row path that follows does what it does with no batched path at all."""
    batched, num_refused = _drive(monkeypatch, batched=True)
    generic, _ = _drive(monkeypatch, batched=False)
    assert num_refused > 20
    assert any(preempted for _, preempted, _, _ in batched)
    assert batched == generic


def _scheduled_work(monkeypatch, as_records: bool) -> tuple[list, int]:
    """Every step's work as read from `SchedulerOutput.seqs` over a run where
    prefill chunks land between decode rows (chunks capped at 8 tokens, new
    requests while others decode, a priority policy that admits between
    running sequences, preemption); `as_records`: every row
    scheduled as a record (the generic path, no columns). Also returns the
    number of steps with a record between two rows."""
    if as_records:
        # private on purpose: counts or turns off an internal shortcut; no public call can
        monkeypatch.setattr(scheduler_module, "_decode_rows", _no_decode_rows)
    bm = BlockManager(BlockManagerConfig(num_blocks=48, block_size=4))
    sched = scheduler_module.Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=8,
                        policy="priority"), bm)
    steps, num_between = [], 0
    for step in range(400):
        if step % 3 == 0 and step < 60:
            i = step // 3
            prompt = [5 * i + j for j in range(6 + 19 * (i % 4))]
            params = SamplingParams(max_tokens=6 + i % 9, n=1 + i % 3)
            sched.add_request(Request(f"r{i}", prompt, params, priority=-i % 3))
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        num_between += any(0 < mark < len(out.rows) for mark in out.item_rows)
        assert len(out.seqs) == len(out.rows) + len(out.items)
        steps.append([(s.seq_id, s.request_id, s.token_ids, s.start_position, s.is_prefill,
                       s.sample, s.num_samples, s.sample_index, s.request.request_id)
                      for s in out.seqs])
        sched.update(out, {item.seq_id: [3] * item.num_samples if item.num_samples > 1 else 3
                           for item in out.seqs if item.sample})
        bm.check_integrity()
    monkeypatch.undo()
    return steps, num_between


def test_decode_rows_read_as_the_records_the_generic_path_schedules(monkeypatch):
    """`seqs` of an output with columns equals, step by step and in running
    order, what the scheduler schedules with every row as a record."""
    columns, num_between = _scheduled_work(monkeypatch, as_records=False)
    records, _ = _scheduled_work(monkeypatch, as_records=True)
    assert num_between > 5  # records did land between rows
    assert sum(len(step) for step in columns) > 300
    assert columns == records
