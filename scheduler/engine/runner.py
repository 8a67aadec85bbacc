"""The model runner: the forward over paged storage and the sampling.

The engine schedules and keeps the books; for each batch of scheduled rows
it asks its `ModelRunner` (the `Runner` protocol) to run it: one forward of
the model over `PagedCache.step` views (rows right-padded to the longest),
then one token sampled for every row whose chunk samples
(`sampling.sample_rows`, with the request's seed key, grammar mask and
logprobs). A runner that raises has computed nothing: `PagedCache.step`
rolls the forward back, and the engine's fault handling
(`scheduler.engine.faults`) decides what runs again.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx

from blockmgr.errors import IntegrityError
from cache import PagedCache
from scheduler.core.records import ScheduledSeq
from scheduler.core.request import TokenLogprob
from scheduler.engine.sampling import KeyChain, sample_rows, token_logprobs


@dataclass(slots=True)
class StepSampling:
    """What sampling reads and writes in a step, kept by the engine.

    keys: request id -> its seed's key chain (seeded requests only);
    masks: (request id, sample index) -> the grammar's mask of the row
        (constrained requests only; filled before the forward);
    logprobs: (request id, sample index) -> the sampled token's logprobs,
        written by the runner for rows that ask for them."""

    keys: Mapping[Hashable, KeyChain]
    masks: Mapping[tuple[Hashable, int], Any]
    logprobs: dict[tuple[Hashable, int], TokenLogprob]


class Runner(Protocol):
    """What the engine asks of its model runner."""

    def run(self, batch: Sequence[ScheduledSeq],
            sampling: StepSampling) -> dict[Hashable, Any]:
        """One forward over `batch`; returns the samples of its sampling
        rows (seq id -> token, or a list of n tokens for a prompt with n
        samples). Raising means nothing was computed."""
        ...

    def warm_up(self) -> None:
        """One one-token forward on a sequence that is then dropped, so that
        the storage's pools take their shapes."""
        ...


class ModelRunner:
    """`Runner` of an mlx-lm model over a `PagedCache`. Cost of `run`: one
    forward of the model over the batch (padded to its longest row), plus
    one LM-head row gathered per sample."""

    __slots__ = ("model", "cache")

    def __init__(self, model: Any, cache: PagedCache) -> None:
        self.model = model
        self.cache = cache

    def run(self, batch: Sequence[ScheduledSeq],
            sampling: StepSampling) -> dict[Hashable, Any]:
        lengths = [s.num_tokens for s in batch]
        picks = [b for b, s in enumerate(batch) if s.sample]
        with self.cache.step([s.seq_id for s in batch], num_new=lengths) as views:
            logits = self.model(right_padded([s.token_ids for s in batch]), cache=views)
            values = self._sample(batch, picks, lengths, logits, sampling) if picks else []
            if not picks:
                self.cache.eval_state()  # the logits are not needed
        self._flush_state()
        sampled: dict[Hashable, Any] = {}
        i = 0
        for b in picks:
            s = batch[b]
            if s.num_samples == 1:
                sampled[s.seq_id] = values[i]
            else:
                sampled[s.seq_id] = values[i : i + s.num_samples]
            i += s.num_samples
        return sampled

    def _sample(self, batch: Sequence[ScheduledSeq], picks: list[int], lengths: list[int],
                logits: mx.array, sampling: StepSampling) -> list[int]:
        """Sample every picked row's last position (evaluated); the rows'
        logprobs, when asked for, go to `sampling.logprobs`."""
        row_index, params, keys, histories, samples, masks = [], [], [], [], [], []
        for b in picks:
            s = batch[b]
            request = s.request
            if request is None:
                raise IntegrityError(f"scheduled row {s.seq_id!r} has no request")
            for j in range(s.num_samples):
                index = j if s.sample_index is None else s.sample_index
                row_index.append(b)
                params.append(request.sampling)
                keys.append(sampling.keys.get(s.request_id))
                samples.append((s.request_id, index))
                output = request.outputs[index] if s.sample_index is not None else ()
                histories.append((request.prompt_tokens, output))
                masks.append(sampling.masks.get((s.request_id, index)))
        last = logits[mx.array(row_index), mx.array([lengths[b] - 1 for b in row_index])]
        tokens = sample_rows(last, params, keys, histories,
                             masks if sampling.masks else None)
        num_top = [p.logprobs for p in params]
        if any(k is not None for k in num_top):
            for sample, entry in zip(samples, token_logprobs(last, tokens, num_top)):
                if entry is not None:
                    sampling.logprobs[sample] = entry
        else:
            mx.eval(tokens)
        return cast("list[int]", tokens.tolist())  # one int32 token per row

    def forward_logits(self, seq_ids: Sequence[Hashable], inputs: Sequence[list[int]],
                       picks: Sequence[list[int]], batched: bool = True) -> list[mx.array]:
        """Forwards of `inputs[b]` (row b's new tokens) over `seq_ids[b]`'s
        storage, right-padded, all rows in one forward (`batched`) or one by
        one; per row its logits at positions `picks[b]`, evaluated (no
        sampling: speculation's drafts and verification). A raising forward
        computed nothing (`PagedCache.step` rolls it back). Cost: one
        forward per group, plus the picked logits."""
        groups = [list(range(len(inputs)))] if batched else [[b] for b in range(len(inputs))]
        out: dict[int, mx.array] = {}  # row -> its logits
        for group in groups:
            lengths = [len(inputs[b]) for b in group]
            with self.cache.step([seq_ids[b] for b in group], num_new=lengths) as views:
                logits = self.model(right_padded([inputs[b] for b in group]), cache=views)
                picked = [logits[i, mx.array(picks[b])] for i, b in enumerate(group)]
                mx.eval(picked)
            self._flush_state()
            for i, b in enumerate(group):
                out[b] = picked[i]
        return [out[b] for b in range(len(inputs))]

    def _flush_state(self) -> None:
        recurrent = self.cache.recurrent
        if recurrent is not None:
            recurrent.flush()

    def warm_up(self) -> None:
        cache, seq_id = self.cache, object()
        cache.allocate(seq_id, [0])
        try:
            with cache.step([seq_id], num_new=[1]) as views:
                mx.eval(self.model(mx.array([[0]], dtype=mx.int32), cache=views))
        finally:
            cache.free(seq_id, 0)


def right_padded(rows: Sequence[list[int]]) -> mx.array:
    """The rows' tokens as one int32 batch, each padded with 0 on the right
    to the longest (a row's logits past its own length are not read)."""
    width = max(map(len, rows))
    return mx.array([row + [0] * (width - len(row)) for row in rows], dtype=mx.int32)
