"""Building a `PagedCache`'s prefix-cache tiers: sizes, fingerprint, restore.

* `tier_sizes`: byte budgets (host memory, disk) turned into pages per
  layer group and recurrent snapshots with the real bytes of the model's
  pages in its format (one probe forward on a one-page cache finds every
  attention position's shape, `KVFormat.page_nbytes` prices it; the cache
  is built by the constructor the caller hands in, `ProbeCache`);
* `model_fingerprint`: the identity of a model's weights and architecture;
* `open_tiers`: the `CacheTiers` of a built cache: device records per group
  and for slots, the host rows, the disk directory opened (locked) and
  restored into the store.

Imports `cache` only, never `scheduler`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from blockmgr import GroupedStore
from blockmgr.errors import InvalidArgument
from blockmgr.kv_format import parse_bytes
from cache.cache_tiers import SLOTS, CacheTiers, RecordStore, page_kind
from cache.disk_tier import VERSION, DiskTier, RecordKind
from cache.group_storage import layer_windows
from cache.model_storage import ModelStorageParts, model_storage_parts
from cache.page_format import KVFormat, KVShape, PageStore
from cache.page_records import PageRecords
from cache.recurrent_backend import RecurrentBackend

log = logging.getLogger("blockmgr.disk_cache")

#: The disk budget when a directory is given without a size.
DEFAULT_DISK_CACHE_SIZE = 20 * 2**30
#: Pages per recurrent snapshot in a hybrid model's tier budget: a cached
#: prefix keeps a snapshot at each request's end (and branch points), a
#: turn of a conversation is some hundreds of tokens.
PAGES_PER_SNAPSHOT = 32


@dataclass(frozen=True, slots=True)
class TierSizes:
    """The constructor arguments of a cache's tiers (`PagedCache`)."""

    kv_shapes: Mapping[int, KVShape]
    num_host_cache_blocks: int
    num_host_cache_slots: int
    num_disk_blocks: int
    num_disk_slots: int
    disk_cache: str | os.PathLike[str] | None
    model_fingerprint: str

    def kwargs(self) -> dict[str, Any]:
        return {"kv_shapes": self.kv_shapes,
                "num_host_cache_blocks": self.num_host_cache_blocks,
                "num_host_cache_slots": self.num_host_cache_slots,
                "num_disk_blocks": self.num_disk_blocks, "num_disk_slots": self.num_disk_slots,
                "disk_cache": self.disk_cache, "model_fingerprint": self.model_fingerprint}


class ProbeCache(Protocol):
    """What the probe forward runs on (a `PagedCache`, built by the
    constructor `tier_sizes` is handed: `PagedCache` itself)."""

    def allocate(self, seq_id: Hashable, tokens: Iterable[int]) -> Any: ...
    def step(self, seq_ids: Sequence[Hashable],
             num_new: Sequence[int] | None = None) -> AbstractContextManager[list[Any]]: ...
    def pools(self) -> dict[int, PageStore]: ...


def probe_kv_shapes(make_cache: Callable[..., ProbeCache], model: Any, parts: ModelStorageParts,
                    block_size: int, kv_format: KVFormat) -> tuple[dict[int, KVShape], int]:
    """Every attention position's `KVShape` and one slot's bytes (0 without
    recurrent layers), from one one-token forward on a one-page cache of
    the same layout, built by `make_cache` with `PagedCache`'s arguments
    (pools take their shapes from the first K/V written).
    Cost: one forward of one token, one page of every pool."""
    hybrid = parts.recurrent is not None
    probe_parts = model_storage_parts(model, num_slots=1) if hybrid else parts
    probe = make_cache(probe_parts.specs, 1, block_size, num_slots=1 if hybrid else 0,
                       recurrent=probe_parts.recurrent, layout=probe_parts.layout,
                       kv_format=kv_format, enable_prefix_cache=False)
    probe.allocate("probe", [0])
    with probe.step(["probe"], num_new=[1]) as views:
        mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=views))
    shapes = {layer: KVShape(pool.shape.n_kv_heads, pool.shape.k_head_dim,
                             pool.shape.v_head_dim, pool.shape.dtype)
              for layer, pool in probe.pools().items()}
    slot_nbytes = 0
    if probe_parts.recurrent is not None:
        slot_nbytes = probe_parts.recurrent.slot_record_nbytes or 0
    return shapes, slot_nbytes


def tier_sizes(make_cache: Callable[..., ProbeCache], model: Any, parts: ModelStorageParts,
               block_size: int, kv_format: KVFormat, host_cache_size: int | str | None,
               disk_cache: str | os.PathLike[str] | None,
               disk_cache_size: int | str | None) -> TierSizes:
    """Pages and snapshots of each tier for byte budgets (see the module
    doc; `make_cache` builds the probe's cache). A page of every layer
    group is the unit (each group gets as many pages); a hybrid model sets
    one snapshot beside `PAGES_PER_SNAPSHOT` pages. Raises
    `InvalidArgument` for a budget below one unit."""
    shapes, slot_nbytes = probe_kv_shapes(make_cache, model, parts, block_size, kv_format)
    windows = layer_windows(parts.specs)
    page_nbytes = 0
    for window in windows:
        for layer, spec in enumerate(parts.specs):
            if spec.kind.paged and spec.window == window and layer in shapes:
                s = shapes[layer]
                page_nbytes += kv_format.page_nbytes(block_size, s.n_kv_heads, s.k_head_dim,
                                                     s.v_head_dim, s.dtype.size)
    page_nbytes = max(page_nbytes, 1)
    host = _split(parse_bytes(host_cache_size), page_nbytes, slot_nbytes, "host_cache_size") \
        if host_cache_size is not None else (0, 0)
    disk = (0, 0)
    if disk_cache is not None:
        budget = DEFAULT_DISK_CACHE_SIZE if disk_cache_size is None else disk_cache_size
        disk = _split(parse_bytes(budget), page_nbytes, slot_nbytes, "disk_cache_size")
    elif disk_cache_size is not None:
        raise InvalidArgument("disk_cache_size needs disk_cache (a directory)")
    return TierSizes(shapes, host[0], host[1], disk[0], disk[1], disk_cache,
                     model_fingerprint(model))


def _split(nbytes: int, page_nbytes: int, slot_nbytes: int, name: str) -> tuple[int, int]:
    """(pages, slots) that `nbytes` holds."""
    if not slot_nbytes:
        pages = nbytes // page_nbytes
        if not pages:
            raise InvalidArgument(f"{name} {nbytes} is less than one page ({page_nbytes} bytes)")
        return pages, 0
    unit = PAGES_PER_SNAPSHOT * page_nbytes + slot_nbytes
    slots = nbytes // unit
    if slots:
        return slots * PAGES_PER_SNAPSHOT, slots
    pages = (nbytes - slot_nbytes) // page_nbytes
    if pages < 1:
        raise InvalidArgument(
            f"{name} {nbytes} is less than one page and one snapshot "
            f"({page_nbytes + slot_nbytes} bytes)")
    return pages, 1


def model_fingerprint(model: Any) -> str:
    """A hex digest of the model's class, every parameter's name, shape and
    dtype, and a strided sample of 256 values of each (evaluated): another
    architecture, size or set of weights (a fine-tune, another
    quantization) gives another digest. Cost: one small gather per
    parameter (milliseconds, whatever the model's size)."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    params = tree_flatten(model.parameters())
    assert isinstance(params, list)  # tree_flatten's default: (name, array) pairs
    for name, array in params:
        digest.update(f"{name}:{array.shape}:{array.dtype}".encode())
        flat = array.reshape(-1)
        step = max(1, flat.size // 256)
        sample = flat[::step][:256]
        digest.update(np.asarray(sample.view(mx.uint8) if sample.dtype.size == 1 else
                                 sample.view({2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
                                             [sample.dtype.size])).tobytes())
    return digest.hexdigest()


class _SlotRecords:
    """The recurrent backend's slots as a `RecordStore`."""

    __slots__ = ("_backend", "nbytes")

    def __init__(self, backend: RecurrentBackend) -> None:
        nbytes = backend.slot_record_nbytes
        if not nbytes:
            raise InvalidArgument(
                "cache tiers need the recurrent state's shapes up front "
                "(RecurrentPools.for_model probes them)")
        self._backend = backend
        self.nbytes = nbytes

    def read(self, ids: Sequence[int]) -> np.ndarray:
        return self._backend.read_slot_records(ids)

    def write(self, ids: Sequence[int], records: np.ndarray) -> None:
        self._backend.write_slot_records(ids, records)


def records_fingerprint(model_fingerprint: str, block_size: int, kv_format: KVFormat,
                        pages: Sequence[RecordStore | None], slots: RecordStore | None) -> str:
    """What a record written by one cache must agree on to be read by
    another: the model, block size, page format and every record layout
    (the disk tier's files and exported prefixes carry it). Pure."""
    layout = [f"{page_kind(g)}={p.describe() if isinstance(p, PageRecords) else ''}"
              for g, p in enumerate(pages)]
    if slots is not None:
        layout.append(f"{SLOTS}={slots.nbytes}")
    return hashlib.sha256("|".join(
        [f"v{VERSION}", model_fingerprint, f"block_size={block_size}",
         f"format={kv_format.name}:{kv_format.group_size}", *layout]).encode()).hexdigest()


def record_stores(pools: Sequence[Mapping[int, PageStore]], recurrent: RecurrentBackend | None,
                  hybrid: bool) -> tuple[list[RecordStore | None], RecordStore | None]:
    """Device pages of each group (None: a group no layer stores) and slots
    (None without recurrent state) as records. The pools must exist."""
    pages: list[RecordStore | None] = [PageRecords(p) if p else None for p in pools]
    slots = _SlotRecords(recurrent) if recurrent is not None and hybrid else None
    return pages, slots


def open_tiers(store: GroupedStore, pools: Sequence[Mapping[int, PageStore]],
               recurrent: RecurrentBackend | None, block_size: int, kv_format: KVFormat,
               disk_cache: str | os.PathLike[str] | None,
               model_fingerprint: str | None, checkpoint_interval: float) -> CacheTiers:
    """The tiers' storage for a cache whose `store` has tiers and whose
    `pools` (per group, by layer) are allocated: the disk directory opened,
    locked and restored into `store` (a fresh one); its index written every
    `checkpoint_interval` seconds of disk activity. Raises
    `InvalidArgument` for a disk tier without a directory or fingerprint,
    `DiskCacheLocked` for a directory in use."""
    config = store.config
    pages, slots = record_stores(pools, recurrent, store.is_hybrid)
    disk = None
    if config.num_disk_blocks:
        if disk_cache is None or not model_fingerprint:
            raise InvalidArgument(
                "a disk tier needs disk_cache (a directory) and model_fingerprint")
        fingerprint = records_fingerprint(model_fingerprint, block_size, kv_format, pages, slots)
        kinds = [RecordKind(page_kind(g), p.nbytes, config.num_disk_blocks)
                 for g, p in enumerate(pages) if p is not None]
        if slots is not None:
            kinds.append(RecordKind(SLOTS, slots.nbytes, config.num_disk_slots))
        disk = DiskTier(disk_cache, fingerprint, kinds)
        _restore(store, disk)
    return CacheTiers(pages, slots, num_host_pages=config.num_host_cache_blocks,
                      num_host_slots=config.num_host_cache_slots, disk=disk,
                      checkpoint_interval=checkpoint_interval)


def _restore(store: GroupedStore, disk: DiskTier) -> None:
    found = disk.restored
    if not found:
        disk.keep([])
        return
    rejected = {id(entry) for entry in store.restore_disk([item.entry for item in found])}
    kept = [item for item in found if id(item.entry) not in rejected]
    disk.keep(kept)
    log.info("disk cache %s: %d cached prefixes restored (%d not restorable)",
             disk.directory, len(kept), len(found) - len(kept))
