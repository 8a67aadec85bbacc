"""One conversation's cached prefix as a file (`PagedCache.export_prefix`,
`import_prefix`): what an agent moves to another machine or keeps beside
its transcript. `export_prefix` / `import_prefix` run a short-lived
sequence on the cache (`PrefixHost`) that holds the prefix's pages: its
allocation hits the cached prefix (a demoted one is loaded back) or takes
fresh pages for the imported one; `DeviceRecords` reads or writes that
sequence's pages and slot as records; the sequence then ends, an imported
prefix entering the trie as computed tokens do.

The records are the disk tier's (`cache.page_records`, design/tiers.md): a
page of a layer group is every layer's stored parts in the page format's
own bytes, a snapshot is every recurrent layer's state arrays, raw; nothing
is converted, so an imported prefix gives the logits of one never evicted,
bit for bit. The file:

* 8 bytes: the JSON header's length (little-endian);
* the header: magic, version, the records fingerprint (model, block size,
  format, layouts: `tier_setup.records_fingerprint`, as the disk tier's),
  the namespace (None, a str or an int), the tokens (uint32, base64), per
  kind its record size, its records in order, and the CRC-32 of each;
* the records, kind after kind, in the header's order.

Written to a temporary file beside the target and renamed (a reader never
sees half a file). A file written for another model, block size or format
raises `ForeignPrefixFile`; a cut or damaged one `CorruptPrefixFile`;
both before anything changes. Costs: O(records' bytes).
"""

from __future__ import annotations

import base64
import json
import os
import zlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from blockmgr import Allocation
from blockmgr.errors import IntegrityError, InvalidArgument
from blockmgr.ops import Plan
from cache.cache_tiers import SLOTS, RecordStore, page_kind

MAGIC = "mlx-blockmgr cached prefix"
VERSION = 1


class ForeignPrefixFile(InvalidArgument):
    """The file was written for another model, block size, format or layout."""


class CorruptPrefixFile(InvalidArgument):
    """The file is not a whole prefix file (cut, damaged, or not one)."""


@dataclass(slots=True)
class PrefixRecords:
    """A prefix's tokens, namespace and records by kind (`pages{g}`,
    `slots`): a ``[n, record bytes]`` uint8 array each."""

    namespace: Hashable
    tokens: list[int]
    records: dict[str, np.ndarray]


def write_prefix(path: str | os.PathLike[str], fingerprint: str, prefix: PrefixRecords) -> None:
    """Write `prefix` to `path` (see the module doc). Raises
    `InvalidArgument` for a namespace that a file cannot carry."""
    namespace = prefix.namespace
    if not (namespace is None or type(namespace) in (str, int)):
        raise InvalidArgument(f"a prefix file keeps a None, str or int namespace, got "
                              f"{namespace!r:.80}")
    kinds = [{"name": name, "nbytes": int(rows.shape[1]), "count": int(rows.shape[0]),
              "crc": [zlib.crc32(row.tobytes()) for row in rows]}
             for name, rows in prefix.records.items()]
    header = json.dumps({
        "magic": MAGIC, "version": VERSION, "fingerprint": fingerprint, "ns": namespace,
        "tokens": base64.b64encode(np.asarray(prefix.tokens, "<u4").tobytes()).decode(),
        "kinds": kinds}).encode()
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for rows in prefix.records.values():
            f.write(np.ascontiguousarray(rows).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_prefix(path: str | os.PathLike[str], fingerprint: str) -> PrefixRecords:
    """The prefix in `path`, every record verified. Raises
    `ForeignPrefixFile` (another fingerprint), `CorruptPrefixFile` (cut,
    damaged, not a prefix file), `InvalidArgument` when it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise InvalidArgument(f"cannot read the prefix file {str(path)!r}: "
                              f"{error.strerror or error}") from None
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise ValueError("no prefix-file header")
    except ValueError as error:
        raise CorruptPrefixFile(f"{str(path)!r} is not a prefix file ({error})") from None
    if header.get("version") != VERSION:
        raise CorruptPrefixFile(f"{str(path)!r} is version {header.get('version')!r}, "
                                f"not {VERSION}")
    if header.get("fingerprint") != fingerprint:
        raise ForeignPrefixFile(f"{str(path)!r} was written for another model, block size or "
                                "page format; it is never loaded into this cache")
    return _records(path, header, data, 8 + size)


def _records(path: str | os.PathLike[str], header: dict, data: bytes,
             offset: int) -> PrefixRecords:
    records: dict[str, np.ndarray] = {}
    try:
        tokens = np.frombuffer(base64.b64decode(header["tokens"]), "<u4").tolist()
        for kind in header["kinds"]:
            nbytes, count = int(kind["nbytes"]), int(kind["count"])
            end = offset + nbytes * count
            if end > len(data) or len(kind["crc"]) != count:
                raise ValueError("cut short")
            rows = np.frombuffer(data[offset:end], np.uint8).reshape(count, nbytes)
            if [zlib.crc32(row.tobytes()) for row in rows] != kind["crc"]:
                raise ValueError(f"a {kind['name']} record fails its checksum")
            records[str(kind["name"])] = rows
            offset = end
        namespace = header["ns"]
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptPrefixFile(f"{str(path)!r} is damaged ({error})") from None
    if offset != len(data) or not tokens:
        raise CorruptPrefixFile(f"{str(path)!r} is damaged (its length)")
    return PrefixRecords(namespace, tokens, records)


class PrefixStorage(Protocol):
    """What `DeviceRecords` reads of the cache (`PagedCache`): where a
    sequence's pages and slot are."""

    @property
    def block_size(self) -> int: ...
    def block_table(self, seq_id: Hashable, group: int | None = None) -> list[int | None]: ...
    def slot(self, seq_id: Hashable) -> int | None: ...


class PrefixHost(PrefixStorage, Protocol):
    """The cache a transfer runs its short-lived sequence on (`PagedCache`)."""

    def allocate(self, seq_id: Hashable, tokens: Iterable[int], namespace: Hashable = None, *,
                 retention: int = 0) -> Allocation: ...
    def flush(self) -> None: ...
    def free(self, seq_id: Hashable, num_computed: int | None = None) -> Plan: ...


class WrittenCounts(Protocol):
    """Where an import says its sequence's tokens are written
    (`computed_counts.ComputedCounts`)."""

    def written(self, seq_id: Hashable, num_tokens: int) -> None: ...


@dataclass(slots=True)
class DeviceRecords:
    """A cache's device storage as records: each group's pages (None: a
    group no layer stores) and the slots (None without recurrent state),
    with the fingerprint a file of them carries
    (`tier_setup.records_fingerprint`)."""

    pages: list[RecordStore | None]
    slots: RecordStore | None
    fingerprint: str

    def read(self, storage: PrefixStorage, seq_id: Hashable,
             num_tokens: int) -> dict[str, np.ndarray]:
        """The records of the first `num_tokens` tokens of `seq_id`: its
        pages of every group, and its slot. Raises `InvalidArgument` when a
        sliding window released an early page. O(records' bytes)."""
        num_pages = -(-num_tokens // storage.block_size)
        records = {}
        for group, store in enumerate(self.pages):
            if store is None:
                continue
            table = storage.block_table(seq_id, group)[:num_pages]
            if None in table:
                raise InvalidArgument("this prefix's early pages were released by a sliding "
                                      "window: it cannot be exported whole")
            records[page_kind(group)] = store.read([_present(p) for p in table])
        if self.slots is not None:
            records[SLOTS] = self.slots.read([_present(storage.slot(seq_id))])
        return records

    def check(self, prefix: PrefixRecords, block_size: int) -> None:
        """Raise `CorruptPrefixFile` unless `prefix` has one record of each
        kind per page of its tokens (one slot record)."""
        num_pages = -(-len(prefix.tokens) // block_size)
        want = {page_kind(g): num_pages for g, store in enumerate(self.pages)
                if store is not None}
        if self.slots is not None:
            want[SLOTS] = 1
        if {kind: len(rows) for kind, rows in prefix.records.items()} != want:
            raise CorruptPrefixFile("the prefix file's records do not match its tokens")

    def write(self, storage: PrefixStorage, seq_id: Hashable, first_page: int,
              prefix: PrefixRecords) -> None:
        """Write `prefix`'s records from page `first_page` on (earlier pages
        are the trie's, shared) into `seq_id`'s pages, and its slot.
        O(records' bytes)."""
        for group, store in enumerate(self.pages):
            if store is not None:
                table = storage.block_table(seq_id, group)
                store.write([_present(p) for p in table[first_page:]],
                            prefix.records[page_kind(group)][first_page:])
        if self.slots is not None:
            self.slots.write([_present(storage.slot(seq_id))], prefix.records[SLOTS])


class TransferId:
    """The id of the short-lived sequence a prefix export or import runs
    (equal to no other id)."""

    __slots__ = ()


def export_prefix(host: PrefixHost, records: DeviceRecords, tokens: Sequence[int],
                  path: str | os.PathLike[str], namespace: Hashable, retention: int) -> int:
    """Write the cached prefix of `tokens` in `namespace` to `path`
    (`PagedCache.export_prefix`); returns its tokens. Raises
    `InvalidArgument` when nothing of `tokens` is cached. The cache is left
    as it was, but for the use of the prefix. O(prefix pages + file bytes)."""
    seq_id = TransferId()
    tokens = list(tokens)
    alloc = host.allocate(seq_id, [*tokens, 0], namespace,  # a hit of at most `tokens`
                          retention=retention)
    try:
        num_tokens = alloc.num_cached_tokens
        if not num_tokens:
            raise InvalidArgument("nothing of these tokens is cached: nothing to export")
        host.flush()  # the hit's loads and the partial page's copy
        write_prefix(path, records.fingerprint, PrefixRecords(
            namespace, tokens[:num_tokens], records.read(host, seq_id, num_tokens)))
    finally:
        host.free(seq_id, 0)
    return num_tokens


def import_prefix(host: PrefixHost, counts: WrittenCounts, records: DeviceRecords,
                  path: str | os.PathLike[str], retention: int) -> int:
    """Cache the prefix in the file `path` (`PagedCache.import_prefix`);
    returns its tokens. Raises `ForeignPrefixFile`, `CorruptPrefixFile`,
    `OutOfBlocks` / `OutOfSlots`, nothing changed then. O(file bytes)."""
    prefix = read_prefix(path, records.fingerprint)
    num_tokens = len(prefix.tokens)
    records.check(prefix, host.block_size)
    seq_id = TransferId()
    alloc = host.allocate(seq_id, prefix.tokens, prefix.namespace, retention=retention)
    try:
        host.flush()
        # Pages before the first the hit left are the trie's: already written.
        records.write(host, seq_id, alloc.num_cached_tokens // host.block_size, prefix)
        counts.written(seq_id, num_tokens)  # as a forward would have
    except BaseException:
        host.free(seq_id, 0)
        raise
    host.free(seq_id)
    host.flush()
    return num_tokens


def _present(page: int | None) -> int:
    """A page or slot the sequence holds (never None where it is read)."""
    if page is None:
        raise IntegrityError("a prefix transfer met a released page")
    return page
