"""One conversation's cached prefix as a file (`PagedCache.export_prefix`,
`import_prefix`): what an agent moves to another machine or keeps beside
its transcript.

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
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockmgr.errors import InvalidArgument

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
