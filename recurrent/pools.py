"""The slot pools of every recurrent layer of one model.

`RecurrentPools` maps each recurrent layer index (a layer whose mlx-lm
`make_cache()` entry is an `ArraysCache`) to its `StatePool`. It is what the
paged cache holds for hybrid models:

* `apply_plan(ops)` folds a block-manager plan once and applies it to every
  layer: one gather + one scatter per state array, and a single evaluation of
  all gathered rows for the whole model;
* `views(slots, lengths)` gives one `RecurrentView` per recurrent layer for
  a batch, to put in the model's cache list in place of its `ArraysCache`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

from blockmgr.errors import InvalidArgument
from blockmgr.ops import MemoryOp, SwapInSlot, SwapOutSlot

from .batch import make_batch
from .host_slots import HostSlots
from .plan import compile_slot_plan
from .state_pool import ArraySpec, StatePool
from .views import RecurrentView


def is_recurrent_cache(cache: Any) -> bool:
    """True for an mlx-lm `ArraysCache`-like layer cache (list of state arrays)."""
    return (
        isinstance(getattr(cache, "cache", None), list)
        and hasattr(cache, "advance")
        and hasattr(cache, "make_mask")
        and not hasattr(cache, "update_and_fetch")
    )


def cache_positions(caches: list) -> list:
    """The caches of `make_cache()` flat: a layer's ``CacheList`` members
    each take a position, in order (the positions `cache.layer_specs` uses)."""
    return [c for layer in caches for c in getattr(layer, "caches", (layer,))]


def probe_specs(model: Any) -> dict[int, list[ArraySpec | None]]:
    """Per-slot specs of every recurrent layer, read after a 1-token forward.

    Runs `model` once on token 0 with fresh `make_cache()` caches (cost: one
    tiny forward pass). Arrays a layer leaves unset stay `None`.
    """
    caches = model.make_cache()
    logits = model(mx.array([[0]], dtype=mx.int32), cache=caches)
    mx.eval(logits)
    specs: dict[int, list[ArraySpec | None]] = {}
    for layer, c in enumerate(cache_positions(caches)):
        if is_recurrent_cache(c):
            specs[layer] = [
                None if a is None else ArraySpec(tuple(a.shape[1:]), a.dtype) for a in c.cache
            ]
    return specs


class RecurrentPools:
    """`StatePool`s of a model's recurrent layers, all with `num_slots` slots.

    Slots are the block manager's recurrent slots: slot `s` of every layer
    together is one sequence's (or snapshot's) recurrent state.
    """

    __slots__ = ("_num_slots", "_pools", "_host")

    def __init__(
        self,
        num_slots: int,
        layer_sizes: Mapping[int, int],
        specs: Mapping[int, Sequence[ArraySpec | None]] | None = None,
        num_host_slots: int = 0,
    ) -> None:
        """`layer_sizes[layer]` = number of state arrays of that layer.

        `specs[layer]` optionally preallocates its arrays (see `StatePool`).
        `num_host_slots`: swap space (host copies, allocated on first use).
        """
        specs = specs or {}
        unknown = set(specs) - set(layer_sizes)
        if unknown:
            raise InvalidArgument(f"specs for non-recurrent layers {sorted(unknown)}")
        self._num_slots = num_slots
        self._pools: dict[int, StatePool] = {
            layer: StatePool(num_slots, size, specs.get(layer))
            for layer, size in sorted(layer_sizes.items())
        }
        self._host: dict[int, HostSlots] = (
            {layer: HostSlots(num_host_slots, size) for layer, size in sorted(layer_sizes.items())}
            if num_host_slots else {}
        )

    @classmethod
    def for_model(
        cls, model: Any, num_slots: int, *, probe: bool = True, num_host_slots: int = 0
    ) -> RecurrentPools:
        """Pools for every `ArraysCache` layer of `model.make_cache()`.

        `probe=True` preallocates the arrays from a 1-token forward
        (`probe_specs`), so memory is taken up front and `bytes_per_slot` is
        known; `probe=False` allocates each array on its first write.
        """
        sizes = {
            layer: len(c.cache)
            for layer, c in enumerate(cache_positions(model.make_cache()))
            if is_recurrent_cache(c)
        }
        specs = probe_specs(model) if probe and sizes else None
        return cls(num_slots, sizes, specs, num_host_slots)

    # ---- structure -----------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def layers(self) -> tuple[int, ...]:
        """Indices of the recurrent layers, ascending."""
        return tuple(self._pools)

    def pool(self, layer: int) -> StatePool:
        try:
            return self._pools[layer]
        except KeyError:
            raise InvalidArgument(f"layer {layer!r} is not a recurrent layer") from None

    def __contains__(self, layer: object) -> bool:
        return layer in self._pools

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools.values())

    @property
    def bytes_per_slot(self) -> int | None:
        """Bytes of one slot over all layers; `None` while some shape is unknown."""
        per = [p.bytes_per_slot for p in self._pools.values()]
        known = [b for b in per if b is not None]
        return None if len(known) < len(per) else sum(known)

    # ---- slot records (the prefix cache's host and disk tiers) ---------------

    @property
    def slot_record_nbytes(self) -> int | None:
        """Bytes of one slot as a record (`read_slot_records`): every layer's
        arrays, raw; `None` while some array's shape is unknown."""
        return self.bytes_per_slot

    def read_slot_records(self, slots: Sequence[int]) -> np.ndarray:
        """Slots `slots[i]` as rows of a ``[len(slots), slot_record_nbytes]``
        uint8 array: each layer's arrays in order, their raw bytes (bit for
        bit, bfloat16 included). One gather per array, evaluated, then one
        host copy. Raises `InvalidArgument` while a shape is unknown."""
        nbytes = self._record_nbytes()
        out = np.empty((len(slots), nbytes), np.uint8)
        if not slots:
            return out
        batch = make_batch(sorted(set(slots)), None, self._num_slots)
        pick = np.searchsorted(np.asarray(batch.slots), np.asarray(slots))
        rows = [p.gather(i, batch) for p in self._pools.values() for i in range(p.num_arrays)]
        raw = [r.view(mx.uint8).reshape(r.shape[0], -1) for r in rows if r is not None]
        mx.eval(raw)
        offset = 0
        for r in raw:
            width = r.shape[1]
            out[:, offset:offset + width] = np.asarray(r)[pick]
            offset += width
        return out

    def write_slot_records(self, slots: Sequence[int], records: np.ndarray) -> None:
        """Write record row i into slot `slots[i]` of every layer (lazy, in
        place; the inverse of `read_slot_records`). Cost: O(bytes moved)."""
        nbytes = self._record_nbytes()
        if records.shape != (len(slots), nbytes):
            raise InvalidArgument(
                f"slot records {records.shape} for {len(slots)} slots of {nbytes} bytes")
        if not slots:
            return
        batch = make_batch(list(slots), None, self._num_slots)
        offset = 0
        for p in self._pools.values():
            for i in range(p.num_arrays):
                spec = p.spec(i)
                assert spec is not None  # _record_nbytes checked every shape
                width = spec.nbytes
                part = np.ascontiguousarray(records[:, offset:offset + width])
                value = mx.array(part).view(spec.dtype).reshape(len(slots), *spec.shape)
                p.scatter(i, batch, value)
                offset += width

    def _record_nbytes(self) -> int:
        nbytes = self.bytes_per_slot
        if nbytes is None:
            raise InvalidArgument("a slot record needs every state array's shape (probe the pools)")
        return nbytes

    # ---- plans and views -------------------------------------------------------

    def apply_plan(self, ops: Iterable[MemoryOp]) -> None:
        """Apply the slot ops of a plan (in order) to every layer.

        `ZeroSlot`/`CopySlot` runs: one fold, one gather + one scatter per
        state array, one evaluation for the gathered rows of all layers.
        `SwapOutSlot`/`SwapInSlot` runs: one batched move per state array
        (see `HostSlots`). Page ops are ignored. Runs are applied in call
        order. Raises `InvalidArgument` on a bad op or slot; a remap run is
        checked before any pool is touched.
        """
        runs: list[tuple[type | None, list[MemoryOp]]] = []
        for op in ops:
            kind = type(op) if isinstance(op, (SwapOutSlot, SwapInSlot)) else None
            if runs and runs[-1][0] is kind:
                runs[-1][1].append(op)
            else:
                runs.append((kind, [op]))
        for kind, run in runs:
            if kind is None:
                self._apply_remap(run)
            else:  # a swap kind's run holds only ops of that kind (built above)
                self._swap(kind, cast("list[SwapOutSlot | SwapInSlot]", run))

    def _swap(self, kind: type, ops: list[SwapOutSlot | SwapInSlot]) -> None:
        """One batched host<->device move per layer for a run of slot swaps."""
        if not self._host:
            raise InvalidArgument(f"{ops[0]!r} but the pools have no host slots")
        src, dst = [op.src for op in ops], [op.dst for op in ops]
        for layer, pool in self._pools.items():
            if kind is SwapOutSlot:
                self._host[layer].swap_out(pool, src, dst)
            else:
                self._host[layer].swap_in(pool, src, dst)

    def _apply_remap(self, ops: list[MemoryOp]) -> None:
        if not ops:
            return
        remap = compile_slot_plan(ops, self._num_slots)
        if remap is None:
            return
        rows = {layer: p.remap_rows(remap) for layer, p in self._pools.items()}
        mx.eval([r for rs in rows.values() for r in rs if r is not None])
        for layer, p in self._pools.items():
            p.write_remap(remap, rows[layer])

    def views(
        self,
        slots: Sequence[int],
        lengths: Sequence[int] | mx.array | None = None,
    ) -> dict[int, RecurrentView]:
        """One view per recurrent layer for the batch `slots` (row b -> slots[b]).

        `lengths[b]` = real tokens of row b in this step (right padding);
        `None` when every row is full. Views serve one forward pass.
        """
        batch = make_batch(slots, lengths, self._num_slots)
        return {layer: RecurrentView(p, batch) for layer, p in self._pools.items()}

    def flush(self) -> None:
        """Evaluate pending state writes of all layers (after the forward's outputs)."""
        for p in self._pools.values():
            p.flush()

    def __repr__(self) -> str:
        return f"RecurrentPools(num_slots={self._num_slots}, layers={self.layers})"
