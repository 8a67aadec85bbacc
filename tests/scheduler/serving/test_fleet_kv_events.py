"""The project's KV events read by the Shepherd Model Gateway's own event path.

SMG's event-driven cache-aware routing reads a worker's `SubscribeKvEvents`
gRPC stream; for a vLLM worker that stream is served by SMG's Rust servicer
(`smg.servicer.VllmGrpcServer`, the `fleet` extra), which subscribes to the
engine's vLLM-format ZMQ publisher (and its replay socket), decodes each
batch with its own wire decoder, drops what it cannot index (unknown
mediums, non-main attention groups, unaligned blocks, self-referencing
hashes) and relays the rest. Here that servicer subscribes to an engine's
`ZmqSink` (no vLLM engine behind it: only its event relay runs), and a gRPC
subscriber rebuilds the router's view from the relayed `KvEventBatch`es:
after a run (evictions, two namespaces, an abort) it must equal what the
store can serve (`servable_prefixes`, from `cached_prefix_length`), for an
attention, a hybrid and a sliding-window model. The gateway itself routes
only workers that serve generation over gRPC too (design/fleet.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("zmq", reason="the KV-event relay test needs pyzmq (events extra)")
servicer = pytest.importorskip("smg.servicer", reason="needs smg (pip install '.[fleet]')")
grpc = pytest.importorskip("grpc", reason="needs grpcio (installed with smg)")
proto = pytest.importorskip("smg_grpc_proto.generated.vllm_engine_pb2_grpc",
                            reason="needs smg-grpc-proto (the gateway's gRPC stubs)")

from smg_grpc_proto.generated import common_pb2  # noqa: E402

from blockmgr.errors import InvalidArgument  # noqa: E402
from scheduler import Engine  # noqa: E402
from scheduler.engine.kv_events import KVEventBatch, ZmqSink, encode_batch  # noqa: E402
from tests.fleet import EventView  # noqa: E402
from tests.polling import wait_for  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.scheduler.serving.test_kv_events import (  # noqa: E402
    BLOCK_SIZE,
    run_and_check,
    servable_prefixes,
    workload,
)
from tests.tiny_models import built  # noqa: E402


def _subscribe(address: str, view: EventView, stop: threading.Event,
               restarts: list[str] | None = None) -> None:
    """Apply the relay's batches to `view` from sequence zero until `stop`. A
    `DATA_LOSS` end (a publisher restart) is an error, or with `restarts` what
    SMG's gateway does with it: note it, clear the view, subscribe from zero."""
    with grpc.insecure_channel(address) as channel:
        stub = proto.VllmEngineStub(channel)
        while not stop.is_set():
            stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
                start_sequence_number=0))
            try:
                for batch in stream:
                    view.apply(batch)
                    if stop.is_set():
                        return
            except grpc.RpcError as error:
                if stop.is_set():
                    return
                if restarts is None or error.code() != grpc.StatusCode.DATA_LOSS:
                    view.error = error
                    return
                restarts.append(error.details())
                view.clear()
            except Exception as error:  # noqa: BLE001 - reported by the test thread
                view.error = error
                return
            finally:
                stream.cancel()


def _attach_relay(sink: ZmqSink, address: str, tmp_path, reader: threading.Thread,
                  view: EventView) -> Any:
    """Publish an empty batch 0 on `sink`, start SMG's relay of its publisher
    (and replay socket) at `address`, start `reader` on the relay; return the
    relay once `view` holds batch 0.

    As in a deployment, the engine has published before the gateway's relay
    attaches, and the relay is in step with it before the workload starts. A
    relay starting while batches flow can take a live batch 0 or 1 that
    arrives after its start replay went past it for a publisher restart
    (SMG's gateway then clears and resubscribes)."""
    sink.send(encode_batch(KVEventBatch(time.time(), (), 0)))
    wait_for(lambda: sink.num_sent == 1, "batch 0 was not sent")
    relay = servicer.VllmGrpcServer(
        address, f"ipc://{tmp_path}/engine", f"tcp://127.0.0.1:{free_port()}",
        "blockmgr-test", block_size=BLOCK_SIZE, kv_events_endpoint=sink.last_endpoint,
        kv_events_replay_endpoint=sink.replay_last_endpoint, kv_events_topic="")
    try:
        reader.start()
        wait_for(lambda: view.num_batches == 1, "the relay did not relay batch 0")
    except BaseException:
        relay.stop()
        raise
    return relay


@pytest.mark.parametrize("name,vocab", [("llama", 101), ("lfm2", 61), ("sliding", 101)])
def test_smgs_event_relay_rebuilds_what_the_store_serves(name, vocab, tmp_path):
    sink = ZmqSink("tcp://127.0.0.1:*", bind=True, replay_endpoint="tcp://127.0.0.1:*")
    view, stop = EventView(BLOCK_SIZE), threading.Event()
    address = f"127.0.0.1:{free_port()}"
    reader = threading.Thread(target=_subscribe, args=(address, view, stop), daemon=True)
    relay = None
    try:
        relay = _attach_relay(sink, address, tmp_path, reader, view)
        engine = Engine(built(name), num_blocks=28, block_size=BLOCK_SIZE, kv_events=sink,
                        max_num_seqs=4)
        seen: list = []
        run_and_check(engine, workload(vocab), seen.append)
        wait_for(lambda: sink.num_sent == 1 + engine.kv_events.num_batches,
                 "the sink did not send its queue")
        expected = {tokens for _, tokens in servable_prefixes(engine.cache.store, seen[-1])}
        deadline = time.monotonic() + 20
        while view.prefixes() != expected and view.error is None:
            assert time.monotonic() < deadline, (
                f"the relayed view never matched: {len(view.prefixes())} prefixes relayed in "
                f"{view.num_batches} batches, {len(expected)} servable")
            time.sleep(0.05)
    finally:
        stop.set()
        if relay is not None:
            relay.stop()
        sink.close()
        if reader.is_alive():
            reader.join(timeout=10)
    assert view.error is None, view.error
    assert engine.kv_events.num_errors == 0 and len(expected) > 5
    assert engine.cache.store.stats.num_evicted_nodes > 0, "the pool was meant to evict"


def _bound_again(endpoint: str, replay_endpoint: str) -> ZmqSink:
    """A sink bound to the addresses a closed one had. ZMQ closes a socket's
    listener in its I/O thread a moment after `close` returns, so the first
    tries may find them in use (a restarted process finds them free)."""
    sinks: list[ZmqSink] = []

    def bind() -> bool:
        try:
            sinks.append(ZmqSink(endpoint, bind=True, replay_endpoint=replay_endpoint))
        except InvalidArgument as error:
            if "Address already in use" not in str(error):
                raise
        return bool(sinks)

    wait_for(bind, f"{endpoint} and {replay_endpoint} free again", timeout=10)
    return sinks[0]


def test_smgs_relay_takes_a_restarted_engine_from_zero(tmp_path):
    """A replica restarted at the same address numbers its batches from zero
    again: SMG's relay reads the restart and ends the stream with DATA_LOSS,
    and a gateway that clears and subscribes from zero (as SMG's does) ends
    with what the new engine serves and nothing of the old one's."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = ZmqSink(endpoint, bind=True, replay_endpoint=replay_endpoint)
    second: ZmqSink | None = None
    view, stop, restarts = EventView(BLOCK_SIZE), threading.Event(), []
    address = f"127.0.0.1:{free_port()}"
    reader = threading.Thread(target=_subscribe, args=(address, view, stop, restarts),
                              daemon=True)
    relay = None
    try:
        relay = _attach_relay(first, address, tmp_path, reader, view)
        old = Engine(built("llama"), num_blocks=28, block_size=BLOCK_SIZE, kv_events=first,
                     max_num_seqs=4)
        seen: list = []
        run_and_check(old, workload(101), seen.append)
        old_prefixes = {tokens for _, tokens in servable_prefixes(old.cache.store, seen[-1])}
        wait_for(lambda: view.prefixes() == old_prefixes or view.error is not None,
                 "the relayed view never matched the first engine's", timeout=20)
        num_old_batches = first.num_sent
        old.close()  # the replica stops (its publisher and replay socket close) ...
        second = _bound_again(endpoint, replay_endpoint)  # ... and is back
        # The relay reads a restart from the new incarnation's batch 0 or 1: it
        # must have reconnected before them (a replica loading its model takes
        # seconds; back within milliseconds, SMG 1.13 takes the new batches for
        # duplicates of numbers it passed, design/fleet.md).
        time.sleep(1.0)
        new = Engine(built("llama"), num_blocks=28, block_size=BLOCK_SIZE, kv_events=second,
                     max_num_seqs=4)
        seen = []
        run_and_check(new, workload(101, seed=1)[:4], seen.append)
        expected = {tokens for _, tokens in servable_prefixes(new.cache.store, seen[-1])}
        wait_for(lambda: second.num_sent == new.kv_events.num_batches,
                 "the sink did not send its queue")
        # every number the new engine used is one the relay had passed: only the
        # relay's restart rule can tell its batches from stale ones
        assert second.num_sent < num_old_batches
        wait_for(lambda: (restarts and view.prefixes() == expected) or view.error is not None,
                 "the relayed view never matched the restarted engine's", timeout=20)
    finally:
        stop.set()
        if relay is not None:
            relay.stop()
        for sink in (first, second):
            if sink is not None:
                sink.close()
        if reader.is_alive():
            reader.join(timeout=10)
    assert view.error is None, view.error
    assert "restarted" in restarts[0], restarts
    assert len(expected) > 3 and not expected & old_prefixes
