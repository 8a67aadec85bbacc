"""`blockmgr calibrate`: measure the real `Engine` on this machine and fit
the simulator's cost model to it.

Every measurement is a real `Engine.step()` (scheduling, paged views,
forward, sampling, update), recorded through the engine's step listener
with its `StepShape`. The grid:

* prefill: for each chunk length L, one engine whose token budget is L
  computes a long prompt, so its chunks run at contexts 0, L, 2L, ... up to
  `max_context` (the last one samples);
* decode: a long base prompt is computed once and kept by the prefix
  trie; for each batch size B and context C, B requests whose prompts are
  the base's first C tokens plus one token of their own hit the trie and
  decode `decode_steps` tokens side by side. Also batches whose contexts are
  spread over [C/4, C] (padding), batches whose tokens are drawn at
  temperature 1 (softmax and a categorical draw per row, 30x an argmax over
  a 152k vocabulary);
* mixed steps: for each decode batch B and context C of the mixed axes,
  B decodes at context C run while a prefill chunk of each length L starts
  after a hit of C tokens and samples, one step each (the engine runs the
  chunk's last token as one more row of the decode forward). The drawn and
  mixed points are spread among the decode contexts' points
  (`decode_order`), so a minute of a slower machine is not one step
  kind's bias;
* page copies and swaps: a batched copy of pages of this model's layout
  between two MLX pools (the storage's copy-on-write and host swap are such
  copies on a CPU), timed per page;
* tier moves: pages moved device <-> host and to and from a disk tier by
  the real storage (`tier_bandwidth`): `host_move_per_page`,
  `disk_store_per_page`, `disk_load_per_page`, and the disk's read and
  write bandwidth in the profile's grid (`tier_moves`).

Then `profile.fit_cost_model` fits all terms (non-negative, relative
error) and the profile records the fit error per grid point, the machine,
MLX version, the BLAS in use, and the model. Imports MLX.
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_choice, check_int
from scheduler.simulator.cost_model import step_shape
from scheduler.simulator.profile import CostProfile, StepSample, fit_cost_model
from scheduler.simulator.tier_bandwidth import measure_tier_moves
from scheduler.simulator.tokens import TokenSource

Progress = Callable[[str], None]

#: What a measured second is. "wall": elapsed time. "cpu": this process's
#: CPU time (all threads), which leaves out the time other processes hold
#: the cores: on a shared machine with one BLAS thread it is what an idle
#: machine's wall clock would read.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(slots=True, frozen=True)
class CalibrationGrid:
    """What to measure. Counts are steps or requests; lengths are tokens."""

    prefill_chunks: tuple[int, ...] = (16, 64, 256, 512)
    max_context: int = 2048
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    decode_contexts: tuple[int, ...] = (128, 512, 1024, 2048)  # 16 x 512: an overloaded chat's rows
    decode_steps: int = 6
    mixed_chunks: tuple[int, ...] = (64, 256, 512)
    mixed_batches: tuple[int, ...] = (1, 2, 4, 32)
    mixed_contexts: tuple[int, ...] = (128, 768, 1536)
    repeats: int = 2
    block_size: int = 16
    copy_pages: int = 64

    def __post_init__(self) -> None:
        for name in ("prefill_chunks", "decode_batches", "decode_contexts", "mixed_chunks",
                     "mixed_batches", "mixed_contexts"):
            values = getattr(self, name)
            if not values:
                raise InvalidArgument(f"{name} must not be empty")
            for value in values:
                check_int(f"each of {name}", value, 1, strict=True)
        for name in ("max_context", "decode_steps", "repeats", "block_size", "copy_pages"):
            check_int(name, getattr(self, name), 1, strict=True)
        for name in ("decode_contexts", "mixed_contexts"):
            if max(getattr(self, name)) > self.max_context:
                raise InvalidArgument(f"{name} {getattr(self, name)} exceed max_context "
                                      f"{self.max_context}")

    @property
    def num_points(self) -> int:
        """Progress units: prefill engines, decode points, mixed points, copies,
        tier moves."""
        decode = len(self.decode_batches) * (len(self.decode_contexts) * 2 + 1)
        mixed = len(self.mixed_batches) * len(self.mixed_contexts) * len(self.mixed_chunks)
        return self.repeats * (len(self.prefill_chunks) + decode + mixed) + 2

    @property
    def max_batch(self) -> int:
        """The most decode rows any point runs."""
        return max(self.decode_batches + self.mixed_batches)

    def to_dict(self) -> dict:
        return asdict(self)


#: A grid that runs in about a minute on a tiny model (tests, smoke runs).
QUICK_GRID = CalibrationGrid(
    prefill_chunks=(16, 64), max_context=256, decode_batches=(1, 4), decode_contexts=(64, 256),
    decode_steps=3, mixed_chunks=(32,), mixed_batches=(1, 4), mixed_contexts=(64,), repeats=1,
    copy_pages=8,
)


class _Recorder:
    """The step listener: (label, shape, seconds) of every engine step, and
    the clock the engines read. Shapes count the keys the model's attention
    layers read (`attended`, its `ModelLayout`'s), as the simulator does."""

    def __init__(self, clock: Callable[[], float], attended: Callable[[int], float]) -> None:
        self.clock = clock
        self.attended = attended
        self.label = "warmup"
        self.samples: list[StepSample] = []

    def __call__(self, out, seconds: float) -> None:
        if self.label != "warmup":
            self.samples.append(StepSample(self.label, step_shape(out, self.attended), seconds))


def calibrate(model: Any, description: dict, grid: CalibrationGrid,
              progress: Progress | None = None, clock: str = "wall",
              disk_cache: str | os.PathLike[str] | None = None) -> CostProfile:
    """Measure `model` over `grid` with `clock` (see `CLOCKS`) and fit a
    profile for the model's layout (`engine_models.model_layout`); the
    tier moves (`tier_bandwidth.measure_tier_moves`) are timed with the
    disk tier's files in `disk_cache` (default: the system's temporary
    directory), always by the wall clock (a disk wait takes no CPU time).
    Minutes of CPU time."""
    from scheduler.simulator.engine_models import model_layout, vocab_size

    tick = progress or (lambda label: None)
    source = TokenSource(min(vocab_size(description), 32000))
    check_choice("clock", clock, CLOCKS)
    layout = model_layout(model)
    recorder = _Recorder(CLOCKS[clock], layout.attended)
    for repeat in range(grid.repeats):
        for chunk in grid.prefill_chunks:
            _measure_prefill(model, grid, chunk, source, recorder, repeat)
            tick(f"prefill chunk {chunk}")
        _measure_decode(model, grid, source, recorder, repeat, tick)
    copy_seconds = measure_page_copy(model, description, grid, CLOCKS[clock])
    tick("page copies")
    tiers = measure_tier_moves(model, grid.block_size, grid.copy_pages, disk_cache)
    tick("tier moves")
    fixed = {"copy_per_page": copy_seconds, "swap_per_page": copy_seconds,
             **tiers.cost_terms()}
    cost, fit = fit_cost_model(recorder.samples, fixed)
    return CostProfile(
        cost=cost,
        fit=fit,
        machine=machine_info(),
        model=description,
        layout=layout,
        grid={**grid.to_dict(), "clock": clock, "copy_per_page_measured_s": copy_seconds,
              "tier_moves": tiers.to_dict(), "not_measured": ["copy_per_slot"]},
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        samples=tuple(recorder.samples),
    )


def _engine(model: Any, grid: CalibrationGrid, budget: int, recorder: _Recorder):
    from scheduler.engine.engine import Engine

    per_page = grid.block_size
    pages = -(-(grid.max_context + max(grid.prefill_chunks) + 1) // per_page)  # the long prompt
    steps = max(grid.decode_steps, len(grid.mixed_chunks)) + 2
    pages += grid.max_batch * (-(-steps // per_page) + 1)
    pages += -(-max(grid.mixed_chunks) // per_page) + 1
    pages = 2 * pages + 16  # room for the trie's finished outputs
    return Engine(model, num_blocks=pages, block_size=grid.block_size,
                  max_num_batched_tokens=budget, max_num_seqs=grid.max_batch + 2,
                  clock=recorder.clock, step_listener=recorder)


def _run(engine, recorder: _Recorder, label: str, prompts, max_tokens: int,
         drawn: bool = False) -> None:
    """Generate `prompts` greedily, or (`drawn`) at temperature 1, seeded."""
    from scheduler.core.request import SamplingParams

    recorder.label = label
    if drawn:
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i)
                  for i in range(len(prompts))]
        engine.generate(prompts, params)
    else:
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens))


def _measure_prefill(model, grid, chunk, source, recorder, repeat) -> None:
    """Chunks of `chunk` tokens at every context up to max_context, then one
    chunk that does not sample beside a decode row (`_measure_unsampled`)."""
    engine = _engine(model, grid, chunk, recorder)
    _run(engine, recorder, "warmup", [source.text(900 + repeat, 2 * chunk + 1)], 1)
    prompt = source.text(1000 + 100 * repeat + chunk, grid.max_context + chunk)
    _run(engine, recorder, f"prefill L={chunk}", [prompt], 1)
    prefix = prompt[:grid.max_context // 2]
    _measure_unsampled(engine, recorder, source, prefix, chunk, 2000 + repeat)


def _measure_unsampled(engine, recorder, source, prefix, budget, key) -> None:
    """One step of a decode row at context len(prefix) beside a chunk that
    fills the rest of the engine's token `budget` (a hybrid model's may end
    earlier, where a snapshot is due) and does not sample (a prompt's
    middle chunk). With the grid's other steps (chunks alone, sampling or
    not; sampling chunks beside decode rows) it separates the per-step,
    per-chunk, per-sampled-chunk and decode-forward terms, which steps whose
    chunks all sample cannot tell apart."""
    from scheduler.core.request import SamplingParams

    recorder.label = "warmup"
    engine.add_request(prefix + [key % source.vocab_size], SamplingParams(max_tokens=2))
    engine.step()  # the decode row is admitted
    recorder.label = f"mixed unsampled B=1 C={len(prefix)} L<={budget - 1}"
    long = engine.add_request(prefix + source.text(key, 2 * budget), SamplingParams(max_tokens=1))
    engine.step()
    recorder.label = "warmup"
    engine.abort(long)  # its other chunks would be prefill steps measured already


def _decode_engine(model, grid, source, recorder, repeat, context):
    """An engine whose prefix trie holds a base prompt of `context` + 1
    tokens (computed unrecorded), and that base."""
    budget = max(grid.max_context + 1, 2 * grid.max_batch, max(grid.mixed_chunks) + grid.max_batch)
    engine = _engine(model, grid, budget, recorder)
    base = source.text(5000 + repeat, context + 1)
    _run(engine, recorder, "warmup", [base], 1)
    return engine, base


def _measure_decode(model, grid, source, recorder, repeat, tick) -> None:
    """Decode batches over a cached base prompt; spread contexts; drawn
    tokens; mixed steps, in `decode_order`."""
    engine, base = _decode_engine(model, grid, source, recorder, repeat, grid.max_context)
    own = iter(range(1, 1 << 30))
    for kind, batch, context in decode_order(grid):
        if kind == "mixed":
            _measure_mixed(engine, recorder, source, base[:context], batch, grid.mixed_chunks, own,
                           tick)
        else:
            tick(_decode_point(engine, recorder, source, base, batch, context, grid.decode_steps,
                               own, kind))


def decode_order(grid: CalibrationGrid) -> list[tuple[str, int, int]]:
    """The decode engine's points as (kind, rows, context), kind "" (one
    context), "spread", "drawn" or "mixed": each decode context's points,
    each followed by its share of the drawn and mixed points, taken with a
    stride (block i gets points i, i + n, ...) so every share mixes rows and
    contexts. The machine's speed here moves 15-25 % between minutes at the
    same engine state; measured in one block at the end, the mixed points
    all took one minute's speed (10-20 % slow in one calibration), which
    the fit put into every chunk's price. Spread over the engine's life,
    such a drift is noise the fit averages, not a bias of one step kind."""
    blocks = len(grid.decode_contexts)
    drawn = [("drawn", batch, min(grid.decode_contexts)) for batch in grid.decode_batches]
    mixed = [("mixed", batch, context) for batch in grid.mixed_batches
             for context in grid.mixed_contexts]
    order: list[tuple[str, int, int]] = []
    for i, context in enumerate(grid.decode_contexts):
        order += [(kind, batch, context) for batch in grid.decode_batches
                  for kind in ("", "spread")]
        order += drawn[i::blocks] + mixed[i::blocks]
    return order


def _decode_point(engine, recorder, source, base, batch, context, steps, own, kind="") -> str:
    """`batch` requests on the cached base's first `context` tokens plus one
    of their own decode `steps` tokens side by side: at one context, with
    contexts spread over [C/4, C] (`kind` "spread"), or drawn at temperature
    1 ("drawn"). Returns the point's label."""
    if kind == "spread":
        contexts = [max(1, context * (8 - 7 * i // max(batch, 1)) // 8) for i in range(batch)]
        label = f"decode spread B={batch} C<={context}"
    else:
        contexts = [context] * batch
        label = f"decode {kind} B={batch} C={context}" if kind else f"decode B={batch} C={context}"
    prompts = [base[:c] + [next(own) % source.vocab_size] for c in contexts]
    _run(engine, recorder, label, prompts, steps + 1, drawn=kind == "drawn")
    return label


def _measure_mixed(engine, recorder, source, prefix, batch, chunks, own, tick) -> None:
    """`batch` decodes at context len(prefix) run while, one step each, a
    prompt of `prefix` plus each chunk length of fresh tokens hits the
    prefix and computes its chunk (and samples) beside them. Only the mixed
    steps are recorded; the decodes end with the last one."""
    from scheduler.core.request import SamplingParams

    recorder.label = "warmup"
    for _ in range(batch):
        engine.add_request(prefix + [next(own) % source.vocab_size],
                           SamplingParams(max_tokens=1 + len(chunks)))
    engine.step()  # the decodes are admitted
    for chunk in chunks:
        label = f"mixed B={batch} C={len(prefix)} L={chunk}"
        recorder.label = label
        engine.add_request(prefix + source.text(7000 + next(own), chunk),
                           SamplingParams(max_tokens=1))
        engine.step()
        recorder.label = "warmup"
        tick(label)
    while engine.has_unfinished():
        engine.step()


@dataclass(slots=True, frozen=True)
class Anchors:
    """A few grid points of a profile, measured again later to see how far
    the machine's speed has moved since (`drift`)."""

    prefill_chunk: int = 256
    # (rows, context), measured in the calibration's order: 16 rows at 512 read 8k keys,
    # below the knee, as an overloaded chat's rows do; at 1024, 16k, past it.
    # One row only at the grid's smallest context (see `measure_anchors`).
    decode: tuple[tuple[int, int], ...] = ((1, 128), (4, 512), (16, 512), (16, 1024))
    mixed: tuple[int, int, int] = (2, 768, 256)  # rows, context, chunk length
    # Steps of the mixed anchor, one after the other beside the same rows (the
    # grid measures it once a repeat): one step's spread here is ~10 %.
    mixed_steps: int = 3


def measure_anchors(model: Any, description: dict, grid: CalibrationGrid,
                    anchors: Anchors = Anchors(), clock: str = "wall") -> list[StepSample]:
    """The steps of `anchors`, measured as `calibrate` measures its grid
    (same labels and shapes, `grid`'s engine settings, the same base prompt,
    the points in the calibration's `decode_order` and, before each, the
    prompts the calibration computed before that point: the same hits and
    recomputations). About 30 s of CPU on Qwen3-0.6B's layers (4 of them).
    Anchors off the grid raise `InvalidArgument`.

    A decode anchor of one row must be at the grid's smallest decode
    context (raises ValueError): at a larger one the calibration's 1-row
    point is the one that computes its prompt past the shorter contexts'
    hits on a sliding-window model, and its chunk boundaries there depend
    on what else the trie held."""
    from scheduler.simulator.engine_models import model_layout, vocab_size

    check_choice("clock", clock, CLOCKS)
    smallest = min(grid.decode_contexts)
    for batch, context in anchors.decode:
        if context not in grid.decode_contexts or batch not in grid.decode_batches \
                or (batch == 1 and context != smallest):
            raise InvalidArgument(f"decode anchor ({batch}, {context}): rows and contexts must be "
                                  f"the grid's {grid.decode_batches} and {grid.decode_contexts}, "
                                  f"one row only at {smallest}")
    rows, context, chunk = anchors.mixed
    if rows not in grid.mixed_batches or context not in grid.mixed_contexts \
            or chunk not in grid.mixed_chunks:
        raise InvalidArgument(f"mixed anchor {anchors.mixed}: rows, context and chunk must be the "
                              f"grid's {grid.mixed_batches}, {grid.mixed_contexts} and "
                              f"{grid.mixed_chunks}")
    source = TokenSource(min(vocab_size(description), 32000))
    recorder = _Recorder(CLOCKS[clock], model_layout(model).attended)
    _measure_prefill(model, grid, anchors.prefill_chunk, source, recorder, 0)
    # The calibration's base length, not the anchors' longest context: on a
    # sliding-window model a shorter base would let a prompt hit whose
    # window pages the calibration's base no longer holds (it recomputed).
    engine, base = _decode_engine(model, grid, source, recorder, 0, grid.max_context)
    own = iter(range(1, 1 << 30))
    warmed: set[int] = set()

    def computed_before(context: int, inclusive: bool) -> None:
        # Before a point the calibration computed the prompts of every
        # shorter decode context and, in its 1-row point, of this one: on a
        # sliding-window model hits end there, not at the base.
        for earlier in sorted(c for c in grid.decode_contexts
                              if c < context or (inclusive and c == context)):
            if earlier not in warmed:
                _run(engine, recorder, "warmup",
                     [base[:earlier] + [next(own) % source.vocab_size]], 1)
                warmed.add(earlier)

    mixed_rows, mixed_context, chunk = anchors.mixed
    # the decode context whose points precede a drawn or mixed point
    block = min(grid.decode_contexts)
    for kind, batch, context in decode_order(grid):  # in the calibration's order
        if kind in ("", "spread"):
            block = context
        if kind == "" and (batch, context) in anchors.decode:
            computed_before(context, batch > 1)
            _decode_point(engine, recorder, source, base, batch, context, grid.decode_steps, own)
        elif kind == "mixed" and (batch, context) == (mixed_rows, mixed_context):
            computed_before(block, True)
            _measure_mixed(engine, recorder, source, base[:context], batch,
                           (chunk,) * anchors.mixed_steps, own, lambda label: None)
    return recorder.samples


def drift(points: list[dict], samples: list[StepSample]) -> dict[str, float]:
    """Per label of `samples` that a profile's fit `points` has: the mean
    measured step time now over the profile's, minus 1 (+0.05: steps now
    take 5 % longer than when the profile was measured)."""
    then = {p["label"]: p["measured_s"] for p in points}
    now: dict[str, list[float]] = {}
    for sample in samples:
        if sample.label in then:
            now.setdefault(sample.label, []).append(sample.seconds)
    return {label: sum(values) / len(values) / then[label] - 1 for label, values in now.items()}


def measure_page_copy(model: Any, description: dict, grid: CalibrationGrid,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per KV page copied (all attention layers, K and V), as one
    batched gather + scatter per pool array: the storage's copy and swap."""
    import mlx.core as mx

    from cache import layer_specs

    config = description["config"]
    heads = int(config.get("num_key_value_heads", config.get("num_attention_heads", 1)))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    layers = sum(1 for s in layer_specs(model) if s.kind.paged)
    n = grid.copy_pages
    pools = [mx.zeros((4 * n, grid.block_size, heads, head_dim)) for _ in range(2 * layers)]
    mx.eval(pools)
    src, dst = mx.arange(0, n), mx.arange(2 * n, 3 * n)
    best = float("inf")
    for _ in range(5):
        start = clock()
        for pool in pools:
            pool[dst] = pool[src]
        mx.eval(pools)
        best = min(best, clock() - start)
    return best / n


# ----------------------------------------------------------------- machine

_BLAS_NAMES = re.compile(r"(openblas|mkl|blis|accelerate|atlas|libblas|libcblas|flexiblas)", re.I)
_OPTIMIZED = re.compile(r"openblas|mkl|blis", re.I)


def blas_info() -> dict:
    """Which BLAS MLX runs on: the BLAS libraries mapped into this process
    (Linux; numpy's private copy, whose symbols are renamed, cannot serve
    MLX and is left out), LD_PRELOAD, and a measured 1024^3 float32 matmul
    rate, the decisive figure."""
    import mlx.core as mx

    mapped = sorted({line.split()[-1] for line in _maps() if _BLAS_NAMES.search(line.split()[-1])})
    usable = [path for path in mapped if "numpy.libs" not in path and "scipy_openblas" not in path]
    optimized = [path for path in usable if _OPTIMIZED.search(os.path.basename(path))]
    a = mx.random.normal((1024, 1024))
    mx.eval(a)
    mx.eval(a @ a)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - start)
    darwin = platform.system() == "Darwin"
    if optimized:
        name = os.path.basename(optimized[0])
    else:
        name = "Accelerate" if darwin else "reference BLAS bundled with mlx"
    return {
        "name": name,
        "optimized": bool(optimized) or darwin,
        "libraries": usable,
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "threads": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
                    if k in os.environ},
        "matmul_1024_gflops": 2 * 1024**3 / best / 1e9,
    }


def _maps() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8") as handle:
            return [line for line in handle if "/" in line]
    except OSError:
        return []


def machine_info() -> dict:
    import mlx.core as mx

    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average": _load_average(),
        "python": platform.python_version(),
        "mlx_version": getattr(mx, "__version__"),  # the module has it; its stubs omit it
        "mlx_device": str(mx.default_device()),
        "blas": blas_info(),
    }


def _load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):  # not on every platform
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
