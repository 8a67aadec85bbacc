"""Decode step of the declared layer caches on PagedCache vs mlx-lm's own, side by side.

Run: PYTHONPATH=. python benchmarks/compare_declared.py [--context 1024] [--steps 20] [--rounds 5]

The sweep's tiny random-weight deepseek_v41 (window 12, compression ratio 4
on 2 of 4 layers, index keys, candidate blocks: `tests.arch_models`) and
longcat_flash_ngram (n-gram context of 3 ids), float32, batch 1, after a
prompt of `--context` tokens. The mlx-lm side runs on `model.make_cache()`
(deepseek_v41's `LayerCache`; longcat's `ArraysCache` + `KVCache`s); the
paged side on `PagedCache.for_model` views, including the per-step `append`
and `views` calls an engine makes. Rounds alternate between the two sides;
each side's figure is the median of its per-round means (the machine is
shared).
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import numpy as np

from cache import PagedCache
from tests.arch_models import VOCAB, build

BLOCK = 16


def mlx_lm_side(model, prompt: list[int], steps: list[int]) -> float:
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt]), cache=cache))
    start = time.perf_counter()
    for t in steps:
        mx.eval(model(mx.array([[t]]), cache=cache))
    return (time.perf_counter() - start) / len(steps)


def paged_side(model, prompt: list[int], steps: list[int]) -> float:
    pages = -(-(len(prompt) + len(steps)) // BLOCK) + 4
    pc = PagedCache.for_model(model, num_blocks=pages, block_size=BLOCK, num_slots=4)
    pc.allocate("a", prompt)
    with pc.step(["a"]) as views:
        mx.eval(model(mx.array([prompt]), cache=views))
    start = time.perf_counter()
    for t in steps:
        pc.append("a", [t])
        with pc.step(["a"]) as views:
            logits = model(mx.array([[t]]), cache=views)
        mx.eval(logits)
        pc.eval_state()
    return (time.perf_counter() - start) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, VOCAB, args.context).tolist()
    steps = rng.integers(1, VOCAB, args.steps).tolist()
    print(f"# {platform.processor() or platform.machine()}, MLX {mx.__version__}, "
          f"context {args.context}, {args.steps} decode steps x {args.rounds} rounds")
    print("| model | mlx-lm step | paged step | paged / mlx-lm |")
    print("|---|---|---|---|")
    for name in ("deepseek_v41", "longcat_flash_ngram"):
        model = build(name)
        ref, paged = [], []
        for _ in range(args.rounds):
            ref.append(mlx_lm_side(model, prompt, steps))
            paged.append(paged_side(model, prompt, steps))
        r, p = float(np.median(ref)), float(np.median(paged))
        print(f"| {name} | {r * 1e3:.2f} ms | {p * 1e3:.2f} ms | {p / r:.2f} |", flush=True)


if __name__ == "__main__":
    main()
