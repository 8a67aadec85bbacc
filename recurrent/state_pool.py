"""Slot pool of one recurrent layer: its state arrays, one row per slot.

A recurrent layer keeps a fixed number of state arrays (mlx-lm's
`ArraysCache(size=n)`): e.g. LFM2 keeps the conv tail `[B, K-1, C]`,
Qwen3-Next the conv tail and the delta state `[B, Hv, Dv, Dk]` (float32).
The pool stores each of them for every slot: array `i` is
`[num_slots, *spec(i).shape]`. Row `s` of every array is slot `s`'s state.

Shapes may be unknown up front (mlx-lm fills an `ArraysCache` on first use):
an array whose spec is not known yet is *unmaterialized* and every slot of it
reads as `None`, which mlx-lm models treat as the zero state. The first write
allocates it (zeros) with the written value's per-row shape and dtype.

In-place rule (measured on MLX 0.32, CPU): `pool[idx] = x` reuses the pool's
buffer only if, when the scatter is evaluated, nothing else references the
pool array it overwrites -- including a not yet evaluated gather from it.
So the pool never hands out its arrays, gathers by index (copies, never
slice views), and plan copies evaluate their gathered rows before scattering.
Forward-pass writes stay lazy; the caller evaluates the forward's outputs
first and the pool afterwards (`flush`, or implicitly by the next gather).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from blockmgr.errors import IntegrityError, InvalidArgument
from blockmgr.ops import MemoryOp

from .batch import SlotBatch, make_batch
from .plan import SlotRemap, compile_slot_plan

# Row size from which writes go run by run as slice updates instead of one
# indexed scatter. Measured on MLX 0.32 CPU: the indexed scatter moves ~0.5
# GB/s (161 ms for 32 rows of 2 MiB) while slice updates run near memcpy
# speed (7.6 ms); below ~4-8 KiB per row the per-op overhead of one slice
# update per run costs more than the scatter saves.
_SLICE_WRITE_MIN_ROW_BYTES = 8192


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """Per-slot shape and dtype of one state array."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d
        return n


class StatePool:
    """The state arrays of one recurrent layer for `num_slots` slots.

    Cost: `gather`/`scatter` are one lazy MLX gather/scatter each (O(batch)
    rows moved). `apply_plan` is one gather + one scatter per materialized
    array for the whole plan, whatever its length.
    """

    __slots__ = ("_num_slots", "_arrays", "_specs")

    def __init__(
        self,
        num_slots: int,
        num_arrays: int,
        specs: Sequence[ArraySpec | None] | None = None,
    ) -> None:
        """`specs[i]` preallocates array `i`; `None` leaves it to the first write."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidArgument(f"num_slots must be a positive int, got {num_slots!r}")
        if isinstance(num_arrays, bool) or not isinstance(num_arrays, int) or num_arrays < 1:
            raise InvalidArgument(f"num_arrays must be a positive int, got {num_arrays!r}")
        specs = list(specs) if specs is not None else [None] * num_arrays
        if len(specs) != num_arrays:
            raise InvalidArgument(f"{len(specs)} specs for {num_arrays} arrays")
        self._num_slots = num_slots
        self._specs: list[ArraySpec | None] = specs
        self._arrays: list[mx.array | None] = [
            None if s is None else mx.zeros((num_slots, *s.shape), dtype=s.dtype) for s in specs
        ]
        live = [a for a in self._arrays if a is not None]
        if live:
            mx.eval(live)

    # ---- shape ---------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_arrays(self) -> int:
        return len(self._arrays)

    def spec(self, i: int) -> ArraySpec | None:
        """Per-slot shape/dtype of array `i`; `None` until it is first written."""
        return self._specs[self._check_index(i)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the materialized arrays."""
        return sum(s.nbytes for s in self._specs if s is not None) * self._num_slots

    @property
    def bytes_per_slot(self) -> int | None:
        """Bytes of one slot's state; `None` while some array's shape is unknown."""
        known = [s for s in self._specs if s is not None]
        if len(known) < len(self._specs):
            return None
        return sum(s.nbytes for s in known)

    # ---- batch access (used by the views) --------------------------------

    def gather(self, i: int, batch: SlotBatch) -> mx.array | None:
        """Array `i` of the batch's slots as a new `[B, ...]` array, lazily.

        `None` when array `i` is unmaterialized (every slot holds the zero state).
        One indexed gather (a copy, never a view of the pool).
        """
        arr = self._arrays[self._check_index(i)]
        return None if arr is None else arr[batch.index]

    def scatter(self, i: int, batch: SlotBatch, value: mx.array) -> None:
        """Write `value[b]` into slot `batch.slots[b]` of array `i`, lazily, in place.

        The value is cast to the array's dtype. Rows of 8 KiB or more are
        written as one slice update per run of consecutive slots, smaller
        ones with one indexed scatter (see `_SLICE_WRITE_MIN_ROW_BYTES`).
        Raises `InvalidArgument` on a shape mismatch (pool unchanged).
        """
        i = self._check_index(i)
        if not isinstance(value, mx.array) or value.ndim < 1 or value.shape[0] != len(batch):
            raise InvalidArgument(
                f"array {i}: expected a [{len(batch)}, ...] mx.array, got "
                f"{getattr(value, 'shape', type(value).__name__)}"
            )
        if batch.slots and max(batch.slots) >= self._num_slots:
            raise InvalidArgument(f"batch slots {batch.slots} exceed pool of {self._num_slots}")
        spec, arr = self._specs[i], self._arrays[i]
        if spec is None or arr is None:  # unmaterialized (both are None together)
            spec = ArraySpec(tuple(value.shape[1:]), value.dtype)
            arr = mx.zeros((self._num_slots, *spec.shape), dtype=spec.dtype)
            self._specs[i] = spec
            self._arrays[i] = arr
        elif tuple(value.shape[1:]) != spec.shape:
            raise InvalidArgument(
                f"array {i}: per-slot shape {tuple(value.shape[1:])} != pool's {spec.shape}"
            )
        if value.dtype != spec.dtype:
            value = value.astype(spec.dtype)
        _write_rows(arr, batch, value, spec.nbytes)

    def read_slot(self, slot: int) -> list[mx.array | None]:
        """Copies of one slot's arrays (`None` where unmaterialized). Evaluated."""
        batch = make_batch([self._check_slot(slot)], None, self._num_slots)
        out = [self.gather(i, batch) for i in range(self.num_arrays)]
        mx.eval([o for o in out if o is not None])
        return [None if o is None else o[0] for o in out]

    def flush(self) -> None:
        """Evaluate pending writes (call after evaluating the forward's outputs)."""
        live = [a for a in self._arrays if a is not None]
        if live:
            mx.eval(live)

    # ---- plans -------------------------------------------------------------

    def apply_plan(self, ops: Iterable[MemoryOp]) -> None:
        """Apply a plan's `ZeroSlot`/`CopySlot` ops (in order) as one batched remap.

        Raises `InvalidArgument` on a bad op or slot; the pool is unchanged then.
        """
        remap = compile_slot_plan(ops, self._num_slots)
        if remap is None:
            return
        rows = self.remap_rows(remap)
        mx.eval([r for r in rows if r is not None])  # see remap_rows
        self.write_remap(remap, rows)

    def remap_rows(self, remap: SlotRemap) -> list[mx.array | None]:
        """Per array, the rows `remap` copies (gathered from current contents).

        Lazy; `None` for an unmaterialized array or a plan without copies.
        The caller must evaluate them before `write_remap`: a gather and a
        write of the same array in one evaluation make MLX copy the whole
        array. Split from `write_remap` so a caller holding many pools
        evaluates all their rows at once (see `RecurrentPools`).
        """
        self._check_remap(remap)
        if not remap.copy_src:
            return [None] * len(self._arrays)
        src = mx.array(remap.copy_src, dtype=mx.int32)  # may repeat: not a SlotBatch
        return [None if arr is None else arr[src] for arr in self._arrays]

    def write_remap(self, remap: SlotRemap, rows: list[mx.array | None]) -> None:
        """Write the copied rows from `remap_rows` and zero `remap.zero` (lazy, in place)."""
        copies = make_batch(remap.copy_dst, None, self._num_slots) if remap.copy_dst else None
        zeros = make_batch(remap.zero, None, self._num_slots) if remap.zero else None
        for arr, spec, r in zip(self._arrays, self._specs, rows):
            if arr is None or spec is None:  # unmaterialized (both together): all zero
                continue
            if copies is not None:
                if r is None:
                    raise IntegrityError(f"remap copies rows into {remap.copy_dst} but none "
                                         "were gathered for a materialized array")
                _write_rows(arr, copies, r, spec.nbytes)
            if zeros is not None:
                _write_rows(arr, zeros, mx.zeros((), dtype=spec.dtype), spec.nbytes)

    # ---- checks ----------------------------------------------------------------

    def _check_remap(self, remap: SlotRemap) -> None:
        for s in remap.copy_dst + remap.copy_src + remap.zero:
            self._check_slot(s)

    def _check_slot(self, slot: object) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._num_slots:
            raise InvalidArgument(f"slot {slot!r} outside [0, {self._num_slots})")
        return slot

    def _check_index(self, i: object) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self._arrays):
            raise InvalidArgument(f"state array index {i!r} outside [0, {len(self._arrays)})")
        return i

    def __repr__(self) -> str:
        return f"StatePool(num_slots={self._num_slots}, specs={self._specs})"


def _write_rows(arr: mx.array, batch: SlotBatch, rows: mx.array, row_bytes: int) -> None:
    """`arr[batch.slots[b]] = rows[b]` for every b (or a broadcast scalar), in place.

    Item assignment on an `mx.array` rebinds that same Python object to the
    update's output, so every holder of the pool's list sees the new array.
    """
    if row_bytes < _SLICE_WRITE_MIN_ROW_BYTES:
        arr[batch.index] = rows
        return
    scalar = rows.ndim == 0
    for first, stop, row in batch.runs:
        arr[first:stop] = rows if scalar else rows[row : row + stop - first]
