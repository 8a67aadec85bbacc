"""Measure candidate page layouts and gather methods for the KV page pool.

Run: python benchmarks/cache_layouts.py

For each layout, one decode-attention step of one layer is timed: gather a
sequence's pages (K and V) into the `[B, H, T, D]` arrays that
`mx.fast.scaled_dot_product_attention` wants, then run SDPA for one query per
sequence. Reference rows: SDPA on an already contiguous history (what a
contiguous per-sequence cache costs) and a plain copy of the same bytes (the
memory-bandwidth limit of any gather). The numbers feed design/cache.md.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

H, D, N_Q_HEADS, BS = 4, 64, 4, 16


def timeit(fn, reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t0) / reps


def page_ids(rng, num_blocks, lengths):
    """Random (non-contiguous) pages per sequence, padded to the longest."""
    pmax = max(-(-n // BS) for n in lengths)
    perm = rng.permutation(num_blocks)[: pmax * len(lengths)]
    return perm.reshape(len(lengths), pmax)


def layouts(num_blocks, pages):
    """(name, pool-builder, gather(pool, pages) -> [B, H, T, D]) per candidate."""
    B, P = pages.shape
    T = P * BS
    pg = mx.array(pages.reshape(-1))
    heads = np.arange(H)[None, :, None]
    rows_hm = mx.array((heads * num_blocks + pages[:, None, :]).reshape(-1))
    slots = pages[:, :, None] * BS + np.arange(BS)[None, None, :]  # [B, P, BS]
    tok = mx.array(slots.reshape(-1))
    tok_hm = mx.array((heads[..., None] * num_blocks * BS + slots[:, None]).reshape(-1))

    def g_block_token_view(p):  # [NB, BS, H, D], transposed view (no copy)
        return mx.take(p, pg, axis=0).reshape(B, T, H, D).transpose(0, 2, 1, 3)

    def g_block_token_copy(p):
        return mx.contiguous(g_block_token_view(p))

    def g_block_head(p):  # [NB, H, BS, D]
        x = mx.take(p, pg, axis=0).reshape(B, P, H, BS, D)
        return mx.contiguous(x.transpose(0, 2, 1, 3, 4)).reshape(B, H, T, D)

    def g_flat_token_view(p):  # [NB*BS, H, D]
        return mx.take(p, tok, axis=0).reshape(B, T, H, D).transpose(0, 2, 1, 3)

    def g_head_major_pages(p):  # [H*NB, BS, D]
        return mx.take(p, rows_hm, axis=0).reshape(B, H, T, D)

    def g_head_major_tokens(p):  # [H*NB*BS, D]
        return mx.take(p, tok_hm, axis=0).reshape(B, H, T, D)

    def g_head_outer_axis1(p):  # [H, NB, BS, D], take on axis 1
        x = mx.take(p, pg, axis=1).reshape(H, B, T, D)
        return mx.contiguous(x.transpose(1, 0, 2, 3))

    return [
        ("block-major [NB,bs,H,D], take pages, transposed view",
         (num_blocks, BS, H, D), g_block_token_view),
        ("block-major [NB,bs,H,D], take pages + contiguous",
         (num_blocks, BS, H, D), g_block_token_copy),
        ("block-head [NB,H,bs,D], take pages + contiguous",
         (num_blocks, H, BS, D), g_block_head),
        ("flat token-major [NB*bs,H,D], take slots, view",
         (num_blocks * BS, H, D), g_flat_token_view),
        ("head-major [H*NB,bs,D], take (head,page) rows",
         (H * num_blocks, BS, D), g_head_major_pages),
        ("head-major [H*NB*bs,D], take (head,slot) rows",
         (H * num_blocks * BS, D), g_head_major_tokens),
        ("head-outer [H,NB,bs,D], take axis 1 + contiguous",
         (H, num_blocks, BS, D), g_head_outer_axis1),
    ]


def run(lengths, reps, num_blocks=2048):
    rng = np.random.default_rng(0)
    pages = page_ids(rng, num_blocks, lengths)
    B, P = pages.shape
    T = P * BS
    q = mx.random.normal((B, N_Q_HEADS, 1, D))
    mask = None
    if len(set(lengths)) > 1:
        mask = mx.array(np.arange(T)[None, :] < np.array(lengths)[:, None])[:, None, None, :]
    scale = D**-0.5

    def sdpa(k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    kc = mx.random.normal((B, H, T, D))
    vc = mx.random.normal((B, H, T, D))
    mx.eval(q, kc, vc)
    nbytes = 2 * B * H * T * D * 4
    t_copy = timeit(lambda: (kc + 0, vc + 0), reps)
    t_ref = timeit(lambda: sdpa(kc, vc), reps)
    print(f"\nB={B} lengths={lengths if B <= 8 else '...'} T(padded)={T} "
          f"gathered K+V={nbytes / 1e6:.1f} MB")
    print(f"{'layout / gather':58s} {'gather':>9s} {'gather+sdpa':>12s} {'vs contig':>9s}")
    print(f"{'plain copy of the same bytes (limit)':58s} {t_copy * 1e3:8.3f}ms")
    print(f"{'SDPA on contiguous history (reference)':58s} {'':9s} {t_ref * 1e3:11.3f}ms "
          f"{1.0:9.2f}")
    for name, shape, gather in layouts(num_blocks, pages):
        kp = mx.random.normal(shape)
        vp = mx.random.normal(shape)
        mx.eval(kp, vp)
        t_g = timeit(lambda: (mx.contiguous(gather(kp)), mx.contiguous(gather(vp)))
                     if "view" not in name else (gather(kp) + 0, gather(vp) + 0), reps)
        t_gs = timeit(lambda: sdpa(gather(kp), gather(vp)), reps)
        print(f"{name:58s} {t_g * 1e3:8.3f}ms {t_gs * 1e3:11.3f}ms {t_gs / t_ref:9.2f}")
        kp = vp = None  # released before the next layout allocates (not del: the lambdas read them)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cache-limit-mb", type=int, default=1024,
                    help="MLX buffer-cache limit; the CPU default (32 MB here) makes every "
                         "larger temporary a fresh mmap with page faults")
    a = ap.parse_args()
    mx.set_cache_limit(a.cache_limit_mb * 2**20)
    print(f"MLX {mx.__version__}, device {mx.default_device()}, float32, "
          f"H={H} kv heads, D={D}, block_size={BS}, cache limit {a.cache_limit_mb} MB")
    run([1024], a.reps)
    run([4096], a.reps)
    run(list(np.linspace(200, 4000, 8).astype(int)), a.reps)


if __name__ == "__main__":
    main()
