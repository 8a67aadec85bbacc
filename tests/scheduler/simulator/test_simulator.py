"""The stress simulator: determinism, accounting, traces, workloads, checks."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from blockmgr import BlockManager, BlockManagerConfig
from scheduler.core.scheduler import SchedulerConfig
from scheduler.simulator import (
    CostModel,
    LeakError,
    SimulationConfig,
    TraceError,
    WorkloadConfig,
    generate,
    read_trace,
    run_simulation,
    write_trace,
)
from scheduler.simulator.config import SimulationConfig as _Cfg
from scheduler.simulator.lengths import LengthDist, LengthSpecError, parse_length
from scheduler.simulator.memory import snapshot
from scheduler.simulator.runner import Simulation, check_no_leaks
from scheduler.simulator.sweep import SweepSpecError, grid_points, parse_grid, run_sweep
from scheduler.simulator.tokens import TokenSource, derive_key
from scheduler.simulator.workloads import WORKLOAD_KINDS, _Choice
from tests.summaries import deterministic


def small_config(**workload) -> SimulationConfig:
    wl = dict(mix=dict.fromkeys(WORKLOAD_KINDS, 1.0), num_requests=120, rate=2.0, seed=3,
              max_context=2048)
    wl.update(workload)
    return SimulationConfig(
        workload=WorkloadConfig(**wl),
        block_manager=BlockManagerConfig(num_blocks=512, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=32),
        check_every=16,
        sample_every=4,
    )


def all_specs(cfg: WorkloadConfig):
    return [spec for session in generate(cfg) for spec in session]


# ------------------------------------------------------------ determinism


def test_same_seed_same_report_other_seed_differs():
    first = run_simulation(small_config()).summary
    second = run_simulation(small_config()).summary
    other = run_simulation(small_config(seed=4)).summary
    assert deterministic(first) == deterministic(second)
    assert deterministic(first) != deterministic(other)


def test_generation_is_deterministic_and_counts_requests():
    cfg = WorkloadConfig(num_requests=300, seed=11)
    a = [(s.request_id, s.prompt, s.output_len, s.arrival) for s in all_specs(cfg)]
    b = [(s.request_id, s.prompt, s.output_len, s.arrival) for s in all_specs(cfg)]
    assert a == b
    assert len(a) == 300
    assert len({rid for rid, *_ in a}) == 300


# ------------------------------------------------------------- accounting


@pytest.mark.parametrize("p", [[1.0], [0.5, 0.3, 0.2], list(np.ones(16) / np.arange(1, 17))])
def test_choice_draws_what_rng_choice_draws(p):
    """The generator's weighted draw against numpy's own `choice` on the
    same stream: the same indices, and the streams stay in step after."""
    p = np.asarray(p) / np.sum(p)
    ours, numpy_rng = np.random.default_rng(7), np.random.default_rng(7)
    choice = _Choice(p)
    drawn = [choice.draw(ours) for _ in range(3000)]
    assert drawn == [int(numpy_rng.choice(len(p), p=p)) for _ in range(3000)]
    assert ours.random() == numpy_rng.random()
    assert len(set(drawn)) == len(p)


@pytest.mark.parametrize("spec", ["fixed:2.5", "fixed:7", "uniform:3,40",
                                  "lognormal:mean=200,sigma=0.8", "exponential:mean=100,max=300",
                                  "normal:mean=20,std=15,min=4"])
def test_one_length_is_the_one_element_sample(spec):
    """`LengthDist.one` (a scalar draw) against `sample(rng, 1)` on the same
    stream: the same lengths, and the streams stay in step after."""
    dist = parse_length(spec)
    ours, reference = np.random.default_rng(3), np.random.default_rng(3)
    lengths = [dist.one(ours) for _ in range(2000)]
    assert lengths == [int(dist.sample(reference, 1)[0]) for _ in range(2000)]
    assert all(type(n) is int for n in lengths)
    assert ours.random() == reference.random()


def test_metrics_add_up():
    cfg = small_config()
    specs = all_specs(cfg.workload)
    s = run_simulation(cfg).summary
    req, pc, mem = s["requests"], s["prefix_cache"], s["memory"]
    assert req["finished"] + req["aborted"] == len(specs) == req["submitted"]
    assert req["aborted"] == 0
    # Independent: the workload says what was asked for.
    assert req["prompt_tokens"] == sum(spec.prompt_len for spec in specs)
    assert req["output_tokens"] == sum(spec.output_len * spec.n for spec in specs)
    assert 0 <= pc["hit_tokens"] <= pc["query_tokens"]
    assert pc["query_tokens"] >= req["prompt_tokens"]  # re-admissions ask again
    assert pc["hit_tokens"] <= pc["query_tokens"] - pc["queries"]  # one token always computed
    assert 0 <= mem["pages_used_peak"] <= mem["num_blocks"]
    assert mem["sequence_pages_peak"] <= mem["num_blocks"]
    assert 0 <= mem["fragmentation_mean"] <= mem["fragmentation_peak"] < 1
    assert 0 <= mem["sharing_saved_mean"] <= mem["sharing_saved_peak"] < 1
    assert s["checks"]["leaks"] == "ok" and s["checks"]["integrity_checks"] > 1
    lat = s["latency"]
    for key in ("ttft_s", "e2e_s", "queue_s"):
        assert lat[key]["count"] == req["finished"]
        assert 0 <= lat[key]["p50"] <= lat[key]["p99"] <= lat[key]["max"]
    assert lat["ttft_s"]["max"] <= lat["e2e_s"]["max"]


def test_per_step_series_are_consistent():
    cfg = small_config()
    result = run_simulation(cfg)
    steps = result.metrics.step_arrays()
    assert np.all(np.diff(steps["time"]) > 0)
    assert np.allclose(np.diff(steps["time"]), steps["step_time"][1:])
    assert np.all(steps["page_usage"] <= 1.0)
    assert np.all(steps["hit_tokens"] <= steps["query_tokens"])
    assert np.all(np.diff(steps["finished"]) >= 0)
    # Tokens computed per step add up to the per-request computed tokens.
    computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
    per_request = result.metrics.request_arrays()["computed_tokens"].sum()
    assert computed == per_request
    # The cost model recomputed independently from the series.
    cost = cfg.cost
    assert np.all(steps["step_time"] >= cost.step_overhead
                  + cost.prefill_per_token * steps["prefill_tokens"]
                  + cost.decode_per_token * steps["decode_tokens"] - 1e-12)


def test_memory_snapshot_matches_a_direct_count():
    bm = BlockManager(BlockManagerConfig(num_blocks=64, block_size=4, enable_prefix_cache=True))
    bm.allocate("a", list(range(10)))
    bm.fork("a", "b")
    bm.append("b", [99, 98, 97])
    bm.allocate("c", list(range(100, 105)))
    snap = snapshot(bm)
    tables = {sid: bm.block_table(sid) for sid in bm.sequence_ids()}
    distinct = {p for t in tables.values() for p in t}
    assert snap.physical_pages == len(distinct)
    assert snap.logical_pages == sum(len(t) for t in tables.values())
    held = {}
    for sid, table in tables.items():
        n = bm.num_tokens(sid)
        for j, page in enumerate(table):
            held[page] = max(held.get(page, 0), min(4, n - 4 * j))
    assert snap.tokens == sum(held.values())
    assert snap.wasted_slots == 4 * len(distinct) - sum(held.values())


# --------------------------------------------------------------- workloads


def test_multiturn_prompts_contain_previous_prompt_and_output():
    cfg = small_config(mix={"multiturn": 1.0, "agent": 1.0}, num_requests=60)
    finished = {}

    def capture(req, aborted):
        finished[req.request_id] = (list(req.prompt_tokens), [list(o) for o in req.outputs])

    Simulation(cfg, on_finish=capture).run()
    follow_ups = [s for s in all_specs(cfg.workload) if s.after is not None]
    assert follow_ups
    for spec in follow_ups:
        prev_prompt, prev_outputs = finished[spec.after]
        prompt, _ = finished[spec.request_id]
        expected = prev_prompt + prev_outputs[0]
        assert prompt[: len(expected)] == expected
        assert len(prompt) > len(expected)


def test_parallel_samples_differ_and_share_the_prompt():
    cfg = small_config(mix={"parallel": 1.0}, num_requests=20, n=3)
    outs = {}

    def capture(req, aborted):
        outs[req.request_id] = [list(o) for o in req.outputs]

    result = Simulation(cfg, on_finish=capture).run()
    specs = {s.request_id: s for s in all_specs(cfg.workload)}
    for rid, samples in outs.items():
        assert len(samples) == 3
        assert all(len(o) == specs[rid].output_len for o in samples)
        assert samples[0] != samples[1]
    assert result.summary["memory"]["sharing_saved_peak"] > 0


def test_tenants_never_hit_another_namespace(tmp_path):
    tokens = list(range(1000, 1300))
    lines = [
        {"id": "a", "arrival": 0.0, "prompt_tokens": tokens, "output_len": 4, "namespace": "t1"},
        {"id": "b", "after": "a", "prompt_tokens": tokens, "output_len": 4, "namespace": "t2"},
        {"id": "c", "after": "b", "prompt_tokens": tokens, "output_len": 4, "namespace": "t1"},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    cfg = SimulationConfig(trace=str(path), check_every=1)
    cached = {}

    def capture(req, aborted):
        cached[req.request_id] = req.metrics.num_cached_tokens

    Simulation(cfg, on_finish=capture).run()
    assert cached["a"] == 0 and cached["b"] == 0
    assert cached["c"] == len(tokens) - 1


def test_hybrid_and_swap_runs_pass_the_checks():
    hybrid = replace(small_config(),
                     block_manager=BlockManagerConfig(num_blocks=512, block_size=16, num_slots=48))
    s = run_simulation(_Cfg.from_dict(hybrid.to_dict())).summary
    assert s["checks"]["leaks"] == "ok"
    assert 0 < s["slots"]["used_peak"] <= 48
    swap = small_config(rate=20.0)
    data = swap.to_dict()
    data["block_manager"].update(num_blocks=160, num_host_blocks=512)
    data["scheduler"]["preemption"] = "swap"
    s = run_simulation(_Cfg.from_dict(data)).summary
    assert s["checks"]["leaks"] == "ok"
    assert s["preemptions"]["swap"] > 0


def test_leak_check_catches_a_held_page():
    result = Simulation(small_config(num_requests=10))
    result.run()
    result.bm.allocate("stray", [1, 2, 3])
    with pytest.raises(LeakError, match="sequences still live"):
        check_no_leaks(result.bm, result.scheduler)


def test_unfittable_request_is_aborted_not_a_hang(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(
        json.dumps({"arrival": 0, "prompt_tokens": list(range(600)), "output_len": 2}) + "\n"
        + json.dumps({"arrival": 0, "prompt_tokens": list(range(20)), "output_len": 2}) + "\n"
    )
    cfg = SimulationConfig(block_manager=BlockManagerConfig(num_blocks=16, block_size=16),
                           trace=str(path), check_every=1)
    s = run_simulation(cfg).summary
    assert s["requests"]["aborted"] == 1 and s["requests"]["finished"] == 1
    assert s["checks"]["leaks"] == "ok"


# ------------------------------------------------------------------ traces


def test_replaying_a_written_trace_gives_the_same_report(tmp_path):
    cfg = small_config(num_requests=80)
    path = tmp_path / "trace.jsonl"
    count = write_trace(path, generate(cfg.workload), {"vocab_size": cfg.vocab_size})
    assert count == 80
    direct = run_simulation(cfg).summary
    replay_cfg = _Cfg.from_dict({**cfg.to_dict(), "trace": str(path)})
    replayed = run_simulation(replay_cfg).summary
    bound = replayed["prefix_cache"].pop("infinite_cache_hit_rate")  # trace runs only
    assert replayed["prefix_cache"]["first_admission_hit_rate"] <= bound
    assert deterministic(direct) == deterministic(replayed)


def test_prefix_id_traces_share_blocks(tmp_path):
    lines = [{"type": "header", "prefix_block_tokens": 32}]
    lines += [{"timestamp": 1000 * i, "hash_ids": [7, 8, 9 + i], "input_length": 100,
               "output_length": 3} for i in range(4)]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    header, sessions = read_trace(path)
    specs = [s[0] for s in sessions]
    assert [s.prompt_len for s in specs] == [100] * 4
    assert all(s.prompt[:2] == specs[0].prompt[:2] for s in specs)
    assert len({s.prompt[2] for s in specs}) == 4
    s = run_simulation(SimulationConfig(trace=str(path), check_every=1)).summary
    assert s["prefix_cache"]["hit_tokens"] == 3 * 64  # two shared 32-token blocks, 3 later requests


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('{"arrival": 0, "output_len": 3}', "missing field 'prompt'"),
        ('{"arrival": 0, "prompt_tokens": [1, -2], "output_len": 3}', "non-negative"),
        ('{"after": "nobody", "prompt_tokens": [1], "output_len": 3}', "'after'"),
        ('{"arrival": 0, "prompt_tokens": [1], "output_len": 0}', "output_len"),
    ],
)
def test_bad_trace_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert "bad.jsonl:1" in str(info.value)


# ------------------------------------------------------------ small parts


def test_length_specs_round_trip_and_reject_garbage():
    rng = np.random.default_rng(0)
    for spec in ("fixed:128", "uniform:5,9", "lognormal:mean=200,sigma=0.8,max=900",
                 "exponential:mean=40,min=2", "normal:mean=50,std=5"):
        dist = parse_length(spec)
        assert parse_length(dist.spec()) == dist
        values = dist.sample(rng, 500)
        assert values.min() >= dist.low and values.max() <= dist.high
    assert parse_length("64") == LengthDist("fixed", 64)
    for bad in ("", "zipf:3", "uniform:9,5", "fixed:0", "lognormal:mean=x", "fixed:3,min=0"):
        with pytest.raises(LengthSpecError):
            parse_length(bad)


def test_token_texts_are_stable_prefixes_and_distinct():
    source = TokenSource(1000)
    key = derive_key(42, 0)
    long = source.text(key, 300)
    assert source.text(key, 100) == long[:100]
    assert source.text(derive_key(42, 1), 300) != long
    assert all(0 <= t < 1000 for t in long)
    other = derive_key(7, 3)
    assert source.expand([(key, 100), (other, 0), (other, 40)]) == \
        long[:100] + source.text(other, 40)
    assert source.expand([]) == [] and source.expand([(key, 0)]) == []


def test_kept_texts_expand_as_fresh_ones(monkeypatch):
    """Texts seen twice are kept expanded (few kept, sightings forgotten past
    a bound, here tiny): every prompt equals its segments' texts from a
    source that keeps nothing, and a caller's edit of a prompt reaches no
    later one."""
    from scheduler.simulator import tokens as tokens_module

    monkeypatch.setattr(tokens_module, "NUM_KEPT_TEXTS", 3)
    monkeypatch.setattr(tokens_module, "NUM_REMEMBERED_SIGHTINGS", 5)
    source, reference = TokenSource(500), TokenSource(500)
    rng = np.random.default_rng(5)
    texts = [(derive_key(9, i), int(n)) for i, n in enumerate(rng.integers(0, 40, 12))]
    for _ in range(400):
        segments = [texts[i] for i in rng.integers(0, len(texts), rng.integers(0, 5))]
        prompt = source.expand(segments)
        assert prompt == [t for key, n in segments for t in reference.text(key, n)]
        if prompt:
            prompt[0] = -1  # a caller's own list


@pytest.mark.parametrize("shared", [True, False])
def test_texts_are_the_documented_table_slices_as_exact_ints(monkeypatch, shared):
    """A text is (table[offset:offset + n] ^ salt) % vocab, both from the key
    (the module docstring), recomputed here from the table's seed; with
    shared int objects (small vocabularies) equal ids are one object."""
    from scheduler.simulator import tokens as tokens_module

    if not shared:
        monkeypatch.setattr(tokens_module, "MAX_SHARED_IDS", 10)
    vocab = 3000
    source = TokenSource(vocab)
    bits, salt_bits = tokens_module.TABLE_BITS, tokens_module.SALT_BITS
    table = np.random.default_rng(tokens_module.TABLE_SEED).integers(
        0, 1 << salt_bits, size=1 << bits, dtype=np.int64)
    for index in range(5):
        key = derive_key(11, index)
        offset, salt = key % (1 << bits), (key >> bits) % (1 << salt_bits)
        want = [int(t ^ salt) % vocab for t in table[offset : offset + 700]]
        got = source.text(key, 700)
        assert got == want and {type(t) for t in got} == {int}
        assert source.expand([(key, 300), (derive_key(key, 1), 5)])[:300] == want[:300]
    first = source.text(derive_key(1, 0), 2000)
    # ids above 256: CPython caches the small ints, shared or not
    second = {t: t for t in source.text(derive_key(2, 0), 2000) if t > 256}
    pairs = [(t, second[t]) for t in first if t in second]
    assert len(pairs) > 20 and all((a is b) == shared for a, b in pairs)


def test_config_round_trips_through_json():
    cfg = small_config()
    again = _Cfg.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.to_dict() == cfg.to_dict()
    with pytest.raises(ValueError, match="unknown config keys"):
        _Cfg.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="does not fit the pool"):
        SimulationConfig(workload=WorkloadConfig(max_context=10_000),
                         block_manager=BlockManagerConfig(num_blocks=16))


def test_sweep_grid_and_parallel_run():
    with pytest.raises(SweepSpecError, match="cannot sweep"):
        parse_grid("bogus=1,2")
    with pytest.raises(SweepSpecError, match="name=v1,v2"):
        parse_grid("num_blocks")
    grid = parse_grid("num_blocks=256,512;enable_prefix_cache=true,false")
    assert grid == {"num_blocks": [256, 512], "enable_prefix_cache": [True, False]}
    base = small_config(num_requests=30)
    points = grid_points(base, {"enable_prefix_cache": [True, False]}, None)
    rows = run_sweep(points, jobs=2)
    assert [r["params"] for r in rows] == [{"enable_prefix_cache": True},
                                          {"enable_prefix_cache": False}]
    assert rows[1]["hit_rate"] == 0 < rows[0]["hit_rate"]
    serial = run_sweep(points[:1], jobs=1)
    assert deterministic(serial[0]["summary"]) == deterministic(rows[0]["summary"])


def test_simulator_does_not_import_mlx():
    code = (
        "import sys\n"
        "from scheduler.simulator import *\n"
        "import scheduler.cli\n"
        "assert not [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')], "
        "[m for m in sys.modules if m.startswith('mlx')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("n", [1, 3])
def test_time_per_output_token_matches_the_cost_model(tmp_path, n):
    """A lone request decodes n tokens per step: TPOT is one step's cost."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"arrival": 0, "prompt_tokens": list(range(50)),
                                "output_len": 20, "n": n}) + "\n")
    cost = CostModel(step_overhead=0.01, prefill_per_token=0.001, decode_per_token=0.002,
                     attention_per_context_token=0.0, copy_per_page=0.0, copy_per_slot=0.0)
    s = run_simulation(SimulationConfig(trace=str(path), cost=cost)).summary
    step = cost.step_overhead + n * cost.decode_per_token
    assert s["latency"]["tpot_s"]["mean"] == pytest.approx(step)
    prefill = cost.step_overhead + 50 * cost.prefill_per_token
    assert s["latency"]["ttft_s"]["mean"] == pytest.approx(prefill)
    assert s["latency"]["e2e_s"]["mean"] == pytest.approx(prefill + 19 * step)


# ------------------------------------------------------------ cache tiers


def _tiered(num_host: int, num_disk: int, disk_load: float = 0.0005) -> dict:
    cfg = small_config(mix={"agent": 1.0}, num_requests=80, rate=4.0)
    cfg = replace(cfg, block_manager=BlockManagerConfig(
        num_blocks=160, block_size=16, num_host_cache_blocks=num_host, num_disk_blocks=num_disk),
        cost=replace(cfg.cost, disk_load_per_page=disk_load))
    return run_simulation(cfg).summary


def test_cache_tiers_keep_what_the_device_pool_drops_and_price_its_loads():
    """An agent workload the device pool cannot hold: a host tier, then a
    disk tier below it, hit more of each prompt (every run leak-free under
    --check); a slower disk makes the same run (same hits, same loads)
    wait longer for its first tokens."""
    device, host, disk = _tiered(0, 0), _tiered(400, 0), _tiered(400, 3000)
    rates = [s["prefix_cache"]["hit_rate"] for s in (device, host, disk)]
    assert rates[0] < rates[1] < rates[2]
    assert "tiers" not in device["prefix_cache"]
    tiers = disk["prefix_cache"]["tiers"]
    assert tiers["host"]["pages_demoted_in"] > 0 and tiers["disk"]["pages_loaded_from"] > 0
    assert all(s["checks"]["leaks"] == "ok" for s in (device, host, disk))
    slow = _tiered(400, 3000, disk_load=0.05)
    assert slow["prefix_cache"]["tiers"]["disk"]["pages_loaded_from"] > 0
    assert slow["latency"]["ttft_s"]["mean"] > disk["latency"]["ttft_s"]["mean"]
