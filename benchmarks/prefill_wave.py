"""A wave of requests arriving together on a cached system prompt (what a
closed loop of `--clients` sends when a wave of answers ends), on the model
of `compare_serve.py`: the Engine's time from adding the wave to every
request's first token, for several `prefill_batch` values, interleaved in
rounds (fresh questions every round, the system prompt cached in each
engine beforehand). Median seconds per wave and forwards per wave.

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

from scheduler import Engine, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--system", type=int, default=400, help="system prompt tokens")
    parser.add_argument("--question", type=int, default=12, help="unique tokens per request")
    parser.add_argument("--prefill-batch", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = qwen3_model(args.layers)
    rng = np.random.default_rng(0)
    system = rng.integers(10, 150000, args.system).tolist()
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    blocks = (args.system + args.question + 32) // 16 * (args.clients + 2) + 64
    engines = {}
    for k in map(int, args.prefill_batch.split(",")):
        engine = Engine(model, num_blocks=blocks, block_size=16, prefill_batch=k,
                        max_num_seqs=args.clients, max_num_batched_tokens=8192)
        engine.generate([system + [1]], greedy)  # the system prompt into the prefix cache
        engines[k] = engine
    times: dict[int, list[float]] = {k: [] for k in engines}
    forwards: dict[int, list[int]] = {k: [] for k in engines}
    outputs: dict[int, list] = {k: [] for k in engines}
    for _ in range(args.rounds):
        wave = [system + rng.integers(10, 150000, args.question).tolist()
                for _ in range(args.clients)]
        for k, engine in engines.items():
            before = engine.stats.num_forwards
            t0 = time.perf_counter()
            outs = engine.generate(wave, greedy)
            times[k].append(time.perf_counter() - t0)
            forwards[k].append(engine.stats.num_forwards - before)
            outputs[k].append([o.tokens for o in outs])
    first = next(iter(outputs.values()))
    same = all(o == first for o in outputs.values())
    print(f"{args.clients} requests of {args.system} cached + {args.question} new tokens, "
          f"{args.layers} layers; outputs equal across settings: {same}")
    for k in engines:
        print(f"  prefill_batch {k:3d}: {statistics.median(times[k]):6.2f} s per wave, "
              f"{statistics.median(forwards[k])} forwards")


if __name__ == "__main__":
    main()
