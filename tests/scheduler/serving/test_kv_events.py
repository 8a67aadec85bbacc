"""KV events (vLLM's wire format) against what the store can really serve.

A subscriber written here decodes every published payload the way llm-d's
KV-cache manager does (msgpack arrays: [ts, events, rank?], each event
[tag, fields in order]) and rebuilds the set of advertised prefixes from
the parent-chained hashes. After every engine step it must equal the set
obtained from the store's own answers: for every prefix of every sequence
the test ran, `cached_prefix_length` says how many full blocks a hit there
uses. Attention, hybrid (hits end at recurrent snapshots) and sliding-window
(hits need the window's pages) models, with a small pool (evictions), two
namespaces, an abort and a reset. The socket test runs a real ZMQ
subscriber and the replay socket; it is skipped without pyzmq.
"""

from __future__ import annotations

import hashlib
import random
import struct
import time

import pytest

msgpack = pytest.importorskip("msgpack", reason="KV events need the events extra (msgpack)")

from scheduler import Engine, SamplingParams  # noqa: E402
from scheduler.engine.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventFormatError,
    decode_batch,
    encode_batch,
)
from tests.tiny_models import built  # noqa: E402

BLOCK_SIZE = 4


# ---------------------------------------------------------------- encoding


def test_a_batch_encodes_to_vllm_array_like_tagged_structs():
    batch = KVEventBatch(1.5, (
        BlockStored((7, 2**63 - 1), None, (1, 2, 3, 4, 5, 6, 7, 8), 4, None, "GPU", "ns"),
        BlockRemoved((7,), None),
        AllBlocksCleared(),
    ), 0)
    # The bytes the msgpack spec gives for
    # [1.5, [["BlockStored", [7, 2**63-1], nil, [1..8], 4, nil, "GPU", "ns"],
    #        ["BlockRemoved", [7], nil], ["AllBlocksCleared"]], 0]
    expected = (
        b"\x93" + b"\xcb" + struct.pack(">d", 1.5) + b"\x93"
        + b"\x98" + b"\xabBlockStored" + b"\x92\x07\xcf" + (2**63 - 1).to_bytes(8, "big")
        + b"\xc0" + b"\x98" + bytes(range(1, 9)) + b"\x04\xc0\xa3GPU\xa2ns"
        + b"\x93\xacBlockRemoved\x91\x07\xc0"
        + b"\x91\xb0AllBlocksCleared"
        + b"\x00"
    )
    assert encode_batch(batch) == expected
    assert decode_batch(expected) == batch
    # Without a rank the batch has two fields (msgspec's omit_defaults).
    assert msgpack.unpackb(encode_batch(KVEventBatch(2.0, ()))) == [2.0, []]


def test_the_decoder_reads_a_newer_vllm_payload_and_refuses_garbage():
    newer = msgpack.packb([3.0, [["BlockStored", [5], 9, [1, 2], 2, None, "GPU", None,
                                  [None], 0, "full_attention"]]])
    assert decode_batch(newer).events == (BlockStored((5,), 9, (1, 2), 2, None, "GPU", None),)
    for bad in (b"\xc1", msgpack.packb({"ts": 1.0}), msgpack.packb([1.0, [["Nope"]]]),
                msgpack.packb([1.0, [["BlockStored", [5], None, [1], 2, None, None, None]]]),
                msgpack.packb([1.0, [["BlockRemoved", ["x"], None]]])):
        with pytest.raises(KVEventFormatError):
            decode_batch(bad)


def test_block_hashes_follow_the_documented_formula():
    """sha256(parent as 8 big-endian bytes + token ids as little-endian
    uint64), first 63 bits; a prompt's first parent is the namespace's seed."""
    from scheduler.engine.kv_events import chain_hashes

    def first63(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") & (2**63 - 1)

    seed = first63(b"mlx-blockmgr kv block\0" + b"'tenant'")
    h0 = first63(seed.to_bytes(8, "big") + struct.pack("<4Q", 1, 2, 3, 4))
    h1 = first63(h0.to_bytes(8, "big") + struct.pack("<4Q", 5, 6, 7, 8))
    assert chain_hashes("tenant", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]
    assert chain_hashes(None, [1, 2, 3, 4], 4) != [h0]


# ------------------------------------------------------------ cache version


@pytest.mark.parametrize("num_slots", [0, 5], ids=["attention", "hybrid"])
def test_an_unchanged_cache_version_means_every_hit_is_unchanged(num_slots):
    """The publisher skips a step when `cache_version` did not move: that is
    only right if no hit changed. Random calls on a small pool (evictions,
    dropped snapshots); the hits of many prefixes are compared around each."""
    from blockmgr import BlockManager, BlockManagerConfig
    from blockmgr.errors import OutOfBlocks, OutOfSlots

    rng = random.Random(5)
    bm = BlockManager(BlockManagerConfig(num_blocks=20, block_size=BLOCK_SIZE,
                                         num_slots=num_slots))
    stems = [[rng.randrange(9) for _ in range(10)] for _ in range(3)]
    probes: list[list[int]] = []
    live: dict[str, list[int]] = {}

    def hits(prompts):
        return [bm.cached_prefix_length(p[:n] + [99]) for p in prompts
                for n in range(1, len(p) + 1, 2)]

    num_unchanged = 0
    for step in range(250):
        probed = list(probes)
        version, before = bm.cache_version, hits(probed)
        choice = rng.random()
        try:
            if choice < 0.4 or not live:
                prompt = rng.choice(stems)[:rng.randrange(3, 11)] + [
                    rng.randrange(9) for _ in range(rng.randrange(1, 8))]
                bm.allocate(f"s{step}", prompt)
                live[f"s{step}"] = prompt
                probes.append(prompt)
            elif choice < 0.7:
                seq = rng.choice(sorted(live))
                bm.free(seq, rng.randrange(len(live.pop(seq)) + 1))
            elif choice < 0.85:
                seq = rng.choice(sorted(live))
                bm.cache_prefix(seq, rng.randrange(1, bm.num_tokens(seq) + 1))
            else:
                seq = rng.choice(sorted(live))
                bm.append(seq, [rng.randrange(9)])
        except (OutOfBlocks, OutOfSlots):
            pass
        bm.check_integrity()
        if bm.cache_version == version:
            num_unchanged += 1
            assert hits(probed) == before, f"step {step}: a hit changed, the version did not"
    assert bm.stats.num_evicted_nodes > 0 and num_unchanged > 20


# -------------------------------------------------------------- subscriber


class Subscriber:
    """A router's view of one server, read from raw msgpack as llm-d does."""

    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple, str | None]] = {}
        self.num_batches = 0

    def receive(self, payload: bytes) -> None:
        fields = msgpack.unpackb(payload)
        # [ts, events, data_parallel_rank]: Dynamo reads all three
        assert isinstance(fields, list) and len(fields) == 3 and fields[2] == 0
        ts, events = fields[0], fields[1]
        assert isinstance(ts, float) and events, "a batch is sent only when something changed"
        for event in events:
            self._apply(event)
        self.num_batches += 1

    def _apply(self, event: list) -> None:
        tag = event[0]
        if tag == "AllBlocksCleared":
            assert event == ["AllBlocksCleared"]
            self.blocks.clear()
        elif tag == "BlockRemoved":
            _, hashes, _medium = event
            removed = set(hashes)
            assert removed <= set(self.blocks), "removed a block that was never stored"
            for child, (parent, _, _) in self.blocks.items():
                assert child in removed or parent not in removed, "removed a block's parent only"
            for digest in hashes:
                del self.blocks[digest]
        else:
            assert tag == "BlockStored"
            _, hashes, parent, tokens, block_size, lora_id, _medium, lora_name = event
            assert block_size == BLOCK_SIZE and lora_id is None
            assert len(tokens) == block_size * len(hashes) and hashes
            assert parent is None or parent in self.blocks, "stored before its parent"
            for i, digest in enumerate(hashes):
                assert digest not in self.blocks, "stored twice"
                self.blocks[digest] = (parent, tuple(tokens[i * block_size:(i + 1) * block_size]),
                                       lora_name)
                parent = digest

    def prefixes(self) -> set[tuple[str | None, tuple]]:
        """(namespace, tokens up to the block's end) of every advertised block."""
        result = set()
        for digest, (_, _, lora_name) in self.blocks.items():
            runs = []
            while digest is not None:
                parent, tokens, _ = self.blocks[digest]
                runs.append(tokens)
                digest = parent
            result.add((lora_name, tuple(t for run in reversed(runs) for t in run)))
        return result


def servable_prefixes(store, sequences) -> set[tuple[str | None, tuple]]:
    """From the store's own answers: the full-block prefixes a hit uses, for
    every prefix of every sequence run (each cached prefix is one of them).
    A token past the prefix stands for the rest of a prompt."""
    result = set()
    for namespace, tokens in sequences:
        for length in range(BLOCK_SIZE, len(tokens) + 1):
            hit = store.cached_prefix_length(list(tokens[:length]) + [0], namespace)
            assert hit <= length
            for end in range(BLOCK_SIZE, hit + 1, BLOCK_SIZE):
                result.add((namespace, tuple(tokens[:end])))
    return result


class RecordingSink:
    def __init__(self):
        self.payloads: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.payloads.append(payload)

    def close(self) -> None:
        pass


def workload(vocab: int, seed: int = 0) -> list[tuple[str | None, list[int]]]:
    """Prompts sharing system prompts (two namespaces), some sharing more."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(n)] for n in (13, 9)]
    prompts = []
    for i in range(14):
        namespace = "tenant-b" if i % 4 == 3 else None
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        prompts.append((namespace, systems[i % 2] + tail))
    prompts.append(prompts[2])  # a repeat: a hit on a whole cached prompt
    return prompts


def run_and_check(engine: Engine, prompts, after_step) -> list[list[int]]:
    """Run the prompts (greedy), calling `after_step(sequences)` after every
    step and abort with every (namespace, tokens so far) of each request."""
    tokens: dict = {}
    namespaces: dict = {}

    def track(rid):
        def callback(out):
            for new in out.new_tokens.values():
                tokens[rid].extend(new)
        return callback

    params = SamplingParams(max_tokens=6, temperature=0.0)
    for i, (namespace, prompt) in enumerate(prompts):
        rid = f"r{i}"
        tokens[rid], namespaces[rid] = list(prompt), namespace
        engine.add_request(prompt, params, request_id=rid, namespace=namespace,
                           callback=track(rid))

    def sequences():
        return [(namespaces[rid], toks) for rid, toks in tokens.items()]

    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
        if num_steps == 3:
            engine.abort("r1")  # mid-run: its computed tokens enter the cache
        after_step(sequences())
    engine.check_integrity()
    return [tokens[f"r{i}"][len(p):] for i, (_, p) in enumerate(prompts)]


#: Attention; hybrid (recurrent + full attention); a sliding window with a
#: full layer (two groups); recurrent + sliding attention (hits need both a
#: snapshot and the window's pages).
MODELS = [("llama", 101), ("lfm2", 61), ("sliding", 101), ("recurrent_gemma", 61)]


@pytest.mark.parametrize("name,vocab", MODELS, ids=[m[0] for m in MODELS])
def test_the_rebuilt_view_is_what_the_store_serves_after_every_step(name, vocab):
    sink = RecordingSink()
    engine = Engine(built(name), num_blocks=28, block_size=BLOCK_SIZE, kv_events=sink,
                    max_num_seqs=4)
    store = engine.cache.store
    subscriber = Subscriber()
    checked, namespaces = [], set()

    def after_step(sequences):
        while subscriber.num_batches < len(sink.payloads):
            subscriber.receive(sink.payloads[subscriber.num_batches])
        expected = servable_prefixes(store, sequences)
        assert subscriber.prefixes() == expected
        checked.append(len(expected))
        namespaces.update(ns for ns, _ in expected)

    run_and_check(engine, workload(vocab), after_step)
    assert store.stats.num_evicted_nodes > 0, "the pool was meant to evict"
    assert max(checked) > 5 and engine.kv_events.num_errors == 0
    assert namespaces == {None, "tenant-b"}  # a namespace is its blocks' adapter name
    engine.cache.reset_prefix_cache()
    engine.kv_events.publish()
    subscriber.receive(sink.payloads[-1])
    assert msgpack.unpackb(sink.payloads[-1])[1] == [["AllBlocksCleared"]]
    assert subscriber.prefixes() == set()


@pytest.mark.parametrize("name, kv_format", [("llama", (8, 4)), ("sliding", (4, 4)),
                                             ("lfm2", (8, 8))])
def test_quantized_pages_are_advertised_as_what_they_serve(name, kv_format):
    """The events do not depend on the page format (a quantized page holds
    the same tokens, vLLM's BlockStored has no field for it; the format is
    in /metrics' cache_config_info): after every step, the view rebuilt
    from them is what the quantized store serves, in blocks of its size."""
    from cache import KVFormat
    from tests.quant_models import VOCAB
    from tests.quant_models import built as built_quantizable

    sink, subscriber = RecordingSink(), Subscriber()
    engine = Engine(built_quantizable(name), num_blocks=28, block_size=BLOCK_SIZE,
                    kv_events=sink, max_num_seqs=4, kv_format=KVFormat(*kv_format, 32))
    store, checked = engine.cache.store, []

    def after_step(sequences):
        while subscriber.num_batches < len(sink.payloads):
            subscriber.receive(sink.payloads[subscriber.num_batches])  # block size checked
        expected = servable_prefixes(store, sequences)
        assert subscriber.prefixes() == expected
        checked.append(len(expected))

    run_and_check(engine, workload(VOCAB), after_step)
    assert engine.cache.kv_format.quantized and store.stats.num_evicted_nodes > 0
    assert max(checked) > 5 and engine.kv_events.num_errors == 0


class FlakySink(RecordingSink):
    """Loses every third batch after accepting it and raises on the next
    send, as `ZmqSink` does when its thread fails; and refuses every
    fifth (a full queue)."""

    def __init__(self):
        super().__init__()
        self.num_calls = 0
        self.lost = False

    def send(self, payload: bytes) -> None:
        self.num_calls += 1
        if self.lost:
            self.lost = False
            raise OSError("an earlier batch was lost")
        if self.num_calls % 5 == 0:
            raise OSError("queue full")
        if self.num_calls % 3 == 2:
            self.lost = True
            return
        super().send(payload)


@pytest.mark.parametrize("fault", ["sink", "encoder"])
def test_a_failing_sink_or_encoder_changes_no_output_and_the_view_recovers(fault, monkeypatch):
    prompts = workload(101, seed=1)
    reference = run_and_check(Engine(built("llama"), num_blocks=28, block_size=BLOCK_SIZE,
                                     max_num_seqs=4), prompts, lambda _: None)
    if fault == "sink":
        sink = FlakySink()
    else:
        sink = RecordingSink()
        import scheduler.engine.kv_events as kv_events

        real, calls = kv_events.encode_batch, []

        def failing_encode(batch):
            calls.append(batch)
            if len(calls) in (2, 3, 7):
                raise ValueError("encoder fault")
            return real(batch)

        monkeypatch.setattr(kv_events, "encode_batch", failing_encode)
    engine = Engine(built("llama"), num_blocks=28, block_size=BLOCK_SIZE, kv_events=sink,
                    max_num_seqs=4)
    seen = []
    outputs = run_and_check(engine, prompts, seen.append)
    assert outputs == reference
    publisher = engine.kv_events
    assert publisher.num_errors >= 2
    num_errors = None
    while num_errors != publisher.num_errors:  # a resend after the last fault
        num_errors = publisher.num_errors
        publisher.publish()
    subscriber = Subscriber()
    for payload in sink.payloads:
        subscriber.receive(payload)
    assert subscriber.prefixes() == servable_prefixes(engine.cache.store, seen[-1])


# ------------------------------------------------------------------ socket


def test_a_zmq_subscriber_and_the_replay_socket_see_every_batch():
    zmq = pytest.importorskip("zmq", reason="the ZMQ test needs pyzmq (events extra)")
    from scheduler.engine.kv_events import ZmqSink

    sink = ZmqSink("tcp://127.0.0.1:*", topic="kv@pod-0@tiny",
                   replay_endpoint="tcp://127.0.0.1:*")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(sink.last_endpoint)
    try:
        engine = Engine(built("lfm2"), num_blocks=28, block_size=BLOCK_SIZE, kv_events=sink,
                        max_num_seqs=4)
        seen = []
        run_and_check(engine, workload(61, seed=2), seen.append)
        wait_sent(sink, engine.kv_events)
        live = {}
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@pod-0@tiny"
            live[int.from_bytes(seq, "big")] = payload
        replayed = replay_all(sink, zmq)
    finally:
        sink.close()
        sub.close(linger=0)
    assert len(replayed) == engine.kv_events.num_batches > 3
    # PUB drops what was sent before the subscription landed: the rest is identical.
    assert live and all(replayed[seq] == payload for seq, payload in live.items())
    subscriber = Subscriber()
    for payload in replayed:
        subscriber.receive(payload)
    assert subscriber.prefixes() == servable_prefixes(engine.cache.store, seen[-1])


def wait_sent(sink, publisher, timeout: float = 10.0) -> None:
    """Until the sink's thread has sent every batch the publisher made."""
    deadline = time.monotonic() + timeout
    while sink.num_sent < publisher.num_batches:
        assert time.monotonic() < deadline, "the sink did not send its queue"
        time.sleep(0.01)


def replay_all(sink, zmq) -> list[bytes]:
    """Every batch the sink sent, read back through its replay socket."""
    from scheduler.engine.kv_events import END_OF_REPLAY

    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(sink.replay_last_endpoint)
    try:
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = []
        while True:
            assert replay.poll(5000), "the replay socket did not answer"
            _, seq, payload = replay.recv_multipart()
            if seq == END_OF_REPLAY:
                return payloads
            assert int.from_bytes(seq, "big") == len(payloads)
            payloads.append(payload)
    finally:
        replay.close(linger=0)


def test_the_server_advertises_exactly_what_it_serves(tmp_path):
    """`blockmgr serve`'s app with KV events: after chat requests sharing a
    system prompt, the replayed events rebuild the store's servable blocks,
    and the server reports each advertised chain as a cache hit."""
    zmq = pytest.importorskip("zmq", reason="the ZMQ test needs pyzmq (events extra)")
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from scheduler.serving.async_engine import AsyncEngine
    from scheduler.serving.serve import load_engine, open_kv_events, serve_config
    from scheduler.serving.server import build_app
    from tests.scheduler.serving.test_server import ServerThread
    from tests.serve_model import build_model_dir

    sink = open_kv_events("tcp://127.0.0.1:*", "kv@pod@tiny", "tcp://127.0.0.1:*")
    engine, name = load_engine(build_model_dir(tmp_path / "tiny"),
                               serve_config(num_blocks=256, block_size=BLOCK_SIZE), kv_events=sink)
    with ServerThread(build_app(AsyncEngine(engine), name)) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                          timeout=60) as client:
        system = {"role": "system", "content": "You are a terse assistant. Answer in a word."}
        for question in ("Hi there", "Why is the sky blue?", "Name a color"):
            client.chat.completions.create(
                model=name, messages=[system, {"role": "user", "content": question}],
                max_tokens=4, temperature=0)
        wait_sent(sink, engine.kv_events)
        subscriber = Subscriber()
        for payload in replay_all(sink, zmq):
            subscriber.receive(payload)
        store = engine.cache.store
        advertised = subscriber.prefixes()
        assert advertised == servable_prefixes(store, store.cached_paths())
        longest = [chain for ns, chain in advertised
                   if not any(len(other) > len(chain) and other[:len(chain)] == chain
                              for _, other in advertised)]
        assert len(longest) >= 3  # one per conversation, sharing the system prompt
        for chain in longest:
            answer = client.completions.create(model=name, prompt=list(chain) + [1],
                                               max_tokens=1, temperature=0)
            assert answer.usage.prompt_tokens_details.cached_tokens == len(chain)


def test_blockmgr_serve_publishes_with_the_kv_events_options(tmp_path):
    """The CLI as a process: --kv-events binds its PUB socket on loopback
    (--kv-events-bind), a subscriber connects and gets live batches (the
    test fails if none arrives), --kv-events-replay serves them all; a
    token-id prompt's full blocks are advertised under the topic; a bad
    endpoint is one line."""
    zmq = pytest.importorskip("zmq", reason="the ZMQ test needs pyzmq (events extra)")
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from tests.ports import free_port
    from tests.scheduler.serving.test_server_cli import _serve, _wait_up
    from tests.serve_model import build_model_dir

    bad = _serve("--model", ".", "--kv-events", "tcp://nowhere")
    _, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and err.strip().startswith("blockmgr serve: error: cannot open KV")

    port, events_port, replay_port = free_port(), free_port(), free_port()
    proc = _serve("--model", str(build_model_dir(tmp_path / "tiny")), "--port", str(port),
                  "--num-blocks", "64", "--block-size", str(BLOCK_SIZE),
                  "--kv-events", f"tcp://127.0.0.1:{events_port}", "--kv-events-bind",
                  "--kv-events-topic", "kv@pod-1@tiny",
                  "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        _wait_up(proc, f"http://127.0.0.1:{port}")
        sub.connect(f"tcp://127.0.0.1:{events_port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        prompts = [[3 + k] + list(range(4, 17)) for k in range(20)]  # 14 ids: 3 full blocks
        live = []
        for prompt in prompts:  # until the subscription has reached the publisher
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                      temperature=0, extra_body={"ignore_eos": True})
            while sub.poll(300):
                live.append(sub.recv_multipart())
            if live:
                break
        assert live, "no KV event reached the subscriber"
        replay = zmq.Context.instance().socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        try:
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            payloads = []
            while replay.poll(5000):
                _, seq, payload = replay.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                payloads.append(payload)
        finally:
            replay.close(linger=0)
    finally:
        sub.close(linger=0)
        proc.kill()
        proc.wait(timeout=10)
    assert all(topic == b"kv@pod-1@tiny" for topic, _, _ in live)
    for _, seq, payload in live:  # each live batch is the replayed one of its number
        assert payloads[int.from_bytes(seq, "big")] == payload
    subscriber = Subscriber()
    for payload in payloads:
        subscriber.receive(payload)
    sent = prompts[:len(payloads)]
    assert {(None, tuple(sent[0][:n])) for n in (4, 8, 12)} <= subscriber.prefixes()


def test_a_sink_binds_loopback_or_an_interface_and_connects_by_vllms_rule():
    """bind=True binds any host: loopback or an interface name (not every
    interface); vLLM's rule connects to a named host and binds a wildcard."""
    zmq = pytest.importorskip("zmq", reason="the ZMQ test needs pyzmq (events extra)")
    from scheduler.engine.kv_events import ZmqSink, exposes_beyond_machine
    from scheduler.serving.serve import kv_events_warning

    for endpoint in ("tcp://127.0.0.1:*", "tcp://lo:*"):
        sink = ZmqSink(endpoint, bind=True)
        try:
            assert sink.last_endpoint.startswith("tcp://127.0.0.1:")
            assert not exposes_beyond_machine(sink.last_endpoint)
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(sink.last_endpoint)
            got = None
            for k in range(50):  # until the subscription has landed
                sink.send(b"payload %d" % k)
                if sub.poll(100):
                    got = sub.recv_multipart()
                    break
            sub.close(linger=0)
            assert got is not None and got[2].startswith(b"payload")
        finally:
            sink.close()
    sub = zmq.Context.instance().socket(zmq.SUB)  # vLLM's rule: a named host connects
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sink = ZmqSink(f"tcp://127.0.0.1:{port}")
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        got = None
        for k in range(50):
            sink.send(b"x")
            if sub.poll(100):
                got = sub.recv_multipart()
                break
        assert got is not None
    finally:
        sink.close()
        sub.close(linger=0)
    assert exposes_beyond_machine("tcp://*:5557") and exposes_beyond_machine("tcp://0.0.0.0:1")
    assert "every network interface" in kv_events_warning("tcp://*:5557", None, None)
    assert "tcp://*:5558" in kv_events_warning("tcp://127.0.0.1:5557", "tcp://*:5558", True)
    assert kv_events_warning("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", True) is None
    assert kv_events_warning("tcp://0.0.0.0:5557", None, None) is None  # vLLM's rule connects


@pytest.mark.parametrize("argv, endpoint, bind", [
    (["--kv-events"], "tcp://127.0.0.1:5557", True),  # alone: this machine only
    (["--kv-events", "tcp://*:5557"], "tcp://*:5557", None),  # vLLM's rule: binds, warned
    (["--kv-events", "tcp://router:5557"], "tcp://router:5557", None),  # connects
    (["--kv-events", "tcp://eth0:5557", "--kv-events-bind"], "tcp://eth0:5557", True),
    ([], None, None),
])
def test_the_kv_events_options_name_the_endpoint_and_how_to_open_it(argv, endpoint, bind):
    from scheduler.cli import build_parser
    from scheduler.serving.serve import kv_events_endpoint

    args = build_parser().parse_args(["serve", "--model", "m", *argv])
    assert kv_events_endpoint(args.kv_events, args.kv_events_bind) == (endpoint, bind)


# ------------------------------------------------------------- stateful

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from blockmgr import GroupedStore, GroupedStoreConfig  # noqa: E402
from blockmgr.errors import BlockManagerError, DuplicateSequence  # noqa: E402
from scheduler.engine.kv_events import KVEventPublisher  # noqa: E402

#: Small alphabet and lengths: prompts share prefixes often.
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class PublisherMachine(RuleBasedStateMachine):
    """Random store calls (allocate, append, cache_prefix, free, reset), a
    sink that fails when told, and refused calls; after each, one publish.
    Whenever the last publish went out, the subscriber's view equals the
    store's servable prefixes; a refused call changes neither."""

    windows: tuple = (None,)
    num_slots = 0

    def __init__(self):
        super().__init__()
        self.store = GroupedStore(GroupedStoreConfig(
            num_blocks=14, block_size=BLOCK_SIZE, windows=self.windows,
            num_slots=self.num_slots))
        self.sink = SwitchSink()
        self.publisher = KVEventPublisher(self.store, self.sink)
        self.subscriber = Subscriber()
        self.sequences: list[tuple[str | None, list[int]]] = []
        self.live: dict[int, list[int]] = {}
        self.next_id = 0

    def _call(self, method, *args) -> bool:
        try:
            method(*args)
        except BlockManagerError:
            return False
        return True

    @rule(prompt=PROMPTS, namespace=st.sampled_from([None, "t"]))
    def allocate(self, prompt, namespace):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if self._call(self.store.allocate, seq_id, prompt, namespace):
            tokens = list(prompt)
            self.live[seq_id] = tokens
            self.sequences.append((namespace, tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        if self._call(self.store.append, seq_id, [token]):
            self.live[seq_id].append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_prefix(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        num = data.draw(st.integers(1, len(self.live[seq_id])))
        self._call(self.store.cache_prefix, seq_id, num)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        num = data.draw(st.integers(0, len(self.live[seq_id])))
        self.store.free(seq_id, num)
        del self.live[seq_id]

    @rule()
    def reset(self):
        self.store.reset_prefix_cache()

    @rule()
    def fail_next_send(self):
        self.sink.fail_next = True

    @rule()
    def lose_next_send(self):
        self.sink.lose_next = True

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def refused_call(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.publish()
        before = (self.store.debug_state(), len(self.sink.payloads))
        with pytest.raises(DuplicateSequence):
            self.store.allocate(seq_id, [1, 2])
        assert self.publisher.publish() is None
        assert (self.store.debug_state(), len(self.sink.payloads)) == before

    def publish(self) -> bool:
        """Publish and deliver; whether the subscriber is up to date (the
        publish went out and no earlier batch is lost)."""
        num_errors = self.publisher.num_errors
        self.publisher.publish()
        for payload in self.sink.payloads[self.subscriber.num_batches:]:
            self.subscriber.receive(payload)
        return self.publisher.num_errors == num_errors and not self.sink.lost

    @invariant()
    def the_view_is_what_the_store_serves(self):
        self.store.check_integrity()
        if self.publish():
            assert self.subscriber.prefixes() == servable_prefixes(self.store, self.sequences)


class SwitchSink(RecordingSink):
    """Refuses the next send when told to (`fail_next`), or accepts and
    loses it and raises on the one after (`lose_next`, as `ZmqSink` does
    when its thread fails)."""

    def __init__(self):
        super().__init__()
        self.fail_next = self.lose_next = self.lost = False

    def send(self, payload: bytes) -> None:
        if self.fail_next or self.lost:
            self.fail_next = self.lost = False
            raise OSError("socket down")
        if self.lose_next:
            self.lose_next, self.lost = False, True
            return
        super().send(payload)


class HybridPublisherMachine(PublisherMachine):
    num_slots = 4


class SlidingPublisherMachine(PublisherMachine):
    windows = (None, 6)


class HybridSlidingPublisherMachine(PublisherMachine):
    windows = (6,)
    num_slots = 4


def _publisher_case(machine):
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


TestPublisher = _publisher_case(PublisherMachine)
TestHybridPublisher = _publisher_case(HybridPublisherMachine)
TestSlidingPublisher = _publisher_case(SlidingPublisherMachine)
TestHybridSlidingPublisher = _publisher_case(HybridSlidingPublisherMachine)
