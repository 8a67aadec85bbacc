"""`blockmgr serve --grpc-port N`: a gRPC worker for the Shepherd Model Gateway.

SMG routes a gRPC worker on token ids it tokenized itself, and reads its
KV events from the same connection: event-driven (precise) `cache_aware`
routing needs such a worker (design/fleet.md). This module serves SMG's
`vllm.grpc.engine.VllmEngine` service (the `smg-grpc-proto` stubs; SMG
finds it by calling each engine's `HealthCheck`, and this one answers
only vLLM's) over the same `AsyncEngine` as the HTTP server:

* `Generate`: token ids (or text) in; with `stream` one chunk of new token
  ids per engine output and sample, then a `GenerateComplete` per sample
  (vLLM's servicer's shape: its last delta, finish reason, prompt and
  cached tokens); without, one `GenerateComplete` per sample with all its
  tokens. The gateway detokenizes. The `GenerateComplete` of a request is
  sent after the engine published the KV events of the step that finished
  it, so the next turn of a conversation is routed on them. Media,
  constrained decoding and prompt logprobs are refused (INVALID_ARGUMENT).
* `Abort`, `HealthCheck` (the engine's thread runs), `GetModelInfo`
  (config.json, context, vocabulary, end-of-sequence ids),
  `GetServerInfo` (requests, uptime, page size, running window),
  `GetLoads` (the HTTP server's `/v1/loads` report, `worker_info`),
  `GetTokenizer` (the model directory's tokenizer files as they were at
  start, zipped, in 64 KiB chunks, the last carrying the archive's
  SHA-256: what SMG loads when the directory `GetModelInfo` names is not
  on its machine).
* `SubscribeKvEvents`: the engine's KV events (`grpc_events.KvEventRelay`).

`Embed`, `FlushCache` and the profiler answer UNIMPLEMENTED (the base
servicer's). The server runs on its own thread and event loop beside
uvicorn's; `GrpcWorker.stop` ends the event streams and gives calls in
flight `grace` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import threading
import time
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from blockmgr.errors import BlockManagerError, InvalidArgument
from scheduler.core.request import RequestStatus, SamplingParams
from scheduler.serving.async_engine import AsyncEngine, EngineStopped, QueueFull
from scheduler.serving.grpc_events import KvEventRelay, attach
from scheduler.serving.operator_api import package_version
from scheduler.serving.worker_info import live_pages, load_report

#: Bytes per `GetTokenizerChunk` (SMG's servicers send 64 KiB).
CHUNK_BYTES = 64 * 1024
#: The tokenizer files SMG's own servicers bundle (its tokenizer loader reads these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "generation_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json")
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja", "*.model")
_FINISH = {RequestStatus.FINISHED_LENGTH: "length", RequestStatus.FINISHED_STOPPED: "stop",
           RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """What the worker tells of its model: the directory, the served name,
    its config.json and its tokenizer bundle (None: no tokenizer files),
    read once at start, as the engine loaded them."""

    path: Path
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer: bytes | None = None

    @classmethod
    def of(cls, path: str | Path, name: str) -> WorkerModel:
        path = Path(path)
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        try:
            bundle: bytes | None = tokenizer_bundle(path)
        except InvalidArgument:
            bundle = None
        return cls(path, name, config, bundle)


def tokenizer_bundle(path: Path) -> bytes:
    """A zip of the tokenizer files in `path` (`InvalidArgument` if none)."""
    names = [n for n in TOKENIZER_FILES if (path / n).is_file()]
    names += sorted({p.name for g in TOKENIZER_GLOBS for p in path.glob(g) if p.is_file()}
                    - set(names))
    if not names:
        raise InvalidArgument(f"no tokenizer files in {str(path)!r}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(path / name, name)
    return buffer.getvalue()


def sampling_of(params: Any, num_prompt: int, max_model_len: int) -> SamplingParams:
    """The engine's `SamplingParams` of vLLM's proto ones, with vLLM's
    defaults for unset fields (temperature 1, no top-k, max_tokens: what
    the context leaves). `InvalidArgument` for what this worker does not
    do or a prompt that leaves no room."""
    if params.WhichOneof("constraint") is not None:
        raise InvalidArgument("constrained decoding is not served over gRPC by this worker")
    if params.HasField("prompt_logprobs"):
        raise InvalidArgument("prompt logprobs are not served by this worker")
    room = max_model_len - num_prompt
    if room < 1:
        raise InvalidArgument(f"the prompt has {num_prompt} tokens; this model's maximum "
                              f"context length is {max_model_len} tokens")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else room
    if max_tokens > room:
        raise InvalidArgument(f"max_tokens {max_tokens} is too large: the context holds "
                              f"{max_model_len} tokens and the prompt has {num_prompt}")
    return SamplingParams(
        max_tokens=max_tokens, n=params.n or 1,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0, top_k=params.top_k or None, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty or 1.0,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias), stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids), ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        seed=params.seed if params.HasField("seed") else None)


def _output_logprobs(entries: list | None) -> Any:
    if not entries:
        return None
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries], token_ids=[e.token for e in entries],
        top_logprobs=[vllm_engine_pb2.TopLogProbs(values=[p for _, p in e.top],
                                                  token_ids=[t for t, _ in e.top])
                      for e in entries])


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """SMG's vLLM service over one `AsyncEngine` (see the module doc)."""

    def __init__(self, engine: AsyncEngine, model: WorkerModel, relay: KvEventRelay) -> None:
        self.engine = engine
        self.model = model
        self.relay = relay
        self.start_time = time.time()

    # ---------------------------------------------------------- generation

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            stream, prompt = await self._add(request)
        except (ValueError, TypeError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except QueueFull as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except EngineStopped as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        reply = _Reply(stream.request, len(prompt), request.stream)
        try:
            async for out in self.engine.outputs(stream):
                messages = reply.absorb(out)
                if out.finished:
                    # the events of the step that finished it go out first
                    await self.engine.call(lambda engine: None)
                for message in messages:
                    yield message
        except EngineStopped as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except BlockManagerError as error:
            await context.abort(grpc.StatusCode.INTERNAL, str(error))

    async def _add(self, request: Any) -> tuple[Any, list[int]]:
        if (request.HasField("mm_inputs") or request.extra_mm_inputs
                or request.media_refs.items):
            raise InvalidArgument("this worker serves text models: no media input")
        if request.WhichOneof("input") == "tokenized":
            prompt = list(request.tokenized.input_ids)
        else:
            prompt = await self.engine.encode(request.text)
        max_model_len = self.engine.engine.scheduler.config.max_model_len or 0
        sampling = sampling_of(request.sampling_params, len(prompt), max_model_len)
        stream = await self.engine.add(prompt, sampling, request_id=request.request_id or None)
        return stream, prompt

    async def Abort(self, request: Any, context: Any) -> Any:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return vllm_engine_pb2.AbortResponse()

    # --------------------------------------------------------- information

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        healthy = self.engine.is_running
        return vllm_engine_pb2.HealthCheckResponse(
            healthy=healthy, message="healthy" if healthy else "the engine is not running")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        engine, config = self.engine.engine, self.model.config
        context_len = engine.scheduler.config.max_model_len or 0
        eos = [] if engine.text is None else list(engine.text.eos_token_ids)
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(self.model.path), is_generation=True,
            max_context_length=context_len, vocab_size=engine.vocab_size,
            served_model_name=self.model.name, tokenizer_path=str(self.model.path),
            model_type=str(config.get("model_type", "")),
            architectures=[str(a) for a in config.get("architectures") or []],
            eos_token_ids=eos, pad_token_id=_int(config.get("pad_token_id")),
            bos_token_id=_int(config.get("bos_token_id")), max_req_input_len=context_len)

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        engine = self.engine.engine
        sched = engine.scheduler
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=sched.num_running + sched.num_waiting,
            uptime_seconds=time.time() - self.start_time, server_type="mlx-blockmgr-grpc",
            data_parallel_size=1, block_size=engine.cache.block_size,
            kv_cache_dtype=engine.cache.kv_format.name, max_num_seqs=sched.config.max_num_seqs)

    async def GetLoads(self, request: Any, context: Any) -> Any:
        try:
            live = await self.engine.call(live_pages)
        except EngineStopped as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        report = load_report(self.engine, live)
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=report["timestamp"], version=package_version(),
            dp_rank_count=report["dp_rank_count"],
            loads=[vllm_engine_pb2.SchedulerLoad(**load) for load in report["loads"]])

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        data = self.model.tokenizer
        if data is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no tokenizer files in {str(self.model.path)!r}")
            return
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(data=data[start:end],
                                               sha256=digest if end == len(data) else "")

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for batch in self.relay.subscribe(request.start_sequence_number):
            yield batch


def _int(value: Any) -> int:
    """A config's token id (a list gives its first; absent: 0, as vLLM's)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _Reply:
    """Turns one request's engine outputs into `GenerateResponse`s."""

    def __init__(self, request: Any, num_prompt: int, stream: bool) -> None:
        self.request, self.num_prompt, self.stream = request, num_prompt, stream
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.done: set[int] = set()

    @property
    def cached(self) -> int:
        return self.request.metrics.num_cached_tokens or 0

    def absorb(self, out: Any) -> list[Any]:
        messages = []
        for i, new in out.new_tokens.items():
            self.tokens.setdefault(i, []).extend(new)
            entries = (out.logprobs or {}).get(i)
            self.logprobs.setdefault(i, []).extend(entries or [])
            if self.stream and new:
                messages.append(vllm_engine_pb2.GenerateResponse(
                    chunk=vllm_engine_pb2.GenerateStreamChunk(
                        token_ids=new, prompt_tokens=self.num_prompt,
                        completion_tokens=len(new), cached_tokens=self.cached,
                        output_logprobs=_output_logprobs(entries), index=i)))
        for i, reason in enumerate(out.finish_reasons):
            if reason is not None and i not in self.done:
                self.done.add(i)
                messages.append(self._complete(i, reason, out.new_tokens.get(i, [])))
        return messages

    def _complete(self, i: int, reason: RequestStatus, last: list[int]) -> Any:
        # streamed: vLLM's servicer repeats the last delta (the gateway counts the chunks)
        ids = last if self.stream else self.tokens.get(i, [])
        entries = self.logprobs.get(i, [])
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=ids, finish_reason=_FINISH.get(reason, "stop"),
            prompt_tokens=self.num_prompt, completion_tokens=len(ids), cached_tokens=self.cached,
            output_logprobs=_output_logprobs(entries[-len(ids):] if ids else []), index=i)
        tokens = self.tokens.get(i, [])
        stops = self.request.sampling.stop_token_ids
        if reason is RequestStatus.FINISHED_STOPPED and tokens and tokens[-1] in stops:
            complete.matched_token_id = tokens[-1]
        return vllm_engine_pb2.GenerateResponse(complete=complete)


class GrpcWorker:
    """The gRPC server of the module doc on its own thread and event loop.

    `start()` binds `host:port` (0: a free port) and returns the port;
    `stop(grace)` ends the event streams, lets calls in flight finish for
    `grace` seconds and joins the thread."""

    def __init__(self, engine: AsyncEngine, model: WorkerModel, *, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.engine, self.model = engine, model
        self.host, self.port = host, port
        self.relay = KvEventRelay()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._grace = 5.0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        """Publish the engine's KV events to the relay, start the engine's
        thread and the server; the bound port. Call it before the engine's
        thread runs (`attach`)."""
        attach(self.engine.engine, self.relay)
        self.engine.start()
        self._thread = threading.Thread(target=self._run, name="blockmgr-grpc", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise InvalidArgument(f"cannot serve gRPC on {self.host}:{self.port}: "
                                  f"{self._error}") from self._error
        return self.port

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            server = grpc.aio.server()
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
                VllmEngineServicer(self.engine, self.model, self.relay), server)
            host = f"[{self.host}]" if ":" in self.host else self.host
            self.port = server.add_insecure_port(f"{host}:{self.port}")
            await server.start()
        except Exception as error:  # noqa: BLE001 - raised by start() on the caller's thread
            self._error = error
            self._ready.set()
            return
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stopping.wait()
        await server.stop(self._grace)

    def stop(self, grace: float = 5.0) -> None:
        """End the event streams, give the calls in flight `grace` seconds,
        join the thread. Idempotent."""
        self.relay.close()
        loop, stopping = self._loop, self._stopping
        self._grace = grace
        if loop is not None and stopping is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(grace + 5)
