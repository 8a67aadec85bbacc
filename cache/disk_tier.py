"""The disk tier's files: fixed-size records, an index, a writer thread.

A `DiskTier` owns one directory (design/tiers.md, "Storage"):

* ``lock``: held with ``fcntl.flock`` while the tier is open; a second
  opener (another process, or another cache of this one) is refused with
  `DiskCacheLocked`, so two servers never write one directory;
* one record file per kind (``pages0.bin``, ``pages1.bin``... one per layer
  group, ``slots.bin`` for recurrent snapshots): a 4 KiB header (magic,
  version, the model fingerprint, the record size), then record ``i`` at
  ``4096 + i * record_nbytes``. Records are written in place with
  ``os.pwrite`` and read with ``os.pread`` (a short read of a truncated
  file is a miss; a memory map would raise SIGBUS there);
* ``index.json``: the fingerprint, the record sizes and every restorable
  entry (namespace, its own tokens and its parent entry, its records per
  group and its snapshot's record and whether that is a checkpoint, the
  CRC-32 of each record), written as
  a whole at checkpoints and at close: temp file, fsync, rename, fsync of
  the directory, after an fsync of the record files. An entry is
  trusted only as far as its checksums: after a crash, a record written
  since the last index (an id reused) no longer matches and is a miss.

Writes go behind the forward: `write` copies nothing (the caller hands a
buffer it will not touch again), keeps it as pending (reads of it are
served from memory) and queues it; a daemon thread writes, checksums and
checkpoints in queue order. A write error (disk full) stops the thread's
writing and sets `failure` (the owner disables the tier). Costs: a write
or read is O(record bytes) plus one system call; a checkpoint
O(entries x their tokens).
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from blockmgr.errors import InvalidArgument
from blockmgr.tiered_trie import DiskEntry

log = logging.getLogger("blockmgr.disk_cache")

HEADER_NBYTES = 4096
MAGIC = "mlx-blockmgr disk cache"
VERSION = 1
INDEX = "index.json"

# The system calls, as seams a test replaces to inject faults (ENOSPC, EIO).
pwrite = os.pwrite
pread = os.pread


class DiskCacheLocked(InvalidArgument):
    """Another open cache (this process or another) holds the directory."""


@dataclass(frozen=True, slots=True)
class RecordKind:
    """One record file: its name and the bytes and count of its records."""

    name: str
    record_nbytes: int
    num_records: int


@dataclass(frozen=True, slots=True)
class IndexedEntry:
    """A restorable entry of the index: the trie's `DiskEntry` and the
    checksum of each of its records (None where the entry has no page)."""

    entry: DiskEntry
    page_crcs: tuple[tuple[int | None, ...], ...]
    slot_crc: int | None


@dataclass(slots=True)
class DiskStats:
    """What the tier did since it opened (read on the owner's thread;
    counters the writer thread bumps are approximate while it runs)."""

    num_writes: int = 0
    write_nbytes: int = 0
    num_reads: int = 0
    read_nbytes: int = 0
    read_seconds: float = 0.0
    num_bad_records: int = 0
    num_checkpoints: int = 0
    checkpoint_seconds: float = 0.0
    restored: int = 0
    dropped_at_open: int = 0
    messages: list[str] = field(default_factory=list)


def _persistable(namespace: Hashable) -> bool:
    return namespace is None or type(namespace) in (str, int)


def _header(fingerprint: str, kind: RecordKind) -> bytes:
    text = json.dumps({"magic": MAGIC, "version": VERSION, "fingerprint": fingerprint,
                       "name": kind.name, "record_nbytes": kind.record_nbytes})
    raw = text.encode()
    if len(raw) > HEADER_NBYTES:
        raise InvalidArgument("a record file header longer than 4 KiB (fingerprint too long)")
    return raw.ljust(HEADER_NBYTES, b" ")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier:
    """The directory of one disk tier; see the module doc. Not thread-safe
    for its owner (one caller thread), besides its own writer thread."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fingerprint: str,
        kinds: Sequence[RecordKind],
    ) -> None:
        """Open (creating) `directory`, lock it, and read its index: the
        entries a matching index lists are in `restored` (the caller gives
        them to `restore_disk`, then `keep` what was restored). A directory
        of another fingerprint or layout, or one whose index or record
        headers do not read, is cleared, with one log line. Raises
        `DiskCacheLocked` when another cache holds it."""
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.kinds = {kind.name: kind for kind in kinds}
        self.stats = DiskStats()
        self.failure: str | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DiskCacheLocked(
                f"the disk cache {str(self.directory)!r} is in use by another cache or process; "
                "give each server its own directory") from None
        self._lock = threading.Lock()
        self._crcs: dict[tuple[str, int], int] = {}
        self._pending: dict[tuple[str, int], tuple[int, np.ndarray]] = {}
        self._num_queued = 0
        self._fds: dict[str, int] = {}
        self.restored = self._open_files()
        self._queue: queue.SimpleQueue[tuple[object, ...] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._run, name="disk-cache-writer", daemon=True)
        self._writer.start()
        self._closed = False

    # ------------------------------------------------------------- opening

    def _open_files(self) -> list[IndexedEntry]:
        (self.directory / (INDEX + ".tmp")).unlink(missing_ok=True)  # a checkpoint cut short
        reason = self._foreign_reason()
        if reason is not None:
            self._clear(reason)
        for name, kind in self.kinds.items():
            path = self.directory / f"{name}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self._fds[name] = fd
            size = os.fstat(fd).st_size
            if size < HEADER_NBYTES:
                pwrite(fd, _header(self.fingerprint, kind), 0)
            elif size > HEADER_NBYTES + kind.num_records * kind.record_nbytes:
                # a smaller budget than last time
                os.ftruncate(fd, HEADER_NBYTES + kind.num_records * kind.record_nbytes)
        if reason is not None:
            return []
        return self._read_index()

    def _foreign_reason(self) -> str | None:
        """Why the directory's contents cannot be used (None: they can, or
        there are none)."""
        index = self.directory / INDEX
        files = [self.directory / f"{name}.bin" for name in self.kinds]
        if not index.exists() and not any(f.exists() for f in files):
            return None
        for name, kind in self.kinds.items():
            path = self.directory / f"{name}.bin"
            if path.exists():
                with open(path, "rb") as f:
                    head = f.read(HEADER_NBYTES)
                if head != _header(self.fingerprint, kind):
                    return f"{path.name} was written for another model, format or layout"
        if not index.exists():
            return "it has record files and no index"
        try:
            meta = json.loads(index.read_text())
        except (OSError, ValueError) as error:
            return f"its index does not read ({error})"
        if not isinstance(meta, dict) or meta.get("magic") != MAGIC \
                or meta.get("version") != VERSION:
            return "its index is not this version's"
        if meta.get("fingerprint") != self.fingerprint:
            return "it was written for another model, block size or page format"
        kinds = {name: [k.record_nbytes, k.num_records] for name, k in self.kinds.items()}
        if {name: v[0] for name, v in (meta.get("kinds") or {}).items()} != \
                {name: v[0] for name, v in kinds.items()}:
            return "its records have another layout"
        return None

    def _clear(self, reason: str) -> None:
        log.warning("disk cache %s: not reused (%s); its entries are cleared",
                    self.directory, reason)
        self.stats.messages.append(reason)
        (self.directory / INDEX).unlink(missing_ok=True)
        for path in self.directory.glob("*.bin"):
            path.unlink()
        _fsync_dir(self.directory)

    def _read_index(self) -> list[IndexedEntry]:
        """The index's entries whose records lie within the files and the
        budget (a truncated file's are dropped), parents first."""
        index = self.directory / INDEX
        if not index.exists():
            return []
        meta = json.loads(index.read_text())
        sizes = {name: os.fstat(fd).st_size for name, fd in self._fds.items()}
        entries: list[IndexedEntry] = []
        kept: dict[int, DiskEntry] = {}
        page_kinds = [name for name in self.kinds if name != "slots"]
        for position, raw in enumerate(meta.get("entries", [])):
            try:
                entry = self._decode(raw, kept, page_kinds, sizes)
            except (KeyError, TypeError, ValueError, IndexError):
                entry = None
            if entry is None:
                self.stats.dropped_at_open += 1
                continue
            kept[position] = entry.entry
            entries.append(entry)
        return entries

    def _decode(self, raw: dict, kept: Mapping[int, DiskEntry], page_kinds: list[str],
                sizes: Mapping[str, int]) -> IndexedEntry | None:
        own = np.frombuffer(base64.b64decode(raw["tokens"]), "<u4").tolist()
        parent = raw["parent"]
        prefix: tuple[int, ...] = ()
        if parent is not None:
            if parent not in kept:
                return None  # its parent was dropped: nothing leads here
            prefix = kept[parent].tokens
        start = int(raw["start"])
        if start != len(prefix) or not own:
            return None
        pages = tuple(tuple(p for p in group) for group in raw["pages"])
        crcs = tuple(tuple(c for c in group) for group in raw["crc"])
        if len(pages) != len(page_kinds) or len(crcs) != len(pages):
            return None
        for name, group_pages, group_crcs in zip(page_kinds, pages, crcs):
            if len(group_pages) != len(group_crcs):
                return None
            for page, crc in zip(group_pages, group_crcs):
                if page is None:
                    continue
                if not self._within(name, page, sizes) or not isinstance(crc, int):
                    return None
        slot, slot_crc = raw.get("slot"), raw.get("slot_crc")
        if slot is not None and (not self._within("slots", slot, sizes)
                                 or not isinstance(slot_crc, int)):
            return None
        checkpoint = raw.get("checkpoint", False)  # an index from before the flag: none
        if type(checkpoint) is not bool:
            return None
        entry = DiskEntry(raw["ns"], prefix + tuple(own), start, pages, slot, checkpoint)
        return IndexedEntry(entry, crcs, slot_crc)

    def _within(self, name: str, record: object, sizes: Mapping[str, int]) -> bool:
        kind = self.kinds.get(name)
        if kind is None or type(record) is not int or not 0 <= record < kind.num_records:
            return False
        return HEADER_NBYTES + (record + 1) * kind.record_nbytes <= sizes[name]

    def keep(self, entries: Sequence[IndexedEntry]) -> None:
        """Trust the records of `entries` (what the trie restored): their
        checksums are what reads verify against."""
        page_kinds = [name for name in self.kinds if name != "slots"]
        with self._lock:
            for item in entries:
                for name, pages, crcs in zip(page_kinds, item.entry.pages, item.page_crcs):
                    for page, crc in zip(pages, crcs):
                        if page is not None and crc is not None:
                            self._crcs[(name, page)] = crc
                if item.entry.slot is not None and item.slot_crc is not None:
                    self._crcs[("slots", item.entry.slot)] = item.slot_crc
        self.stats.restored = len(entries)
        self.restored = []

    # ------------------------------------------------------ reads and writes

    def write(self, name: str, record: int, data: np.ndarray) -> None:
        """Queue record `record` of kind `name` (a 1-D uint8 array of the
        record's bytes, which the caller never touches again). Reads see it
        at once. O(1) here; the thread does the I/O."""
        if self.failure is not None or self._closed:
            return
        key = (name, record)
        with self._lock:
            self._num_queued += 1
            self._pending[key] = (self._num_queued, data)
            self._crcs.pop(key, None)
            seq = self._num_queued
        self._queue.put(("write", key, seq, data))

    def read(self, name: str, record: int) -> np.ndarray | None:
        """Record `record` of kind `name`, verified: None when it was never
        written, is cut short or fails its checksum (a miss; the caller
        forgets it). Raises `OSError` on an I/O error. O(record bytes)."""
        key = (name, record)
        with self._lock:
            pending = self._pending.get(key)
            crc = self._crcs.get(key)
        if pending is not None:
            return pending[1]
        if crc is None:
            return None
        kind = self.kinds[name]
        begin = time.perf_counter()
        data = pread(self._fds[name], kind.record_nbytes,
                     HEADER_NBYTES + record * kind.record_nbytes)
        self.stats.read_seconds += time.perf_counter() - begin
        self.stats.num_reads += 1
        self.stats.read_nbytes += len(data)
        if len(data) != kind.record_nbytes or zlib.crc32(data) != crc:
            self.stats.num_bad_records += 1
            self.forget(name, [record])
            return None
        return np.frombuffer(data, np.uint8)

    def forget(self, name: str, records: Sequence[int]) -> None:
        """Stop trusting `records` (unreadable ones): reads of them miss."""
        with self._lock:
            for record in records:
                self._crcs.pop((name, record), None)

    def checkpoint(self, entries: Sequence[DiskEntry]) -> None:
        """Queue an index of `entries` (the trie's `disk_entries()`, taken
        now): written after every record queued before it, with the
        checksums those writes produced. Entries whose parent is not on
        disk, whose namespace is not None / str / int, or with a record
        that failed are left out (nothing would lead to them after a
        restart)."""
        if self.failure is None and not self._closed:
            self._queue.put(("checkpoint", list(entries)))

    def sync(self) -> None:
        """Wait until every queued write and checkpoint is done."""
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(("sync", done))
        done.wait()

    def close(self) -> None:
        """Finish the queue, stop the thread, close the files, unlock.
        Idempotent."""
        if self._closed:
            return
        self._queue.put(None)
        self._writer.join()
        self._closed = True
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    @property
    def num_pending(self) -> int:
        """Records queued and not yet written."""
        with self._lock:
            return len(self._pending)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            kind = job[0]
            if kind == "sync":
                job[1].set()  # type: ignore[attr-defined]
                continue
            if self.failure is not None:
                continue
            try:
                if kind == "write":
                    self._write(*job[1:])  # type: ignore[arg-type]
                else:
                    self._checkpoint(job[1])  # type: ignore[arg-type]
            except OSError as error:
                self.failure = f"{error.strerror or error} ({self.directory})"
                log.error("disk cache %s: %s; the disk tier is turned off",
                          self.directory, error.strerror or error)

    def _write(self, key: tuple[str, int], seq: int, data: np.ndarray) -> None:
        name, record = key
        nbytes = self.kinds[name].record_nbytes
        raw = np.ascontiguousarray(data).data
        written = pwrite(self._fds[name], raw, HEADER_NBYTES + record * nbytes)
        if written != nbytes:
            raise OSError(28, f"short write ({written} of {nbytes} bytes)")
        crc = zlib.crc32(raw)
        with self._lock:
            if self._pending.get(key, (None,))[0] == seq:  # no later write of it queued
                del self._pending[key]
                self._crcs[key] = crc
        self.stats.num_writes += 1
        self.stats.write_nbytes += nbytes

    def _checkpoint(self, entries: list[DiskEntry]) -> None:
        begin = time.perf_counter()
        for fd in self._fds.values():
            os.fsync(fd)
        meta = {
            "magic": MAGIC, "version": VERSION, "fingerprint": self.fingerprint,
            "kinds": {name: [k.record_nbytes, k.num_records] for name, k in self.kinds.items()},
            "entries": self._index_entries(entries),
        }
        tmp = self.directory / (INDEX + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / INDEX)
        _fsync_dir(self.directory)
        self.stats.num_checkpoints += 1
        self.stats.checkpoint_seconds += time.perf_counter() - begin

    def _index_entries(self, entries: list[DiskEntry]) -> list[dict]:
        page_kinds = [name for name in self.kinds if name != "slots"]
        positions: dict[tuple[Hashable, tuple[int, ...]], int] = {}
        out: list[dict] = []
        with self._lock:
            crcs = dict(self._crcs)
        for entry in sorted(entries, key=lambda e: len(e.tokens)):
            if not _persistable(entry.namespace):
                continue
            parent = None
            if entry.start:
                parent = positions.get((entry.namespace, entry.tokens[:entry.start]))
                if parent is None:
                    continue
            page_crcs = [[None if page is None else crcs.get((name, page)) for page in pages]
                         for name, pages in zip(page_kinds, entry.pages)]
            if any(c is None and p is not None
                   for cs, ps in zip(page_crcs, entry.pages) for c, p in zip(cs, ps)):
                continue
            slot_crc = None if entry.slot is None else crcs.get(("slots", entry.slot))
            if entry.slot is not None and slot_crc is None:
                continue
            own = np.asarray(entry.tokens[entry.start:], "<u4").tobytes()
            positions[(entry.namespace, entry.tokens)] = len(out)
            out.append({"ns": entry.namespace, "parent": parent, "start": entry.start,
                        "tokens": base64.b64encode(own).decode(),
                        "pages": [list(p) for p in entry.pages], "crc": page_crcs,
                        "slot": entry.slot, "slot_crc": slot_crc,
                        "checkpoint": entry.checkpoint})
        return out
