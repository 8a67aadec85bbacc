"""The KV page format end to end: `blockmgr serve --kv-memory` sizes the pool
by the quantized page size, `blockmgr simulate --kv-memory --kv-shape` holds
as many pages as the engine for the same model, the format shows in the
simulate report and in `/metrics`, and bad values are refused before anything
is built.

The reference page bytes are independent of `cache/`: mlx-lm's own caches
after a one-token forward give each attention layer's kv heads, head sizes
and dtype; `mx.quantize` of that one token's rows gives what a quantized row
takes (packed values, scales, biases). The reference slot bytes are mlx-lm's
``ArraysCache`` states (as tests/scheduler/serving/test_serve_pool.py).
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from blockmgr.errors import InvalidArgument
from cache import KVFormat
from cache.page_format import make_pool
from cache.page_pool import PoolShape
from scheduler import cli
from scheduler.engine.engine import Engine, default_num_slots
from scheduler.engine.sampling import SamplingParams
from scheduler.serving.metrics import ServingMetrics
from scheduler.serving.serve import size_pool
from scheduler.simulator.kv_memory import (
    KVMemory,
    KVShape,
    engine_num_slots,
)
from tests.quant_models import built

BLOCK = 8
MAX_SEQS = 4


def kv_shape(layers: int, head_dim: int = 32) -> dict:
    """`--kv-shape`'s fields: two kv heads a layer, float32 weights."""
    return {"layers": layers, "kv_heads": 2, "head_dim": head_dim, "dtype": "float32"}


#: Each model's KV shape as its config states it (not read from any pool):
#: attention layers, kv heads, head size; float32 weights.
SHAPES = {
    "llama": kv_shape(2),
    "sliding": kv_shape(2),  # one sliding, one full
    "gemma3": kv_shape(4),
    "qwen3": kv_shape(2, head_dim=64),
    "lfm2": kv_shape(1),  # 1 attention + 3 conv layers
    "qwen3_next": kv_shape(1),  # 1 attention + 3 linear
}
FORMATS = [KVFormat(), KVFormat(8, 8, 32), KVFormat(4, 4, 32), KVFormat(8, 4, 32),
           KVFormat(None, 4, 32), KVFormat(8, 8, 64)]


def _side_bytes(rows: mx.array, bits: int | None, group: int) -> int:
    if bits is None:
        return rows.nbytes
    return sum(part.nbytes for part in mx.quantize(rows, group_size=group, bits=bits))


def reference_bytes(model, fmt: KVFormat) -> tuple[int, int]:
    """(one recurrent slot, one page of every attention layer) in `fmt`,
    from mlx-lm's caches of a one-token forward."""
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]], dtype=mx.int32), cache=caches))
    slot = page = 0
    for cache in caches:
        if isinstance(cache, ArraysCache):
            slot += sum(a.nbytes for a in cache.cache if a is not None)
            continue
        assert isinstance(cache, (KVCache, RotatingKVCache)) and cache.offset == 1
        keys, values = cache.keys[..., :1, :], cache.values[..., :1, :]
        page += BLOCK * (_side_bytes(keys, fmt.key_bits, fmt.group_size)
                         + _side_bytes(values, fmt.value_bits, fmt.group_size))
    return slot, page


def shape_of(name: str, slot: int) -> dict:
    shape = SHAPES[name]
    return {**shape, "slot_bytes": slot} if slot else dict(shape)


def fits(name: str, fmt: KVFormat) -> bool:
    return not fmt.quantized or fmt.group_size <= (64 if name == "qwen3" else 32)


CASES = [(name, fmt) for name in SHAPES for fmt in FORMATS if fits(name, fmt)]


@pytest.mark.parametrize("name, fmt", CASES, ids=[f"{n}-{f.name}" for n, f in CASES])
def test_engine_and_simulator_size_the_same_pool_as_the_reference_bytes(name, fmt):
    model = built(name)
    slot, page = reference_bytes(model, fmt)
    num_slots = default_num_slots(MAX_SEQS) if slot else 0
    memory = KVMemory.from_dict({"budget": 1, "shape": shape_of(name, slot),
                                 "format": fmt.to_dict()})
    assert memory.page_bytes(BLOCK) == page
    for pages in (1, 37):
        budget = num_slots * slot + pages * page + page // 2
        size = size_pool(model, budget, BLOCK, MAX_SEQS, fmt)
        assert (size.num_blocks, size.num_slots) == (pages, num_slots)
        assert (size.page_bytes, size.slot_bytes) == (page, slot)
        sim = KVMemory(budget, memory.shape, memory.format)
        assert sim.num_blocks(BLOCK, num_slots) == pages
    # the engine's pools, once written, take exactly those bytes
    engine = Engine(model, num_blocks=size.num_blocks, block_size=BLOCK, kv_format=fmt,
                    num_slots=size.num_slots or None, max_num_seqs=MAX_SEQS)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert engine.cache.nbytes == size.num_blocks * page
    assert engine.cache.nbytes + num_slots * slot <= budget


@pytest.mark.parametrize("name, fmt", [("llama", KVFormat(8, 4, 32)), ("lfm2", KVFormat(4, 4, 32)),
                                       ("gemma3", KVFormat()), ("qwen3", KVFormat(8, 8, 64))])
def test_simulate_kv_memory_gives_the_engines_page_count(name, fmt):
    """The same memory, shape and format on the command line: the simulated
    pool has the pages `serve` gives the engine (hybrid: with the engine's
    default slots unless --num-slots says otherwise)."""
    model = built(name)
    slot, page = reference_bytes(model, fmt)
    budget = (default_num_slots(MAX_SEQS) * slot if slot else 0) + 1000 * page + 3
    argv = ["simulate", "--kv-memory", str(budget), "--block-size", str(BLOCK),
            "--max-num-seqs", str(MAX_SEQS), "--max-context", "256",
            "--kv-shape", ",".join(f"{k}={v}" for k, v in shape_of(name, slot).items())]
    if fmt.quantized:
        argv += ["--kv-key-bits", str(fmt.key_bits), "--kv-value-bits", str(fmt.value_bits),
                 "--kv-group-size", str(fmt.group_size)]
    if slot:
        argv.append("--hybrid")
    config = cli.build_config(cli.build_parser().parse_args(argv))
    engine_pool = size_pool(model, budget, BLOCK, MAX_SEQS, fmt)
    assert config.block_manager.num_blocks == engine_pool.num_blocks == 1000
    assert config.block_manager.num_slots == engine_pool.num_slots


def test_engine_num_slots_is_the_engines_default():
    for seqs in (1, 4, 64):
        assert engine_num_slots(seqs) == default_num_slots(seqs)


@pytest.mark.parametrize("key, value, group", [(None, None, 64), (8, 8, 32), (4, 4, 128),
                                               (8, 4, 64), (None, 8, 32), (4, None, 64)])
def test_the_simulators_page_is_what_a_pool_allocates(key, value, group):
    fmt = KVFormat(key, value, group)
    for dtype, name in ((mx.float16, "float16"), (mx.bfloat16, "bfloat16"),
                        (mx.float32, "float32")):
        memory = KVMemory(1, KVShape(3, 4, 128, 256, name), fmt)
        pool = make_pool(fmt, PoolShape(2, 16, 4, 128, 256, dtype), 0)  # two pages
        assert memory.page_bytes(16) == 3 * pool.nbytes // 2


@pytest.mark.parametrize("kwargs", [{"key_bits": 3}, {"value_bits": 16}, {"key_bits": True},
                                    {"group_size": 48}, {"group_size": 16}])
def test_the_simulators_format_refuses_what_the_cache_refuses(kwargs):
    with pytest.raises(InvalidArgument):
        KVFormat(**kwargs)
    with pytest.raises(InvalidArgument):
        KVFormat.from_dict(kwargs)


def test_simulate_report_names_the_format(tmp_path, capsys):
    out = tmp_path / "rep"
    code = cli.main(["simulate", "-n", "20", "--rate", "2", "--no-progress", "--no-plots",
                     "--max-context", "1024", "--kv-memory", "64MiB", "--kv-bits", "8",
                     "--kv-value-bits", "4", "--kv-shape",
                     "layers=28,kv_heads=8,head_dim=128,dtype=bfloat16", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    memory = report["config"]["kv_memory"]
    assert memory["format"] == {"key_bits": 8, "value_bits": 4, "group_size": 64}
    assert memory["budget"] == 64 * 2**20
    # bfloat16, head size 128, groups of 64: 136 bytes a key row, 72 a value row
    page = 16 * 28 * 8 * (136 + 72)
    assert report["config"]["block_manager"]["num_blocks"] == 64 * 2**20 // page
    md = (out / "report.md").read_text()
    assert f"k8v4-g64 pages of {page / 2**10:.2f} KiB from a KV memory of 64.00 MiB" in md
    assert report["summary"]["requests"]["finished"] == 20


SIM = ["simulate", "-n", "4", "--no-progress", "--no-plots", "--max-context", "256"]
SHAPE = ["--kv-shape", "layers=2,kv_heads=2,head_dim=96"]


@pytest.mark.parametrize("extra, message", [
    (["--kv-bits", "3"], "argument --kv-bits: invalid choice: 3"),
    (["--kv-key-bits", "16"], "argument --kv-key-bits: invalid choice: 16"),
    (["--kv-memory", "1MiB", *SHAPE, "--kv-bits", "8", "--kv-group-size", "48"],
     "argument --kv-group-size: invalid choice: 48"),
    (["--kv-memory", "1MiB", *SHAPE, "--kv-group-size", "32"], "--kv-group-size needs --kv-bits"),
    (["--kv-bits", "8"], "needs --kv-memory"),
    (["--kv-memory", "1MiB", "--kv-bits", "8"], "--kv-memory needs the model's KV shape"),
    (["--kv-memory", "1MiB", *SHAPE, "--kv-bits", "8", "--kv-group-size", "64"],
     "key head size 96 is not a multiple of the kv group size 64"),
    (["--kv-memory", "1MiB", *SHAPE, "--kv-bits", "8", "--kv-key-bits", "4",
      "--kv-value-bits", "4"], "--kv-bits has no effect"),
    (["--kv-memory", "1MiB", *SHAPE, "--num-blocks", "64"], "give --num-blocks or --kv-memory"),
    (["--kv-memory", "100", *SHAPE], "does not hold 0 recurrent slots"),
    (["--kv-memory", "1MiB", "--kv-shape", "layers=2,kv_heads=2,head_dim=64,dtype=int8"],
     "dtype must be one of"),
    (["--kv-memory", "1MiB", "--kv-shape", "layers=2,kv_heads=2,head_dim=64",
      "--hybrid"], "give one slot's bytes"),
])
def test_bad_kv_options_of_simulate_are_one_line(extra, message, capsys, tmp_path):
    code = cli.main(SIM + ["--out", str(tmp_path)] + extra)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockmgr simulate: error: "), err
    assert message in lines[0]
    assert not list(tmp_path.iterdir())  # no report half-written


def test_metrics_name_the_page_format():
    model = built("llama")
    engine = Engine(model, num_blocks=32, block_size=BLOCK, kv_bits=4, kv_group_size=32)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    text = ServingMetrics().render(engine)
    info = [line for line in text.splitlines() if line.startswith("blockmgr_cache_config_info")]
    assert info == ['blockmgr_cache_config_info{kv_format="k4v4-g32",block_size="8",'
                    'num_pages="32"} 1']
    assert "# TYPE blockmgr_cache_config_info gauge" in text


def test_replay_runs_the_simulated_format(tmp_path):
    """`blockmgr replay --config report.json` of a pool sized by a KV memory
    runs the engine on pages of that format (not silently at the model's
    dtype), as many as the config says; a model whose head size the group
    does not divide is refused naming the layer."""
    from scheduler.simulator.config import SimulationConfig
    from scheduler.simulator.engine_models import ModelSpec, load_model
    from scheduler.simulator.replay import Replay

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"q{i}", "arrival": 0.0, "output_len": 3,
                                         "prompt_tokens": [1 + i, 2, 3, 4, 5]}) + "\n"
                             for i in range(3)))
    argv = ["simulate", "--trace", str(trace), "--block-size", "8", "--kv-memory", "64KiB",
            "--kv-shape", "layers=2,kv_heads=2,head_dim=32,dtype=float32", "--kv-bits", "8",
            "--kv-group-size", "32"]
    config = cli.build_config(cli.build_parser().parse_args(argv))
    config = SimulationConfig.from_dict({**config.to_dict(), "vocab_size": 101})
    # 2 layers x 2 heads x 8 tokens x 2 sides x (32 + 2 x 4) bytes = 2560 bytes a page
    assert config.block_manager.num_blocks == 64 * 1024 // 2560
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101)
    model, description = load_model(ModelSpec(preset="qwen3-0.6b", layers=2,
                                              shape={**shape, "head_dim": 32}))
    replay = Replay(config, model, description)
    assert replay.engine.cache.kv_format == KVFormat(8, 8, 32)
    assert replay.run().summary["requests"]["finished"] == 3
    assert replay.engine.cache.nbytes == 25 * 2560
    model, description = load_model(ModelSpec(preset="qwen3-0.6b", layers=2,
                                              shape={**shape, "head_dim": 16}))
    with pytest.raises(InvalidArgument, match="layer 0: key head size 16"):
        Replay(config, model, description)


def test_a_sweep_over_formats_and_block_sizes_resizes_the_pool():
    """Each point of a sweep over a KV memory's format, budget and block size
    has the pages that memory holds at that point (what serve would build)."""
    from scheduler.simulator.sweep import grid_points, parse_grid

    shape = "layers=28,kv_heads=8,head_dim=128,dtype=bfloat16"
    argv = ["simulate", "--max-context", "1024", "--kv-memory", "128MiB", "--kv-shape", shape]
    base = cli.build_config(cli.build_parser().parse_args(argv))
    grid = parse_grid("kv_bits=none,8,4;block_size=16,32;kv_memory=128MiB,256MiB")
    points = grid_points(base, grid, None)
    assert len(points) == 12
    row = {None: 256, 8: 136, 4: 72}  # bytes of a key or value row (bfloat16, groups of 64)
    for params, config in points:
        budget = {"128MiB": 128, "256MiB": 256}[params["kv_memory"]] * 2**20
        page = params["block_size"] * 28 * 8 * 2 * row[params["kv_bits"]]
        assert config.block_manager.block_size == params["block_size"]
        assert config.block_manager.num_blocks == budget // page, params
        assert config.kv_memory.format.key_bits == config.kv_memory.format.value_bits \
            == params["kv_bits"]
    points = grid_points(base, parse_grid("kv_value_bits=4;kv_group_size=32,128"), None)
    # the base keeps keys at the model's dtype
    assert [c.kv_memory.format.name for _, c in points] == ["kfullv4-g32", "kfullv4-g128"]


@pytest.mark.parametrize("spec, base_argv, message", [
    ("kv_bits=8,4", ["--num-blocks", "256"], "sweeping kv_* needs a pool sized by --kv-memory"),
    ("num_blocks=64;kv_bits=8", ["--kv-memory", "128MiB"], "sweep num_blocks or the KV memory"),
    ("kv_bits=8,3", ["--kv-memory", "128MiB"], "key_bits must be one of (4, 8)"),
    ("kv_group_size=48", ["--kv-memory", "128MiB", "--kv-bits", "8"], "kv group size must be"),
])
def test_bad_kv_sweeps_are_refused(spec, base_argv, message):
    from scheduler.simulator.sweep import grid_points, parse_grid

    argv = ["simulate", "--max-context", "1024", *base_argv]
    if "--kv-memory" in base_argv:
        argv += ["--kv-shape", "layers=28,kv_heads=8,head_dim=128,dtype=bfloat16"]
    base = cli.build_config(cli.build_parser().parse_args(argv))
    with pytest.raises(ValueError, match=re.escape(message)):
        grid_points(base, parse_grid(spec), None)


@pytest.mark.parametrize("name, fmt", [("llama", KVFormat(8, 4, 32)), ("sliding", KVFormat()),
                                       ("gemma3", KVFormat(4, 4, 32)),
                                       ("qwen3", KVFormat(8, 8, 64)),
                                       ("lfm2", KVFormat(None, 8, 32)),
                                       ("qwen3_next", KVFormat(4, 4, 32))])
def test_serve_states_the_simulate_options_of_its_pool(name, fmt):
    """The options `blockmgr serve` prints (read from the model's own caches)
    give `blockmgr simulate` the engine's pages and slots."""
    from scheduler.serving.serve import simulate_options

    model = built(name)
    slot, page = reference_bytes(model, fmt)
    budget = (default_num_slots(MAX_SEQS) * slot if slot else 0) + 300 * page + 7
    size = size_pool(model, budget, BLOCK, MAX_SEQS, fmt)
    options = simulate_options(model, size, fmt, BLOCK, str(budget))
    assert options is not None and ("--hybrid" in options) == bool(slot)
    argv = ["simulate", *options.split(), "--max-num-seqs", str(MAX_SEQS), "--max-context", "64"]
    config = cli.build_config(cli.build_parser().parse_args(argv))
    assert (config.block_manager.num_blocks,
            config.block_manager.num_slots) == (300, size.num_slots)
    assert config.kv_memory.format.name == fmt.name
