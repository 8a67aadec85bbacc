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
from collections.abc import Hashable
from dataclasses import dataclass, field


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
    stop_token_ids: sampling one of these ends the sample (the token is kept
        in the output, as the last one).
    seed: per-request random seed (reproducible sampling), None for the
        engine's global generator.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        _require_int("max_tokens", self.max_tokens, 1)
        _require_int("n", self.n, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}") from None
        for t in stop:
            _require_int("stop token id", t, 0)
        self.stop_token_ids = stop
        if self.seed is not None:
            _require_int("seed", self.seed, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
        if tokens_per_sample < 2 or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (tokens_per_sample - 1)


@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    request_id: any hashable id, unique among live requests (not a tuple:
        tuples name parallel samples, `(request_id, i)`).
    prompt_tokens: the prompt, at least one token.
    priority: lower runs first under the "priority" policy (as in vLLM).
    namespace: isolates prefix-cache hits (tenant, adapter, cache salt).
    arrival_time: None: stamped by `Scheduler.add_request` with its clock.

    Filled in by the scheduler: `status`, `outputs[i]` (tokens of sample i),
    `finish_reasons[i]`, `metrics`.
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

    def __post_init__(self) -> None:
        try:
            hash(self.request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {self.request_id!r}") from None
        if isinstance(self.request_id, tuple):
            raise ValueError("request_id must not be a tuple (reserved for sample ids)")
        if isinstance(self.prompt_tokens, (str, bytes)):
            raise ValueError("prompt_tokens must be token ids, not text")
        self.prompt_tokens = list(self.prompt_tokens)
        if not self.prompt_tokens:
            raise ValueError("a prompt needs at least one token")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {self.sampling!r}")
        _require_int("priority", self.priority, None)
        try:
            hash(self.namespace)
        except TypeError:
            raise ValueError(f"namespace must be hashable, got {self.namespace!r}") from None
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


def _require_int(name: str, value: object, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
