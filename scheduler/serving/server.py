"""An OpenAI-compatible HTTP server over an `AsyncEngine` (Starlette).

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streaming by
server-sent events, or one JSON answer), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text, `scheduler.serving.metrics`), and the prefix
cache's pins: `POST /v1/cache/pins` ({"pin_id", "prompt" or "messages",
"cache_salt"?}), `GET /v1/cache/pins`, `DELETE /v1/cache/pins/{pin_id}`.

Nothing a client sends, and no fault, can hurt another request
(`design/errors.md`, "Server"). Work is bounded before a request is admitted
or refused: the body is refused with 413 past `max_body_bytes` before it is
buffered, stop strings are bounded (`MAX_STOP_STRINGS` of at most
`MAX_STOP_LENGTH` characters; the engine matches them with one automaton),
prompts are tokenized and measured against `max_model_len` off the engine
thread. Every answer that is not a completion is OpenAI's error object:
400 for a malformed body (naming the field, vLLM's words past the
context), 404 for an unknown model or route, 405, 413, 429 for a full
waiting queue, 500 for a fault in the request's own path (its tokenizer, a
forward that keeps failing for it), 503 for a stopped or stopping engine.
A stream that fails after its first chunk ends with an error event and
`[DONE]`. A completions body with several prompts queues one request per
prompt, all or none. `cache_salt` is the request's prefix-cache namespace,
`retention_priority` (an int, default 0) its prefixes' retention priority
(`SamplingParams.retention_priority`: lower priorities are evicted first).
`usage` reports `prompt_tokens_details.cached_tokens`, the prefix-cache hit
of the request, and with host or disk cache tiers `cached_tokens_by_tier`
(`{"device": n, "host": n, "disk": n}`: where the hit's tokens were). A
client that disconnects (mid-stream or while waiting for a whole answer)
has its request aborted, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from blockmgr.errors import BlockManagerError, IntegrityError, InvalidArgument, UnknownSequence
from scheduler.core.records import RequestOutput
from scheduler.core.request import RequestMetrics, RequestStatus, SamplingParams, TokenLogprob
from scheduler.engine.text import ChatPrompt
from scheduler.serving.agent_api import AgentOptions
from scheduler.serving.async_engine import AsyncEngine, EngineStopped, QueueFull
from scheduler.serving.chat_output import ChatOutput

#: OpenAI's default max_tokens for /v1/completions.
DEFAULT_MAX_TOKENS = 16
#: The most top logprobs per position each endpoint accepts (OpenAI's limits).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
#: The most prompts one /v1/completions body may hold (each is a request).
MAX_PROMPTS = 64
#: The default request body limit (`blockmgr serve --max-body-size`) is
#: this many bytes per token of `max_model_len`, at least `MIN_BODY_BYTES`:
#: room for any prompt that fits, as text (JSON-escaped) or token ids, while
#: the tokenization a refused body can cost stays in proportion to the
#: context (a 5 MB text prompt: ~1 GB of RSS and 8-30 s of a worker thread).
BODY_BYTES_PER_TOKEN = 32
MIN_BODY_BYTES = 2**20


def default_max_body_bytes(max_model_len: int) -> int:
    """The default body limit for a context of `max_model_len` tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)
#: Stop strings one request may give, and their length in characters.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
#: Chat completions' default max_tokens (lowered to what the context leaves).
DEFAULT_CHAT_MAX_TOKENS = 512

logger = logging.getLogger("uvicorn.error")


def _off(*values: object) -> Callable[[object], bool]:
    """A field's values that ask for nothing (None always does)."""
    return lambda value: value is None or any(value == v for v in values)


#: Fields of OpenAI's API and of vLLM's extensions that change the answer
#: and that this server does not implement, with the values that ask for
#: nothing (accepted): any other value is refused with a 400 naming them.
_UNSUPPORTED_COMMON: dict[str, Callable[[object], bool]] = {
    "best_of": _off(1),
    "use_beam_search": _off(False),
    "length_penalty": _off(1, 1.0),
    "guided_json": _off(),
    "guided_regex": _off(),
    "guided_choice": _off(),
    "guided_grammar": _off(),
    "structured_outputs": _off(),
    "allowed_token_ids": _off(),
    "bad_words": _off([]),
    "prompt_logprobs": _off(),
    "truncate_prompt_tokens": _off(),
    "include_stop_str_in_output": _off(False),
    "skip_special_tokens": _off(True),
    "spaces_between_special_tokens": _off(True),
}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "functions": _off([]),
    "function_call": _off("none", "auto"),
    "audio": _off(),
    "modalities": _off(["text"]),
    "reasoning_effort": _off(),
    "verbosity": _off(),
    "web_search_options": _off(),
    "echo": _off(False),
    "chat_template": _off(),
    "add_generation_prompt": _off(True),
    "continue_final_message": _off(False),
    "documents": _off(),
}
_UNSUPPORTED_COMPLETION = {
    **_UNSUPPORTED_COMMON,
    "suffix": _off(""),
    "echo": _off(False),
}

_FINISH = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
#: Body fields mapped one to one onto `SamplingParams` (OpenAI's, then vLLM's extensions).
_PASSTHROUGH = ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
                "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
                "min_tokens", "retention_priority")


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def of_fault(cls, error: BaseException) -> HttpError:
        """The error a request's own fault answers: 503 when the engine
        stopped (or is stopping), else 500 naming the exception."""
        if isinstance(error, EngineStopped):
            return cls(503, str(error), "server_error")
        return cls(500, f"the request failed: {type(error).__name__}: {error}"[:500],
                   "server_error")


def build_app(engine: AsyncEngine, model_name: str, *,
              max_body_bytes: int | None = None, routes: Sequence[Route] = ()) -> Starlette:
    """The Starlette app; starts `engine` on startup, shuts it down on exit.
    `max_body_bytes`: larger request bodies are refused (413) unread
    (default: `default_max_body_bytes` of the engine's `max_model_len`).
    `routes`: more routes (`operator_api`'s), after the OpenAI ones."""
    api = OpenAIServer(engine, model_name, max_body_bytes=max_body_bytes)
    table = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        *routes,
        *pin_routes(api),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        aborted = await asyncio.to_thread(engine.shutdown)
        logger.info("blockmgr serve: engine stopped, %d unfinished requests aborted", aborted)

    handlers = {HTTPException: _route_error, Exception: _unexpected_error}
    return Starlette(routes=table, lifespan=lifespan, exception_handlers=handlers)


async def _route_error(request: HttpRequest, error: Exception) -> Response:
    """Starlette's 404 (no such route) and 405 as OpenAI's error object."""
    if not isinstance(error, HTTPException):  # registered for HTTPException only
        return await _unexpected_error(request, error)
    method, path = request.method, request.url.path
    if error.status_code == 404:
        message = f"Unknown request URL: {method} {path:.200}"
    elif error.status_code == 405:
        message = f"method {method} is not allowed on {path:.200}"
    else:
        message = str(error.detail)
    return HttpError(error.status_code, message).response(error.headers)


async def _unexpected_error(request: HttpRequest, error: Exception) -> Response:
    """A bug that escaped a handler: still OpenAI's error object (uvicorn
    logs the traceback)."""
    return HttpError(500, f"internal error: {type(error).__name__}", "server_error").response()


class OpenAIServer:
    """Request handlers (see the module doc)."""

    def __init__(self, engine: AsyncEngine, model_name: str, *,
                 max_body_bytes: int | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        max_model_len = engine.engine.scheduler.config.max_model_len
        if max_model_len is None:  # the Engine sets it (at most what the pool holds)
            raise IntegrityError("the engine's scheduler has no max_model_len")
        self.max_model_len = max_model_len
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(self.max_model_len)
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

    # ----------------------------------------------------------------- pins

    async def pin(self, request: HttpRequest) -> Response:
        """POST /v1/cache/pins {"pin_id", "prompt" (text or token ids) or
        "messages", "cache_salt"?}: keep the cached prefix of the prompt on
        the device, out of every eviction, until deleted (`PagedCache.pin`).
        Answers {"pin_id", "cached_tokens"} (0: nothing cached, no pin)."""
        try:
            body = await _json_body(request, self.max_body_bytes)
            pin_id = body.get("pin_id")
            if not isinstance(pin_id, str) or not pin_id:
                raise HttpError(400, "pin_id must be a non-empty string", param="pin_id")
            prompt = body.get("messages", body.get("prompt"))
            if prompt is None:
                raise HttpError(400, "a pin needs a prompt or messages", param="prompt")
            tokens = await self.engine.encode(prompt)
            namespace = _cache_salt(body)

            def pin(engine: Any) -> int:
                engine.cache.pin(pin_id, tokens, namespace)
                return engine.cache.pinned().get(pin_id, 0)

            cached = await self.engine.call(pin)
        except HttpError as error:
            return error.response()
        except BlockManagerError as error:  # a pin id in use, no room to load, a bad prompt
            return HttpError(400, str(error), param="pin_id").response()
        except EngineStopped as error:
            return HttpError.of_fault(error).response()
        return JSONResponse({"pin_id": pin_id, "cached_tokens": cached})

    async def pins(self, request: HttpRequest) -> Response:
        """GET /v1/cache/pins: {"data": [{"pin_id", "cached_tokens"}, ...]}."""
        try:
            pinned = await self.engine.call(lambda engine: engine.cache.pinned())
        except EngineStopped as error:
            return HttpError.of_fault(error).response()
        return JSONResponse({"data": [{"pin_id": str(k), "cached_tokens": v}
                                      for k, v in pinned.items()]})

    async def unpin(self, request: HttpRequest) -> Response:
        """DELETE /v1/cache/pins/{pin_id}: the prefix may be evicted again
        (404 for an unknown pin)."""
        pin_id = request.path_params["pin_id"]
        try:
            await self.engine.call(lambda engine: engine.cache.unpin(pin_id))
        except UnknownSequence:
            return HttpError(404, f"no pin {pin_id!r:.80}", "not_found_error",
                             "pin_id").response()
        except EngineStopped as error:
            return HttpError.of_fault(error).response()
        return JSONResponse({"pin_id": pin_id, "deleted": True})

    # ------------------------------------------------------------- requests

    async def _serve(self, request: HttpRequest, chat: bool) -> Response:
        streams = []
        try:
            body = await _json_body(request, self.max_body_bytes)
            self._check_model(body)
            _check_supported(body, _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)
            prompts, sampling, max_tokens_given = (
                _chat_request if chat else _completion_request)(body)
            namespace = _cache_salt(body)
            options = _Options.of(body, chat)
            agent = await asyncio.to_thread(AgentOptions.of, body, chat,
                                            self.engine.engine.grammars)
            if agent.constraint is not None:
                sampling = replace(sampling, constraint=agent.constraint)
            if chat and (agent.tools or agent.template_kwargs):
                prompts = [ChatPrompt(p, agent.tools, agent.template_kwargs) for p in prompts]
            encoded = [await self.engine.encode(prompt) for prompt in prompts]  # off-thread
            params = [self._fit_context(len(tokens), sampling, max_tokens_given, chat)
                      for tokens in encoded]
            for tokens, param in zip(encoded, params):
                streams.append(await self.engine.add(tokens, param, namespace=namespace))
        except HttpError as error:
            self._abort(streams)
            return error.response()
        except QueueFull as error:
            self._abort(streams)
            return HttpError(429, str(error), "rate_limit_exceeded").response()
        except InvalidArgument as error:  # every typed check (WrongArgumentType included)
            self._abort(streams)
            return HttpError(400, str(error)).response()
        except RecursionError:  # a body nested deeper than any API field
            self._abort(streams)
            return HttpError(400, "the request body is nested too deeply").response()
        except Exception as error:  # noqa: BLE001 - a fault (the tokenizer): this request's
            self._abort(streams)
            if not isinstance(error, EngineStopped):
                logger.exception("blockmgr serve: a request failed before it was queued")
            return HttpError.of_fault(error).response()
        outputs = [agent.chat_output(self.tokenizer, tokens) for tokens in encoded] if chat \
            else None
        reply = _Reply(self, streams, params[0], options, chat, outputs)
        if options.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        return await self._whole(request, reply)

    def _fit_context(self, num_prompt: int, sampling: SamplingParams, max_tokens_given: bool,
                     chat: bool) -> SamplingParams:
        """Check a prompt and its max_tokens against `max_model_len` (400 in
        vLLM's words); a default max_tokens is lowered to what is left."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise HttpError(400, f"This model's maximum context length is {limit} tokens. "
                            f"However, your request has {num_prompt} input tokens. Please "
                            f"reduce the length of the input messages.",
                            param="messages" if chat else "prompt")
        room = limit - num_prompt
        if sampling.max_tokens <= room:
            return sampling
        if not max_tokens_given:
            return replace(sampling, max_tokens=room)
        raise HttpError(400, f"'max_tokens' or 'max_completion_tokens' is too large: "
                        f"{sampling.max_tokens}. This model's maximum context length is {limit} "
                        f"tokens and your request has {num_prompt} input tokens "
                        f"({sampling.max_tokens} > {limit} - {num_prompt}).",
                        param="max_tokens")

    async def _whole(self, request: HttpRequest, reply: _Reply) -> Response:
        """Wait for the whole answer, aborting the request if the client
        leaves; a request that failed answers its error object."""
        answer = asyncio.ensure_future(reply.collect())
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if answer not in done:
            answer.cancel()  # closes the output iteration: the request is aborted
            try:
                await answer
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody to tell
                pass
            return Response(status_code=499)
        gone.cancel()
        try:
            return JSONResponse(answer.result())
        except Exception as error:  # noqa: BLE001 - its own fault: answered, logged
            return _failed(error).response()

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
    stream: bool
    include_usage: bool

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

    def __init__(self, server: OpenAIServer, streams, sampling: SamplingParams, options, chat,
                 outputs: list[ChatOutput] | None = None):
        self.server, self.streams, self.sampling, self.options, self.chat = (
            server, streams, sampling, options, chat)
        # chat: each choice's parser (reasoning, content, tool calls), one per prompt given
        self.parsers = [copy.deepcopy(o) for o in outputs for _ in range(sampling.n)] \
            if outputs else None
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
        details: dict[str, Any] = {
            "cached_tokens": sum(m.num_cached_tokens or 0 for m in metrics)}
        by_tier = cached_tokens_by_tier(metrics)
        if by_tier is not None:
            details["cached_tokens_by_tier"] = by_tier
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": details}

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
            body: dict[str, Any] = {"message": self._message(i)} if self.chat \
                else {"text": self.texts[i]}  # (the message may make the reason "tool_calls")
            logprobs = self._logprobs(i, self.logprobs[i]) if self.sampling.logprobs is not None \
                else None
            choice: dict[str, Any] = {"index": i, "finish_reason": self.reasons[i], **body,
                                      "logprobs": logprobs}
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices,
                "usage": self.usage()}

    def _message(self, i: int) -> dict:
        """Choice i's whole message (its parser splits reasoning and calls)."""
        if self.parsers is None:
            return {"role": "assistant", "content": self.texts[i]}
        parser = self.parsers[i]
        delta = parser.feed(self.texts[i])
        end = parser.finish()
        self._tool_reason(i)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": (delta.content + end.content) or None}
        calls = _merge_calls(delta.tool_calls + end.tool_calls)
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                                     for c in calls]
        elif message["content"] is None:
            message["content"] = ""
        reasoning = delta.reasoning + end.reasoning
        if reasoning:
            message["reasoning_content"] = reasoning
        return message

    def _tool_reason(self, i: int) -> None:
        """A sample that stopped after calling tools finishes with "tool_calls"."""
        if self.parsers and self.parsers[i].num_tool_calls and self.reasons[i] == "stop":
            self.reasons[i] = "tool_calls"

    def _chat_delta(self, i: int, text: str, finished: bool) -> dict:
        """Choice i's streamed delta for `text`."""
        if self.parsers is None:
            return {"content": text}
        parser = self.parsers[i]
        delta = parser.feed(text)
        if finished:
            end = parser.finish()
            delta.reasoning += end.reasoning
            delta.content += end.content
            delta.tool_calls += end.tool_calls
            self._tool_reason(i)
        out: dict[str, Any] = {}
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.content or not (delta.reasoning or delta.tool_calls):
            out["content"] = delta.content
        if delta.tool_calls:
            out["tool_calls"] = delta.tool_calls
        return out

    async def events(self) -> AsyncIterator[str]:
        """SSE: a chunk per output and sample, the usage chunk if asked,
        [DONE]; a request that fails ends with an error event, then [DONE]."""
        try:
            async for event in self._events():
                yield event
        except Exception as error:  # noqa: BLE001 - its own fault: told, logged
            yield _sse(_failed(error).body())
        yield "data: [DONE]\n\n"

    async def _events(self) -> AsyncIterator[str]:
        if self.chat:
            for i in range(self.sampling.n):
                yield _sse(self._chunk(i, {"role": "assistant", "content": ""}, None, None))
        async for first, out in self.outputs():
            before = [len(self.logprobs[first + i]) for i in range(self.sampling.n)]
            self._absorb(first, out)
            for i in sorted(set(out.new_tokens) | set(out.new_text or {})):
                text = (out.new_text or {}).get(i, "")
                finished = out.finish_reasons[i] is not None
                delta = self._chat_delta(first + i, text, finished) if self.chat else text
                reason = self.reasons[first + i] if finished else None
                logprobs = None
                if self.sampling.logprobs is not None:
                    logprobs = self._logprobs(first + i, self.logprobs[first + i][before[i]:])
                yield _sse(self._chunk(first + i, delta, reason, logprobs))
        if self.options.include_usage:
            yield _sse({"id": self.id, "object": self._chunk_object(), "created": self.created,
                        "model": self.server.model_name, "choices": [], "usage": self.usage()})

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


def _merge_calls(pieces: list[dict]) -> list[dict]:
    """Whole tool calls from streamed pieces (a NAMED call comes in
    argument pieces of one index)."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.get(piece["index"])
        if call is None:
            calls[piece["index"]] = {**piece, "function": dict(piece["function"])}
        else:
            call["function"]["arguments"] += piece["function"]["arguments"]
    return [calls[k] for k in sorted(calls)]


def _failed(error: BaseException) -> HttpError:
    """The error object of a request that failed after it was queued (logged
    unless the server is stopping)."""
    if not isinstance(error, EngineStopped):
        logger.error("blockmgr serve: a request failed: %s: %s", type(error).__name__, error,
                     exc_info=error)
    return HttpError.of_fault(error)


async def _json_body(request: HttpRequest, limit: int) -> Mapping:
    """The body as a JSON object. Past `limit` bytes it is refused (413):
    at once from its Content-Length, unread; while reading when it has none."""
    length = request.headers.get("content-length")
    if length is not None and length.isdecimal() and int(length) > limit:
        raise HttpError(413, f"the request body has {int(length)} bytes; this server takes at "
                        f"most {limit} bytes (blockmgr serve --max-body-size)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"the request body has more than {limit} bytes; this server "
                            f"takes at most {limit} (blockmgr serve --max-body-size)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HttpError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise HttpError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


#: The body reader, for the routes of other modules (`operator_api`).
json_body = _json_body


def _check_supported(body: Mapping, unsupported: Mapping[str, Callable[[object], bool]]) -> None:
    """Refuse (400, naming them) the fields that would change the answer
    and are not implemented here."""
    names = [name for name, off in unsupported.items() if name in body and not off(body[name])]
    if names:
        raise HttpError(400, f"not supported by this server: {', '.join(names)} (the answer "
                        f"would not be what they ask for)", param=names[0])


def _cache_salt(body: Mapping) -> str | None:
    """`cache_salt`: the request's prefix-cache namespace (vLLM's meaning:
    a prompt hits only prefixes cached with the same salt)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise HttpError(400, "cache_salt must be a non-empty string if provided",
                        param="cache_salt")
    return salt


def _sampling(body: Mapping, extra: dict) -> SamplingParams:
    """`SamplingParams` from the body's fields; its checks name the field."""
    kwargs = {name: body[name] for name in _PASSTHROUGH if body.get(name) is not None}
    kwargs.setdefault("temperature", 1.0)  # OpenAI's default
    if kwargs.get("top_k") in (0, -1):
        del kwargs["top_k"]  # vLLM's spelling of "off"
    stop = body.get("stop")
    if stop is not None:
        _check_stop_bounds(stop)
        kwargs["stop"] = stop
    bias = body.get("logit_bias")
    if bias is not None:
        kwargs["logit_bias"] = bias
    kwargs.update(extra)
    try:
        return SamplingParams(**kwargs)
    except InvalidArgument as error:
        raise HttpError(400, str(error)) from None


def _check_stop_bounds(stop: object) -> None:
    """At most `MAX_STOP_STRINGS` stop strings of `MAX_STOP_LENGTH`
    characters (their types are `SamplingParams`' to check)."""
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list):
        return
    if len(strings) > MAX_STOP_STRINGS:
        raise HttpError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got "
                        f"{len(strings)}", param="stop")
    for index, text in enumerate(strings):
        if isinstance(text, str) and len(text) > MAX_STOP_LENGTH:
            raise HttpError(400, f"stop[{index}]: at most {MAX_STOP_LENGTH} characters, got "
                            f"{len(text)}", param="stop")


def _max_tokens(body: Mapping, names: tuple[str, ...], default: int) -> tuple[dict, bool]:
    """{"max_tokens": ...} from the first field given, else the default;
    and whether the client gave it."""
    for name in names:
        if body.get(name) is not None:
            return {"max_tokens": body[name]}, True
    return {"max_tokens": default}, False


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


def _completion_request(body: Mapping) -> tuple[list, SamplingParams, bool]:
    prompts = _prompts(body)
    extra, given = _max_tokens(body, ("max_tokens",), DEFAULT_MAX_TOKENS)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) \
                or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise HttpError(400, f"logprobs must be an int in [0, {MAX_COMPLETION_LOGPROBS}], "
                            f"got {logprobs!r:.40}", param="logprobs")
        extra["logprobs"] = logprobs
    return prompts, _sampling(body, extra), given


def _chat_request(body: Mapping) -> tuple[list, SamplingParams, bool]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, f"messages must be a non-empty list, got {messages!r:.80}",
                        param="messages")
    extra, given = _max_tokens(body, ("max_completion_tokens", "max_tokens"),
                               DEFAULT_CHAT_MAX_TOKENS)
    if _bool(body, "logprobs", False):
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) \
                or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise HttpError(400, f"top_logprobs must be an int in [0, {MAX_CHAT_TOP_LOGPROBS}], "
                            f"got {top!r:.40}", param="top_logprobs")
        extra["logprobs"] = top
    return [[_plain_message(m, i) for i, m in enumerate(messages)]], _sampling(body, extra), \
        given


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
    out = {**message, "content": content}
    if isinstance(message.get("tool_calls"), list):  # templates read arguments as objects
        out["tool_calls"] = [_call_for_template(c) for c in message["tool_calls"]]
    return out


def _call_for_template(call: Any) -> Any:
    """An assistant message's tool call with its JSON `arguments` string as
    an object, as chat templates (and mlx-lm's server) expect."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


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


TIER_NAMES = ("device", "host", "disk")


def cached_tokens_by_tier(metrics: list[RequestMetrics]) -> dict[str, int] | None:
    """The requests' prefix-cache hits by tier (None: no request's cache has
    colder tiers, so the breakdown is left out of `usage`)."""
    known = [m.cached_tokens_by_tier for m in metrics if m.cached_tokens_by_tier is not None]
    if not known:
        return None
    return {name: sum(t[i] for t in known) for i, name in enumerate(TIER_NAMES)}


def pin_routes(api: OpenAIServer) -> list[Route]:
    """The prefix-cache pin endpoints (design/tiers.md, "Pins")."""
    return [Route("/v1/cache/pins", api.pin, methods=["POST"]),
            Route("/v1/cache/pins", api.pins, methods=["GET"]),
            Route("/v1/cache/pins/{pin_id}", api.unpin, methods=["DELETE"])]
