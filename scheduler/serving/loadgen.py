"""`blockmgr bench --url URL`: replay a workload or trace against any
OpenAI-compatible server and write the simulator's report format.

The requests are the simulator's (`scheduler.simulator.sessions_of`: the
same workload options and trace files `blockmgr simulate` reads). Arrivals
follow the workload: a session head with an arrival time is sent then
(open loop), one without waits for one of `concurrency` clients (closed
loop); a follow-up is sent `think_time` after the request it follows has
finished. `time_scale` multiplies every arrival and think time.

Each request is one streaming POST (`stream_options.include_usage`):
`/v1/completions` with the prompt as token ids (`prompt_format="tokens"`:
this server and vLLM take them; `mlx_lm.server` does not) or as text, or
`/v1/chat/completions` with the prompt's text segments as messages (the
first segment the system prompt, then user and assistant turns in
alternation, as the workload built them). Text is one word per token id
(`prompt_text`), so prompts that share token ids share their text.

Per request the client measures, from the moment it sends: time to the
first non-empty text delta (TTFT), to the last one, to the end of the
stream, and the largest gap between deltas; the token counts and
`usage.prompt_tokens_details.cached_tokens` are the server's (`usage`),
falling back to the number of non-empty deltas and the workload's prompt
length when a server reports no usage. A request that fails (HTTP error,
dropped connection, timeout) is counted as aborted with its error.

A follow-up turn's prompt quotes the workload's answer text, not the
server's answer, so every server sees the same prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from blockmgr.errors import IntegrityError, InvalidArgument
from scheduler.serving.bench_checks import load_section
from scheduler.simulator.config import SimulationConfig
from scheduler.simulator.metrics import MetricsRecorder, RequestRecord
from scheduler.simulator.tokens import TokenSource
from scheduler.simulator.workloads import RequestSpec, head_arrival

APIS = ("chat", "completions")
PROMPT_FORMATS = ("text", "tokens")
#: Workload kinds whose prompt segments alternate system, user, assistant, user...
_CHAT_KINDS = ("chat", "multiturn", "agent", "parallel", "tenants")
#: Words a token id maps to in text prompts (common words: about one token
#: each in the vocabularies of real models).
WORDS = tuple("""
the of and to in is for on that with as it be by at this are from or an was not can but
which have all one has more their will new also other time about when there were its may
some out up into than only over use two most first any these such what so after like well
work data model cache page block token text word prompt answer system user server client
request memory layer head batch step state value key query time list tree node root leaf
path file line code test run read write send open close start end left right high low
long short fast slow early late small large full empty free busy hot cold old young good
bad best worst same other next last each every many much few less more most own part
""".split())


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """How to talk to the server (the workload is the `SimulationConfig`).

    url: the server's base URL (`http://host:port`, with or without `/v1`).
    model: the model id to send; None: the first id of `GET /v1/models`.
    api: "chat" or "completions"; prompt_format: "text" or "tokens"
        (token ids need the completions API).
    time_scale: multiplies every arrival and think time.
    timeout: seconds one request may take before it is counted as failed.
    ignore_eos: send vLLM's `ignore_eos` so outputs run to max_tokens on
        servers that honour it.
    cache_salt: sent as every request's `cache_salt` (before the
        workload's namespace): a new one per run keeps a server that honours
        it (this one, vLLM) from answering from an earlier run's cache.
    """

    url: str
    model: str | None = None
    api: str = "chat"
    prompt_format: str = "text"
    time_scale: float = 1.0
    timeout: float = 600.0
    ignore_eos: bool = True
    api_key: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


def check_options(options: BenchOptions) -> None:
    """Raises `InvalidArgument` naming the bad option."""
    if not options.url.startswith(("http://", "https://")):
        raise InvalidArgument(f"url must start with http:// or https://, got {options.url!r}")
    if options.api not in APIS:
        raise InvalidArgument(f"api must be one of {', '.join(APIS)}, got {options.api!r}")
    if options.prompt_format not in PROMPT_FORMATS:
        raise InvalidArgument(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, "
                              f"got {options.prompt_format!r}")
    if options.api == "chat" and options.prompt_format == "tokens":
        raise InvalidArgument("token-id prompts need the completions api (chat takes text)")
    for name in ("time_scale", "timeout"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it (seconds since the run started)."""

    spec: RequestSpec
    sent: float
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    max_gap: float = 0.0
    num_deltas: int = 0
    usage: dict | None = None
    error: str | None = None

    def record(self) -> RequestRecord:
        spec, usage = self.spec, self.usage or {}
        prompt = usage.get("prompt_tokens") or spec.prompt_len
        output = usage.get("completion_tokens")
        output = self.num_deltas if output is None else output
        details = usage.get("prompt_tokens_details") or {}
        return RequestRecord(
            workload=spec.workload, arrival=self.sent, first_scheduled=None,
            first_token=self.first_token, last_token=self.last_token,
            finish=self.finish if self.finish is not None else self.sent,
            prompt_tokens=prompt, cached_tokens=details.get("cached_tokens"),
            output_tokens=output, computed_tokens=prompt + output, preemptions=0,
            max_gap=self.max_gap, samples=spec.n, aborted=self.error is not None,
        )


@dataclass(slots=True)
class BenchResult:
    """A finished run: the summary (the simulator's sections that a client
    can see) and the recorder with the per-request series."""

    config: SimulationConfig
    options: BenchOptions
    model: str
    summary: dict
    metrics: MetricsRecorder
    outcomes: list[Outcome] = field(default_factory=list)


# ---------------------------------------------------------------- prompts


def prompt_text(tokens: Iterable[int]) -> str:
    """One word per token id (`WORDS[id % len(WORDS)]`), space separated."""
    words = WORDS
    return " ".join(words[t % len(words)] for t in tokens)


class PromptBuilder:
    """Request bodies of `RequestSpec`s. O(prompt tokens) per request."""

    def __init__(self, vocab_size: int, options: BenchOptions) -> None:
        self.tokens = TokenSource(vocab_size)
        self.options = options

    def body(self, spec: RequestSpec, model: str) -> dict:
        body: dict = {"model": model, "max_tokens": spec.output_len, "stream": True,
                      "stream_options": {"include_usage": True}}
        if spec.n == 1:
            body["temperature"] = 0.0
        else:
            body.update(n=spec.n, temperature=1.0, seed=spec.output_key % (1 << 31))
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        salt = _cache_salt(self.options.cache_salt, spec.namespace)
        if salt is not None:
            body["cache_salt"] = salt  # vLLM's per-tenant cache isolation
        if self.options.api == "chat":
            body["messages"] = self.messages(spec)
        elif self.options.prompt_format == "tokens":
            body["prompt"] = self.token_ids(spec)
        else:
            body["prompt"] = prompt_text(self.token_ids(spec))
        return body

    def token_ids(self, spec: RequestSpec) -> list[int]:
        return list(spec.tokens) if spec.tokens is not None else self.tokens.expand(spec.prompt)

    def messages(self, spec: RequestSpec) -> list[dict]:
        """System, then user and assistant in turn, one message per segment
        (workloads of other shapes: the whole prompt as one user message)."""
        if spec.tokens is not None or spec.workload not in _CHAT_KINDS or len(spec.prompt) < 2:
            return [{"role": "user", "content": prompt_text(self.token_ids(spec))}]
        messages = []
        for i, (key, length) in enumerate(spec.prompt):
            role = "system" if i == 0 else ("user" if i % 2 else "assistant")
            messages.append({"role": role, "content": prompt_text(self.tokens.text(key, length))})
        return messages


def served_sessions(sessions: Iterable[list[RequestSpec]], builder: PromptBuilder,
                    encode: Callable[[str | list[dict]], list[int]]) -> list[list[RequestSpec]]:
    """The sessions as the server computes them: each request's prompt
    replaced by the token ids the server's tokenizer makes of what
    `builder` sends (`encode`: text or chat messages -> ids, the server's
    own `TextCodec.encode`; token-id prompts are sent as they are), every
    other field kept. Simulating these computes what the server computed:
    the chat template's tokens included, and a follow-up that quotes the
    workload's answer where the server cached its model's own answer.
    O(prompt tokens) per request."""
    options = builder.options
    served = []
    for session in sessions:
        specs = []
        for spec in session:
            if options.api == "chat":
                tokens = encode(builder.messages(spec))
            elif options.prompt_format == "tokens":
                tokens = builder.token_ids(spec)
            else:
                tokens = encode(prompt_text(builder.token_ids(spec)))
            specs.append(dataclasses.replace(spec, tokens=tuple(tokens)))
        served.append(specs)
    return served


def _cache_salt(run: str | None, namespace: object) -> str | None:
    """The run's salt and the workload's namespace, as one `cache_salt`."""
    parts = [part for part in (run, None if namespace is None else str(namespace))
             if part is not None]
    return "/".join(parts) if parts else None


# ------------------------------------------------------------------ client


def _httpx():
    try:  # the HTTP client the openai package uses (httpx before openai 3)
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


class LoadGenerator:
    """One run against one server. `run()` once; not reusable."""

    def __init__(self, config: SimulationConfig, options: BenchOptions,
                 sessions: list[list[RequestSpec]],
                 on_done: Callable[[Outcome], None] | None = None) -> None:
        self.config = config
        self.options = options
        self.sessions = sessions
        self.prompts = PromptBuilder(config.vocab_size, options)
        self.on_done = on_done
        self.outcomes: list[Outcome] = []
        self._start = 0.0
        self._model = options.model

    def _now(self) -> float:
        return time.perf_counter() - self._start

    async def run(self) -> BenchResult:
        httpx = _httpx()
        headers = {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key \
            else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.options.base, headers=headers,
                                     timeout=httpx.Timeout(self.options.timeout),
                                     limits=limits) as client:
            if self._model is None:
                self._model = await served_model(client)
            self._start = time.perf_counter()
            timed = [s for s in self.sessions if s[0].arrival is not None]
            untimed = iter([s for s in self.sessions if s[0].arrival is None])
            tasks = [asyncio.ensure_future(self._open_loop(client, timed))]
            tasks += [asyncio.ensure_future(self._client(client, untimed))
                      for _ in range(min(self.config.workload.concurrency, len(self.sessions)))]
            await asyncio.gather(*tasks)
            seconds = max((o.finish or o.sent for o in self.outcomes), default=0.0)
        return self._result(seconds)

    async def _open_loop(self, client, sessions: list[list[RequestSpec]]) -> None:
        """Each timed session starts at its head's arrival (scaled)."""
        running = []
        for session in sorted(sessions, key=head_arrival):
            delay = head_arrival(session) * self.options.time_scale - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
            running.append(asyncio.ensure_future(self._session(client, session)))
        await asyncio.gather(*running)

    async def _client(self, client, sessions) -> None:
        """A closed-loop client: one session after another."""
        for session in sessions:
            await asyncio.sleep(session[0].think_time * self.options.time_scale)
            await self._session(client, session)

    async def _session(self, client, session: list[RequestSpec]) -> None:
        for index, spec in enumerate(session):
            if index:
                await asyncio.sleep(spec.think_time * self.options.time_scale)
            await self._send(client, spec)

    async def _send(self, client, spec: RequestSpec) -> None:
        path = "/v1/chat/completions" if self.options.api == "chat" else "/v1/completions"
        body = self.prompts.body(spec, self._served_model())
        outcome = Outcome(spec, self._now())
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    outcome.error = f"HTTP {response.status_code}: {_error_message(text)}"
                else:
                    await self._read_stream(response, outcome)
        except Exception as error:  # noqa: BLE001 - any failure of one request is its outcome
            outcome.error = f"{type(error).__name__}: {error}"
        outcome.finish = self._now()
        self.outcomes.append(outcome)
        if self.on_done is not None:
            self.on_done(outcome)

    async def _read_stream(self, response, outcome: Outcome) -> None:
        """Server-sent events until `[DONE]` (or the end of the body)."""
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            chunk = json.loads(payload)
            if chunk.get("error"):
                raise RuntimeError(_error_message(json.dumps(chunk)))
            if chunk.get("usage"):
                outcome.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    self._on_delta(outcome)

    def _on_delta(self, outcome: Outcome) -> None:
        now = self._now()
        if outcome.first_token is None:
            outcome.first_token = now
        elif outcome.last_token is not None:  # set with first_token
            outcome.max_gap = max(outcome.max_gap, now - outcome.last_token)
        outcome.last_token = now
        outcome.num_deltas += 1

    def _result(self, seconds: float) -> BenchResult:
        metrics = MetricsRecorder()
        errors: Counter[str] = Counter()
        for outcome in sorted(self.outcomes, key=lambda o: o.sent):
            metrics.on_finish(outcome.record())
            if outcome.error is not None:
                errors[outcome.error[:200]] += 1
        summary = metrics.request_summary(seconds)
        summary["requests"]["submitted"] = len(self.outcomes)
        summary["requests"]["usage_reported"] = sum(o.usage is not None for o in self.outcomes)
        summary["requests"]["cached_tokens_reported"] = sum(
            bool((o.usage or {}).get("prompt_tokens_details")) for o in self.outcomes)
        summary["errors"] = dict(errors.most_common(10))
        summary["load"] = load_section(self.outcomes, self.options.time_scale)
        return BenchResult(self.config, self.options, self._served_model(), summary, metrics,
                           self.outcomes)

    def _served_model(self) -> str:
        """The model id requests name: the option's, or the one `run` asked the server for."""
        if self._model is None:
            raise IntegrityError("the served model is read before run() asked for it")
        return self._model


async def served_model(client) -> str:
    """The first model id the server lists."""
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as error:  # noqa: BLE001 - any failure: the same advice
        raise InvalidArgument(f"cannot read a model id from {client.base_url}/v1/models "
                              f"({type(error).__name__}: {error}); pass the model id with "
                              f"--model") from None


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return " ".join(text.split())[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:200]
    return str(error or body)[:200]


def run_bench(config: SimulationConfig, options: BenchOptions,
              sessions: list[list[RequestSpec]] | None = None,
              on_done: Callable[[Outcome], None] | None = None) -> BenchResult:
    """Replay `config`'s workload (or `sessions`) against `options.url`;
    blocks until every request has finished or failed."""
    if sessions is None:
        from scheduler.simulator.runner import sessions_of

        sessions = list(sessions_of(config))
    return asyncio.run(LoadGenerator(config, options, sessions, on_done).run())
