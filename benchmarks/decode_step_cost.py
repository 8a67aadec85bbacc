"""The cost of one decode step of `rows` sequences at `context` tokens, on
the model of `compare_serve.py` (Qwen3-0.6B shape, random float32 weights):
the Engine's `step()` beside mlx-lm's `BatchGenerator.next()` and beside
the pieces of the forward (the layers on mlx-lm's KV caches without the LM
head; the LM head alone), in one process, interleaved in rounds so the
machine's load falls on all of them alike. Median ms per step.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/decode_step_cost.py --rows 8 --context 450
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare_serve import qwen3_model  # noqa: E402

from scheduler import Engine, SamplingParams  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=450)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per side per round")
    args = parser.parse_args()
    model = qwen3_model(args.layers)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 150000, args.context).tolist() for _ in range(args.rows)]
    budget = args.rounds * args.steps + 4

    engine = Engine(model, num_blocks=(args.context + budget + 16) // 16 * args.rows + 64,
                    block_size=16, max_num_seqs=args.rows, max_num_batched_tokens=4096)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=budget + 4, temperature=0.0,
                                             ignore_eos=True))
    while engine.stats.num_decode_tokens == 0:  # through the prefill
        engine.step()

    gen = BatchGenerator(model, completion_batch_size=args.rows, prefill_batch_size=args.rows)
    gen.insert(prompts, max_tokens=[budget + 4] * args.rows)
    while len(gen._generation_batch) < args.rows:  # noqa: SLF001 (measuring only)
        gen.next()

    h = mx.zeros((args.rows, 1, 1024))
    caches = make_prompt_cache(model)
    for _ in range(1):
        model(mx.array(prompts), cache=caches)
        mx.eval([c.state for c in caches])
    head = model.model.embed_tokens

    def layers_only():
        out = model.model(mx.array([[p[-1]] for p in prompts]), cache=caches)
        mx.eval(out)
        for c in caches:  # stay at the same context
            c.trim(1)

    def head_only():
        mx.eval(mx.argmax(head.as_linear(h), axis=-1))

    sides = {"engine.step": engine.step, "BatchGenerator.next": gen.next,
             "layers, mlx-lm KVCache, no head": layers_only, "LM head + argmax": head_only}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            for _ in range(args.steps):
                times[name].append(timed(fn))
    print(f"rows {args.rows}, context {args.context}, {args.layers} layers; median ms per step")
    for name, ts in times.items():
        print(f"  {name:34s} {1e3 * statistics.median(ts):7.1f}")


if __name__ == "__main__":
    main()
