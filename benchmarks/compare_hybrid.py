"""Hybrid decode step on PagedCache vs mlx-lm's own caches, side by side.

Run: python benchmarks/compare_hybrid.py [--steps 20] [--rounds 5]

Tiny random-weight LFM2 and Qwen3-Next (float32): the test-sized models
(hidden 32, 4 layers) and a larger "small" layout (hidden 256, 8 layers, 2 of
them attention). Context 1024 tokens, batch 1. The mlx-lm side runs on
`model.make_cache()` (KVCache + ArraysCache); the paged side on
`PagedCache.for_model(model, num_slots=...)` views (paged KV + recurrent
slots), including the per-step `append` and `views` calls an engine makes.
Rounds alternate between the two sides; each side's figure is the median of
its per-round means (the machine is shared).
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import lfm2, qwen3_next

from cache import PagedCache

BLOCK = 16
VOCAB = 1000


def lfm2_model(hidden: int, layers: int):
    attn = {layers // 2 - 1, layers - 1}
    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        norm_eps=1e-5, conv_bias=True, conv_L_cache=3, block_dim=hidden,
        block_multiple_of=8, block_ffn_dim_multiplier=None, block_auto_adjust_ff_dim=False,
        block_ff_dim=2 * hidden,
        layer_types=["full_attention" if i in attn else "conv" for i in range(layers)],
    )
    return lfm2.Model(args)


def qwen3_next_model(hidden: int, layers: int):
    heads = max(2, hidden // 64)
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=2 * heads,
        linear_num_value_heads=2 * heads, linear_num_key_heads=heads,
        linear_key_head_dim=hidden // heads // 2 * 2 if hidden >= 128 else 8,
        linear_value_head_dim=hidden // heads // 2 * 2 if hidden >= 128 else 8,
        linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
        decoder_sparse_step=1, shared_expert_intermediate_size=2 * hidden, mlp_only_layers=[],
        moe_intermediate_size=hidden, rms_norm_eps=1e-6, vocab_size=VOCAB,
        num_key_value_heads=heads, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=8192, head_dim=hidden // heads if hidden >= 128 else 8,
        full_attention_interval=4,
    )
    return qwen3_next.Model(args)


MODELS = {
    "LFM2 tiny (hidden 32, 3 conv + 1 attn)": lambda: lfm2_model(32, 4),
    "LFM2 small (hidden 256, 6 conv + 2 attn)": lambda: lfm2_model(256, 8),
    "Qwen3-Next tiny (hidden 32, 3 delta + 1 attn)": lambda: qwen3_next_model(32, 4),
    "Qwen3-Next small (hidden 256, 6 delta + 2 attn)": lambda: qwen3_next_model(256, 8),
}


def prefill(model, cache, toks, chunk=512):
    for i in range(0, len(toks), chunk):
        logits = model(mx.array([toks[i : i + chunk]]), cache=cache)
        mx.eval(logits)


def mean_step(step, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def compare(model, ctx, steps, rounds):
    toks = np.random.default_rng(ctx).integers(0, VOCAB, ctx).tolist()
    y = mx.array([[1]])

    ref = model.make_cache()
    prefill(model, ref, toks)

    pc = PagedCache.for_model(model, num_blocks=(ctx + (rounds + 1) * (steps + 3)) // BLOCK + 8,
                              block_size=BLOCK, num_slots=4)
    pc.allocate("a", toks)
    prefill(model, pc.views(["a"]), toks)

    def ref_step():
        mx.eval(model(y, cache=ref))

    def paged_step():
        pc.append("a", [1])
        mx.eval(model(y, cache=pc.views(["a"])))

    t_ref, t_paged = [], []
    for _ in range(rounds):
        for _ in range(3):
            ref_step()
        t_ref.append(mean_step(ref_step, steps))
        for _ in range(3):
            paged_step()
        t_paged.append(mean_step(paged_step, steps))
    return float(np.median(t_ref)), float(np.median(t_paged))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=1024)
    a = ap.parse_args()
    mx.set_cache_limit(1 << 30)
    print(f"# {platform.machine()}, {mx.default_device()}, MLX {mx.__version__}, float32, "
          f"block_size={BLOCK}, batch 1, {a.ctx} tokens of context")
    print("\n| hybrid decode step | mlx-lm caches | PagedCache | ratio (target <= 1.25) |")
    print("|---|---|---|---|")
    for name, build in MODELS.items():
        mx.random.seed(0)
        model = build()
        mx.eval(model.parameters())
        t_ref, t_paged = compare(model, a.ctx, a.steps, a.rounds)
        print(f"| {name} | {t_ref * 1e3:.2f} ms | {t_paged * 1e3:.2f} ms "
              f"| {t_paged / t_ref:.2f} |", flush=True)


if __name__ == "__main__":
    main()
