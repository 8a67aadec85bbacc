"""Does an engine state make a chunk-beside-decode-rows step slow?

Times the calibration's mixed steps (decode rows at a context beside a
chunk that hits that context and samples) on engines built as `calibrate`
builds its decode engine, in several states, in one process, with the CPU
time split into user and system time and the step's minor page faults.
Modes:

* `states`: the same step 3 times on a fresh engine (the base prompt
  computed, nothing else), on that engine after the grid's decode points,
  on a new engine in the now warm process (process-level state: MLX's
  buffer cache, the C allocator), and after `mx.clear_cache()`;
* `interleave`: rounds of one step each on the warm engine, on it after
  `mx.clear_cache()` + `malloc_trim(0)` + 3 s (free page reporting hands
  freed pages back to the host after ~2 s), and on a new engine;
* `pool`: rounds on a fresh engine and on one whose pool the trie has
  filled (every step evicts), interleaved: a 1-row decode at 2048, 16 rows
  at 1024, the calibration's B=2 C=768 mixed steps;
* `pairs`: on a filled engine, each mixed shape twice in a row (the first
  of its shape after a decode point, then the same shape again).

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/mixed_state_probe.py --mode states|interleave|pool|pairs
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


class Probe:
    """The calibration's decode engine, its base prompt and token source."""

    def __init__(self, preset: str, layers: int) -> None:
        from scheduler.simulator.calibrate import CLOCKS, CalibrationGrid, _Recorder
        from scheduler.simulator.engine_models import ModelSpec, load_model, model_layout, vocab_size
        from scheduler.simulator.tokens import TokenSource

        self.model, description = load_model(ModelSpec(preset=preset, layers=layers))
        self.grid = CalibrationGrid()
        self.source = TokenSource(min(vocab_size(description), 32000))
        self.recorder = _Recorder(CLOCKS["cpu"], model_layout(self.model).attended)
        self.own = iter(range(1, 1 << 30))

    def engine(self):
        from scheduler.simulator.calibrate import _decode_engine

        engine, self.base = _decode_engine(self.model, self.grid, self.source, self.recorder, 0,
                                           self.grid.max_context)
        return engine

    def fill(self, engine) -> None:
        """Finished short requests until the trie holds all but a few pages."""
        from scheduler.request import SamplingParams

        while engine.cache.num_free_blocks > 40:  # the scheduler's eviction keeps ~32 free
            engine.generate([self.base[:128] + [next(self.own) % 32000] + self.source.text(next(self.own), 20)
                             for _ in range(32)], SamplingParams(max_tokens=8))

    def decode_points(self, engine) -> None:
        from scheduler.simulator.calibrate import _decode_point

        for context in self.grid.decode_contexts:
            for rows in self.grid.decode_batches:
                for kind in ("", "spread"):
                    _decode_point(engine, self.recorder, self.source, self.base, rows, context,
                                  self.grid.decode_steps, self.own, kind)

    def decode_median(self, engine, rows: int, context: int) -> float:
        from scheduler.simulator.calibrate import _decode_point

        self.recorder.samples.clear()
        _decode_point(engine, self.recorder, self.source, self.base, rows, context, self.grid.decode_steps, self.own)
        times = sorted(s.seconds for s in self.recorder.samples)
        return times[len(times) // 2]

    def mixed(self, engine, rows: int, context: int, chunks: tuple[int, ...], before=None) -> list[tuple]:
        """Per chunk length in turn (the decode rows kept): (user s, system
        s, faults) of one step computing that chunk after a `context` hit
        beside `rows` decode rows."""
        from scheduler.request import SamplingParams

        prefix = self.base[:context]
        for _ in range(rows):
            engine.add_request(prefix + [next(self.own) % 32000], SamplingParams(max_tokens=1 + len(chunks)))
        engine.step()  # the decode rows are admitted
        out = []
        for chunk in chunks:
            engine.add_request(prefix + self.source.text(7000 + next(self.own), chunk), SamplingParams(max_tokens=1))
            if before is not None:
                before()
            u0, s0, f0 = usage()
            engine.step()
            u1, s1, f1 = usage()
            out.append((u1 - u0, s1 - s0, f1 - f0))
        while engine.has_unfinished():
            engine.step()
        return out


def line(state: str, step: tuple) -> str:
    import mlx.core as mx

    user, system, faults = step
    return (f"{state:14s} cpu {user + system:.3f} s (user {user:.3f}, sys {system:.3f}) faults {faults:6d}"
            f"  mlx cache {mx.get_cache_memory() / 2**20:.0f} MB")


def main() -> int:
    import mlx.core as mx

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mode", choices=("states", "interleave", "pool", "pairs"), default="states")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    probe = Probe(args.preset, args.layers)
    shape = (2, 768, (256,))

    if args.mode == "states":
        engine = probe.engine()
        for state in ("fresh", "after decode", "new engine", "cache cleared"):
            before = mx.clear_cache if state == "cache cleared" else None
            target = probe.engine() if state == "new engine" else engine
            if state == "after decode":
                probe.decode_points(engine)
            for _ in range(args.rounds):
                print(line(state, probe.mixed(target, *shape, before=before)[0]), flush=True)
    elif args.mode == "interleave":
        libc = ctypes.CDLL("libc.so.6")

        def trimmed() -> None:
            mx.clear_cache()
            libc.malloc_trim(0)
            time.sleep(3)

        engine = probe.engine()
        probe.mixed(engine, *shape)
        for _ in range(args.rounds):
            print(line("warm", probe.mixed(engine, *shape)[0]), flush=True)
            print(line("trimmed", probe.mixed(engine, *shape, before=trimmed)[0]), flush=True)
            print(line("new engine", probe.mixed(probe.engine(), *shape)[0]), flush=True)
    elif args.mode == "pool":
        fresh, full = probe.engine(), probe.engine()
        probe.fill(full)
        for _ in range(args.rounds):
            for name, engine in (("fresh", fresh), ("full", full)):
                steps = probe.mixed(engine, 2, 768, (64, 256, 512))
                print(f"{name:5s} decode B=1 C=2048 {probe.decode_median(engine, 1, 2048):.3f} "
                      f"B=16 C=1024 {probe.decode_median(engine, 16, 1024):.3f}  mixed B=2 C=768 L=64,256,512 "
                      + " ".join(f"{u + s:.3f}" for u, s, _ in steps)
                      + f"  free pages {engine.cache.num_free_blocks}", flush=True)
    else:
        engine = probe.engine()
        probe.fill(engine)
        for _ in range(args.rounds):
            for rows, context in ((2, 768), (4, 128), (1, 1536)):
                probe.decode_median(engine, 16, 512)  # another shape in between, as in the grid
                steps = probe.mixed(engine, rows, context, (64, 64, 256, 256, 512, 512))
                print(f"B={rows} C={context} " + "  ".join(
                    f"L={chunk}: {sum(steps[2 * i][:2]):.3f} -> {sum(steps[2 * i + 1][:2]):.3f}"
                    for i, chunk in enumerate((64, 256, 512))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
