"""The Engine under bad input and faulty callbacks, on tiny random-weight
models (float32), against mlx-lm's own greedy generation.

Each refused call raises the typed error and leaves `Engine.debug_state()`
unchanged; a faulty callback ends only its own request; every other request
finishes with exactly mlx-lm's output and nothing leaks.
"""

from __future__ import annotations

import numpy as np
import pytest

from blockmgr import InvalidArgument
from blockmgr.errors import WrongArgumentType
from scheduler import Engine, RequestStatus, SamplingParams
from scheduler.core.scheduler import RequestTooLarge
from scheduler.engine.engine import AutoRequestId
from tests.scheduler.test_engine import MAX_TOKENS, assert_no_leak, get

GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


def engine_for(name="llama", **kwargs):
    model, vocab, prompts, want = get(name)
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 8)
    return Engine(model, **kwargs), vocab, prompts, want


def test_add_request_refuses_bad_prompts_and_changes_nothing():
    engine, vocab, prompts, _ = engine_for(max_num_seqs=4)
    engine.add_request(prompts[0], GREEDY, request_id="live")
    engine.step()
    ok = prompts[1]
    cases = [
        ("str", dict(prompt_tokens="hello"), WrongArgumentType),
        ("None", dict(prompt_tokens=None), WrongArgumentType),
        ("empty", dict(prompt_tokens=[]), InvalidArgument),
        ("nested", dict(prompt_tokens=[ok]), WrongArgumentType),
        ("float ids", dict(prompt_tokens=[float(t) for t in ok]), WrongArgumentType),
        ("bool id", dict(prompt_tokens=ok + [True]), WrongArgumentType),
        ("bool id inside", dict(prompt_tokens=ok[:1] + [False] + ok[1:]), WrongArgumentType),
        ("numpy bool array", dict(prompt_tokens=np.ones(3, dtype=bool)), WrongArgumentType),
        ("id 2**40", dict(prompt_tokens=ok + [2**40]), InvalidArgument),
        ("id == vocab", dict(prompt_tokens=ok + [vocab]), InvalidArgument),
        ("negative id", dict(prompt_tokens=[-1] + ok), InvalidArgument),
        ("float array", dict(prompt_tokens=np.array(ok, dtype=np.float32)), WrongArgumentType),
        ("2-D array", dict(prompt_tokens=np.array([ok, ok])), WrongArgumentType),
        ("unhashable id", dict(request_id=["x"]), WrongArgumentType),
        ("tuple id", dict(request_id=("x", 1)), InvalidArgument),
        ("duplicate id", dict(request_id="live"), InvalidArgument),
        ("n > max_num_seqs", dict(sampling=SamplingParams(n=5)), RequestTooLarge),
        ("prompt longer than the pool", dict(prompt_tokens=ok * 40), RequestTooLarge),
        ("sampling not params", dict(sampling={"max_tokens": 3}), WrongArgumentType),
        ("callback not callable", dict(callback=3), WrongArgumentType),
        ("namespace unhashable", dict(namespace=[1]), WrongArgumentType),
    ]
    for label, kwargs, error in cases:
        args = dict(prompt_tokens=ok, sampling=GREEDY)
        args.update(kwargs)
        prompt = args.pop("prompt_tokens")
        sampling = args.pop("sampling")
        before = engine.debug_state()
        with pytest.raises(error) as info:
            engine.add_request(prompt, sampling, **args)
        assert engine.debug_state() == before, label
        assert str(info.value), label
    # The live request was not disturbed.
    while engine.has_unfinished():
        engine.step()
    assert engine.get_request("live") is None
    assert_no_leak(engine)


def test_out_of_vocab_message_names_the_id():
    engine, vocab, prompts, _ = engine_for()
    with pytest.raises(InvalidArgument, match=f"= {vocab + 5} .*vocab_size {vocab}"):
        engine.add_request(prompts[0] + [vocab + 5])


def test_a_type_error_names_what_was_wanted():
    """A count that is not an int is refused as an int, a prompt's element as
    a token id."""
    with pytest.raises(WrongArgumentType, match=r"^max_tokens must be an int, got 1\.5$"):
        SamplingParams(max_tokens=1.5)  # type: ignore[arg-type]
    engine, _, prompts, _ = engine_for()
    wanted = r"^prompt_tokens\[1\] must be an int token id, got 2\.0$"
    with pytest.raises(WrongArgumentType, match=wanted):
        engine.add_request([prompts[0][0], 2.0])


def test_numpy_prompt_gives_the_list_output():
    engine, _, prompts, want = engine_for()
    (out,) = engine.generate([np.array(prompts[3], dtype=np.int32)], GREEDY)
    assert out.tokens == want[3]
    assert all(type(t) is int for t in out.prompt_tokens)


def test_generate_is_all_or_nothing():
    engine, vocab, prompts, want = engine_for()
    before = engine.debug_state()
    with pytest.raises(InvalidArgument, match=r"prompts\[1\]"):
        engine.generate([prompts[0], prompts[1] + [vocab], prompts[2]], GREEDY)
    assert engine.debug_state() == before
    assert not engine.has_unfinished()
    outs = engine.generate([prompts[0], prompts[2]], GREEDY)
    assert [o.tokens for o in outs] == [want[0], want[2]]


def test_closing_a_stream_aborts_its_requests():
    engine, _, prompts, _ = engine_for()
    stream = engine.stream(prompts[:4], GREEDY)
    for _ in range(3):
        next(stream)
    assert engine.has_unfinished()
    stream.close()
    assert not engine.has_unfinished()
    assert_no_leak(engine)


def test_leaving_a_stream_loop_early_aborts_its_requests():
    engine, _, prompts, _ = engine_for()

    def first_output():
        for out in engine.stream(prompts[:3], GREEDY):
            return out

    first_output()
    import gc

    gc.collect()  # the abandoned generator is closed when collected
    assert not engine.has_unfinished()
    assert_no_leak(engine)


@pytest.mark.parametrize("fail_at", [0, 1, 4])
def test_a_raising_callback_ends_only_its_own_request(name, fail_at):
    engine, _, prompts, want = engine_for(name)
    got: dict = {}
    seen = {"n": 0}

    def record(rid):
        return lambda out: got.setdefault(rid, []).extend(out.new_tokens.get(0, []))

    def faulty(out):
        seen["n"] += 1
        if seen["n"] > fail_at:
            raise RuntimeError("callback fault")

    ids = [engine.add_request(prompts[i], GREEDY, callback=record(i)) for i in (0, 1)]
    bad = engine.add_request(prompts[2], GREEDY, callback=faulty)
    ids.append(engine.add_request(prompts[3], GREEDY, callback=record(3)))
    aborted = []
    while engine.has_unfinished():
        aborted += [o for o in engine.step() if o.request_id == bad and o.finished]
    assert got == {0: want[0], 1: want[1], 3: want[3]}
    assert len(aborted) == 1 and aborted[0].status is RequestStatus.FINISHED_ABORTED
    assert_no_leak(engine)


def test_failed_request_keeps_its_error():
    engine, _, prompts, _ = engine_for()
    error = RuntimeError("boom")

    def faulty(out):
        raise error

    rid = engine.add_request(prompts[0], GREEDY, callback=faulty)
    request = engine.get_request(rid)
    while engine.has_unfinished():
        engine.step()
    assert request.status is RequestStatus.FINISHED_ABORTED and request.error is error


def test_tiny_temperature_samples_greedily():
    engine, _, prompts, want = engine_for()
    outs = engine.generate(prompts[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-300))
    assert [o.tokens for o in outs] == want[:2]


def test_automatic_ids_never_equal_caller_ids():
    engine, _, prompts, want = engine_for()
    mine = engine.add_request(prompts[0], GREEDY, request_id="req-0")
    auto = engine.add_request(prompts[1], GREEDY)
    assert isinstance(auto, AutoRequestId) and str(auto) == "req-0" and auto != mine
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


def test_max_model_len_beyond_the_pool_is_refused():
    model, *_ = get("llama")
    with pytest.raises(InvalidArgument, match="max_model_len 10000"):
        Engine(model, num_blocks=16, block_size=8, max_model_len=10000)
