"""Tiny random-weight models whose head sizes a kv group size divides, and
the references quantized pages are compared with.

`tests.tiny_models` keeps head sizes of 8 and 16, below mlx's smallest
quantization group (32); these are the same architectures at head size 32
(64 for qwen3). References, both independent of `cache/`:

* `quantized_caches`: mlx-lm's own ``QuantizedKVCache`` from the first token
  for every full-attention layer, and for a sliding-window layer (mlx-lm
  cannot quantize a ``RotatingKVCache``) a ``QuantizedKVCache`` that keeps
  every key and masks the window (`WindowedQuantizedKVCache`): mlx-lm's own
  quantized attention with mlx-lm's own window mask. Keys and values share
  the bits there, as mlx-lm allows nothing else.
* `fake_quant_caches`: mlx-lm's ``KVCache`` / ``RotatingKVCache`` fed rows
  quantized and dequantized as they arrive (dequantize-then-attend with
  mlx's fused kernel): the reference for separate key and value bits and
  for attention sinks, which mlx-lm's quantized attention refuses.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text, gpt_oss, lfm2, llama, qwen3, qwen3_next
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from cache import KVFormat

VOCAB = 101
HYBRID = ("lfm2", "qwen3_next")


def _llama(**extra):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        **extra)
    mx.random.seed(21)
    return llama.Model(args)


def _sliding():
    """llama with a sliding layer (window 20, not a page multiple)."""
    return _llama(layer_types=["sliding_attention", "full_attention"], sliding_window=20)


def _qwen3():
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=1024, rope_theta=10000.0, head_dim=64,
        tie_word_embeddings=True)
    mx.random.seed(22)
    return qwen3.Model(args)


def _gemma3():
    """gemma3 text: sliding layers (window 16) and full layers."""
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, head_dim=32, num_key_value_heads=2, vocab_size=VOCAB,
        query_pre_attn_scalar=32, sliding_window=16, sliding_window_pattern=2,
        max_position_embeddings=1024)
    mx.random.seed(23)
    return gemma3_text.Model(args)


def _gpt_oss():
    """gpt-oss: sliding (window 12) and full layers with attention sinks."""
    args = gpt_oss.ModelArgs(
        model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, head_dim=32,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"])
    mx.random.seed(24)
    return gpt_oss.Model(args)


def _lfm2():
    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        norm_eps=1e-5, conv_bias=True, conv_L_cache=3, block_dim=128,
        block_multiple_of=8, block_ffn_dim_multiplier=None,
        block_auto_adjust_ff_dim=False, block_ff_dim=96,
        layer_types=["conv", "full_attention", "conv", "conv"])
    mx.random.seed(25)
    return lfm2.Model(args)


def _qwen3_next():
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1,
        shared_expert_intermediate_size=48, mlp_only_layers=[], moe_intermediate_size=32,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=256, head_dim=32,
        full_attention_interval=4)
    mx.random.seed(26)
    return qwen3_next.Model(args)


BUILDERS = {"llama": _llama, "sliding": _sliding, "qwen3": _qwen3, "gemma3": _gemma3,
            "gpt_oss": _gpt_oss, "lfm2": _lfm2, "qwen3_next": _qwen3_next}
#: The group size each model's head sizes allow at the least (qwen3: 64).
GROUP = {"qwen3": 64}
_built: dict[str, object] = {}


def built(name: str):
    """The model `name`, built and evaluated once per session."""
    if name not in _built:
        model = BUILDERS[name]()
        mx.eval(model.parameters())
        _built[name] = model
    return _built[name]


def group_size(name: str) -> int:
    return GROUP.get(name, 32)


def num_slots(name: str) -> int:
    return 8 if name in HYBRID else 0


class WindowedQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` keeping every key, with a sliding-window
    mask of `window` keys (the window ``RotatingKVCache(max_size=window)``
    gives): the quantized reference for sliding layers."""

    def __init__(self, group_size: int, bits: int, window: int) -> None:
        super().__init__(group_size=group_size, bits=bits)
        self.window = window

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=min(window_size or self.window, self.window))


def quantized_caches(model, bits: int, group: int) -> list:
    """The model's caches (`make_prompt_cache`) with every attention cache replaced by
    mlx-lm's ``QuantizedKVCache`` (windowed for ``RotatingKVCache``)."""
    out = []
    for cache in make_prompt_cache(model):
        if isinstance(cache, RotatingKVCache):
            out.append(WindowedQuantizedKVCache(group, bits, cache.max_size))
        elif isinstance(cache, KVCache):
            out.append(QuantizedKVCache(group_size=group, bits=bits))
        else:
            assert isinstance(cache, ArraysCache), cache
            out.append(cache)
    return out


def fake_quant(x: mx.array, bits: int | None, group: int) -> mx.array:
    """Rows as quantized pages store them (identity for bits None)."""
    if bits is None:
        return x
    return mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group,
                         bits=bits)


class _FakeQuant:
    def __init__(self, fmt: KVFormat) -> None:
        self.fmt = fmt

    def update_and_fetch(self, keys, values):
        f = self.fmt
        return super().update_and_fetch(fake_quant(keys, f.key_bits, f.group_size),
                                        fake_quant(values, f.value_bits, f.group_size))


class FakeQuantKVCache(_FakeQuant, KVCache):
    def __init__(self, fmt: KVFormat) -> None:
        KVCache.__init__(self)
        _FakeQuant.__init__(self, fmt)


class FakeQuantRotatingKVCache(_FakeQuant, RotatingKVCache):
    def __init__(self, fmt: KVFormat, max_size: int) -> None:
        RotatingKVCache.__init__(self, max_size=max_size)
        _FakeQuant.__init__(self, fmt)


def fake_quant_caches(model, fmt: KVFormat) -> list:
    """The model's caches (`make_prompt_cache`) with attention caches fed fake-quantized rows."""
    out = []
    for cache in make_prompt_cache(model):
        if isinstance(cache, RotatingKVCache):
            out.append(FakeQuantRotatingKVCache(fmt, cache.max_size))
        elif isinstance(cache, KVCache):
            out.append(FakeQuantKVCache(fmt))
        else:
            assert isinstance(cache, ArraysCache), cache
            out.append(cache)
    return out


def reference_caches(model, fmt: KVFormat, name: str) -> list:
    """mlx-lm's ``QuantizedKVCache`` where mlx-lm can quantize (same bits for
    keys and values, no sinks), else the fake-quantized caches."""
    if fmt.key_bits == fmt.value_bits and name != "gpt_oss":
        return quantized_caches(model, fmt.key_bits, fmt.group_size)
    return fake_quant_caches(model, fmt)


def run_chunks(model, caches, chunks: list[list[int]]) -> mx.array:
    """Logits ``[sum(len), vocab]`` of `chunks` fed one forward each."""
    return mx.concatenate([model(mx.array([c]), cache=caches)[0] for c in chunks])
