"""Retention priority: under memory pressure a cached prefix of lower
priority is evicted (or demoted to a colder tier) before any of higher
priority, whatever their ages; within one priority the least recently used
goes first, as before. A prefix's priority is the last user's."""

from __future__ import annotations

import pytest

from blockmgr import BlockManager, BlockManagerConfig
from blockmgr.errors import BlockManagerError

X, Y, Z = [1] * 8, [2] * 8, [3] * 12  # two pages each of 4 tokens; Z needs three


def cache(bm, seq_id, tokens, retention=0):
    bm.allocate(seq_id, tokens, retention=retention)
    bm.free(seq_id)


def kept(bm, tokens) -> int:
    return bm.cached_prefix_length(tokens + [0])


@pytest.mark.parametrize("x_priority,y_priority,survivor", [
    (0, 0, Y),  # one priority: the least recently used (X) goes
    (1, 0, X),  # X is older but worth more: Y goes
    (0, 1, Y),
    (-1, 0, Y),  # negative priorities go before the default
])
def test_eviction_takes_lower_priorities_first(x_priority, y_priority, survivor):
    bm = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4))
    cache(bm, "x", X, x_priority)
    cache(bm, "y", Y, y_priority)
    bm.allocate("z", Z)  # needs a third page: one cached prefix must go
    gone = X if survivor is Y else Y
    assert kept(bm, survivor) == 8 and kept(bm, gone) == 0
    bm.check_integrity()


def test_a_hit_gives_the_prefix_the_hitters_priority():
    bm = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4))
    cache(bm, "x", X, 5)
    cache(bm, "y", Y, 1)
    cache(bm, "x2", X + [9], 0)  # the last user of X had priority 0: X is worth 0 now
    bm.allocate("z", Z)
    assert kept(bm, Y) == 8 and kept(bm, X) == 0
    bm.check_integrity()


def test_demotion_to_the_host_tier_takes_lower_priorities_first():
    bm = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4, num_host_cache_blocks=8))
    cache(bm, "x", X, 2)
    cache(bm, "y", Y, 0)
    bm.allocate("z", Z)
    assert not bm.find_prefix(X + [0]).loads  # still on the device
    assert bm.find_prefix(Y + [0]).loads  # demoted: a hit loads it
    assert kept(bm, X) == kept(bm, Y) == 8
    bm.check_integrity()


@pytest.mark.parametrize("bad", [1.5, True, "1", None])
def test_a_bad_priority_is_refused_and_changes_nothing(bad):
    bm = BlockManager(BlockManagerConfig(num_blocks=6, block_size=4))
    cache(bm, "x", X)
    before = bm.debug_state()
    with pytest.raises(BlockManagerError):
        bm.allocate("y", Y, retention=bad)
    assert bm.debug_state() == before


def test_engine_requests_and_the_server_body_carry_the_priority():
    """An agent's context sent with a higher priority outlives newer
    default-priority prompts that push the pool; the server reads the
    OpenAI-compatible extra field `retention_priority`."""
    from scheduler import Engine, SamplingParams

    # private on purpose: the body's parser alone; its only public path is a running server
    from scheduler.serving.server import HttpError, _sampling
    from tests.tiny_models import built

    engine = Engine(built("llama"), num_blocks=16, block_size=4, max_num_seqs=1)
    agent = list(range(1, 25))  # 6 pages
    engine.generate([agent], SamplingParams(max_tokens=1, retention_priority=1))
    for seed in range(3):  # 3 x 6 pages of other prompts through a 16-page pool
        engine.generate([[50 + seed] * 24], SamplingParams(max_tokens=1))
    assert engine.cache.cached_prefix_length(agent + [0]) == len(agent)
    control = Engine(built("llama"), num_blocks=16, block_size=4, max_num_seqs=1)
    control.generate([agent], SamplingParams(max_tokens=1))
    for seed in range(3):
        control.generate([[50 + seed] * 24], SamplingParams(max_tokens=1))
    assert control.cache.cached_prefix_length(agent + [0]) < len(agent)

    assert _sampling({"retention_priority": 3}, {}).retention_priority == 3
    assert _sampling({}, {}).retention_priority == 0
    for bad in (1.5, "high", True):
        with pytest.raises(HttpError):
            _sampling({"retention_priority": bad}, {})
