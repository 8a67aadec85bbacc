"""Does a simulation's cost per request grow with the run? CPU per chunk of requests.

    python benchmarks/simulate_growth.py -n 1000000 --chunk 100000 [-- SIMULATE_ARGS...]

Runs one `blockmgr simulate` in this process (default: chat at rate 5 with
`--check`) and prints, every `--chunk` finished requests, the CPU seconds of
that chunk and per request, the cyclic GC's time in it (`gc.callbacks`) and
its generation-2 collections, the objects the GC tracks and the peak RSS: a
cost that grows with the requests seen shows as a rising ms/request at a
steady load.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.cli import build_config, build_parser  # noqa: E402
from scheduler.simulator.runner import run_simulation  # noqa: E402

DEFAULT_ARGS = ["--workload", "chat", "--rate", "5", "--check"]


class GcClock:
    """CPU seconds spent in cyclic GC collections, and generation-2 ones."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.num_full = 0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
            return
        self.seconds += time.process_time() - self._start
        self.num_full += info["generation"] == 2


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300_000, help="requests")
    parser.add_argument("--chunk", type=int, default=50_000, help="requests per line")
    opts = parser.parse_args(argv[:split])
    sim_args = argv[split + 1:] or DEFAULT_ARGS
    config = build_config(build_parser().parse_args(["simulate", "-n", str(opts.n), *sim_args]))
    clock = GcClock()
    mark = {"done": 0, "cpu": time.process_time(), "gc": 0.0, "full": 0}

    def progress(num_done: int, num_added: int, sim_time: float) -> None:
        if num_done - mark["done"] < opts.chunk:
            return
        cpu = time.process_time()
        seconds = cpu - mark["cpu"]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{num_done:9d} requests  {seconds:7.2f} s  "
              f"{seconds / (num_done - mark['done']) * 1e3:.3f} ms/request  "
              f"gc {clock.seconds - mark['gc']:5.2f} s ({clock.num_full - mark['full']} full)  "
              f"tracked {len(gc.get_objects())}  peak rss {rss:.0f} MB", flush=True)
        mark.update(done=num_done, cpu=time.process_time(), gc=clock.seconds, full=clock.num_full)

    start = time.process_time()
    run_simulation(config, progress=progress)
    print(f"total {time.process_time() - start:.1f} s CPU, gc {clock.seconds:.2f} s "
          f"({clock.num_full} full collections)")


if __name__ == "__main__":
    main()
