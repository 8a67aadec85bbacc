"""`blockmgr serve`: load a model directory, size the pool, run the server.

`load_engine(path, ...)` loads an mlx-lm model directory (`mlx_lm.load`)
and builds an `Engine` whose page pool fits a memory budget
(`kv_memory`, e.g. "4GiB": a hybrid model's recurrent slots first, then
pages of every layer group together; `size_pool`) unless a page count is
given. `run(...)` serves it with uvicorn until SIGINT or
SIGTERM (uvicorn stops accepting, lets in-flight responses finish for
`graceful_seconds`, then the engine aborts what is left).
`blas_hint()` is the one line printed on Linux when MLX's CPU backend runs
on the reference BLAS (the `mlx[cpu]` wheel bundles it: about 5.5 GFLOPS on
a 1024^3 float32 matmul, against about 230 with OpenBLAS preloaded).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockmgr.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12,
          "tib": 2**40}
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
#: Prefill chunks per forward in the server: a closed loop's clients arrive
#: in waves, and a wave of short chunks on a cached system prompt costs one
#: weight read per forward (BENCHMARKS.md, "serve"); `prefill_groups` keeps
#: the padding bounded whatever the lengths.
PREFILL_BATCH = 8


def parse_bytes(text: str) -> int:
    """"4GiB", "512MB", "1e9" -> bytes (binary units for Ki/Mi/Gi and bare K/M/G)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"not a memory size: {text!r} (try 4GiB or 512MB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise InvalidArgument(f"memory size must be positive, got {text!r}")
    return value


def page_bytes(model: Any, block_size: int) -> int:
    """Bytes one page of the model's KV takes, over every layer group: the
    pools of a one-page storage, sized by one forward of one token (pools
    take their head shapes from the first K/V written)."""
    import mlx.core as mx

    from cache import PagedCache

    storage = PagedCache.for_model(model, 1, block_size, num_slots=1)
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


def size_pool(model: Any, budget: int, block_size: int, max_num_seqs: int) -> PoolSize:
    """Pages and slots that fit `budget` bytes. A hybrid model gets the
    engine's default slots (`default_num_slots`: each running sequence's
    state and a prefix snapshot), whose bytes come off the budget first;
    pages take the rest. Raises `InvalidArgument` when not even the slots
    and one page fit. Cost: two one-token forwards."""
    from scheduler.engine import default_num_slots

    per_slot = slot_bytes(model)
    num_slots = default_num_slots(max_num_seqs) if per_slot else 0
    per_page = max(1, page_bytes(model, block_size))
    left = budget - num_slots * per_slot
    if left < per_page:
        raise InvalidArgument(
            f"a KV memory budget of {budget} bytes does not hold {num_slots} recurrent slots of "
            f"{per_slot} bytes and one page of {per_page} bytes; give at least "
            f"{num_slots * per_slot + per_page} bytes (or fewer --max-num-seqs)")
    return PoolSize(left // per_page, num_slots, per_page, per_slot)


def load_engine(path: str | Path, *, kv_memory: str | None = None,
                num_blocks: int | None = None, block_size: int = 16,
                prefill_batch: int = PREFILL_BATCH, **engine_kwargs):
    """(Engine, model name) for an mlx-lm model directory. Without
    `num_blocks` the pool fits `kv_memory` (default 4GiB; `size_pool`).
    Prefill chunks that arrive together share forwards (`prefill_batch`,
    default `PREFILL_BATCH`)."""
    import mlx_lm

    from scheduler.engine import Engine
    from scheduler.scheduler import SchedulerConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{str(path)!r} is not an mlx-lm model directory (no config.json)")
    model, tokenizer = mlx_lm.load(str(path))
    if num_blocks is None:
        max_num_seqs = engine_kwargs.get("max_num_seqs", SchedulerConfig().max_num_seqs)
        size = size_pool(model, parse_bytes(kv_memory or "4GiB"), block_size, max_num_seqs)
        num_blocks = size.num_blocks
        engine_kwargs.setdefault("num_slots", size.num_slots or None)
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, tokenizer=tokenizer,
                    prefill_batch=prefill_batch, **engine_kwargs)
    return engine, path.name


def open_kv_events(endpoint: str | None, topic: str = "", replay_endpoint: str | None = None):
    """The ZMQ sink of `--kv-events` (None without an endpoint), opened
    before the model loads so that a bad endpoint fails at once."""
    if endpoint is None:
        return None
    from scheduler.kv_events import ZmqSink

    return ZmqSink(endpoint, topic=topic, replay_endpoint=replay_endpoint)


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
    where = OPENBLAS if Path(OPENBLAS).exists() else "libopenblas.so.0 (Debian: libopenblas0-pthread)"
    return (f"note: MLX runs on the reference BLAS here (~5 GFLOPS); for ~40x faster CPU "
            f"matmuls start with LD_PRELOAD={where}")


def run(engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
        max_waiting: int = 256, graceful_seconds: float = 10.0) -> None:
    import uvicorn

    from scheduler.async_engine import AsyncEngine
    from scheduler.server import build_app

    app = build_app(AsyncEngine(engine, max_waiting=max_waiting), model_name)
    uvicorn.run(app, host=host, port=port, log_level="info",
                timeout_graceful_shutdown=graceful_seconds)
