"""Slots driven by the real BlockManager: its plans applied to RecurrentPools.

Tiny LFM2 / Qwen3-Next; recurrent layers run on slot views, attention layers
on mlx-lm `KVCache`s held per sequence by the test (the paged attention
storage is not under test here). Where the manager serves a prefix from the
trie, the attention KV of that prefix is rebuilt by a reference run and only
the recurrent state comes from the snapshot slot, so the comparison checks
exactly the slot handling: snapshots, copy-on-write, recycling, rollback.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from blockmgr import BlockManager, BlockManagerConfig
from blockmgr.errors import NoSnapshot
from blockmgr.ops import CopySlot, ZeroSlot
from recurrent import RecurrentPools
from tests.recurrent.test_recurrent_models import MODELS, TOL, commit, reference, tokens
from tests.tiny_models import built


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return built(request.param)


class Hybrid:
    """BlockManager + RecurrentPools + per-sequence attention KVCaches."""

    def __init__(self, model, num_slots=8, prefix_cache=True):
        self.model = model
        self.bm = BlockManager(
            BlockManagerConfig(num_blocks=64, block_size=4, num_slots=num_slots,
                               enable_prefix_cache=prefix_cache)
        )
        self.pools = RecurrentPools.for_model(model, num_slots=num_slots)
        self.kv: dict[str, dict[int, KVCache]] = {}

    def attention_layers(self):
        return [i for i in range(len(self.model.layers)) if i not in self.pools]

    def allocate(self, sid, prompt):
        alloc = self.bm.allocate(sid, prompt)
        self.pools.apply_plan(alloc.ops)
        n = alloc.num_cached_tokens
        if n:  # attention KV of the served prefix, rebuilt by a reference run
            cache = self.model.make_cache()
            mx.eval(self.model(mx.array([prompt[:n]]), cache=cache))
            self.kv[sid] = {i: cache[i] for i in self.attention_layers()}
        else:
            self.kv[sid] = {i: KVCache() for i in self.attention_layers()}
        return alloc

    def compute(self, sid, chunk) -> np.ndarray:
        views = self.pools.views([self.bm.slot(sid)])
        kv = self.kv[sid]
        cache = [views.get(i) or kv.get(i) for i in range(len(self.model.layers))]
        logits = self.model(mx.array([chunk]), cache=cache)
        mx.eval(logits)
        commit(views)
        self.pools.flush()
        return np.array(logits[0])

    def decode(self, sid, toks) -> list[np.ndarray]:
        out = []
        for t in toks:
            self.pools.apply_plan(self.bm.append(sid, [t]))
            out.append(self.compute(sid, [t]))
        return out

    def fork_kv(self, parent, child):
        self.kv[child] = {}
        for i, c in self.kv[parent].items():
            k, v, n = c.state
            self.kv[child][i] = KVCache()
            self.kv[child][i].state = (mx.array(k[..., :n, :]), mx.array(v[..., :n, :]), n)


def fresh(model, prompt, decode=()):
    """Reference logits: whole prompt, then one token at a time."""
    ref = reference(model, [prompt] + [[t] for t in decode])
    return ref[0], ref[1:]


def test_conversation_turn_two_reuses_turn_one_and_matches_fresh(model):
    h = Hybrid(model)
    turn1, answer, new = tokens(40, 11), tokens(41, 3), tokens(42, 5)
    h.allocate("t1", turn1)
    h.compute("t1", turn1[:6])
    h.compute("t1", turn1[6:])
    h.decode("t1", answer)
    h.pools.apply_plan(h.bm.free("t1"))

    turn2 = turn1 + answer + new
    alloc = h.allocate("t2", turn2)
    assert alloc.num_cached_tokens == len(turn1) + len(answer)
    assert any(isinstance(op, CopySlot) for op in alloc.ops)  # from the snapshot
    got = h.compute("t2", turn2[alloc.num_cached_tokens :])
    ref, _ = fresh(model, turn2)
    np.testing.assert_allclose(got, ref[alloc.num_cached_tokens :], atol=TOL, rtol=0)


def test_fork_then_different_continuations_match_fresh_runs(model):
    h = Hybrid(model)
    prompt = tokens(43, 9)
    h.allocate("p", prompt)
    h.compute("p", prompt)
    h.pools.apply_plan(h.bm.fork("p", "c"))
    h.fork_kv("p", "c")
    assert h.bm.slot("c") == h.bm.slot("p")  # shared until the first write

    cont_c, cont_p = tokens(44, 3), tokens(45, 3)
    got_c = h.decode("c", cont_c)  # first write of the child copies the slot
    assert h.bm.slot("c") != h.bm.slot("p")
    got_p = h.decode("p", cont_p)
    for got, cont in ((got_c, cont_c), (got_p, cont_p)):
        _, ref = fresh(model, prompt, cont)
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def test_recycled_slot_matches_fresh_run(model):
    h = Hybrid(model, num_slots=1, prefix_cache=False)
    first = tokens(46, 10)
    h.allocate("a", first)
    h.compute("a", first)
    slot = h.bm.slot("a")
    h.pools.apply_plan(h.bm.free("a"))

    second = tokens(47, 7)
    alloc = h.allocate("b", second)
    assert alloc.slot == slot and ZeroSlot(slot) in alloc.ops
    got = h.compute("b", second)
    np.testing.assert_allclose(got, fresh(model, second)[0], atol=TOL, rtol=0)


def test_truncate_restores_only_at_a_snapshot(model):
    h = Hybrid(model)
    prompt = tokens(48, 8)
    h.allocate("s", prompt)
    h.compute("s", prompt)
    h.pools.apply_plan(h.bm.cache_prefix("s"))  # snapshot at 8 (a CopySlot)
    spec = tokens(49, 3)
    h.decode("s", spec)

    slot_before = h.bm.slot("s")
    with pytest.raises(NoSnapshot):
        h.bm.truncate("s", 9)  # no snapshot at 9: refused, nothing changes
    assert h.bm.slot("s") == slot_before and h.bm.num_tokens("s") == 11

    h.pools.apply_plan(h.bm.truncate("s", 8))  # back to the snapshot at 8
    for c in h.kv["s"].values():
        c.trim(3)
    fix = tokens(50, 2)
    got = h.decode("s", fix)
    _, ref = fresh(model, prompt, fix)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
