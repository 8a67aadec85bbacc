"""deepseek_v41's ``LayerCache`` protocol over paged storage (`CompressedLayer`).

mlx-lm's deepseek_v41 layer reads and writes its cache by attribute:

* ``cache.offset`` (the first layer's: the step's start position) and
  ``cache.window`` (its width: rows the window held before the step);
* ``cache.update_window(kv)``: append the step's KV rows ``[B, N, D]`` and
  return the window before the step plus those rows;
* ``cache.pending_kv`` / ``cache.pending_gate``: the projections of the open
  group's tokens, read then replaced (a compressing layer with ratio > 1);
* ``cache.compress_kv`` / ``cache.index_k``: every closed group's entry so
  far, read, then replaced by the same plus this step's new entries.

`CompressedLayerView` serves these from the layer's positions: the window
through its `AttentionView` (a sliding window of window + 1 keys), the
entries from pages where entry g sits at the token that closes its group,
(g + 1) * ratio - 1 (only those tokens are written, only they are read), and
the open group from a recurrent slot (2 arrays of ratio - 1 rows, filled from
the front). Entries and window follow the tokens, so prefix reuse needs only
the slot's snapshot, like any hybrid model.

mlx-lm's model takes one start position and one window width for a whole
batch and masks no padding, so a view serves one row per forward; a batch
raises `InvalidArgument` (the engine's batch probe then runs rows alone).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import mlx.core as mx
import numpy as np

from blockmgr.errors import IntegrityError, InvalidArgument
from cache.layers import CompressedLayer
from cache.page_pool import PagePool, head_rows
from cache.step_plan import StepPlan
from cache.views import AttentionView, BatchState

PoolFor = Callable[[int, mx.array | None, mx.array | None], PagePool | None]


class CompressedLayerView:
    """One deepseek_v41 layer's cache for one sequence (see the module doc).

    `window`: the window position's `AttentionView` and group; `entries`:
    (group, layer) of the entries position, None when the layer does not compress;
    the open group is `batch.recurrent[layer.positions[2]]` when the layer
    has one. Cost per step: the window's write and gather, one eval'd token
    gather of the entries read (count = computed tokens / ratio), one token
    scatter of the new entries, one slot read and write of the open group.
    """

    __slots__ = ("_batch", "_layer", "_window", "_window_group", "_entries", "_pool_for",
                 "_set", "_forwards", "_parts")

    def __init__(
        self,
        batch: BatchState,
        layer: CompressedLayer,
        window: tuple[AttentionView, int],
        entries: tuple[int, int] | None,
        pool_for: PoolFor,
    ) -> None:
        self._batch = batch
        self._layer = layer
        self._window, self._window_group = window
        self._forwards = 0  # forwards whose window update ran
        self._entries = entries
        self._pool_for = pool_for
        # Arrays the model set in the current step (by attribute name), and
        # the step they belong to: what it reads back within that step.
        self._set: tuple[int, dict[str, mx.array]] = (-1, {})
        # Parts written in a step (window, open group rows, entries), and that
        # step: the layer has written its step once every part the step needs has.
        self._parts: tuple[int, set[str]] = (-1, set())

    # --- start of a forward (the model reads the first layer's) -------------

    @property
    def offset(self) -> int:
        return self._one_row_offset()

    def _one_row_offset(self) -> int:
        offset = self._window.offset
        if not isinstance(offset, int):
            raise InvalidArgument(
                f"deepseek_v41's layer cache serves one row per forward, not "
                f"{len(self._batch.seq_ids)} (mlx-lm's model takes one start position)")
        return offset

    @property
    def window_size(self) -> int:
        return self._layer.window

    @property
    def window(self) -> mx.array | None:
        """The window's rows before the step, ``[1, min(window, offset), D]``
        (None before any token). Read at the start of a forward (the model
        reads it for its width): it starts the step, covering the reserved
        tokens or `num_new` as for models that never build a mask. Cost: a
        gather of those rows, evaluated (a lazy read of the pool would make
        the step's write copy it)."""
        plan = self._start_step()
        offset = plan.offsets[0]
        kept = min(self._layer.window, offset)
        pool = self._pool_for(self._layer.positions[0], None, None)
        if kept == 0 or pool is None:
            return None
        keys, _ = pool.read_tokens(*_token_index(plan, np.arange(offset - kept, offset)))
        mx.eval(keys)
        return keys[None]

    def update_window(self, kv: mx.array) -> mx.array:
        """Write the step's rows ``[1, N, D]``; the window before the step
        and the new rows, ``[1, min(window, offset) + N, D]``."""
        self._one_row_offset()
        keys = kv[:, None]
        values = mx.zeros((*keys.shape[:-1], 0), kv.dtype)
        k_hist, _ = self._window.update_and_fetch(keys, values)
        self._forwards += 1
        self._part_written("window")
        return k_hist[:, 0]

    # --- the compressed entries ---------------------------------------------

    @property
    def compress_kv(self) -> mx.array | None:
        return self._read_entries("compress_kv", 0)

    @compress_kv.setter
    def compress_kv(self, value: mx.array) -> None:
        self._set_entries("compress_kv", value)
        if not self._layer.indexes:  # no index key follows: write now
            self._write_entries(value, None)

    @property
    def index_k(self) -> mx.array | None:
        return self._read_entries("index_k", 1)

    @index_k.setter
    def index_k(self, value: mx.array) -> None:
        compressed = self._current().get("compress_kv")
        if compressed is None:
            raise InvalidArgument(f"{self._layer}: index keys set before this step's entries")
        self._set_entries("index_k", value)
        self._write_entries(compressed, value)

    # --- the open group (recurrent slot) ------------------------------------

    @property
    def pending_kv(self) -> mx.array | None:
        return self._read_open(0)

    @pending_kv.setter
    def pending_kv(self, value: mx.array) -> None:
        self._write_open(0, value)

    @property
    def pending_gate(self) -> mx.array | None:
        return self._read_open(1)

    @pending_gate.setter
    def pending_gate(self, value: mx.array) -> None:
        self._write_open(1, value)

    # --- the rest of the protocol -------------------------------------------

    @property
    def state(self) -> tuple:
        """The window's pool arrays, for `mx.eval` only."""
        return self._window.state

    def is_trimmable(self) -> bool:
        return False  # the open group is recurrent state (see PagedCache.truncate)

    def trim(self, n: int) -> int:
        return 0

    def empty(self) -> bool:
        return self._window.empty()

    @property
    def nbytes(self) -> int:
        """Bytes of the window pages the sequence holds."""
        return self._window.nbytes

    def __repr__(self) -> str:
        return f"CompressedLayerView({self._layer}, seqs={list(self._batch.seq_ids)})"

    # --- internals ------------------------------------------------------------

    def _start_step(self) -> StepPlan:
        """The window group's plan of this forward's step, started if no
        layer started it yet."""
        batch = self._batch
        if batch.steps == self._forwards:
            batch.plan(batch.steps, self._window_group, None)
        return batch.plans[self._window_group]

    def _plan(self) -> StepPlan:
        """The step the window's update started (the model compresses after it)."""
        batch = self._batch
        if batch.steps == 0:
            raise InvalidArgument("deepseek_v41 layer cache: compressed state before the window")
        plan = batch.plans[0]
        if not plan.exact:
            raise InvalidArgument("deepseek_v41's layer cache serves one unpadded row per forward")
        return plan

    def _current(self) -> dict[str, mx.array]:
        step, arrays = self._set
        return arrays if step == self._batch.steps else {}

    def _set_entries(self, name: str, value: mx.array) -> None:
        if self._set[0] != self._batch.steps:
            self._set = (self._batch.steps, {})
        self._set[1][name] = value

    def _entry_plan(self) -> tuple[StepPlan, PagePool | None, int, int]:
        """(plan of the entries' group, their pool, entries before the step, after it)."""
        self._plan()
        group, position = self._entries_position()
        plan = self._batch.plans[group]
        ratio = self._layer.ratio
        start = plan.offsets[0]
        return plan, self._pool_for(position, None, None), start // ratio, \
            (start + plan.num_queries) // ratio

    def _entries_position(self) -> tuple[int, int]:
        if self._entries is None:
            raise InvalidArgument(f"{self._layer} keeps no compressed entries")
        return self._entries

    def _read_entries(self, name: str, which: int) -> mx.array | None:
        """The entries so far: what the model set this step, else the
        entries of the groups closed before it (None when there are none)."""
        current = self._current()
        if name in current:
            return current[name]
        plan, pool, before, _ = self._entry_plan()
        if before == 0 or pool is None:
            return None
        rows, cols = _entry_index(plan, 0, before, self._layer.ratio)
        arrays = pool.read_tokens(rows, cols)
        mx.eval(arrays)  # before this step's write into the pool (in place)
        return arrays[which][None]

    def _write_entries(self, compressed: mx.array, index_keys: mx.array | None) -> None:
        """Write this step's new entries at the tokens that close their groups."""
        plan, pool, before, after = self._entry_plan()
        if after == before:
            return
        keys = compressed[0, before:after]
        width = 0 if index_keys is None else index_keys.shape[-1]
        values = (mx.zeros((after - before, 0), keys.dtype) if index_keys is None
                  else index_keys[0, before:after])
        if pool is None:
            _, position = self._entries_position()
            shape = (1, 1, 1)
            pool = self._pool_for(position, mx.zeros((*shape, keys.shape[-1]), keys.dtype),
                                  mx.zeros((*shape, width), keys.dtype))
            if pool is None:
                raise IntegrityError(f"compressed layer {position}: no pool after its first write")
        rows, cols = _entry_index(plan, before, after, self._layer.ratio)
        pool.write(rows, cols, keys, values)
        self._part_written("entries")

    def _open_view(self) -> Any:
        self._plan()
        if not self._layer.has_open_group:
            raise InvalidArgument(f"{self._layer} keeps no open group")
        recurrent: Mapping[int, Any] = self._batch.recurrent
        return recurrent[self._layer.positions[2]]

    def _read_open(self, which: int) -> mx.array | None:
        """The open group's rows before the step (None when it is empty)."""
        view = self._open_view()
        rows = view[which]
        count = self._plan().offsets[0] % self._layer.ratio
        if rows is None or count == 0:
            return None
        return rows[:, :count]

    def _write_open(self, which: int, value: mx.array) -> None:
        """Keep the open group's rows ``[1, k, D]`` (k < ratio), front-filled."""
        view = self._open_view()
        free = self._layer.ratio - 1 - value.shape[1]
        view[which] = mx.pad(value, [(0, 0), (0, free), (0, 0)]) if free else value
        self._part_written(f"open{which}")

    def _part_written(self, part: str) -> None:
        """Record a written part; tell the batch once the step's parts are
        all written: the window, the open group's two arrays (a layer that
        has one), the entries of the groups the step closes (a layer that
        compresses)."""
        batch = self._batch
        if self._parts[0] != batch.steps:
            self._parts = (batch.steps, set())
        parts = self._parts[1]
        parts.add(part)
        needed = {"window"}
        if self._layer.has_open_group:
            needed |= {"open0", "open1"}
        if self._layer.compresses:
            plan = batch.plans[self._entries_position()[0]]
            start = plan.offsets[0]
            if (start + plan.num_queries) // self._layer.ratio > start // self._layer.ratio:
                needed.add("entries")
        if needed <= parts:
            batch.wrote(self)


def _entry_index(plan: StepPlan, first: int, stop: int, ratio: int) -> tuple[mx.array, mx.array]:
    """Pool (row, column) of entries [first, stop) of the plan's one row:
    entry g at token (g + 1) * ratio - 1."""
    return _token_index(plan, (np.arange(first, stop) + 1) * ratio - 1)


def _token_index(plan: StepPlan, tokens: np.ndarray) -> tuple[mx.array, mx.array]:
    """Pool (row, column) of the plan's one row's `tokens` (within the pages
    the step gathers: from the window's first page on)."""
    bs = plan.block_size
    pages = plan.pages[0][(tokens - int(plan.base[0])) // bs]
    rows = head_rows(pages, 1, plan.num_blocks)[0]
    return mx.array(rows.astype(np.int32)), mx.array((tokens % bs).astype(np.int32))
