"""Bad input at every bookkeeping entry point: `BlockManager`, `Scheduler`,
`SamplingParams`, `Request`. Each bad call raises the typed error and leaves
`debug_state()` exactly as it was; accepted conversions (tuples, generators,
numpy integer arrays and scalars) give the very result a list of ints gives.
Faults in prefix-cache listeners leave the manager consistent.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from blockmgr import (
    BlockManager,
    BlockManagerConfig,
    DuplicateSequence,
    GroupedStore,
    GroupedStoreConfig,
    InvalidArgument,
    UnknownSequence,
)
from blockmgr.errors import WrongArgumentType
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.core.scheduler import RequestTooLarge, StaleSchedulerOutput

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
LONG = list(range(100, 140))  # past the short-list path of the validation


def make(**kwargs) -> BlockManager:
    cfg = dict(num_blocks=32, block_size=4, num_host_blocks=8)
    cfg.update(kwargs)
    return BlockManager(BlockManagerConfig(**cfg))


def busy_manager(**kwargs) -> BlockManager:
    """A manager with live sequences and a filled prefix trie."""
    bm = make(**kwargs)
    bm.allocate("done", PROMPT + [1, 2])
    bm.free("done")
    bm.allocate("a", PROMPT + [3])
    bm.allocate("long", LONG)
    return bm


def refused(state_of, error, call) -> Exception:
    before = state_of()
    with pytest.raises(error) as info:
        call()
    assert state_of() == before, "a refused call changed the state"
    return info.value


# ------------------------------------------------------------ block manager

BAD_TOKENS = [
    ("str", "hello", WrongArgumentType),
    ("bytes", b"\x01\x02", WrongArgumentType),
    ("int", 7, WrongArgumentType),
    ("None", None, WrongArgumentType),
    ("float elem", [1, 2.0, 3], WrongArgumentType),
    ("float elem long", LONG[:-1] + [3.0], WrongArgumentType),
    ("float first long", [1.0] + LONG, WrongArgumentType),
    ("None elem", [1, None], WrongArgumentType),
    ("None elem long", LONG + [None] + LONG, WrongArgumentType),
    ("str elem", [1, "2"], WrongArgumentType),
    ("str elem long", LONG + ["x"] + LONG, WrongArgumentType),
    ("bool elem", [1, True], WrongArgumentType),
    ("bool first long", [True] + LONG, WrongArgumentType),
    ("negative", [1, -1], InvalidArgument),
    ("one negative", [-1], InvalidArgument),
    ("one at 2**64", [2**64], InvalidArgument),
    ("one bool", [True], WrongArgumentType),
    ("one float", [7.0], WrongArgumentType),
    ("huge long", LONG + [2**64], InvalidArgument),
    ("negative long", LONG + [-5] + LONG, InvalidArgument),
    ("nested (unhashable)", [1, [2, 3]], WrongArgumentType),
    ("nested long", LONG + [[2]] + LONG, WrongArgumentType),
    ("tuple with float", (1, 2.5), WrongArgumentType),
    ("generator with None", (t for t in [1, None]), WrongArgumentType),
    ("numpy float array", np.array([1.0, 2.0]), WrongArgumentType),
    ("numpy 2-D array", np.array([[1, 2], [3, 4]]), WrongArgumentType),
    ("numpy negative", np.array([1, -2], dtype=np.int32), InvalidArgument),
    ("numpy bool array", np.array([True, False]), WrongArgumentType),
    ("numpy float scalar elem", [1, np.float32(2)], WrongArgumentType),
    ("numpy scalar", np.int64(3), WrongArgumentType),
    ("dict", {1: 2}, None),  # iterable of ints: accepted (its keys), see below
    ("not iterable", object(), WrongArgumentType),
]
BAD_TOKENS = [case for case in BAD_TOKENS if case[2] is not None]


@pytest.mark.parametrize("label,tokens,error", BAD_TOKENS, ids=[c[0] for c in BAD_TOKENS])
def test_bad_prompt_is_refused_by_every_prompt_call(label, tokens, error):
    bm = busy_manager()
    calls = [
        lambda t: bm.allocate("new", t),
        lambda t: bm.can_allocate(t),
        lambda t: bm.cached_prefix_length(t),
        lambda t: bm.append("a", t),
    ]
    for call in calls:
        refused(bm.debug_state, error, lambda: call(tokens))
        if hasattr(tokens, "__next__"):
            break  # a generator is consumed by the first call
    bm.check_integrity()


@pytest.mark.parametrize(
    "label,call,error",
    [
        ("empty prompt", lambda bm: bm.allocate("new", []), InvalidArgument),
        ("empty numpy prompt", lambda bm: bm.allocate("new", np.array([], dtype=np.int64)),
         InvalidArgument),
        ("duplicate id", lambda bm: bm.allocate("a", [1]), DuplicateSequence),
        ("unhashable id", lambda bm: bm.allocate(["x"], [1]), InvalidArgument),
        ("unhashable namespace", lambda bm: bm.allocate("new", [1], namespace={}),
         WrongArgumentType),
        ("unknown id append", lambda bm: bm.append("nope", [1]), UnknownSequence),
        ("unknown id free", lambda bm: bm.free("nope"), UnknownSequence),
        ("unhashable id free", lambda bm: bm.free(["a"]), UnknownSequence),
        ("free float count", lambda bm: bm.free("a", 1.0), WrongArgumentType),
        ("free bool count", lambda bm: bm.free("a", True), WrongArgumentType),
        ("free negative count", lambda bm: bm.free("a", -1), InvalidArgument),
        ("free count past end", lambda bm: bm.free("a", 99), InvalidArgument),
        ("truncate float", lambda bm: bm.truncate("a", 2.0), WrongArgumentType),
        ("truncate huge", lambda bm: bm.truncate("a", 2**70), InvalidArgument),
        ("can_append str", lambda bm: bm.can_append("a", "1"), WrongArgumentType),
        ("cache_prefix None-like", lambda bm: bm.cache_prefix("a", "3"), WrongArgumentType),
        ("fork to live id", lambda bm: bm.fork("a", "long"), DuplicateSequence),
        ("fork to unhashable", lambda bm: bm.fork("a", {}), InvalidArgument),
    ],
)
def test_bad_call_is_refused_and_changes_nothing(label, call, error):
    bm = busy_manager()
    refused(bm.debug_state, error, lambda: call(bm))
    bm.check_integrity()


@pytest.mark.parametrize(
    "make_tokens",
    [
        lambda t: tuple(t),
        lambda t: (x for x in t),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: [np.int64(x) for x in t],
        lambda t: [np.int32(x) for x in t][:2] + t[2:],
        lambda t: range(t[0], t[0] + len(t)) if t == list(range(t[0], t[0] + len(t))) else t,
    ],
)
@pytest.mark.parametrize("tokens", [PROMPT + [1, 2], LONG, [4]])
def test_accepted_kinds_give_the_same_result_as_a_list_of_ints(make_tokens, tokens):
    want, got = make(), make()
    for bm, prompt, new in ((want, tokens, tokens[:3]),
                            (got, make_tokens(tokens), make_tokens(tokens[:3]))):
        bm.allocate("warm", tokens)
        bm.free("warm")
        bm.allocate("s", prompt)
        bm.append("s", new)
    assert got.debug_state() == want.debug_state()
    assert all(type(t) is int for t in got.tokens("s"))
    got.check_integrity()


def test_numpy_integer_counts_are_accepted():
    bm = busy_manager()
    assert bm.can_append("a", np.int64(2))
    bm.truncate("a", np.int32(4))
    bm.free("a", np.uint8(3))
    bm.check_integrity()


def test_free_never_fails_for_a_live_id_after_refused_allocations():
    """The old failure: an unhashable element was accepted, then free raised
    after deleting the sequence and its pages leaked."""
    bm = busy_manager()
    for bad in ([1, [2]], [1, {}], np.zeros((2, 2), dtype=np.int64)):
        with pytest.raises(InvalidArgument):
            bm.allocate("x", bad)
    for seq_id in list(bm.sequence_ids()):
        bm.free(seq_id)
    bm.check_integrity()
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == bm.config.num_blocks


def test_floats_do_not_share_cache_entries_with_ints():
    bm = busy_manager()
    with pytest.raises(WrongArgumentType):
        bm.cached_prefix_length([float(t) for t in PROMPT + [1, 2]])


def test_nan_namespace_passes_the_integrity_check():
    bm = make()
    nan = float("nan")
    bm.allocate("a", PROMPT, namespace=nan)
    bm.free("a")
    bm.check_integrity()
    bm.allocate("b", PROMPT, namespace=float("nan"))  # another NaN object
    bm.check_integrity()
    bm.free("b")
    bm.check_integrity()


# --------------------------------------------------------------- listeners


class FailingListener:
    """Raises on every `fail_every`-th call; records what it was told."""

    def __init__(self, bm_ref: list, fail_every: int = 2) -> None:
        self.calls = 0
        self.fail_every = fail_every
        self.bm_ref = bm_ref
        self.held: dict[int, int] = {}

    def _tick(self) -> None:
        self.calls += 1
        bm = self.bm_ref[0] if self.bm_ref else None
        if bm is not None:
            bm.check_integrity()  # called only once the state is consistent
        if self.calls % self.fail_every == 0:
            raise RuntimeError(f"listener fault {self.calls}")

    def stored(self, pages, tokens):
        for page in pages:
            self.held[page] = self.held.get(page, 0) + 1
        self._tick()

    def removed(self, pages):
        for page in pages:
            self.held[page] -= 1
        self._tick()


@pytest.mark.parametrize("fail_every", [1, 2, 3])
def test_a_raising_listener_cannot_corrupt_the_manager(fail_every):
    ref: list = []
    listener = FailingListener(ref, fail_every)
    bm = BlockManager(BlockManagerConfig(num_blocks=12, block_size=4), listener=listener)
    ref.append(bm)
    rng = np.random.default_rng(fail_every)
    errors = []
    for i in range(40):
        prompt = [i % 3] * 6 + rng.integers(0, 50, int(rng.integers(1, 9))).tolist()
        bm.allocate(i, prompt)  # evicts under pressure: `removed` events
        bm.append(i, [1, 2])
        bm.free(i)  # stores: `stored` events; never raises for a live id
        errors += bm.take_listener_errors()
        bm.check_integrity()
    assert errors and all(isinstance(exc, RuntimeError) for _, exc in errors)
    assert {name for name, _ in errors} <= {"stored", "removed"}
    assert len(errors) == listener.calls // fail_every
    assert bm.take_listener_errors() == []
    # Every event was delivered despite the faults: the listener's view
    # matches the trie exactly.
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == bm.config.num_blocks
    assert all(count == 0 for count in listener.held.values())


# ------------------------------------------------------------- scheduler


def make_scheduler(**cfg):
    bm = make(num_blocks=16)
    config = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=60)
    config.update(cfg)
    return bm, Scheduler(SchedulerConfig(**config), bm)


def state(bm, s):
    return lambda: (bm.debug_state(), s.debug_state())


def request(rid, tokens=PROMPT, **sp):
    return Request(rid, tokens, SamplingParams(max_tokens=sp.pop("max_tokens", 4), **sp))


@pytest.mark.parametrize(
    "label,make_request,error",
    [
        ("not a Request", lambda: "r", WrongArgumentType),
        ("duplicate id", lambda: request("r0"), InvalidArgument),
        ("n > max_num_seqs", lambda: request("big", n=5), RequestTooLarge),
        ("prompt reaches max_model_len", lambda: request("big", list(range(60))),
         RequestTooLarge),
        ("prompt larger than the pool", lambda: request("big", list(range(59)) * 2),
         RequestTooLarge),
    ],
)
def test_scheduler_add_request_refuses(label, make_request, error):
    bm, s = make_scheduler(max_model_len=None if "pool" in label else 60)
    s.add_request(request("r0"))
    refused(state(bm, s), error, lambda: s.add_request(make_request()))


def scheduled(s, bm, *requests):
    for r in requests:
        s.add_request(r)
    return s.schedule()


def test_update_refuses_bad_sampled_values_before_changing_anything():
    bm, s = make_scheduler()
    out = scheduled(s, bm, request("a"), request("b"), request("c", n=2))
    good = {"a": 1, "b": 2, "c": [3, 4]}
    bad_values = [
        {"a": 1, "c": [3, 4]},  # missing b
        {**good, "b": 2.0},
        {**good, "b": None},
        {**good, "b": "2"},
        {**good, "b": -1},
        {**good, "b": True},
        {**good, "c": [3]},  # n = 2 needs 2 tokens
        {**good, "c": [3, 4, 5]},
        {**good, "c": [3, "x"]},
        [("a", 1)],  # not a mapping
    ]
    for sampled in bad_values:
        refused(state(bm, s), InvalidArgument, lambda: s.update(out, sampled))
    refused(state(bm, s), WrongArgumentType, lambda: s.update("out", good))
    s.update(out, good)
    bm.check_integrity()


def test_update_refuses_bad_sampled_values_of_decode_rows_before_changing_anything():
    """Decode rows are checked in one pass over their columns; a bad value
    must still be refused, naming it, before any row or record changes."""
    bm, s = make_scheduler()
    first = scheduled(s, bm, request("a"), request("b"), request("c", n=2))
    s.update(first, {"a": 1, "b": 2, "c": [3, 4]})
    out = s.schedule()
    assert len(out.rows) == 4 and not out.items  # every row in columns
    good = {"a": 5, "b": 6, ("c", 0): 7, ("c", 1): 8}
    for sampled in [
        {k: v for k, v in good.items() if k != "b"},  # missing b
        {**good, "b": 2.0},
        {**good, "b": None},
        {**good, "b": "2"},
        {**good, "b": -1},
        {**good, "b": True},
        {**good, ("c", 1): [8, 9]},  # one sample: one token
    ]:
        error = refused(state(bm, s), InvalidArgument, lambda: s.update(out, sampled))
        bad = next(k for k in good if sampled.get(k, "missing") != good[k])
        assert repr(bad) in str(error)
    # A mapping with defaults still needs every row's token (and is not filled in).
    partial = defaultdict(int, {k: v for k, v in good.items() if k != "b"})
    error = refused(state(bm, s), InvalidArgument, lambda: s.update(out, partial))
    assert "'b'" in str(error) and "b" not in partial
    ids = out.rows.seq_ids
    for row_tokens, error in [
        ([good[k] for k in ids][:-1], InvalidArgument),  # one token short
        ("5678", WrongArgumentType),
        ([-1 if k == "b" else good[k] for k in ids], InvalidArgument),
        ([None if k == "b" else good[k] for k in ids], InvalidArgument),
    ]:
        refused(state(bm, s), error, lambda: s.update(out, {}, row_tokens=row_tokens))
    results = s.update(out, {**good, "a": np.int64(5), "b": [6]})  # accepted like ints
    assert {r.request_id: r.new_tokens for r in results} == {
        "a": {0: [5]}, "b": {0: [6]}, "c": {0: [7], 1: [8]}}
    assert s.get_request("c").outputs == [[3, 7], [4, 8]]
    bm.check_integrity()


def test_row_tokens_stand_for_the_rows_entries_in_sampled():
    """`update(out, sampled, row_tokens=...)` gives the rows' tokens in row
    order; the outcome equals the same values given in `sampled`, also
    after an abort between schedule and update (the record-by-record path)."""
    def run(by_rows: bool, abort: bool):
        bm, s = make_scheduler()
        first = scheduled(s, bm, request("a"), request("b"), request("c", n=2))
        s.update(first, {"a": 1, "b": 2, "c": [3, 4]})
        out = s.schedule()
        if abort:
            s.abort("b")
        tokens = {"a": 5, "b": 6, ("c", 0): 7, ("c", 1): 8}
        if by_rows:
            results = s.update(out, {"b": 99}, row_tokens=[tokens[k] for k in out.rows.seq_ids])
        else:
            results = s.update(out, tokens)
        bm.check_integrity()
        return [(r.request_id, r.new_tokens, r.finished) for r in results], s.debug_state(), \
            bm.debug_state()

    for abort in (False, True):
        assert run(True, abort) == run(False, abort)
    assert run(True, False)[0][1] == ("b", {0: [6]}, False)


def test_update_refuses_a_stale_or_repeated_output():
    bm, s = make_scheduler()
    out = scheduled(s, bm, request("a"))
    s.update(out, {"a": 1})
    refused(state(bm, s), StaleSchedulerOutput, lambda: s.update(out, {"a": 1}))
    newer = s.schedule()
    refused(state(bm, s), StaleSchedulerOutput, lambda: s.update(out, {"a": 1}))
    s.update(newer, {"a": 1})


def test_update_accepts_numpy_integers_like_ints():
    def run(convert):
        bm, s = make_scheduler()
        out = scheduled(s, bm, request("a"), request("c", n=2))
        results = s.update(out, {"a": convert(7), "c": np.array([8, 9]) if convert is np.int64
                                 else [8, 9]})
        return [(r.request_id, r.new_tokens) for r in results], s.debug_state(), bm.debug_state()

    want, got = run(int), run(np.int64)
    assert got == want
    assert all(type(t) is int for _, tokens in got[0] for ts in tokens.values() for t in ts)


# ------------------------------------------------------- sampling, request


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(seed=2**64), InvalidArgument),
        (dict(seed=-1), InvalidArgument),
        (dict(seed=1.5), WrongArgumentType),
        (dict(seed=True), WrongArgumentType),
        (dict(seed="1"), WrongArgumentType),
        (dict(temperature=math.nan), InvalidArgument),
        (dict(temperature=math.inf), InvalidArgument),
        (dict(temperature=-0.5), InvalidArgument),
        (dict(temperature="0"), WrongArgumentType),
        (dict(temperature=None), WrongArgumentType),
        (dict(top_p=0.0), InvalidArgument),
        (dict(top_p=1.5), InvalidArgument),
        (dict(top_p=math.nan), InvalidArgument),
        (dict(max_tokens=0), InvalidArgument),
        (dict(max_tokens=2.0), WrongArgumentType),
        (dict(max_tokens=True), WrongArgumentType),
        (dict(n=0), InvalidArgument),
        (dict(n=None), WrongArgumentType),
        (dict(stop_token_ids=["a"]), WrongArgumentType),
        (dict(stop_token_ids=[-1]), InvalidArgument),
        (dict(stop_token_ids=5), WrongArgumentType),
        (dict(stop_token_ids="ab"), WrongArgumentType),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, error):
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    (value,) = kwargs.values()
    named = value[0] if isinstance(value, list) else value  # the bad element
    assert repr(named)[:20] in str(info.value) or str(named) in str(info.value)


def test_sampling_params_accept_numpy_values_and_tiny_temperatures():
    p = SamplingParams(max_tokens=np.int64(3), n=np.uint8(2), seed=np.uint64(2**64 - 1),
                       stop_token_ids=np.array([1, 2]), temperature=np.float32(0.5))
    assert (p.max_tokens, p.n, p.seed, p.stop_token_ids) == (3, 2, 2**64 - 1, (1, 2))
    assert all(type(v) is int for v in (p.max_tokens, p.n, p.seed, *p.stop_token_ids))
    assert SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(request_id=["x"]), WrongArgumentType),
        (dict(request_id=("x", 0)), InvalidArgument),
        (dict(prompt_tokens="hello"), WrongArgumentType),
        (dict(prompt_tokens=[]), InvalidArgument),
        (dict(prompt_tokens=[1, True]), WrongArgumentType),
        (dict(prompt_tokens=LONG + [True]), WrongArgumentType),
        (dict(prompt_tokens=[[1, 2]]), WrongArgumentType),
        (dict(sampling={"n": 2}), WrongArgumentType),
        (dict(priority=1.5), WrongArgumentType),
        (dict(namespace=[1]), WrongArgumentType),
    ],
)
def test_request_refuses_bad_values(kwargs, error):
    args = dict(request_id="r", prompt_tokens=[1, 2])
    args.update(kwargs)
    with pytest.raises(error):
        Request(**args)


def test_an_interrupt_in_a_listener_propagates_and_loses_no_later_event():
    class Interrupting:
        def __init__(self):
            self.removed_pages: list[list[int]] = []
            self.interrupt = True

        def stored(self, pages, tokens):
            pass

        def removed(self, pages):
            if self.interrupt:
                self.interrupt = False
                raise KeyboardInterrupt
            self.removed_pages.append(list(pages))

    listener = Interrupting()
    bm = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4), listener=listener)
    for seq_id, prompt in (("a", [1, 2, 3]), ("b", [7, 8])):
        bm.allocate(seq_id, prompt)
        bm.free(seq_id)
    with pytest.raises(KeyboardInterrupt):
        bm.reset_prefix_cache()  # evicts two leaves: two `removed` events
    bm.check_integrity()
    assert bm.num_free_blocks == bm.config.num_blocks  # the reset itself is complete
    assert listener.removed_pages == []
    bm.allocate("c", [4, 5])
    bm.free("c")  # delivers the event still queued
    assert len(listener.removed_pages) == 1


@pytest.mark.parametrize("group", [-1, 3, True, "1", 1.0])
def test_a_page_table_of_a_group_the_manager_lacks_is_refused(group):
    """`block_table(seq, group)` names a group the manager keeps or raises a
    typed error: a negative index gave another group's table, and a plain
    manager failed with a TypeError."""
    store = GroupedStore(GroupedStoreConfig(num_blocks=16, block_size=4, windows=(None, 8, 5)))
    store.allocate("a", list(range(10)))
    plain = make()
    plain.allocate("a", list(range(10)))
    for manager in (store, plain):
        with pytest.raises((InvalidArgument, WrongArgumentType)):
            manager.block_table("a", group)
    assert plain.block_table("a", 0) == plain.block_table("a")
    assert store.block_table("a", 0) == store.block_table("a")
