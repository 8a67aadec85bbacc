"""Speculative decoding for the `Engine`: a draft model proposes, the target verifies.

One `Speculator.run` per step takes the step's decode rows (one sample,
a short pending chunk: the last sampled token, or after a rejected hybrid
row the tokens since its checkpoint) and

1. brings each sequence's copy in the draft model's own paged storage up
   to its tokens (`allocate` with its prefix cache, or `append`);
2. drafts up to k tokens per row: one batched draft forward over every
   row's pending tokens, then k - 1 batched one-token forwards inside a
   speculation transaction of the draft storage;
3. opens a speculation transaction on the target storage with every row's
   drafts and verifies them all in one batched forward (row = pending
   tokens + drafts, right-padded);
4. accepts (`accept_greedy` / `accept_sampled`), commits both stores and
   returns each row's tokens as `AcceptedTokens` for `Scheduler.update`.

A forward that raises aborts both transactions (nothing of the step
counts) and is re-raised for the engine's fault handling. See
design/speculation.md for the acceptance rule and the recurrent rollback.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from blockmgr.errors import IntegrityError, OutOfBlocks, OutOfSlots
from cache import PagedCache
from scheduler.core.records import AcceptedTokens, ScheduledSeq
from scheduler.core.request import Request, SamplingParams
from scheduler.engine.runner import ModelRunner
from scheduler.engine.sampling import KeyChain, adjust_logits, filtered_logprobs


@dataclass(slots=True)
class SpeculationCounts:
    """What one `Speculator.run` did: draft tokens proposed, accepted,
    forwards of the draft and of the target model, target tokens to compute
    again because a hybrid row's checkpoint came back."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_draft_forwards: int = 0
    num_target_forwards: int = 0
    num_recomputed: int = 0  # tokens pending again after a checkpoint restore


@dataclass(slots=True)
class _Row:
    """One decode row under speculation."""

    item: ScheduledSeq
    request: Request  # item.request (a scheduled row's, never None)
    sample_index: int  # item.sample_index (an eligible row's, never None)
    tokens: list[int]  # the sample's tokens: prompt + outputs
    max_drafts: int  # drafts this row may take (its remaining length - 1)
    drafts: list[int] = field(default_factory=list)
    draft_logprobs: list[mx.array] = field(default_factory=list)  # per draft (sampled rows)
    in_draft_store: bool = False
    num_spec_drafts: int = 0  # drafts appended inside the draft transaction

    @property
    def seq_id(self) -> Hashable:
        return self.item.seq_id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling

    def history(self, num_drafts: int) -> tuple[list[int], list[int]]:
        """(prompt, output + the first `num_drafts` drafts): what penalties
        and processors see at the position after those drafts."""
        request = self.request
        output = request.outputs[self.sample_index]
        return request.prompt_tokens, list(output) + self.drafts[:num_drafts]


class Speculator:
    """Drafts with `draft_model` on `draft_cache`, verifies with the target
    model on `target_cache` (both `cache.PagedCache`); every forward goes
    through one `ModelRunner` per model (`self.draft`, `self.target`:
    `forward_logits`). Not thread-safe.

    Cost per step: 1 + (k - 1) draft forwards and one target forward over
    rows of (pending + k) tokens, plus one slot copy per hybrid row and
    store (the checkpoint).
    """

    def __init__(
        self,
        model: Any,
        target_cache: PagedCache,
        draft_model: Any,
        draft_cache: PagedCache,
        num_speculative_tokens: int,
        *,
        batched: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        """`batched`: ragged multi-token rows may share a forward (the
        models' `BatchSupport.prefill`); else rows run one by one."""
        #: the target's and the draft's forwards (`ModelRunner.forward_logits`)
        self.target = ModelRunner(model, target_cache)
        self.draft = ModelRunner(draft_model, draft_cache)
        self.k = num_speculative_tokens
        self.batched = batched
        self.max_model_len = max_model_len

    @property
    def model(self) -> Any:
        """The target model (its runner's; a wrapper may replace it)."""
        return self.target.model

    @model.setter
    def model(self, model: Any) -> None:
        self.target.model = model

    @property
    def draft_model(self) -> Any:
        """The draft model (its runner's; a wrapper may replace it)."""
        return self.draft.model

    @draft_model.setter
    def draft_model(self, model: Any) -> None:
        self.draft.model = model

    @property
    def cache(self) -> PagedCache:
        """The target's storage."""
        return self.target.cache

    @property
    def draft_cache(self) -> PagedCache:
        """The draft model's storage."""
        return self.draft.cache

    def eligible(self, item: ScheduledSeq) -> bool:
        """Can this scheduled row be speculated? A sampling row of one
        sample past its prompt, with a short pending chunk, no logprobs."""
        request = item.scheduled_request
        return (
            item.sample
            and item.num_samples == 1
            and item.sample_index is not None
            and item.start_position >= len(request.prompt_tokens)
            and item.num_tokens <= self.k + 2
            and request.sampling.logprobs is None
        )

    def release_ended(self) -> None:
        """Free the draft copies of sequences the target store no longer
        holds (finished, aborted, preempted by recompute); their computed
        tokens go into the draft's prefix cache."""
        target = self.cache
        for seq_id in self.draft_cache.sequence_ids():
            if seq_id not in target:
                self.draft_cache.free(seq_id)

    # ------------------------------------------------------------------ run

    def run(
        self, items: Sequence[ScheduledSeq], keys: Mapping[Hashable, KeyChain]
    ) -> tuple[dict[Hashable, AcceptedTokens], SpeculationCounts]:
        """Draft, verify and accept for `items` (all `eligible`); returns the
        `AcceptedTokens` of each and the step's counts. A raising forward
        leaves both stores as before the call (transactions aborted)."""
        self.release_ended()
        counts = SpeculationCounts()
        rows = [self._row(item) for item in items]
        try:
            self._draft(rows, keys, counts)
            accepted = self._verify(rows, keys, counts)
        except BaseException:
            self._abort(rows)
            raise
        return accepted, counts

    def _row(self, item: ScheduledSeq) -> _Row:
        request = item.scheduled_request
        index = item.sample_index
        if index is None:  # `eligible` rows are one sample's
            raise IntegrityError(f"speculating {item.seq_id!r}, a prompt shared by samples")
        output = request.outputs[index]
        tokens = request.prompt_tokens + output
        remaining = request.sampling.max_tokens - len(output)
        if self.max_model_len is not None:
            remaining = min(remaining, self.max_model_len - len(tokens))
        return _Row(item, request, index, tokens, max(0, min(self.k, remaining - 1)))

    # ---------------------------------------------------------------- draft

    def _draft(self, rows: list[_Row], keys, counts: SpeculationCounts) -> None:
        """Up to `max_drafts` draft tokens per row (fewer when the draft
        storage is short of pages)."""
        drafting = [r for r in rows if r.max_drafts and self._sync_draft(r)]
        if not drafting:
            return
        self._prefill_prompts(drafting, counts)
        pending = [r.tokens[self.draft_cache.num_computed(r.seq_id):] for r in drafting]
        self._draft_step(drafting, pending, keys, counts)
        more = [r for r in drafting if r.max_drafts > 1]
        if more and self.draft_cache.can_speculate({r.seq_id: [] for r in more}):
            self.draft_cache.begin_speculation({r.seq_id: [] for r in more})
            for r in more:
                r.in_draft_store = True  # a transaction is open: commit or abort it
        else:
            more = []
        while more:
            more = [r for r in more if self._append_draft(r)]
            if more:
                self._draft_step(more, [[r.drafts[-1]] for r in more], keys, counts)
                more = [r for r in more if len(r.drafts) < r.max_drafts]

    def _prefill_prompts(self, rows: list[_Row], counts: SpeculationCounts) -> None:
        """Compute the uncomputed prompt part of new draft copies and
        snapshot the prompt's end (best effort), so that later prompts
        sharing it hit the draft's prefix cache (hybrid hits end at
        snapshots only)."""
        draft = self.draft_cache
        new = [r for r in rows if draft.num_computed(r.seq_id) < len(r.request.prompt_tokens)]
        if not new:
            return
        inputs = [r.tokens[draft.num_computed(r.seq_id):len(r.request.prompt_tokens)]
                  for r in new]
        _forward_last(self.draft, new, inputs, self.batched)
        counts.num_draft_forwards += 1 if self.batched else len(new)
        for r in new:
            try:
                draft.cache_prefix(r.seq_id)
            except (OutOfBlocks, OutOfSlots):
                pass  # a snapshot is an optimization only

    def _sync_draft(self, row: _Row) -> bool:
        """Make the draft store hold the row's tokens with at least one to
        compute; False (nothing held) when it has no room."""
        draft, seq_id, tokens = self.draft_cache, row.seq_id, row.tokens
        if seq_id in draft:
            held = draft.tokens(seq_id)
            if len(held) < len(tokens) and tokens[: len(held)] == held:
                try:
                    draft.append(seq_id, tokens[len(held):])
                    return True
                except (OutOfBlocks, OutOfSlots):
                    pass
            draft.free(seq_id)
        try:
            draft.allocate(seq_id, tokens)
        except (OutOfBlocks, OutOfSlots):
            return False
        return True

    def _append_draft(self, row: _Row) -> bool:
        """Reserve the row's last draft in the draft store (inside its
        transaction); False when there is no room (the row drafts no more)."""
        try:
            self.draft_cache.append(row.seq_id, row.drafts[-1:])
        except (OutOfBlocks, OutOfSlots):
            return False
        row.num_spec_drafts += 1
        return True

    def _draft_step(self, rows: list[_Row], inputs: list[list[int]], keys, counts) -> None:
        """One draft forward over `inputs`; each row's next draft token from
        the last real position (its distribution kept for sampled rows)."""
        last = _forward_last(self.draft, rows, inputs, self.batched)
        counts.num_draft_forwards += 1 if self.batched else len(rows)
        histories = [r.history(len(r.drafts)) for r in rows]
        adjusted = adjust_logits(last, [r.params for r in rows], histories)
        tokens: list[mx.array] = []
        for b, r in enumerate(rows):
            if r.params.greedy:
                tokens.append(mx.argmax(adjusted[b]))
            else:
                logprobs = _sampling_logprobs(adjusted[b : b + 1], r.params)[0]
                r.draft_logprobs.append(logprobs)
                chain = _key(keys, r)
                tokens.append(mx.random.categorical(logprobs, key=chain.next() if chain else None))
        drafted = cast("list[int]", mx.stack(tokens).tolist())  # one token id per row
        for r, token in zip(rows, drafted):
            r.drafts.append(int(token))
        counts.num_drafted += len(rows)

    # --------------------------------------------------------------- verify

    def _verify(self, rows: list[_Row], keys, counts) -> dict[Hashable, AcceptedTokens]:
        """The target's batched forward over pending + drafts, acceptance,
        and both commits."""
        target = self.cache
        drafts = {r.seq_id: r.drafts for r in rows if r.drafts}
        dropped = list(reversed([r for r in rows if r.drafts]))
        while drafts and not target.can_speculate(drafts):
            r = dropped.pop(0)  # no room for its drafts: a plain decode row
            del drafts[r.seq_id]
            counts.num_drafted -= len(r.drafts)
            r.drafts, r.draft_logprobs = [], []
        if drafts:
            target.begin_speculation(drafts)
        inputs = [r.item.token_ids + r.drafts for r in rows]
        logits = _forward_positions(self.target, rows, inputs, self.batched)
        counts.num_target_forwards += 1 if self.batched else len(rows)
        results = [
            accept_greedy(r, logits[b]) if r.params.greedy
            else accept_sampled(r, logits[b], _key(keys, r))
            for b, r in enumerate(rows)
        ]
        target.commit_speculation(
            {r.seq_id: num for r, (num, _) in zip(rows, results) if r.drafts}
        )
        self._commit_draft(rows, results)
        out = {}
        for r, (num, token) in zip(rows, results):
            counts.num_accepted += num
            num_computed = target.num_computed(r.seq_id)
            kept = r.item.start_position + r.item.num_tokens + num
            counts.num_recomputed += kept - num_computed
            out[r.seq_id] = AcceptedTokens((*r.drafts[:num], token), num_computed)
        return out

    def _commit_draft(self, rows: list[_Row], results) -> None:
        accepted = {
            r.seq_id: min(num, r.num_spec_drafts)
            for r, (num, _) in zip(rows, results)
            if r.in_draft_store
        }
        if accepted:
            self.draft_cache.commit_speculation(accepted)
        for r in rows:
            r.in_draft_store = False

    def _abort(self, rows: list[_Row]) -> None:
        """Close whatever transaction the failed step left open."""
        for cache in (self.cache, self.draft_cache):
            open_ids = [r.seq_id for r in rows if r.seq_id in cache
                        and cache.speculation_start(r.seq_id) is not None]
            if open_ids:
                cache.abort_speculation(open_ids)


# ------------------------------------------------------------- acceptance


def accept_greedy(row: _Row, logits: mx.array) -> tuple[int, int]:
    """(drafts accepted, next token) at temperature 0: drafts are kept while
    they equal the target's argmax (after the row's logit processing, each
    position with its own history); the next token is the target's argmax
    after the last accepted one. Exactly the tokens plain greedy decoding
    gives. `logits`: ``[len(drafts) + 1, V]``."""
    n = len(row.drafts) + 1
    adjusted = adjust_logits(logits, [row.params] * n, [row.history(i) for i in range(n)])
    choice = cast("list[int]", mx.argmax(adjusted, axis=-1).tolist())  # a token id per position
    num = 0
    while num < len(row.drafts) and row.drafts[num] == choice[num]:
        num += 1
    return num, int(choice[num])


def accept_sampled(row: _Row, logits: mx.array, key: KeyChain | None) -> tuple[int, int]:
    """(drafts accepted, next token) at temperature > 0, by the standard
    rejection rule: draft x_i (drawn from q_i) is kept with probability
    min(1, p_i(x_i) / q_i(x_i)); at the first rejection the next token is
    drawn from norm(max(0, p_i - q_i)), and when all are kept from p_k.
    p and q are the target's and the draft's distributions after the same
    processing (`sampling.sample_rows`: processors, bias, penalties,
    top-p / min-p / top-k, temperature), so every output token is
    distributed exactly as the target's own sampling."""
    n = len(row.drafts) + 1
    adjusted = adjust_logits(logits, [row.params] * n, [row.history(i) for i in range(n)])
    logp = _sampling_logprobs(adjusted, row.params)
    num = 0
    if row.drafts:
        index = mx.array(row.drafts)
        positions = mx.arange(len(row.drafts))
        p = mx.exp(logp[positions, index])
        q = mx.exp(mx.stack(row.draft_logprobs)[positions, index])
        u = mx.random.uniform(shape=(len(row.drafts),), key=key.next() if key else None)
        keep = cast("list[bool]", (u * q < p).tolist())  # one bool per draft
        while num < len(keep) and keep[num]:
            num += 1
    target = mx.exp(logp[num])
    if num < len(row.drafts):
        residual = mx.maximum(target - mx.exp(row.draft_logprobs[num]), 0.0)
        total = residual.sum()
        target = mx.where(total > 0, residual / mx.maximum(total, 1e-30), target)
    token = mx.random.categorical(mx.log(target), key=key.next() if key else None)
    return num, int(cast(int, token.item()))  # a scalar token id


def _sampling_logprobs(adjusted: mx.array, params: SamplingParams) -> mx.array:
    """log of the distribution `sample_rows` draws from: filtered log-softmax
    scaled by 1 / temperature, renormalized. ``[R, V]``."""
    scaled = filtered_logprobs(adjusted, params) * (1.0 / params.temperature)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def _key(keys: Mapping[Hashable, KeyChain], row: _Row) -> KeyChain | None:
    return keys.get(row.item.request_id)


# ---------------------------------------------------------------- forwards


def _forward_last(runner: ModelRunner, rows: list[_Row], inputs, batched: bool) -> mx.array:
    """Logits ``[B, V]`` at each row's last input position."""
    picks = [[len(x) - 1] for x in inputs]
    return mx.concatenate(runner.forward_logits([r.seq_id for r in rows], inputs, picks,
                                                batched))


def _forward_positions(runner: ModelRunner, rows: list[_Row], inputs,
                       batched: bool) -> list[mx.array]:
    """Per row, logits ``[len(drafts) + 1, V]`` at the positions that predict
    each draft and the token after them."""
    picks = [list(range(len(x) - len(r.drafts) - 1, len(x))) for r, x in zip(rows, inputs)]
    return runner.forward_logits([r.seq_id for r in rows], inputs, picks, batched)
