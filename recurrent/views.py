"""Per-layer recurrent views: mlx-lm's `ArraysCache` protocol over a slot pool.

A `RecurrentView` stands for the slots of one batch in one recurrent layer,
for one forward pass. mlx-lm's recurrent layers (LFM2 `ShortConv`,
Qwen3-Next `GatedDeltaNet`, ...) use it exactly like an `ArraysCache`:

* `view[i]` gathers array `i` of the batch's slots (`None` while the pool's
  array is unmaterialized, which the models read as the zero state);
* `view[i] = x` sets the new state; `commit()` scatters every state set in
  the step back into the slots, in place (a forward that fails before its
  commit leaves the slots as they were);
* `lengths` (real tokens per row in this step, or `None` when no row is
  padded), `make_mask(N)` (right-padding mask, or `None`), `advance(n)`.

The view is always truthy: mlx-lm tests `if cache` to decide whether a layer
has state, and a falsy view would make Qwen3-Next drop the state silently.

Rows are right-padded: row `b` holds `lengths[b]` real tokens followed by
padding; the models mask padded positions and take the next conv tail from
each row's real end.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from blockmgr.errors import InvalidArgument

from .batch import SlotBatch
from .state_pool import StatePool


class RecurrentView:
    """One recurrent layer's state for the slots of one batch, for one step.

    Cost: construction O(1) MLX work (one small lengths array); each first
    `view[i]` one lazy gather; `commit()` one lazy scatter per array set.
    Values set during the step are kept, so reading after writing returns
    them without touching the pool again.
    """

    __slots__ = ("_pool", "_batch", "_values", "_dirty", "lengths")

    def __init__(self, pool: StatePool, batch: SlotBatch) -> None:
        """`batch` from `make_batch(..., pool.num_slots)`."""
        if batch.slots and max(batch.slots) >= pool.num_slots:
            raise InvalidArgument(f"batch slots {batch.slots} exceed pool of {pool.num_slots}")
        self._pool = pool
        self._batch = batch
        self._values: list[mx.array | None] = [None] * pool.num_arrays
        self._dirty: list[int] = []  # arrays set this step, not yet in the pool
        # Each view owns its lengths: layers advance them independently.
        self.lengths = None if batch.lengths is None else mx.array(batch.lengths, dtype=mx.int32)

    # ---- ArraysCache protocol --------------------------------------------

    def __getitem__(self, i: int) -> mx.array | None:
        i = self._array_index(i)
        value = self._values[i]
        if value is None:
            value = self._pool.gather(i, self._batch)
            self._values[i] = value
        return value

    def __setitem__(self, i: int, value: mx.array) -> None:
        i = self._array_index(i)
        self._values[i] = value
        if i not in self._dirty:
            self._dirty.append(i)

    def commit(self) -> None:
        """Scatter the arrays set this step into the slots (lazily, in place).
        Idempotent; raises `InvalidArgument` on a shape mismatch."""
        dirty, self._dirty = self._dirty, []
        for i in dirty:
            value = self._values[i]
            if value is None:  # the model set the array to None: nothing to write
                raise InvalidArgument(
                    f"array {i}: expected a [{len(self._batch)}, ...] mx.array, got NoneType")
            self._pool.scatter(i, self._batch, value)

    def _array_index(self, i: int) -> int:
        n = self._pool.num_arrays
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise InvalidArgument(f"state array index {i!r} outside [-{n}, {n})")
        return i + n if i < 0 else i  # negative indices, as on ArraysCache's list

    def __bool__(self) -> bool:
        return True  # a view always stands for at least one sequence

    def __len__(self) -> int:
        return self._pool.num_arrays

    def __iter__(self):
        """The arrays in order, as iterating an `ArraysCache`'s list (models
        unpack ``conv, state = cache``)."""
        return iter([self[i] for i in range(self._pool.num_arrays)])

    def advance(self, n: int) -> None:
        """The layer consumed `n` positions (padded included); as `ArraysCache`."""
        if self.lengths is not None:
            # Rebind, never `-=`: MLX's in-place operators mutate shared arrays.
            self.lengths = self.lengths - n

    def make_mask(self, n: int) -> mx.array | None:
        """`[B, n]` bool, true at real positions; `None` when no row is padded."""
        if self.lengths is None:
            return None
        return mx.arange(n)[None, :] < self.lengths[:, None]

    @property
    def state(self) -> list[mx.array | None]:
        """The batch's current arrays (gathered; values set this step win)."""
        return [self[i] for i in range(self._pool.num_arrays)]

    @state.setter
    def state(self, values: Sequence[mx.array | None]) -> None:
        if len(values) != self._pool.num_arrays:
            raise InvalidArgument(f"{len(values)} arrays for {self._pool.num_arrays}")
        for i, v in enumerate(values):
            if v is not None:
                self[i] = v

    def is_trimmable(self) -> bool:
        return False  # recurrent state cannot be rolled back token by token

    # ---- extras ------------------------------------------------------------

    @property
    def slots(self) -> tuple[int, ...]:
        return self._batch.slots

    @property
    def batch_size(self) -> int:
        return len(self._batch.slots)

    @property
    def nbytes(self) -> int:
        per_slot = sum(
            s.nbytes for s in (self._pool.spec(i) for i in range(self._pool.num_arrays)) if s
        )
        return per_slot * len(self._batch.slots)

    def __repr__(self) -> str:
        return f"RecurrentView(slots={self._batch.slots}, lengths={self.lengths})"
