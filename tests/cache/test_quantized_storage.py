"""Quantized pages under the storage operations: swap, faults, in-place
writes, a Hypothesis state machine, and the Engine.

References: mlx-lm's ``QuantizedKVCache`` from the first token (windowed
for sliding layers) or mlx-lm's caches fed quantized rows
(`tests.quant_models`), and the pages' own bytes before an operation.
"""

from __future__ import annotations

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mlx_lm.models.cache import make_prompt_cache

from blockmgr.errors import BlockManagerError
from cache import KVFormat, PagedCache, QuantizedPagePool
from cache.host_pool import HostPagePool
from cache.page_pool import PoolShape
from scheduler import Engine, SamplingParams
from tests.cache.test_store_faults import FAULT, FailingLayer, FailingModel
from tests.memory import peak_growth
from tests.quant_models import VOCAB, built, group_size, num_slots, reference_caches, run_chunks
from tests.scheduler.test_engine import assert_no_leak, assert_preempted

TOL = 1e-4


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def paged(name, fmt, num_blocks=64, block_size=4, **kwargs):
    return PagedCache.for_model(built(name), num_blocks, block_size, kv_format=fmt,
                                num_slots=num_slots(name), **kwargs)


def forward(pc, model, ids, rows):
    width = max(map(len, rows))
    x = mx.array([r + [0] * (width - len(r)) for r in rows])
    with pc.step(ids, num_new=[len(r) for r in rows]) as views:
        out = model(x, cache=views)
        mx.eval(out)
    return out


def close(got, want):
    diff = mx.abs(got - want).max().item()
    assert diff < TOL, diff


def paged_layers(pc) -> list[int]:
    return [i for i, s in enumerate(pc.specs) if s.kind.paged]


def pool_bytes(pc) -> list[np.ndarray]:
    """Every pool array of every layer, copied to numpy (raw bytes)."""
    out = []
    for layer in paged_layers(pc):
        pool = pc.pool_for(layer, None, None)
        if pool is not None:
            arrays = pool.arrays()
            mx.eval(arrays)
            out.extend(np.array(a.view(mx.uint8) if a.dtype != mx.uint32 else a) for a in arrays)
    return out


def page_parts(pc, seq_id) -> list[np.ndarray]:
    """The stored parts of every page `seq_id` holds, in every layer."""
    out = []
    for layer in paged_layers(pc):
        pool = pc.pool_for(layer, None, None)
        if pool is None:
            continue
        pages = [p for p in pc.block_table(seq_id, pc.group_of(layer)) if p is not None]
        rows = mx.array([h * pool.shape.num_blocks + p for h in range(pool.shape.n_kv_heads)
                         for p in pages])
        parts = pool.read_pages(rows)
        mx.eval(parts)
        out.extend(np.array(p.view(mx.uint8) if p.dtype != mx.uint32 else p) for p in parts)
    return out


# --- swap ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_host_pages_of_a_quantized_pool_round_trip_bit_for_bit(dtype):
    pool = QuantizedPagePool(PoolShape(6, 4, 2, 64, 32, dtype), 8, 4, 32)
    rows = mx.array([1, 4, 5, 7, 10, 11])  # pages 1, 4, 5 of both heads
    k = mx.random.normal((6, 4, 64)).astype(dtype)
    v = mx.random.normal((6, 4, 32)).astype(dtype)
    cols = mx.array([0, 1, 2, 3])
    for r in range(6):
        pool.write(mx.full((4,), r) + rows[r] - r, cols, k[r], v[r])
    before = pool.read_pages(rows)
    mx.eval(before)
    host = HostPagePool(3)
    host.swap_out(pool, [1, 4, 5], [2, 0, 1])
    pool.write_pages(rows, *[mx.zeros_like(p) for p in before])
    host.swap_in(pool, [2, 0, 1], [1, 4, 5])
    after = pool.read_pages(rows)
    assert len(after) == 6
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert host.nbytes == 3 * sum(p.nbytes for p in before) // 3


@pytest.mark.parametrize("name", ["llama", "sliding", "lfm2"])
def test_swap_round_trip_is_bit_identical_and_continues_like_the_reference(name):
    model = built(name)
    fmt = KVFormat(8, 4, group_size(name))
    prompt, cont, other = tokens(37, 1), tokens(5, 2), tokens(60, 3)
    pc = paged(name, fmt, num_blocks=16, num_host_blocks=12,
               num_host_slots=2 if num_slots(name) else 0)
    pc.allocate("a", prompt)
    forward(pc, model, ["a"], [prompt])
    for t in cont[:2]:
        pc.append("a", [t])
        forward(pc, model, ["a"], [[t]])
    before = page_parts(pc, "a")
    pc.swap_out("a")
    pc.allocate("b", other)  # takes and overwrites the pages "a" left
    forward(pc, model, ["b"], [other])
    pc.free("b")
    pc.reset_prefix_cache()
    pc.swap_in("a")
    pc.flush()
    after = page_parts(pc, "a")
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    got = []
    for t in cont[2:]:
        pc.append("a", [t])
        got.append(forward(pc, model, ["a"], [[t]])[0])
    ref = reference_caches(model, fmt, name)
    want = run_chunks(model, ref, [prompt] + [[t] for t in cont])[-3:]
    close(mx.concatenate(got), want)
    pc.check_integrity()


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("name", ["llama", "sliding"])
def test_a_sequence_swapped_out_before_any_forward_reads_no_unwritten_host_memory(
        name, quantized, garbage_memory):
    """"a" is swapped out before any forward created the pools (nothing is
    copied to its host pages); "b"'s swap out then allocates the host
    arrays. Swapped back in, "a" runs in batches with "c" (a prefill, then
    a decode), which read the rows of its last page it has not written
    under the mask: the logits are mlx-lm's, for quantized pages and for
    pages at the model's dtype."""
    model = built(name)
    fmt = KVFormat(4, 4, group_size(name)) if quantized else None
    a, b, c = tokens(10, 6), tokens(7, 7), tokens(13, 8)
    pc = paged(name, fmt, num_blocks=16, num_host_blocks=8)
    pc.allocate("a", a)
    pc.swap_out("a")
    pc.allocate("b", b)
    forward(pc, model, ["b"], [b])
    pc.swap_out("b")
    pc.swap_in("a")
    pc.allocate("c", c)
    got = [forward(pc, model, ["a", "c"], [a, c])]
    pc.append_decode(["a", "c"], [5, 6])
    got.append(forward(pc, model, ["a", "c"], [[5], [6]]))
    for row, (p, t) in enumerate(((a, 5), (c, 6))):
        ref = reference_caches(model, fmt, name) if fmt else make_prompt_cache(model)
        want = run_chunks(model, ref, [p, [t]])
        close(mx.concatenate([got[0][row, : len(p)], got[1][row, :1]]), want)
    pc.check_integrity()


# --- faults ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gemma3", "lfm2"])
def test_a_raising_forward_leaves_every_other_byte_of_the_pages_as_it_was(name):
    """A batched forward raising in its last layer: the earlier layers wrote
    the in-flight tokens' rows (pending again, rewritten by the retry);
    every other byte of every pool is as it was, nothing counts as
    computed, and the retry gives the reference's logits."""
    model = built(name)
    fmt = KVFormat(4, 4, group_size(name))
    a, b = tokens(21, 4), tokens(14, 5)
    pc = paged(name, fmt)
    for sid, p in (("a", a), ("b", b)):
        pc.allocate(sid, p)
        forward(pc, model, [sid], [p])
    pc.append("a", [7])
    pc.append("b", [8, 9])
    before = pool_bytes(pc)
    with pytest.raises(RuntimeError, match=FAULT):
        with pc.step(["a", "b"], num_new=[1, 2]) as views:
            views = list(views)
            views[-1] = FailingLayer(views[-1])
            model(mx.array([[7, 0], [8, 9]]), cache=views)
    assert pc.num_computed("a") == 21 and pc.num_computed("b") == 14
    in_flight = {(layer, page, col) for layer in paged_layers(pc)
                 for sid, start, n in (("a", 21, 1), ("b", 14, 2))
                 if pc.pool_for(layer, None, None) is not None
                 for pos in range(start, start + n)
                 for page, col in [(pc.block_table(sid, pc.group_of(layer))[pos // 4], pos % 4)]}
    after = pool_bytes(pc)
    changed = _changed_positions(pc, before, after)
    assert changed <= in_flight  # only the step's own rows
    out = forward(pc, model, ["a", "b"], [[7], [8, 9]])
    for row, (p, new) in enumerate(((a, [7]), (b, [8, 9]))):
        ref = reference_caches(model, fmt, name)
        run_chunks(model, ref, [p])
        close(out[row, : len(new)], model(mx.array([new]), cache=ref)[0])
    pc.check_integrity()


def _changed_positions(pc, before, after) -> set[tuple[int, int, int]]:
    """(layer, page, row in page) whose bytes differ in any pool array."""
    changed = set()
    i = 0
    for layer in paged_layers(pc):
        pool = pc.pool_for(layer, None, None)
        if pool is None:
            continue
        nb = pool.shape.num_blocks
        for _ in pool.arrays():
            diff = (before[i] != after[i]).reshape(before[i].shape[0], before[i].shape[1], -1)
            for row, col in zip(*np.nonzero(diff.any(axis=2))):
                changed.add((layer, int(row) % nb, int(col)))
            i += 1
    return changed


# --- in-place writes -------------------------------------------------------------


@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_quantized_decode_writes_stay_in_place(batch, alias):
    """Quantizing a decode step's rows into the pool and reading the pool
    (a run view and quantized matmuls for one row, gather_qmm for a batch)
    in the same graph must not copy any pool array (peak memory growth).
    With an alias of the pool arrays kept (`alias`), the detector must see
    the copies."""
    model = built("llama")
    pc = PagedCache.for_model(model, num_blocks=4096, block_size=8, kv_bits=8,
                              kv_group_size=32)
    ids = list(range(batch))
    for i in ids:
        pc.allocate(i, tokens(20, i))
        forward(pc, model, [i], [tokens(20, i)])
    pc.eval_state()

    def step():
        for i in ids:
            pc.append(i, [3])
        mx.eval(forward(pc, model, ids, [[3]] * batch))
        pc.eval_state()

    step()
    pool = pc.pool_for(0, None, None)
    kept = [a.reshape(-1) for a in pool.arrays()] if alias else []  # noqa: F841
    grown = peak_growth(step)
    if alias:
        assert grown >= sum(a.nbytes for a in pool.arrays())
    else:
        assert grown < min(a.nbytes for a in pool.arrays()) // 2


# --- a state machine over quantized storage --------------------------------------


class QuantizedStorageMachine(RuleBasedStateMachine):
    """Random prefill chunks, batched decodes, forks, prefix reuse, swaps,
    truncation, failing forwards and refused calls on a 4-bit sliding +
    full model; every forward is compared with mlx-lm's quantized caches
    replaying the sequence's chunks, and `check_integrity()` runs after
    every rule."""

    NAME = "sliding"

    def __init__(self) -> None:
        super().__init__()
        self.model = built(self.NAME)
        self.fmt = KVFormat(4, 4, 32)
        self.pc = PagedCache.for_model(self.model, 40, 4, kv_format=self.fmt,
                                       num_host_blocks=24)
        self.chunks: dict[str, list[list[int]]] = {}  # computed chunks per sequence
        self.todo: dict[str, list[int]] = {}  # reserved, not computed
        self.finished: list[list[int]] = []
        self.next_id = 0

    def _tokens(self, sid) -> list[int]:
        return [t for c in self.chunks[sid] for t in c]

    def _check(self, sid, chunk, logits) -> None:
        ref = reference_caches(self.model, self.fmt, self.NAME)
        if self.chunks[sid]:
            run_chunks(self.model, ref, self.chunks[sid])
        want = self.model(mx.array([chunk]), cache=ref)[0]
        close(logits[: len(chunk)], want)

    def _live(self, computed_only=False) -> list[str]:
        return sorted(s for s in self.chunks if not self.pc.is_swapped(s)
                      and (not computed_only or not self.todo[s]))

    @precondition(lambda self: len(self.chunks) < 4)
    @rule(seed=st.integers(0, 2**16), n=st.integers(1, 18), reuse=st.booleans())
    def start(self, seed, n, reuse):
        rng = np.random.default_rng(seed)
        toks = rng.integers(0, VOCAB, n).tolist()
        if reuse and self.finished:
            old = self.finished[seed % len(self.finished)]
            toks = old[: 1 + seed % len(old)] + toks
        if not self.pc.can_allocate(toks):
            return
        sid = f"s{self.next_id}"
        self.next_id += 1
        hit = self.pc.allocate(sid, toks).num_cached_tokens
        self.chunks[sid] = [toks[:hit]] if hit else []
        self.todo[sid] = toks[hit:]

    @precondition(lambda self: any(self.todo[s] for s in self._live()))
    @rule(data=st.data())
    def prefill(self, data):
        sids = [s for s in self._live() if self.todo[s]]
        picked = data.draw(st.lists(st.sampled_from(sids), min_size=1, max_size=2, unique=True))
        rows = [self.todo[s][: data.draw(st.integers(1, len(self.todo[s])))] for s in picked]
        out = forward(self.pc, self.model, picked, rows)
        for b, (s, r) in enumerate(zip(picked, rows)):
            self._check(s, r, out[b])
            self.chunks[s].append(r)
            self.todo[s] = self.todo[s][len(r):]

    @precondition(lambda self: self._live(computed_only=True))
    @rule(data=st.data())
    def decode(self, data):
        sids = data.draw(st.lists(st.sampled_from(self._live(computed_only=True)), min_size=1,
                                  max_size=3, unique=True))
        toks = [data.draw(st.integers(0, VOCAB - 1)) for _ in sids]
        try:
            self.pc.append_decode(sids, toks)
        except BlockManagerError:
            return
        out = forward(self.pc, self.model, sids, [[t] for t in toks])
        for b, (s, t) in enumerate(zip(sids, toks)):
            self._check(s, [t], out[b])
            self.chunks[s].append([t])

    @precondition(lambda self: self._live(computed_only=True) and len(self.chunks) < 4)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._live(computed_only=True)))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.pc.fork(parent, child)
        self.chunks[child] = list(self.chunks[parent])
        self.todo[child] = []

    @precondition(lambda self: self._live(computed_only=True))
    @rule(data=st.data(), k=st.integers(1, 6))
    def truncate(self, data, k):
        sid = data.draw(st.sampled_from(self._live(computed_only=True)))
        toks = self._tokens(sid)
        n = max(1, len(toks) - k)
        try:
            self.pc.truncate(sid, n)
        except BlockManagerError:
            return  # into released window pages: refused
        cut, kept = 0, []
        for c in self.chunks[sid]:
            if cut < n:
                kept.append(c[: n - cut])
            cut += len(c)
        self.chunks[sid] = kept

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        if self.pc.can_swap_out(sid):
            self.pc.flush()  # a prefix hit's page copy is queued until then
            before = page_parts(self.pc, sid)
            self.pc.swap_out(sid)
            self.pc.flush()
            self.swapped_bytes = getattr(self, "swapped_bytes", {})
            self.swapped_bytes[sid] = before

    @precondition(lambda self: any(self.pc.is_swapped(s) for s in self.chunks))
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s in self.chunks if self.pc.is_swapped(s))))
        if self.pc.can_swap_in(sid):
            self.pc.swap_in(sid)
            self.pc.flush()
            after = page_parts(self.pc, sid)
            assert all(np.array_equal(x, y)
                       for x, y in zip(self.swapped_bytes.pop(sid), after))

    @precondition(lambda self: any(self.todo[s] for s in self._live()))
    @rule(data=st.data(), layer=st.integers(0, 1))
    def failing_forward(self, data, layer):
        sid = data.draw(st.sampled_from([s for s in self._live() if self.todo[s]]))
        computed = self.pc.num_computed(sid)
        with pytest.raises(RuntimeError, match=FAULT):
            with self.pc.step([sid]) as views:
                views = list(views)
                views[layer] = FailingLayer(views[layer])
                self.model(mx.array([self.todo[sid]]), cache=views)
        assert self.pc.num_computed(sid) == computed

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.chunks)))
        if self._tokens(sid):
            self.finished.append(self._tokens(sid))
        self.pc.free(sid)
        del self.chunks[sid], self.todo[sid]
        getattr(self, "swapped_bytes", {}).pop(sid, None)

    @rule(data=st.data())
    def refused(self, data):
        """Calls that must raise a typed error and change nothing."""
        state = self.pc.debug_state()
        calls = [lambda: self.pc.append("nobody", [1]), lambda: self.pc.views([])]
        if self.chunks:
            some = sorted(self.chunks)[0]
            calls += [lambda: self.pc.allocate(some, [1]), lambda: self.pc.fork(some, some),
                      lambda: self.pc.views([some, some])]
        swapped = [s for s in self.chunks if self.pc.is_swapped(s)]
        if swapped:
            calls.append(lambda: self.pc.views(swapped[:1]))
        with pytest.raises(BlockManagerError):
            data.draw(st.sampled_from(calls))()
        assert self.pc.debug_state() == state

    @invariant()
    def integrity(self):
        self.pc.check_integrity()


QuantizedStorageMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestQuantizedStorage = QuantizedStorageMachine.TestCase


# --- the Engine ------------------------------------------------------------------


def greedy_reference(model, name, fmt, prompt, n) -> list[int]:
    """Greedy decoding on the reference caches (prompt in one forward)."""
    caches = reference_caches(model, fmt, name)
    logits = model(mx.array([prompt]), cache=caches)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=caches)[0, -1]
    return out


def prompts_with_shared_prefixes(count):
    rng = np.random.default_rng(0)
    shared = [rng.integers(0, VOCAB, n).tolist() for n in (29, 18)]
    return [(shared[i % 2] if i % 3 else []) + rng.integers(0, VOCAB, 3 + i).tolist()
            for i in range(count)]


_WANT: dict = {}


def engine_case(name, bits):
    key = (name, bits)
    fmt = KVFormat(bits, bits, group_size(name))
    if key not in _WANT:
        prompts = prompts_with_shared_prefixes(8)
        _WANT[key] = (prompts, [greedy_reference(built(name), name, fmt, p, 8) for p in prompts])
    return fmt, *_WANT[key]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["llama", "gemma3", "lfm2"])
@pytest.mark.parametrize("batch", [1, 8])
def test_engine_greedy_equals_the_reference_loop(name, bits, batch):
    fmt, prompts, want = engine_case(name, bits)
    engine = Engine(built(name), num_blocks=128, block_size=4, max_num_seqs=batch,
                    max_num_batched_tokens=64, kv_bits=bits, kv_group_size=fmt.group_size)
    assert engine.cache.kv_format == fmt
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.tokens for o in outs] == want
    if name == "llama":  # sliding and hybrid models reuse prefixes only from checkpoints
        assert engine.scheduler.stats.num_prefix_hit_tokens_total > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_engine_preempts_on_a_tiny_quantized_pool_and_outputs_stay_equal(name, preemption):
    fmt, prompts, want = engine_case(name, 8)
    engine = Engine(built(name), num_blocks=14, block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=32, preemption=preemption, num_host_blocks=64,
                    num_host_slots=8, kv_format=fmt)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.tokens for o in outs] == want
    assert_preempted(engine, preemption)
    assert_no_leak(engine)


def test_engine_retries_a_raising_forward_on_quantized_pages():
    fmt, prompts, want = engine_case("llama", 4)
    failing = FailingModel(built("llama"), fail_at=[2, 5], layer=1)
    engine = Engine(failing, num_blocks=128, block_size=4, max_num_batched_tokens=40,
                    kv_format=fmt, max_forward_retries=4)
    failing.arm()
    outs = engine.generate(prompts, SamplingParams(max_tokens=8))
    assert engine.stats.num_forward_errors == 2
    assert [o.tokens for o in outs] == want
    assert_no_leak(engine)
