"""Engine vs mlx-lm's BatchGenerator on the same tiny model, side by side.

Run: python benchmarks/compare_engine.py [--hidden 64] [--max-tokens 64] [--repeats 3]
     python benchmarks/compare_engine.py --shape qwen3-0.6b [--layers 4]

`--shape tiny` (the default): a llama of `--hidden` with 4 heads, a step so
small that per-step Python work decides the ratio. `--shape qwen3-0.6b`: a
random-weight qwen3 with Qwen3-0.6B's layer sizes (hidden 1024, 16 query / 8
KV heads of 128, MLP 3072; `--layers`, vocabulary 8192), where the model's
own work dominates as in real use. Preload an optimized BLAS for that one
(BENCHMARKS.md, "BLAS").

16 prompts (120..300 tokens, 12 of them sharing a 96-token prefix), greedy,
`max_tokens` each, float32, CPU. Both sides run with the same MLX buffer
cache limit (1 GiB, see design/cache.md). Reported per side: wall time of
the whole batch (best of `repeats`), generated tokens/s, and peak KV bytes:

* mlx-lm: the generation batch's caches (`nbytes`), sampled after every
  step (its prefill caches are merged into it);
* engine: pages held (sequences + prefix trie) at the end of every step,
  and the pool as allocated up front (`num_blocks` pages).

The outputs of both sides are checked to be equal, prompt by prompt.
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama, qwen3

from scheduler import Engine, SamplingParams
from scheduler.simulator.calibrate import blas_info

VOCAB = 1000


def tiny_llama(hidden: int, layers: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=VOCAB,
    )
    mx.random.seed(1)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def qwen3_shaped(layers: int) -> qwen3.Model:
    """Qwen3-0.6B's layer sizes with random weights and a vocabulary of 8192
    (the published 151936-entry LM head would take most of a CPU step)."""
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=layers, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        vocab_size=8192, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )
    mx.random.seed(1)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 96).tolist()
    prompts = []
    for i in range(16):
        n = int(rng.integers(24, 204))
        tail = rng.integers(0, VOCAB, n).tolist()
        prompts.append(shared + tail if i % 4 else rng.integers(0, VOCAB, 96).tolist() + tail)
    return prompts


def cache_nbytes(caches) -> int:
    total = 0
    for c in caches or []:
        for a in getattr(c, "state", []) or []:
            if isinstance(a, mx.array):
                total += a.nbytes
    return total


def run_mlx_lm(model, prompts, max_tokens):
    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=16,
                         prefill_batch_size=16)
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    out = {u: [] for u in uids}
    peak = 0
    t0 = time.perf_counter()
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(int(r.token))
        batch = getattr(gen, "_generation_batch", None)
        peak = max(peak, cache_nbytes(getattr(batch, "prompt_cache", None)))
    dt = time.perf_counter() - t0
    gen.close()
    return [out[u] for u in uids], dt, peak


def run_engine(model, prompts, max_tokens, num_blocks, block_size):
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                    max_num_batched_tokens=4096, max_num_seqs=16)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    dt = time.perf_counter() - t0
    ttft = [o.metrics.time_to_first_token for o in outs]
    tpot = [o.metrics.time_per_output_token for o in outs]
    return [o.tokens for o in outs], dt, engine, ttft, tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "qwen3-0.6b"), default="tiny")
    parser.add_argument("--hidden", type=int, default=64, help="tiny: the llama's hidden size")
    parser.add_argument("--layers", type=int, help="default 2 (tiny), 4 (qwen3-0.6b)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mx.set_cache_limit(1 << 30)
    if args.shape == "tiny":
        args.layers = args.layers or 2
        model = tiny_llama(args.hidden, args.layers)
        described = f"llama hidden {args.hidden}, {args.layers} layers"
    else:
        args.layers = args.layers or 4
        model = qwen3_shaped(args.layers)
        described = f"qwen3 with Qwen3-0.6B's layer sizes, {args.layers} layers, vocabulary 8192"
    prompts = make_prompts()
    need = sum(len(p) + args.max_tokens for p in prompts)
    num_blocks = -(-need // args.block_size) + 16
    ours, theirs = [], []
    for _ in range(args.repeats):
        theirs.append(run_mlx_lm(model, prompts, args.max_tokens))
        ours.append(run_engine(model, prompts, args.max_tokens, num_blocks, args.block_size))
    ref_tokens, ref_dt, ref_peak = min(theirs, key=lambda r: r[1])
    tokens, dt, engine, ttft, tpot = min(ours, key=lambda r: r[1])
    same = sum(a == b for a, b in zip(tokens, ref_tokens))
    generated = sum(len(t) for t in tokens)
    blas = blas_info()
    print(f"machine: {platform.machine()}, {platform.system()}, MLX {mx.__version__}, "
          f"{mx.default_device()}, float32; BLAS {blas['name']} "
          f"({blas['matmul_1024_gflops']:.0f} GFLOPS, 1024^3 float32 matmul)")
    print(f"model: {described}; 16 prompts "
          f"({min(map(len, prompts))}..{max(map(len, prompts))} tokens), "
          f"{args.max_tokens} new tokens each, greedy")
    print(f"outputs equal prompt by prompt: {same}/16")
    print()
    print("| | wall (s) | generated tok/s | peak KV bytes | KV pool allocated |")
    print("|---|---|---|---|---|")
    print(f"| mlx-lm BatchGenerator | {ref_dt:.3f} | {generated / ref_dt:.0f} | "
          f"{ref_peak / 2**20:.2f} MiB | - |")
    print(f"| Engine (paged) | {dt:.3f} | {generated / dt:.0f} | "
          f"{engine.stats.peak_kv_bytes / 2**20:.2f} MiB | {engine.cache.nbytes / 2**20:.2f} MiB |")
    print(f"| ratio engine / mlx-lm | {dt / ref_dt:.2f} | {ref_dt / dt:.2f}x | "
          f"{engine.stats.peak_kv_bytes / max(ref_peak, 1):.2f} | |")
    print()
    st = engine.stats
    hit = engine.scheduler.stats.num_prefix_hit_tokens_total
    print(f"engine: {st.num_steps} steps, {st.num_forwards} forwards, prefix-hit tokens {hit}, "
          f"scheduler {st.schedule_time * 1e3:.1f} ms total")
    print(f"engine TTFT: median {np.median(ttft) * 1e3:.1f} ms, max {max(ttft) * 1e3:.1f} ms; "
          f"per-token latency: median {np.median(tpot) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
