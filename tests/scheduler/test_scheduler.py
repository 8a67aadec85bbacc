"""Scheduler bookkeeping over a plain BlockManager (no MLX).

Scenarios follow vLLM v1's scheduler tests (budget split across concurrent
partial prefills, priority order and victim choice, stop conditions); the
random runs replay every plan on `ShadowStorage`, which "computes" token ids
into pages and slots, so a wrong page, a missed copy or a stale recurrent
state reads back as a wrong id.
"""

from __future__ import annotations

import random

import pytest

from blockmgr import BlockManager, BlockManagerConfig, InvalidArgument
from scheduler import (
    Request,
    RequestStatus,
    RequestTooLarge,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SequenceInfo,
)
from tests.shadow import ShadowStorage


def make(num_blocks=1000, block_size=16, num_slots=0, watermark=0.0, host=0, **cfg):
    bm = BlockManager(BlockManagerConfig(
        num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, watermark=watermark,
        num_host_blocks=host, num_host_slots=host if num_slots else 0))
    return bm, Scheduler(SchedulerConfig(**cfg), bm)


def req(rid, n_tokens=None, tokens=None, max_tokens=16, priority=0, arrival=None, **sp):
    tokens = tokens if tokens is not None else list(range(1000, 1000 + n_tokens))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **sp),
                   priority=priority, arrival_time=arrival)


def sched_tokens(out):
    return {s.seq_id: s.num_tokens for s in out.seqs}


def step(s, token=0):
    """One step; every sampled sequence gets `token` (or token(seq))."""
    out = s.schedule()
    sampled = {}
    for item in out.seqs:
        if item.sample:
            t = token(item) if callable(token) else token
            sampled[item.seq_id] = [t] * item.num_samples if item.num_samples > 1 else t
    return out, s.update(out, sampled)


def assert_no_leak(bm):
    bm.check_integrity()
    assert bm.num_sequences == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == bm.config.num_blocks
    assert bm.num_free_slots + bm.stats.num_trie_slots == bm.config.num_slots


# ------------------------------------------------------------ ported scenarios


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_budget_split_across_concurrent_partial_prefills(prefix_cache):
    bm = BlockManager(BlockManagerConfig(num_blocks=1000, block_size=16,
                                         enable_prefix_cache=prefix_cache))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1024,
                                  long_prefill_token_threshold=400), bm)
    for i in range(3):
        s.add_request(req(f"r{i}", tokens=[i * 1000 + t for t in range(800)]))
    out, _ = step(s)
    assert sched_tokens(out) == {"r0": 400, "r1": 400, "r2": 224}
    assert all(item.is_prefill and not item.sample for item in out.seqs)
    out, _ = step(s)
    assert sched_tokens(out) == {"r0": 400, "r1": 400, "r2": 224}
    assert [item.sample for item in out.seqs] == [True, True, False]
    out, _ = step(s)
    assert sched_tokens(out) == {"r0": 1, "r1": 1, "r2": 800 - 224 - 224}
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 352


def test_running_first_then_waiting_fcfs():
    bm, s = make(max_num_batched_tokens=64, max_num_seqs=3)
    for i in range(4):
        s.add_request(req(f"r{i}", tokens=[i] * 10, max_tokens=5))
    out, _ = step(s)
    assert [x.seq_id for x in out.seqs] == ["r0", "r1", "r2"]  # max_num_seqs
    out, _ = step(s)
    assert [x.seq_id for x in out.seqs] == ["r0", "r1", "r2"]
    assert s.num_waiting == 1


def test_priority_order_then_arrival():
    bm, s = make(policy="priority")
    for i, (prio, arrival) in enumerate(zip([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0])):
        s.add_request(req(str(i), 10, priority=prio, arrival=arrival))
    out, _ = step(s)
    assert [x.seq_id for x in out.seqs] == ["3", "2", "1", "0"]


def test_priority_preempts_lowest_priority_running():
    # 5 pages of 16 tokens: lo (32 tokens) decodes into a 3rd page, hi (32)
    # takes 2; the next growth must evict lo, never hi.
    bm = BlockManager(BlockManagerConfig(num_blocks=5, block_size=16, enable_prefix_cache=False))
    s = Scheduler(SchedulerConfig(policy="priority", max_num_batched_tokens=200), bm)
    s.add_request(req("lo", 32, priority=5, max_tokens=40))
    step(s)
    s.add_request(req("hi", 32, priority=0, max_tokens=40))
    out, _ = step(s)
    assert sched_tokens(out) == {"lo": 1, "hi": 32}  # running first, then admission
    assert s.running_ids() == ["hi", "lo"]  # kept in priority order
    preempted = []
    for _ in range(20):
        out, _ = step(s)
        preempted += out.preempted
        if preempted:
            break
    assert preempted == ["lo"]
    assert s.get_request("lo").status is RequestStatus.PREEMPTED
    assert s.running_ids() == ["hi"]
    bm.check_integrity()


def test_fcfs_preempts_last_admitted_and_requeues_it_first():
    bm = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4, enable_prefix_cache=False))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100), bm)
    for i in range(3):
        s.add_request(req(f"r{i}", tokens=[i] * 8, max_tokens=20))
    out, _ = step(s)
    assert sched_tokens(out) == {"r0": 8, "r1": 8, "r2": 8}
    s.add_request(req("late", tokens=[9] * 4, max_tokens=2))
    out, _ = step(s)  # all three need a 3rd page: the last admitted makes room
    assert out.preempted == ["r2"]
    assert sched_tokens(out) == {"r0": 1, "r1": 1}  # no admission in a preempting step
    assert s.waiting_ids() == ["r2", "late"]  # the preempted one goes first
    stats = s.stats
    assert stats.num_preempted_recompute == 1 and stats.num_preempted_recompute_total == 1


def test_stop_token_max_tokens_and_max_model_len():
    bm, s = make(max_model_len=14)
    s.add_request(req("stop", 4, max_tokens=10, stop_token_ids=(42,)))
    s.add_request(req("len", 4, max_tokens=3))
    s.add_request(req("model_len", 10, max_tokens=100))
    tokens = iter([7, 7, 7, 7, 42, 7, 7, 7, 7, 7, 7, 7])
    outputs = []
    while s.has_unfinished():
        outputs += step(s, token=lambda item: next(tokens) if item.seq_id == "stop" else 5)[1]
    final = {o.request_id: o for o in outputs if o.finished}
    assert final["stop"].status is RequestStatus.FINISHED_STOPPED
    assert final["len"].status is RequestStatus.FINISHED_LENGTH
    assert final["model_len"].status is RequestStatus.FINISHED_LENGTH
    streamed = {}
    for o in outputs:
        streamed.setdefault(o.request_id, []).extend(o.new_tokens.get(0, []))
    assert streamed["stop"] == [7, 7, 7, 7, 42]  # the stop token ends the output
    assert streamed["len"] == [5, 5, 5]
    assert len(streamed["model_len"]) == 14 - 10
    assert_no_leak(bm)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("neighbour", [False, True])
def test_without_max_model_len_a_sequence_stops_at_what_the_pool_holds(preemption, neighbour):
    """max_model_len None: a sample ends by length when its sequence fills the
    pool past its watermark (6 pages of 4 tokens: 24 tokens), instead of
    waiting for pages for ever; with a neighbour preempted for it too."""
    bm, s = make(num_blocks=6, block_size=4, host=20, preemption=preemption)
    assert s.max_model_len == 24
    s.add_request(req("a", tokens=list(range(6)), max_tokens=40))
    if neighbour:
        s.add_request(req("b", tokens=list(range(100, 107)), max_tokens=8, n=2))
    outputs, num_steps = [], 0
    while s.has_unfinished():
        outputs += step(s, token=5)[1]
        num_steps += 1
        assert num_steps < 500, "the scheduler made no progress"
    final = {o.request_id: o for o in outputs if o.finished}
    assert final["a"].status is RequestStatus.FINISHED_LENGTH
    assert sum(len(o.new_tokens.get(0, [])) for o in outputs if o.request_id == "a") == 24 - 6
    if neighbour:
        assert final["b"].status is RequestStatus.FINISHED_LENGTH
    assert_no_leak(bm)


def test_max_model_len_past_the_pool_and_prompts_filling_it_are_refused():
    bm = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4))
    with pytest.raises(InvalidArgument, match="more than the pool can hold"):
        Scheduler(SchedulerConfig(max_model_len=25), bm)
    s = Scheduler(SchedulerConfig(), bm)
    before = s.debug_state()
    with pytest.raises(RequestTooLarge, match="max_model_len 24"):
        s.add_request(req("full", 24))  # no room left for its first output
    assert s.debug_state() == before
    windowed = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4, sliding_window=8))
    assert Scheduler(SchedulerConfig(), windowed).max_model_len is None  # any length fits


def test_prefix_hit_counts_only_new_tokens_against_the_budget():
    bm, s = make(block_size=4, max_num_batched_tokens=12)
    shared = list(range(40))
    s.add_request(req("a", tokens=shared + [100], max_tokens=1))
    while s.has_unfinished():
        step(s)
    s.add_request(req("b", tokens=shared + [200, 201], max_tokens=1))
    s.add_request(req("c", tokens=[300, 301, 302], max_tokens=1))
    out, _ = step(s)
    assert sched_tokens(out) == {"b": 2, "c": 3}  # b hit 40 tokens
    assert out.seqs[0].start_position == 40
    assert s.stats.num_prefix_hit_tokens == 40


def test_watermark_holds_admission_back():
    bm, s = make(num_blocks=10, block_size=4, watermark=0.2, max_num_batched_tokens=100)
    s.add_request(req("a", tokens=[1] * 24, max_tokens=2))  # 6 pages + 2 watermark
    s.add_request(req("b", tokens=[2] * 12, max_tokens=2))  # 3 pages: fit, but not
    out, _ = step(s)                                          # with 2 kept free
    assert sched_tokens(out) == {"a": 24}
    assert s.num_waiting == 1
    assert bm.num_free_blocks == 4


def test_n_samples_share_prompt_pages():
    bm, s = make(num_blocks=100, block_size=4)
    s.add_request(req("r", tokens=list(range(16)), max_tokens=3, n=4))
    out = s.schedule()
    assert out.seqs[0].num_samples == 4 and out.seqs[0].sample_index is None
    s.update(out, {"r": [10, 11, 12, 13]})
    assert sorted(s.running_ids()) == [("r", i) for i in range(4)]
    tables = [bm.block_table(("r", i)) for i in range(4)]
    assert all(t == tables[0] for t in tables)
    assert bm.config.num_blocks - bm.num_free_blocks == 4  # the prompt, once
    out, _ = step(s)
    assert bm.config.num_blocks - bm.num_free_blocks == 4 + 4  # one new page per sample
    while s.has_unfinished():
        step(s)
    r = s.get_request("r")
    assert r is None  # finished requests leave the scheduler
    assert_no_leak(bm)


def test_abort_at_every_stage_frees_everything():
    for stage in range(6):
        bm, s = make(num_blocks=20, block_size=4, max_num_batched_tokens=6, host=20,
                     preemption="swap")
        s.add_request(req("a", tokens=list(range(12)), max_tokens=8, n=2))
        s.add_request(req("b", tokens=list(range(5)), max_tokens=8))
        for _ in range(stage):
            step(s)
        out = s.schedule()
        final = s.abort("a")  # between schedule and update
        assert final.finished and final.status is RequestStatus.FINISHED_ABORTED
        s.update(out, {x.seq_id: 1 if x.num_samples == 1 else [1, 1] for x in out.seqs if x.sample})
        assert s.abort("a") is None
        while s.has_unfinished():
            step(s)
        assert_no_leak(bm)


def test_hybrid_chunks_end_at_branch_point_and_page_boundaries():
    bm, s = make(num_blocks=200, block_size=8, num_slots=16, max_num_batched_tokens=20)
    shared = list(range(30))
    s.add_request(req("a", tokens=shared + [100, 101, 102], max_tokens=1))
    starts = []
    while s.has_unfinished():
        out, _ = step(s)
        starts += [(x.start_position, x.num_tokens) for x in out.seqs]
    assert starts[0] == (0, 16)  # 20 cut down to a page boundary
    # a sibling sharing 30 tokens: its chunk ends at a snapshot point, and a
    # third prompt then hits the deepest snapshot
    s.add_request(req("b", tokens=shared + [200, 201], max_tokens=1))
    out, _ = step(s)
    hit_b = out.seqs[0].start_position
    assert hit_b > 0 and hit_b % 8 == 0 or hit_b == 30
    while s.has_unfinished():
        step(s)
    s.add_request(req("c", tokens=shared + [300], max_tokens=1))
    out, _ = step(s)
    assert out.seqs[0].start_position >= hit_b
    while s.has_unfinished():
        step(s)
    assert_no_leak(bm)


def test_queries_follow_each_sequence_through_fork_swap_and_abort():
    """`request_ids` and `sequence_info` against the steps as scheduled:
    a prompt with two samples forks after its prompt, a preempted sample is
    swapped out holding nothing on the device, an aborted request is gone."""
    bm, s = make(num_blocks=6, block_size=4, max_num_batched_tokens=64, host=20,
                 preemption="swap")
    s.add_request(req("a", tokens=list(range(6)), max_tokens=8))
    s.add_request(req("b", tokens=list(range(100, 107)), max_tokens=8, n=2))
    assert s.request_ids() == ["a", "b"]
    assert s.sequence_info("a") == SequenceInfo("a", "a", 6, 0, 0, False, False, False)
    assert s.sequence_info("b").num_tokens == 7 and s.sequence_info(("b", 0)) is None
    assert s.sequence_info("nobody") is None
    out = s.schedule()
    assert s.sequence_info("b") == SequenceInfo("b", "b", 7, 0, 7, False, True, False)
    s.update(out, {"a": 1, "b": [2, 3]})
    assert s.sequence_info("b") is None  # forked into its samples
    for i in range(2):
        assert s.sequence_info(("b", i)) == SequenceInfo(("b", i), "b", 8, 7, 7, False,
                                                         False, False)
    for _ in range(4):  # 6 pages: the three sequences outgrow them
        if s.waiting_ids():
            break
        step(s)
    (victim,) = s.waiting_ids()  # preempted by swap, its pages in host memory
    info = s.sequence_info(victim)
    assert bm.is_swapped(victim) and info.swapped and info.num_reserved == info.num_computed
    assert info.num_computed == info.num_tokens - 1 and not info.in_flight
    s.abort("a")
    assert s.request_ids() == ["b"] and s.sequence_info("a") is None
    while s.has_unfinished():
        step(s)
    assert s.request_ids() == [] and s.sequence_info(("b", 0)) is None
    assert_no_leak(bm)


# ---------------------------------------------------------------- random runs


def drive(s, bm, shadow, rng, steps_limit=3000, new=None, abort_p=0.05):
    """Run until idle, computing every scheduled chunk on the shadow storage."""
    steps = 0
    while (new is not None and new()) or s.has_unfinished():
        if rng.random() < abort_p:
            ids = s.request_ids()
            if ids:
                s.abort(rng.choice(ids))
        shadow_step(s, bm, shadow, rng)
        steps += 1
        assert steps < steps_limit, "no progress"


def shadow_step(s, bm, shadow, rng):
    out = s.schedule()
    shadow.apply(out.ops)
    for sid in [k for k in shadow.computed if k not in bm]:
        del shadow.computed[sid]
    sampled = {}
    for item in out.seqs:
        shadow.computed[item.seq_id] = item.start_position
        shadow.compute(item.seq_id, item.start_position + item.num_tokens)
        if item.sample:
            toks = [rng.randrange(60) for _ in range(item.num_samples)]
            sampled[item.seq_id] = toks if item.num_samples > 1 else toks[0]
    s.update(out, sampled)
    bm.check_integrity()
    for sid in list(shadow.computed):
        if sid in bm:
            shadow.check_reads_back(sid)
    return out


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_replays_on_shadow_storage(hybrid, preemption, policy):
    kinds = {"recompute": 0, "swap": 0}
    for seed in range(4):
        rng = random.Random(seed)
        bm, s = make(num_blocks=24, block_size=4, num_slots=12 if hybrid else 0,
                     watermark=0.05, host=40, max_num_batched_tokens=24, max_num_seqs=6,
                     policy=policy, preemption=preemption,
                     long_prefill_token_threshold=rng.choice([None, 8]))
        shadow = ShadowStorage(bm)
        prefixes = [[rng.randrange(60) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        count = [0]

        def new():
            if count[0] < 40 and rng.random() < 0.5:
                p = rng.choice(prefixes) + [rng.randrange(60) for _ in range(rng.randint(1, 10))]
                s.add_request(req(count[0], tokens=p, max_tokens=rng.randint(1, 20),
                                  n=rng.choice([1, 1, 2, 3]), stop_token_ids=(7,),
                                  priority=rng.randrange(3)))
                count[0] += 1
            return count[0] < 40

        drive(s, bm, shadow, rng, new=new)
        shadow.apply(s.schedule().ops)
        assert_no_leak(bm)
        kinds["recompute"] += s.stats.num_preempted_recompute_total
        kinds["swap"] += s.stats.num_preempted_swap_total
    assert kinds[preemption] > 0  # the pool is small enough to preempt


def test_config_and_request_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError):
        SchedulerConfig(preemption="drop")
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(n=0)
    with pytest.raises(ValueError):
        Request("x", [])
    with pytest.raises(ValueError):
        Request(("x", 1), [1])
    bm, s = make()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError):
        s.add_request(req("a", 4))


def test_time_per_output_token_is_per_sample():
    """n samples decode side by side: their per-token time equals that of a
    single-sample request run the same way, not 1/n of it."""
    tpot = {}
    for n in (1, 3):
        now = [0.0]  # one time unit per step
        bm = BlockManager(BlockManagerConfig(num_blocks=100, block_size=4))
        s = Scheduler(SchedulerConfig(), bm, clock=lambda: now[0])
        r = req("r", 10, max_tokens=6, n=n)
        s.add_request(r)
        while s.has_unfinished():
            step(s, token=7)
            now[0] += 1.0
        tpot[n] = r.metrics.time_per_output_token
    assert tpot[1] is not None and tpot[3] == pytest.approx(tpot[1])


def test_unscheduled_decode_rows_are_not_applied_and_run_again():
    """`unschedule` between `schedule` and `update` (a forward that raised):
    the update of that same output skips those rows, and the next step
    schedules them again with the same token at the same position."""
    bm, s = make(block_size=4)
    for rid in "abcd":
        s.add_request(req(rid, tokens=[ord(rid), 1, 2], max_tokens=8))
    step(s, token=5)  # prompts: every sequence now at a decode row
    out = s.schedule()
    assert len(out.rows) == 4 and not out.items
    failed = [item for item in out.seqs if item.request_id in ("b", "d")]
    s.unschedule(failed)
    s.update(out, {item.seq_id: 6 for item in out.seqs})
    assert [s.get_request(rid).outputs[0] for rid in "abcd"] == [[5, 6], [5], [5, 6], [5]]
    again = {item.seq_id: (item.token_ids, item.start_position) for item in s.schedule().seqs}
    assert again["b"] == again["d"] == ([5], 3)
    assert again["a"] == again["c"] == ([6], 4)
    bm.check_integrity()
