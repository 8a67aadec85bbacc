"""Calibration and real replay: the step shape, the fit, profiles, the
replay driving the same scheduler decisions as the simulator, the CLI."""

from __future__ import annotations

import itertools
import json
from dataclasses import fields, replace

import numpy as np
import pytest

from blockmgr import BlockManagerConfig, CopyBlock, CopySlot
from scheduler.cli import main
from scheduler.core.request import Request, SamplingParams
from scheduler.core.scheduler import ScheduledSeq, SchedulerConfig, SchedulerOutput
from scheduler.simulator import CostModel, SimulationConfig, WorkloadConfig, run_simulation
from scheduler.simulator.cost_model import COEFFICIENTS, KNEES, StepShape, step_shape
from scheduler.simulator.layout import ModelLayout
from scheduler.simulator.profile import (
    CostProfile,
    ProfileError,
    StepSample,
    fit_cost_model,
    nnls,
    read_cost,
    read_layout,
    write_profile,
)
from scheduler.simulator.runner import Simulation

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=101)


def seq(n: int, start: int, sample: bool, samples: int = 1,
        temperature: float = 0.0) -> ScheduledSeq:
    request = Request("r", [1] * (start + n), SamplingParams(n=samples, temperature=temperature))
    return ScheduledSeq(seq_id=object(), request_id="r", token_ids=[1] * n, start_position=start,
                        is_prefill=n > 1, sample=sample, num_samples=samples, request=request)


# ------------------------------------------------------------------ shape


def test_step_shape_counts_the_engines_rows_and_chunks():
    out = SchedulerOutput(step=0, seqs=[
        seq(1, 40, True), seq(1, 7, True, temperature=1.0), seq(1, 99, True),  # decode rows
        seq(30, 0, False), seq(12, 50, True, samples=4, temperature=0.7),    # prefill chunks
    ], ops=(CopyBlock(1, 2), CopyBlock(3, 4), CopySlot(0, 1)))
    shape = step_shape(out)
    assert shape == StepShape(
        prefill_tokens=42, decode_rows=3, context_tokens=41 + 8 + 100 + 30 + 62,
        prefill_chunks=2, sampled_chunks=1, prefill_token_pairs=30 * 15 + 12 * (50 + 6),
        longest_decode_context=100, random_samples=1 + 4, page_copies=2, slot_copies=1, swaps=0,
        prefill_token_squares=30 * 30 + 12 * 12, decode_context_tokens=41 + 8 + 100,
    )
    cost = CostModel(**{name: float(i + 1) for i, name in enumerate(COEFFICIENTS)},
                     decode_context_knee=100)
    by_hand = (1 + 2 * 42 + 3 * 3 + 4 * 241 + 5 * 2 + 6 * 1 + 7 * 0 + 8 * 2 + 9 * 1
               + 10 * (30 * 15 + 12 * 56) + 11 * 1 + 12 * 3 * 100 + 13 * 5 + 14 * 1044 + 15 * 1
               + 16 * 149 + 17 * (149 - 100))
    assert cost.time_of(shape) == pytest.approx(by_hand)
    terms = shape.terms(100)  # what the fit multiplies: the same sum
    assert sum(c * t for c, t in zip(cost.coefficients(), terms)) == pytest.approx(by_hand)
    beyond = replace(cost, decode_context_knee=149)  # no key past the knee: no second slope
    assert beyond.time_of(shape) == pytest.approx(by_hand - 17 * 49)
    slower = cost.scaled(2.5)  # a machine 2.5x slower: the knee is keys, kept
    assert slower.decode_context_knee == 100
    assert slower.time_of(shape) == pytest.approx(2.5 * by_hand)


def test_the_decode_forward_runs_for_decode_rows_or_a_sampling_chunk():
    """The engine's one-token forward carries the decode rows and the last
    token of every chunk that samples: it runs once if either is there."""
    zero = {f.name: 0.0 for f in fields(CostModel)}
    cost = CostModel(**zero | {"step_overhead": 1.0, "decode_forward_overhead": 10.0})
    assert cost.time_of(step_shape(SchedulerOutput(step=0, seqs=[seq(30, 0, False)]))) == 1.0
    several = [seq(30, 0, True), seq(20, 0, True), seq(1, 5, True)]
    for seqs in ([seq(30, 0, True)], [seq(1, 5, True)], several):
        assert cost.time_of(step_shape(SchedulerOutput(step=0, seqs=seqs))) == 11.0


def test_step_shape_counts_the_keys_each_layer_reads():
    """A layout with sliding layers: every context count is the mean over the
    attention layers of the keys each reads, counted layer by layer here."""
    window = 64
    layers = [None, window, window, None, None]  # 3 full : 2 sliding, one recurrent below
    layout = ModelLayout(full=3, sliding=2, recurrent=1, window=window)

    def keys(end: int) -> float:  # a query at end - 1, per attention layer
        return sum(end if w is None else min(end, w) for w in layers) / len(layers)

    out = SchedulerOutput(step=0, seqs=[seq(1, 40, True), seq(1, 150, True),
                                        seq(30, 0, False), seq(100, 200, True)])
    shape = step_shape(out, layout.attended)
    assert shape.context_tokens == pytest.approx(keys(41) + keys(151) + keys(30) + keys(300))
    assert shape.decode_context_tokens == pytest.approx(keys(41) + keys(151))
    assert shape.longest_decode_context == pytest.approx(keys(151))
    assert shape.prefill_token_pairs == pytest.approx(30 * (keys(0) + 15) + 100 * (keys(200) + 50))
    assert keys(151) < 151 and keys(200) < 200  # the window does cut them
    assert shape.prefill_token_squares == 30 * 30 + 100 * 100
    full = ModelLayout(full=2, recurrent=1)  # the simulator's fast path reads every key
    assert full.reads_every_key and not layout.reads_every_key
    assert step_shape(out, full.attended) == step_shape(out)


def test_first_order_step_time_is_unchanged():
    cost = CostModel()
    expected = (cost.step_overhead + 100 * cost.prefill_per_token + 3 * cost.decode_per_token
                + 500 * cost.attention_per_context_token + 2 * cost.copy_per_page
                + cost.copy_per_slot + 4 * cost.swap_per_page)
    assert cost.step_time(100, 3, 500, 2, 1, 4) == pytest.approx(expected)


# -------------------------------------------------------------------- fit


def brute_force_nnls(a, b):
    """Best least-squares solution over every support with a non-negative
    unconstrained solution (the optimum is one of them)."""
    best, best_x = np.inf, None
    n = a.shape[1]
    for k in range(n + 1):
        for support in itertools.combinations(range(n), k):
            x = np.zeros(n)
            if support:
                x[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if (x >= -1e-12).all():
                residual = np.linalg.norm(a @ x - b)
                if residual < best - 1e-12:
                    best, best_x = residual, x
    return best_x


def test_nnls_matches_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(60):
        a = rng.normal(size=(12, 6))
        a[:, :3] = np.abs(a[:, :3])  # correlated columns: variables leave the support
        b = np.abs(rng.normal(size=12)) - 0.3
        x = nnls(a, b)
        assert (x >= 0).all()
        assert x == pytest.approx(brute_force_nnls(a, b), abs=1e-9)


def simulated_samples(cost: CostModel) -> list[StepSample]:
    """The steps of a real simulation, priced by `cost` (noise-free). At
    this rate the engine is sometimes idle, so some steps run a prefill
    chunk alone (without them no fit can tell the per-step term from the
    decode forward's, which every other step runs)."""
    cfg = SimulationConfig(
        workload=WorkloadConfig(mix={"chat": 1.0, "parallel": 1.0, "agent": 1.0}, num_requests=80,
                                rate=1.0, seed=2, max_context=2048),
        block_manager=BlockManagerConfig(num_blocks=400, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
    )
    sim = Simulation(cfg)
    samples = []
    original = sim.scheduler.schedule

    def recording():
        out = original()
        shape = step_shape(out)
        samples.append(StepSample("sim", shape, cost.time_of(shape)))
        return out

    sim.scheduler.schedule = recording
    sim.run()
    return samples


def test_fit_recovers_the_coefficients_that_made_the_times():
    truth = CostModel(step_overhead=0.01, prefill_per_token=0.0004, decode_per_token=0.002,
                      attention_per_context_token=2e-6, copy_per_page=3e-4, copy_per_slot=0.0,
                      swap_per_page=0.0, prefill_chunk_overhead=0.015,
                      prefill_sample_overhead=0.12, prefill_attention_per_token_pair=1e-8,
                      decode_batch_overhead=0.2, decode_padded_context_token=5e-7,
                      random_sample_per_row=0.004, prefill_chunk_token_square=3e-7,
                      decode_forward_overhead=0.17, decode_attention_per_context_token=1.5e-6,
                      decode_attention_beyond_knee=4e-6, decode_context_knee=6144,
                      host_move_per_page=0.0, disk_load_per_page=0.0)  # timed apart, as copies
    samples = simulated_samples(truth)
    assert len(samples) > 200
    keys = [s.shape.decode_context_tokens for s in samples]
    assert min(keys) < 6144 < max(keys) and 6144 in KNEES  # steps on both slopes
    fitted, fit = fit_cost_model(samples, {"copy_per_page": 3e-4})
    for name, value in truth.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name
    assert fit["median_abs_rel_error"] < 1e-9
    assert [p["label"] for p in fit["points"]] == ["sim"]


def test_the_calibration_grid_pins_every_term():
    """Step times made by known coefficients on the shapes of the steps a
    calibration runs (the quick grid, a tiny model): the fit recovers each
    coefficient, so the grid measures every step kind the terms tell apart
    (its unsampled chunk beside a decode row separates the per-step,
    per-chunk, per-sampling-chunk and decode-forward terms)."""
    from scheduler.simulator.calibrate import QUICK_GRID, calibrate

    model, description = tiny_model()
    shapes = [s for s in calibrate(model, description, QUICK_GRID).samples]
    names = [f.name for f in fields(CostModel)]
    apart = ("copy_per_slot", "swap_per_page", "host_move_per_page", "disk_load_per_page",
             "disk_store_per_page")  # no calibration step moves pages between tiers
    truth = CostModel(**{name: 0.0 if name in apart else (i + 1) * 1e-3
                         for i, name in enumerate(COEFFICIENTS)}, decode_context_knee=512)
    samples = [StepSample(s.label, s.shape, truth.time_of(s.shape)) for s in shapes]
    fitted, _ = fit_cost_model(samples, {"copy_per_page": truth.copy_per_page})
    for name in names:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6,
                                                      abs=1e-12), name


def test_mixed_and_drawn_points_are_spread_over_the_decode_points():
    """The calibration measures each decode context's points followed by a
    share of the mixed (chunk beside decode rows) and drawn points, not all
    of them in one block at the end: the machine's speed moves between
    minutes, and one block would take one minute's speed for one step
    kind. Every grid point is still measured once per repeat."""
    from scheduler.simulator.calibrate import QUICK_GRID, calibrate

    model, description = tiny_model()
    grid = replace(QUICK_GRID, decode_contexts=(32, 64, 256), mixed_batches=(1, 2, 4),
                   mixed_contexts=(32, 64))
    labels = [s.label for s in calibrate(model, description, grid).samples]
    contexts = grid.decode_contexts
    starts = [min(i for i, label in enumerate(labels)
                  if label in (f"decode B=1 C={c}", f"decode spread B=1 C<={c}"))
              for c in contexts] + [len(labels)]
    for kind in ("mixed B=", "decode drawn"):
        steps = [i for i, label in enumerate(labels) if label.startswith(kind)]
        shares = [sum(start < i < end for i in steps) for start, end in zip(starts, starts[1:])]
        # after the first and second contexts' points
        assert shares[0] and shares[1], (kind, shares)
    assert sum(starts[2] < i for i, label in enumerate(labels) if label.startswith("mixed B=")) == 2
    mixed = [label for label in labels if label.startswith("mixed B=")]
    assert sorted(mixed) == sorted({f"mixed B={b} C={c} L={n}" for b in grid.mixed_batches
                                    for c in grid.mixed_contexts for n in grid.mixed_chunks})
    assert {label for label in labels if label.startswith("decode drawn")} == {
        f"decode drawn B={b} C=32" for b in grid.decode_batches}


@pytest.mark.parametrize("window", [None, 32])
def test_anchors_repeat_grid_points_and_drift_is_their_change(window):
    """Anchors are grid points measured again: the same labels and step
    shapes as the calibration's, so the same hits and recomputed prompts
    (a sliding-window model's decode point below the calibration's base
    length recomputes its prompt there: the window group keeps no pages that
    far behind the base's end, and the anchor must too); their drift against
    the profile is 0 for the calibration's own steps and +100 % for steps
    that took twice as long."""
    from scheduler.simulator.calibrate import QUICK_GRID, Anchors, calibrate, drift, measure_anchors
    from scheduler.simulator.engine_models import ModelSpec, load_model

    preset = "qwen3-0.6b" if window is None else "qwen3-0.6b-sliding"
    shape = TINY_SHAPE if window is None else TINY_SHAPE | {"sliding_window": window}
    model, description = load_model(ModelSpec(preset=preset, layers=2, shape=shape))
    grid = replace(QUICK_GRID, decode_contexts=(32, 64, 256))  # 64 after 32, as 512 after 128
    profile = calibrate(model, description, grid)
    anchors = measure_anchors(model, description, grid,
                              Anchors(16, ((1, 32), (4, 64), (4, 256)), (4, 64, 32)))
    labels = {s.label for s in anchors}
    assert labels == {"prefill L=16", "mixed unsampled B=1 C=128 L<=15", "decode B=1 C=32",
                      "decode B=4 C=64", "decode B=4 C=256", "mixed B=4 C=64 L=32"}
    for label in labels:
        def shapes(samples):
            return [(s.shape.prefill_tokens, s.shape.decode_rows, s.shape.context_tokens)
                    for s in samples if s.label == label]
        # the mixed anchor repeats its step, one token later each
        calibrated = shapes(profile.samples)
        assert shapes(anchors)[:len(calibrated)] == calibrated, label
    assert len([s for s in anchors if s.label == "mixed B=4 C=64 L=32"]) == Anchors().mixed_steps
    def order(samples):  # labels by first step, in the order measured
        return list(dict.fromkeys(s.label for s in samples))
    calibrated = [label for label in order(profile.samples) if label in labels]
    assert order(anchors) == calibrated  # the mixed anchor where the calibration measured it
    recomputed = [s for s in anchors if s.label == "decode B=1 C=32" and s.shape.prefill_tokens]
    # the window group cannot hit the base that far back
    assert bool(recomputed) == (window is not None)
    with pytest.raises(ValueError, match="one row only at 32"):
        measure_anchors(model, description, grid, Anchors(16, ((1, 64),), (4, 64, 32)))
    with pytest.raises(ValueError, match="mixed anchor"):  # not a grid point: it would never run
        measure_anchors(model, description, grid, Anchors(16, ((4, 64),), (2, 64, 32)))
    points = profile.fit["points"]
    own = [s for s in profile.samples if s.label in labels]
    assert drift(points, own) == pytest.approx({label: 0.0 for label in labels})
    slower = [StepSample(s.label, s.shape, 2 * s.seconds) for s in own]
    assert drift(points, slower) == pytest.approx({label: 1.0 for label in labels})
    assert drift(points, [StepSample("not in the grid", own[0].shape, 1.0)]) == {}


def test_profile_round_trip_and_bad_profiles(tmp_path):
    cost = CostModel(step_overhead=0.5, decode_batch_overhead=0.25)
    profile = CostProfile(cost, {"num_steps": 0, "points": []}, {"blas": {"name": "x"}},
                          {"preset": "p"}, {}, "now")
    path = tmp_path / "p.json"
    write_profile(path, profile)
    assert read_cost(path) == cost
    data = json.loads(path.read_text())
    data["cost"]["decode_per_token"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="cost decode_per_token must be >= 0.0, got -1"):
        read_cost(path)
    data["cost"]["bogus"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="keys among"):
        read_cost(path)
    path.write_text(json.dumps({"type": "something else"}))
    with pytest.raises(ProfileError, match="not a cost profile"):
        read_cost(path)


def test_simulate_with_a_profile_uses_its_cost_and_cost_overrides_it(tmp_path, capsys):
    cost = CostModel(step_overhead=0.5, prefill_per_token=0.001, decode_per_token=0.01,
                     decode_batch_overhead=0.25)
    path = tmp_path / "p.json"
    write_profile(path, CostProfile(cost, {}, {}, {}, {}, "now"))
    out = tmp_path / "rep"
    args = ["simulate", "-n", "20", "--no-plots", "--no-progress", "--out", str(out),
            "--profile", str(path)]
    assert main(args) == 0
    assert json.loads((out / "report.json").read_text())["config"]["cost"] == cost.to_dict()
    assert main(args + ["--cost", "step_overhead=0.1"]) == 0
    used = json.loads((out / "report.json").read_text())["config"]["cost"]
    assert used == {**cost.to_dict(), "step_overhead": 0.1}
    (tmp_path / "bad.json").write_text("{")
    capsys.readouterr()
    assert main(args[:-1] + [str(tmp_path / "bad.json")]) == 2
    assert "profile" in capsys.readouterr().err


def test_simulate_with_a_profile_takes_its_layout_unless_one_is_given(tmp_path, capsys):
    layout = ModelLayout(full=1, sliding=1, window=64)
    path = tmp_path / "p.json"
    write_profile(path, CostProfile(CostModel(), {}, {}, {}, {}, "now", layout=layout))
    assert read_layout(path) == layout
    out = tmp_path / "rep"
    args = ["simulate", "-n", "20", "--no-plots", "--no-progress", "--out", str(out),
            "--profile", str(path)]

    def used_layout() -> dict:
        return json.loads((out / "report.json").read_text())["config"]["layout"]

    assert main(args) == 0
    assert used_layout() == layout.to_dict()
    assert main(args + ["--layout", "full"]) == 0
    assert used_layout() == ModelLayout().to_dict()
    data = json.loads(path.read_text())
    del data["layout"]  # a profile from before layouts counted every key
    path.write_text(json.dumps(data))
    assert read_layout(path) == ModelLayout()
    data["layout"] = {"full": 1, "sliding": 1}  # no window
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="layout: a layout with sliding layers needs a window"):
        read_layout(path)
    capsys.readouterr()
    assert main(args) == 2
    assert "needs a window" in capsys.readouterr().err


# ------------------------------------------------------------------ replay


def tiny_model():
    from scheduler.simulator.engine_models import ModelSpec, load_model

    return load_model(ModelSpec(preset="qwen3-0.6b", layers=2, shape=TINY_SHAPE))


def burst_trace(tmp_path, num: int = 12):
    """Requests that all arrive at once, some sharing a system prompt."""
    records = [{"id": f"q{i}", "arrival": 0.0,
                "prompt": [[7 + i % 3, 40 + 16 * (i % 3)], [1000 + i, 9 + i]],
                "output_len": 3 + i % 4} for i in range(num)]
    path = tmp_path / "burst.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-0.6b-sliding"])
def test_replay_makes_the_simulators_scheduling_decisions(tmp_path, preset):
    """With every request present from the start, timing cannot change a
    decision: the engine replay and the simulation of the replay's config
    schedule the same steps, hit the same prefixes, use the same pages and
    preempt alike. A sliding-window model's replay config carries the
    model's layout, so the simulated store has the engine's window group
    (which frees pages that leave the window: peak pages would differ)."""
    from scheduler.simulator.engine_models import ModelSpec, load_model
    from scheduler.simulator.replay import run_replay

    shape = TINY_SHAPE | ({"sliding_window": 32} if preset.endswith("sliding") else {})
    model, description = load_model(ModelSpec(preset=preset, layers=2, shape=shape))
    cfg = SimulationConfig(
        trace=str(burst_trace(tmp_path)), vocab_size=101, check_every=4, sample_every=2,
        block_manager=BlockManagerConfig(num_blocks=20, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=6),
    )
    seen = []
    replayed = run_replay(cfg, model, description, step_listener=lambda out, seconds: seen.append(
        (sum(len(item.token_ids) for item in out.seqs), seconds)))
    expected = (ModelLayout(full=1, sliding=1, window=32) if "sliding_window" in shape
                else ModelLayout())
    assert replayed.config.layout == expected
    real = replayed.summary
    sim = run_simulation(replayed.config).summary
    assert real["requests"]["finished"] == sim["requests"]["finished"] == 12
    assert real["requests"]["output_tokens"] == sim["requests"]["output_tokens"] == sum(
        3 + i % 4 for i in range(12))
    assert real["steps"]["count"] == sim["steps"]["count"]
    for section, key in (("prefix_cache", "hit_tokens"), ("prefix_cache", "query_tokens"),
                         ("memory", "pages_used_peak"), ("preemptions", "total"),
                         ("preemptions", "recomputed_tokens"), ("evictions", "pages")):
        assert real[section][key] == sim[section][key], (section, key)
    assert sim["preemptions"]["total"] > 0  # the pool is small enough to matter
    assert real["checks"]["leaks"] == "ok"
    # the listener saw every step
    assert real["engine"]["steps"] == real["steps"]["count"] == len(seen)
    scheduled = sim["steps"]["mean_batch_tokens"] * sim["steps"]["count"]  # the simulator's tokens
    assert sum(tokens for tokens, _ in seen) == pytest.approx(scheduled)
    assert all(seconds > 0 for _, seconds in seen)
    pc = real["prefix_cache"]
    assert 0 < pc["first_admission_hit_rate"] <= pc["infinite_cache_hit_rate"]


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_replay_time_is_engine_time_with_idle_gaps_skipped(tmp_path, clock):
    """A request arriving late: its latency is its own steps, not the wait
    for its arrival. A second one arriving during the first step waits for
    that step, as it would in the simulator. Either clock."""
    from scheduler.simulator.replay import Replay

    model, description = tiny_model()
    path = tmp_path / "late.jsonl"
    path.write_text(
        json.dumps({"id": "a", "arrival": 1000.0, "prompt_tokens": list(range(1, 40)),
                    "output_len": 4})
        + "\n" + json.dumps({"id": "b", "arrival": 1000.000001, "prompt_tokens": [5, 6, 7],
                              "output_len": 1}) + "\n")
    cfg = SimulationConfig(trace=str(path), vocab_size=101,
                           block_manager=BlockManagerConfig(num_blocks=16, block_size=16))
    replay = Replay(cfg, model, description, clock=clock)
    summary = replay.run().summary
    assert summary["engine"]["clock"] == clock
    step_times = replay.engine.stats.step_times
    assert len(step_times) == 4
    ttft, e2e = summary["latency"]["ttft_s"], summary["latency"]["e2e_s"]
    # a's first token comes within the first step, b's within the second, a's
    # last within the last: the 1000 s before the arrival are skipped, not
    # waited for or counted. Replay time also runs through each step's tail
    # after its step time is taken (KV events, the step listener; on the cpu
    # clock other threads' CPU time in it too), hence the millisecond.
    assert 0 < ttft["p50"] <= ttft["max"] <= sum(step_times[:2]) + 1e-3
    assert sum(step_times[:-1]) < e2e["max"] < 500
    # b arrived 1 us into a's first step and was queued until it ended.
    assert summary["latency"]["queue_s"]["max"] >= step_times[0] - 1e-6
    # Replay time runs only inside Engine.step(), which contains each step_time.
    assert e2e["max"] <= summary["throughput"]["simulated_seconds"]
    assert sum(step_times) <= summary["throughput"]["simulated_seconds"] < 500


def test_replay_samples_of_a_parallel_request_differ(tmp_path):
    """n = 4 samples are drawn, not argmax'd: four different outputs reach
    the trie, as the workload's four texts do in the simulator."""
    from scheduler.simulator.replay import Replay

    model, description = tiny_model()
    path = tmp_path / "n4.jsonl"
    path.write_text(json.dumps({"id": "p", "arrival": 0.0, "prompt_tokens": list(range(1, 33)),
                                "output_len": 40, "n": 4}) + "\n")
    cfg = SimulationConfig(trace=str(path), vocab_size=101,
                           block_manager=BlockManagerConfig(num_blocks=64, block_size=16))
    replay = Replay(cfg, model, description)
    assert replay.run().summary["requests"]["output_tokens"] == 160
    # 2 prompt pages, then per sample 32 + 40 - 1 computed tokens: pages 3..5 its own.
    assert replay.engine.cache.block_manager.stats.num_trie_pages == 2 + 4 * 3


def test_replay_rejects_closed_loop_and_a_vocabulary_too_large():
    from scheduler.simulator.replay import ReplayError, run_replay

    model, description = tiny_model()
    closed = SimulationConfig(workload=WorkloadConfig(num_requests=3, arrival="closed",
                                                      max_context=256),
                              vocab_size=101)
    with pytest.raises(ReplayError, match="open-loop"):
        run_replay(closed, model, description)
    with pytest.raises(ReplayError, match="vocab_size 32000 exceeds the model's 101"):
        run_replay(SimulationConfig(), model, description)


# --------------------------------------------------------------------- CLI


def test_calibrate_replay_simulate_compare_from_the_cli(tmp_path, capsys):
    shape = ",".join(f"{k}={v}" for k, v in TINY_SHAPE.items())
    model = ["--preset", "qwen3-0.6b", "--layers", "1", "--shape", shape]
    profile = tmp_path / "profile.json"
    (tmp_path / "disk").mkdir()
    assert main(["calibrate", *model, "--quick", "--no-progress", "--clock", "cpu",
                 "--disk-cache", str(tmp_path / "disk"), "--out", str(profile)]) == 0
    printed = capsys.readouterr().out
    assert "per-step error median" in printed
    worst = max(json.loads(profile.read_text())["fit"]["points"], key=lambda p: abs(p["rel_error"]))
    assert f"worst grid points (mean step, predicted vs measured): {worst['label']} " in printed
    data = json.loads(profile.read_text())
    assert data["model"]["preset"] == "qwen3-0.6b" and data["model"]["config"]["hidden_size"] == 64
    assert data["mlx_version"] and {"name", "optimized", "matmul_1024_gflops"} <= set(data["blas"])
    labels = {p["label"] for p in data["fit"]["points"]}
    assert {"prefill L=16", "prefill L=64", "decode B=4 C=256", "decode drawn B=4 C=64",
            "mixed B=1 C=64 L=32", "mixed B=4 C=64 L=32",
            "mixed unsampled B=1 C=128 L<=63"} <= labels
    assert all(np.isfinite(p["rel_error"]) for p in data["fit"]["points"])
    assert data["cost"]["copy_per_page"] > 0
    moves = data["grid"]["tier_moves"]  # timed on the --disk-cache directory's disk
    for term in ("host_move_per_page", "disk_store_per_page", "disk_load_per_page"):
        assert data["cost"][term] == moves[term] > 0
    assert moves["disk_read_bytes_per_s"] == pytest.approx(
        moves["record_nbytes"] / moves["disk_load_per_page"])
    assert f"tier moves per page of {moves['record_nbytes']} bytes" in printed
    assert list((tmp_path / "disk").iterdir()) == []  # its temporary folder removed
    assert data["grid"]["clock"] == "cpu"
    assert len(data["steps"]) == data["fit"]["num_steps"]
    assert all(len(terms) == len(data["step_fields"]) for _, _, terms in data["steps"])

    workload = ["--workload", "chat", "-n", "8", "--rate", "50", "--max-context", "256",
                "--num-blocks", "64", "--no-plots", "--no-progress"]
    real, sim = tmp_path / "real", tmp_path / "sim"
    assert main(["replay", *model, *workload, "--check", "4", "--out", str(real)]) == 0
    assert "blockmgr replay" in capsys.readouterr().out
    report = json.loads((real / "report.json").read_text())
    assert report["config"]["vocab_size"] == 101
    assert report["summary"]["requests"]["finished"] == 8
    assert "Real engine" in (real / "report.md").read_text()
    assert main(["simulate", "--config", str(real / "report.json"), "--profile", str(profile),
                 "--out", str(sim), "--no-plots", "--no-progress"]) == 0
    capsys.readouterr()
    simulated_cost = json.loads((sim / "report.json").read_text())["config"]["cost"]
    for term in ("host_move_per_page", "disk_store_per_page", "disk_load_per_page"):
        assert simulated_cost[term] == data["cost"][term]  # simulate prices tier moves with them
    assert main(["compare", str(sim), str(real), "--json"]) == 0
    rows = {r["metric"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["prefix hit rate"]["second"] == report["summary"]["prefix_cache"]["hit_rate"]
    assert rows["TTFT p50, s"]["difference"] == pytest.approx(
        rows["TTFT p50, s"]["second"] / rows["TTFT p50, s"]["first"] - 1)
    assert main(["replay", "--preset", "nope", *workload, "--out", str(real)]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_a_fit_priced_by_forward_overheads_alone_is_a_cost_model():
    """A small model's steps can be all per-forward cost: the fit then
    gives step_overhead, prefill_per_token and decode_per_token 0 (seen on
    the tiny model's calibrations). Every step still costs time (a chunk
    pays `prefill_chunk_overhead`, a decode forward
    `decode_forward_overhead`), so the fit must return that model instead
    of raising."""
    truth = CostModel(step_overhead=0.0, prefill_per_token=0.0, decode_per_token=0.0,
                      prefill_chunk_overhead=2e-3, decode_forward_overhead=1.5e-3)
    shapes = [StepShape(prefill_tokens=n, prefill_chunks=c) for n, c in ((16, 1), (64, 1), (64, 2))]
    shapes += [StepShape(decode_rows=r, sampled_chunks=0) for r in (1, 4, 8)]
    samples = [StepSample(f"p{i}", s, truth.time_of(s)) for i, s in enumerate(shapes)]
    fitted, _ = fit_cost_model(samples, {"copy_per_page": 0.0})
    for shape in shapes + [StepShape(decode_rows=2),
                           StepShape(prefill_tokens=32, prefill_chunks=3)]:
        assert fitted.time_of(shape) == pytest.approx(truth.time_of(shape), rel=1e-6), shape
    assert fitted.step_overhead + fitted.prefill_per_token + fitted.decode_per_token == 0.0
    with pytest.raises(ValueError):  # a model that prices no step at all
        CostModel(step_overhead=0.0, prefill_per_token=0.0, decode_per_token=0.0)


def test_tier_moves_are_timed_on_the_models_page_records_in_the_given_directory(tmp_path):
    """`measure_tier_moves` moves pages of the model's own size (a page of
    every layer, measured here on a one-page cache) through the real host
    and disk tiers, in a temporary folder of the directory it is given."""
    import mlx.core as mx

    from cache import PagedCache
    from scheduler.simulator.tier_bandwidth import measure_tier_moves
    from tests.tiny_models import built

    model = built("llama")
    probe = PagedCache.for_model(model, num_blocks=1, block_size=8)
    probe.allocate("p", [0])
    with probe.step(["p"]) as views:
        mx.eval(model(mx.array([[0]]), cache=views))
    moves = measure_tier_moves(model, 8, num_pages=16, directory=tmp_path, repeats=2)
    assert moves.record_nbytes == probe.nbytes and moves.num_pages == 16
    terms = moves.cost_terms()
    assert set(terms) == {"host_move_per_page", "disk_store_per_page", "disk_load_per_page"}
    assert all(value > 0 for value in terms.values())
    assert moves.disk_write_bytes_per_s > 0 and moves.disk_read_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="num_pages"):
        measure_tier_moves(model, 8, num_pages=0, directory=tmp_path)
