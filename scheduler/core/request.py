"""Requests: what a user asks for, and where it is in its life.

A `Request` is a prompt plus `SamplingParams`. The scheduler moves it through
`RequestStatus`:

    WAITING -> RUNNING -> FINISHED_LENGTH | FINISHED_STOPPED
         ^        |
         +- PREEMPTED (pages freed or swapped out; back to the waiting queue)
    any state -> FINISHED_ABORTED (`Scheduler.abort`)

With `n > 1` samples the prompt is computed once; its sequence is then
forked into one sequence per sample, and each sample has its own output
tokens and finish reason. The request finishes when every sample has.

No MLX here: these are plain records shared by the scheduler, the engine and
the simulator.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from blockmgr.errors import InvalidArgument, WrongArgumentType
from blockmgr.validation import check_hashable, check_int, check_number, prompt_list, token_list
from scheduler.core.constraints import Constraint

#: Seeds are 64-bit (`mlx.core.random.key`).
MAX_SEED = 2**64 - 1
#: Temperatures below this sample greedily (see `SamplingParams.greedy`).
GREEDY_BELOW = 1e-5
#: Most top log-probabilities one position may return (as OpenAI's API).
MAX_LOGPROBS = 20


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "finished_length"  # max_tokens (or max_model_len) reached
    FINISHED_STOPPED = "finished_stopped"  # a stop token was sampled
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED}
)


@dataclass(slots=True)
class SamplingParams:
    """How to sample; validated on construction (`ValueError`).

    max_tokens: tokens to generate per sample (>= 1).
    n: parallel samples sharing the prompt (>= 1).
    temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / T).
    top_p: nucleus sampling, in (0, 1]; 1 keeps every token.
    top_k: keep the k most likely tokens (>= 1); None keeps every token.
    min_p: keep tokens at least `min_p` times as likely as the most likely
        one, in [0, 1]; 0 keeps every token.
    repetition_penalty: > 0; a token already in the prompt or the sample's
        output has its logit divided by it (multiplied when negative); 1 is off.
    presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the
        logit of a token the sample's output holds, once / once per
        occurrence (OpenAI's definition); 0 is off.
    logit_bias: {token id: bias in [-100, 100]} added to the logits.
    logprobs: None, or N in [0, MAX_LOGPROBS]: return each sampled token's
        log-probability and the N most likely tokens' (log_softmax of the
        model's logits, before penalties, bias and temperature).
    stop_token_ids: sampling one of these ends the sample (the token is kept
        in the output, as the last one).
    stop: stop strings (needs an engine with a tokenizer): the sample ends
        when its text contains one; the text is cut before it.
    ignore_eos: do not stop at the tokenizer's end-of-sequence tokens
        (an engine with a tokenizer adds them to `stop_token_ids` otherwise).
    min_tokens: in [0, max_tokens]; until a sample has this many tokens its
        `stop_token_ids` (end of sequence included) cannot be sampled (their
        logits are -inf, as vLLM's); stop strings still apply.
    logits_processors: mlx-lm logits processors, `f(tokens, logits) ->
        logits` with `tokens` the sample's prompt + output so far (an
        `mx.array`) and `logits` ``[1, V]``; applied in order, first, one
        row at a time. One that raises is its request's fault (the engine
        aborts the request after its retries).
    seed: per-request random seed in [0, 2**64) (reproducible sampling),
        None for the engine's global generator.
    constraint: a `scheduler.core.constraints.Constraint` (a compiled grammar:
        JSON Schema, a tool call): each sample draws only tokens its
        grammar allows (applied after bias and penalties). Such a request
        is never speculated. A grammar that fails is its request's fault.
    retention_priority: an int (default 0): the prefixes this request hits
        and caches take it, and under memory pressure a cached prefix of
        lower priority is evicted or demoted before any of higher priority
        (least recently used first within one priority; a prefix's priority
        is its last user's). An agent's long context, for instance, outlives
        one-off chat prompts. Not a sampling option, but per request like
        them.

    Bad values raise `InvalidArgument` (a `ValueError`; `WrongArgumentType`,
    also a `TypeError`, for the wrong kind), naming the value.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logits_processors: tuple = ()
    min_tokens: int = 0
    constraint: Constraint | None = None
    retention_priority: int = 0

    def __post_init__(self) -> None:
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.n = check_int("n", self.n, 1)
        self.temperature = check_number("temperature", self.temperature, 0.0)
        self.top_p = check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_token_ids = tuple(token_list(self.stop_token_ids, "stop_token_ids"))
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0, MAX_SEED)
        if self.top_k is not None:
            self.top_k = check_int("top_k", self.top_k, 1)
        self.min_p = _check_range("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidArgument(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        self.presence_penalty = _check_range("presence_penalty", self.presence_penalty, -2, 2)
        self.frequency_penalty = _check_range("frequency_penalty", self.frequency_penalty, -2, 2)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.logprobs is not None:
            self.logprobs = check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.stop = _check_stop_strings(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise WrongArgumentType(f"ignore_eos must be a bool, got {self.ignore_eos!r:.80}")
        self.logits_processors = _check_processors(self.logits_processors)
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise WrongArgumentType(
                f"constraint must be a scheduler.core.constraints.Constraint, got "
                f"{self.constraint!r:.80}")
        self.retention_priority = check_int("retention_priority", self.retention_priority, None)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or below `GREEDY_BELOW` (where
        1 / temperature would overflow float32 and sampling would turn
        uniform instead of sharp)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Do the logits depend on the tokens so far (any penalty set)?"""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def filter_key(self) -> tuple:
        """What the token filters and the draw depend on: rows with equal
        keys are sampled in one call."""
        return (self.temperature, self.top_p, self.min_p, self.top_k)


def _check_range(name: str, value: object, low: float, high: float) -> float:
    number = check_number(name, value)
    if not low <= number <= high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value!r}")
    return number


def _check_logit_bias(bias: object) -> dict[int, float]:
    """{token id: bias in [-100, 100]} (keys may be decimal strings, as JSON
    gives them), as a new dict."""
    if not isinstance(bias, Mapping):
        raise WrongArgumentType(f"logit_bias must be a mapping, got {bias!r:.80}")
    checked = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isdecimal():
            key = int(key)
        token = check_int("logit_bias key", key, 0)
        checked[token] = _check_range(f"logit_bias[{token}]", value, -100.0, 100.0)
    return checked


def _check_processors(processors: object) -> tuple:
    if callable(processors) or not isinstance(processors, (list, tuple)):
        raise WrongArgumentType(
            f"logits_processors must be a list of callables, got {processors!r:.80}"
        )
    for index, item in enumerate(processors):
        if not callable(item):
            raise WrongArgumentType(f"logits_processors[{index}] is not callable: {item!r:.80}")
    return tuple(processors)


def _check_stop_strings(stop: object) -> tuple[str, ...]:
    """A str or a sequence of non-empty strs, as a tuple."""
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise WrongArgumentType(f"stop must be a str or a list of str, got {stop!r:.80}")
    for index, item in enumerate(stop):
        if not isinstance(item, str):
            raise WrongArgumentType(f"stop[{index}] must be a str, got {item!r:.80}")
        if not item:
            raise InvalidArgument(f"stop[{index}] is an empty string")
    return tuple(stop)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely tokens' at its
    position, `top` as (token id, log-probability) pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (scheduler clock, seconds) and counters of one request.

    first_token_time / last_token_time cover every sample; `max_token_gap`
    is the longest wait between two tokens of one sample.
    """

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit of the first admission
    # that hit by tier (device, host, disk; `blockmgr.Tier`), None without colder tiers
    cached_tokens_by_tier: tuple[int, int, int] | None = None
    num_computed_tokens: int = 0  # tokens run through the model (recompute included)
    num_generated_tokens: int = 0  # over all samples
    num_samples: int = 1
    num_preemptions: int = 0
    max_token_gap: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between one sample's tokens after its first (None with
        < 2 tokens per sample). Samples decode side by side, so the tokens
        per sample, not their total over samples, divide the time."""
        tokens_per_sample = self.num_generated_tokens / self.num_samples
        if tokens_per_sample < 2 or self.first_token_time is None or self.last_token_time is None:
            return None  # (the first and the last token time are stamped together)
        return (self.last_token_time - self.first_token_time) / (tokens_per_sample - 1)


@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    request_id: any hashable id, unique among live requests (not a tuple:
        tuples name parallel samples, `(request_id, i)`).
    prompt_tokens: the prompt, at least one token id (checked by
        `blockmgr.validation.prompt_list`; the engine checks exactly).
    priority: lower runs first under the "priority" policy (as in vLLM).
    namespace: isolates prefix-cache hits (tenant, adapter, cache salt).
    arrival_time: None: stamped by `Scheduler.add_request` with its clock.

    Filled in by the scheduler: `status`, `outputs[i]` (tokens of sample i),
    `finish_reasons[i]`, `metrics`; by the engine: `error`, the exception
    that aborted the request (its callback raised), else None.
    """

    request_id: Hashable
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    namespace: Hashable = None
    arrival_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    outputs: list[list[int]] = field(default_factory=list)
    finish_reasons: list[RequestStatus | None] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        check_hashable("request_id", self.request_id)
        if isinstance(self.request_id, tuple):
            raise InvalidArgument(
                f"request_id must not be a tuple (reserved for sample ids), got {self.request_id!r}"
            )
        self.prompt_tokens = prompt_list(self.prompt_tokens, "prompt_tokens")
        if not isinstance(self.sampling, SamplingParams):
            raise WrongArgumentType(f"sampling must be SamplingParams, got {self.sampling!r:.80}")
        self.priority = check_int("priority", self.priority, None)
        check_hashable("namespace", self.namespace)
        n = self.sampling.n
        self.outputs = [[] for _ in range(n)]
        self.finish_reasons = [None] * n
        self.metrics.num_prompt_tokens = len(self.prompt_tokens)
        self.metrics.num_samples = n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def seq_id(self, sample_index: int | None) -> Hashable:
        """The block-manager sequence id of a sample (None: the prompt's)."""
        if sample_index is None or self.sampling.n == 1:
            return self.request_id
        return (self.request_id, sample_index)
