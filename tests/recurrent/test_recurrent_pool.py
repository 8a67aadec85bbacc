"""Slot plans, StatePool, RecurrentView and RecurrentPools, without a model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockmgr.errors import InvalidArgument
from blockmgr.ops import CopyBlock, CopySlot, ZeroSlot
from recurrent import (
    ArraySpec,
    HostSlots,
    RecurrentPools,
    RecurrentView,
    StatePool,
    compile_slot_plan,
    make_batch,
)
from tests.memory import peak_growth

NUM_SLOTS = 6


def filled_pool(num_slots=NUM_SLOTS, seed=0) -> tuple[StatePool, list[np.ndarray]]:
    """A pool of three arrays filled with random rows: distinct dtypes and
    shapes, small rows (indexed scatter) and 8 KiB rows (slice updates)."""
    rng = np.random.default_rng(seed)
    pool = StatePool(num_slots, 3)
    conv = rng.standard_normal((num_slots, 2, 3)).astype(np.float32)
    delta = rng.standard_normal((num_slots, 2, 4, 5)).astype(np.float32)
    big = rng.standard_normal((num_slots, 2048)).astype(np.float32)
    everything = make_batch(range(num_slots), None, num_slots)
    pool.scatter(0, everything, mx.array(conv).astype(mx.bfloat16))
    pool.scatter(1, everything, mx.array(delta))
    pool.scatter(2, everything, mx.array(big))
    pool.flush()
    return pool, contents(pool)


def contents(pool: StatePool) -> list[np.ndarray]:
    everything = make_batch(range(pool.num_slots), None, pool.num_slots)
    rows = [pool.gather(i, everything) for i in range(pool.num_arrays)]
    return [None if r is None else np.array(r.astype(mx.float32)) for r in rows]


def apply_sequentially(arrays: list[np.ndarray], ops) -> list[np.ndarray]:
    """Reference: the plan's ops one at a time, in order, on numpy copies."""
    out = [a.copy() for a in arrays]
    for op in ops:
        for a in out:
            if isinstance(op, ZeroSlot):
                a[op.slot] = 0
            elif isinstance(op, CopySlot):
                a[op.dst] = a[op.src]
    return out


slot = st.integers(0, NUM_SLOTS - 1)
op_strategy = st.one_of(
    st.builds(ZeroSlot, slot),
    st.builds(CopySlot, slot, slot),
    st.builds(CopyBlock, st.integers(0, 9), st.integers(0, 9)),
)


# ---- plans -----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(op_strategy, max_size=12))
def test_batched_plan_equals_sequential_ops(ops):
    pool, before = filled_pool()
    pool.apply_plan(ops)
    for got, want in zip(contents(pool), apply_sequentially(before, ops)):
        np.testing.assert_array_equal(got, want)


def test_plan_folds_chains_and_swaps():
    remap = compile_slot_plan([CopySlot(0, 1), CopySlot(1, 2), ZeroSlot(0)], 4)
    assert dict(zip(remap.copy_dst, remap.copy_src)) == {1: 0, 2: 0}
    assert remap.zero == (0,) and len(remap) == 3
    # A swap through a temporary reads only the original contents.
    swap = [CopySlot(0, 3), CopySlot(1, 0), CopySlot(3, 1), ZeroSlot(3)]
    pool, before = filled_pool()
    pool.apply_plan(swap)
    got = contents(pool)
    np.testing.assert_array_equal(got[1][0], before[1][1])
    np.testing.assert_array_equal(got[1][1], before[1][0])
    assert compile_slot_plan([CopySlot(2, 2), CopyBlock(0, 1)], 4) is None


@pytest.mark.parametrize(
    "ops",
    [[ZeroSlot(0), CopySlot(1, NUM_SLOTS)], [CopySlot(-1, 0)], [ZeroSlot(True)], ["zero"]],
)
def test_bad_plan_raises_and_changes_nothing(ops):
    pool, before = filled_pool()
    with pytest.raises(InvalidArgument):
        pool.apply_plan(ops)
    for got, want in zip(contents(pool), before):
        np.testing.assert_array_equal(got, want)


def test_plan_on_unmaterialized_pool_is_a_no_op_until_first_write():
    pool = StatePool(4, 1)
    pool.apply_plan([CopySlot(0, 1), ZeroSlot(2)])
    assert pool.gather(0, make_batch([1], None, 4)) is None
    assert pool.bytes_per_slot is None


# ---- pool ------------------------------------------------------------------------------


def test_first_write_materializes_with_value_shape_and_dtype():
    pool = StatePool(5, 2)
    assert pool.spec(0) is None and pool.nbytes == 0
    value = mx.ones((2, 3, 4), dtype=mx.bfloat16)
    pool.scatter(0, make_batch([4, 1], None, 5), value)
    assert pool.spec(0) == ArraySpec((3, 4), mx.bfloat16)
    assert pool.nbytes == 5 * 3 * 4 * 2 and pool.bytes_per_slot is None
    rows = contents(pool)[0]
    np.testing.assert_array_equal(rows[[1, 4]], 1.0)
    np.testing.assert_array_equal(rows[[0, 2, 3]], 0.0)  # other slots zero


def test_scatter_casts_dtype_and_rejects_wrong_shape():
    pool = StatePool(3, 1, [ArraySpec((2,), mx.float32)])
    pool.scatter(0, make_batch([2], None, 3), mx.array([[1.5, 2.5]], dtype=mx.float16))
    assert pool.gather(0, make_batch([2], None, 3)).dtype == mx.float32
    before = contents(pool)
    with pytest.raises(InvalidArgument):
        pool.scatter(0, make_batch([0], None, 3), mx.ones((1, 3)))
    with pytest.raises(InvalidArgument):
        pool.scatter(0, make_batch([0, 1], None, 3), mx.ones((1, 2)))
    np.testing.assert_array_equal(contents(pool)[0], before[0])


def test_read_slot_returns_copies():
    pool, before = filled_pool()
    conv, delta, big = pool.read_slot(3)
    np.testing.assert_array_equal(np.array(delta), before[1][3])
    pool.apply_plan([ZeroSlot(3)])
    np.testing.assert_array_equal(np.array(delta), before[1][3])


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_constructor_rejects_bad_sizes(bad):
    with pytest.raises(InvalidArgument):
        StatePool(bad, 1)
    with pytest.raises(InvalidArgument):
        StatePool(4, bad)


# ---- in place -------------------------------------------------------------------------------


def test_mlx_copies_when_gather_and_scatter_share_one_evaluation():
    """The MLX behaviour the pool is built around (a canary if MLX changes it)."""
    a = mx.zeros((4096, 1024))
    mx.eval(a)

    def naive():
        a[mx.array([1])] = a[mx.array([2])] + 1
        mx.eval(a)

    # Whether MLX copies depends on scheduling (the gather may finish and drop
    # its reference first); it usually does (34 of 40 tries on an idle
    # machine, fewer under load), so the pool must never rely on luck. 100
    # tries (~0.1 s) make a miss by chance negligible.
    assert any(peak_growth(naive) > a.nbytes // 2 for _ in range(100))


@pytest.mark.parametrize("row", [1024, 4096])  # indexed scatter / slice updates
def test_plans_and_batch_writes_stay_in_place(row):
    pool = StatePool(16384 // (row // 256), 1, [ArraySpec((row,), mx.float32)])  # 16 MiB
    size = pool.nbytes
    batch = make_batch(list(range(0, 64, 2)) + [100, 101, 102], None, pool.num_slots)

    def step():
        rows = pool.gather(0, batch)
        pool.scatter(0, batch, rows * 0.5 + 1)
        mx.eval(rows)  # the forward's outputs first ...
        pool.flush()  # ... then the pool

    step()
    assert peak_growth(step) < size // 4
    for plan in ([CopySlot(0, 9), ZeroSlot(2)], [ZeroSlot(5)], [CopySlot(3, 4)]):
        assert peak_growth(lambda: (pool.apply_plan(plan), pool.flush())) < size // 4


# ---- views -------------------------------------------------------------------------------------


def test_view_reads_writes_and_reads_back_the_batch_slots():
    pool, before = filled_pool()
    view = RecurrentView(pool, make_batch([4, 1], None, pool.num_slots))
    runs = RecurrentView(pool, make_batch([2, 3, 0], None, pool.num_slots))
    np.testing.assert_array_equal(np.array(runs[2]), before[2][[2, 3, 0]])
    assert view and view.batch_size == 2 and view.make_mask(3) is None
    np.testing.assert_array_equal(np.array(view[1]), before[1][[4, 1]])
    new = mx.full((2, 2, 4, 5), 7.0)
    view[1] = new
    assert view[1] is new and view[-2] is view[1]
    with pytest.raises(InvalidArgument):
        view[3]
    pool.flush()
    np.testing.assert_array_equal(contents(pool)[1], before[1])  # not committed yet
    view.commit()
    pool.flush()
    after = contents(pool)[1]
    np.testing.assert_array_equal(after[[4, 1]], 7.0)
    np.testing.assert_array_equal(after[[0, 2, 3, 5]], before[1][[0, 2, 3, 5]])


def test_view_on_unmaterialized_pool_reads_none_and_stays_truthy():
    pool = StatePool(3, 2)
    view = RecurrentView(pool, make_batch([2], None, 3))
    assert view[0] is None and view[1] is None
    assert bool(view) is True  # mlx-lm tests `if cache` for "has state"
    assert view.state == [None, None]


def test_a_slot_swapped_out_unmaterialized_swaps_in_as_the_zero_state(garbage_memory):
    """Slot 0 goes out while the array is unmaterialized (nothing copied);
    slot 1's swap out then allocates the host array. Host slot 0 swaps in
    as the zero state, not as whatever that memory held."""
    pool = StatePool(4, 1)
    host = HostSlots(2, 1)
    host.swap_out(pool, [0], [0])
    pool.scatter(0, make_batch([1], None, 4), mx.ones((1, 2, 3)))
    host.swap_out(pool, [1], [1])
    host.swap_in(pool, [0, 1], [2, 3])
    rows = np.array(pool.gather(0, make_batch([2, 3], None, 4)))
    np.testing.assert_array_equal(rows, [np.zeros((2, 3)), np.ones((2, 3))])


def test_view_lengths_mask_and_advance_are_per_view():
    pools = RecurrentPools(4, {0: 1, 2: 1})
    views = pools.views([3, 0, 1], lengths=[3, 1, 0])
    m = np.array(views[0].make_mask(4))
    np.testing.assert_array_equal(m, np.arange(4)[None, :] < np.array([3, 1, 0])[:, None])
    views[0].advance(4)
    np.testing.assert_array_equal(np.array(views[0].lengths), [-1, -3, -4])
    np.testing.assert_array_equal(np.array(views[2].lengths), [3, 1, 0])  # untouched


def test_view_state_setter_writes_every_array():
    pool, before = filled_pool()
    view = RecurrentView(pool, make_batch([0], None, pool.num_slots))
    view.state = [mx.zeros((1, 2, 3)), mx.ones((1, 2, 4, 5)), None]
    view.commit()
    pool.flush()
    got = contents(pool)
    np.testing.assert_array_equal(got[0][0], 0.0)
    np.testing.assert_array_equal(got[1][0], 1.0)
    np.testing.assert_array_equal(got[2], before[2])  # None: left as it was
    with pytest.raises(InvalidArgument):
        view.state = [mx.zeros((1, 2, 3))]


@pytest.mark.parametrize(
    "slots, lengths",
    [([], None), ([1, 1], None), ([0, 9], None), ([0, 1], [1]), ([0, 1], [1, -1]), (["a"], None)],
)
def test_make_batch_rejects_bad_batches(slots, lengths):
    with pytest.raises(InvalidArgument):
        make_batch(slots, lengths, 4)


def test_pools_apply_plan_to_every_layer_and_reject_unknown_layers():
    pools = RecurrentPools(3, {1: 1, 3: 2})
    assert pools.layers == (1, 3) and 3 in pools and 0 not in pools
    views = pools.views([0, 1])
    for layer in pools.layers:
        for i in range(pools.pool(layer).num_arrays):
            views[layer][i] = mx.arange(2 * 4, dtype=mx.float32).reshape(2, 4) + 1
        views[layer].commit()
    pools.flush()
    pools.apply_plan([CopySlot(1, 2), ZeroSlot(1)])
    for layer in pools.layers:
        for arr in contents(pools.pool(layer)):
            np.testing.assert_array_equal(arr[2], np.arange(4, 8) + 1)
            np.testing.assert_array_equal(arr[1], 0.0)
    assert pools.bytes_per_slot == 3 * 4 * 4
    with pytest.raises(InvalidArgument):
        pools.pool(0)
    with pytest.raises(InvalidArgument):
        RecurrentPools(3, {1: 1}, specs={2: [None]})


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(NUM_SLOTS)).flatmap(
    lambda p: st.integers(1, NUM_SLOTS).map(lambda n: p[:n])))
def test_batch_writes_land_in_their_slots(slots):
    """Any batch order: runs of consecutive slots and indexed scatters agree."""
    pool, before = filled_pool(seed=len(slots))
    batch = make_batch(slots, None, NUM_SLOTS)
    assert sum(stop - first for first, stop, _ in batch.runs) == len(slots)
    view = RecurrentView(pool, batch)
    rng = np.random.default_rng(1)
    new = [rng.standard_normal((len(slots), *a.shape[1:])).astype(np.float32) for a in before]
    for i, a in enumerate(new):
        view[i] = mx.array(a)
    view.commit()
    pool.flush()
    want = [b.copy() for b in before]
    for w, a in zip(want, new):
        w[list(slots)] = a
    want[0] = np.array(mx.array(want[0]).astype(mx.bfloat16).astype(mx.float32))
    for got, w in zip(contents(pool), want):
        np.testing.assert_array_equal(got, w)
