"""Tiny random-weight LFM2 / Qwen3-Next running on slot pools through RecurrentViews.

The reference is the same model on its own `make_cache()` caches, one
sequence at a time. Slots are driven by hand (no PagedCache); attention
layers run on mlx-lm `KVCache`s, or, for right-padded batches, on a small
ragged KV cache defined here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from blockmgr.ops import CopySlot, ZeroSlot
from recurrent import RecurrentPools
from tests.memory import peak_growth
from tests.tiny_models import HYBRID_MODELS, HYBRID_VOCAB, built

TOL = 1e-4
VOCAB = HYBRID_VOCAB
MODELS = HYBRID_MODELS


@pytest.fixture(params=sorted(MODELS))
def model(request):
    return built(request.param)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def reference(model, chunks: list[list[int]]) -> list[np.ndarray]:
    """Logits of each chunk for one sequence on the model's own caches."""
    cache = model.make_cache()
    out = []
    for c in chunks:
        logits = model(mx.array([c]), cache=cache)
        mx.eval(logits)
        out.append(np.array(logits[0]))
    return out


def commit(views) -> None:
    """The forward finished: its recurrent writes go to the slots."""
    for view in views.values():
        view.commit()


class SlotRunner:
    """One sequence: its slot in the pools, mlx-lm KVCaches for attention layers."""

    def __init__(self, model, pools: RecurrentPools, slot: int):
        self.model, self.pools, self.slot = model, pools, slot
        self.kv = {i: KVCache() for i in range(len(model.layers)) if i not in pools}

    def step(self, chunk: list[int]) -> np.ndarray:
        views = self.pools.views([self.slot])
        cache = [views.get(i) or self.kv.get(i) for i in range(len(self.model.layers))]
        logits = self.model(mx.array([chunk]), cache=cache)
        mx.eval(logits)
        commit(views)
        self.pools.flush()
        return np.array(logits[0])

    def fork(self, slot: int) -> SlotRunner:
        """A child on `slot` (after the caller copied the recurrent slot)."""
        child = SlotRunner(self.model, self.pools, slot)
        for i, c in self.kv.items():
            k, v, n = c.state
            child.kv[i].state = (mx.array(k[..., :n, :]), mx.array(v[..., :n, :]), n)
        return child


def run_chunks(runner: SlotRunner, chunks) -> list[np.ndarray]:
    return [runner.step(c) for c in chunks]


def assert_close(ours: list[np.ndarray], ref: list[np.ndarray]) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def chunked(seq: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for s in sizes:
        out.append(seq[i : i + s])
        i += s
    assert i == len(seq)
    return out


# ---- single sequence ---------------------------------------------------------------


@pytest.mark.parametrize("probe", [True, False])
def test_chunked_prefill_and_decode_match_own_caches(model, probe):
    prompt, decode = tokens(1, 17), tokens(2, 4)
    ref = reference(model, [prompt] + [[t] for t in decode])
    ref_rows = [ref[0][:5], ref[0][5:12], ref[0][12:17]] + ref[1:]

    pools = RecurrentPools.for_model(model, num_slots=6, probe=probe)
    assert (pools.bytes_per_slot is not None) == probe
    runner = SlotRunner(model, pools, slot=4)
    ours = run_chunks(runner, chunked(prompt, [5, 7, 5]) + [[t] for t in decode])
    assert_close(ours, ref_rows)
    assert pools.bytes_per_slot is not None  # materialized on first use


def test_lost_state_is_detected(model):
    """Control: the comparison above is sensitive to the recurrent state."""
    prompt = tokens(3, 12)
    ref = reference(model, [prompt])[0]
    pools = RecurrentPools.for_model(model, num_slots=2)
    runner = SlotRunner(model, pools, slot=0)
    runner.step(prompt[:6])
    pools.apply_plan([ZeroSlot(0)])  # drop the state, keep the attention KV
    lost = runner.step(prompt[6:])
    assert np.abs(lost - ref[6:]).max() > 100 * TOL


# ---- copy-on-write and recycling ----------------------------------------------------


def test_fork_by_copy_slot_matches_fresh_runs_and_parent_is_untouched(model):
    prompt, cont_a, cont_b = tokens(4, 10), tokens(5, 3), tokens(6, 3)
    pools = RecurrentPools.for_model(model, num_slots=4)
    parent = SlotRunner(model, pools, slot=1)
    parent.step(prompt)
    before = [pools.pool(layer).read_slot(1) for layer in pools.layers]

    pools.apply_plan([CopySlot(1, 3)])  # the child's first write copies the shared slot
    child = parent.fork(3)
    ours_b = run_chunks(child, [cont_b])
    after = [pools.pool(layer).read_slot(1) for layer in pools.layers]
    for old, new in zip(before, after):
        for a, b in zip(old, new):
            np.testing.assert_array_equal(np.array(a), np.array(b))

    ours_a = run_chunks(parent, [cont_a])
    assert_close(ours_a, reference(model, [prompt, cont_a])[1:])
    assert_close(ours_b, reference(model, [prompt, cont_b])[1:])


def test_recycled_slot_equals_fresh_slot(model):
    pools = RecurrentPools.for_model(model, num_slots=3)
    SlotRunner(model, pools, slot=2).step(tokens(7, 9))  # leaves state in slot 2
    pools.apply_plan([ZeroSlot(2)])  # recycled
    seq = tokens(8, 8)
    recycled = run_chunks(SlotRunner(model, pools, slot=2), [seq[:5], seq[5:]])
    fresh = run_chunks(SlotRunner(model, pools, slot=0), [seq[:5], seq[5:]])
    for a, b in zip(recycled, fresh):
        np.testing.assert_array_equal(a, b)
    assert_close(recycled, reference(model, [seq[:5], seq[5:]]))


# ---- batches of different lengths ---------------------------------------------------


class RaggedKVCache:
    """Attention cache for right-padded batches with per-row histories.

    Row b has `offsets[b]` tokens of history and `lengths[b]` real new tokens
    this step; keys come back left-aligned per row, padded on the right.
    """

    def __init__(self, batch: int):
        self.keys: list[mx.array | None] = [None] * batch
        self.values: list[mx.array | None] = [None] * batch
        self.lengths: list[int] = [0] * batch

    def prepare(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)

    def _len(self, b):
        return 0 if self.keys[b] is None else self.keys[b].shape[2]

    @property
    def offset(self) -> mx.array:
        return mx.array([self._len(b) for b in range(len(self.keys))])

    def update_and_fetch(self, keys, values):
        for b, n in enumerate(self.lengths):
            k, v = keys[b : b + 1, :, :n], values[b : b + 1, :, :n]
            if self.keys[b] is not None:
                k = mx.concatenate([self.keys[b], k], axis=2)
                v = mx.concatenate([self.values[b], v], axis=2)
            self.keys[b], self.values[b] = k, v
        total = max(self._len(b) for b in range(len(self.keys)))

        def pad(a):
            return mx.pad(a, [(0, 0), (0, 0), (0, total - a.shape[2]), (0, 0)])

        return (
            mx.concatenate([pad(k) for k in self.keys]),
            mx.concatenate([pad(v) for v in self.values]),
        )

    def make_mask(self, n, return_array=False, window_size=None):
        offsets = np.array([self._len(b) for b in range(len(self.keys))])
        ends = offsets + np.array(self.lengths)
        total = ends.max()
        q = offsets[:, None] + np.arange(n)[None, :]  # absolute query positions
        kpos = np.arange(total)
        mask = (kpos[None, None, :] <= q[:, :, None]) & (kpos[None, None, :] < ends[:, None, None])
        mask[:, :, 0] = True  # padded queries attend somewhere (their output is ignored)
        return mx.array(mask[:, None])


def test_batched_ragged_prefill_and_decode_equal_each_alone(model):
    prompts = [tokens(10, 9), tokens(11, 4), tokens(12, 13)]
    decode = [tokens(20 + i, 3) for i in range(3)]
    slots = [5, 0, 2]
    pools = RecurrentPools.for_model(model, num_slots=6)
    attn = {i: RaggedKVCache(3) for i in range(len(model.layers)) if i not in pools}

    def step(rows: list[list[int]]) -> np.ndarray:
        lengths = [len(r) for r in rows]
        width = max(lengths)
        padded = [r + [0] * (width - len(r)) for r in rows]
        views = pools.views(slots, None if min(lengths) == width else lengths)
        for c in attn.values():
            c.prepare(lengths)
        cache = [views.get(i) or attn.get(i) for i in range(len(model.layers))]
        logits = model(mx.array(padded), cache=cache)
        mx.eval(logits)
        commit(views)
        pools.flush()
        return np.array(logits)

    ours: list[list[np.ndarray]] = [[] for _ in prompts]
    chunk = 6
    for start in range(0, max(map(len, prompts)), chunk):  # chunked, right-padded prefill
        rows = [p[start : start + chunk] for p in prompts]
        logits = step(rows)
        for b, r in enumerate(rows):
            ours[b].append(logits[b, : len(r)])
    for t in range(3):  # batched decode, one token per row
        logits = step([[d[t]] for d in decode])
        for b in range(3):
            ours[b].append(logits[b, :1])

    for b, p in enumerate(prompts):
        ref = reference(model, [p] + [[t] for t in decode[b]])
        got = np.concatenate([o for o in ours[b][:-3] if o.size])
        np.testing.assert_allclose(got, ref[0], atol=TOL, rtol=0)
        assert_close(ours[b][-3:], ref[1:])


# ---- storage stays in place ------------------------------------------------------------


def test_decode_writes_do_not_copy_the_pool():
    """MLX copies a whole array on `a[idx] = x` if anything else holds it."""
    model = built("lfm2")
    pools = RecurrentPools.for_model(model, num_slots=60_000)  # ~15 MB per layer
    per_layer = min(pools.pool(layer).nbytes for layer in pools.layers)
    assert per_layer > 10_000_000
    runner = SlotRunner(model, pools, slot=123)
    runner.step(tokens(30, 8))
    pools.apply_plan([CopySlot(123, 7)])
    def steps():
        for t in tokens(31, 4):
            runner.step([t])
        pools.apply_plan([CopySlot(123, 9), ZeroSlot(7)])
        pools.flush()

    assert peak_growth(steps) < per_layer / 4
