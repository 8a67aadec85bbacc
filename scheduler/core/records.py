"""The records the scheduler hands out and takes back: the work of a step
(`SchedulerOutput` of `ScheduledSeq` items and `DecodeRows`), what
`update` returns (`RequestOutput`) and takes for a speculative row
(`AcceptedTokens`), its counters (`SchedulerStats`) and one sequence as it
tracks it (`SequenceInfo`). Plain data; the rules are `scheduler.py`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from blockmgr.errors import IntegrityError
from scheduler.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step.

    token_ids: the tokens to compute, at positions start_position, ...;
    start_position: tokens of the sequence already computed (and stored);
    is_prefill: the chunk is part of a prompt (or of a recompute);
    sample: a token is sampled from the logits of the chunk's last token;
    num_samples: tokens to sample then (n for a prompt with n samples, else 1);
    sample_index: which sample this sequence is (None: a shared prompt).
    """

    seq_id: Hashable
    request_id: Hashable
    token_ids: list[int]
    start_position: int
    is_prefill: bool
    sample: bool
    num_samples: int = 1
    sample_index: int | None = 0
    request: Request | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def scheduled_request(self) -> Request:
        """The request of a row the scheduler scheduled (it always sets it;
        a record built by hand without one raises `IntegrityError`)."""
        if self.request is None:
            raise IntegrityError(f"scheduled row {self.seq_id!r} has no request")
        return self.request


@dataclass(slots=True)
class DecodeRows:
    """A step's decode rows in columns, with no record per row.

    Row i computes `tokens[i]`, the last sampled token of sample
    `sample_indices[i]` of `requests[i]` (sequence `seq_ids[i]`), at
    position `positions[i]`, and samples that sample's next token: the
    `ScheduledSeq(seq_ids[i], requests[i].request_id, [tokens[i]],
    positions[i], False, True, 1, sample_indices[i], requests[i])`
    (`record(i)`). Read-only for consumers.
    """

    seq_ids: list[Hashable] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def extend(self, seq_ids: list[Hashable], tokens: list[int], positions: list[int],
               sample_indices: list[int], requests: list[Request]) -> None:
        """Add rows: entry i of each list is one row's column. O(rows)."""
        self.seq_ids += seq_ids
        self.tokens += tokens
        self.positions += positions
        self.sample_indices += sample_indices
        self.requests += requests

    def record(self, i: int) -> ScheduledSeq:
        """Row i as a `ScheduledSeq`. O(1)."""
        req = self.requests[i]
        return ScheduledSeq(self.seq_ids[i], req.request_id, [self.tokens[i]], self.positions[i],
                            False, True, 1, self.sample_indices[i], req)


class SchedulerOutput:
    """What one step computes.

    Each piece of work is stored once: the decode rows in columns (`rows`,
    a `DecodeRows`) and the rest as records (`items`: prefill chunks,
    recomputes, speculative rows); `item_rows[k]` rows come before
    `items[k]` in running order. `seqs` is a view over both, every
    scheduled sequence's work as `ScheduledSeq`s in running order, built
    on each read (O(rows + items)); a consumer that handles many rows per
    step (the simulator, `Scheduler.update`) reads `rows` and `items`
    instead. An output built from records (`SchedulerOutput(step, seqs)`)
    has them all in `items`.

    `ops`: the `BlockManager` plans of this step's bookkeeping (and of the
    previous `update`), in call order, to apply before the forward pass
    (empty over a `PagedCache`, which applies its own).
    """

    __slots__ = ("step", "items", "item_rows", "rows", "num_batched_tokens", "num_prefill_tokens",
                 "num_decode_tokens", "preempted", "ops")

    def __init__(
        self,
        step: int,
        seqs: Sequence[ScheduledSeq] = (),
        *,
        num_batched_tokens: int = 0,
        num_prefill_tokens: int = 0,
        num_decode_tokens: int = 0,
        preempted: list[Hashable] | None = None,
        ops: tuple = (),
    ) -> None:
        self.step = step
        self.items: list[ScheduledSeq] = list(seqs)
        self.item_rows: list[int] = [0] * len(self.items)
        self.rows = DecodeRows()
        self.num_batched_tokens = num_batched_tokens
        self.num_prefill_tokens = num_prefill_tokens
        self.num_decode_tokens = num_decode_tokens
        self.preempted: list[Hashable] = [] if preempted is None else preempted
        self.ops = ops

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """Every scheduled sequence's work, in running order: a new list of
        the rows' records and the items, O(rows + items) a read."""
        rows, done = self.rows, 0
        records: list[ScheduledSeq] = []
        for item, mark in zip(self.items, self.item_rows):
            records += map(rows.record, range(done, mark))
            records.append(item)
            done = mark
        records += map(rows.record, range(done, len(rows)))
        return records

    @property
    def is_empty(self) -> bool:
        return not self.items and not self.rows.seq_ids

    def with_seqs(self, seqs: Sequence[ScheduledSeq]) -> SchedulerOutput:
        """This step's output with only `seqs` as its work (every other field
        as here), e.g. for `update` after some of the work did not run."""
        return SchedulerOutput(self.step, seqs, num_batched_tokens=self.num_batched_tokens,
                               num_prefill_tokens=self.num_prefill_tokens,
                               num_decode_tokens=self.num_decode_tokens,
                               preempted=self.preempted, ops=self.ops)

    def __repr__(self) -> str:
        return (f"SchedulerOutput(step={self.step}, rows={len(self.rows)}, "
                f"items={len(self.items)}, num_batched_tokens={self.num_batched_tokens}, "
                f"preempted={self.preempted!r})")


@dataclass(slots=True)
class RequestOutput:
    """Tokens a request gained in one `update` (or its end).

    new_tokens[i]: new tokens of sample i; finished: the whole request is
    done; status: the request's status; finish_reasons[i]: per sample;
    new_text[i] / logprobs[i]: the engine's text delta and `TokenLogprob`s
    of sample i (with a tokenizer / when asked for; None otherwise).
    """

    request_id: Hashable
    new_tokens: dict[int, list[int]]
    finished: bool
    status: RequestStatus
    finish_reasons: list[RequestStatus | None] = field(default_factory=list)
    # Filled by an engine with a tokenizer / with logprobs asked for (None otherwise):
    new_text: dict[int, str] | None = None  # text delta of sample i
    logprobs: dict[int, list] | None = None  # TokenLogprob per new token of sample i


@dataclass(frozen=True, slots=True)
class AcceptedTokens:
    """A speculative decode row's result, given to `update` in place of one
    sampled token: the accepted drafts and the token after them, and how
    many of the sequence's tokens the store holds as computed after the
    transaction's commit (a hybrid sequence that rejected a draft is back
    at its checkpoint: the tokens from there are computed again)."""

    tokens: tuple[int, ...]
    num_computed: int


@dataclass(slots=True)
class SchedulerStats:
    """Metrics of the last step (counts) and running totals (`*_total`)."""

    step: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_scheduled_seqs: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # cached tokens of this step's admissions
    num_admitted: int = 0
    num_preempted_recompute: int = 0
    num_preempted_swap: int = 0
    num_preempted_recompute_total: int = 0
    num_preempted_swap_total: int = 0
    num_prefix_hit_tokens_total: int = 0
    num_finished_total: int = 0
    num_aborted_total: int = 0
    page_usage: float = 0.0
    num_free_blocks: int = 0

    @property
    def num_preempted_total(self) -> int:
        return self.num_preempted_recompute_total + self.num_preempted_swap_total


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """One sequence as the scheduler tracks it: a snapshot, read only.

    num_computed: its tokens whose KV the store holds as computed;
    num_reserved: its tokens with pages in the store (0: it holds none);
    swapped: preempted by swap (its pages in host memory until it is back);
    in_flight: scheduled in the last step, not yet applied by `update`;
    done: finished, stopped, aborted or replaced by its forks.
    """

    seq_id: Hashable
    request_id: Hashable
    num_tokens: int
    num_computed: int
    num_reserved: int
    swapped: bool
    in_flight: bool
    done: bool
