"""Tiny random-weight mlx-lm models built from their ModelArgs (no download).

Shared by the model-level tests. Each builder seeds MLX's generator, so a
model is the same on every build; `built(name)` builds each one once per
test session.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import (
    cohere2,
    gemma3_text,
    gpt_oss,
    lfm2,
    llama,
    qwen3,
    qwen3_next,
    recurrent_gemma,
)

#: Vocabulary of the attention-only models (llama, qwen3, sliding).
ATTENTION_VOCAB = 101
#: Vocabulary of the hybrid models (lfm2, qwen3_next).
HYBRID_VOCAB = 61


def tiny_llama(**extra):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=ATTENTION_VOCAB, **extra,
    )
    mx.random.seed(1)
    return llama.Model(args)


def tiny_qwen3():
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        vocab_size=ATTENTION_VOCAB, max_position_embeddings=1024, rope_theta=10000.0,
        head_dim=16, tie_word_embeddings=True,
    )
    mx.random.seed(2)
    return qwen3.Model(args)


def tiny_sliding():
    """llama with a RotatingKVCache layer (window 20, not a page multiple)."""
    return tiny_llama(layer_types=["sliding_attention", "full_attention"], sliding_window=20)


def tiny_lfm2():
    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=HYBRID_VOCAB, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        norm_eps=1e-5, conv_bias=True, conv_L_cache=3, block_dim=32,
        block_multiple_of=8, block_ffn_dim_multiplier=None,
        block_auto_adjust_ff_dim=False, block_ff_dim=48,
        layer_types=["conv", "full_attention", "conv", "conv"],
    )
    mx.random.seed(7)
    return lfm2.Model(args)


def tiny_qwen3_next():
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=32, num_hidden_layers=4, intermediate_size=48,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1,
        shared_expert_intermediate_size=48, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=HYBRID_VOCAB, num_key_value_heads=2, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=256, head_dim=8,
        full_attention_interval=4,
    )
    mx.random.seed(8)
    return qwen3_next.Model(args)


def tiny_gemma3():
    """gemma3 text: 5 sliding layers (window 16) per full layer, 2 of each kind here."""
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=ATTENTION_VOCAB,
        query_pre_attn_scalar=16, sliding_window=16, sliding_window_pattern=2,
        max_position_embeddings=1024,
    )
    mx.random.seed(11)
    return gemma3_text.Model(args)


def tiny_gpt_oss():
    """gpt-oss: alternating sliding (window 12) and full layers, attention sinks, MoE."""
    args = gpt_oss.ModelArgs(
        model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=ATTENTION_VOCAB, hidden_size=64, intermediate_size=64, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
    )
    mx.random.seed(12)
    return gpt_oss.Model(args)


def tiny_cohere2():
    """cohere2: 3 sliding layers (window 20) per full layer."""
    args = cohere2.ModelArgs(
        model_type="cohere2", hidden_size=64, head_dim=16, num_hidden_layers=4,
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=ATTENTION_VOCAB, sliding_window=20, sliding_window_pattern=4,
    )
    mx.random.seed(13)
    return cohere2.Model(args)


def tiny_recurrent_gemma():
    """recurrent_gemma: recurrent (RG-LRU) layers and sliding attention (window 16)."""
    args = recurrent_gemma.ModelArgs(
        model_type="recurrent_gemma", attention_bias=False, conv1d_width=4, hidden_size=64,
        intermediate_size=96, logits_soft_cap=30.0, num_attention_heads=4,
        num_hidden_layers=3, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
        attention_window_size=16, vocab_size=HYBRID_VOCAB,
        block_types=["recurrent", "attention", "recurrent"],
    )
    mx.random.seed(14)
    return recurrent_gemma.Model(args)


ATTENTION_MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "sliding": tiny_sliding}
HYBRID_MODELS = {"lfm2": tiny_lfm2, "qwen3_next": tiny_qwen3_next}
#: Models with sliding-window layers (name -> (builder, vocabulary)).
SLIDING_MODELS = {
    "gemma3": (tiny_gemma3, ATTENTION_VOCAB),
    "gpt_oss": (tiny_gpt_oss, ATTENTION_VOCAB),
    "cohere2": (tiny_cohere2, ATTENTION_VOCAB),
    "recurrent_gemma": (tiny_recurrent_gemma, HYBRID_VOCAB),
}
_BUILDERS = {
    **ATTENTION_MODELS, **HYBRID_MODELS, **{k: b for k, (b, _) in SLIDING_MODELS.items()}
}
_built: dict[str, object] = {}


def built(name: str):
    """The model `name`, built and evaluated once per session."""
    if name not in _built:
        model = _BUILDERS[name]()
        mx.eval(model.parameters())
        _built[name] = model
    return _built[name]
