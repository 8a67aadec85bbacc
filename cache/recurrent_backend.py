"""`RecurrentBackend`: what `PagedCache` needs of the slot storage of a
model's recurrent layers (e.g. `recurrent.RecurrentPools`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from blockmgr.ops import MemoryOp


class RecurrentStepView(Protocol):
    """One recurrent layer's view of one step (mlx-lm's ``ArraysCache`` protocol).

    Writes (`view[i] = x`) are kept by the view until `commit()` stores them
    in the slots, so a forward that fails part-way leaves the slots as they
    were.
    """

    def commit(self) -> None: ...


class RecurrentBackend(Protocol):
    """Slot storage for recurrent layers (e.g. `recurrent.RecurrentPools`).

    `apply_plan` gets every slot op (`ZeroSlot`, `CopySlot`, `SwapOutSlot`,
    `SwapInSlot`) in call order; `views(slots, lengths)` gives one
    ArraysCache-like view per recurrent layer for one forward pass;
    `flush()` evaluates the state writes of committed steps. The prefix
    cache's host and disk tiers move snapshots as records: one slot's
    arrays, raw (`slot_record_nbytes`, None while a shape is unknown;
    `read_slot_records`, `write_slot_records`).
    """

    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def bytes_per_slot(self) -> int | None: ...
    def apply_plan(self, ops: Iterable[MemoryOp]) -> None: ...
    def views(
        self, slots: Sequence[int], lengths: Sequence[int] | None = None
    ) -> Mapping[int, RecurrentStepView]: ...
    def flush(self) -> None: ...
    @property
    def slot_record_nbytes(self) -> int | None: ...
    def read_slot_records(self, slots: Sequence[int]) -> np.ndarray: ...
    def write_slot_records(self, slots: Sequence[int], records: np.ndarray) -> None: ...
