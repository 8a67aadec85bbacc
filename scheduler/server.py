"""An OpenAI-compatible HTTP server over an `AsyncEngine` (Starlette).

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streaming by
server-sent events, or one JSON answer), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text, `scheduler.metrics`).

Every request body is checked before anything is queued: a malformed one
gets 400 with OpenAI's error object naming the bad field (the checks are
`SamplingParams`' and the engine's own, `blockmgr.validation`); an unknown
model 404; a full waiting queue 429; a stopped engine 503. A completions
body with several prompts queues one request per prompt, all or none. `usage` reports
`prompt_tokens_details.cached_tokens`, the prefix-cache hit of the request.
A client that disconnects (mid-stream or while waiting for a whole answer)
has its request aborted, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from blockmgr.errors import InvalidArgument
from scheduler.async_engine import AsyncEngine, EngineStopped, QueueFull
from scheduler.request import RequestStatus, SamplingParams, TokenLogprob
from scheduler.scheduler import RequestOutput

#: OpenAI's default max_tokens for /v1/completions.
DEFAULT_MAX_TOKENS = 16
#: The most top logprobs per position each endpoint accepts (OpenAI's limits).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
#: The most prompts one /v1/completions body may hold (each is a request).
MAX_PROMPTS = 64

_FINISH = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
#: Body fields mapped one to one onto `SamplingParams` (OpenAI's, then vLLM's extensions).
_PASSTHROUGH = ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
                "top_k", "min_p", "repetition_penalty", "ignore_eos")


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}
        return JSONResponse(body, status_code=self.status)


def build_app(engine: AsyncEngine, model_name: str) -> Starlette:
    """The Starlette app; starts `engine` on startup, shuts it down on exit."""
    api = OpenAIServer(engine, model_name)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        aborted = await asyncio.to_thread(engine.shutdown)
        logging.getLogger("uvicorn.error").info(
            "blockmgr serve: engine stopped, %d unfinished requests aborted", aborted)

    return Starlette(routes=routes, lifespan=lifespan)


class OpenAIServer:
    """Request handlers (see the module doc)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.text.tokenizer if engine.engine.text else None
        self.created = int(time.time())

    # ---------------------------------------------------------------- routes

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "blockmgr"}]})

    async def health(self, request: HttpRequest) -> Response:
        if not self.engine.is_running:
            return PlainTextResponse("stopped", status_code=503)
        return PlainTextResponse("ok")

    async def metrics(self, request: HttpRequest) -> Response:
        text = self.engine.metrics.render(self.engine.engine)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def chat(self, request: HttpRequest) -> Response:
        return await self._serve(request, chat=True)

    async def completions(self, request: HttpRequest) -> Response:
        return await self._serve(request, chat=False)

    # ------------------------------------------------------------- requests

    async def _serve(self, request: HttpRequest, chat: bool) -> Response:
        streams = []
        try:
            body = await _json_body(request)
            self._check_model(body)
            prompts, sampling = (_chat_request if chat else _completion_request)(body)
            options = _Options.of(body, chat)
            for prompt in prompts:
                streams.append(await self.engine.add(prompt, sampling))
        except HttpError as error:
            return error.response()
        except QueueFull as error:
            self._abort(streams)
            return HttpError(429, str(error), "rate_limit_exceeded").response()
        except EngineStopped as error:
            self._abort(streams)
            return HttpError(503, str(error), "server_error").response()
        except InvalidArgument as error:  # every typed check (WrongArgumentType included)
            self._abort(streams)
            return HttpError(400, str(error)).response()
        reply = _Reply(self, streams, sampling, options, chat)
        if options.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        return await self._whole(request, reply)

    async def _whole(self, request: HttpRequest, reply: _Reply) -> Response:
        """Wait for the whole answer, aborting the request if the client leaves."""
        answer = asyncio.ensure_future(reply.collect())
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer not in done:
            answer.cancel()  # closes the output iteration: the request is aborted
            try:
                await answer
            except asyncio.CancelledError:
                pass
            return Response(status_code=499)
        gone.cancel()
        return JSONResponse(answer.result())

    def _abort(self, streams) -> None:
        """Abort the requests queued for a body that then failed (all or none)."""
        for stream in streams:
            self.engine.abort(stream.request.request_id)

    def _check_model(self, body: Mapping) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise HttpError(404, f"model {model!r:.80} is not served here "
                            f"(this server serves {self.model_name!r})", "not_found_error",
                            "model")

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)


class _Options:
    """What shapes the reply (not the sampling)."""

    __slots__ = ("stream", "include_usage")

    @classmethod
    def of(cls, body: Mapping, chat: bool) -> _Options:
        self = cls()
        self.stream = _bool(body, "stream", False)
        options = body.get("stream_options") or {}
        if not isinstance(options, Mapping):
            raise HttpError(400, "stream_options must be an object", param="stream_options")
        self.include_usage = bool(options.get("include_usage", False))
        return self


class _Reply:
    """Turns the outputs of one body's requests (one per prompt) into
    OpenAI's JSON or SSE chunks: choice `k * n + i` is prompt k's sample i."""

    def __init__(self, server: OpenAIServer, streams, sampling: SamplingParams, options, chat):
        self.server, self.streams, self.sampling, self.options, self.chat = (
            server, streams, sampling, options, chat)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        n = sampling.n * len(streams)
        self.texts = [""] * n
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.num_tokens = [0] * n
        self.offsets = [0] * n  # completions logprobs: characters of the tokens so far

    def _absorb(self, first: int, out: RequestOutput) -> None:
        """Take one output of the request whose first choice is `first`."""
        for i, tokens in out.new_tokens.items():
            self.num_tokens[first + i] += len(tokens)
        for i, text in (out.new_text or {}).items():
            self.texts[first + i] += text
        for i, entries in (out.logprobs or {}).items():
            self.logprobs[first + i].extend(entries)
        for i, reason in enumerate(out.finish_reasons):
            if reason is not None:
                self.reasons[first + i] = _FINISH[reason]

    def usage(self) -> dict:
        metrics = [stream.request.metrics for stream in self.streams]
        prompt = sum(m.num_prompt_tokens for m in metrics)
        completion = sum(self.num_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(m.num_cached_tokens or 0 for m in metrics)}}

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(first choice index, output) of every request as they come;
        leaving early (or a failure) aborts every unfinished request."""
        engine, n = self.server.engine, self.sampling.n
        if len(self.streams) == 1:
            async for out in engine.outputs(self.streams[0]):
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(first: int, stream) -> None:
            try:
                async for out in engine.outputs(stream):
                    merged.put_nowait((first, out))
            except Exception as error:  # noqa: BLE001 - re-raised by the reader
                merged.put_nowait((first, error))
            finally:
                merged.put_nowait((first, None))

        tasks = [asyncio.ensure_future(pump(k * n, s)) for k, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                first, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield first, item
        finally:
            for task in tasks:
                task.cancel()  # closes its output iteration: an unfinished request is aborted

    async def collect(self) -> dict:
        async for first, out in self.outputs():
            self._absorb(first, out)
        choices = []
        for i in range(len(self.texts)):
            choice: dict[str, Any] = {"index": i, "finish_reason": self.reasons[i]}
            logprobs = self._logprobs(i, self.logprobs[i]) if self.sampling.logprobs is not None \
                else None
            if self.chat:
                choice["message"] = {"role": "assistant", "content": self.texts[i]}
            else:
                choice["text"] = self.texts[i]
            choice["logprobs"] = logprobs
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices,
                "usage": self.usage()}

    async def events(self) -> AsyncIterator[str]:
        """SSE: a chunk per output and sample, the usage chunk if asked, [DONE]."""
        if self.chat:
            for i in range(self.sampling.n):
                yield _sse(self._chunk(i, {"role": "assistant", "content": ""}, None, None))
        async for first, out in self.outputs():
            before = [len(self.logprobs[first + i]) for i in range(self.sampling.n)]
            self._absorb(first, out)
            for i in sorted(set(out.new_tokens) | set(out.new_text or {})):
                text = (out.new_text or {}).get(i, "")
                reason = self.reasons[first + i] if out.finish_reasons[i] is not None else None
                logprobs = None
                if self.sampling.logprobs is not None:
                    logprobs = self._logprobs(first + i, self.logprobs[first + i][before[i]:])
                delta = {"content": text} if self.chat else text
                yield _sse(self._chunk(first + i, delta, reason, logprobs))
        if self.options.include_usage:
            yield _sse({"id": self.id, "object": self._chunk_object(), "created": self.created,
                        "model": self.server.model_name, "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index, delta, reason, logprobs) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": self.id, "object": self._chunk_object(), "created": self.created,
                "model": self.server.model_name, "choices": [choice]}

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> dict:
        """OpenAI's logprobs object of sample `index`'s `entries` (chat:
        `content`; completions: tokens, token_logprobs, top_logprobs and
        text_offset, continuing from the sample's earlier tokens)."""
        text = self.server.token_text
        if self.chat:
            return {"content": [{
                "token": text(e.token), "logprob": e.logprob,
                "bytes": list(text(e.token).encode()),
                "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())}
                                 for t, v in e.top]} for e in entries]}
        tokens = [text(e.token) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(t): v for t, v in e.top} for e in entries],
                "text_offset": offsets}


# ----------------------------------------------------------------- parsing


async def _json_body(request: HttpRequest) -> Mapping:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HttpError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _sampling(body: Mapping, extra: dict) -> SamplingParams:
    """`SamplingParams` from the body's fields; its checks name the field."""
    kwargs = {name: body[name] for name in _PASSTHROUGH if body.get(name) is not None}
    kwargs.setdefault("temperature", 1.0)  # OpenAI's default
    if kwargs.get("top_k") in (0, -1):
        del kwargs["top_k"]  # vLLM's spelling of "off"
    stop = body.get("stop")
    if stop is not None:
        kwargs["stop"] = stop
    bias = body.get("logit_bias")
    if bias is not None:
        kwargs["logit_bias"] = bias
    kwargs.update(extra)
    try:
        return SamplingParams(**kwargs)
    except InvalidArgument as error:
        raise HttpError(400, str(error)) from None


def _max_tokens(body: Mapping, names: tuple[str, ...], default: int | None) -> dict:
    for name in names:
        if body.get(name) is not None:
            return {"max_tokens": body[name]}
    return {} if default is None else {"max_tokens": default}


def _prompts(body: Mapping) -> list:
    """OpenAI's prompt forms: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = prompt  # a batch: strings or token-id lists
    else:
        prompts = [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise HttpError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                        param="prompt")
    for item in prompts:
        if not isinstance(item, (str, list)) or not item:
            raise HttpError(400, f"prompt must be a non-empty string, a list of token ids or a "
                            f"list of those, got {item!r:.80}", param="prompt")
    return prompts


def _completion_request(body: Mapping) -> tuple[list, SamplingParams]:
    prompts = _prompts(body)
    if body.get("echo"):
        raise HttpError(400, "echo is not supported", param="echo")
    extra = _max_tokens(body, ("max_tokens",), DEFAULT_MAX_TOKENS)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) \
                or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise HttpError(400, f"logprobs must be an int in [0, {MAX_COMPLETION_LOGPROBS}], "
                            f"got {logprobs!r:.40}", param="logprobs")
        extra["logprobs"] = logprobs
    return prompts, _sampling(body, extra)


def _chat_request(body: Mapping) -> tuple[list, SamplingParams]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, f"messages must be a non-empty list, got {messages!r:.80}",
                        param="messages")
    extra = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    if "max_tokens" not in extra:
        extra["max_tokens"] = 512
    if _bool(body, "logprobs", False):
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) \
                or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise HttpError(400, f"top_logprobs must be an int in [0, {MAX_CHAT_TOP_LOGPROBS}], "
                            f"got {top!r:.40}", param="top_logprobs")
        extra["logprobs"] = top
    return [[_plain_message(m, i) for i, m in enumerate(messages)]], _sampling(body, extra)


def _plain_message(message: object, index: int) -> dict:
    """A message with its content as one string (text parts joined)."""
    if not isinstance(message, Mapping):
        raise HttpError(400, f"messages[{index}] must be an object", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise HttpError(400, f"messages[{index}]: only text content parts are supported",
                                param="messages")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    return {**message, "content": content}


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(400, f"{name} must be true or false, got {value!r:.40}", param=name)
    return value


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _disconnected(request: HttpRequest) -> None:
    """Return when the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
