"""`Engine`: an mlx-lm model driven by the scheduler over paged storage.

Each `step()`:

1. `Scheduler.schedule()` picks the work and reserves pages in the
   `cache.PagedCache` (which queues and applies its own plans);
2. the scheduled sequences run through the model over `PagedCache.step` views:
   all single-token rows (decode) in one batched forward, prefill chunks in
   groups of `prefill_batch` (right-padded to the group's longest chunk); a
   chunk that samples runs all but its last token there and the last token
   as one more row of the decode forward (one LM head for every sample).
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

A forward that raises counts as never run: its tokens are not computed
(`PagedCache.step` rolls it back), the scheduler gives the same work again
next step, and outputs of the forwards that did finish are kept. Rows of a
failed batch then run alone; a row that keeps failing alone has its request
aborted with the error (`scheduler.engine.faults`). An `Exception` is contained
that way and counted (`EngineStats.num_forward_errors`); any other
`BaseException` (KeyboardInterrupt) is re-raised after the rollback. The
next `step()` continues either way.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from blockmgr.errors import IntegrityError, InvalidArgument, WrongArgumentType
from blockmgr.validation import check_int, check_token_range, prompt_list
from cache import LayerKind, PagedCache, layer_specs
from scheduler.core.config import SchedulerConfig
from scheduler.core.constraints import Grammars, RowMatcher
from scheduler.core.records import RequestOutput, ScheduledSeq, SchedulerOutput
from scheduler.core.request import (
    Request,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
)
from scheduler.core.scheduler import Scheduler
from scheduler.engine.batch_probe import BatchSupport, probe_batching, probe_cache
from scheduler.engine.config import EngineConfig
from scheduler.engine.faults import ForwardFaults
from scheduler.engine.kv_events import EventSink, KVEventPublisher, open_publisher
from scheduler.engine.runner import ModelRunner, Runner, StepSampling
from scheduler.engine.sampling import KeyChain
from scheduler.engine.speculative import Speculator
from scheduler.engine.stats import EngineStats
from scheduler.engine.step_forwards import StepForwards, StepRun
from scheduler.engine.text import SampleText, TextCodec, is_text_prompt, stop_strings

Callback = Callable[[RequestOutput], None]
#: Called after every non-empty step with its scheduled work and its duration
#: (engine clock seconds, scheduling + forward + update).
StepListener = Callable[[SchedulerOutput, float], None]


@dataclass(frozen=True, slots=True)
class AutoRequestId:
    """A request id the engine chose: "req-<k>" when printed, but never equal
    to an id a caller chose (a str "req-0" is a different id)."""

    index: int

    def __str__(self) -> str:
        return f"req-{self.index}"

    __repr__ = __str__


@dataclass(slots=True)
class GenerationOutput:
    """A finished request: tokens and finish reason per sample, metrics."""

    request_id: Hashable
    prompt_tokens: list[int]
    outputs: list[list[int]]
    finish_reasons: list[RequestStatus | None]
    metrics: RequestMetrics
    texts: list[str] | None = None  # per sample (an engine with a tokenizer)
    logprobs: list[list[TokenLogprob]] | None = None  # per sample, per token (if asked)

    @property
    def tokens(self) -> list[int]:
        """The first sample's tokens (the only one when n == 1)."""
        return self.outputs[0]

    @property
    def text(self) -> str | None:
        """The first sample's text (None without a tokenizer)."""
        return None if self.texts is None else self.texts[0]


@dataclass(slots=True)
class _Tracked:
    """A request whose outputs the engine annotates: text per sample (with a
    tokenizer) and logprobs per sample (when asked for), kept until its end."""

    request: Request
    texts: list[SampleText] | None
    logprobs: list[list[TokenLogprob]] | None


def default_num_slots(max_num_seqs: int, speculative: bool = False) -> int:
    """Recurrent slots a hybrid model's engine gets by default: two per
    running sequence (its state and a prefix snapshot), three with a draft
    model (plus the speculation checkpoint), plus two."""
    return (3 if speculative else 2) * max_num_seqs + 2


class Engine:
    """Continuous batching of an mlx-lm model over a `PagedCache`.

    `Engine(model, config=EngineConfig(...))`: every setting, declared once
    with its default and help in `scheduler.engine.config` (the storage's
    `CacheConfig`, the `SchedulerConfig`, the engine's own). The same
    settings are accepted as flat keywords, `Engine(model, num_blocks=...,
    block_size=16, max_num_seqs=..., kv_bits=8, ...)` (`EngineConfig.of`
    sorts them; a whole `scheduler_config` may replace the scheduler's
    keywords), but not beside `config`. `self.config` holds the settings in
    effect (`max_model_len` resolved). The other arguments are objects,
    not settings: the clock, a step listener, the tokenizer, the KV-event
    sink, the draft model, and facts about the model: `model_context`, the
    longest sequence it reads (its config.json's, `serve.model_context`;
    None: unbounded). `max_model_len` defaults to the smaller of that
    context and what the pool holds; a larger one asked for is refused
    (`InvalidArgument`). Not thread-safe: one caller drives `step()`.

    `self.runner` (a `scheduler.engine.runner.Runner`, by default a
    `ModelRunner` of `model` over `self.cache`) runs each batch: the
    forward and the sampling; the engine schedules, handles faults and
    keeps the books. A wrapper may replace it between steps.

    `batch_probe` (default on): when built, compare a few batched and
    single-row forwards of the model (`batch_probe.probe_batching`, 13
    forwards of at most 6 tokens on private storage); where mlx-lm's model
    code cannot batch (`self.batching`), those rows run one by one.
    `max_forward_retries`: solo failures in a row after which a request's
    forward fault is its own and it is aborted (`scheduler.engine.faults`).

    `tokenizer` (an mlx-lm `TokenizerWrapper`, as `mlx_lm.load` gives):
    prompts may then be text or chat messages, outputs carry text
    (`RequestOutput.new_text`, `GenerationOutput.texts`), `SamplingParams.stop`
    strings apply, and the tokenizer's end-of-sequence tokens stop a sample
    unless `ignore_eos` (`scheduler.engine.text`).

    `kv_events` (a ZMQ endpoint such as "tcp://*:5557", or an `EventSink`):
    after every step and abort, publish what the prefix cache can serve in
    vLLM's KV-event format, for cache-aware routers (`scheduler.engine.kv_events`;
    needs the `events` extra). `close()` closes its socket.

    `kv_bits` (8 or 4) and `kv_group_size` (32, 64, 128; default 64), or a
    `cache.KVFormat` as `kv_format` (key and value bits apart): quantized KV
    pages (`PagedCache`; design/cache.md, "Page formats"), so `num_blocks`
    pages take about 0.53x (8-bit) or 0.28x (4-bit) of the memory of the
    model's float16. The draft model's pages stay at its dtype.

    `host_cache_size`, `disk_cache` (a directory) and `disk_cache_size`
    (bytes, or strings like "20GiB"): the prefix cache's host and disk
    tiers (`PagedCache.for_model`, design/tiers.md): evicted prefixes move
    there instead of being dropped, and the disk tier survives restarts.
    `close()` (or leaving a ``with`` block) writes what is cached to disk.
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int | None = None,
        block_size: int | None = None,
        *,
        config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        step_listener: StepListener | None = None,
        tokenizer: Any = None,
        kv_events: str | EventSink | None = None,
        draft_model: Any = None,
        model_context: int | None = None,
        **settings: Any,
    ) -> None:
        config = _engine_config(config, scheduler_config, num_blocks, block_size, settings)
        storage, sched = config.cache, config.scheduler
        self.prefill_batch = config.prefill_batch
        self.faults = ForwardFaults(config.max_forward_retries)
        hybrid = any(s.kind is LayerKind.RECURRENT for s in layer_specs(model))
        num_slots = _num_slots(config, hybrid, draft_model is not None)
        self.model = model
        self.cache = PagedCache.for_model(
            model, storage.num_blocks, storage.block_size,
            **storage.storage_kwargs(num_slots, hybrid))
        #: runs each batch: the forward and the sampling (`scheduler.engine.runner`)
        self.runner: Runner = ModelRunner(model, self.cache)
        # Rows the model's own code cannot batch run one by one (see batch_probe).
        self.batching = (
            probe_batching(model, probe_cache(model, storage.block_size, hybrid),
                           probe_prefill=config.prefill_batch > 1 or draft_model is not None)
            if config.batch_probe else BatchSupport()
        )
        sched = self._bounded(sched, storage.block_size, model_context)
        #: the settings in effect (`scheduler.max_model_len` resolved)
        self.config = replace(config, scheduler=sched)
        self.vocab_size = _model_vocab_size(model) if config.vocab_size is None \
            else config.vocab_size
        self.scheduler = Scheduler(sched, self.cache, clock=clock)
        self.clock = clock
        self.step_listener = step_listener
        self.stats = EngineStats()
        self._callbacks: dict[Hashable, Callback] = {}
        self._keys: dict[Hashable, KeyChain] = {}
        self._ids = itertools.count()
        self.text = None if tokenizer is None else TextCodec(tokenizer)
        #: constrained decoding for this tokenizer (`SamplingParams.constraint`)
        self.grammars = None if self.text is None else Grammars(
            tokenizer, self.vocab_size, self.text.eos_token_ids)
        self._tracked: dict[Hashable, _Tracked] = {}
        self.speculator = None if draft_model is None else self._speculator(
            draft_model, num_slots)
        self._step_logprobs: dict[tuple[Hashable, int], TokenLogprob] = {}
        # constrained decoding: each sample's grammar matcher, this step's masks
        self._matchers: dict[Hashable, dict[int, RowMatcher]] = {}
        self._step_masks: dict[tuple[Hashable, int], Any] = {}
        #: forwards each step's rows, faults kept to their requests
        self._forwards = StepForwards(
            self.faults, self.batching, config.prefill_batch,
            StepSampling(self._keys, self._step_masks, self._step_logprobs), self.stats,
            self.speculator, self._keys)
        #: Waiting requests whose disk-cached prefixes are read ahead each
        #: step (admission prefetch; 0: read when allocated).
        self.num_prefetch_ahead = 4
        self.kv_events = None if kv_events is None else self._open_publisher(kv_events)

    def _open_publisher(self, kv_events: str | EventSink) -> KVEventPublisher:
        """A KV-event publisher on this engine's storage (media by tier when
        its prefix cache has colder tiers)."""
        cache = self.cache
        return open_publisher(cache, kv_events, tiered=cache if cache.tiers is not None else None)

    def add_kv_event_sink(self, sink: EventSink) -> None:
        """Publish this engine's KV events to `sink` too (beside its own
        publisher's sink, `KVEventPublisher.add_sink`; only to it when the
        engine publishes none), starting with the current state. Call it
        between steps. Cost: one publish (O(cached pages) the first time)."""
        if self.kv_events is None:
            self.kv_events = self._open_publisher(sink)
        else:
            self.kv_events.add_sink(sink)
        self.kv_events.publish()

    def _bounded(self, sched: SchedulerConfig, block_size: int,
                 model_context: int | None) -> SchedulerConfig:
        """`sched` with its `max_model_len` resolved: at most the model's
        context, and by default what one sequence can hold in the pool (a
        number even when every layer slides: the server measures requests
        against it). A larger one is the scheduler's to refuse
        (`pool_length`: such a sequence could never finish)."""
        if sched.max_model_len is None:
            capacity = self.cache.num_usable_blocks * block_size
            longest = capacity if model_context is None else min(capacity, model_context)
            return replace(sched, max_model_len=longest)
        check_model_len(sched.max_model_len, model_context)
        return sched  # frozen: shared as it is

    def _speculator(self, draft_model: Any, num_slots: int) -> Speculator:
        """Speculative decoding: the draft model on its own paged storage
        (as many pages and slots as the target's, its own prefix cache)."""
        config = self.config
        storage = config.cache
        draft_vocab = _model_vocab_size(draft_model)
        if draft_vocab != self.vocab_size:
            raise InvalidArgument(
                f"the draft model's vocabulary ({draft_vocab}) is not the target's "
                f"({self.vocab_size})")
        hybrid = any(s.kind is LayerKind.RECURRENT for s in layer_specs(draft_model))
        draft_cache = PagedCache.for_model(
            draft_model, storage.num_blocks, storage.block_size,
            num_slots=num_slots if hybrid else 0,
            enable_prefix_cache=storage.enable_prefix_cache)
        draft_batching = (
            probe_batching(draft_model, probe_cache(draft_model, storage.block_size, hybrid))
            if config.batch_probe else BatchSupport()
        )
        batched = self.batching.prefill and draft_batching.prefill
        return Speculator(self.model, self.cache, draft_model, draft_cache,
                          config.num_speculative_tokens, batched=batched,
                          max_model_len=config.scheduler.max_model_len)

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

        `prompt_tokens` may also be text or chat messages (a list of
        {"role", "content"} maps) when the engine has a tokenizer.
        Everything is checked before anything changes: token ids must be
        ints in [0, vocab_size) (a list, tuple or numpy integer array;
        `WrongArgumentType` for text, None, floats, nested lists;
        `InvalidArgument` out of range), and a request that could never run
        (`RequestTooLarge`: n > max_num_seqs, a prompt that does not fit
        max_model_len or the pool) is refused. Automatic ids are
        `AutoRequestId`s, which no caller-chosen id equals.
        """
        request = self._make_request(prompt_tokens, sampling, request_id, priority, namespace,
                                     callback, arrival_time)
        self.scheduler.check_admissible(request)
        self._queue(request, callback)
        return request.request_id

    def encode_prompt(self, prompt: Any) -> list[int]:
        """The checked token ids of a prompt: text or chat messages through
        the tokenizer (`WrongArgumentType` without one; `InvalidArgument` for
        text that is not valid Unicode), or token ids (ints in
        [0, vocab_size)). Reads only the tokenizer and the vocabulary size,
        so a server may call it off the thread that drives the engine (the
        tokenizer's cost then stalls no step). Cost: tokenization + O(tokens)."""
        if is_text_prompt(prompt):
            if self.text is None:
                raise WrongArgumentType(
                    f"prompt_tokens must be token ids (text needs Engine(tokenizer=...)), "
                    f"got {prompt!r:.80}"
                )
            prompt = self.text.encode(prompt)
        tokens = prompt_list(prompt, "prompt_tokens", exact=True)
        check_token_range(tokens, self.vocab_size, "prompt_tokens")
        return tokens

    def _make_request(self, prompt_tokens, sampling, request_id, priority, namespace,
                      callback, arrival_time=None) -> Request:
        """A checked `Request` (nothing queued yet)."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise WrongArgumentType(f"sampling must be SamplingParams, got {sampling!r:.80}")
        if callback is not None and not callable(callback):
            raise WrongArgumentType(f"callback must be callable, got {callback!r:.80}")
        tokens = self.encode_prompt(prompt_tokens)
        sampling = self._engine_sampling(sampling or SamplingParams())
        if request_id is None:
            request_id = AutoRequestId(next(self._ids))
        return Request(request_id, tokens, sampling, priority=priority, namespace=namespace,
                       arrival_time=arrival_time)

    def _engine_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """Check what only the engine knows (stop strings need a tokenizer,
        bias ids in the vocabulary); add the tokenizer's end-of-sequence ids
        to the stop tokens unless `ignore_eos`. The caller's object is not
        changed."""
        if sampling.stop and self.text is None:
            raise InvalidArgument(
                f"stop strings {sampling.stop!r:.80} need Engine(tokenizer=...)"
            )
        check_token_range(list(sampling.logit_bias), self.vocab_size, "logit_bias")
        if sampling.min_tokens:  # their logits are masked until min_tokens
            check_token_range(list(sampling.stop_token_ids), self.vocab_size, "stop_token_ids")
        if self.text is None or sampling.ignore_eos:
            return sampling
        missing = [t for t in self.text.eos_token_ids if t not in sampling.stop_token_ids]
        if not missing:
            return sampling
        return replace(sampling, stop_token_ids=sampling.stop_token_ids + tuple(missing))

    def _queue(self, request: Request, callback: Callback | None) -> None:
        """Hand a checked request to the scheduler (its last check can still
        refuse it), then register its callback and key chain."""
        self.scheduler.add_request(request)
        rid = request.request_id
        if callback is not None:
            self._callbacks[rid] = callback
        sampling = request.sampling
        if sampling.seed is not None:
            self._keys[rid] = KeyChain(sampling.seed)
        if self.text is not None or sampling.logprobs is not None:
            self._tracked[rid] = self._track(request)

    def _track(self, request: Request) -> _Tracked:
        sampling, n = request.sampling, request.sampling.n
        texts = None
        if self.text is not None:
            stop = stop_strings(sampling.stop)  # one automaton for the request's samples
            texts = [self.text.sample_text(stop, sampling.stop_token_ids,
                                           request.prompt_tokens) for _ in range(n)]
        logprobs: list[list[TokenLogprob]] | None = (
            None if sampling.logprobs is None else [[] for _ in range(n)])
        return _Tracked(request, texts, logprobs)

    def abort(self, request_id: Hashable, error: BaseException | None = None) -> None:
        """Stop a request and free its pages (call between steps or from a
        callback). Its callback receives the final, aborted output; `error`
        (e.g. the server is shutting down) is kept in `Request.error`."""
        request = self.scheduler.get_request(request_id)
        if request is not None and error is not None:
            request.error = error
        out = self.scheduler.abort(request_id)
        if out is not None:
            self._deliver([out])
        self._forget(request_id)
        self.faults.forget(request_id)
        self._publish_kv_events()

    def _forget(self, request_id: Hashable) -> None:
        """Drop the engine's per-request maps (the request has ended)."""
        self._callbacks.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._tracked.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: Hashable) -> Request | None:
        return self.scheduler.get_request(request_id)

    def release_thread(self) -> None:
        """Wait for the device work this thread queued, then destroy the MLX
        streams it created. A thread that drove the engine calls it before
        it ends (MLX's rule since 0.32: `clear_streams` at the end of every
        thread that used MLX): streams left to process exit can abort it
        ("terminate called without an active exception")."""
        mx.synchronize()
        mx.clear_streams()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix on the device that no live sequence uses
        (vLLM's `reset_prefix_cache`; the host and disk tiers keep theirs);
        returns the pages it freed. Not thread-safe: call it between steps.
        Cost: O(cached pages)."""
        cache = self.cache
        before = cache.num_free_blocks
        cache.reset_prefix_cache()
        self._publish_kv_events()
        return cache.num_free_blocks - before

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the step's outputs
        (with the aborted output of a request whose callback raised).

        A step that only preempts (the preempted sequences run again later)
        returns []. Raises `RuntimeError` when requests wait, nothing runs
        and nothing was preempted (a state `add_request`'s checks rule out).
        """
        t0 = self.clock()
        self._step_logprobs.clear()
        out = self.scheduler.schedule()
        if self.num_prefetch_ahead and self.cache.tiers is not None:
            self._prefetch_waiting()
        t1 = self.clock()
        if out.is_empty:
            if (self.scheduler.has_unfinished() and not self.scheduler.num_running
                    and not out.preempted):
                raise RuntimeError("requests are waiting but none fits in the page pool")
            self._publish_kv_events()
            return []
        run = StepRun()
        try:
            self._forwards.run(self._constrain(out.seqs, run), self.runner, run)
        except BaseException:  # not an Exception (those are contained): re-raise
            self._settle(out, run)
            raise
        t2 = self.clock()
        results = self._settle(out, run)
        if self.speculator is not None:
            self.speculator.release_ended()
        self._record(out, t0, t1, t2)
        self._publish_kv_events()
        if self.step_listener is not None:
            self.step_listener(out, self.stats.step_times[-1])
        return results

    def _prefetch_waiting(self) -> None:
        """Start reading the disk records of the next waiting requests'
        cached prefixes (`PagedCache.prefetch`), so the reads overlap this
        step's forward instead of holding their admission."""
        for tokens, namespace in self.scheduler.waiting_prompts(self.num_prefetch_ahead):
            self.cache.prefetch(tokens, namespace)

    def _publish_kv_events(self) -> None:
        """Tell routers what the prefix cache can serve now (never raises)."""
        if self.kv_events is not None:
            self.kv_events.publish()

    def export_prefix(self, prompt: Any, path: str | os.PathLike[str],
                      namespace: Hashable = None) -> int:
        """Write the cached prefix of `prompt` (token ids, text or chat
        messages with a tokenizer) to the file `path`: one conversation's
        cache for another machine or a later start (`PagedCache.
        export_prefix`; call between steps). Returns its tokens."""
        return self.cache.export_prefix(self.encode_prompt(prompt), path, namespace)

    def import_prefix(self, path: str | os.PathLike[str]) -> int:
        """Cache the prefix `export_prefix` wrote to `path` with this model
        (`PagedCache.import_prefix`: another model's file raises
        `ForeignPrefixFile`; call between steps). Returns its tokens. A
        fresh engine first runs one one-token forward, so that its pools
        exist to take the records."""
        if not self.cache.pools_ready:
            self.runner.warm_up()
        return self.cache.import_prefix(path)

    def close(self) -> None:
        """Release what lives outside the engine: the KV-event socket, and
        the prefix cache's disk tier (what is cached goes to disk for the
        next start: `PagedCache.close`). Idempotent."""
        try:
            self.cache.close()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle(self, out: SchedulerOutput, run: StepRun) -> list[RequestOutput]:
        """Give the scheduler what ran (a failed forward's items are scheduled
        again next step), abort the requests whose forward keeps failing, and
        deliver the outputs (see `_deliver`)."""
        ran = {item.seq_id for item in run.done}
        failed = [item for item in out.seqs if item.seq_id not in ran]
        if failed:
            self.scheduler.unschedule(failed)
        results = self.scheduler.update(out.with_seqs(run.done), run.sampled)
        for request_id, error in run.aborts:
            request = self.scheduler.get_request(request_id)
            if request is not None:
                request.error = error
                results.append(self._abort_live(request_id))
        if self._tracked:
            self._annotate(results)
        for r in results:
            if r.finished:
                self.faults.forget(r.request_id)
        return self._deliver(results)

    def _abort_live(self, request_id: Hashable) -> RequestOutput:
        """`scheduler.abort` of a request known to be live: its final output."""
        out = self.scheduler.abort(request_id)
        if out is None:
            raise IntegrityError(f"live request {request_id!r} had nothing to abort")
        return out

    def _annotate(self, results: list[RequestOutput]) -> None:
        """Give each tracked request's outputs their logprobs and text deltas;
        a sample whose text reached a stop string is stopped here. A fault
        there (the tokenizer's decode raising on a token) is that request's
        own: it ends aborted with the error (`Request.error`), its output
        replaced by the aborted one, and the other requests go on."""
        for k, r in enumerate(results):
            tracked = self._tracked.get(r.request_id)
            if tracked is None:
                continue
            try:
                self._annotate_one(r, tracked)
            except Exception as error:  # isolate: one request's text fault is its own
                results[k] = self._text_failed(r, tracked.request, error)

    def _text_failed(self, r: RequestOutput, request: Request,
                     error: Exception) -> RequestOutput:
        """End a request whose text failed with `error`: aborted if it is
        still live, marked aborted if it finished in this very step."""
        request.error = error
        self._tracked.pop(r.request_id, None)
        out = self.scheduler.abort(r.request_id)
        if out is not None:
            return out
        request.status = RequestStatus.FINISHED_ABORTED
        request.finish_reasons[:] = [RequestStatus.FINISHED_ABORTED] * len(request.finish_reasons)
        return RequestOutput(r.request_id, {}, True, request.status, list(request.finish_reasons))

    def _annotate_one(self, r: RequestOutput, tracked: _Tracked) -> None:
        if tracked.logprobs is not None:
            r.logprobs = {}
            for index in r.new_tokens:
                entry = self._step_logprobs.get((r.request_id, index))
                if entry is not None:
                    r.logprobs[index] = [entry]
                    tracked.logprobs[index].append(entry)
        if tracked.texts is not None:
            self._add_text(r, tracked.request, tracked.texts)

    def _add_text(self, r: RequestOutput, request: Request, texts: list[SampleText]) -> None:
        r.new_text = {}
        for index, tokens in r.new_tokens.items():
            text = texts[index]
            delta = "".join(text.add(t) for t in tokens)
            if r.finish_reasons[index] is not None:
                delta += text.finish()
                if text.stopped:  # the stop string came with the last token
                    r.finish_reasons[index] = RequestStatus.FINISHED_STOPPED
                    request.finish_reasons[index] = RequestStatus.FINISHED_STOPPED
            elif text.stopped:
                stopped = self.scheduler.stop_sample(r.request_id, index)
                if stopped is not None:
                    r.finished, r.status = stopped.finished, stopped.status
                    r.finish_reasons = stopped.finish_reasons
            r.new_text[index] = delta

    def _constrain(self, seqs: list[ScheduledSeq], run: StepRun) -> list[ScheduledSeq]:
        """The grammar mask of every sampling row whose request has a
        constraint (into `_step_masks`), computed before the forward; a row
        whose matcher raises is left out of the step and its request
        aborted with the error (`run.aborts`). Returns the rows that run.
        Costs nothing when no row is constrained."""
        self._step_masks.clear()
        kept = []
        for seq in seqs:
            request = seq.scheduled_request
            constraint = request.sampling.constraint
            if constraint is None or not seq.sample:
                kept.append(seq)
                continue
            try:
                matchers = self._matchers.setdefault(seq.request_id, {})
                for j in range(seq.num_samples):
                    index = j if seq.sample_index is None else seq.sample_index
                    output = request.outputs[index] if seq.sample_index is not None else ()
                    matcher = matchers.get(index)
                    if matcher is None:
                        matcher = matchers[index] = constraint.new_matcher()
                    self._step_masks[(seq.request_id, index)] = matcher.allowed(output)
            except Exception as error:  # noqa: BLE001 - the grammar's fault is its request's
                run.aborts.append((seq.request_id, error))
                continue
            kept.append(seq)
        return kept

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
            used = self.cache.num_slots - self.cache.num_free_slots
            stats.peak_state_bytes = max(stats.peak_state_bytes, used * recurrent.bytes_per_slot)

    def _deliver(self, results: list[RequestOutput]) -> list[RequestOutput]:
        """Call each request's callback with its output. A callback that
        raises (an `Exception`) does not stop the others: its request is
        aborted (FINISHED_ABORTED, `Request.error` holds the exception) and
        its final output is added to the returned list."""
        failed: list[RequestOutput | None] = []
        for r in results:
            callback = self._callbacks.get(r.request_id)
            if callback is not None:
                try:
                    callback(r)
                except Exception as exc:  # isolate: one request's fault is its own
                    failed.append(self._abort_failed(r.request_id, exc))
                    continue
            if r.finished:
                self._forget(r.request_id)
        return results + [f for f in failed if f is not None]

    def _abort_failed(self, request_id: Hashable, error: Exception) -> RequestOutput | None:
        self._forget(request_id)
        request = self.scheduler.get_request(request_id)
        if request is None:  # it finished in this very step
            return None
        request.error = error
        return self.scheduler.abort(request_id)

    # ------------------------------------------------------------ front-ends

    def stream(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Add `prompts` (all or none, as `generate`) and yield every
        `RequestOutput` as steps produce them (automatic ids in prompt order).

        Closing the iterator (or leaving a loop over it early, or an
        exception in it) aborts the requests it added that have not finished.
        """
        ids = self._add_all(prompts, sampling)
        try:
            while self.has_unfinished():
                yield from self.step()
        finally:
            for rid in ids:
                self.abort(rid)  # a no-op for a finished request

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run `prompts` to completion; outputs in prompt order.

        `sampling`: one `SamplingParams` for all, or one per prompt. All or
        nothing: every prompt is checked before any is queued. Other
        requests already queued run too (their outputs are not returned).
        """
        ids = self._add_all(prompts, sampling)
        requests = {rid: self._live_request(rid) for rid in ids}
        tracked = {rid: self._tracked.get(rid) for rid in ids}
        while any(not r.is_finished for r in requests.values()):
            self.step()
        return [
            _generation_output(r, tracked[rid]) for rid, r in requests.items()
        ]

    def _live_request(self, request_id: Hashable) -> Request:
        """The `Request` of an id just queued (it cannot have finished yet)."""
        request = self.scheduler.get_request(request_id)
        if request is None:
            raise IntegrityError(f"request {request_id!r} was queued but is not live")
        return request

    def _add_all(self, prompts, sampling) -> list[Hashable]:
        """Check every prompt, then queue them all (or none)."""
        if isinstance(prompts, (str, bytes)) or prompts is None:
            raise WrongArgumentType(f"prompts must be a list of prompts, got {prompts!r:.80}")
        try:
            prompts = list(prompts)
        except TypeError:
            raise WrongArgumentType(
                f"prompts must be a list of prompts, got {prompts!r:.80}"
            ) from None
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise InvalidArgument(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        requests = []
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            try:
                request = self._make_request(prompt, param, None, 0, None, None)
                self.scheduler.check_admissible(request)
            except InvalidArgument as exc:
                raise type(exc)(f"prompts[{index}]: {exc}") from None
            requests.append(request)
        for request in requests:
            self._queue(request, None)
        return [r.request_id for r in requests]

    # --------------------------------------------------------------- checks

    def check_integrity(self) -> None:
        """The storage's invariants: every layer group's, and the computed
        counts (raises `IntegrityError`); the draft model's storage too; and
        that the scheduler plans from the count the storage holds.
        O(pages + sequences)."""
        self.cache.check_integrity()
        if self.speculator is not None:
            self.speculator.draft_cache.check_integrity()
        self._check_computed_counts()

    def _check_computed_counts(self) -> None:
        """Each sequence in storage belongs to a live request, and the
        scheduler plans from the storage's own record of its computed count
        (`Scheduler.check_counts`: the one count the forwards move). Raises
        `IntegrityError`."""
        for seq_id in self.cache.sequence_ids():
            if self.scheduler.sequence_info(seq_id) is None:
                raise IntegrityError(f"storage holds {seq_id!r}, which no live request owns")
        self.scheduler.check_counts()

    def check_no_leaks(self) -> None:
        """For the end of a run: no request left, and nothing but the prefix
        cache holds storage (`PagedCache.check_no_leaks`, the draft model's
        storage too). Raises `IntegrityError`. Drops the device prefix
        caches. Cost: O(pages + cached prefixes)."""
        scheduler = self.scheduler
        if scheduler.has_unfinished():
            raise IntegrityError(f"the scheduler still has {scheduler.num_running} running, "
                                 f"{scheduler.num_waiting} waiting")
        self.cache.check_no_leaks()
        if self.speculator is not None:
            self.speculator.draft_cache.check_no_leaks()

    def debug_state(self) -> tuple:
        """The scheduler's and the store's `debug_state()`, plus the engine's
        own maps: equal before and after a refused call."""
        return (
            self.scheduler.debug_state(),
            self.cache.debug_state(),
            tuple(self._callbacks),
            tuple(self._keys),
            tuple(self._tracked),
        )


def _generation_output(request: Request, tracked: _Tracked | None) -> GenerationOutput:
    texts = logprobs = None
    if tracked is not None:
        if tracked.texts is not None:
            texts = [t.text for t in tracked.texts]
        logprobs = tracked.logprobs
    return GenerationOutput(request.request_id, request.prompt_tokens, request.outputs,
                            request.finish_reasons, request.metrics, texts, logprobs)


def check_model_len(max_model_len: int | None, model_context: int | None) -> None:
    """`InvalidArgument` when `max_model_len` is more than the model's
    context (None: either is unbounded)."""
    if max_model_len is not None and model_context is not None \
            and max_model_len > model_context:
        raise InvalidArgument(f"max_model_len {max_model_len} is more than the model's "
                              f"context ({model_context} tokens)")


def _num_slots(config: EngineConfig, hybrid: bool, speculative: bool) -> int:
    """The recurrent slots of the engine's storage: the config's, else
    `default_num_slots` for a hybrid model (0 for an attention-only one)."""
    if config.cache.num_slots is not None:
        return config.cache.num_slots
    if not hybrid:
        return 0
    return default_num_slots(config.scheduler.max_num_seqs, speculative)


def _engine_config(config: EngineConfig | None, scheduler_config: SchedulerConfig | None,
                   num_blocks: int | None, block_size: int | None,
                   settings: dict[str, Any]) -> EngineConfig:
    """The `EngineConfig` of `Engine`'s arguments: `config` as given, or one
    made of the flat keywords (`EngineConfig.of`); not both."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if value is not None:
            settings[name] = value
    if config is None:
        return EngineConfig.of(scheduler_config, **settings)
    if not isinstance(config, EngineConfig):
        raise WrongArgumentType(f"config must be an EngineConfig, got {config!r:.80}")
    if settings or scheduler_config is not None:
        given = sorted(settings) + (["scheduler_config"] if scheduler_config else [])
        raise InvalidArgument(f"give either config or setting keywords ({', '.join(given)}), "
                              f"not both")
    return config


def _model_vocab_size(model: Any) -> int:
    """The vocabulary size an mlx-lm model declares in its `args`, else the
    width of its logits for one token (one tiny forward on mlx-lm's caches)."""
    try:
        vocab = model.args.vocab_size
    except AttributeError:
        from mlx_lm.models.cache import make_prompt_cache

        logits = model(mx.array([[0]], dtype=mx.int32), cache=make_prompt_cache(model))
        vocab = int(logits.shape[-1])
    return check_int("vocab_size", vocab, 1)
