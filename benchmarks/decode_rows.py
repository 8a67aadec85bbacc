"""Decode step time against the number of rows, at one context: is it
linear in the rows between the calibration grid's batch sizes?

One engine on a preset's layers (random weights) computes a base prompt;
for each row count, that many requests on the base plus one token of their
own decode side by side (as `calibrate`'s decode points do), in rounds so
the machine's load falls on every row count alike. Step time by this
process's CPU time (run with one BLAS thread); median over the steps.
`--own-prompts`: each row's prompt is a text of its own (no shared pages).

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/decode_rows.py --preset qwen3-0.6b --layers 4 --context 460 \\
            --rows 1,2,4,6,8,11,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import count
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.core.request import SamplingParams  # noqa: E402
from scheduler.engine.engine import Engine  # noqa: E402
from scheduler.simulator.engine_models import ModelSpec, load_model  # noqa: E402
from scheduler.simulator.tokens import TokenSource  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=460)
    parser.add_argument("--rows", default="1,2,4,6,8,11,16")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per row count and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--own-prompts", action="store_true", help="no prompt shares the base")
    args = parser.parse_args()
    rows = [int(value) for value in args.rows.split(",")]
    model, _ = load_model(ModelSpec(preset=args.preset, layers=args.layers))
    source = TokenSource(32000)
    times: dict[int, list[float]] = {n: [] for n in rows}
    running = [0]

    def listener(out, seconds: float) -> None:  # decode-only steps of the current row count
        if len(out.seqs) == running[0] and all(len(item.token_ids) == 1 for item in out.seqs):
            times[running[0]].append(seconds)

    engine = Engine(model, num_blocks=1024, block_size=16, max_num_batched_tokens=2048,
                    max_num_seqs=max(rows) + 2, clock=time.process_time, step_listener=listener)
    base = source.text(1, args.context)
    engine.generate([base + [0]], SamplingParams(max_tokens=2))  # the base is computed once
    own = count(1)
    for _ in range(args.rounds):
        for n in rows:
            running[0] = n
            prompts = [source.text(1000 + next(own), args.context + 1) if args.own_prompts
                       else base + [next(own)] for _ in range(n)]
            engine.generate(prompts, SamplingParams(max_tokens=args.steps))
    low, high = rows[0], rows[-1]
    median = {n: statistics.median(times[n]) for n in rows}
    print(f"| decode rows | step, s (median of steps) | over the {low}-{high} chord |"
          "\n|---|---|---|")
    for n in rows:
        chord = median[low] + (median[high] - median[low]) * (n - low) / max(high - low, 1)
        print(f"| {n} | {median[n]:.4f} ({len(times[n])}) "
              f"| {(median[n] / chord - 1) * 100:+.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
