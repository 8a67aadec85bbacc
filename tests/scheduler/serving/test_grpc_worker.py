"""The gateway's gRPC worker service (`scheduler/serving/grpc_worker.py`)
and its KV-event stream (`grpc_events.py`), driven by a gRPC client with
SMG's own generated stubs, in process.

Generation is mlx-lm's greedy decode (`tests/reference.py`), streamed or
whole, one sample or two; the event stream, read as SMG's indexer reads
it (numbered batches, stored runs chained to parents already stored),
rebuilds exactly the blocks the store can serve after a run that evicts
(`servable_prefixes`, the store's own answers), and so does a late
subscriber's snapshot; a replay starts where it is asked to; bad requests
are INVALID_ARGUMENT and leave no sequence behind; a cancelled stream and
the Abort call free their request; the tokenizer bundle is the model
directory's files with their SHA-256.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
import time
import zipfile

import pytest

grpc = pytest.importorskip("grpc", reason="the gRPC worker needs grpcio (pip install '.[fleet]')")
pytest.importorskip("smg_grpc_proto", reason="needs smg-grpc-proto (pip install '.[fleet]')")
pytest.importorskip("msgpack", reason="the KV events need msgpack (events extra)")

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as pb  # noqa: E402

from scheduler import Engine  # noqa: E402
from scheduler.engine.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    TeeSink,
    encode_batch,
)
from scheduler.serving import serve  # noqa: E402
from scheduler.serving.async_engine import AsyncEngine  # noqa: E402
from scheduler.serving.grpc_events import KvEventRelay, attach  # noqa: E402
from scheduler.serving.grpc_worker import GrpcWorker, WorkerModel  # noqa: E402
from tests.fleet import EventView  # noqa: E402
from tests.leaks import assert_only_the_cache_holds  # noqa: E402
from tests.reference import greedy_reference  # noqa: E402
from tests.scheduler.serving.test_kv_events import (  # noqa: E402
    FlakySink,
    run_and_check,
    servable_prefixes,
    workload,
)
from tests.serve_model import build_model_dir, load_tiny  # noqa: E402
from tests.tiny_models import built  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # small: the event test's prompts evict


class Worker:
    def __init__(self, path):
        self.path = path
        engine, _ = serve.load_engine(path,
                                      serve.serve_config(num_blocks=NUM_BLOCKS,
                                                         block_size=BLOCK_SIZE, max_num_seqs=4))
        self.engine = AsyncEngine(engine)
        self.server = GrpcWorker(self.engine, WorkerModel.of(path, "tiny"), port=0)
        port = self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        self.model, self.tok = load_tiny(path)

    def call(self, fn):
        """`fn(engine)` on the engine's thread."""
        return asyncio.run(self.engine.call(fn))

    def close(self):
        self.channel.close()
        self.server.stop()
        self.engine.shutdown()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(build_model_dir(tmp_path_factory.mktemp("grpc") / "tiny", context=256))
    yield w
    w.close()


def _request(rid, tokens, max_tokens=6, stream=False, **sampling):
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=tokens), stream=stream,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=True, **sampling))


def _prompt(tok, i):
    return tok.encode(f"Session {i}: the quick brown fox jumps over the lazy dog {i}.")


def test_generate_streamed_or_whole_is_mlx_lms_greedy_decode(worker):
    prompt = _prompt(worker.tok, 0)
    want = greedy_reference(worker.model, prompt, 6)
    (whole,) = list(worker.stub.Generate(_request("whole", prompt)))
    assert whole.WhichOneof("response") == "complete"
    c = whole.complete
    assert list(c.output_ids) == want and c.finish_reason == "length"
    assert c.prompt_tokens == len(prompt) and c.completion_tokens == 6

    replies = list(worker.stub.Generate(_request("streamed", prompt, stream=True, n=2)))
    chunks = [r.chunk for r in replies if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    for index in (0, 1):
        tokens = [t for ch in chunks if ch.index == index for t in ch.token_ids]
        assert tokens == want, index
        (done,) = [c for c in completes if c.index == index]
        assert done.finish_reason == "length"
    # the second request hit the first one's prefix: its cached tokens say so
    assert all(ch.cached_tokens >= (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE for ch in chunks)
    assert worker.call(lambda e: e.cache.store.num_sequences) == 0


def _read(stream, view, stop, numbers, apply):
    try:
        for batch in stream:
            numbers.append(batch.sequence_number)
            if apply:
                view.apply(batch)
    except grpc.RpcError as error:
        if not stop.is_set():
            view.error = error
    except AssertionError as error:
        view.error = error


def _servable(engine, sequences):
    """The full-page prefixes of `sequences` a hit of the store uses now."""
    store, result = engine.cache.store, set()
    for tokens in sequences:
        for length in range(BLOCK_SIZE, len(tokens) + 1):
            hit = store.cached_prefix_length(list(tokens[:length]) + [0])
            for end in range(BLOCK_SIZE, hit + 1, BLOCK_SIZE):
                result.add(tuple(tokens[:end]))
    return result


class Reader:
    """A subscription read on its own thread into an `EventView`."""

    def __init__(self, worker, start, apply=True):
        self.view = EventView(BLOCK_SIZE, numbered=True)
        self.stop, self.numbers = threading.Event(), []
        self.stream = worker.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start))
        self.thread = threading.Thread(
            target=_read, daemon=True,
            args=(self.stream, self.view, self.stop, self.numbers, apply))
        self.thread.start()

    def close(self):
        self.stop.set()
        self.stream.cancel()
        self.thread.join(timeout=10)
        assert self.view.error is None, self.view.error


def _until(check, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_event_stream_rebuilds_what_the_store_serves(worker):
    live = Reader(worker, 0)
    _until(lambda: live.view.last is not None, "no snapshot on subscribing")
    first = worker.server.relay.last_sequence
    sequences = []
    for i in range(12):  # more than the pool holds: evictions
        prompt = _prompt(worker.tok, i % 9)
        (reply,) = list(worker.stub.Generate(_request(f"ev-{i}", prompt)))
        sequences.append(prompt + list(reply.complete.output_ids))
    want = worker.call(lambda e: _servable(e, sequences))
    assert worker.call(lambda e: e.cache.store.stats.num_evicted_nodes) > 0
    _until(lambda: live.view.prefixes() == want, "the streamed view never matched the store")
    assert len(want) > 5

    late = Reader(worker, 0)  # a snapshot of the state now
    _until(lambda: late.view.prefixes() == want, "the snapshot is not the store's state")
    last = worker.server.relay.last_sequence
    assert late.numbers == [last]
    replay = Reader(worker, first + 1, apply=False)  # (its view would start at `first`)
    _until(lambda: replay.numbers[-1:] == [last], "the replay did not reach the last batch")
    assert replay.numbers == list(range(first + 1, last + 1))
    for reader in (live, late, replay):
        reader.close()


@pytest.mark.parametrize("change,message", [
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(json_schema='{"type": "object"}'), "constrained"),
    (dict(prompt_logprobs=1), "prompt logprobs"),
    (dict(top_p=2.0), "top_p"),
])
def test_a_bad_request_is_invalid_argument_and_leaves_nothing(worker, change, message):
    prompt = _prompt(worker.tok, 3)
    request = _request("bad", prompt)
    for key, value in change.items():
        setattr(request.sampling_params, key, value)
    with pytest.raises(grpc.RpcError) as info:
        list(worker.stub.Generate(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    worker.call(lambda e: (assert_only_the_cache_holds(e.cache.store), e.check_integrity()))


def test_a_cancelled_stream_and_the_abort_call_free_their_request(worker):
    stream = worker.stub.Generate(_request("cut", _prompt(worker.tok, 4), max_tokens=100,
                                           stream=True))
    next(stream)
    stream.cancel()
    _until(lambda: worker.call(lambda e: e.cache.store.num_sequences) == 0,
           "the cancelled request kept its pages")

    replies = worker.stub.Generate(_request("stop-me", _prompt(worker.tok, 5), max_tokens=100,
                                            stream=True))
    next(replies)
    worker.stub.Abort(pb.AbortRequest(request_ids=["stop-me"]))
    rest = list(replies)
    assert rest[-1].WhichOneof("response") == "complete"
    assert rest[-1].complete.finish_reason == "abort"
    worker.call(lambda e: (assert_only_the_cache_holds(e.cache.store), e.check_integrity()))


def test_the_information_calls_describe_the_engine(worker):
    assert worker.stub.HealthCheck(pb.HealthCheckRequest()).healthy
    info = worker.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.is_generation and info.served_model_name == "tiny"
    context = worker.call(lambda e: e.scheduler.config.max_model_len)  # the pool's, < 256
    assert info.max_context_length == context < 256
    assert info.vocab_size == len(worker.tok.vocab)
    assert list(info.eos_token_ids) == sorted(worker.tok.eos_token_ids)
    assert info.tokenizer_path == str(worker.path) and info.model_type == "llama"
    server = worker.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.block_size == BLOCK_SIZE and server.max_num_seqs == 4
    (load,) = worker.stub.GetLoads(pb.GetLoadsRequest()).loads
    assert load.max_total_num_tokens == NUM_BLOCKS * BLOCK_SIZE
    assert load.num_running_reqs == load.num_waiting_reqs == load.num_used_tokens == 0


def test_the_tokenizer_bundle_is_the_directorys_files(worker):
    chunks = list(worker.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
        for name in names:
            assert archive.read(name) == (worker.path / name).read_bytes()


# ------------------------------------------------------------ the relay alone


def _payload(*events):
    return encode_batch(KVEventBatch(1.0, events, 0))


def _stored(digest, parent, tokens):
    return BlockStored((digest,), parent, tuple(tokens), len(tokens))


async def _take(agen, n):
    return [await agen.__anext__() for _ in range(n)]


def test_the_relay_replays_from_its_history_and_snapshots_otherwise():
    async def run():
        relay = KvEventRelay(history=3)
        relay.send(_payload(_stored(1, None, [1, 2])))
        relay.send(_payload(_stored(2, 1, [3, 4])))
        relay.send(_payload(AllBlocksCleared(), _stored(3, None, [5, 6])))
        relay.send(_payload(_stored(4, 3, [7, 8])))
        # 2..4 are kept: from 3, a replay; from 1 (forgotten), a snapshot numbered 4
        replayed = await _take(relay.subscribe(3), 2)
        assert [b.sequence_number for b in replayed] == [3, 4]
        (snapshot,) = await _take(relay.subscribe(1), 1)
        assert snapshot.sequence_number == 4 and snapshot.HasField("snapshot")
        kinds = [e.WhichOneof("data") for e in snapshot.events]
        assert kinds == ["cleared", "stored", "stored"]
        assert [e.stored.blocks[0].block_hash for e in snapshot.events[1:]] == [3, 4]
        assert snapshot.events[2].stored.parent_block_hash == 3
        relay.close()
    asyncio.run(run())


def test_the_relay_ends_a_subscriber_that_falls_behind_and_at_close():
    async def run():
        relay = KvEventRelay(max_pending=2)
        behind = relay.subscribe(0)
        await _take(behind, 1)  # the snapshot: now subscribed
        for digest in (1, 2, 3):
            relay.send(_payload(_stored(digest, None, [digest])))
        taken = [b.sequence_number async for b in behind]
        assert taken == [1, 2]  # the third made it end: it reconnects and is replayed
        assert relay.num_subscribers == 0
        live = relay.subscribe(0)
        await _take(live, 1)
        relay.close()
        assert [b async for b in live] == []
    asyncio.run(run())


class _Refusing:
    def __init__(self):
        self.num_calls = 0

    def send(self, payload):
        self.num_calls += 1
        raise OSError("refused")

    def close(self):
        pass


def test_a_tee_gives_every_sink_the_batch_and_then_raises():
    relay, refusing = KvEventRelay(), _Refusing()
    tee = TeeSink(refusing, relay)
    with pytest.raises(OSError, match="refused"):
        tee.send(_payload(_stored(1, None, [1])))
    assert refusing.num_calls == 1 and relay.last_sequence == 1


@pytest.mark.parametrize("name,vocab", [("llama", 101), ("lfm2", 61)])
def test_a_failing_sink_beside_the_relay_leaves_its_state_exact(name, vocab):
    """A `--kv-events` socket that loses and refuses batches beside the relay:
    the publisher resends the whole state to both, and the relay's state
    (its snapshot) is what the store serves, namespaces included."""
    engine = Engine(built(name), num_blocks=28, block_size=BLOCK_SIZE, kv_events=FlakySink(),
                    max_num_seqs=4)
    relay = KvEventRelay()
    attach(engine, relay)
    seen: list = []
    run_and_check(engine, workload(vocab), seen.append)

    async def snapshot():
        return await relay.subscribe(0).__anext__()

    view = EventView(BLOCK_SIZE, numbered=True)
    view.apply(asyncio.run(snapshot()))
    assert view.prefixes(namespaced=True) == servable_prefixes(engine.cache.store, seen[-1])
    assert engine.kv_events.num_errors > 0 and len(view.blocks) > 5
    assert engine.cache.store.stats.num_evicted_nodes > 0
