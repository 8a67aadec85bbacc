"""Quantized KV pages against full-precision pages and mlx-lm's QuantizedKVCache.

Run (optimized BLAS, as recorded in BENCHMARKS.md):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/compare_kv_quant.py [--sections bytes,kernels,decode,engine,quality]

Model: random-weight qwen3 with Qwen3-0.6B's layer sizes (hidden 1024, 16
query / 8 KV heads of 128, MLP 3072), `--layers` of them, a `--vocab` of
8192 by default (the published 151936-entry LM head alone takes most of a
CPU decode step and hides the KV cache), float32 (MLX's CPU backend has no
fast half precision). Formats: full precision (the model's dtype), K8V8,
K8V4, K4V4, groups of 64. Sections, side by side in one run:

* bytes: KV bytes per token per layer, measured on allocated pools (and
  `KVFormat.page_nbytes`, which must agree), for float16 and float32.
* kernels: one layer's attention over quantized pages, quantized matmuls
  against dequantize-then-attend (the choice `cache.quantized_attention`
  makes), batch 1 and a ragged batch of 8, 1 to 16 queries.
* decode: a batch-1 decode step at 1k and 4k tokens of context: pages at
  full precision, K8V8 and K4V4, mlx-lm's QuantizedKVCache (8-bit) and
  KVCache; rounds alternate the sides, median of rounds.
* engine: Engine tokens/s (prefill included) on a workload that does not
  fit a fixed KV memory budget at full precision (preemption by recompute),
  with the same budget in full-precision pages and in 8-bit pages; also
  with the page counts a float16 model would get from that budget.
* quality: KL divergence (full precision || quantized) and top-1 agreement
  of the next-token distributions against full-precision pages over
  `--quality-positions` positions, teacher-forced (random weights: a noisy
  picture, see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from cache import KVFormat, PagedCache, QuantizedPagePool
from cache.page_pool import PagePool, PoolShape
from cache.quantized_attention import paged_quantized_attention, quantized_sdpa
from cache.step_plan import plan_step
from scheduler import Engine, SamplingParams

FORMATS = {"full": KVFormat(), "k8v8": KVFormat(8, 8), "k8v4": KVFormat(8, 4),
           "k4v4": KVFormat(4, 4)}
H, HQ, D = 8, 16, 128


def model_of(layers: int, vocab: int):
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=layers, intermediate_size=3072,
        num_attention_heads=HQ, num_key_value_heads=H, head_dim=D, rms_norm_eps=1e-6,
        vocab_size=vocab, max_position_embeddings=40960, rope_theta=1_000_000.0,
        tie_word_embeddings=True)
    mx.random.seed(0)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def median_ms(fn, reps: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# --- bytes ----------------------------------------------------------------------


def section_bytes() -> None:
    print("\n## KV bytes per token per layer (8 kv heads x 128, groups of 64)\n")
    print("| format | float16 | vs float16 | float32 | vs float32 |")
    print("|---|---|---|---|---|")
    for name, fmt in FORMATS.items():
        cells = []
        for dtype in (mx.float16, mx.float32):
            shape = PoolShape(64, 16, H, D, D, dtype)
            pool = (PagePool(shape) if not fmt.quantized
                    else QuantizedPagePool(shape, fmt.key_bits, fmt.value_bits, fmt.group_size))
            per_token = pool.nbytes / (64 * 16)
            assert pool.page_nbytes == fmt.page_nbytes(16, H, D, D, dtype.size)
            full = 2 * H * D * dtype.size
            cells += [f"{per_token:.0f} B", f"{per_token / full:.3f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")


# --- kernels --------------------------------------------------------------------


def section_kernels(reps: int) -> None:
    print("\n## One layer's attention on 8-bit pages: quantized matmuls vs dequantize "
          "then attend (float32)\n")
    print("| rows x context | queries | quantized matmuls | dequantize + fused SDPA | ratio |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for lengths in ([1024], [4096], [int(x) for x in np.linspace(200, 4000, 8)]):
        bs = 16
        num_blocks = sum(n // bs + 2 for n in lengths) + 4
        pool = QuantizedPagePool(PoolShape(num_blocks, bs, H, D, D, mx.float32), 8, 8, 64)
        rows = mx.arange(H * num_blocks)
        for col in range(bs):
            pool.write(rows, mx.full((H * num_blocks,), col),
                       mx.random.normal((H * num_blocks, D)), mx.random.normal((H * num_blocks, D)))
        mx.eval(pool.arrays())
        for n in (1, 2, 4, 8, 16):
            pages = iter(rng.permutation(num_blocks).tolist())
            tables = [[next(pages) for _ in range((L + n) // bs + 1)] for L in lengths]
            plan = plan_step(tables, [int(L) for L in lengths], [n] * len(lengths), n, bs,
                             num_blocks, None)
            q = mx.random.normal((len(lengths), HQ, n, D))
            mask = plan.mask(n, None, return_array=len(lengths) > 1)

            def dequantized():
                k, v = pool.gather(plan.gather_rows(H), plan.batch, plan.length)
                if plan.exact:
                    start, stop = plan.history_slice()
                    k, v = k[:, :, start:stop], v[:, :, start:stop]
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)

            def quantized():
                if plan.batch == 1:  # mlx-lm's quantized SDPA on the exact packed history
                    start, stop = plan.history_slice()
                    parts = [p.reshape(1, H, plan.length, p.shape[-1])[:, :, start:stop]
                             for p in pool.read_pages(plan.gather_rows(H))]
                    return quantized_sdpa(q, parts[:3], parts[3:], D**-0.5, mask, 64, 8, 8)
                arrays = pool.arrays()
                return paged_quantized_attention(q, arrays[:3], arrays[3:],
                                                 plan.pair_index(H), D**-0.5, 64, 8, 8)

            diff = mx.abs(quantized() - dequantized()).max().item()
            assert diff < 1e-3, diff
            a, b = median_ms(quantized, reps), median_ms(dequantized, reps)
            label = (f"1 x {lengths[0]}" if len(lengths) == 1
                     else f"{len(lengths)} x {min(lengths)}..{max(lengths)}")
            print(f"| {label} | {n} | {a:.2f} ms | {b:.2f} ms | {a / b:.2f} |")


# --- decode ---------------------------------------------------------------------


def section_decode(model, contexts, rounds: int, steps: int) -> None:
    print(f"\n## Decode step, batch 1, {len(model.layers)} layers (median of {rounds} rounds "
          f"of {steps} steps)\n")
    print("| context | side | step | vs full-precision pages |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(1)
    for ctx in contexts:
        prompt = rng.integers(0, model.args.vocab_size, ctx).tolist()
        sides = {}
        for name in ("full", "k8v8", "k4v4"):
            pc = PagedCache.for_model(model, ctx // 16 + 64, 16, kv_format=FORMATS[name])
            pc.allocate("a", prompt)
            for i in range(0, ctx, 512):
                with pc.step(["a"]) as views:
                    mx.eval(model(mx.array([prompt[i:i + 512]]), cache=views))
            sides[f"pages {name}"] = _paged_step(model, pc)
        for name, make in (("mlx-lm QuantizedKVCache 8-bit", lambda: QuantizedKVCache(64, 8)),
                           ("mlx-lm KVCache", KVCache)):
            caches = [make() for _ in model.layers]
            for i in range(0, ctx, 512):
                mx.eval(model(mx.array([prompt[i:i + 512]]), cache=caches))
            sides[name] = _mlx_step(model, caches)
        times = {k: [] for k in sides}
        for _ in range(rounds):
            for k, step in sides.items():
                mx.clear_cache()
                times[k].append(median_ms(step, steps))
        base = statistics.median(times["pages full"])
        for k, ts in times.items():
            t = statistics.median(ts)
            print(f"| {ctx} | {k} | {t:.2f} ms | {t / base:.2f} |")


def _paged_step(model, pc):
    def step():
        pc.append("a", [1])
        with pc.step(["a"]) as views:
            out = model(mx.array([[1]]), cache=views)
            mx.eval(out)
        return out
    return step


def _mlx_step(model, caches):
    def step():
        return model(mx.array([[1]]), cache=caches)
    return step


# --- engine ---------------------------------------------------------------------


def section_engine(model, budget_mib: int, requests: int, prompt_len: int, max_tokens: int,
                   rounds: int) -> None:
    budget = budget_mib << 20
    layers = len(model.layers)
    print(f"\n## Engine at a fixed KV budget of {budget_mib} MiB ({requests} requests of "
          f"{prompt_len} prompt + {max_tokens} output tokens, max 16 running, block 16)\n")
    print("| pages | page bytes counted at | pages in budget | tokens/s | vs full | preemptions |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, model.args.vocab_size, prompt_len).tolist()
               for _ in range(requests)]
    cases = []
    for dtype in (mx.float32, mx.float16):
        for name in ("full", "k8v8", "k4v4"):
            page = layers * FORMATS[name].page_nbytes(16, H, D, D, dtype.size)
            cases.append((name, dtype, budget // page))
    results = {c: [] for c in cases}
    for _ in range(rounds):
        for case in cases:
            name, _, num_blocks = case
            engine = Engine(model, num_blocks=num_blocks, block_size=16, max_num_seqs=16,
                            max_num_batched_tokens=512, enable_prefix_cache=False,
                            kv_format=FORMATS[name], batch_probe=False)
            mx.clear_cache()
            start = time.perf_counter()
            outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True))
            elapsed = time.perf_counter() - start
            generated = sum(len(o.tokens) for o in outs)
            results[case].append((generated / elapsed,
                                  engine.scheduler.stats.num_preempted_total))
    base = {dtype: statistics.median(r[0] for r in results[("full", dtype, n)])
            for (name, dtype, n) in cases if name == "full"}
    for case in cases:
        name, dtype, num_blocks = case
        tps = statistics.median(r[0] for r in results[case])
        pre = max(r[1] for r in results[case])
        label = "float32 (the model's)" if dtype == mx.float32 else "float16 (its count)"
        print(f"| {name} | {label} | {num_blocks} | {tps:.1f} | {tps / base[dtype]:.2f}x | "
              f"{pre} |")


# --- quality --------------------------------------------------------------------


def section_quality(model, positions: int, seq_len: int) -> None:
    print(f"\n## Next-token distributions against full-precision pages ({positions} positions, "
          f"teacher-forced, sequences of {seq_len}, random weights)\n")
    print("| K/V stored as | mean KL (nats) | p99 KL | top-1 agreement |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, model.args.vocab_size, seq_len).tolist()
            for _ in range(max(1, positions // seq_len))]
    full = [_logprobs(model, s, FORMATS["full"]) for s in seqs]
    sides = {name: (lambda s, f=FORMATS[name]: _logprobs(model, s, f))
             for name in ("k8v8", "k8v4", "k4v4")}
    sides["bfloat16 (yardstick)"] = lambda s: _logprobs(model, s, FORMATS["full"], mx.bfloat16)
    for name, logprobs in sides.items():
        kls, agree = [], []
        for s, ref in zip(seqs, full):
            got = logprobs(s)
            kls.append(np.sum(np.exp(ref) * (ref - got), axis=-1))
            agree.append(ref.argmax(-1) == got.argmax(-1))
        kl, ag = np.concatenate(kls), np.concatenate(agree)
        print(f"| {name} | {kl.mean():.2e} | {np.quantile(kl, 0.99):.2e} | {ag.mean():.4f} |")
    ref = np.concatenate(full)
    entropy = -np.sum(np.exp(ref) * ref, axis=-1).mean()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    print(f"\nFull-precision distributions: mean entropy {entropy:.2f} nats (uniform: "
          f"{np.log(ref.shape[-1]):.2f}), median top-1 / top-2 log-probability gap "
          f"{np.median(top2[:, 1] - top2[:, 0]):.3f}.")


def _logprobs(model, seq, fmt, round_to: mx.Dtype | None = None) -> np.ndarray:
    """Log-probabilities at every position, prefill in chunks of 64 then
    decode one token at a time for the last quarter (both paths count).
    `round_to`: K/V rounded through that dtype before they are stored."""
    pc = PagedCache.for_model(model, len(seq) // 16 + 4, 16, kv_format=fmt)
    split = 3 * len(seq) // 4
    pc.allocate("a", seq[:split])
    chunks = [seq[i:min(i + 64, split)] for i in range(0, split, 64)]
    out = []
    for i, chunk in enumerate(chunks + [[t] for t in seq[split:]]):
        if i >= len(chunks):
            pc.append("a", chunk)
        with pc.step(["a"]) as views:
            views = [_Rounding(v, round_to) for v in views] if round_to else views
            out.append(model(mx.array([chunk]), cache=views)[0])
    logits = mx.concatenate(out).astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


class _Rounding:
    """An attention view whose writes are rounded through `dtype` first."""

    def __init__(self, view, dtype) -> None:
        self._view, self._dtype = view, dtype

    def update_and_fetch(self, keys, values):
        rounded = [x.astype(self._dtype).astype(x.dtype) for x in (keys, values)]
        return self._view.update_and_fetch(*rounded)

    def __getattr__(self, name):
        return getattr(self._view, name)

    def __bool__(self) -> bool:
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="bytes,kernels,decode,engine,quality")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--engine-rounds", type=int, default=2)
    ap.add_argument("--budget-mib", type=int, default=40)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quality-positions", type=int, default=4096)
    ap.add_argument("--quality-seq-len", type=int, default=512)
    args = ap.parse_args()
    mx.set_cache_limit(1 << 30)
    sections = args.sections.split(",")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__}, "
          f"device {mx.default_device()}, LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    if "bytes" in sections:
        section_bytes()
    if "kernels" in sections:
        section_kernels(args.steps)
    model = model_of(args.layers, args.vocab)
    if "decode" in sections:
        section_decode(model, [int(c) for c in args.contexts.split(",")], args.rounds,
                       args.steps)
    if "engine" in sections:
        section_engine(model, args.budget_mib, args.requests, args.prompt_len,
                       args.max_tokens, args.engine_rounds)
    if "quality" in sections:
        section_quality(model, args.quality_positions, args.quality_seq_len)


if __name__ == "__main__":
    main()
