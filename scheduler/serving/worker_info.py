"""What a gateway asks of a worker, in the shapes SGLang and vLLM answer.

The Shepherd Model Gateway (SMG, `pip install smg`) registers an HTTP worker
by probing it: `GET /v1/models` (`owned_by`), `/version` (vLLM), then the
metadata `/server_info` and `/model_info` (SGLang; on a 404 it retries the
older `/get_server_info`, `/get_model_info`), and polls its load every
`--load-monitor-interval` seconds: `/v1/loads` (SGLang's, and the
gateway's own format), `/loads`, or `/metrics`' vLLM gauges. This module
answers each of them (`WorkerInfo.routes`), so a `blockmgr serve` replica
is not a 404 to any of them:

* `/server_info`, `/get_server_info`: SGLang's server description, the
  fields SMG keeps as the worker's labels (`served_model_name`, `version`,
  `tp_size`/`dp_size`/`pp_size` 1, `context_length`, `max_total_tokens` =
  pages x tokens per page, `max_running_requests`, `page_size`).
* `/model_info`, `/get_model_info`: SGLang's model description
  (`is_generation`, no image or audio input).
* `/v1/loads`, `/loads`: SGLang's load report (SMG's `WorkerLoadResponse`):
  one data-parallel rank with running and waiting requests, the KV tokens
  of the pool (`max_total_num_tokens`), those live sequences hold
  (`num_used_tokens`) and their share (`token_usage`, the fullest page
  group's), and the prefix hit rate of finished requests. Fields the
  engine does not measure (generation throughput, the waiting requests'
  uncached tokens) are left out, which the gateway reads as unknown (0).

`token_usage` is vLLM's and SGLang's meaning: pages a live sequence holds,
not the prefix cache's evictable pages (`/metrics`' `vllm:kv_cache_usage_perc`
counts those as used, design/serving.md). SMG 1.13 polls `/loads` and by
default leaves a worker at 0.8 usage or more out of routing while another
is under it; with the cache counted a warm replica would read near 1
and lose the sessions whose prefix it holds. It is counted on the engine
thread between two steps (`AsyncEngine.call`): O(pages the live sequences
hold), once per poll (every 10 s by default). The other answers read
counters at request time, as `/metrics` does: O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from scheduler.engine.engine import Engine
from scheduler.serving.async_engine import AsyncEngine
from scheduler.serving.server import HttpError


class WorkerInfo:
    """Handlers of the routes in the module doc, for one served model."""

    def __init__(self, engine: AsyncEngine, model_name: str, version: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.version = version

    def routes(self) -> list[Route]:
        return [Route(path, handler, methods=["GET"]) for path, handler in (
            ("/server_info", self.server_info), ("/get_server_info", self.server_info),
            ("/model_info", self.model_info), ("/get_model_info", self.model_info),
            ("/v1/loads", self.loads), ("/loads", self.loads))]

    async def server_info(self, request: HttpRequest) -> Response:
        return JSONResponse(server_info(self.engine, self.model_name, self.version))

    async def model_info(self, request: HttpRequest) -> Response:
        return JSONResponse(model_info(self.model_name))

    async def loads(self, request: HttpRequest) -> Response:
        try:
            live = await self.engine.call(live_pages)
        except Exception as error:  # noqa: BLE001 - a stopped engine (503) or a fault (500)
            return HttpError.of_fault(error).response()
        return JSONResponse(load_report(self.engine, live))


def server_info(engine: AsyncEngine, model_name: str, version: str) -> dict[str, Any]:
    """SGLang's `/server_info` fields that describe this server."""
    cache = engine.engine.cache
    sched = engine.engine.scheduler.config
    return {"served_model_name": model_name, "model_path": model_name, "version": version,
            "engine": "mlx-blockmgr", "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "is_embedding": False, "disaggregation_mode": "null",
            "context_length": sched.max_model_len,
            "max_total_tokens": cache.num_blocks * cache.block_size,
            "max_running_requests": sched.max_num_seqs, "page_size": cache.block_size}


def model_info(model_name: str) -> dict[str, Any]:
    """SGLang's `/model_info`: a text generation model, no media input."""
    return {"model_path": model_name, "tokenizer_path": None, "is_generation": True,
            "has_image_understanding": False, "has_audio_understanding": False}


@dataclass(frozen=True, slots=True)
class LivePages:
    """Pages live sequences hold in the fullest page group (shared pages
    once), and that group's pool."""

    num_pages: int
    num_held: int


def live_pages(engine: Engine) -> LivePages:
    """The fullest page group's pages held by live sequences: what no
    eviction can free. Run it on the engine thread. O(their pages)."""
    cache = engine.cache
    ids = cache.sequence_ids()
    fullest = LivePages(cache.num_blocks, 0)
    for group in cache.group_usage():
        held = {page for seq_id in ids for page in cache.block_table(seq_id, group.group)
                if page is not None}
        if len(held) * fullest.num_pages > fullest.num_held * group.num_pages:
            fullest = LivePages(group.num_pages, len(held))
    return fullest


def load_report(engine: AsyncEngine, live: LivePages) -> dict[str, Any]:
    """SGLang's `/v1/loads` answer (SMG's `WorkerLoadResponse`), one rank."""
    sched, config = engine.engine.scheduler, engine.engine.cache
    metrics = engine.metrics
    hit = (metrics.num_cached_tokens / metrics.num_prompt_tokens
           if metrics.num_prompt_tokens else 0.0)
    running, waiting = sched.num_running, sched.num_waiting
    snapshot = {
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": live.num_held * config.block_size,
        "max_total_num_tokens": live.num_pages * config.block_size,
        "token_usage": live.num_held / live.num_pages if live.num_pages else 0.0,
        "cache_hit_rate": hit, "max_running_requests": sched.config.max_num_seqs,
    }
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1,
            "loads": [snapshot]}
