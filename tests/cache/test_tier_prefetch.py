"""Admission prefetch: a waiting request's disk-cached prefix is read on a
background thread before its allocation, and the allocation uses those
reads: the logits are those of a prefix never evicted, bit for bit; the
engine's outputs are the same with and without it; a read that fails in
the background turns the disk off at the allocation, and the request is
computed right."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from blockmgr.ops import Tier
from cache import disk_tier
from tests.cache.test_cache_tiers import QUERY, A, evict_a, make, model_of, reference, run


@pytest.fixture(scope="module")
def models():
    return {}


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_prefetched_load_gives_the_never_evicted_logits(models, tmp_path, name):
    model = model_of(models, name)
    expected = reference(model, name)
    pc = make(model, name, disk_cache=tmp_path)
    evict_a(pc, model)
    num = pc.prefetch(QUERY)
    assert num >= 5  # A's five pages (and a snapshot)
    assert pc.prefetch(QUERY) == 0  # already under way
    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A) and pc.tiers.counters.hit_tokens[Tier.DISK] > 0
    assert pc.tiers.num_prefetched == num  # the allocation read nothing itself
    np.testing.assert_array_equal(logits, expected)
    pc.check_integrity()
    pc.close()


def test_a_background_read_error_turns_the_disk_off_and_the_request_recomputes(
        models, tmp_path, monkeypatch, caplog):
    model = model_of(models, "llama")
    pc = make(model, "llama", disk_cache=tmp_path)
    evict_a(pc, model)
    pc.tiers.disk.sync()

    def failing(fd, n, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_tier, "pread", failing)
    assert pc.prefetch(QUERY) > 0
    logits, n = run(pc, model, "q", QUERY)
    assert n == 0 and pc.tiers.disk is None  # computed, the disk tier off
    assert "turned off" in caplog.text
    fresh, _ = run(make(model, "llama", num_blocks=64), model, "f", QUERY)
    np.testing.assert_array_equal(logits, fresh)
    pc.check_integrity()
    pc.close()


def test_engine_outputs_are_the_same_with_and_without_prefetch(tmp_path):
    from scheduler import Engine, SamplingParams
    from tests.scheduler.test_engine import assert_no_leak
    from tests.tiny_models import built

    model = built("llama")
    rng = np.random.default_rng(1)
    sessions = [rng.integers(0, 101, 48).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    results = {}
    for ahead in (0, 4):
        with Engine(model, num_blocks=40, block_size=8, max_num_seqs=2,
                    disk_cache=tmp_path / str(ahead), disk_cache_size="4MiB") as engine:
            engine.num_prefetch_ahead = ahead
            engine.generate(sessions, params)  # each session pushes earlier ones to disk
            outs = engine.generate([s + [7, 8] for s in sessions], params)
            results[ahead] = [o.tokens for o in outs]
            hits = [o.metrics.cached_tokens_by_tier[Tier.DISK] for o in outs]
            assert sum(hits) > 0
            assert (engine.cache.tiers.num_prefetched > 0) == bool(ahead)
            assert_no_leak(engine)
    assert results[0] == results[4]
