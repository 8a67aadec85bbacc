"""What moving a page between the prefix cache's tiers costs on this machine
(`blockmgr calibrate`; design/simulator.md, "Cache tiers").

The real storage moves the pages: a `PagedCache` of the calibrated model
with a host tier and a disk tier in `directory` (the directory a server
would be given), its `CacheTiers.move_pages` applying `MovePage` runs as a
plan's would. Timed per page, each the best of `repeats` runs:

* host moves: device -> host (a gather, one evaluation, a copy into the
  host rows) and host -> device (a scatter, evaluated); their mean is
  `host_move_per_page`;
* disk stores: the part a forward waits for (the device read and the copy
  queued to the writer) is `disk_store_per_page`; the writer's `pwrite`s
  and one `fsync`, timed apart, give the write bandwidth;
* disk loads: records read back with the OS's copies of the file dropped
  first (`posix_fadvise(DONTNEED)` after an `fsync`, where the system has
  it: a cold read, as after a restart), verified (CRC-32) and written to
  device pages: `disk_load_per_page`, and the read bandwidth.

A page here is one record of layer group 0: every layer of that group, K
and V, in the model's page format (the simulator prices each page and
snapshot moved alike). Cost: O(pages x record bytes) of I/O, seconds.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from blockmgr.errors import InvalidArgument
from blockmgr.ops import MovePage, Tier


@dataclass(frozen=True, slots=True)
class TierBandwidth:
    """Per-page seconds of tier moves (the `CostModel` terms) and the
    bandwidths they imply, for records of `record_nbytes`."""

    record_nbytes: int
    num_pages: int
    host_move_per_page: float
    disk_store_per_page: float
    disk_load_per_page: float
    host_copy_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    cold_reads: bool  # the OS's cached copies were dropped before the loads

    def cost_terms(self) -> dict[str, float]:
        """The `CostModel` fields this measures."""
        return {"host_move_per_page": self.host_move_per_page,
                "disk_store_per_page": self.disk_store_per_page,
                "disk_load_per_page": self.disk_load_per_page}

    def to_dict(self) -> dict:
        return asdict(self)


def measure_tier_moves(model: Any, block_size: int, num_pages: int = 64,
                       directory: str | os.PathLike[str] | None = None, repeats: int = 3,
                       clock: Callable[[], float] = time.perf_counter) -> TierBandwidth:
    """Time `num_pages` pages moved between the tiers of a cache of `model`
    (see the module doc). `directory`: where the disk tier's files go (a
    new temporary directory inside it, removed after; default the system's
    temporary directory). Raises `ValueError` for a count below 1."""
    if num_pages < 1 or repeats < 1:
        raise InvalidArgument(f"num_pages and repeats must be >= 1, got {num_pages}, {repeats}")
    with tempfile.TemporaryDirectory(prefix="blockmgr-calibrate-", dir=directory) as tmp:
        return _measure(model, block_size, num_pages, Path(tmp), repeats, clock)


def _measure(model: Any, block_size: int, num_pages: int, directory: Path, repeats: int,
             clock: Callable[[], float]) -> TierBandwidth:
    import mlx.core as mx

    pc = _tiered_cache(model, block_size, num_pages, directory)
    tiers = pc.tiers
    assert tiers is not None and tiers.disk is not None
    disk = tiers.disk
    nbytes = tiers.record_nbytes("pages0")
    pages = range(num_pages)

    def moves(src: Tier, dst: Tier) -> list[MovePage]:
        return [MovePage(page, page, 0, src, dst) for page in pages]

    def timed(action: Callable[[], None]) -> float:
        start = clock()
        action()
        return clock() - start

    def to_device(src: Tier) -> None:
        tiers.move_pages(0, moves(src, Tier.DEVICE))
        # the scatter is lazy: the next forward would pay it
        mx.eval([pool.arrays() for pool in pc.pools().values()])

    out = min(timed(lambda: tiers.move_pages(0, moves(Tier.DEVICE, Tier.HOST)))
              for _ in range(repeats))
    back = min(timed(lambda: to_device(Tier.HOST)) for _ in range(repeats))
    store = write = load = float("inf")
    cold = False
    for _ in range(repeats):
        store = min(store, timed(lambda: tiers.move_pages(0, moves(Tier.DEVICE, Tier.DISK))))
        write = min(write, timed(lambda: _written(disk)))
        cold = _drop_cached_copies(disk.directory / "pages0.bin")
        load = min(load, timed(lambda: to_device(Tier.DISK)))
    pc.reset_prefix_cache()
    disk.close()
    total = num_pages * nbytes
    host_move = (out + back) / 2 / num_pages
    return TierBandwidth(
        record_nbytes=nbytes, num_pages=num_pages, host_move_per_page=host_move,
        disk_store_per_page=store / num_pages, disk_load_per_page=load / num_pages,
        host_copy_bytes_per_s=nbytes / host_move, disk_write_bytes_per_s=total / write,
        disk_read_bytes_per_s=total / load, cold_reads=cold)


def _tiered_cache(model: Any, block_size: int, num_pages: int, directory: Path) -> Any:
    """A cache of `model` with `num_pages` device pages and as many host
    and disk pages (group 0's records), its disk tier in `directory`."""
    from cache import PagedCache
    from cache.tier_setup import PAGES_PER_SNAPSHOT

    probe = PagedCache.for_model(model, num_blocks=1, block_size=block_size, num_slots=1)
    _touch(model, probe)
    page = probe.nbytes  # every group's page, the tiers' unit
    budget = (num_pages + PAGES_PER_SNAPSHOT) * page * 2 + (1 << 20)
    return PagedCache.for_model(model, num_blocks=num_pages, block_size=block_size,
                                num_slots=1, host_cache_size=budget, disk_cache=directory,
                                disk_cache_size=budget)


def _touch(model: Any, cache: Any) -> None:
    """One one-token forward: the pools take their shapes."""
    import mlx.core as mx

    cache.allocate("probe", [0])
    with cache.step(["probe"], num_new=[1]) as views:
        mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=views))
    cache.free("probe")


def _written(disk: Any) -> None:
    """Wait for the queued records to be written, and make them durable."""
    disk.sync()
    for name in disk.kinds:
        with open(disk.directory / f"{name}.bin", "rb+") as f:
            os.fsync(f.fileno())


def _drop_cached_copies(path: Path) -> bool:
    """Ask the OS to drop its cached copy of `path` (written and synced):
    the next reads come from the disk. False where it cannot be asked."""
    advise = getattr(os, "posix_fadvise", None)  # Linux, not macOS
    if advise is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True
