"""Paged attention against gathering the history, one batched decode step.

Run: python benchmarks/paged_or_gather.py [--steps 20] [--rows 4,16] [--lengths 128,512,2048]

`PagedCache` serves mlx-lm's attention calls of a batch of 2+ rows from the
pool pages in place (`cache/paged_attention.py`, `gather_mm` per row, head
and page); with ``paged_attention=False`` it gathers each row's history into
a padded array for the model's own kernel. Which is faster depends on the
step's shape; this measures both on the same pages for random-weight llama
models of several head layouts (2 layers, float32), B rows of lengths
spread over [L/2, L], the best of two alternating rounds of `--steps` steps
each. Prints each shape's times, their ratio (gather / paged: above 1 means
paged attention is faster) and the padded K+V bytes a gather copies per
layer. Preload an optimized BLAS (BENCHMARKS.md, "BLAS").
"""

from __future__ import annotations

import argparse
import platform

import mlx.core as mx
import numpy as np
from compare_cache import prefill, time_steps
from mlx_lm.models import llama

from cache import PagedCache
from scheduler.simulator.calibrate import blas_info

BLOCK = 16
#: (hidden, query heads, KV heads): head sizes 16, 64, 64 and 64 with more heads.
LAYOUTS = ((64, 4, 2), (256, 4, 4), (512, 8, 4), (1024, 16, 8))


def model_of(hidden: int, heads: int, kv_heads: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=2,
        intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5, vocab_size=1000,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def step_time(model, lengths: list[int], steps: int, paged: bool) -> float:
    """Seconds per decode step of rows of `lengths` on a fresh cache."""
    need = sum(-(-(n + 4 * (steps + 8)) // BLOCK) for n in lengths) + len(lengths)
    pc = PagedCache.for_model(model, num_blocks=need, block_size=BLOCK, paged_attention=paged)
    ids = [f"s{i}" for i in range(len(lengths))]
    for seq_id, n in zip(ids, lengths):
        pc.allocate(seq_id, np.random.default_rng(n).integers(0, 1000, n).tolist())
        prefill(model, pc.views([seq_id]), n)
    y = mx.ones((len(lengths), 1), dtype=mx.int32)

    def step() -> None:
        pc.append_decode(ids, [1] * len(ids))
        mx.eval(model(y, cache=pc.views(ids)))

    return time_steps(step, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", default="4,16")
    ap.add_argument("--lengths", default="128,512,2048")
    args = ap.parse_args()
    mx.set_cache_limit(1 << 30)
    blas = blas_info()
    print(f"# {platform.machine()}, {mx.default_device()}, MLX {mx.__version__}, float32, "
          f"block {BLOCK}, 2 layers; BLAS {blas['name']} ({blas['matmul_1024_gflops']:.0f} GFLOPS)")
    print("\n| KV heads x size | rows | L | paged | gather | gather / paged | padded K+V a layer |")
    print("|---|---|---|---|---|---|---|")
    for hidden, heads, kv_heads in LAYOUTS:
        model = model_of(hidden, heads, kv_heads)
        size = hidden // heads
        for rows in map(int, args.rows.split(",")):
            for length in map(int, args.lengths.split(",")):
                lengths = [length - (length // (2 * rows)) * i for i in range(rows)]
                times = {True: [], False: []}
                for _ in range(2):
                    for paged in (True, False):
                        times[paged].append(step_time(model, lengths, args.steps, paged))
                paged_s, gather_s = min(times[True]), min(times[False])
                nbytes = 2 * rows * length * kv_heads * size * 4
                print(f"| {kv_heads} x {size} | {rows} | {length} | {paged_s * 1e3:.2f} ms "
                      f"| {gather_s * 1e3:.2f} ms | {gather_s / paged_s:.2f} "
                      f"| {nbytes / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
