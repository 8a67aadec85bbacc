"""Paged views vs mlx-lm's own caches, side by side, in one run.

Run: python benchmarks/compare_cache.py [--steps 30]

* decode step of a tiny llama (4 layers, hidden 256) at 1k and 4k context:
  PagedCache views vs mlx-lm KVCache (target ratio <= 1.25);
* batched decode of 8 sequences of lengths 200..4000: tokens/s vs mlx-lm
  BatchKVCache (target >= 1.0) and KV bytes held (target <= 0.6); also the
  same step as 2 or 3 forwards over length buckets (`cache.buckets`), which
  paged views allow and a padded BatchKVCache does not;
* gather throughput as a fraction of a plain copy of the same bytes.

Both sides run with the same MLX buffer-cache limit (1 GiB, set below): the
CPU default (32 MB here) returns every larger temporary to the OS, so each
step page-faults its big buffers in again; that would penalise whichever
side allocates large temporaries.
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache

from cache import PagedCache
from cache.buckets import length_buckets

BLOCK = 16


def tiny_llama():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=1000,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def prefill(model, cache, n, chunk=512):
    toks = np.random.default_rng(n).integers(0, 1000, n)
    for i in range(0, n, chunk):
        model(mx.array(toks[None, i : i + chunk]), cache=cache)
        mx.eval([c.state for c in cache])
    return toks.tolist()


def time_steps(step, steps):
    # Start every measured phase with an empty MLX buffer cache: buffers left
    # by prefill (other sizes) otherwise fill it to the limit, and each large
    # per-step temporary is then fresh memory, page-faulted in (both sides).
    mx.clear_cache()
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def decode_single(model, ctx, steps):
    ref = [KVCache() for _ in model.layers]
    prefill(model, ref, ctx)
    y = mx.array([[1]])
    t_ref = time_steps(lambda: mx.eval(model(y, cache=ref)), steps)

    pc = PagedCache.for_model(model, num_blocks=(ctx + 2 * steps + 64) // BLOCK + 8,
                              block_size=BLOCK)
    toks = np.random.default_rng(ctx).integers(0, 1000, ctx).tolist()
    pc.allocate("a", toks)
    prefill(model, pc.views(["a"]), ctx)

    def paged_step():
        pc.append("a", [1])
        mx.eval(model(y, cache=pc.views(["a"])))

    t_paged = time_steps(paged_step, steps)
    return t_ref, t_paged


def batch_kv_caches(model, lengths):
    """mlx-lm's BatchKVCache per layer, merged from one prefilled KVCache per row."""
    singles = []
    for n in lengths:
        c = [KVCache() for _ in model.layers]
        prefill(model, c, n)
        singles.append(c)
    return [BatchKVCache.merge([s[i] for s in singles]) for i in range(len(model.layers))]


def decode_batch(model, lengths, steps):
    B = len(lengths)
    batch = batch_kv_caches(model, lengths)
    y = mx.ones((B, 1), dtype=mx.int32)
    t_ref = time_steps(lambda: mx.eval(model(y, cache=batch)), steps)
    ref_bytes = sum(c.nbytes for c in batch)
    batch = None  # released before the paged cache is built (not del: the lambda reads it)

    need = sum(-(-(n + 4 * (steps + 8)) // BLOCK) for n in lengths) + B
    pc = PagedCache.for_model(model, num_blocks=need, block_size=BLOCK)
    ids = [f"s{i}" for i in range(B)]
    for sid, n in zip(ids, lengths):
        pc.allocate(sid, np.random.default_rng(n).integers(0, 1000, n).tolist())
        prefill(model, pc.views([sid]), n)

    def paged_step():
        for sid in ids:
            pc.append(sid, [1])
        mx.eval(model(y, cache=pc.views(ids)))

    t_paged = time_steps(paged_step, steps)

    def bucketed_step(groups):
        for sid in ids:
            pc.append(sid, [1])
        outs = [model(mx.ones((len(g), 1), dtype=mx.int32), cache=pc.views([ids[i] for i in g]))
                for g in groups]
        mx.eval(outs)

    t_buckets = {}
    for k in (2, 3):
        groups = length_buckets([pc.num_tokens(sid) for sid in ids], k)
        t_buckets[k] = time_steps(lambda: bucketed_step(groups), steps)
    return t_ref, t_paged, t_buckets, ref_bytes, pc.kv_bytes_in_use, pc.nbytes, pc


def gather_vs_copy(pc, ids, reps=30):
    """One layer's K+V gather for the batch vs a plain copy of the same bytes."""
    from cache.step_plan import plan_step

    pool = pc.pools()[0]  # the first attention layer's pool (full attention: group 0)
    tables = [pc.block_table(s, group=pc.group_of(0)) for s in ids]
    offs = [pc.num_computed(s) - 1 for s in ids]
    plan = plan_step(tables, offs, [1] * len(ids), 1, BLOCK, pc.num_blocks, None)
    rows = plan.gather_rows(pool.shape.n_kv_heads)
    k, v = pool.gather(rows, plan.batch, plan.length)
    mx.eval(k, v)
    t_g = time_steps(lambda: mx.eval(pool.gather(rows, plan.batch, plan.length)), reps)
    t_c = time_steps(lambda: mx.eval(k + 0, v + 0), reps)
    return t_g, t_c, 2 * k.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    mx.set_cache_limit(1 << 30)
    print(f"# {platform.machine()}, {mx.default_device()}, MLX {mx.__version__}, float32, "
          f"block_size={BLOCK}, tiny llama 4 layers hidden 256 (4 heads x 64)")
    model = tiny_llama()
    print("\n| decode step (B=1) | mlx-lm KVCache | paged views | ratio (target <= 1.25) |")
    print("|---|---|---|---|")
    for ctx in (1024, 4096):
        t_ref, t_paged = decode_single(model, ctx, a.steps)
        print(f"| {ctx} ctx | {t_ref * 1e3:.2f} ms | {t_paged * 1e3:.2f} ms "
              f"| {t_paged / t_ref:.2f} |")
    lengths = np.linspace(200, 4000, 8).astype(int).tolist()
    t_ref, t_paged, t_buckets, ref_bytes, held, pool_bytes, pc = decode_batch(model, lengths,
                                                                              a.steps)
    B = len(lengths)
    print(f"\n| batched decode, 8 seqs {lengths[0]}..{lengths[-1]} | mlx-lm BatchKVCache "
          "| paged views | ratio |")
    print("|---|---|---|---|")
    print(f"| tokens/s (target ratio >= 1.0) | {B / t_ref:.0f} | {B / t_paged:.0f} "
          f"| {t_ref / t_paged:.2f} |")
    for k, t in t_buckets.items():
        print(f"| tokens/s, paged in {k} length buckets ({k} forwards) | {B / t_ref:.0f} "
              f"| {B / t:.0f} | {t_ref / t:.2f} |")
    print(f"| KV bytes held (target <= 0.6) | {ref_bytes / 1e6:.1f} MB | {held / 1e6:.1f} MB "
          f"| {held / ref_bytes:.2f} |")
    print(f"| pool arrays allocated | | {pool_bytes / 1e6:.1f} MB | {pool_bytes / ref_bytes:.2f} |")
    t_g, t_c, nbytes = gather_vs_copy(pc, [f"s{i}" for i in range(B)])
    print(f"\n| gather, 1 layer K+V, 8 seqs ({nbytes / 1e6:.1f} MB) | time | GB/s |")
    print("|---|---|---|")
    print(f"| plain copy of the same bytes | {t_c * 1e3:.2f} ms | {nbytes / t_c / 1e9:.1f} |")
    print(f"| PagePool.gather | {t_g * 1e3:.2f} ms | {nbytes / t_g / 1e9:.1f} |")
    print(f"| gather / copy throughput | {t_c / t_g:.2f} | |")


if __name__ == "__main__":
    main()
