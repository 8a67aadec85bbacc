"""Simulated step time: what a forward pass over a scheduled batch would cost.

The simulator runs no model; each scheduler step advances the simulated clock
by `CostModel.time_of(StepShape)`:

    step_overhead
    + prefill_per_token  * prefill tokens
    + decode_per_token   * decode rows (one token each)
    + attention_per_context_token * sum over scheduled sequences of the
                                    context they attend to (chunk end)
    + prefill_chunk_overhead * prefill chunks (one forward each)
    + prefill_sample_overhead * prefill chunks that sample (a second
                                forward of one token, the LM head)
    + prefill_attention_per_token_pair * sum over prefill chunks of
                                new tokens x (keys before the chunk + new
                                tokens / 2)
    + decode_batch_overhead * (1 if any decode row)
    + decode_padded_context_token * decode rows x longest decode context
    + random_sample_per_row * tokens drawn at temperature > 0 (softmax and a
                              categorical draw over the vocabulary, per row)
    + prefill_chunk_token_square * sum over prefill chunks of new tokens^2
                              (a long chunk costs more per token: its whole
                              score block is computed under the causal mask,
                              and its activations outgrow the CPU caches)
    + decode_forward_overhead * (1 if any decode row or any chunk that
                              samples: the engine runs one batched forward
                              of the decode rows and the last token of every
                              sampling chunk, so a chunk beside decode rows
                              adds a row to that forward, not a forward)
    + decode_attention_per_context_token * decode keys (the keys all decode
                              rows read, summed: the part of the context
                              term the decode forward reads)
    + decode_attention_beyond_knee * max(0, decode keys - decode_context_knee)
                              (past a few thousand keys per step the paged
                              attention's per-page partial results outgrow
                              the CPU's caches and every further key costs
                              more: convex, piecewise linear; measured on a
                              2-core EPYC with a 32 MB L3, the slope more than
                              doubles past ~12-16k keys)
    + copy_per_page      * CopyBlock ops  (+ copy_per_slot * CopySlot/ZeroSlot)
    + swap_per_page      * swap ops
    + host_move_per_page * prefix-cache pages and snapshots moved between the
                              device and the host tier (a demotion or a load)
    + disk_load_per_page * pages and snapshots loaded from the disk tier (a
                              read the forward waits for)
    + disk_store_per_page * pages and snapshots demoted to the disk tier
                              (written behind the forward: 0 unless the
                              writes outrun the disk)

A "decode row" is a sequence scheduled for one token, a prefill chunk one
scheduled for more (the engine's own split: all one-token rows run in one
batched forward, each longer chunk alone). All figures are seconds. The
defaults describe a ~7B model on one accelerator roughly (a few thousand
prefill tokens/s, ~30 ms per decode step at small batch); the terms after
the first four default to 0. Context counts are what the model's attention
layers read (`attended`: a sliding layer at most its window), so a profile
prices the layout it was calibrated on. `blockmgr calibrate` fits all of them to the
real engine on one machine (see calibrate.py). Cost: O(1) per step, plus
O(scheduled sequences + ops) for `step_shape`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from blockmgr import CopyBlock, CopySlot, ZeroSlot
from blockmgr.errors import InvalidArgument
from blockmgr.ops import MovePage, MoveSlot, SwapIn, SwapInSlot, SwapOut, SwapOutSlot, Tier
from blockmgr.validation import check_number

_SWAP_OPS = (SwapOut, SwapIn, SwapOutSlot, SwapInSlot)
_SLOT_OPS = (CopySlot, ZeroSlot)
_MOVE_OPS = (MovePage, MoveSlot)


@dataclass(slots=True, frozen=True)
class StepShape:
    """What one step computes, in the terms the cost model prices."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    context_tokens: float = 0  # keys read: fractional when layers read different counts
    prefill_chunks: int = 0
    sampled_chunks: int = 0
    prefill_token_pairs: float = 0.0
    longest_decode_context: float = 0.0
    random_samples: int = 0
    page_copies: int = 0
    slot_copies: int = 0
    swaps: int = 0
    prefill_token_squares: int = 0
    decode_context_tokens: float = 0.0  # keys the decode rows read, summed
    host_moves: int = 0  # prefix-cache pages/snapshots moved between device and host
    disk_loads: int = 0  # ... loaded from disk
    disk_stores: int = 0  # ... written to disk

    @property
    def runs_decode_forward(self) -> bool:
        """The step runs the batched one-token forward: a decode row, or the
        last token of a chunk that samples."""
        return bool(self.decode_rows or self.sampled_chunks)

    def terms(self, knee: float = 0.0) -> tuple[float, ...]:
        """The multiplier of each `CostModel` coefficient (`COEFFICIENTS`, in
        field order), the decode keys past `knee` for the one past the knee."""
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.decode_rows),
            float(self.context_tokens),
            float(self.page_copies),
            float(self.slot_copies),
            float(self.swaps),
            float(self.prefill_chunks),
            float(self.sampled_chunks),
            float(self.prefill_token_pairs),
            1.0 if self.decode_rows else 0.0,
            float(self.decode_rows * self.longest_decode_context),
            float(self.random_samples),
            float(self.prefill_token_squares),
            1.0 if self.runs_decode_forward else 0.0,
            float(self.decode_context_tokens),
            max(0.0, self.decode_context_tokens - knee),
            float(self.host_moves),
            float(self.disk_loads),
            float(self.disk_stores),
        )


def step_shape(out, attended: Callable[[int], float] | None = None) -> StepShape:
    """The shape of a `SchedulerOutput` (its rows, items and plan).
    O(rows + items + ops); the rows' sums run at C speed for full attention.

    `attended(end)`: the keys a query at position end - 1 reads, averaged
    over the model's attention layers (`ModelLayout.attended`: a sliding
    window reads at most W); None: every key before it (full attention).
    It counts the context, a prefill chunk's keys before its start, and
    the longest decode row's keys.
    """
    sums = _ShapeSums()
    positions = out.rows.positions
    done = 0
    # Running order: with a sliding window the keys are fractional, and float
    # sums depend on their order.
    for item, mark in zip(out.items, out.item_rows):
        if mark > done:
            sums.add_rows(positions, done, mark, attended)
            done = mark
        sums.add_item(item, attended)
    sums.add_rows(positions, done, len(positions), attended)
    sums.drawn += sum(1 for req in out.rows.requests if req.sampling.temperature > 0)
    last_end = sums.last_end
    longest = last_end if attended is None or not sums.decode else attended(last_end)  # monotone
    copies, slots, swaps, host, loads, stores = count_ops(out.ops)
    return StepShape(sums.prefill, sums.decode, sums.context, sums.chunks, sums.sampled,
                     sums.pairs, longest, sums.drawn, copies, slots, swaps, sums.squares,
                     sums.decode_keys, host, loads, stores)


@dataclass(slots=True)
class _ShapeSums:
    """`step_shape`'s running sums, added in running order."""

    prefill: int = 0
    decode: int = 0
    context: float = 0
    chunks: int = 0
    sampled: int = 0
    drawn: int = 0
    squares: int = 0
    last_end: int = 0
    pairs: float = 0.0
    decode_keys: float = 0.0

    def add_rows(self, positions: list[int], start: int, stop: int,
                 attended: Callable[[int], float] | None) -> None:
        """Decode rows `start:stop` (one token at each position)."""
        if stop <= start:
            return
        if attended is None:  # integer keys: their sum is exact in any order
            ends = positions[start:stop]
            keys: float = sum(ends) + len(ends)  # an int here, a float from `attended` below
            self.context += keys
            self.decode_keys += keys
            self.last_end = max(self.last_end, max(ends) + 1)
        else:
            for position in positions[start:stop]:
                end = position + 1
                keys = attended(end)
                self.context += keys
                self.decode_keys += keys
                if end > self.last_end:
                    self.last_end = end
        self.decode += stop - start

    def add_item(self, item, attended: Callable[[int], float] | None) -> None:
        """One record: a prefill chunk, or a one-token record (a decode row)."""
        start = item.start_position
        n = len(item.token_ids)
        if item.sample and item.request is not None and item.request.sampling.temperature > 0:
            self.drawn += item.num_samples
        if n == 1:
            self.add_rows([start], 0, 1, attended)
            return
        end = start + n
        self.context += end if attended is None else attended(end)
        self.prefill += n
        self.chunks += 1
        self.sampled += item.sample
        self.pairs += n * ((start if attended is None else attended(start)) + n / 2)
        self.squares += n * n


def count_ops(ops) -> tuple[int, int, int, int, int, int]:
    """(page copies, slot copies/zeroes, swapped pages or slots, host-tier
    moves, disk loads, disk stores) of a plan. O(ops)."""
    pages = slots = swaps = host = loads = stores = 0
    for op in ops or ():
        kind = type(op)
        if kind is CopyBlock:
            pages += 1
        elif kind in _SLOT_OPS:
            slots += 1
        elif kind in _SWAP_OPS:
            swaps += 1
        elif kind in _MOVE_OPS:
            if op.dst_tier == Tier.DISK:
                stores += 1
            elif op.src_tier == Tier.DISK:
                loads += 1
            else:
                host += 1
    return pages, slots, swaps, host, loads, stores


@dataclass(slots=True, frozen=True)
class CostModel:
    """Per-step time in simulated seconds; every field finite and >= 0.

    Every field but the last is a coefficient (`COEFFICIENTS`), in the order
    of `StepShape.terms()`; `decode_context_knee` (keys) is where the decode
    keys' second slope starts (the fit picks it among `KNEES`).
    """

    step_overhead: float = 0.020
    prefill_per_token: float = 0.00025
    decode_per_token: float = 0.0008
    attention_per_context_token: float = 0.0000005
    copy_per_page: float = 0.00002
    copy_per_slot: float = 0.0002
    swap_per_page: float = 0.0001
    prefill_chunk_overhead: float = 0.0
    prefill_sample_overhead: float = 0.0
    prefill_attention_per_token_pair: float = 0.0
    decode_batch_overhead: float = 0.0
    decode_padded_context_token: float = 0.0
    random_sample_per_row: float = 0.0
    prefill_chunk_token_square: float = 0.0
    decode_forward_overhead: float = 0.0
    decode_attention_per_context_token: float = 0.0
    decode_attention_beyond_knee: float = 0.0
    host_move_per_page: float = 0.0001
    disk_load_per_page: float = 0.0005
    disk_store_per_page: float = 0.0
    decode_context_knee: float = 0.0

    def __post_init__(self) -> None:
        for item in fields(self):
            check_number(f"cost {item.name}", getattr(self, item.name), 0.0)
        # A fit can price a small model's steps by their forwards alone (every
        # chunk and every decode forward pays an overhead), so those count too.
        if (self.step_overhead + self.prefill_per_token + self.decode_per_token
                + self.prefill_chunk_overhead + self.decode_forward_overhead) <= 0:
            raise InvalidArgument("a step must cost some time: step_overhead, prefill_per_token, "
                                  "decode_per_token, prefill_chunk_overhead and "
                                  "decode_forward_overhead cannot all be 0")

    def time_of(self, shape: StepShape) -> float:
        """Seconds the step of this shape takes: the sum over fields of field
        x the matching `shape.terms()` entry, written out (once per step, so
        it must be cheap). O(1)."""
        s = shape
        return (
            self.step_overhead
            + self.prefill_per_token * s.prefill_tokens
            + self.decode_per_token * s.decode_rows
            + self.attention_per_context_token * s.context_tokens
            + self.copy_per_page * s.page_copies
            + self.copy_per_slot * s.slot_copies
            + self.swap_per_page * s.swaps
            + self.prefill_chunk_overhead * s.prefill_chunks
            + self.prefill_sample_overhead * s.sampled_chunks
            + self.prefill_attention_per_token_pair * s.prefill_token_pairs
            + (self.decode_batch_overhead if s.decode_rows else 0.0)
            + self.decode_padded_context_token * s.decode_rows * s.longest_decode_context
            + self.random_sample_per_row * s.random_samples
            + self.prefill_chunk_token_square * s.prefill_token_squares
            + (self.decode_forward_overhead if s.decode_rows or s.sampled_chunks else 0.0)
            + self.decode_attention_per_context_token * s.decode_context_tokens
            + (self.decode_attention_beyond_knee
               * (s.decode_context_tokens - self.decode_context_knee)
               if s.decode_context_tokens > self.decode_context_knee else 0.0)
            + self.host_move_per_page * s.host_moves
            + self.disk_load_per_page * s.disk_loads
            + self.disk_store_per_page * s.disk_stores
        )

    def step_time(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        context_tokens: int = 0,
        page_copies: int = 0,
        slot_copies: int = 0,
        swapped_pages: int = 0,
    ) -> float:
        """Seconds of a step given by its first-order terms only (the others
        count as 0). O(1)."""
        return self.time_of(StepShape(
            prefill_tokens=prefill_tokens, decode_rows=decode_tokens,
            context_tokens=context_tokens, page_copies=page_copies,
            slot_copies=slot_copies, swaps=swapped_pages,
        ))

    def coefficients(self) -> tuple[float, ...]:
        """The `COEFFICIENTS`' values: `time_of(shape)` is their dot product
        with `shape.terms(self.decode_context_knee)`."""
        return tuple(getattr(self, name) for name in COEFFICIENTS)

    def scaled(self, factor: float) -> CostModel:
        """This model with every coefficient times `factor` (the knee, a
        count of keys, kept): every step priced `factor` times as long (a
        machine that much slower). Raises ValueError as the constructor."""
        return replace(self, **{name: getattr(self, name) * factor for name in COEFFICIENTS})

    def to_dict(self) -> dict:
        return {item.name: getattr(self, item.name) for item in fields(self)}


#: The `CostModel` fields that multiply a `StepShape.terms()` entry, in order.
COEFFICIENTS = tuple(item.name for item in fields(CostModel) if item.name != "decode_context_knee")

#: The knees the fit tries (decode keys per step): powers of two and their
#: halfway points from 256 to 96k (the step from one to the next is 1.5x or
#: 1.33x), and 0 (no second slope).
KNEES = (0.0,) + tuple(float(base << shift) for shift in range(9) for base in (256, 384))
