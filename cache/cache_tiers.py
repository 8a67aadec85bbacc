"""`CacheTiers`: the storage of the prefix cache's host and disk tiers.

The bookkeeping (`blockmgr.tiered_trie`) decides which cached prefix lives
in which tier and says so with `MovePage` / `MoveSlot` ops in the plans of
the calls that caused them; `PagedCache` hands each group's runs of those
ops here, in plan order. A page is moved as one record (`PageRecords`: all
layers of its group, bit for bit in the page format), a snapshot as one
slot record (`SlotRecords`, e.g. `recurrent.RecurrentPools`):

* host tier: one ``[pages, record bytes]`` uint8 array per group and one
  for slots, allocated on first use (`np.empty`: untouched rows take no
  resident memory), apart from the swap space;
* disk tier: a `DiskTier` (records in files, an index, a writer thread).
  A move to disk copies the record out when the op is applied (a device
  read is evaluated then) and queues the write: no forward waits for it.

Loads from disk are read and verified before the allocation that needs
them (`verified_match`: `disk_loads` of the match, unreadable records
forgotten and the prefix found again), kept in memory and written to the
device pages when the op is applied. A waiting request's records can be
read ahead on a background thread (`prefetch`), overlapping other
requests' forwards; its allocation then takes them. A disk that fails (a full disk, an
I/O error) is turned off (`disable_tier`) with one log line; requests go
on with the device and host tiers. The disk's index is written every
`checkpoint_interval` seconds of disk activity, checked after each flush
(`after_flush`), and at `close_disk`. Costs: O(bytes moved) per op run, one
device evaluation per wave of reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from blockmgr import Allocation, PrefixMatch
from blockmgr.errors import IntegrityError, InvalidArgument
from blockmgr.ops import MovePage, MoveSlot, Tier
from blockmgr.tiered_trie import DiskEntry, TierUsage
from cache.disk_tier import DiskTier

log = logging.getLogger("blockmgr.disk_cache")

SLOTS = "slots"
#: Bytes of disk records `CacheTiers.prefetch` holds read ahead at most.
DEFAULT_PREFETCH_NBYTES = 512 * 2**20


def page_kind(group: int) -> str:
    """The disk record kind of layer group `group`'s pages."""
    return f"pages{group}"


class RecordStore(Protocol):
    """Device storage as records: pages of one group, or slots."""

    @property
    def nbytes(self) -> int: ...  # one record
    def read(self, ids: Sequence[int]) -> np.ndarray: ...
    def write(self, ids: Sequence[int], records: np.ndarray) -> None: ...


class TieredStore(Protocol):
    """What `CacheTiers` asks of the bookkeeping (`blockmgr.GroupedStore`)."""

    def find_prefix(self, tokens: Iterable[int], namespace: Hashable = None) -> PrefixMatch: ...
    def can_allocate(self, tokens: Iterable[int], namespace: Hashable = None, *,
                     match: PrefixMatch | None = None) -> bool: ...
    def allocate(self, seq_id: Hashable, tokens: Iterable[int], namespace: Hashable = None, *,
                 retention: int = 0, match: PrefixMatch | None = None) -> Allocation: ...
    def disk_loads(self, match: PrefixMatch) -> tuple[list[list[int]], list[int]]: ...
    def forget_disk_pages(self, group: int, pages: Sequence[int]) -> None: ...
    def disk_entries(self) -> list[DiskEntry]: ...
    def disable_tier(self, tier: Tier) -> None: ...
    def tier_usage(self) -> tuple[TierUsage, ...]: ...


class HostRecords:
    """`num_records` host rows of `nbytes` each (allocated on first write)."""

    __slots__ = ("num_records", "nbytes", "_rows")

    def __init__(self, num_records: int, nbytes: int) -> None:
        self.num_records = num_records
        self.nbytes = nbytes
        self._rows: np.ndarray | None = None

    @property
    def allocated_nbytes(self) -> int:
        return 0 if self._rows is None else self._rows.nbytes

    def read(self, ids: Sequence[int]) -> np.ndarray:
        if self._rows is None:
            raise IntegrityError("a host-tier record was read before any was written")
        return self._rows[np.asarray(ids, np.int64)]  # a copy (fancy index)

    def write(self, ids: Sequence[int], records: np.ndarray) -> None:
        if self._rows is None:
            self._rows = np.empty((self.num_records, self.nbytes), np.uint8)
        self._rows[np.asarray(ids, np.int64)] = records


@dataclass(slots=True)
class TierCounters:
    """Per tier (index: `Tier`): records moved in and loaded out, tokens of
    hits served from it, seconds spent loading from it."""

    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])
    loaded_records: list[int] = field(default_factory=lambda: [0, 0, 0])
    stored_records: list[int] = field(default_factory=lambda: [0, 0, 0])
    load_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    num_disk_misses: int = 0


@dataclass(frozen=True, slots=True)
class TierReport:
    """One tier of the prefix cache as `/metrics` shows it (`CacheTiers.report`):
    the bytes its cached pages and snapshots take (in the page format's own
    bytes), its trie nodes (entries), prompt tokens hit in it, records (pages
    and snapshots) loaded from it to the device and seconds spent reading
    them (host rows or disk reads; 0 for the device)."""

    tier: Tier
    num_bytes: int
    num_entries: int
    num_hit_tokens: int
    num_loaded_records: int
    load_seconds: float


class CacheTiers:
    """Host and disk storage of the prefix cache; see the module doc."""

    def __init__(
        self,
        pages: Sequence[RecordStore | None],
        slots: RecordStore | None,
        *,
        num_host_pages: int = 0,
        num_host_slots: int = 0,
        disk: DiskTier | None = None,
        checkpoint_interval: float = 10.0,
    ) -> None:
        """`pages[g]`: group g's device pages as records (None: a group no
        layer stores, whose moves copy nothing); `slots`: the device slots
        (None without recurrent state); `checkpoint_interval`: seconds
        between two writes of the disk's index (`after_flush`)."""
        self._device: dict[str, RecordStore | None] = {
            page_kind(g): store for g, store in enumerate(pages)}
        self._device[SLOTS] = slots
        self._host = {
            kind: HostRecords(num_host_slots if kind == SLOTS else num_host_pages, store.nbytes)
            for kind, store in self._device.items() if store is not None
        } if num_host_pages else {}
        self.disk = disk
        self._staged: dict[tuple[str, int], np.ndarray] = {}
        self.counters = TierCounters()
        #: Disk reads started ahead of an allocation (`prefetch`), by record.
        self._reads: dict[tuple[str, int], Future[np.ndarray | None]] = {}
        self._reader: ThreadPoolExecutor | None = None
        self.max_prefetch_nbytes = DEFAULT_PREFETCH_NBYTES
        self.num_prefetched = 0  # records read ahead and then used by an allocation
        self.checkpoint_interval = checkpoint_interval
        self._last_checkpoint = time.monotonic()
        self._checkpointed = 0  # the disk activity the last checkpoint saw

    # ---------------------------------------------------------------- moves

    def move_pages(self, group: int, ops: Sequence[MovePage]) -> None:
        """Apply a run of one group's `MovePage` ops, in order."""
        self._move(page_kind(group), [(op.src, op.src_tier, op.dst, op.dst_tier) for op in ops])

    def move_slots(self, ops: Sequence[MoveSlot]) -> None:
        """Apply a run of `MoveSlot` ops, in order."""
        self._move(SLOTS, [(op.src, op.src_tier, op.dst, op.dst_tier) for op in ops])

    def _move(self, kind: str, moves: list[tuple[int, Tier, int, Tier]]) -> None:
        if self._device.get(kind) is None:
            return  # nothing stored in this group: nothing to move
        for wave in _waves(moves):
            sources = self._read_sources(kind, wave)
            self._write_destinations(kind, wave, sources)

    def _read_sources(self, kind: str, wave: list[tuple[int, Tier, int, Tier]]) -> np.ndarray:
        store = self._device[kind]
        assert store is not None
        out = np.empty((len(wave), store.nbytes), np.uint8)
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            rows = [i for i, move in enumerate(wave) if move[1] == tier]
            if not rows:
                continue
            ids = [wave[i][0] for i in rows]
            begin = time.perf_counter()
            if tier == Tier.DEVICE:
                out[rows] = store.read(ids)
            elif tier == Tier.HOST:
                out[rows] = self._host[kind].read(ids)
            else:
                out[rows] = np.stack([self._disk_record(kind, record) for record in ids])
            if tier != Tier.DEVICE:
                self.counters.load_seconds[tier] += time.perf_counter() - begin
        return out

    def _disk_record(self, kind: str, record: int) -> np.ndarray:
        data = self._staged.pop((kind, record), None)
        if data is None and self.disk is not None:
            data = self.disk.read(kind, record)
        if data is None:
            raise IntegrityError(f"disk record {kind}/{record} was loaded without being verified")
        return data

    def _write_destinations(self, kind: str, wave: list[tuple[int, Tier, int, Tier]],
                            sources: np.ndarray) -> None:
        store = self._device[kind]
        assert store is not None
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            rows = [i for i, move in enumerate(wave) if move[3] == tier]
            if not rows:
                continue
            ids = [wave[i][2] for i in rows]
            if tier == Tier.DEVICE:
                store.write(ids, sources[rows])
                for i in rows:
                    self.counters.loaded_records[wave[i][1]] += 1
            elif tier == Tier.HOST:
                self._host[kind].write(ids, sources[rows])
            else:
                for i, record in zip(rows, ids):
                    self._staged.pop((kind, record), None)
                    self._reads.pop((kind, record), None)  # read ahead before this write
                    if self.disk is not None:
                        self.disk.write(kind, record, sources[i].copy())
            self.counters.stored_records[tier] += len(rows) if tier else 0

    # ------------------------------------------------------------- loading

    def can_allocate(self, store: TieredStore, tokens: Sequence[int],
                     namespace: Hashable) -> bool:
        """`store.can_allocate` on the `verified_match` of `tokens`: the
        answer `allocate` will find."""
        match = self.verified_match(store, tokens, namespace)
        return store.can_allocate(tokens, namespace, match=match)

    def allocate(self, store: TieredStore, seq_id: Hashable, tokens: Sequence[int],
                 namespace: Hashable, retention: int) -> Allocation:
        """`store.allocate` on the `verified_match` of `tokens` (a hit in a
        colder tier is loaded back by the plan), the hit counted by tier
        (`Allocation.cached_tokens_by_tier`). Raises like `store.allocate`."""
        match = self.verified_match(store, tokens, namespace)
        hits = self.hit_tiers(match)
        alloc = store.allocate(seq_id, tokens, namespace, match=match, retention=retention)
        self.count_hit(hits)
        alloc.cached_tokens_by_tier = (hits[0], hits[1], hits[2])
        return alloc

    def verified_match(self, store: TieredStore, tokens: Sequence[int],
                       namespace: Hashable) -> PrefixMatch:
        """`store.find_prefix(tokens, namespace)`, with every disk record its
        load would read read and verified first (kept for the load): an
        unreadable record's prefixes are forgotten and the prefix found
        again; an I/O error turns the disk tier off. O(records read)."""
        while True:
            match = store.find_prefix(tokens, namespace)
            disk = self.disk
            if disk is None or not match.loads:
                return match
            pages, slots = store.disk_loads(match)
            if not any(pages) and not slots:
                return match
            try:
                bad_pages, bad_slots = self._stage(disk, pages, slots)
            except OSError as error:
                self.disable_disk(store, f"a read failed: {error.strerror or error}")
                continue
            if not any(bad_pages) and not bad_slots:
                return match
            num_bad = sum(map(len, bad_pages)) + len(bad_slots)
            self.counters.num_disk_misses += num_bad
            log.warning("disk cache: %d unreadable record(s) (truncated or corrupt): "
                        "their prefixes are dropped", num_bad)
            self._forget(store, bad_pages, bad_slots)

    def _stage(self, disk: DiskTier, pages: list[list[int]],
               slots: list[int]) -> tuple[list[list[int]], list[int]]:
        bad_pages: list[list[int]] = [[] for _ in pages]
        bad_slots: list[int] = []
        wanted = [(page_kind(g), page, bad_pages[g]) for g, ps in enumerate(pages) for page in ps]
        wanted += [(SLOTS, slot, bad_slots) for slot in slots]
        begin = time.perf_counter()
        for kind, record, bad in wanted:
            if self._device.get(kind) is None or (kind, record) in self._staged:
                continue
            ahead = self._reads.pop((kind, record), None)
            if ahead is not None:
                data = ahead.result()  # an OSError of the read raises here, as inline
                self.num_prefetched += 1
            else:
                data = disk.read(kind, record)
            if data is None:
                bad.append(record)
            else:
                self._staged[(kind, record)] = data
        self.counters.load_seconds[Tier.DISK] += time.perf_counter() - begin
        return bad_pages, bad_slots

    def _forget(self, store: TieredStore, bad_pages: list[list[int]], bad_slots: list[int]) -> None:
        for group, pages in enumerate(bad_pages):
            if pages:
                store.forget_disk_pages(group, pages)
        if bad_slots:  # a snapshot goes with its node: forget the node by its pages
            wanted = set(bad_slots)
            for entry in store.disk_entries():
                if entry.slot in wanted:
                    for group, entry_pages in enumerate(entry.pages):
                        held = [p for p in entry_pages if p is not None]
                        if held:
                            store.forget_disk_pages(group, held)
                            break

    def prefetch(self, store: TieredStore, tokens: Sequence[int], namespace: Hashable) -> int:
        """Start reading, on a background thread, the disk records that
        allocating `tokens` now would load (a waiting request's), so the
        read overlaps other requests' forwards; the allocation takes them
        (`verified_match`) instead of reading them itself. A record
        rewritten meanwhile is read again. At most `max_prefetch_nbytes`
        are held ahead. Returns the records queued. O(matched tokens)."""
        disk = self.disk
        if disk is None:
            return 0
        match = store.find_prefix(tokens, namespace)
        if not match.loads:
            return 0
        pages, slots = store.disk_loads(match)
        wanted = [(page_kind(g), page) for g, ps in enumerate(pages) for page in ps]
        wanted += [(SLOTS, slot) for slot in slots]
        held = sum(self.record_nbytes(kind) for kind, _ in self._reads)
        if held > self.max_prefetch_nbytes // 2:  # reads for requests that never came: start over
            self._reads.clear()
            held = 0
        num_queued = 0
        for key in wanted:
            if self._device.get(key[0]) is None or key in self._reads or key in self._staged:
                continue
            held += self.record_nbytes(key[0])
            if held > self.max_prefetch_nbytes:
                break
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="disk-cache-reader")
            self._reads[key] = self._reader.submit(disk.read, *key)
            num_queued += 1
        return num_queued

    def stop_reader(self) -> None:
        """Forget every read ahead and wait for the reader thread to stop
        (before the disk's files close)."""
        self._reads.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    @staticmethod
    def hit_tiers(match: PrefixMatch) -> list[int]:
        """A hit's tokens by the tier they are in now (before its load)."""
        tokens = [0, 0, 0]
        for node in match.loads:
            num = min(node.end, match.num_tokens) - node.start
            if num > 0:
                tokens[node.tier] += num
        tokens[Tier.DEVICE] = match.num_tokens - tokens[Tier.HOST] - tokens[Tier.DISK]
        return tokens

    def count_hit(self, tokens: list[int]) -> None:
        """Count a served hit's tokens by tier (`hit_tiers`)."""
        for tier, num in enumerate(tokens):
            self.counters.hit_tokens[tier] += num

    def drop_staged(self) -> None:
        """Forget records read ahead for allocations that never came."""
        self._staged.clear()

    # ----------------------------------------------------------- the disk

    def after_flush(self, store: TieredStore) -> None:
        """After a flush applied the moves: forget records read ahead for
        nothing, turn the disk off if its writer failed, and write the index
        when the disk changed and `checkpoint_interval` has passed."""
        self.drop_staged()
        self.check_disk(store)
        if self.disk is not None and \
                time.monotonic() - self._last_checkpoint >= self.checkpoint_interval:
            self.checkpoint(store)

    def checkpoint(self, store: TieredStore, *, force: bool = False) -> None:
        """Queue the disk's index as `store` has it now (written by the
        writer thread after the records queued before it), if the disk saw
        activity since the last one (`force`: whatever it saw). No-op
        without a disk. O(disk entries)."""
        disk = self.disk
        if disk is None:
            return
        self._last_checkpoint = time.monotonic()
        activity = self.counters.stored_records[Tier.DISK] + self.counters.num_disk_misses
        if activity == self._checkpointed and not force:
            return
        self._checkpointed = activity
        disk.checkpoint(store.disk_entries())

    def close_disk(self, store: TieredStore) -> None:
        """Write the index, finish the writes and unlock the directory: the
        disk is off from here, and a restart on the directory finds what it
        holds. The caller moved what it keeps there first (`flush_to_disk`,
        flushed). No-op without a disk."""
        disk = self.disk
        if disk is None:
            return
        self.checkpoint(store, force=True)
        disk.close()
        self.disable_disk(store, "closed", logged=True)

    def check_disk(self, store: TieredStore) -> None:
        """Turn the disk tier off if its writer failed (one log line was
        written by the writer)."""
        disk = self.disk
        if disk is not None and disk.failure is not None:
            self.disable_disk(store, disk.failure, logged=True)

    def disable_disk(self, store: TieredStore, reason: str, *, logged: bool = False) -> None:
        """Stop using the disk (its prefixes are dropped, nothing goes there
        again); the directory is unlocked and left for the next start."""
        disk = self.disk
        if disk is None:
            return
        if not logged:
            log.error("disk cache %s: %s; the disk tier is turned off", disk.directory, reason)
        store.disable_tier(Tier.DISK)
        self.disk = None
        self._staged.clear()
        self.stop_reader()
        disk.failure = disk.failure or reason
        disk.close()

    def report(self, store: TieredStore) -> tuple[TierReport, ...]:
        """Each tier's bytes, entries, hits, loads and load time, device
        first, then the colder tiers the store has. O(trie nodes)."""
        slots = self._device.get(SLOTS)
        slot_nbytes = slots.nbytes if slots is not None else 0
        reports = []
        for usage in store.tier_usage():
            num_bytes = usage.num_used_slots * slot_nbytes
            for group, num_pages in enumerate(usage.num_used_pages):
                device = self._device.get(page_kind(group))
                num_bytes += num_pages * (device.nbytes if device is not None else 0)
            tier, counters = usage.tier, self.counters
            reports.append(TierReport(
                tier, num_bytes, usage.num_nodes, counters.hit_tokens[tier],
                counters.loaded_records[tier], counters.load_seconds[tier]))
        return tuple(reports)

    @property
    def host_nbytes(self) -> int:
        """Bytes the host tier has allocated."""
        return sum(h.allocated_nbytes for h in self._host.values())

    def record_nbytes(self, kind: str) -> int:
        store = self._device.get(kind)
        if store is None:
            raise InvalidArgument(f"no record kind {kind!r}")
        return store.nbytes


def _waves(moves: list[tuple[int, Tier, int, Tier]]) -> list[list[tuple[int, Tier, int, Tier]]]:
    """Split moves into waves that read every source before writing any
    destination: a move whose source or destination an earlier move of the
    wave writes starts a new wave (the plan's sequential meaning kept)."""
    waves: list[list[tuple[int, Tier, int, Tier]]] = []
    written: set[tuple[Tier, int]] = set()
    for move in moves:
        src, dst = (move[1], move[0]), (move[3], move[2])
        if not waves or src in written or dst in written:
            waves.append([])
            written = set()
        waves[-1].append(move)
        written.add(dst)
    return waves
