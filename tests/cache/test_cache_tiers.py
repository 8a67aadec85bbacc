"""The prefix cache's host and disk tiers on `PagedCache` (design/tiers.md).

Exactness: the logits of a request whose prefix was evicted to host memory,
to disk, or kept on disk across a restart equal, bit for bit, those of the
same request whose prefix never left the device (a cache big enough to
keep it). Faults (corrupt, truncated or foreign files, a full disk, a read
error, a killed writer, a second opener) leave every request right and
nothing leaked.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from blockmgr import DiskEntry
from blockmgr.ops import Tier
from cache import PagedCache, disk_tier
from cache.disk_tier import DiskCacheLocked
from tests import quant_models
from tests.cache.test_cache_swap import build, toks

HYBRID = ("lfm2", "qwen3_next")
ROOT = Path(__file__).resolve().parents[2]
A, B, C = toks(1, 40), toks(2, 64), toks(3, 64)
QUERY = A + [5, 9]  # hits A (40 tokens: 5 pages of 8), computes 2


@pytest.fixture(scope="module")
def models():
    return {}


def model_of(models, name):
    if name not in models:
        models[name] = build(name)
    return models[name]


def make(model, name, num_blocks=12, **kwargs):
    if "disk_cache" in kwargs:  # a budget for a tiny model: thousands of pages, not millions
        kwargs.setdefault("disk_cache_size", "4MiB")
    return PagedCache.for_model(model, num_blocks=num_blocks, block_size=8,
                                num_slots=4 if name in HYBRID else 0, **kwargs)


def run(pc, model, seq_id, prompt):
    """Allocate, compute what the cache does not hold in one forward, free;
    the last position's logits and the cached token count."""
    alloc = pc.allocate(seq_id, prompt)
    n = alloc.num_cached_tokens
    with pc.step([seq_id]) as views:
        out = model(mx.array([prompt[n:]]), cache=views)
    mx.eval(out)
    pc.free(seq_id)
    return np.array(out[0, -1]), n


def reference(model, name, **kwargs):
    """QUERY's logits with A cached on the device, never evicted."""
    pc = make(model, name, num_blocks=64, **kwargs)
    run(pc, model, "a", A)
    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A)
    return logits


def evict_a(pc, model):
    """Cache A, then push it off the 12-page device with B and C."""
    run(pc, model, "a", A)
    run(pc, model, "b", B)
    run(pc, model, "c", C)
    assert pc.store.tier_usage()[0].num_nodes <= 2


@pytest.mark.parametrize("name", ["llama", "sliding", "lfm2"])
@pytest.mark.parametrize("where", ["host", "disk", "restart"])
def test_evicted_prefix_gives_the_same_logits_bit_for_bit(models, name, where, tmp_path):
    model = model_of(models, name)
    expected = reference(model, name)
    tiers = {"host_cache_size": "1MiB"} if where == "host" else {"disk_cache": tmp_path}
    pc = make(model, name, **tiers)
    evict_a(pc, model)
    if where == "restart":
        pc.close()
        pc = make(model, name, **tiers)
        assert pc.tiers.disk.stats.restored > 0
    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A)
    tier = Tier.HOST if where == "host" else Tier.DISK
    assert pc.tiers.counters.hit_tokens[tier] > 0  # served from that tier, not recomputed
    np.testing.assert_array_equal(logits, expected)
    pc.check_integrity()
    pc.close()


def test_quantized_pages_round_trip_through_disk_and_a_restart(tmp_path):
    model = quant_models.built("llama")  # head size 32: a kv group divides it
    fmt = {"kv_bits": 8, "kv_group_size": 32}
    expected = reference(model, "llama", **fmt)
    pc = make(model, "llama", disk_cache=tmp_path, **fmt)
    evict_a(pc, model)
    pc.close()
    pc = make(model, "llama", disk_cache=tmp_path, **fmt)
    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A) and pc.tiers.counters.hit_tokens[Tier.DISK] > 0
    np.testing.assert_array_equal(logits, expected)
    pc.close()


def test_host_then_disk_then_back_and_nothing_leaks(models, tmp_path):
    """A prefix goes device -> host -> disk under pressure and comes back;
    every tier's pools are whole again after a reset."""
    model = model_of(models, "llama")
    expected = reference(model, "llama")
    pc = make(model, "llama", host_cache_size=12 * pc_page_bytes(model), disk_cache=tmp_path)
    evict_a(pc, model)
    for seed in range(4, 8):  # more pressure: the host tier overflows to disk
        run(pc, model, f"x{seed}", toks(seed, 64))
        pc.check_integrity()
    usage = {u.tier: u for u in pc.store.tier_usage()}
    assert usage[Tier.DISK].num_demoted_pages > 0
    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A)
    np.testing.assert_array_equal(logits, expected)
    pc.reset_prefix_cache()
    pc.check_integrity()
    for u in pc.store.tier_usage():
        assert u.num_nodes == 0 and sum(u.num_used_pages) == 0
    assert pc.num_free_blocks == pc.num_usable_blocks
    pc.close()


def pc_page_bytes(model):
    probe = make(model, "llama", num_blocks=1)
    probe.allocate("p", [0])
    with probe.step(["p"]) as views:
        mx.eval(model(mx.array([[0]]), cache=views))
    return probe.nbytes


# ------------------------------------------------------------------ faults


def closed_cache(model, name, path, **kwargs):
    pc = make(model, name, disk_cache=path, **kwargs)
    evict_a(pc, model)
    pc.close()


def fresh_logits(model, name, prompt):
    """`prompt`'s last logits computed whole (no hit)."""
    logits, n = run(make(model, name, num_blocks=64), model, "f", prompt)
    assert n == 0
    return logits


def index_entries(path):
    return json.loads((path / "index.json").read_text())["entries"]


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_records_are_misses_removed_and_never_served(models, tmp_path, damage, caplog):
    model = model_of(models, "llama")
    closed_cache(model, "llama", tmp_path)
    records = tmp_path / "pages0.bin"
    if damage == "corrupt":  # flip bytes in every record
        data = bytearray(records.read_bytes())
        for offset in range(disk_tier.HEADER_NBYTES + 7, len(data), 1024):
            data[offset] ^= 0xFF
        records.write_bytes(bytes(data))
    else:
        os.truncate(records, disk_tier.HEADER_NBYTES + 100)
    pc = make(model, "llama", disk_cache=tmp_path)
    with caplog.at_level(logging.WARNING, logger="blockmgr.disk_cache"):
        logits, n = run(pc, model, "q", QUERY)
    assert n == 0  # every record of A was damaged: a miss, computed again
    np.testing.assert_allclose(logits, fresh_logits(model, "llama", QUERY), atol=1e-5)
    if damage == "corrupt":
        assert pc.tiers.disk.stats.num_bad_records > 0
        assert sum("unreadable" in r.message for r in caplog.records) == 1
    else:
        assert pc.tiers.disk.stats.dropped_at_open > 0
    pc.check_integrity()
    pc.close()
    # the damaged entries are gone from the index; A as computed now is back
    pc = make(model, "llama", disk_cache=tmp_path)
    logits, n = run(pc, model, "q2", QUERY)
    assert n >= len(A) and pc.tiers.disk.stats.num_bad_records == 0
    pc.close()


def test_a_foreign_models_directory_is_cleared_never_reused(models, tmp_path, caplog):
    closed_cache(model_of(models, "llama"), "llama", tmp_path)
    other = model_of(models, "sliding")
    with caplog.at_level(logging.WARNING, logger="blockmgr.disk_cache"):
        pc = make(other, "sliding", disk_cache=tmp_path)
    assert sum("not reused" in r.message for r in caplog.records) == 1
    assert pc.tiers.disk.stats.restored == 0 and not (tmp_path / "index.json").exists()
    logits, n = run(pc, other, "q", QUERY)
    assert n == 0
    np.testing.assert_array_equal(logits, fresh_logits(other, "sliding", QUERY))
    pc.close()


@pytest.mark.parametrize("change", [{"kv_bits": 8, "kv_group_size": 32}, {"block_size": 4}])
def test_another_format_or_block_size_never_reuses_an_entry(tmp_path, change):
    model = quant_models.built("llama")
    closed_cache(model, "llama", tmp_path)
    block_size = change.pop("block_size", 8)
    pc = PagedCache.for_model(model, 24, block_size, disk_cache=tmp_path,
                              disk_cache_size="4MiB", **change)
    assert pc.tiers.disk.stats.restored == 0
    assert pc.cached_prefix_length(QUERY) == 0
    pc.close()


def test_a_full_disk_turns_the_tier_off_and_requests_finish_right(models, tmp_path,
                                                                  monkeypatch, caplog):
    model = model_of(models, "llama")
    expected = reference(model, "llama")
    pc = make(model, "llama", disk_cache=tmp_path)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "pwrite", full)
    with caplog.at_level(logging.ERROR, logger="blockmgr.disk_cache"):
        evict_a(pc, model)
        pc.tiers.disk.sync() if pc.tiers.disk is not None else None
        for seed in range(4, 7):
            logits, n = run(pc, model, f"x{seed}", toks(seed, 30) + [1])
            np.testing.assert_allclose(logits, fresh_logits(model, "llama",
                                                            toks(seed, 30) + [1]), atol=1e-5)
    assert pc.tiers.disk is None
    assert Tier.DISK not in {u.tier for u in pc.store.tier_usage()}
    assert sum("turned off" in r.message for r in caplog.records) == 1
    run(pc, model, "a2", A)  # A computed again on the device
    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A)
    np.testing.assert_array_equal(logits, expected)
    pc.check_integrity()
    pc.close()


def test_a_read_error_mid_load_turns_the_tier_off_and_the_request_recomputes(
        models, tmp_path, monkeypatch, caplog):
    model = model_of(models, "llama")
    closed_cache(model, "llama", tmp_path)
    pc = make(model, "llama", disk_cache=tmp_path)
    calls = []
    real = disk_tier.pread

    def failing(fd, n, offset):
        calls.append(offset)
        if len(calls) == 3:  # the third record of the load
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(disk_tier, "pread", failing)
    with caplog.at_level(logging.ERROR, logger="blockmgr.disk_cache"):
        logits, n = run(pc, model, "q", QUERY)
    assert n == 0 and len(calls) == 3
    np.testing.assert_allclose(logits, fresh_logits(model, "llama", QUERY), atol=1e-5)
    assert pc.tiers.disk is None
    assert sum("turned off" in r.message for r in caplog.records) == 1
    pc.check_integrity()
    assert pc.num_free_blocks + pc.num_cached_blocks == pc.num_usable_blocks


def test_a_second_opener_is_refused_in_process_and_from_another_process(models, tmp_path):
    model = model_of(models, "llama")
    pc = make(model, "llama", disk_cache=tmp_path)
    with pytest.raises(DiskCacheLocked, match="in use"):
        make(model, "llama", disk_cache=tmp_path)
    code = textwrap.dedent(f"""
        from cache.disk_tier import DiskTier, DiskCacheLocked, RecordKind
        try:
            DiskTier({str(tmp_path)!r}, "x", [RecordKind("pages0", 8, 4)])
        except DiskCacheLocked as error:
            print("refused:", error)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("refused:"), out.stderr
    pc.close()
    make(model, "llama", disk_cache=tmp_path).close()  # free again once closed


WRITER = """
import sys, mlx.core as mx
from tests import quant_models
from tests.cache.test_cache_swap import build, toks
from tests.cache.test_cache_tiers import make, run
model = build("llama")
pc = make(model, "llama", disk_cache=sys.argv[1], checkpoint_interval=0.0)
for i in range(10_000):
    run(pc, model, f"s{i}", toks(100 + i % 40, 48))
    if pc.tiers.disk.stats.num_checkpoints:
        print("checkpointed", i, flush=True)
"""


def test_sigkill_during_a_burst_of_writes_restarts_to_a_consistent_cache(models, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = 0
        deadline = time.monotonic() + 120
        while lines < 12 and time.monotonic() < deadline:
            if proc.stdout.readline().startswith("checkpointed"):
                lines += 1
        assert lines == 12, proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    model = model_of(models, "llama")
    pc = make(model, "llama", disk_cache=tmp_path)
    assert pc.tiers.disk.stats.restored > 0
    fresh = make(model, "llama", num_blocks=16, enable_prefix_cache=False)
    num_hits = 0
    for seed in range(100, 125):
        prompt = toks(seed, 48) + [3]
        logits, n = run(pc, model, f"r{seed}", prompt)
        num_hits += n > 0
        np.testing.assert_allclose(logits, run(fresh, model, "f", prompt)[0], atol=1e-4)
        pc.check_integrity()
    assert num_hits > 0
    pc.close()


def test_pin_keeps_a_prefix_on_the_device_and_loads_it_back_from_disk(models, tmp_path):
    model = model_of(models, "llama")
    expected = reference(model, "llama")
    pc = make(model, "llama", disk_cache=tmp_path)
    evict_a(pc, model)
    pc.pin("system", A)  # loaded back from disk
    assert pc.pinned() == {"system": len(A)}
    for seed in range(4, 8):
        run(pc, model, f"x{seed}", toks(seed, 40))
    assert pc.cached_prefix_length(QUERY) == len(A)
    assert pc.store.tier_usage()[0].num_nodes >= 1
    logits, n = run(pc, model, "q", QUERY)
    np.testing.assert_array_equal(logits, expected)
    pc.unpin("system")
    pc.check_integrity()
    pc.close()


@pytest.mark.parametrize("engine_model", ["llama", "lfm2"])
def test_engine_restart_hits_the_disk_and_outputs_equal_mlx_lm(engine_model, tmp_path):
    from scheduler import Engine, SamplingParams
    from tests.scheduler.test_engine import MAX_TOKENS, assert_no_leak, get

    model, _, prompts, want = get(engine_model)
    options = dict(num_blocks=24, block_size=8, max_num_batched_tokens=64, max_num_seqs=4,
                   disk_cache=tmp_path, disk_cache_size="4MiB")
    with Engine(model, **options) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        assert [o.tokens for o in outs] == want
        assert_no_leak(engine)
    with Engine(model, **options) as engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        assert [o.tokens for o in outs] == want
        assert engine.cache.tiers.counters.hit_tokens[Tier.DISK] > 0
        assert_no_leak(engine)


def test_the_index_keeps_which_snapshots_are_checkpoints(tmp_path):
    kinds = [disk_tier.RecordKind("pages0", 8, 4), disk_tier.RecordKind("slots", 8, 4)]
    entries = [
        DiskEntry(None, (1, 2, 3, 4), 0, ((0,),), 0, checkpoint=True),
        DiskEntry(None, (1, 2, 3, 4, 5, 6, 7, 8), 4, ((1,),), 1),
    ]
    disk = disk_tier.DiskTier(tmp_path, "x", kinds)
    for name, record in (("pages0", 0), ("pages0", 1), ("slots", 0), ("slots", 1)):
        disk.write(name, record, np.full(8, record, np.uint8))
    disk.checkpoint(entries)
    disk.close()
    reopened = disk_tier.DiskTier(tmp_path, "x", kinds)
    assert [item.entry for item in reopened.restored] == entries
    reopened.close()
    index = json.loads((tmp_path / disk_tier.INDEX).read_text())
    for raw in index["entries"]:
        del raw["checkpoint"]  # an index written before the flag: no checkpoints
    (tmp_path / disk_tier.INDEX).write_text(json.dumps(index))
    older = disk_tier.DiskTier(tmp_path, "x", kinds)
    assert [item.entry.checkpoint for item in older.restored] == [False, False]
    older.close()
