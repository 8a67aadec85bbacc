"""A wave of requests arriving together on a cached system prompt (what a
closed loop of `--clients` sends when a wave of answers ends), on the model
of `compare_serve.py`: the Engine's time from adding the wave to every
request's first token, for several `prefill_batch` values, interleaved in
rounds (fresh questions every round, the system prompt cached in each
engine beforehand). Median seconds per wave and forwards per wave.
`--long N`: one request of the wave asks N new tokens instead; `--naive`
also runs each `prefill_batch` with the chunks grouped in arrival order,
`prefill_batch` at a time, padded to the longest (the grouping before
`scheduler.core.prefill_groups`), side by side.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/prefill_wave.py --clients 32 --prefill-batch 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare_serve import qwen3_model  # noqa: E402

import scheduler.engine.engine  # noqa: E402
from scheduler import Engine, SamplingParams  # noqa: E402
from scheduler.core.prefill_groups import prefill_groups  # noqa: E402


def naive_groups(chunks, max_rows):
    return [list(chunks[i : i + max_rows]) for i in range(0, len(chunks), max_rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--system", type=int, default=400, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=12, help="unique tokens per request")
    parser.add_argument("--prefill-batch", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=None,
                        help="new tokens of one request of the wave (default: --question)")
    parser.add_argument("--naive", action="store_true",
                        help="also run the arrival-order grouping")
    args = parser.parse_args()
    model = qwen3_model(args.layers)
    rng = np.random.default_rng(0)
    system = rng.integers(10, 150000, args.system).tolist()
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    blocks = (args.system + args.question + 32) // 16 * (args.clients + 2) + 64
    blocks += ((args.long or 0) + 15) // 16
    groupings = {"bounded": prefill_groups}
    if args.naive:
        groupings["naive"] = naive_groups
    engines = {}
    for k in map(int, args.prefill_batch.split(",")):
        for grouping in groupings:
            engine = Engine(model, num_blocks=blocks, block_size=16, prefill_batch=k,
                            max_num_seqs=args.clients, max_num_batched_tokens=8192)
            engine.generate([system + [1]], greedy)  # the system prompt into the prefix cache
            engines[k, grouping] = engine
    times: dict = {k: [] for k in engines}
    forwards: dict = {k: [] for k in engines}
    outputs: dict = {k: [] for k in engines}
    for _ in range(args.rounds):
        lengths = [args.question] * args.clients
        if args.long is not None:
            lengths[args.clients // 2] = args.long
        wave = [system + rng.integers(10, 150000, n).tolist() for n in lengths]
        for k, engine in engines.items():
            before = engine.stats.num_forwards
            scheduler.engine.engine.prefill_groups = groupings[k[1]]  # (measuring only)
            t0 = time.perf_counter()
            outs = engine.generate(wave, greedy)
            times[k].append(time.perf_counter() - t0)
            forwards[k].append(engine.stats.num_forwards - before)
            outputs[k].append([o.tokens for o in outs])
    first = next(iter(outputs.values()))
    same = all(o == first for o in outputs.values())
    long = "" if args.long is None else f" (one of them {args.long})"
    print(f"{args.clients} requests of {args.system} cached + {args.question} new tokens{long}, "
          f"{args.layers} layers; outputs equal across settings: {same}")
    for (k, grouping), ts in times.items():
        print(f"  prefill_batch {k:3d} {grouping:8s}: {statistics.median(ts):6.2f} s per wave, "
              f"{statistics.median(forwards[k, grouping])} forwards")


if __name__ == "__main__":
    main()
