"""What the prefix cache's tiers show: `/metrics` per tier, hits by tier in
a request's metrics and `usage`, KV events naming each block's medium.

Each is checked against what is known independently: the tokens and pages
of prefixes the test itself pushed to a tier and hit there, a page's bytes
measured on a one-page cache, and for KV events the tier of each block as
the store's own match finds it (`find_prefix`'s path), after every step.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from blockmgr.ops import Tier
from scheduler.serving.metrics import tier_families
from scheduler.serving.server import cached_tokens_by_tier
from tests.cache.test_cache_tiers import QUERY, A, evict_a, make, model_of, pc_page_bytes, run

msgpack = pytest.importorskip("msgpack", reason="KV events need the events extra (msgpack)")


@pytest.fixture(scope="module")
def models():
    return {}


def samples(pc) -> dict[tuple[str, str], float]:
    """The tier families of `/metrics` as {(name, tier): value}."""
    lines: list[str] = []
    tier_families(lines, pc)
    out = {}
    for line in lines:
        if line.startswith("#"):
            continue
        found = re.fullmatch(r'blockmgr_(\w+)\{tier="(\w+)"\} (\S+)', line)
        assert found, line
        out[(found.group(1), found.group(2))] = float(found.group(3))
    return out


@pytest.mark.parametrize("where", ["host", "disk"])
def test_metrics_count_bytes_entries_hits_and_loads_per_tier(models, tmp_path, where):
    model = model_of(models, "llama")
    page = pc_page_bytes(model)
    tiers = {"host_cache_size": "1MiB"} if where == "host" else {"disk_cache": tmp_path}
    pc = make(model, "llama", **tiers)
    evict_a(pc, model)  # A (40 tokens, 5 pages of 8) leaves the 12-page device
    before = samples(pc)
    assert set(tier for _, tier in before) == {"device", where}
    assert before[("cache_tier_entries", where)] >= 1
    assert before[("cache_tier_bytes", where)] >= 5 * page
    assert before[("cache_tier_bytes", where)] % page == 0
    assert before[("cache_tier_hit_tokens_total", where)] == 0
    assert before[("cache_tier_loads_total", where)] == 0

    logits, n = run(pc, model, "q", QUERY)
    assert n == len(A)
    after = samples(pc)
    assert after[("cache_tier_hit_tokens_total", where)] == len(A)
    assert after[("cache_tier_hit_tokens_total", "device")] == 0
    assert after[("cache_tier_loads_total", where)] == 5  # A's five pages
    assert after[("cache_tier_load_seconds_total", where)] > 0
    # bytes are pages held times a page's measured bytes, in every tier
    for usage in pc.store.tier_usage():
        tier = usage.tier.name.lower()
        assert after[("cache_tier_bytes", tier)] == sum(usage.num_used_pages) * page
        assert after[("cache_tier_entries", tier)] == usage.num_nodes
    # QUERY (42 tokens) is cached on the device now: A's 5 pages and its own 6th
    assert after[("cache_tier_bytes", "device")] >= 6 * page
    pc.close()


def test_a_cache_without_colder_tiers_adds_no_tier_metrics(models):
    pc = make(model_of(models, "llama"), "llama")
    run(pc, model_of(models, "llama"), "a", A)
    assert samples(pc) == {}


def test_an_allocation_says_where_its_hit_was(models):
    model = model_of(models, "llama")
    pc = make(model, "llama", host_cache_size="1MiB")
    evict_a(pc, model)
    alloc = pc.allocate("q", QUERY)
    assert alloc.num_cached_tokens == len(A)
    assert alloc.cached_tokens_by_tier == (0, len(A), 0)
    with pc.step(["q"]) as views:
        mx.eval(model(mx.array([QUERY[len(A):]]), cache=views))
    pc.free("q")
    again = pc.allocate("r", QUERY + [7])  # now all on the device
    assert again.cached_tokens_by_tier == (again.num_cached_tokens, 0, 0)
    assert again.num_cached_tokens == len(QUERY)
    pc.free("r")
    plain = make(model, "llama").allocate("p", QUERY)
    assert plain.cached_tokens_by_tier is None
    pc.close()


def test_engine_requests_and_usage_report_hits_by_tier(tmp_path):
    from scheduler import Engine, SamplingParams
    from tests.tiny_models import built

    model = built("llama")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 101, 40).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with Engine(model, num_blocks=24, block_size=4, max_num_seqs=1,
                disk_cache=tmp_path, disk_cache_size="1MiB") as engine:
        first = engine.generate(prompts, params)  # each pushes the one before off the device
        assert all(o.metrics.cached_tokens_by_tier == (0, 0, 0) for o in first)
        again = engine.generate([prompts[0] + [1, 2]], params)[0]
        by_tier = again.metrics.cached_tokens_by_tier
        assert by_tier is not None and by_tier[Tier.DISK] > 0
        assert sum(by_tier) == again.metrics.num_cached_tokens >= 36
        usage = cached_tokens_by_tier([o.metrics for o in first] + [again.metrics])
        assert usage == {"device": by_tier[0], "host": by_tier[1], "disk": by_tier[2]}
    assert cached_tokens_by_tier([first[0].metrics.__class__()]) is None


# ----------------------------------------------------------- KV events


class MediumSubscriber:
    """A router's view with each block's medium, from raw msgpack."""

    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple, str | None, str]] = {}
        self.num_batches = 0

    def receive(self, payload: bytes) -> None:
        for event in msgpack.unpackb(payload)[1]:
            tag = event[0]
            if tag == "AllBlocksCleared":
                self.blocks.clear()
            elif tag == "BlockRemoved":
                _, hashes, medium = event
                for digest in hashes:
                    assert self.blocks[digest][3] == medium, "removed from another medium"
                    del self.blocks[digest]
            else:
                _, hashes, parent, tokens, bs, _, medium, lora_name = event
                assert medium in ("GPU", "CPU", "DISK")
                assert parent is None or parent in self.blocks, "stored before its parent"
                for i, digest in enumerate(hashes):
                    assert digest not in self.blocks, "stored twice"
                    self.blocks[digest] = (parent, tuple(tokens[i * bs:(i + 1) * bs]),
                                           lora_name, medium)
                    parent = digest
        self.num_batches += 1

    def prefixes(self) -> dict[tuple, str]:
        """{(namespace, tokens to the block's end): medium} of every block."""
        result = {}
        for digest, (_, _, lora_name, medium) in self.blocks.items():
            runs, walk = [], digest
            while walk is not None:
                parent, tokens, _, _ = self.blocks[walk]
                runs.append(tokens)
                walk = parent
            result[(lora_name, tuple(t for run in reversed(runs) for t in run))] = medium
        return result


def expected_media(store, sequences, block_size) -> dict[tuple, str]:
    """For every full block a hit uses, the tier of its last token: the
    node of the store's own match that holds it."""
    media = {0: "GPU", 1: "CPU", 2: "DISK"}
    result = {}
    for namespace, tokens in sequences:
        for length in range(block_size, len(tokens) + 1):
            hit = store.cached_prefix_length(list(tokens[:length]) + [0], namespace)
            if hit < block_size:
                continue
            path = store.find_prefix(list(tokens[:hit]) + [0], namespace).path
            for end in range(block_size, hit + 1, block_size):
                node = next(n for n in path if n.start <= end - 1 < n.end)
                result[(namespace, tuple(tokens[:end]))] = media[node.tier]
    return result


@pytest.mark.parametrize("name", ["llama", "sliding"])
def test_kv_events_name_each_blocks_tier_after_every_step(name, tmp_path):
    from scheduler import Engine
    from tests.scheduler.serving.test_kv_events import RecordingSink, run_and_check, workload
    from tests.tiny_models import built

    sink = RecordingSink()
    engine = Engine(built(name), num_blocks=28, block_size=4, kv_events=sink, max_num_seqs=4,
                    host_cache_size="16KiB", disk_cache=tmp_path, disk_cache_size="1MiB")
    store = engine.cache.store
    subscriber = MediumSubscriber()
    seen: set[str] = set()

    def after_step(sequences):
        while subscriber.num_batches < len(sink.payloads):
            subscriber.receive(sink.payloads[subscriber.num_batches])
        expected = expected_media(store, sequences, 4)
        assert subscriber.prefixes() == expected
        seen.update(expected.values())

    prompts = workload(101) * 2  # the second round hits what the first demoted
    run_and_check(engine, prompts, after_step)
    assert engine.kv_events.num_errors == 0
    assert seen == {"GPU", "CPU", "DISK"}
    engine.close()
