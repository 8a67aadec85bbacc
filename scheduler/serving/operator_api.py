"""The operator's routes beside the OpenAI API (vLLM's spellings).

`POST /tokenize` ({"prompt": text} or {"messages": [...]}, the chat rendered
by the model's template with the generation prompt) answers {"count",
"max_model_len", "tokens", "token_strs": null}; `POST /detokenize`
({"tokens": [...]}) answers {"prompt": text}; `GET /version` the package's
version; `GET /v1/models/{id}` the served model (404 for another id);
`POST /reset_prefix_cache` (only with `allow_cache_reset`, as vLLM keeps it
to its development mode) drops the device's cached prefixes that no live
request uses, between two steps, and answers the pages freed.

`count_refusals` wraps the app so that every completion answered with an
error status before its first byte (400, 404, 413, 429, 500, 503) is
counted by status in the engine's `ServingMetrics`.

Every error is OpenAI's error object (`server.HttpError`); a body is read
under the server's size limit. Tokenizing runs off the engine thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_token_range, prompt_list
from scheduler.serving.async_engine import AsyncEngine
from scheduler.serving.metrics import ServingMetrics
from scheduler.serving.server import HttpError, build_app, default_max_body_bytes, json_body
from scheduler.serving.worker_info import WorkerInfo

#: The routes whose refusals `count_refusals` counts.
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")


def package_version() -> str:
    """The installed mlx-blockmgr's version ("unknown" from a bare checkout)."""
    try:
        return version("mlx-blockmgr")
    except PackageNotFoundError:
        return "unknown"


class OperatorApi:
    """Handlers of the routes in the module doc."""

    def __init__(self, engine: AsyncEngine, model_name: str, created: int, *,
                 max_body_bytes: int | None = None, allow_cache_reset: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.created = created
        self.max_model_len = engine.engine.scheduler.config.max_model_len
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(self.max_model_len or 0)
        self.allow_cache_reset = allow_cache_reset

    def routes(self) -> list[Route]:
        routes = [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
        ]
        if self.allow_cache_reset:
            routes.append(Route("/reset_prefix_cache", self.reset_prefix_cache,
                                methods=["POST"]))
        return routes

    async def version(self, request: HttpRequest) -> Response:
        return JSONResponse({"version": package_version()})

    async def model(self, request: HttpRequest) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            return HttpError(404, f"The model `{model_id:.200}` does not exist.",
                             "not_found_error", "model").response()
        return JSONResponse({"id": self.model_name, "object": "model", "created": self.created,
                             "owned_by": "blockmgr", "max_model_len": self.max_model_len})

    async def tokenize(self, request: HttpRequest) -> Response:
        try:
            body = await json_body(request, self.max_body_bytes)
            self._check_model(body)
            prompt = _tokenize_prompt(body)
            tokens = await self.engine.encode(prompt)
        except HttpError as error:
            return error.response()
        except InvalidArgument as error:  # the engine's checks (WrongArgumentType included)
            return HttpError(400, str(error)).response()
        return JSONResponse({"count": len(tokens), "max_model_len": self.max_model_len,
                             "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: HttpRequest) -> Response:
        try:
            body = await json_body(request, self.max_body_bytes)
            self._check_model(body)
            tokens = _token_ids(body.get("tokens"), self.engine.engine.vocab_size)
            text = self.engine.engine.text
            if text is None:
                raise HttpError(400, "this server has no tokenizer")
        except HttpError as error:
            return error.response()
        return JSONResponse({"prompt": text.decode(tokens)})

    async def reset_prefix_cache(self, request: HttpRequest) -> Response:
        try:
            freed = await self.engine.reset_prefix_cache()
        except Exception as error:  # noqa: BLE001 - a stopped engine (503) or a fault (500)
            return HttpError.of_fault(error).response()
        return JSONResponse({"num_pages_freed": freed})

    def _check_model(self, body: Any) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise HttpError(404, f"model {model!r:.80} is not served here (this server serves "
                            f"{self.model_name!r})", "not_found_error", "model")


def _tokenize_prompt(body: Any) -> Any:
    """The body's `prompt` (text or token ids) or `messages` (exactly one)."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise HttpError(400, "give either prompt or messages", param="prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", param="messages")
        return messages
    if not isinstance(prompt, (str, list)) or not prompt:
        raise HttpError(400, "prompt must be a non-empty string or token ids", param="prompt")
    return prompt


def _token_ids(tokens: object, vocab_size: int) -> list[int]:
    """Checked token ids in [0, vocab_size) (400 naming the field)."""
    if not isinstance(tokens, list):
        raise HttpError(400, f"tokens must be a list of token ids, got {tokens!r:.40}",
                        param="tokens")
    try:
        checked = prompt_list(tokens, "tokens", exact=True)
        check_token_range(checked, vocab_size, "tokens")
    except InvalidArgument as error:
        raise HttpError(400, str(error), param="tokens") from None
    return checked


def count_refusals(app: Any, metrics: ServingMetrics, paths: Sequence[str] = COMPLETION_PATHS):
    """`app` (ASGI) with every error status answered on `paths` counted in
    `metrics.refused` by status code. Cost: one comparison per message."""

    async def counted(scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in paths:
            return await app(scope, receive, send)

        async def watch(message):
            status = message.get("status", 0)
            if message["type"] == "http.response.start" and status >= 400 and status != 499:
                metrics.count_refused(status)  # 499: the client left, nothing refused
            await send(message)

        return await app(scope, receive, watch)

    return counted


def build_serving_app(engine: AsyncEngine, model_name: str, *, max_body_bytes: int | None = None,
                      allow_cache_reset: bool = False):
    """The served ASGI app: `server.build_app`'s OpenAI routes and this
    module's, refusals counted (`count_refusals`), every metric labelled
    with `model_name`."""
    api = OperatorApi(engine, model_name, int(time.time()), max_body_bytes=max_body_bytes,
                      allow_cache_reset=allow_cache_reset)
    engine.metrics.model_name = model_name
    gateway = WorkerInfo(engine, model_name, package_version())  # what SMG probes
    app = build_app(engine, model_name, max_body_bytes=max_body_bytes,
                    routes=[*api.routes(), *gateway.routes()])
    return count_refusals(app, engine.metrics)
