"""The engine's KV events as the gateway's `SubscribeKvEvents` stream.

The Shepherd Model Gateway (SMG) reads a gRPC worker's KV events from its
`SubscribeKvEvents` RPC: a stream of `smg.grpc.common.KvEventBatch`
messages, numbered, each carrying `KvBlocksStored` / `KvBlocksRemoved` /
`KvCacheCleared` events. `KvEventRelay` is an `EventSink` for the engine's
`KVEventPublisher` (design/kv_events.md): each payload it is sent (one
engine step's changes, vLLM's msgpack) is decoded, numbered from 1, kept
in a bounded history and handed to every live subscription, and applied to
the relay's own copy of what is advertised. A subscription starting from
a number still in the history replays from there; any other (0, the
gateway's "from the current state", or one older than the history) first
gets that copy as one snapshot batch (`KvCacheCleared`, then every block,
parents first) numbered as the last batch sent, so no batch is missed and
none is applied twice. Field mapping: a `BlockStored` run is one
`KvBlocksStored` (its blocks, its parent, its namespace as `lora_name`,
its medium and the tier it names); the group fields are left unset (the
events carry the intersection of every group already, design/fleet.md).

`send` runs on the engine thread and never blocks on a subscriber: it
decodes (O(payload)), then queues the message on each subscriber's event
loop. A subscriber whose queue passes `max_pending` batches is ended (the
gateway reconnects from its last number and is replayed). `attach(engine,
relay)` makes the engine publish to the relay, beside a `--kv-events`
socket if it has one.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from smg_grpc_proto.generated import common_pb2

from scheduler.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
)

#: Batches kept for replay (vLLM's publisher keeps 10 000 steps too).
HISTORY = 10_000
#: Tiers of the engine's media (design/kv_events.md, "medium").
_TIERS = {"GPU": common_pb2.KV_CACHE_TIER_DEVICE, "CPU": common_pb2.KV_CACHE_TIER_HOST,
          "DISK": common_pb2.KV_CACHE_TIER_DISK}


@dataclass(slots=True)
class _Block:
    """One advertised block in the relay's copy."""

    parent: int | None
    tokens: tuple[int, ...]
    medium: str | None
    lora_name: str | None
    depth: int  # blocks before it in its prompt: a snapshot sends parents first


class _Subscriber:
    """One live stream: batches queued on its own event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.max_pending = max_pending
        self.pending = 0  # queued, not yet taken (under the relay's lock)
        self.ended = False

    def push(self, item: Any) -> None:
        """Queue `item` (a batch, or None: the end); under the relay's lock."""
        if self.ended:
            return
        self.pending += 1
        if item is None or self.pending > self.max_pending:
            self.ended = True
            item = None
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its loop is closed: the stream is gone
            self.ended = True


class KvEventRelay:
    """An `EventSink` serving the batches it is sent as `KvEventBatch`
    streams (see the module doc). `history`: batches kept for replay;
    `max_pending`: batches a subscriber may have queued before it is ended."""

    def __init__(self, *, history: int = HISTORY, max_pending: int = HISTORY) -> None:
        self._lock = threading.Lock()
        self._history: deque[Any] = deque(maxlen=history)
        self._blocks: dict[int, _Block] = {}
        self._subscribers: set[_Subscriber] = set()
        self._max_pending = max_pending
        self.last_sequence = 0  # the number of the last batch sent (0: none yet)
        self.closed = False

    # ------------------------------------------------------------ the sink

    def send(self, payload: bytes) -> None:
        """Take one published batch (the engine thread). A payload that does
        not decode raises `KVEventFormatError`: the publisher then resends
        its whole state."""
        batch = decode_batch(payload)
        with self._lock:
            self.last_sequence += 1
            message = common_pb2.KvEventBatch(
                sequence_number=self.last_sequence, timestamp=batch.ts,
                events=[_proto_event(e) for e in batch.events])
            if batch.data_parallel_rank is not None:
                message.dp_rank = batch.data_parallel_rank
            for event in batch.events:
                self._apply(event)
            self._history.append(message)
            for subscriber in self._subscribers:
                subscriber.push(message)

    def close(self) -> None:
        """End every stream; later subscriptions end at once."""
        with self._lock:
            self.closed = True
            for subscriber in self._subscribers:
                subscriber.push(None)
            self._subscribers.clear()

    # ------------------------------------------------------- subscriptions

    async def subscribe(self, start: int) -> AsyncIterator[Any]:
        """The batches from `start` on (see the module doc), then each new
        one as it is sent, until the relay closes, the subscriber falls
        `max_pending` batches behind, or the caller stops iterating."""
        subscriber = _Subscriber(asyncio.get_running_loop(), self._max_pending)
        with self._lock:
            first = self._history[0].sequence_number if self._history else None
            if 0 < start and first is not None and first <= start <= self.last_sequence:
                backlog = [m for m in self._history if m.sequence_number >= start]
            else:
                backlog = [self._snapshot()]
            closed = self.closed
            if not closed:
                self._subscribers.add(subscriber)
        try:
            for message in backlog:
                yield message
            while not closed:
                message = await subscriber.queue.get()
                with self._lock:
                    subscriber.pending -= 1
                if message is None:
                    return
                yield message
        finally:
            with self._lock:
                self._subscribers.discard(subscriber)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # ------------------------------------------------------------- helpers

    def _apply(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._blocks.clear()
        elif isinstance(event, BlockRemoved):
            for digest in event.block_hashes:
                self._blocks.pop(digest, None)
        else:
            parent, size = event.parent_block_hash, event.block_size
            depth = 0 if parent is None or parent not in self._blocks \
                else self._blocks[parent].depth + 1
            for i, digest in enumerate(event.block_hashes):
                self._blocks[digest] = _Block(parent, event.token_ids[i * size:(i + 1) * size],
                                              event.medium, event.lora_name, depth + i)
                parent = digest

    def _snapshot(self) -> Any:
        """The relay's copy as one batch numbered `last_sequence`: a clear,
        then one stored event per block, parents first. O(blocks log blocks)."""
        events = [common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())]
        for digest, block in sorted(self._blocks.items(), key=lambda item: item[1].depth):
            stored = BlockStored((digest,), block.parent, block.tokens, len(block.tokens),
                                 medium=block.medium, lora_name=block.lora_name)
            events.append(_proto_event(stored))
        return common_pb2.KvEventBatch(
            sequence_number=self.last_sequence, events=events,
            snapshot=common_pb2.KvSnapshotChunk(index=0, count=1, blocks=len(self._blocks)))


def _proto_event(event: KVEvent) -> Any:
    """One engine event as the gateway's `KvCacheEvent`."""
    if isinstance(event, AllBlocksCleared):
        return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())
    if isinstance(event, BlockRemoved):
        removed = common_pb2.KvBlocksRemoved(block_hashes=event.block_hashes)
        if event.medium is not None:
            removed.medium = event.medium
            removed.tier = _TIERS.get(event.medium, common_pb2.KV_CACHE_TIER_UNSPECIFIED)
        return common_pb2.KvCacheEvent(removed=removed)
    size = event.block_size
    stored = common_pb2.KvBlocksStored(blocks=[
        common_pb2.KvBlock(block_hash=digest, token_ids=event.token_ids[i * size:(i + 1) * size],
                           block_size=size)
        for i, digest in enumerate(event.block_hashes)])
    if event.parent_block_hash is not None:
        stored.parent_block_hash = event.parent_block_hash
    if event.medium is not None:
        stored.medium = event.medium
        stored.tier = _TIERS.get(event.medium, common_pb2.KV_CACHE_TIER_UNSPECIFIED)
    if event.lora_name is not None:
        stored.lora_name = event.lora_name
    return common_pb2.KvCacheEvent(stored=stored)


def attach(engine: Any, relay: KvEventRelay) -> None:
    """Make `engine` publish its KV events to `relay` too (its own
    publisher's sink and the relay, `KVEventPublisher.add_sink`), or only
    to it when it publishes none. Call it before the engine's thread runs:
    it publishes the current state at once (`Engine.add_kv_event_sink`)."""
    engine.add_kv_event_sink(relay)
