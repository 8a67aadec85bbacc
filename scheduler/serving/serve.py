"""`blockmgr serve`: load a model directory, size the pool, run the server.

`load_engine(path, config, budget=...)` loads an mlx-lm model directory
(`mlx_lm.load`) and builds an `Engine` of one `EngineConfig`
(`serve_config()`: the engine's defaults with serve's). Sizing the page
pool to a memory budget (`kv_budget`: `--kv-memory`, e.g. "4GiB", or a
share of the memory available) is a step that makes a complete config
before the engine is built (`fit_pool`: a hybrid model's recurrent slots
first, then pages of every layer group together; `size_pool`). The
engine's `max_model_len` is the model's context (`model_context`, read
from config.json as vLLM reads it) or a smaller one asked for, never more
than the pool holds. `run(...)` serves it with uvicorn until SIGINT or
SIGTERM (uvicorn stops accepting, lets in-flight responses finish for
`graceful_seconds`, then the engine ends what is left so that every
response still ends cleanly: `scheduler.serving.shutdown`).
`blas_hint()` is the one line printed on Linux when MLX's CPU backend runs
on the reference BLAS (the `mlx[cpu]` wheel bundles it: about 5.5 GFLOPS on
a 1024^3 float32 matmul, against about 230 with OpenBLAS preloaded).
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from blockmgr.errors import InvalidArgument
from blockmgr.kv_format import KVFormat, format_bytes, parse_bytes
from scheduler.engine.config import EngineConfig

if TYPE_CHECKING:
    from scheduler.engine.engine import Engine

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
#: Prefill chunks per forward in the server: a closed loop's clients arrive
#: in waves, and a wave of short chunks on a cached system prompt costs one
#: weight read per forward (BENCHMARKS.md, "serve"); `prefill_groups` keeps
#: the padding bounded whatever the lengths.
PREFILL_BATCH = 8
#: The engine settings (`scheduler.engine.config`) whose default `blockmgr
#: serve` changes: prefill batching (above), and 64 running sequences (a
#: hybrid model's pool sets recurrent slots aside per running sequence
#: before its pages: `size_pool`).
SERVE_DEFAULTS: dict[str, object] = {"max_num_seqs": 64, "prefill_batch": PREFILL_BATCH}


#: The share of the memory available at start that `blockmgr serve` gives
#: the KV pool without `--kv-memory` (vLLM's `--gpu-memory-utilization` is
#: 0.9 of a GPU's own memory; here the memory is shared with the system
#: and every other process, so half of what is free).
KV_MEMORY_FRACTION = 0.5


def cache_tier_options(disk_cache: str | None, disk_cache_size: str | None,
                       host_cache_size: str | None) -> dict[str, Any]:
    """`Engine` keywords of `--disk-cache`, `--disk-cache-size` and
    `--host-cache-size`, checked before the model loads (a bad size, a size
    without its directory, a directory that cannot be made)."""
    if disk_cache_size is not None and disk_cache is None:
        raise InvalidArgument("--disk-cache-size needs --disk-cache DIR")
    options: dict[str, Any] = {}
    if host_cache_size is not None:
        options["host_cache_size"] = parse_bytes(host_cache_size)
    if disk_cache is not None:
        Path(disk_cache).mkdir(parents=True, exist_ok=True)
        options["disk_cache"] = disk_cache
        if disk_cache_size is not None:
            options["disk_cache_size"] = parse_bytes(disk_cache_size)
    return options


def page_bytes(model: Any, block_size: int, kv_format: KVFormat | None = None) -> int:
    """Bytes one page of the model's KV takes, over every layer group, in
    `kv_format` (None: the model's dtype; a quantized one counts packed
    values, scales and biases): the pools of a one-page storage, sized by
    one forward of one token (pools take their head shapes from the first
    K/V written)."""
    import mlx.core as mx

    from cache import PagedCache

    storage = PagedCache.for_model(model, 1, block_size, num_slots=1, kv_format=kv_format)
    storage.allocate("probe", [0])
    with storage.step(["probe"], num_new=[1]) as views:
        mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=views))
    return storage.nbytes


def slot_bytes(model: Any) -> int:
    """Bytes of one recurrent slot over every recurrent layer (0 for a model
    without recurrent layers): the state of a one-token forward."""
    from cache.layers import LayerKind, layer_specs
    from recurrent.pools import probe_specs

    if not any(s.kind is LayerKind.RECURRENT for s in layer_specs(model)):
        return 0
    return sum(spec.nbytes for layer in probe_specs(model).values() for spec in layer
               if spec is not None)


def available_memory() -> int:
    """Bytes this process may still take: Linux's MemAvailable; on a Mac,
    Metal's recommended working set less what MLX holds; else the physical
    memory less what MLX holds. Cost: one file read or system call."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    import mlx.core as mx

    recommended = mx.device_info().get("max_recommended_working_set_size")
    total = recommended if isinstance(recommended, int) else \
        os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(0, total - mx.get_active_memory())


def weights_bytes(path: str | Path) -> int:
    """Bytes of a model directory's weight files (what loading it takes)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The KV memory budget and where it came from: `--kv-memory`, or
    `fraction` of the `available` bytes (after the weights)."""

    nbytes: int
    fraction: float | None = None
    available: int | None = None

    def describe(self) -> str:
        if self.fraction is None or self.available is None:
            return "--kv-memory"
        return (f"{self.fraction:g} of {self.available / 2**30:.2f} GiB available after the "
                f"weights")


def kv_budget(kv_memory: str | None, model_dirs: Sequence[str | Path],
              fraction: float = KV_MEMORY_FRACTION) -> KVBudget:
    """`kv_memory` parsed, or (None) `fraction` of the memory available now
    (`available_memory`) less the weights of `model_dirs` still to load.
    `InvalidArgument` for a fraction outside (0, 1] or nothing left."""
    if kv_memory is not None:
        return KVBudget(parse_bytes(kv_memory))
    if not 0 < fraction <= 1:
        raise InvalidArgument(f"--kv-memory-fraction must be in (0, 1], got {fraction}")
    available = available_memory() - sum(weights_bytes(d) for d in model_dirs)
    if available <= 0:
        raise InvalidArgument("no memory is left for the KV pool after the model's weights; "
                              "give --kv-memory")
    return KVBudget(int(available * fraction), fraction, available)


def touch_pool(engine: Any) -> None:
    """Allocate (and write) the engine's page pools and slots now, not at
    the first request: one two-token request of token 0, its cache then
    dropped. Cost: two one-token forwards and writing the whole pool."""
    from scheduler.core.request import SamplingParams

    engine.generate([[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.reset_prefix_cache()


def peak_rss() -> int:
    """This process's peak resident memory in bytes."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux gives KiB


@dataclass(frozen=True, slots=True)
class PoolSize:
    """How a KV memory budget is spent: `num_slots` recurrent slots first
    (the engine's slot count), pages of every layer group with the rest."""

    num_blocks: int
    num_slots: int
    page_bytes: int
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.page_bytes + self.num_slots * self.slot_bytes


def size_pool(model: Any, budget: int, block_size: int, max_num_seqs: int,
              kv_format: KVFormat | None = None) -> PoolSize:
    """Pages (in `kv_format`, None: the model's dtype) and slots that fit
    `budget` bytes. A hybrid model gets the engine's default slots
    (`default_num_slots`: each running sequence's state and a prefix
    snapshot), whose bytes come off the budget first; pages take the rest.
    Raises `InvalidArgument` when not even the slots and one page fit.
    Cost: two one-token forwards (three for a quantized format, whose head
    sizes are checked first)."""
    from scheduler.engine.engine import default_num_slots

    per_slot = slot_bytes(model)
    num_slots = default_num_slots(max_num_seqs) if per_slot else 0
    per_page = max(1, page_bytes(model, block_size, kv_format))
    left = budget - num_slots * per_slot
    if left < per_page:
        raise InvalidArgument(
            f"a KV memory budget of {budget} bytes does not hold {num_slots} recurrent slots of "
            f"{per_slot} bytes and one page of {per_page} bytes; give at least "
            f"{num_slots * per_slot + per_page} bytes (or fewer --max-num-seqs)")
    return PoolSize(left // per_page, num_slots, per_page, per_slot)


def engine_pool(engine: Any) -> PoolSize:
    """The pool `engine` holds, in bytes of its page format: its pages and
    recurrent slots at `page_bytes` and `slot_bytes` of its model (pools are
    allocated at their first write, so `engine.cache.nbytes` is 0 before the
    first request). Cost: two or three one-token forwards on one-page
    storage."""
    cache = engine.cache
    per_slot = slot_bytes(engine.model) if cache.num_slots else 0
    return PoolSize(cache.num_blocks, cache.num_slots,
                    page_bytes(engine.model, cache.block_size, cache.kv_format), per_slot)


def pool_line(size: PoolSize, kv_format: KVFormat, block_size: int) -> str:
    """The start-up line's account of the pool: "512 pages of 8 tokens,
    k8v8-g32 (2.50 KiB each), 10 recurrent slots (1.25 KiB each): 1.26 MiB
    of KV"."""
    name = kv_format.name if kv_format.quantized else "at the model's dtype"
    slots = (f", {size.num_slots} recurrent slots ({format_bytes(size.slot_bytes)} each)"
             if size.num_slots else "")
    return (f"{size.num_blocks} pages of {block_size} tokens, {name} "
            f"({format_bytes(size.page_bytes)} each){slots}: {format_bytes(size.nbytes)} of KV")


def simulate_options(model: Any, size: PoolSize, kv_format: KVFormat, block_size: int,
                     kv_memory: str) -> str | None:
    """The `blockmgr simulate` options of the pool `size_pool` gave `model`
    from `kv_memory`: --kv-memory, --kv-shape (read from the model's own
    caches), the format's options, --block-size and --hybrid for recurrent
    slots (with the engine's default count); the simulated pool then
    has the same pages (design/simulator.md, "KV memory"). None when the
    attention layers differ in kv heads, head sizes or dtype (one --kv-shape
    cannot state them). Cost: one one-token forward."""
    import mlx.core as mx

    from cache.page_format import model_kv_shapes

    layers = model_kv_shapes(model)
    dtypes = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
    kinds = {(heads, k_dim, v_dim, dtypes.get(dtype)) for _, heads, k_dim, v_dim, dtype in layers}
    if len(kinds) != 1:
        return None
    ((heads, k_dim, v_dim, dtype),) = kinds
    if dtype is None:
        return None
    shape = f"layers={len(layers)},kv_heads={heads},head_dim={k_dim}"
    shape += (f",v_head_dim={v_dim}" if v_dim != k_dim else "") + f",dtype={dtype}"
    shape += f",slot_bytes={size.slot_bytes}" if size.num_slots else ""
    options = f"--kv-memory {kv_memory} --kv-shape {shape} --block-size {block_size}"
    for flag, bits in (("--kv-key-bits", kv_format.key_bits),
                       ("--kv-value-bits", kv_format.value_bits)):
        options += f" {flag} {bits}" if bits is not None else ""
    if kv_format.quantized:
        options += f" --kv-group-size {kv_format.group_size}"
    return options + (" --hybrid" if size.num_slots else "")


#: config.json keys that bound a model's context, as vLLM reads them (the
#: smallest one given wins), looked for in the config and its text_config.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")
#: RoPE scalings whose factor does not stretch the context further (vLLM).
_UNSCALED_ROPE = ("su", "longrope", "llama3", "mrope", "default")


def model_context(config: dict) -> int | None:
    """The context a model's config.json gives (None: it gives none): the
    smallest of vLLM's keys, times the RoPE scaling factor where vLLM
    multiplies it (yarn from its `original_max_position_embeddings`)."""
    sections = [config] + [config[k] for k in ("text_config", "language_config")
                           if isinstance(config.get(k), dict)]
    for section in sections:
        lengths = [v for k in _CONTEXT_KEYS if isinstance(v := section.get(k), int)
                   and not isinstance(v, bool) and v > 0]
        if not lengths:
            continue
        length = min(lengths)
        rope = section.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if kind not in _UNSCALED_ROPE and kind is not None and isinstance(factor, (int, float)):
            if kind == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
                length = rope["original_max_position_embeddings"]
            length = int(length * factor)
        return length
    return None


def serve_config(**settings: Any) -> EngineConfig:
    """The `EngineConfig` of `blockmgr serve`: the engine's defaults with
    `SERVE_DEFAULTS` over them, `settings` (flat, as `EngineConfig.of`
    takes them) over both."""
    return EngineConfig.of(**{**SERVE_DEFAULTS, **settings})


def fit_pool(config: EngineConfig, model: Any, budget: int) -> tuple[EngineConfig, PoolSize]:
    """`config` with its pool sized to `budget` bytes (`size_pool`, at the
    config's page size, page format and running sequences): its page count,
    and its recurrent slots unless the config sets them. The config given
    is not changed. Cost: `size_pool`'s forwards."""
    cache = config.cache
    kv_format = KVFormat.of(cache.kv_format, cache.kv_bits, cache.kv_group_size)
    size = size_pool(model, budget, cache.block_size, config.scheduler.max_num_seqs,
                     kv_format if kv_format.quantized else None)
    num_slots = cache.num_slots if cache.num_slots is not None else size.num_slots or None
    return replace(config, cache=replace(cache, num_blocks=size.num_blocks,
                                         num_slots=num_slots)), size


def load_engine(path: str | Path, config: EngineConfig | None = None, *,
                budget: KVBudget | None = None, draft_model: str | Path | Any = None,
                kv_events: Any = None, **legacy: Any) -> tuple[Engine, str]:
    """(Engine, model name) for an mlx-lm model directory, with `config`'s
    settings (None: `serve_config()`, the pool sized to the default
    `kv_budget`: `KV_MEMORY_FRACTION` of the memory available before
    loading, after the weights). With a `budget` (`kv_budget`) the pool is
    sized to it (`fit_pool`: a complete config, made before the engine is)
    instead of the config's `num_blocks`. `max_model_len` (prompt + output
    tokens of a sequence) defaults to the model's context (`model_context`)
    and may not exceed it; the engine then caps it at what the pool holds,
    and refuses a larger one asked for. `draft_model` may be a model
    directory (`load_draft`): the engine then speculates. `kv_events`: the
    engine's KV-event endpoint or sink.

    Deprecated (kept for one release): the flat keywords `kv_memory`,
    `num_blocks`, `block_size`, `prefill_batch` (default `PREFILL_BATCH`),
    `max_model_len` and other engine settings in place of `config`."""
    import mlx_lm

    from scheduler.engine.engine import Engine

    path = Path(path)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{str(path)!r} is not an mlx-lm model directory (no config.json)")
    if legacy:
        if config is not None or budget is not None:
            raise InvalidArgument("give either config (and budget) or setting keywords, "
                                  "not both")
        config, budget = _legacy_config(path, draft_model, legacy)
    elif config is None:
        config = serve_config()
        budget = budget or kv_budget(None, _model_dirs(path, draft_model))
    context = model_context(json.loads((path / "config.json").read_text()))
    asked = config.scheduler.max_model_len
    if asked is not None and context is not None and asked > context:  # before loading
        raise InvalidArgument(f"--max-model-len {asked} is more than the model's context "
                              f"({context} tokens in its config.json)")
    # without return_config, load gives (model, tokenizer)
    model, tokenizer = cast("tuple[Any, Any]", mlx_lm.load(str(path)))
    if isinstance(draft_model, (str, Path)):
        draft_model = load_draft(draft_model)
    if budget is not None:
        config, _ = fit_pool(config, model, budget.nbytes)
    engine = Engine(model, config=config, tokenizer=tokenizer, kv_events=kv_events,
                    draft_model=draft_model, model_context=context)
    return engine, path.name


def _model_dirs(path: Path, draft_model: Any) -> list[str | Path]:
    """The model directories whose weights are still to load."""
    return [path] + ([draft_model] if isinstance(draft_model, (str, Path)) else [])


def _legacy_config(path: Path, draft_model: Any,
                   keywords: dict[str, Any]) -> tuple[EngineConfig, KVBudget | None]:
    """(config, budget) of `load_engine`'s deprecated flat keywords: without
    `num_blocks` the pool fits `kv_memory` (or the default budget)."""
    warnings.warn("load_engine's setting keywords are deprecated: pass an EngineConfig "
                  "(serve_config(...)) and a kv_budget(...)", DeprecationWarning, stacklevel=3)
    keywords = {"prefill_batch": PREFILL_BATCH, **keywords}
    kv_memory = keywords.pop("kv_memory", None)
    budget = None
    if keywords.get("num_blocks") is None:
        keywords.pop("num_blocks", None)
        budget = kv_budget(kv_memory, _model_dirs(path, draft_model))
    return EngineConfig.of(**keywords), budget


def load_draft(path: str | Path) -> Any:
    """The draft model of `--draft-model DIR` (an mlx-lm model directory
    with the target's vocabulary; the Engine checks it)."""
    import mlx_lm

    path = Path(path)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"--draft-model {str(path)!r} is not an mlx-lm model directory "
                              f"(no config.json)")
    model, _ = cast("tuple[Any, Any]", mlx_lm.load(str(path)))
    return model


def open_kv_events(endpoint: str | None, topic: str = "", replay_endpoint: str | None = None,
                   bind: bool | None = None):
    """The ZMQ sink of `--kv-events` (None without an endpoint), opened
    before the model loads so that a bad endpoint fails at once. `bind`:
    as `ZmqSink` (None: vLLM's rule)."""
    if endpoint is None:
        return None
    from scheduler.engine.kv_events import ZmqSink

    return ZmqSink(endpoint, topic=topic, replay_endpoint=replay_endpoint, bind=bind)


def kv_events_endpoint(option: str | None, bind: bool) -> tuple[str | None, bool | None]:
    """(endpoint, bind) of `--kv-events [ENDPOINT]` and `--kv-events-bind`:
    the option alone ("") binds `kv_events.DEFAULT_ENDPOINT` (loopback); an
    endpoint binds with `bind`, else follows vLLM's rule (None)."""
    from scheduler.engine.kv_events import DEFAULT_ENDPOINT

    if option == "":
        return DEFAULT_ENDPOINT, True
    return option, True if bind else None


def kv_events_warning(endpoint: str | None, replay_endpoint: str | None,
                      bind: bool | None) -> str | None:
    """One line when the KV events (every cached prompt's token ids, sent
    unauthenticated) would listen on every network interface."""
    from scheduler.engine.kv_events import exposes_beyond_machine, vllm_binds

    exposed = [e for e, binds in ((endpoint, bind), (replay_endpoint, True))
               if e is not None and (binds or (binds is None and vllm_binds(e)))
               and exposes_beyond_machine(e)]
    if not exposed:
        return None
    return (f"warning: KV events on {', '.join(exposed)} listen on every network interface, "
            f"unauthenticated (they carry every cached prompt's token ids); bind 127.0.0.1 or "
            f"one interface (--kv-events tcp://127.0.0.1:5557 --kv-events-bind) to keep them "
            f"on this machine")


def blas_hint() -> str | None:
    """One line on preloading OpenBLAS, when this Linux process's MLX has no
    optimized BLAS mapped (None otherwise)."""
    if not sys.platform.startswith("linux"):
        return None
    import mlx.core  # noqa: F401 - map MLX's libraries first

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    if "mlx_cpu.libs/libblas" not in maps:  # the wheel's reference BLAS is not in use
        return None
    for line in maps.splitlines():
        # numpy's bundled scipy_openblas renames its symbols: it does not serve MLX
        if any(n in line for n in ("libopenblas", "libmkl", "libblis")) and "scipy_" not in line:
            return None  # an optimized BLAS was preloaded: its symbols win
    where = (OPENBLAS if Path(OPENBLAS).exists()
             else "libopenblas.so.0 (Debian: libopenblas0-pthread)")
    return (f"note: MLX runs on the reference BLAS here (~5 GFLOPS); for much faster CPU "
            f"matmuls (BENCHMARKS.md, section BLAS) start with LD_PRELOAD={where}")


def run(engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
        max_waiting: int = 256, graceful_seconds: float = 10.0,
        max_body_bytes: int | None = None, allow_cache_reset: bool = False,
        status_interval: float | None = None, grpc_port: int | None = None,
        model_dir: str | Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get `graceful_seconds`
    to finish, then end cleanly (`scheduler.serving.shutdown`). `max_body_bytes`:
    None for the server's default (`server.default_max_body_bytes`).
    `allow_cache_reset`: serve `POST /reset_prefix_cache` (`operator_api`).
    `status_interval`: seconds between status lines in the log while busy
    (`scheduler.serving.status`; None: none). `grpc_port`: also serve the
    gateway's gRPC worker service on `host:grpc_port` (`grpc_worker`; the
    `fleet` extra), its model information and tokenizer read from
    `model_dir`."""
    import uvicorn

    from scheduler.serving.async_engine import AsyncEngine
    from scheduler.serving.operator_api import build_serving_app
    from scheduler.serving.shutdown import GracefulServer
    from scheduler.serving.status import StatusLine

    log = logging.getLogger("uvicorn.error")  # uvicorn's log, which it configures

    status = None if status_interval is None else StatusLine(status_interval)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, status=status,
                               status_sink=lambda line: log.info("blockmgr serve: %s", line))
    app = build_serving_app(async_engine, model_name, max_body_bytes=max_body_bytes,
                            allow_cache_reset=allow_cache_reset)
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    worker = None
    if grpc_port is not None:
        worker = start_grpc_worker(async_engine, model_name, model_dir, host, grpc_port)
        log.info("blockmgr serve: gRPC worker (SMG's vLLM service, KV events) on %s:%d",
                 host, worker.port)
    try:
        GracefulServer(config, async_engine, graceful_seconds).run()
    finally:
        if worker is not None:
            worker.stop()


def start_grpc_worker(engine, model_name: str, model_dir: str | Path | None, host: str,
                      port: int):
    """The started `GrpcWorker` of `--grpc-port` (`MissingDependency` without
    the `fleet` extra's grpcio and smg-grpc-proto)."""
    try:
        from scheduler.serving.grpc_worker import GrpcWorker, WorkerModel
    except ImportError as error:
        from scheduler.engine.kv_events import MissingDependency

        raise MissingDependency(f"--grpc-port needs grpcio and smg-grpc-proto: pip install "
                                f"'mlx-blockmgr[fleet]' ({error})") from None
    if model_dir is None:
        raise InvalidArgument("the gRPC worker needs the model directory (its tokenizer)")
    worker = GrpcWorker(engine, WorkerModel.of(model_dir, model_name), host=host, port=port)
    worker.start()
    return worker
