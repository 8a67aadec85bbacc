"""KV events for cache-aware routers, in vLLM's wire format.

A router in front of several servers (llm-d's KV-cache manager, NVIDIA
Dynamo's KV router, anything that reads vLLM's KV events) keeps, per
server, the set of full blocks whose prefix that server can serve as a
prefix-cache hit. This module tells it, after every engine step, what
changed (see `design/kv_events.md`):

* `servable_blocks(store)`: the blocks a hit can really use right now. For
  every maximal cached prefix (`store.cached_paths()`), the hit a prompt
  following it gets (`store.cached_prefix_length`) says how far it is
  servable: up to the last snapshot for a hybrid model, up to the last
  point whose window pages are present for a sliding-window one; the full
  blocks before that point are advertised, chained by `block_hash`.
* `KVEventPublisher.publish()`: the difference from what was advertised
  before, as one `KVEventBatch` (`BlockRemoved`, then `BlockStored` runs,
  parents first; `AllBlocksCleared` when nothing is left), encoded by
  `encode_batch` and handed to a sink (`ZmqSink`: a ZMQ PUB socket, with
  vLLM's multipart [topic, 8-byte big-endian sequence number, payload] and
  its optional replay ROUTER socket).

Faults never reach serving: a failing store read, encoder or sink is
counted (`num_errors`, `last_error`) and the next `publish()` resends the
whole state after an `AllBlocksCleared`, so subscribers converge.

msgpack and pyzmq are optional (`pip install mlx-blockmgr[events]`); they
are imported when a publisher or a socket is made (a missing one raises
`MissingDependency` there, naming the extra).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import queue
import struct
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from blockmgr.errors import InvalidArgument
from blockmgr.trie_node import common_prefix_length

logger = logging.getLogger(__name__)

#: Hashes are kept below 2**63 so that decoders reading int64 or uint64 agree.
HASH_MASK = (1 << 63) - 1
#: The replay socket's end-of-replay sequence number (vLLM's: -1, signed).
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


# ------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks now servable: `block_hashes[i]` holds `token_ids[i*bs:(i+1)*bs]`;
    the first block's parent is `parent_block_hash` (None: it starts a prompt).
    `lora_name` is the blocks' namespace (`str(namespace)`, None for the default)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer servable (deepest first)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is servable any more: forget every block of this server."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one engine step; `ts` in seconds since the epoch."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


class KVEventFormatError(InvalidArgument):
    """A payload that is not a KV event batch of the published schema."""


class MissingDependency(InvalidArgument):
    """KV events were asked for but pyzmq or msgpack is not installed."""


def _optional(name: str) -> Any:
    """Import an optional dependency of KV events, or say how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingDependency(
            f"KV events need {name}: pip install 'mlx-blockmgr[events]'") from None


# ------------------------------------------------------------------ encoding


def _event_fields(event: KVEvent) -> list:
    """One event as vLLM's array-like tagged struct: [tag, fields...]."""
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash,
                list(event.token_ids), event.block_size, event.lora_id, event.medium,
                event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise InvalidArgument(f"not a KV event: {event!r:.80}")


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM's `KVEventBatch` encodes to (msgspec
    array-like structs: [ts, events] plus the data-parallel rank when set;
    each event [tag, fields in declaration order]). Pure; O(tokens)."""
    msgpack = _optional("msgpack")
    fields = [batch.ts, [_event_fields(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        fields.append(batch.data_parallel_rank)
    return msgpack.packb(fields)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read a payload of the published schema (vLLM's; trailing fields a newer
    vLLM adds, such as `extra_keys`, are accepted and dropped). Raises
    `KVEventFormatError` naming what is wrong. O(payload)."""
    msgpack = _optional("msgpack")
    try:
        fields = msgpack.unpackb(payload)
    except Exception as error:  # msgpack raises several unrelated types
        raise KVEventFormatError(f"payload is not msgpack: {error}") from None
    if not isinstance(fields, list) or len(fields) not in (2, 3):
        raise KVEventFormatError(f"a batch is [ts, events(, rank)], got {fields!r:.80}")
    ts, events = fields[0], fields[1]
    rank = fields[2] if len(fields) == 3 else None
    if not isinstance(ts, float) or not isinstance(events, list):
        raise KVEventFormatError(f"bad batch header {fields[:2]!r:.80}")
    return KVEventBatch(ts, tuple(_decode_event(e) for e in events), rank)


_EVENT_ARITY = {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}


def _decode_event(fields: Any) -> KVEvent:
    if not isinstance(fields, list) or not fields or fields[0] not in _EVENT_ARITY:
        raise KVEventFormatError(f"not a tagged KV event: {fields!r:.80}")
    tag = fields[0]
    if len(fields) < _EVENT_ARITY[tag]:
        raise KVEventFormatError(f"{tag} has {len(fields) - 1} fields: {fields!r:.80}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = fields[1]
    if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
        raise KVEventFormatError(f"{tag}.block_hashes must be ints, got {hashes!r:.80}")
    if tag == "BlockRemoved":
        return BlockRemoved(tuple(hashes), fields[2])
    _, _, parent, tokens, block_size, lora_id, medium, lora_name = fields[:8]
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * block_size:
        raise KVEventFormatError(
            f"BlockStored has {len(hashes)} blocks of {block_size} but "
            f"{len(tokens) if isinstance(tokens, list) else tokens!r} token ids")
    return BlockStored(tuple(hashes), parent, tuple(tokens), block_size, lora_id, medium,
                       lora_name)


# ------------------------------------------------------------ block hashes


def namespace_seed(namespace: Hashable) -> int:
    """The parent hash of a namespace's first block (its cache salt)."""
    digest = hashlib.sha256(b"mlx-blockmgr kv block\0" + repr(namespace).encode()).digest()
    return int.from_bytes(digest[:8], "big") & HASH_MASK


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The id of a block: the first 63 bits of sha256(parent as 8 big-endian
    bytes + the token ids as little-endian uint64). `parent` is the previous
    block's hash, or `namespace_seed` for a prompt's first block, so the id
    names the whole prefix and its namespace. Deterministic across
    processes and machines. O(block size)."""
    data = parent.to_bytes(8, "big") + struct.pack(f"<{len(tokens)}Q", *tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") & HASH_MASK


def chain_hashes(namespace: Hashable, tokens: Sequence[int], block_size: int) -> list[int]:
    """The hash of every full block of `tokens`, first block first."""
    hashes, parent = [], namespace_seed(namespace)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


# ------------------------------------------------------- what is servable


class ServableStore(Protocol):
    """What the publisher reads (`BlockManager`, `GroupedStore`, `PagedCache`)."""

    @property
    def block_size(self) -> int: ...

    @property
    def cache_version(self) -> int: ...

    def cached_paths(self) -> list[tuple[Hashable, list[int]]]: ...

    def cached_prefix_length(self, tokens: Sequence[int], namespace: Hashable = None) -> int: ...


class TieredServableStore(ServableStore, Protocol):
    """A store whose prefix cache has host and disk tiers: each cached path
    says where its tiers begin (`BlockManager.cached_tier_paths`)."""

    def cached_tier_paths(self) -> list[tuple[Hashable, list[int], list[tuple[int, int]]]]: ...


#: vLLM's `medium` of a block, by `blockmgr.Tier` (device, host, disk): the
#: offloading connector's "GPU" and "CPU" names, "DISK" for the disk tier.
TIER_MEDIA = ("GPU", "CPU", "DISK")


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One advertised block: its parent's hash (None: the first of a prompt),
    its tokens, namespace and index in the prompt."""

    parent: int | None
    tokens: tuple[int, ...]
    namespace: Hashable
    index: int


#: Blocks along one cached path: (hash, block), first block first.
PathBlocks = list[tuple[int, CachedBlock]]


def servable_blocks(store: ServableStore,
                    memo: dict[tuple[Hashable, bytes], PathBlocks] | None = None
                    ) -> dict[int, CachedBlock]:
    """Every full block a hit can use now, by hash: along each maximal cached
    prefix, the blocks before the hit a prompt following it gets (a token
    past its end stands for the prompt's rest; the hit never covers it).

    `memo` (kept by the caller between calls, rewritten here) maps each
    servable path to its blocks, so a path seen last time costs no hashing.
    A new path reuses the blocks of the prefix it shares with the previous
    path (the paths come in trie order). Pure but for `memo`. Cost:
    O(sum of the paths' lengths) at C speed (the paths, the hit queries,
    the memo keys), O(paths + blocks) dictionary work, one hash per new
    block.
    """
    block_size = store.block_size
    blocks: dict[int, CachedBlock] = {}
    old_memo = {} if memo is None else dict(memo)
    new_memo: dict[tuple[Hashable, bytes], PathBlocks] = {}
    previous: tuple[Hashable, list[int], PathBlocks] = (None, [], [])
    for namespace, tokens in store.cached_paths():
        num_blocks = store.cached_prefix_length(tokens + [0], namespace) // block_size
        key = (namespace, array("Q", tokens[:num_blocks * block_size]).tobytes())
        entries = old_memo.get(key)
        if entries is None:
            entries = _path_blocks(namespace, tokens, num_blocks, block_size, previous)
        new_memo[key] = entries
        blocks.update(entries)
        previous = (namespace, tokens, entries)
    if memo is not None:
        memo.clear()
        memo.update(new_memo)
    return blocks


def _path_blocks(namespace: Hashable, tokens: list[int], num_blocks: int, block_size: int,
                 previous: tuple[Hashable, list[int], PathBlocks]) -> PathBlocks:
    """The first `num_blocks` blocks of `tokens`, reusing those of the
    `previous` (namespace, tokens, blocks) up to where the two part."""
    last_namespace, last_tokens, last_entries = previous
    num_reused = 0
    if last_entries and last_namespace == namespace:
        num_shared = common_prefix_length(last_tokens, tokens, 0)
        num_reused = min(num_shared // block_size, len(last_entries), num_blocks)
    entries = last_entries[:num_reused]
    parent = entries[-1][0] if entries else None
    for index in range(num_reused, num_blocks):
        run = tuple(tokens[index * block_size:(index + 1) * block_size])
        digest = block_hash(namespace_seed(namespace) if parent is None else parent, run)
        entries.append((digest, CachedBlock(parent, run, namespace, index)))
        parent = digest
    return entries


def servable_media(store: TieredServableStore, memo: dict[tuple[Hashable, bytes], PathBlocks]
                   ) -> dict[int, str]:
    """The medium (`TIER_MEDIA`) of every servable block, by hash: the tier
    of the block's last token (a block a node boundary splits is as cold
    as its colder part: a hit on it loads). `memo` is what `servable_blocks`
    just filled for the same store state. O(sum of the paths' lengths)."""
    block_size = store.block_size
    media: dict[int, str] = {}
    for namespace, tokens, runs in store.cached_tier_paths():
        num_blocks = store.cached_prefix_length(tokens + [0], namespace) // block_size
        key = (namespace, array("Q", tokens[:num_blocks * block_size]).tobytes())
        run = 0
        for index, (digest, _) in enumerate(memo.get(key, ())):
            last = (index + 1) * block_size - 1
            while run + 1 < len(runs) and runs[run + 1][0] <= last:
                run += 1
            media[digest] = TIER_MEDIA[runs[run][1]]
    return media


def tiered_diff_events(before: dict[int, CachedBlock], before_media: dict[int, str],
                       after: dict[int, CachedBlock], after_media: dict[int, str],
                       block_size: int) -> list[KVEvent]:
    """`diff_events` with each block's medium: a block that changed tier is
    removed from its old medium and stored in its new one; removals come
    first (deepest first, per medium), then stores, warmest medium first
    (a block's parent is never colder than it: parents come first).
    O(blocks + changed log changed)."""
    if before and not after:
        return [AllBlocksCleared()]
    events: list[KVEvent] = []
    moved = {d for d in after if d in before and before_media.get(d) != after_media.get(d)}
    removed = [d for d in before if d not in after or d in moved]
    for medium in TIER_MEDIA:
        gone = sorted((d for d in removed if before_media.get(d) == medium),
                      key=lambda d: -before[d].index)
        if gone:
            events.append(BlockRemoved(tuple(gone), medium))
    added = [d for d in after if d not in before or d in moved]
    for medium in TIER_MEDIA:
        events += stored_events([d for d in added if after_media.get(d) == medium], after,
                                block_size, medium)
    return events


def stored_events(added: Sequence[int], blocks: dict[int, CachedBlock], block_size: int,
                  medium: str | None = None) -> list[BlockStored]:
    """`BlockStored` events for the blocks `added` (hashes into `blocks`),
    chained runs, each run's parent advertised before it (already, or by an
    earlier run). O(added log added)."""
    added_set = set(added)
    children: dict[int, list[int]] = {}
    roots = []
    for digest in sorted(added, key=lambda d: blocks[d].index):
        parent = blocks[digest].parent
        if parent in added_set:
            children.setdefault(parent, []).append(digest)
        else:
            roots.append(digest)
    events, starts = [], deque(roots)
    while starts:
        run = [starts.popleft()]
        while run[-1] in children:
            first, *others = children[run[-1]]
            starts.extend(others)
            run.append(first)
        head = blocks[run[0]]
        events.append(BlockStored(
            tuple(run), head.parent, tuple(t for d in run for t in blocks[d].tokens),
            block_size, None, medium, None if head.namespace is None else str(head.namespace),
        ))
    return events


def diff_events(before: dict[int, CachedBlock], after: dict[int, CachedBlock],
                block_size: int, medium: str | None = None) -> list[KVEvent]:
    """The events that turn a subscriber's view `before` into `after`.
    O(blocks + changed log changed)."""
    if before and not after:
        return [AllBlocksCleared()]
    removed = sorted((d for d in before if d not in after), key=lambda d: -before[d].index)
    events: list[KVEvent] = [BlockRemoved(tuple(removed), medium)] if removed else []
    added = [d for d in after if d not in before]
    return events + stored_events(added, after, block_size, medium)


# ------------------------------------------------------------------ sinks


class EventSink(Protocol):
    """Where encoded batches go. `send` may raise: the publisher resends the
    whole state on its next call."""

    def send(self, payload: bytes) -> None: ...

    def close(self) -> None: ...


class EventsLost(RuntimeError):
    """The sink could not deliver an earlier batch."""


class TeeSink:
    """Every payload to each of `sinks` in turn. `send` tries them all, then
    raises the first error one raised (the publisher then resends its whole
    state to all of them, which each applies as a fresh start)."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def send(self, payload: bytes) -> None:
        error: Exception | None = None
        for sink in self.sinks:
            try:
                sink.send(payload)
            except Exception as failure:  # noqa: BLE001 - raised after the others had it
                error = error or failure
        if error is not None:
            raise error

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


#: Where `blockmgr serve --kv-events` (no endpoint given) binds: this
#: machine only (the events carry every cached prompt's token ids).
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, IPv6 any or a local transport binds; else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def exposes_beyond_machine(endpoint: str) -> bool:
    """Does binding `endpoint` listen on every interface (a wildcard host,
    IPv4 or IPv6 any)? Its events then reach the network, unauthenticated."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    return host in ("*", "0.0.0.0", "[::]", "::", "[*]")


class ZmqSink:
    """A ZMQ PUB socket sending vLLM's multipart [topic, sequence number
    (8 bytes, big-endian, from 0), payload], from a background thread so a
    slow network never holds a step. `replay_endpoint`: a ROUTER socket
    answering [identity, b"", start sequence] with every buffered
    [identity, b"", seq, payload] from there, then [.., END_OF_REPLAY, b""].

    `send` queues (at most `max_queue` batches; beyond that it raises
    `queue.Full`); a batch the thread could not send makes the next `send`
    raise `EventsLost`. Needs pyzmq.

    `bind`: True binds `endpoint` whatever its host (loopback
    "tcp://127.0.0.1:5557", an interface "tcp://lo:5557" or "tcp://eth0:5557"),
    False connects to it; None follows vLLM's rule (a wildcard such as
    "tcp://*:5557", which listens on every interface, or ipc/inproc binds;
    anything else connects). The replay endpoint is always bound.
    """

    def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 10_000,
                 bind: bool | None = None) -> None:
        zmq = _optional("zmq")
        _optional("msgpack")  # fail here, not at the first event
        self.endpoint = endpoint
        self._topic = topic.encode()
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            binds = vllm_binds(endpoint) if bind is None else bind
            self._pub.bind(endpoint) if binds else self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise InvalidArgument(f"cannot open KV events on {endpoint!r}: {error}") from None
        self._queue: queue.Queue[bytes | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lost: BaseException | None = None
        self.num_sent = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def last_endpoint(self) -> str:
        """The address bound (a `tcp://*:0` endpoint shows its port here)."""
        return self._pub.getsockopt_string(_optional("zmq").LAST_ENDPOINT)

    @property
    def replay_last_endpoint(self) -> str | None:
        """The replay socket's bound address (None without one)."""
        if self._replay is None:
            return None
        return self._replay.getsockopt_string(_optional("zmq").LAST_ENDPOINT)

    def send(self, payload: bytes) -> None:
        lost, self._lost = self._lost, None
        if lost is not None:
            raise EventsLost(f"a KV event batch was not sent: {lost}") from lost
        self._queue.put_nowait(payload)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        seq = 0
        try:
            while True:
                replay = self._replay
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    payload = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if payload is None:
                    return
                try:
                    self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                except Exception as error:  # noqa: BLE001 - reported by the next send()
                    self._lost = error
                    continue
                self._buffer.append((seq, payload))
                seq += 1
                self.num_sent += 1
        finally:
            self._close_sockets()

    def _serve_replay(self, replay: Any) -> None:
        """Answer one replay request on the `replay` (ROUTER) socket."""
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events: ignored a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        replay.send_multipart([client, b"", END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


# --------------------------------------------------------------- publisher


class KVEventPublisher:
    """Publishes the changes of a store's servable blocks to a sink.

    Call `publish()` after every step (the `Engine` does, and after an
    abort). `data_parallel_rank` is sent in every batch (0 by default, as
    vLLM's publisher does: Dynamo's decoder reads three batch fields). It
    costs one `servable_blocks` (see there) and one batch when something
    changed. Not thread-safe: call it from the thread that drives the store.
    """

    def __init__(self, store: ServableStore, sink: EventSink, *, medium: str | None = None,
                 data_parallel_rank: int | None = 0,
                 clock: Callable[[], float] = time.time,
                 tiered: TieredServableStore | None = None) -> None:
        """`tiered`: the same store, when its prefix cache has host and disk
        tiers: every event then names its blocks' medium by tier
        (`TIER_MEDIA`: "GPU", "CPU", "DISK"; `medium` is not used), and a
        block that moves between tiers is removed from one medium and
        stored in the other."""
        _optional("msgpack")  # fail here, not at the first event
        self.store = store
        self.tiered = tiered
        self.advertised_media: dict[int, str] = {}
        self.sink = sink
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self.advertised: dict[int, CachedBlock] = {}
        self._memo: dict[tuple[Hashable, bytes], PathBlocks] = {}
        self._version: int | None = None  # the store's cache_version when last sent
        self.num_batches = 0
        self.num_errors = 0
        self.last_error: Exception | None = None
        self._resync = False

    def publish(self) -> KVEventBatch | None:
        """Send what changed since the last batch; return that batch (None:
        nothing changed, or a fault). Never raises an `Exception`: a fault is
        counted and logged, and the next call resends everything after an
        `AllBlocksCleared`."""
        try:
            version = self.store.cache_version
            if version == self._version and not self._resync:
                return None  # no hit changed: O(1)
            after = servable_blocks(self.store, self._memo)
            block_size = self.store.block_size
            events: list[KVEvent]
            media: dict[int, str] = {}
            if self.tiered is not None:
                media = servable_media(self.tiered, self._memo)
                events = tiered_diff_events({} if self._resync else self.advertised,
                                            self.advertised_media, after, media, block_size)
                if self._resync:
                    events = [AllBlocksCleared(), *events]
            elif self._resync:
                events = [AllBlocksCleared(), *stored_events(list(after), after, block_size,
                                                              self.medium)]
            else:
                events = diff_events(self.advertised, after, block_size, self.medium)
            if not events:
                self._version = version
                return None
            batch = KVEventBatch(self.clock(), tuple(events), self.data_parallel_rank)
            self.sink.send(encode_batch(batch))
        except Exception as error:  # noqa: BLE001 - events must never stop serving
            self.num_errors += 1
            self.last_error = error
            if not self._resync:
                logger.warning("kv events: publishing failed (%s); resending all next step",
                               error)
            self._resync = True
            return None
        self.advertised = after
        self.advertised_media = media
        self._version = version
        self._resync = False
        self.num_batches += 1
        return batch

    def add_sink(self, sink: EventSink) -> None:
        """Send every later batch to `sink` as well (a `TeeSink`). `sink`
        knows nothing yet, so the next `publish()` sends the whole state
        (`AllBlocksCleared`, then every advertised block) to every sink, as
        after a fault. Call it on the thread that publishes."""
        self.sink = TeeSink(self.sink, sink)
        self._resync = True

    def close(self) -> None:
        """Close the sink (a `ZmqSink` sends what is queued first)."""
        self.sink.close()


def open_publisher(store: ServableStore, kv_events: str | EventSink, *,
                   topic: str = "", replay_endpoint: str | None = None,
                   tiered: TieredServableStore | None = None) -> KVEventPublisher:
    """A publisher on `store`: `kv_events` is a ZMQ endpoint (vLLM's rule:
    "tcp://*:5557" binds on every interface, "tcp://host:5557" connects; a
    `ZmqSink(..., bind=True)` binds loopback or one interface) or a sink.
    `tiered`: the store again when it has cache tiers (media by tier)."""
    if isinstance(kv_events, str):
        sink: EventSink = ZmqSink(kv_events, topic=topic, replay_endpoint=replay_endpoint)
    else:
        sink = kv_events
    return KVEventPublisher(store, sink, tiered=tiered)
