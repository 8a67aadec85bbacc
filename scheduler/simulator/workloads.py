"""Synthetic workloads: sessions of requests with shared and growing prefixes.

A workload is a stream of *sessions*. A session is a list of requests; the
first has an arrival time (open loop) or is issued when a client is free
(closed loop); each later request arrives `think_time` seconds after the one
before it finishes. Prompts are lists of `(key, length)` text segments (see
`tokens.py`), so a follow-up prompt can contain the previous prompt and the
previous *output* verbatim: outputs are deterministic texts keyed by the
request's `output_key` (sample i: `derive_key(output_key, i)`).

Kinds (see design/simulator.md for the full description):

chat       system prompt (one of a few, Zipf popularity) + a user message.
multiturn  a conversation: turn k's prompt = turn k-1's prompt + its answer
           + a new user message; turns arrive after a think time.
agent      a tool loop: a long tool-spec system prompt and a task, then
           steps whose prompt = previous prompt + previous output (a short
           tool call) + a long tool result; steps arrive after the tool's
           latency. Contexts grow to thousands of tokens.
parallel   a chat request sampled n times (`n > 1`: the scheduler forks).
tenants    chat across many tenants: each request has a namespace; every
           tenant uses the *same* system prompt texts, so any hit across
           tenants would be an isolation bug.

Every session stops growing before `max_context` tokens (prompt + output).
Generation costs O(segments) per request; no token ids are produced here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blockmgr.errors import IntegrityError, InvalidArgument, WrongArgumentType
from blockmgr.validation import check_choice, check_int, check_number
from scheduler.simulator.lengths import LengthDist, parse_length
from scheduler.simulator.tokens import derive_key

WORKLOAD_KINDS = ("chat", "multiturn", "agent", "parallel", "tenants")
ARRIVALS = ("poisson", "closed")

Segment = tuple[int, int]  # (text key, length in tokens)


@dataclass(slots=True, eq=False)
class RequestSpec:
    """One request of a workload (not yet a scheduler `Request`).

    prompt: text segments; `tokens` replaces them for traces with explicit ids.
    output_len: tokens to generate per sample (max_tokens; no stop tokens).
    output_key: sample i generates text `derive_key(output_key, i)`.
    arrival: absolute arrival in simulated seconds, or None when the runner
        decides (closed loop heads, follow-ups).
    after: request id of the previous request of the session (None for a head).
    think_time: seconds between `after` finishing (closed loop: the client
        becoming free) and this request arriving.
    """

    request_id: str
    prompt: tuple[Segment, ...]
    output_len: int
    output_key: int
    n: int = 1
    namespace: str | int | None = None  # a tenant (traces give strings or integers)
    arrival: float | None = None
    after: str | None = None
    think_time: float = 0.0
    workload: str = "chat"
    tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise InvalidArgument(
                f"{self.request_id}: output_len must be >= 1, got {self.output_len}")
        if self.n < 1:
            raise InvalidArgument(f"{self.request_id}: n must be >= 1, got {self.n}")
        if self.prompt_len < 1:
            raise InvalidArgument(f"{self.request_id}: empty prompt")
        if self.think_time < 0 or not math.isfinite(self.think_time):
            raise InvalidArgument(
                f"{self.request_id}: think_time must be >= 0, got {self.think_time}")
        if self.arrival is not None and (self.arrival < 0 or not math.isfinite(self.arrival)):
            raise InvalidArgument(f"{self.request_id}: arrival must be >= 0, got {self.arrival}")

    @property
    def prompt_len(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        return sum(length for _, length in self.prompt)

    def sampling(self):
        """The request's `SamplingParams`: greedy for one sample; n > 1
        samples draw at temperature 1 from a seed of the request, so they
        differ (on the real engine as in the workload's texts)."""
        from scheduler.core.request import SamplingParams

        if self.n == 1:
            return SamplingParams(max_tokens=self.output_len)
        return SamplingParams(max_tokens=self.output_len, n=self.n, temperature=1.0,
                              seed=self.output_key % (1 << 31))

    def output_segment(self, sample: int = 0) -> Segment:
        """The text this request generates for `sample` (a follow-up's input)."""
        return (derive_key(self.output_key, sample), self.output_len)


def _lognormal(mean: float, sigma: float, high: int, low: int = 1) -> LengthDist:
    return LengthDist("lognormal", mean, sigma, low, high)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What to generate; validated on construction (`InvalidArgument`, a
    `ValueError`).

    mix: workload kind -> weight (the share of *sessions* of that kind).
    num_requests: total requests (the last session may be cut short).
    arrival: "poisson" (sessions start at `rate` per simulated second) or
        "closed" (`concurrency` clients, each starting its next session
        when its previous one ends).
    max_context: a session stops before prompt + output exceeds it.
    Length distributions: system prompts, user messages and outputs of chat,
    multiturn, parallel and tenants; the agent kind has its own.
    """

    mix: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WORKLOAD_KINDS, 1.0))
    num_requests: int = 2000
    arrival: str = "poisson"
    rate: float = 1.0
    concurrency: int = 64
    seed: int = 0
    max_context: int = 8192
    num_system_prompts: int = 8
    system_len: LengthDist = _lognormal(600, 0.5, 2048, 64)
    user_len: LengthDist = _lognormal(120, 0.8, 2048)
    output_len: LengthDist = _lognormal(100, 0.7, 1024)
    turns: LengthDist = LengthDist("uniform", 2, 8)
    think_time: float = 3.0
    agent_system_len: LengthDist = _lognormal(1500, 0.3, 4096, 256)
    agent_task_len: LengthDist = _lognormal(300, 0.6, 2048)
    agent_steps: LengthDist = LengthDist("uniform", 3, 12)
    agent_output_len: LengthDist = _lognormal(60, 0.5, 512)
    tool_output_len: LengthDist = _lognormal(400, 1.0, 4096)
    tool_time: float = 0.5
    num_agents: int = 4
    n: int = 4
    num_tenants: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.mix, dict) or not self.mix:
            raise InvalidArgument("workload mix must name at least one kind")
        for kind, weight in self.mix.items():
            check_choice("workload", kind, WORKLOAD_KINDS)
            check_number(f"workload weight for {kind}", weight, 0.0)
        if sum(self.mix.values()) <= 0:
            raise InvalidArgument("workload weights must not all be 0")
        check_choice("arrival", self.arrival, ARRIVALS)
        for name, value in (
            ("num_requests", self.num_requests),
            ("concurrency", self.concurrency),
            ("num_system_prompts", self.num_system_prompts),
            ("num_agents", self.num_agents),
            ("n", self.n),
            ("num_tenants", self.num_tenants),
        ):
            check_int(name, value, 1, strict=True)
        check_int("seed", self.seed, 0, strict=True)
        check_int("max_context", self.max_context, 16, strict=True)
        check_number("rate", self.rate, above=0.0)
        check_number("think_time", self.think_time, 0.0)
        check_number("tool_time", self.tool_time, 0.0)
        for name, spec in self.__dataclass_fields__.items():
            if isinstance(spec.default, LengthDist) \
                    and not isinstance(getattr(self, name), LengthDist):
                raise WrongArgumentType(
                    f"{name} must be a LengthDist, got {getattr(self, name)!r:.80}")

    def to_dict(self) -> dict:
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = value.spec() if isinstance(value, LengthDist) else value
        out["mix"] = dict(self.mix)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "WorkloadConfig":
        known = cls.__dataclass_fields__
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise InvalidArgument(f"unknown workload settings: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            default = known[name].default
            values[name] = parse_length(value) if isinstance(default, LengthDist) else value
        return cls(**values)


def head_arrival(session: Sequence[RequestSpec]) -> float:
    """When an open-loop session starts: its head's arrival time. Callers
    pass open-loop sessions only; a closed-loop one (no arrival) raises
    `IntegrityError`. O(1)."""
    arrival = session[0].arrival
    if arrival is None:
        raise IntegrityError(f"session of {session[0].request_id} has no arrival time")
    return arrival


class _Generator:
    """Draws sessions for one `WorkloadConfig`; deterministic for its seed."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        root = int(self.rng.integers(1 << 62))
        self._root = root
        kinds = [kind for kind in WORKLOAD_KINDS if cfg.mix.get(kind, 0) > 0]
        weights = np.array([cfg.mix[kind] for kind in kinds], dtype=float)
        self.kinds = kinds
        self.kind_p = _Choice(weights / weights.sum())
        self.system = self._texts(1, cfg.num_system_prompts, cfg.system_len)
        self.system_p = _Choice(_zipf(cfg.num_system_prompts))
        self.agent_system = self._texts(2, cfg.num_agents, cfg.agent_system_len)
        self.tenant_p = _Choice(_zipf(cfg.num_tenants))
        self.clock = 0.0
        self.num_sessions = 0
        self._builders = {
            "chat": self._chat, "multiturn": self._multiturn, "agent": self._agent,
            "parallel": self._parallel, "tenants": self._tenants,
        }
        self._mean_gap = 1.0 / cfg.rate if cfg.arrival == "poisson" else None

    def _texts(self, family: int, count: int, dist: LengthDist) -> list[Segment]:
        lengths = dist.sample(self.rng, count)
        base = derive_key(self._root, family)
        return [(derive_key(base, i), int(length)) for i, length in enumerate(lengths)]

    def _key(self) -> int:
        return int(self.rng.integers(1 << 62))

    def session(self, budget: int) -> list[RequestSpec]:
        """The next session, at most `budget` requests long."""
        rng = self.rng
        kind = self.kinds[self.kind_p.draw(rng)]
        index = self.num_sessions
        self.num_sessions += 1
        arrival = None
        if self._mean_gap is not None:
            self.clock += float(rng.exponential(self._mean_gap))
            arrival = self.clock
        specs = self._builders[kind](f"{kind}-{index}", budget)
        specs[0].arrival = arrival
        return specs

    # ---------------------------------------------------------------- kinds

    def _system_prompt(self) -> Segment:
        return self.system[self.system_p.draw(self.rng)]

    def _single(self, sid: str, prompt: list[Segment], kind: str, *, n: int = 1, namespace=None):
        cfg = self.cfg
        prompt = _fit(prompt, cfg.max_context - 1)
        room = cfg.max_context - sum(length for _, length in prompt)
        output_len = min(cfg.output_len.one(self.rng), room)
        return [
            RequestSpec(f"{sid}", tuple(prompt), output_len, self._key(), n=n,
                        namespace=namespace, workload=kind)
        ]

    def _chat(self, sid: str, budget: int) -> list[RequestSpec]:
        prompt = [self._system_prompt(), (self._key(), self.cfg.user_len.one(self.rng))]
        return self._single(sid, prompt, "chat")

    def _parallel(self, sid: str, budget: int) -> list[RequestSpec]:
        prompt = [self._system_prompt(), (self._key(), self.cfg.user_len.one(self.rng))]
        return self._single(sid, prompt, "parallel", n=self.cfg.n)

    def _tenants(self, sid: str, budget: int) -> list[RequestSpec]:
        tenant = self.tenant_p.draw(self.rng)
        prompt = [self._system_prompt(), (self._key(), self.cfg.user_len.one(self.rng))]
        return self._single(sid, prompt, "tenants", namespace=f"tenant-{tenant}")

    def _multiturn(self, sid: str, budget: int) -> list[RequestSpec]:
        cfg = self.cfg
        turns = min(budget, cfg.turns.one(self.rng))
        first = [self._system_prompt(), (self._key(), cfg.user_len.one(self.rng))]
        return self._grow(
            sid, first, turns, "multiturn",
            next_input=lambda: cfg.user_len.one(self.rng),
            output_len=cfg.output_len, delay=cfg.think_time,
        )

    def _agent(self, sid: str, budget: int) -> list[RequestSpec]:
        cfg = self.cfg
        steps = min(budget, cfg.agent_steps.one(self.rng))
        agent = self.agent_system[int(self.rng.integers(len(self.agent_system)))]
        first = [agent, (self._key(), cfg.agent_task_len.one(self.rng))]
        return self._grow(
            sid, first, steps, "agent",
            next_input=lambda: cfg.tool_output_len.one(self.rng),
            output_len=cfg.agent_output_len, delay=cfg.tool_time,
        )

    def _grow(self, sid, prompt, count, kind, *, next_input, output_len, delay):
        """A chain of requests, each prompt extending the previous prompt + output."""
        cfg = self.cfg
        prompt = _fit(prompt, cfg.max_context - 1)
        specs: list[RequestSpec] = []
        used = sum(length for _, length in prompt)
        for turn in range(count):
            if turn:
                prev = specs[-1]
                extra = next_input()
                used = prev.prompt_len + prev.output_len + extra
                if used >= cfg.max_context:
                    break
                prompt = list(prev.prompt) + [prev.output_segment(0), (self._key(), extra)]
            out = min(output_len.one(self.rng), cfg.max_context - used)
            think = float(self.rng.exponential(delay)) if turn and delay > 0 else 0.0
            specs.append(
                RequestSpec(
                    f"{sid}.{turn}", tuple(prompt), out, self._key(), workload=kind,
                    after=specs[-1].request_id if specs else None, think_time=think,
                )
            )
        return specs


class _Choice:
    """An index drawn with probabilities `p`: exactly `rng.choice(len(p), p=p)`
    (one `rng.random()` against the normalised cumulative sum, the same
    stream), without its per-call checks of `p` (1 us a draw instead of 18)."""

    __slots__ = ("_cdf",)

    def __init__(self, p: np.ndarray) -> None:
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        self._cdf = cdf.tolist()

    def draw(self, rng: np.random.Generator) -> int:
        return bisect.bisect_right(self._cdf, rng.random())


def _zipf(count: int, exponent: float = 1.0) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return weights / weights.sum()


def _fit(prompt: list[Segment], limit: int) -> list[Segment]:
    """Cut the last segments so the prompt has at most `limit` tokens."""
    out: list[Segment] = []
    room = limit
    for key, length in prompt:
        if room <= 0:
            break
        out.append((key, min(length, room)))
        room -= out[-1][1]
    return out


def generate(cfg: WorkloadConfig) -> Iterator[list[RequestSpec]]:
    """Sessions in order of start, `cfg.num_requests` requests in total.

    Deterministic for `cfg` (seed included); lazy, O(1) memory per session.
    """
    gen = _Generator(cfg)
    remaining = cfg.num_requests
    while remaining > 0:
        session = gen.session(remaining)
        remaining -= len(session)
        yield session
