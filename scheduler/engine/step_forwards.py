"""`StepForwards`: the forwards of one step's scheduled work, each fault
kept to the rows it hit.

The engine hands over the rows that run (after grammar masks and the
speculator's pick are settled) and its runner; this module decides how the
rows share forwards and records what finished in a `StepRun`:

* decode rows (one token each) go in one batched forward, with the last
  token of every sampling prefill chunk as one more row (its head, all but
  that token, runs first as a prefill without logits): the weights and the
  LM head are read once for every sampled row;
* prefill chunks run alone, or in groups of up to `prefill_batch` with
  bounded padding (`scheduler.core.prefill_groups`) where the model's code
  batches them (`BatchSupport`);
* rows the speculator takes run in one draft-and-verify round.

A forward that raises an `Exception` computed nothing (`PagedCache.step`
rolls it back): its rows are not in `StepRun.done`, the scheduler gives them
again next step, and `ForwardFaults` runs them alone after a failure and
names the requests whose forward keeps failing (`StepRun.aborts`). The
other forwards of the step still run. A `BaseException` that is not an
`Exception` (KeyboardInterrupt) propagates after `StepRun` records what
finished. Cost: O(rows) list work per step besides the forwards.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler.core.prefill_groups import prefill_groups
from scheduler.core.records import ScheduledSeq
from scheduler.engine.batch_probe import BatchSupport
from scheduler.engine.faults import ForwardFaults
from scheduler.engine.runner import Runner, StepSampling
from scheduler.engine.sampling import KeyChain
from scheduler.engine.speculative import Speculator
from scheduler.engine.stats import EngineStats


@dataclass(slots=True)
class StepRun:
    """What of a step's work finished: items (a sampling chunk's head may
    finish without its tail), their samples, and the requests to abort
    because their forward keeps failing (with the error)."""

    done: list[ScheduledSeq] = field(default_factory=list)
    sampled: dict[Hashable, Any] = field(default_factory=dict)
    aborts: list[tuple[Hashable, Exception]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class StepForwards:
    """Runs a step's rows through the model (see the module doc).

    `faults` isolates and counts failing requests, `batching` says what
    may share a forward, `prefill_batch` is the most prefill chunks per
    forward, `sampling` what the runner samples with, `stats` the engine's
    counters (forwards, errors, speculation), `speculator` the draft model's
    (None: no speculation) and `keys` the seeded requests' key chains.
    """

    faults: ForwardFaults
    batching: BatchSupport
    prefill_batch: int
    sampling: StepSampling
    stats: EngineStats
    speculator: Speculator | None
    keys: Mapping[Hashable, KeyChain]

    def run(self, seqs: list[ScheduledSeq], runner: Runner, run: StepRun) -> None:
        """Forward `seqs` with `runner`, recording in `run` what finished."""
        if self.speculator is not None:  # the rows it does not take
            seqs = self._run_speculative(self.speculator, seqs, run)
        decode = [s for s in seqs if s.num_tokens == 1]
        prefill = [s for s in seqs if s.num_tokens > 1]
        isolated = self.faults.isolated
        together = [s for s in decode if not isolated(s.request_id)]
        alone = [s for s in decode if isolated(s.request_id)]
        if not self.batching.decode:
            together, alone = [], together + alone
        split = [s for s in prefill
                 if s.sample and self.batching.decode and not isolated(s.request_id)]
        whole = [s for s in prefill if not any(s is x for x in split)]
        heads = [replace(s, token_ids=s.token_ids[:-1], sample=False) for s in split]
        self._run_prefill(heads, runner, run)
        ran = {id(item) for item in run.done}
        chunks = {id(head): seq for head, seq in zip(heads, split) if id(head) in ran}
        if together or chunks:
            self._run_decode(together, chunks, runner, run)
        for seq in alone:
            self._run_group([seq], runner, run)
        self._run_prefill(whole, runner, run)

    def _run_decode(self, rows: list[ScheduledSeq], chunks: dict[int, ScheduledSeq],
                    runner: Runner, run: StepRun) -> None:
        """One forward over the decode rows and the last token of every
        chunk whose head ran (`chunks`: id of the head in `run.done` -> the
        chunk). On success a chunk replaces its head in `run.done`; on a
        failure the heads stay there (computed: only the last tokens run
        again) and the rows are handled as `_run_group` does."""
        tails = [replace(seq, token_ids=seq.token_ids[-1:],
                         start_position=seq.start_position + seq.num_tokens - 1)
                 for seq in chunks.values()]
        group = rows + tails
        try:
            run.sampled.update(self._forward(group, runner))
        except Exception as error:
            self._failed(group, error, run)
            return
        run.done[:] = [chunks.get(id(item), item) for item in run.done]
        run.done.extend(rows)
        self.faults.succeeded(s.request_id for s in group)

    def _run_prefill(self, prefill: list[ScheduledSeq], runner: Runner, run: StepRun) -> None:
        """Prefill chunks alone or in groups of up to `prefill_batch` with
        bounded padding (`scheduler.core.prefill_groups`)."""
        k = self.prefill_batch if self.batching.prefill else 1
        if k == 1:
            for seq in prefill:
                self._prefill_one(seq, runner, run)
            return
        alone = [s for s in prefill if self.faults.isolated(s.request_id)]
        together = [s for s in prefill if not self.faults.isolated(s.request_id)]
        for group in prefill_groups(together, k):
            self._run_group(group, runner, run)
        for seq in alone:
            self._prefill_one(seq, runner, run)

    def _run_speculative(self, speculator: Speculator, seqs: list[ScheduledSeq],
                         run: StepRun) -> list[ScheduledSeq]:
        """Speculate the eligible rows (`Speculator.eligible`, unconstrained,
        not isolated by a fault) in one draft-and-verify round; returns the
        other rows. A raising round counts as never run, as any failed
        forward."""
        rows = [s for s in seqs if speculator.eligible(s)
                and s.scheduled_request.sampling.constraint is None
                and not self.faults.isolated(s.request_id)]
        if not rows:
            return seqs
        try:
            accepted, counts = speculator.run(rows, self.keys)
        except Exception as error:
            self._failed(rows, error, run)
        else:
            run.sampled.update(accepted)
            run.done.extend(rows)
            self.faults.succeeded(s.request_id for s in rows)
            stats = self.stats
            stats.num_forwards += counts.num_target_forwards
            stats.num_draft_forwards += counts.num_draft_forwards
            stats.num_draft_tokens += counts.num_drafted
            stats.num_accepted_tokens += counts.num_accepted
            stats.num_generated_tokens += counts.num_accepted
            stats.num_recomputed_tokens += counts.num_recomputed
        taken = {id(s) for s in rows}
        return [s for s in seqs if id(s) not in taken]

    def _run_group(self, group: list[ScheduledSeq], runner: Runner, run: StepRun) -> None:
        """One forward over `group`; a raising one is recorded (`run`), not
        raised: the other groups of the step still run."""
        try:
            run.sampled.update(self._forward(group, runner))
        except Exception as error:
            self._failed(group, error, run)
            return
        run.done.extend(group)
        self.faults.succeeded(s.request_id for s in group)

    def _failed(self, group: list[ScheduledSeq], error: Exception, run: StepRun) -> None:
        self.stats.num_forward_errors += 1
        for request_id in self.faults.failed([s.request_id for s in group]):
            run.aborts.append((request_id, error))

    def _prefill_one(self, seq: ScheduledSeq, runner: Runner, run: StepRun) -> None:
        """A chunk that samples runs as all-but-last (no logits) then the last
        token, as mlx-lm's generate does: the LM head sees one position."""
        if not seq.sample:
            self._run_group([seq], runner, run)
            return
        head = replace(seq, token_ids=seq.token_ids[:-1], sample=False)
        tail = replace(
            seq, token_ids=seq.token_ids[-1:], start_position=seq.start_position + head.num_tokens
        )
        try:
            self._forward([head], runner)
        except Exception as error:
            self._failed([seq], error, run)
            return
        try:
            run.sampled.update(self._forward([tail], runner))
        except BaseException as error:
            run.done.append(head)  # computed: only the tail runs again
            if not isinstance(error, Exception):
                raise
            self._failed([seq], error, run)
            return
        run.done.append(seq)
        self.faults.succeeded([seq.request_id])

    def _forward(self, group: list[ScheduledSeq], runner: Runner) -> dict[Hashable, Any]:
        """One forward over `group` by the runner; returns the samples of its
        picked rows. A raising forward computed nothing (rolled back)."""
        sampled = runner.run(group, self.sampling)
        self.stats.num_forwards += 1
        return sampled
