"""Every model module mlx-lm ships, built as a tiny random-weight model.

`architectures()` discovers the modules of `mlx_lm.models` that define a
``Model`` and ``ModelArgs`` (so a new mlx-lm release is covered without
editing this file). `build(name)` fills the module's ``ModelArgs`` (and any
nested text config) from one table of tiny generic values, fills the
remaining required fields from their type, then applies the few
per-architecture overrides in `OVERRIDES` that the defaults cannot build.
No download, no checkpoint: weights are random (seeded).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten

#: Vocabulary of every swept model.
VOCAB = 97
#: A swept model larger than this missed its size fields (sweep time guard).
MAX_PARAMS = 3_000_000
#: Sliding window of the swept sliding-window models: short, not a page multiple.
WINDOW = 12

#: Tiny values for the names mlx-lm's ModelArgs use most (unknown names are
#: dropped by ``ModelArgs.from_dict``).
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
    attention_bias=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True, routed_scaling_factor=1.0, first_k_dense_replace=1,
    n_routed_experts=4, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, layer_norm_epsilon=1e-5,
    layer_norm_eps=1e-5, norm_eps=1e-5, partial_rotary_factor=0.5, n_group=1, topk_group=1,
    use_bias=False, mlp_bias=False, num_layers=4, num_shared_experts=1,
    decoder_sparse_step=1, mlp_only_layers=[], use_qk_norm=False,
    n_embd=64, n_head=4, n_layer=4, n_positions=512, n_ctx=512, n_inner=64,
    num_heads=4, num_kv_heads=2, moe_topk=2, num_local_experts=4,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, shared_expert_intermediate_size=32,
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=64,
    state_size=8, ssm_state_size=8, time_step_rank=8, n_groups=1, conv_kernel=4,
    use_conv_bias=True, conv_bias=True, conv_L_cache=3, embedding_multiplier=1.0,
    attention_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
    dim_model_base=64, scale_depth=1.0, scale_emb=1.0, topk_method="noaux_tc",
    scoring_func="sigmoid", moe_layer_freq=1, ffn_hidden_size=64, expert_ffn_hidden_size=32,
    zero_expert_num=0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
    intermediate_size_mlp=64, model_max_length=512, time_step_limit=(0.0, float("inf")),
)

_SW = ["sliding_attention", "full_attention"] * 2
_YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}
_ROPE = {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
         "original_max_position_embeddings": 512}

#: Per-architecture values the generic table cannot build (patterns of
#: layer kinds, nested configs, rope dictionaries). Keep entries minimal.
OVERRIDES: dict[str, dict[str, Any]] = {
    "plamo2": dict(hidden_size_per_head=16, mamba_d_state=8, mamba_num_heads=4),
    "phixtral": dict(num_vocab=VOCAB, model_dim=64, rotary_dim=8),
    "olmo3": dict(sliding_window=WINDOW),
    "step3p5": dict(sliding_window=WINDOW, moe_num_experts=4, moe_top_k=2,
                    moe_intermediate_size=32, share_expert_dim=32),
    "plamo3": dict(sliding_window=WINDOW),
    "muse_glimmer": dict(sliding_window=WINDOW),
    "iquestloopcoder": dict(loop_window_size=WINDOW),
    "gpt_oss": dict(sliding_window=WINDOW),
    "cohere2": dict(sliding_window=WINDOW),
    "afm7": dict(num_layers=4, num_kv_reuse_layers=2, hidden_dim=64),
    "afmoe": dict(layer_types=_SW, sliding_window=WINDOW, num_dense_layers=1, head_dim=16),
    "baichuan_m1": dict(sliding_window=WINDOW, sliding_window_layers=[0, 2], conv_window=2),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "deepseek_v2": dict(rope_scaling=_YARN),
    # Window, compression (ratio 4: an open group of up to 3 rows), index
    # keys, top-k and candidate blocks all small enough to act in the checks.
    "deepseek_v41": dict(sliding_window=WINDOW, compress_ratios=[0, 4, 4, 4],
                         kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3],
                         candidate_source_layer_id=1, candidate_topk_blocks=2,
                         candidate_block_size=2, index_topk=3, index_n_heads=2,
                         index_head_dim=16, o_groups=2, o_lora_rank=16, hc_mult=2),
    "exaone4": dict(rope_scaling=None),
    "exaone_moe": dict(sliding_window=WINDOW, layer_types=_SW,
                       is_moe_layer=[False, True, False, True]),
    "gear": dict(layer_types=["conv_mixer", "sliding_attention", "conv_mixer", "full_attention"],
                 sliding_window=WINDOW),
    "gemma3": dict(sliding_window=WINDOW, sliding_window_pattern=2, head_dim=16,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=WINDOW, sliding_window_pattern=2,
                        query_pre_attn_scalar=16),
    "gemma3n": dict(num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                    sliding_window=WINDOW, layer_types=_SW, final_logit_softcapping=30.0,
                    activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=8,
                    altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
                    altup_active_idx=0, laurel_rank=8, rope_local_base_freq=10000.0),
    "gemma4": dict(sliding_window=WINDOW, sliding_window_pattern=2, num_kv_shared_layers=2,
                   global_head_dim=16, hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=VOCAB, layer_types=_SW),
    "gemma4_text": dict(sliding_window=WINDOW, sliding_window_pattern=2,
                        num_kv_shared_layers=2, global_head_dim=16,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                        layer_types=_SW),
    "glm_moe_dsa": dict(rope_parameters=_ROPE, index_head_dim=16, index_n_heads=2,
                        index_topk=8),
    "gptj": dict(rotary_dim=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_proj_bias=False,
                             mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True, shared_intermediate_size=32),
    "hunyuan": dict(rope_scaling={"type": "dynamic", "factor": 1.0, "alpha": 1.0}, use_cla=False,
                    cla_share_factor=2, num_shared_expert=1, use_mixed_mlp_moe=True),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2),
    "kimi_linear": dict(linear_attn_config={"kda_layers": [1, 3], "num_heads": 4,
                                            "head_dim": 16, "short_conv_kernel_size": 4}),
    "kimi_k3": dict(linear_attn_config={"kda_layers": [1, 3], "num_heads": 4, "head_dim": 16,
                                        "short_conv_kernel_size": 4},
                    hidden_act="situ", num_experts_per_token=2, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16),
    "lfm2": dict(block_dim=64, block_multiple_of=8, block_ffn_dim_multiplier=None,
                 block_auto_adjust_ff_dim=False, block_ff_dim=64,
                 layer_types=["conv", "full_attention", "conv", "conv"]),
    "lfm2-vl": dict(block_dim=64, block_multiple_of=8, block_ffn_dim_multiplier=None,
                    block_auto_adjust_ff_dim=False, block_ff_dim=64,
                    layer_types=["conv", "full_attention", "conv", "conv"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "conv"],
                     num_dense_layers=1),
    "llama4": dict(attention_chunk_size=16, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   no_rope_layers=[1, 1, 1, 0], rope_scaling=None),
    "llama4_text": dict(no_rope_layers=[1, 1, 1, 0]),
    "longcat_flash": dict(zero_expert_type="identity", attention_method="MLA"),
    "longcat_flash_ngram": dict(zero_expert_type="identity", attention_method="MLA"),
    "mamba2": dict(num_heads=8, head_dim=16, time_step_rank=8),
    "mellum": dict(sliding_window=WINDOW, layer_types=_SW,
                   rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                    "full_attention": {"rope_theta": 10000.0}}),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[0, 1, 0, 1], moe_layer_freq=[0, 1, 0, 1],
                          sliding_window_size=WINDOW, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=16,
                          swa_rope_theta=10000.0, layernorm_epsilon=1e-5,
                          partial_rotary_factor=0.5),
    "minicpm3": dict(rope_scaling={"original_max_position_embeddings": 512}),
    "minimax_m3_vl": dict(layer_types=None, mlp_layer_types=None, moe_layer_freq=None,
                          sparse_attention_freq=[0, 1, 0, 1], index_n_heads=2,
                          index_head_dim=16, index_block_size=4, index_topk_blocks=2,
                          dense_intermediate_size=64, shared_intermediate_size=32),
    "ministral3": dict(rope_parameters=_ROPE),
    "mistral4": dict(rope_parameters=_ROPE),
    "muse_spark": dict(post_norm_eps=1e-5, rope_parameters=_ROPE,
                       layer_rope_theta=[10000.0] * 4, layer_types=_SW,
                       sliding_window=WINDOW, final_logit_softcapping=30.0,
                       output_multiplier=1.0, moe_hidden_size=32, num_shared_experts=0),
    "nemotron-nas": dict(block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"no_op": True}},
    ]),
    "nemotron_h": dict(hybrid_override_pattern=["M", "*", "M", "-"], mamba_num_heads=8,
                       mamba_head_dim=16, mamba_proj_bias=False),
    "openelm": dict(num_transformer_layers=4, model_dim=64, ffn_dim_divisor=8,
                    num_query_heads=[4] * 4, num_kv_heads=[2] * 4, ffn_multipliers=[1.0] * 4),
    "plamo": dict(n_shared_head=2),
    "qwen": dict(kv_channels=16),
    "recurrent_gemma": dict(conv1d_width=4, logits_soft_cap=30.0, attention_window_size=WINDOW,
                            block_types=["recurrent", "attention"]),
    "spark2_5": dict(sliding_window=WINDOW, layer_types=_SW,
                     rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                      "full_attention": {"rope_theta": 10000.0}}),
}


@functools.lru_cache(maxsize=1)
def architectures() -> tuple[str, ...]:
    """Every module of ``mlx_lm.models`` that has a ``Model`` and ``ModelArgs``
    (defined or re-exported). A module that fails to import is listed when
    its source names both (it then fails to build, with the reason)."""
    names = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            mod = module(info.name)
        except Exception:
            source = _module_source(info.name)
            if re.search(r"\bModel\b", source) and re.search(r"\bModelArgs\b", source):
                names.append(info.name)
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            names.append(info.name)
    return tuple(sorted(names))


def _module_source(name: str) -> str:
    path = f"{mlx_lm.models.__path__[0]}/{name}.py"
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


#: Packages a module imports only to check they are installed (nothing of
#: them is used by the model code): an empty stand-in lets it build.
PROBED_PACKAGES = {"olmo": "hf_olmo"}


def module(name: str) -> ModuleType:
    """The mlx-lm module `name` (raises what its import raises; some modules
    exit the interpreter when an optional package is missing)."""
    probed = PROBED_PACKAGES.get(name)
    if probed is not None and probed not in sys.modules \
            and importlib.util.find_spec(probed) is None:
        sys.modules.setdefault(probed, ModuleType(probed))
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except SystemExit as e:
        raise ImportError(f"mlx_lm.models.{name} exits on import ({e})") from None


def config(name: str) -> dict[str, Any]:
    """The tiny config of `name`: generic values, type-filled required fields
    of every args class in the module, the architecture's overrides."""
    mod = module(name)
    cfg = dict(GENERIC, model_type=name)
    for cls in _args_classes(mod):
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in cfg and f.name != "text_config":
                cfg[f.name] = _by_type(f.type)
    cfg.update(OVERRIDES.get(name, {}))
    if "text_config" in inspect.signature(mod.ModelArgs).parameters:
        cfg["text_config"] = dict(cfg)
    return cfg


def _args_classes(mod: ModuleType) -> list[type]:
    from mlx_lm.models.base import BaseModelArgs

    return [c for c in vars(mod).values()
            if isinstance(c, type) and issubclass(c, BaseModelArgs) and c is not BaseModelArgs
            and c.__module__ == mod.__name__ and dataclasses.is_dataclass(c)]


def _by_type(annotation: Any) -> Any:
    """A small value of a scalar type; None for containers (an override must
    give them, else the build fails loudly instead of building no layers)."""
    text = str(annotation)
    if any(c in text for c in ("List", "list", "Dict", "dict", "Tuple", "tuple")):
        return None
    if "bool" in text:
        return False
    if "int" in text:
        return 4
    if "float" in text:
        return 1.0
    if "str" in text:
        return ""
    return None


def build(name: str, dtype: mx.Dtype = mx.float32):
    """A fresh tiny random-weight model of architecture `name` (seeded)."""
    mod = module(name)
    args = mod.ModelArgs.from_dict(config(name))
    mx.random.seed(sum(map(ord, name)))
    model = mod.Model(args)
    model.set_dtype(dtype)
    num_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    if num_params > MAX_PARAMS:
        raise ValueError(f"{name}: {num_params} parameters, not tiny: the generic config "
                         "missed its size fields; add them to OVERRIDES")
    mx.eval(model.parameters())
    return model
