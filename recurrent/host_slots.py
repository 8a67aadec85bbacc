"""Host-side copies of recurrent slots (swap space) for one `StatePool`.

`BlockManager.swap_out` moves a hybrid sequence's slot to a host slot
(`SwapOutSlot(src, dst_host)`), `swap_in` back to a fresh device slot
(`SwapInSlot(src_host, dst)`). A `HostSlots` keeps, per state array of one
layer, a numpy array ``[num_host_slots, *per_slot_shape]``; a batch of slots
moves with one device gather (evaluated) and one numpy write, or one numpy
gather and one in-place device write.

Values are stored bit for bit (unsigned integers of the dtype's size), so
bfloat16 round-trips exactly. Arrays are allocated on first use with
`np.zeros` (which the OS backs lazily: untouched host slots take no
resident memory). An array the device pool never materialized stays
unmaterialized here too: every slot of it is the zero state, on either
side. A host slot swapped out while its array was unmaterialized is still
the zero state once another slot's swap out allocates the array: nothing
was copied to it, and the allocation is zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument

from .batch import make_batch
from .state_pool import StatePool

_RAW = {1: (mx.uint8, np.uint8), 2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32),
        8: (mx.uint64, np.uint64)}


class HostSlots:
    """Host copies of one layer's slots; see the module doc."""

    __slots__ = ("num_host_slots", "_arrays")

    def __init__(self, num_host_slots: int, num_arrays: int) -> None:
        if isinstance(num_host_slots, bool) or not isinstance(num_host_slots, int) \
                or num_host_slots < 1:
            raise InvalidArgument(f"num_host_slots must be a positive int, got {num_host_slots!r}")
        self.num_host_slots = num_host_slots
        self._arrays: list[np.ndarray | None] = [None] * num_arrays

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays if a is not None)

    def swap_out(self, pool: StatePool, slots: Sequence[int], host_slots: Sequence[int]) -> None:
        """Copy device `slots[i]` of `pool` into host slot `host_slots[i]`.

        The gathered rows are evaluated before returning, so the device slots
        may be reused right after. Cost: O(bytes moved).
        """
        self._check(host_slots)
        unique = sorted(set(slots))  # forked sequences may share a device slot
        batch = make_batch(unique, None, pool.num_slots)
        rows = [pool.gather(i, batch) for i in range(pool.num_arrays)]
        raw = [None if r is None else r.view(_RAW[r.dtype.size][0]) for r in rows]
        mx.eval([r for r in raw if r is not None])
        dst = np.asarray(host_slots, dtype=np.int64)
        pick = np.searchsorted(np.asarray(unique), np.asarray(slots))
        for i, r in enumerate(raw):
            if r is None:
                continue
            host = self._arrays[i]
            if host is None:
                host = np.zeros((self.num_host_slots, *r.shape[1:]), _RAW[r.dtype.size][1])
                self._arrays[i] = host
            host[dst] = np.asarray(r)[pick]

    def swap_in(self, pool: StatePool, host_slots: Sequence[int], slots: Sequence[int]) -> None:
        """Copy host slot `host_slots[i]` into device slot `slots[i]` (lazy,
        in place). Cost: O(bytes moved)."""
        self._check(host_slots)
        batch = make_batch(slots, None, pool.num_slots)
        src = np.asarray(host_slots, dtype=np.int64)
        for i, host in enumerate(self._arrays):
            spec = pool.spec(i)
            if spec is None:  # unmaterialized on device: every slot is already zero
                continue
            if host is None:  # swapped out while unmaterialized: the zero state
                value = mx.zeros((len(batch), *spec.shape), spec.dtype)
            else:
                value = mx.array(host[src]).view(spec.dtype)
            pool.scatter(i, batch, value)

    def _check(self, host_slots: Sequence[int]) -> None:
        for s in host_slots:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.num_host_slots:
                raise InvalidArgument(f"host slot {s!r} outside [0, {self.num_host_slots})")
