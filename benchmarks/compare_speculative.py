"""Speculative decoding: the Engine with and without a draft model, and mlx-lm's
`speculative_generate_step`, side by side.

Run (optimized BLAS, as recorded in BENCHMARKS.md):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/compare_speculative.py [--layers 8] [--tokens 48] [--rounds 2]

Target (`--model qwen3`): random-weight qwen3 with Qwen3-0.6B's layer sizes
(hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocabulary 151936,
tied embeddings), `--layers` of them; `--model lfm2`: a hybrid of hidden
1024 (conv layers, attention in the middle and at the end, vocabulary
65536). Draft: the same architecture and vocabulary with hidden 256 and 2
layers, whose embeddings are the target's projected to 256 dimensions (a
random near-isometry) plus noise: `--noise` levels set the agreement (the
acceptance rates are measured and printed, with the tokens a hybrid target
computed again after checkpoint restores). float32.

Measured per configuration: generated tokens per second at batch 1 and 8
(the Engine, prefill included), the acceptance rate, and at batch 1 mlx-lm's
`generate_step` (no draft) and `speculative_generate_step` on the same pair.
Rounds alternate the configurations; each figure is the median over rounds
(the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import lfm2, qwen3

from scheduler import Engine, SamplingParams

VOCAB = {"qwen3": 151936, "lfm2": 65536}


def qwen3_args(hidden: int, layers: int, heads: int, head_dim: int, mlp: int):
    return qwen3.ModelArgs(
        model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim,
        rms_norm_eps=1e-6, vocab_size=VOCAB["qwen3"], max_position_embeddings=40960,
        rope_theta=1_000_000.0, tie_word_embeddings=True,
    )


def lfm2_args(hidden: int, layers: int, heads: int, mlp: int):
    attention = {layers // 2 - 1, layers - 1} if layers >= 4 else {layers - 1}
    return lfm2.ModelArgs(
        model_type="lfm2", vocab_size=VOCAB["lfm2"], hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=40960, norm_eps=1e-5, conv_bias=True, conv_L_cache=3,
        block_dim=hidden, block_multiple_of=8, block_ffn_dim_multiplier=None,
        block_auto_adjust_ff_dim=False, block_ff_dim=mlp,
        layer_types=["full_attention" if i in attention else "conv" for i in range(layers)],
    )


def target_model(kind: str, layers: int):
    """Qwen3-0.6B's layer sizes (qwen3), or LFM2-350M's (lfm2: hidden 1024,
    MLP 3072 here, conv layers with attention at the middle and the end)."""
    mx.random.seed(0)
    if kind == "qwen3":
        model = qwen3.Model(qwen3_args(1024, layers, 16, 128, 3072))
    else:
        model = lfm2.Model(lfm2_args(1024, layers, 16, 3072))
    mx.eval(model.parameters())
    return model


def draft_model(kind: str, target, noise: float):
    """Hidden 256, 2 layers, the target's embeddings projected to 256 dims
    plus `noise` x their std of Gaussian noise."""
    mx.random.seed(1)
    if kind == "qwen3":
        model = qwen3.Model(qwen3_args(256, 2, 4, 64, 768))
    else:
        model = lfm2.Model(lfm2_args(256, 2, 4, 768))
    embed = target.model.embed_tokens.weight
    projection = mx.random.normal((embed.shape[1], 256)) / np.sqrt(256)
    projected = embed @ projection
    projected = projected + noise * mx.std(projected) * mx.random.normal(projected.shape)
    model.model.embed_tokens.weight = projected
    mx.eval(model.parameters())
    return model


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(batch)]


def engine_run(target, draft, batch: int, args) -> tuple[float, float | None, int]:
    """(generated tokens / s, acceptance rate, tokens recomputed after a
    checkpoint restore) of one Engine.generate."""
    engine = Engine(target, num_blocks=64 * batch, block_size=16, max_num_seqs=batch,
                    draft_model=draft, num_speculative_tokens=args.k,
                    enable_prefix_cache=False)
    params = SamplingParams(max_tokens=args.tokens)
    work = prompts(VOCAB[args.model], batch, args.prompt_len, seed=batch)
    t0 = time.perf_counter()
    outs = engine.generate(work, params)
    elapsed = time.perf_counter() - t0
    stats = engine.stats
    return sum(len(o.tokens) for o in outs) / elapsed, stats.acceptance_rate, \
        stats.num_recomputed_tokens


def mlx_lm_run(target, draft, args) -> tuple[float, float | None]:
    """(tokens / s, acceptance) of mlx-lm at batch 1: generate_step without a
    draft, speculative_generate_step with one."""
    prompt = mx.array(prompts(VOCAB[args.model], 1, args.prompt_len, seed=1)[0])
    t0 = time.perf_counter()
    if draft is None:
        steps = generate_step(prompt, target, max_tokens=args.tokens)
        tokens = [t for t, _ in steps]
        accepted = None
    else:
        steps = speculative_generate_step(prompt, target, draft, num_draft_tokens=args.k,
                                          max_tokens=args.tokens)
        flags = [from_draft for _, _, from_draft in steps]
        tokens, accepted = flags, sum(flags)
    elapsed = time.perf_counter() - t0
    rate = None
    if accepted is not None:
        rate = accepted / max(1, len(tokens) - accepted) / args.k  # per verification round
    return len(tokens) / elapsed, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(VOCAB), default="qwen3")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 3.0],
                        help="draft embedding noise levels (agreement high to low)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    target = target_model(args.model, args.layers)
    drafts = {noise: draft_model(args.model, target, noise) for noise in args.noise}
    configs = [("engine", b, None) for b in (1, 8)]
    configs += [("engine", b, n) for b in (1, 8) for n in args.noise]
    configs += [("mlx-lm", 1, None)]
    if args.model == "qwen3":  # mlx-lm refuses recurrent caches (not trimmable)
        configs += [("mlx-lm", 1, n) for n in args.noise]
    results: dict = {c: [] for c in configs}
    rates: dict = {}
    recomputed: dict = {}
    for _ in range(args.rounds):
        for config in configs:
            kind, batch, noise = config
            draft = None if noise is None else drafts[noise]
            if kind == "engine":
                tps, rate, recomputed[config] = engine_run(target, draft, batch, args)
            else:
                tps, rate = mlx_lm_run(target, draft, args)
            results[config].append(tps)
            rates[config] = rate
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__}, "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '-')}")
    print(f"target: {args.model} (hidden 1024) x {args.layers} layers; "
          "draft: hidden 256 x 2 layers; "
          f"k={args.k}, prompt {args.prompt_len}, {args.tokens} new tokens, "
          f"median of {args.rounds} rounds")
    print(f"{'runner':8} {'batch':>5} {'draft noise':>11} {'tok/s':>8} {'vs no draft':>11} "
          f"{'acceptance':>10} {'recomputed':>10}")
    for config in configs:
        kind, batch, noise = config
        tps = float(np.median(results[config]))
        base = float(np.median(results[(kind, batch, None)]))
        rate = rates[config]
        print(f"{kind:8} {batch:>5} {'-' if noise is None else noise:>11} {tps:>8.2f} "
              f"{tps / base:>10.2f}x {'-' if rate is None else f'{rate:.2f}':>10} "
              f"{recomputed.get(config, '-'):>10}")


if __name__ == "__main__":
    main()
