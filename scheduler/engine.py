"""`Engine`: an mlx-lm model driven by the scheduler over paged storage.

Each `step()`:

1. `Scheduler.schedule()` picks the work and reserves pages in the
   `cache.PagedCache` (which queues its own copy plans);
2. the scheduled sequences run through the model over `PagedCache.views`:
   all single-token rows (decode) in one batched forward, prefill chunks in
   groups of `prefill_batch` (right-padded to the group's longest chunk).
   On the CPU backend a padded multi-sequence prefill costs more than the
   same sequences one by one (16 x 285 tokens: 0.84 s batched vs 16 x 20 ms
   alone, plain mlx-lm, no cache involved), hence the default of 1;
3. a token is sampled for every row whose chunk reached its sequence's end
   (`sampling.sample_rows`), and `Scheduler.update()` applies stop
   conditions, forks n > 1 samples and frees finished sequences;
4. new tokens are streamed: `step()` returns them, `stream()` yields them,
   per-request callbacks receive them.

Hybrid models (LFM2, Qwen3-Next: `ArraysCache` layers) get recurrent slots
(`num_slots`, default 2 per running sequence); the storage is built by
`PagedCache.for_model`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from cache import LayerKind, PagedCache, layer_specs
from scheduler.request import Request, RequestMetrics, RequestStatus, SamplingParams
from scheduler.sampling import KeyChain, sample_rows
from scheduler.scheduler import (
    RequestOutput,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

Callback = Callable[[RequestOutput], None]
#: Called after every non-empty step with its scheduled work and its duration
#: (engine clock seconds, scheduling + forward + update).
StepListener = Callable[[SchedulerOutput, float], None]


@dataclass(slots=True)
class GenerationOutput:
    """A finished request: tokens and finish reason per sample, metrics."""

    request_id: Hashable
    prompt_tokens: list[int]
    outputs: list[list[int]]
    finish_reasons: list[RequestStatus | None]
    metrics: RequestMetrics

    @property
    def tokens(self) -> list[int]:
        """The first sample's tokens (the only one when n == 1)."""
        return self.outputs[0]


@dataclass(slots=True)
class EngineStats:
    """Counters and timings (seconds) over the engine's life.

    peak_kv_bytes: most KV page bytes held at once (sequences + prefix trie);
    peak_state_bytes: likewise for recurrent slots.
    """

    num_steps: int = 0
    num_forwards: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0
    schedule_time: float = 0.0
    forward_time: float = 0.0
    peak_kv_bytes: int = 0
    peak_state_bytes: int = 0
    step_times: list[float] = field(default_factory=list)


class Engine:
    """Continuous batching of an mlx-lm model over a `PagedCache`.

    `Engine(model, num_blocks=..., block_size=16, ...)`; scheduler settings
    come as keywords (`max_num_batched_tokens`, `max_num_seqs`, `policy`,
    `preemption`, `long_prefill_token_threshold`, `max_model_len`) or as a
    whole `scheduler_config`. Not thread-safe: one caller drives `step()`.
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int = 1024,
        block_size: int = 16,
        *,
        num_slots: int | None = None,
        enable_prefix_cache: bool = True,
        watermark: float = 0.0,
        num_host_blocks: int = 0,
        num_host_slots: int = 0,
        prefill_batch: int = 1,
        scheduler_config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        step_listener: StepListener | None = None,
        **scheduler_kwargs: Any,
    ) -> None:
        if isinstance(prefill_batch, bool) or not isinstance(prefill_batch, int) \
                or prefill_batch < 1:
            raise ValueError(f"prefill_batch must be an int >= 1, got {prefill_batch!r}")
        self.prefill_batch = prefill_batch
        if scheduler_config is not None and scheduler_kwargs:
            raise ValueError("give either scheduler_config or scheduler keywords, not both")
        config = scheduler_config or SchedulerConfig(**scheduler_kwargs)
        hybrid = any(s.kind is LayerKind.RECURRENT for s in layer_specs(model))
        if num_slots is None:
            num_slots = 2 * config.max_num_seqs + 2 if hybrid else 0
        store_kwargs = {}
        if num_host_blocks:  # swap space (host slots only matter for hybrid models)
            store_kwargs = {"num_host_blocks": num_host_blocks,
                            "num_host_slots": num_host_slots if hybrid else 0}
        self.model = model
        self.cache = PagedCache.for_model(
            model, num_blocks, block_size, num_slots=num_slots,
            enable_prefix_cache=enable_prefix_cache, watermark=watermark, **store_kwargs,
        )
        if config.preemption == "swap" and not hasattr(self.cache, "swap_out"):
            raise ValueError("this PagedCache cannot swap; use preemption='recompute'")
        if config.max_model_len is None:
            # A sample must stop before one sequence outgrows the whole pool.
            usable = num_blocks - self.cache.block_manager.config.num_watermark_blocks
            config.max_model_len = usable * block_size
        self.scheduler = Scheduler(config, self.cache, clock=clock)
        self.clock = clock
        self.step_listener = step_listener
        self.stats = EngineStats()
        self._callbacks: dict[Hashable, Callback] = {}
        self._keys: dict[Hashable, KeyChain] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: Hashable = None,
        priority: int = 0,
        namespace: Hashable = None,
        callback: Callback | None = None,
        arrival_time: float | None = None,
    ) -> Hashable:
        """Queue a prompt; returns its request id. `callback(output)` is called
        with every `RequestOutput` of the request (new tokens, the end).
        `arrival_time` (engine clock) defaults to now; a replay gives the
        trace's arrival, so queueing before the call counts in the TTFT.

        Raises `ValueError` for a prompt longer than `max_model_len`.
        """
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request = Request(request_id, list(prompt_tokens), sampling or SamplingParams(),
                          priority=priority, namespace=namespace, arrival_time=arrival_time)
        limit = self.scheduler.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens does not fit max_model_len {limit}"
            )
        self.scheduler.add_request(request)
        if callback is not None:
            self._callbacks[request_id] = callback
        if request.sampling.seed is not None:
            self._keys[request_id] = KeyChain(request.sampling.seed)
        return request_id

    def abort(self, request_id: Hashable) -> None:
        """Stop a request and free its pages (call between steps or from a
        callback). Its callback receives the final, aborted output."""
        out = self.scheduler.abort(request_id)
        if out is not None:
            self._deliver([out])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: Hashable) -> Request | None:
        return self.scheduler.get_request(request_id)

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the step's outputs.

        Raises `RuntimeError` when requests wait but nothing can run (a
        prompt that no longer fits the pool).
        """
        t0 = self.clock()
        out = self.scheduler.schedule()
        t1 = self.clock()
        if out.is_empty:
            if self.scheduler.has_unfinished() and not self.scheduler.num_running:
                raise RuntimeError("requests are waiting but none fits in the page pool")
            return []
        sampled = self._run(out)
        t2 = self.clock()
        results = self.scheduler.update(out, sampled)
        self._record(out, t0, t1, t2)
        self._deliver(results)
        if self.step_listener is not None:
            self.step_listener(out, self.stats.step_times[-1])
        return results

    def _run(self, out: SchedulerOutput) -> dict[Hashable, Any]:
        """Forward the scheduled work (decode rows, then prefill chunks)."""
        sampled: dict[Hashable, Any] = {}
        decode = [s for s in out.seqs if s.num_tokens == 1]
        prefill = [s for s in out.seqs if s.num_tokens > 1]
        if decode:
            sampled.update(self._forward(decode))
        k = self.prefill_batch
        if k == 1:
            for seq in prefill:
                sampled.update(self._prefill_one(seq))
            return sampled
        for i in range(0, len(prefill), k):
            sampled.update(self._forward(prefill[i : i + k]))
        return sampled

    def _prefill_one(self, seq: ScheduledSeq) -> dict[Hashable, Any]:
        """A chunk that samples runs as all-but-last (no logits) then the last
        token, as mlx-lm's generate does: the LM head sees one position."""
        if not seq.sample:
            return self._forward([seq])
        head = replace(seq, token_ids=seq.token_ids[:-1], sample=False)
        tail = replace(
            seq, token_ids=seq.token_ids[-1:], start_position=seq.start_position + head.num_tokens
        )
        self._forward([head])
        return self._forward([tail])

    def _forward(self, group: list[ScheduledSeq]) -> dict[Hashable, Any]:
        lengths = [s.num_tokens for s in group]
        width = max(lengths)
        rows = [s.token_ids + [0] * (width - len(s.token_ids)) for s in group]
        views = self.cache.views([s.seq_id for s in group], num_new=lengths)
        logits = self.model(mx.array(rows, dtype=mx.int32), cache=views)
        self.stats.num_forwards += 1
        picks = [b for b, s in enumerate(group) if s.sample]
        if not picks:
            self.cache.eval_state()  # the logits are not needed
            return {}
        row_index, params, keys = [], [], []
        for b in picks:
            s = group[b]
            for _ in range(s.num_samples):
                row_index.append(b)
                params.append(s.request.sampling)
                keys.append(self._keys.get(s.request_id))
        last = logits[mx.array(row_index), mx.array([lengths[b] - 1 for b in row_index])]
        tokens = sample_rows(last, params, keys)
        mx.eval(tokens)
        self._flush_state()
        values = tokens.tolist()
        sampled: dict[Hashable, Any] = {}
        i = 0
        for b in picks:
            s = group[b]
            if s.num_samples == 1:
                sampled[s.seq_id] = values[i]
            else:
                sampled[s.seq_id] = values[i : i + s.num_samples]
            i += s.num_samples
        return sampled

    def _flush_state(self) -> None:
        recurrent = self.cache.recurrent
        if recurrent is not None:
            recurrent.flush()

    def _record(self, out: SchedulerOutput, t0: float, t1: float, t2: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.schedule_time += t1 - t0
        stats.forward_time += t2 - t1
        stats.step_times.append(self.clock() - t0)
        stats.num_prefill_tokens += out.num_prefill_tokens
        stats.num_decode_tokens += out.num_decode_tokens
        stats.num_generated_tokens += sum(s.num_samples for s in out.seqs if s.sample)
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, self.cache.kv_bytes_in_use)
        recurrent = self.cache.recurrent
        if recurrent is not None and recurrent.bytes_per_slot:
            bm = self.cache.block_manager
            used = bm.config.num_slots - bm.num_free_slots
            stats.peak_state_bytes = max(stats.peak_state_bytes, used * recurrent.bytes_per_slot)

    def _deliver(self, results: list[RequestOutput]) -> None:
        for r in results:
            callback = self._callbacks.get(r.request_id)
            if callback is not None:
                callback(r)
            if r.finished:
                self._callbacks.pop(r.request_id, None)
                self._keys.pop(r.request_id, None)

    # ------------------------------------------------------------ front-ends

    def stream(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Add `prompts` and yield every `RequestOutput` as steps produce them
        (request ids are "req-<k>" in `add_request` order)."""
        self._add_all(prompts, sampling)
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run `prompts` to completion; outputs in prompt order.

        `sampling`: one `SamplingParams` for all, or one per prompt. Other
        requests already queued run too (their outputs are not returned).
        """
        ids = self._add_all(prompts, sampling)
        requests = {rid: self.scheduler.get_request(rid) for rid in ids}
        while any(not r.is_finished for r in requests.values()):
            self.step()
        return [
            GenerationOutput(rid, r.prompt_tokens, r.outputs, r.finish_reasons, r.metrics)
            for rid, r in requests.items()
        ]

    def _add_all(self, prompts, sampling) -> list[Hashable]:
        prompts = [list(p) for p in prompts]
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return [self.add_request(p, s) for p, s in zip(prompts, params)]

    # --------------------------------------------------------------- checks

    def check_integrity(self) -> None:
        """Every block manager's invariants (raises `IntegrityError`)."""
        for bm in self.cache.block_managers:
            bm.check_integrity()
