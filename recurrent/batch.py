"""A validated batch of slots: which slot each batch row reads and writes.

Built once per forward pass (or per plan) and shared by every layer, so the
Python checks and the int32 index array are paid once, not per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from blockmgr.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class SlotBatch:
    """Row `b` uses slot `slots[b]`.

    * `index`: `slots` as an int32 array (for gathers and small scatters);
    * `runs`: `(first_slot, stop_slot, first_row)` for every maximal run of
      consecutive slots in consecutive rows (large rows are written run by
      run, see `StatePool.scatter`);
    * `lengths[b]`: real tokens of row `b` in this step; `None` = no padding.
    """

    slots: tuple[int, ...]
    index: mx.array
    runs: tuple[tuple[int, int, int], ...]
    lengths: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.slots)


def make_batch(
    slots: Sequence[int],
    lengths: Sequence[int] | mx.array | None,
    num_slots: int,
) -> SlotBatch:
    """Validate and pack a batch. O(B) Python work, no MLX evaluation
    (except reading `lengths` when it is given as an `mx.array`).

    Raises `InvalidArgument` on an empty batch, a repeated or out-of-range
    slot, or lengths of the wrong size or sign.
    """
    slots = tuple(slots)
    if not slots:
        raise InvalidArgument("a batch needs at least one slot")
    for s in slots:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots:
            raise InvalidArgument(f"slot {s!r} outside [0, {num_slots})")
    if len(set(slots)) != len(slots):
        # Two rows writing one slot means a copy-on-write was missed upstream.
        raise InvalidArgument(f"repeated slot in batch {slots}")
    if lengths is not None:
        if isinstance(lengths, mx.array):
            # a per-row lengths array is 1-D; int(n) below checks each element
            lengths = cast("list[int]", lengths.tolist())
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != len(slots) or min(lengths) < 0:
            raise InvalidArgument(f"lengths {lengths} do not fit a batch of {len(slots)}")
    return SlotBatch(slots, mx.array(slots, dtype=mx.int32), _runs(slots), lengths)


def _runs(slots: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    runs = []
    start = 0
    for b in range(1, len(slots) + 1):
        if b == len(slots) or slots[b] != slots[b - 1] + 1:
            runs.append((slots[start], slots[b - 1] + 1, start))
            start = b
    return tuple(runs)
