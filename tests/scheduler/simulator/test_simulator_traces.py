"""Real traces: Mooncake block size, time scaling, CSV columns, and the
infinite-cache hit rate against independent references."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest

from blockmgr import BlockManagerConfig
from scheduler.cli import main
from scheduler.simulator import (
    SimulationConfig,
    TraceError,
    WorkloadConfig,
    generate,
    read_trace,
    run_simulation,
)
from scheduler.simulator.prefix_bound import infinite_cache_hit_rate
from scheduler.simulator.tokens import TokenSource
from scheduler.simulator.trace import MOONCAKE_BLOCK_TOKENS, TraceWarning

REPO = Path(__file__).resolve().parents[3]
MOONCAKE = REPO / "../shared/traces/mooncake_synthetic_trace.jsonl"


def block_level_bound(records: list[dict], block: int) -> float:
    """Mooncake's own reading: whole blocks whose ids were seen before (an id
    names its block and everything before it), capped at the prompt - 1."""
    seen, hit, total = set(), 0, 0
    for r in sorted(records, key=lambda r: r["timestamp"]):
        k = 0
        for block_id in r["hash_ids"]:
            if block_id not in seen:
                break
            k += 1
        hit += min(k * block, r["input_length"] - 1)
        total += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / total


def token_level_bound(specs, vocab: int = 32000) -> float:
    """Brute force over expanded tokens: longest common prefix with any
    earlier prompt or prompt + output, in arrival order."""
    source = TokenSource(vocab)
    earlier: list[tuple[object, list[int]]] = []
    hit = total = 0
    for spec in specs:
        prompt = list(spec.tokens) if spec.tokens is not None else source.expand(spec.prompt)
        best = 0
        for namespace, seen in earlier:
            if namespace != spec.namespace:
                continue
            n = 0
            while n < len(prompt) and n < len(seen) and prompt[n] == seen[n]:
                n += 1
            best = max(best, n)
        hit += min(best, len(prompt) - 1)
        total += len(prompt)
        for sample in range(spec.n):
            key, length = spec.output_segment(sample)
            earlier.append((spec.namespace, prompt + source.text(key, length)))
        earlier.append((spec.namespace, prompt))
    return hit / total


def write_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mooncake_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records, next_id = [], 1000
    for i in range(count):
        length = rng.randint(100, 3000)
        blocks = -(-length // 512)
        shared = rng.randint(0, blocks - 1)  # a cut last block has its own id
        ids = list(range(shared)) + list(range(next_id, next_id + blocks - shared))
        next_id += blocks
        records.append({"timestamp": 250 * i, "input_length": length,
                        "output_length": rng.randint(1, 20), "hash_ids": ids})
    return records


# ------------------------------------------------------------ block size


def test_headerless_mooncake_trace_reads_512_token_blocks_and_warns(tmp_path):
    path = write_lines(tmp_path / "mc.jsonl", mooncake_records(3))
    with pytest.warns(TraceWarning, match="512-token blocks"):
        header, sessions = read_trace(path)
    assert header["prefix_block_tokens"] == MOONCAKE_BLOCK_TOKENS == 512
    assert header["prefix_block_tokens_guessed"] is True
    spec = sessions[0][0]
    assert [length for _, length in spec.prompt][:-1] == [512] * (len(spec.prompt) - 1)


def test_block_size_option_and_header_are_used_without_a_warning(tmp_path):
    records = mooncake_records(3)
    plain = write_lines(tmp_path / "mc.jsonl", records)
    headed = write_lines(tmp_path / "h.jsonl",
                         [{"type": "header", "prefix_block_tokens": 64}] + records)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceWarning)
        header, sessions = read_trace(plain, prefix_block_tokens=32)
        assert header == {"prefix_block_tokens": 32, "prefix_block_tokens_guessed": False}
        assert sessions[0][0].prompt[0][1] == 32
        header, sessions = read_trace(headed)
        assert header["prefix_block_tokens"] == 64
        assert sessions[0][0].prompt[0][1] == 64
    with pytest.raises(ValueError, match="prefix_block_tokens"):
        read_trace(plain, prefix_block_tokens=0)


def test_time_scale_multiplies_arrivals_and_think_times(tmp_path):
    records = [{"id": "a", "arrival": 2.0, "prompt_tokens": [1, 2, 3], "output_len": 2},
               {"id": "b", "after": "a", "think": 1.5, "prompt_tokens": [4, 5], "output_len": 2}]
    path = write_lines(tmp_path / "t.jsonl", records)
    _, [[a, b]] = read_trace(path, time_scale=0.25)
    assert (a.arrival, b.think_time) == (0.5, 0.375)
    with pytest.raises(ValueError, match="time_scale"):
        read_trace(path, time_scale=0)


def test_time_scale_changes_the_load_of_a_replay(tmp_path):
    path = write_lines(tmp_path / "mc.jsonl", mooncake_records(60, seed=2))
    def run(scale):
        cfg = SimulationConfig(trace=str(path), trace_block_tokens=512, time_scale=scale,
                               block_manager=BlockManagerConfig(num_blocks=4096, block_size=16))
        return run_simulation(cfg).summary
    slow, fast = run(4.0), run(0.05)
    # 60 arrivals 0.25 s apart: stretched 4x the queue stays short,
    # compressed 20x it builds up.
    assert slow["throughput"]["simulated_seconds"] > 4 * 59 * 0.25 - 1e-9
    assert fast["latency"]["queue_s"]["p90"] > 10 * slow["latency"]["queue_s"]["p90"]


# ------------------------------------------------------------------ CSV


def test_azure_and_sharegpt_csv_columns(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,396,109\n")
    _, sessions = read_trace(azure)
    specs = [s[0] for s in sessions]
    assert [(s.prompt_len, s.output_len) for s in specs] == [(374, 44), (396, 109)]
    assert specs[0].arrival == 0.0
    assert specs[1].arrival == pytest.approx(4.314579, abs=1e-6)
    assert specs[0].prompt[0][0] != specs[1].prompt[0][0]  # nothing shared
    simple = tmp_path / "s.csv"
    simple.write_text("arrival,input_length,output_length\n1.5,10,3\n2.0,20,4\n")
    _, sessions = read_trace(simple, time_scale=2.0)
    assert [s[0].arrival for s in sessions] == [0.0, 1.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("when,input_length,output_length\n1,2,3\n")
    with pytest.raises(TraceError, match="bad.csv:1: CSV trace needs one of the columns arrival"):
        read_trace(bad)
    bad.write_text("arrival,input_length,output_length\n1,x,3\n")
    with pytest.raises(TraceError, match="bad.csv:2"):
        read_trace(bad)


# ----------------------------------------------------- infinite-cache bound


def test_bound_matches_a_brute_force_token_reference():
    cfg = WorkloadConfig(mix={"chat": 1.0, "multiturn": 1.0, "tenants": 1.0, "parallel": 1.0},
                         num_requests=60, seed=5, max_context=1024)
    specs = [spec for session in generate(cfg) for spec in session]  # heads, then follow-ups
    assert infinite_cache_hit_rate(specs) == pytest.approx(token_level_bound(specs), abs=1e-12)
    tokens = [s for s in specs[:20]]
    assert infinite_cache_hit_rate(tokens) > 0


def test_bound_of_prefix_id_traces_is_mooncakes_block_reuse(tmp_path):
    records = mooncake_records(200, seed=1)
    path = write_lines(tmp_path / "mc.jsonl", records)
    cfg = SimulationConfig(trace=str(path), trace_block_tokens=512, check_every=64,
                           block_manager=BlockManagerConfig(num_blocks=65536, block_size=16))
    s = run_simulation(cfg).summary["prefix_cache"]
    assert s["infinite_cache_hit_rate"] == pytest.approx(block_level_bound(records, 512), abs=1e-12)
    # A pool that never evicts, arrivals far apart: the achieved rate is the bound.
    assert s["first_admission_hit_rate"] == pytest.approx(s["infinite_cache_hit_rate"], abs=1e-12)


@pytest.mark.skipif(not MOONCAKE.is_file(),
                    reason=f"{MOONCAKE} is absent (Mooncake's synthetic trace)")
def test_mooncake_synthetic_trace_bound_is_the_published_65_percent():
    records = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    assert len(records) == 3993
    with pytest.warns(TraceWarning):
        header, sessions = read_trace(MOONCAKE)
    assert header["prefix_block_tokens"] == 512
    specs = sorted((s[0] for s in sessions), key=lambda s: s.arrival)
    bound = infinite_cache_hit_rate(specs)
    assert bound == pytest.approx(block_level_bound(records, 512), abs=1e-12)
    assert bound == pytest.approx(0.651, abs=0.0005)  # the trace's README: 65.1 %


def test_cli_warns_on_guessed_block_size_and_rejects_orphan_options(tmp_path, capsys):
    path = write_lines(tmp_path / "mc.jsonl", mooncake_records(5))
    out = tmp_path / "rep"
    assert main(["simulate", "--trace", str(path), "--out", str(out), "--no-plots",
                 "--time-scale", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert "warning" in captured.err and "512-token blocks" in captured.err
    summary = json.loads(captured.out)
    assert 0 < summary["prefix_cache"]["infinite_cache_hit_rate"] < 1
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["time_scale"] == 2.0
    assert "first-admission hit rate / infinite cache" in (out / "report.md").read_text()
    assert main(["simulate", "--trace", str(path), "--trace-block-tokens", "512", "--out",
                 str(out), "--no-plots"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["simulate", "--time-scale", "2", "--out", str(out)]) == 2
    assert "--time-scale needs --trace" in capsys.readouterr().err
