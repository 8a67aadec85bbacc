"""What the architecture sweep expects of each architecture, and why.

Three kinds of exception to "passes every check", each with its reason:

* `UNBUILDABLE`: the architecture cannot run on this machine at all (a
  Metal-only kernel, a missing optional package, a checkpoint-only format,
  a crash inside mlx-lm on its own caches). Skipped.
* `MLX_LM_LIMITS`: checks where mlx-lm's own model code computes a batch
  wrong (its own batching is equally wrong). Expected failures, strict: a
  check that starts passing fails the sweep until the entry is removed. The
  `Engine` check still runs: `scheduler.engine.batch_probe` detects these models
  and runs their rows one by one.
* `PROJECT_GAPS` and `PROJECT_CHECK_GAPS`: open gaps of this project, named
  as such (whole architectures, or single checks of one, not supported
  yet). Strict as well.
"""

from __future__ import annotations

_METAL = "mlx-lm's {} runs {} as a Metal kernel, which the CPU backend lacks"
UNBUILDABLE: dict[str, str] = {
    "bitnet": _METAL.format("bitnet", "its BitLinear layers"),
    "muse_spark": _METAL.format("muse_spark", "its fused qk-norm + RoPE"),
    "olmo": "mlx-lm's olmo adds the mask create_attention_mask returns for a prompt (the string "
            "'causal') to its scores, so every forward of more than one token raises, on mlx-lm's "
            "own caches too",
    "prism_hadamard_qwen35": "mlx-lm builds prism_hadamard_qwen35 only from a 2-bit Hadamard-pack "
                             "checkpoint (its ModelArgs refuse any other config)",
    "phi3small": "mlx-lm's phi3small block-sparse attention (layer 0 always has it) kills "
                 "the process on MLX CPU (segfault / double free) on mlx-lm's own caches, and "
                 "where it runs gives a prompt's prefix other logits than the whole prompt",
}

_SSM_PADDING = ("mlx-lm's {} lets a row's right padding into its recurrent state ({}), so a "
                "ragged batched prefill leaves shorter rows' state wrong; mlx-lm's own batching "
                "is equally wrong")
_GEMMA2 = ("mlx-lm's gemma2 adds a 4-D mask to 5-D grouped-query scores: rows mix with "
           "heads (wrong with 2 rows, a broadcast error with 3)")
_BIGCODE = ("mlx-lm's gpt_bigcode builds positions from cache.offset as one Python int, "
            "which a batch of rows at different offsets does not have")
_AFM7 = ("mlx-lm's afm7 KV-reuse layers rotate queries at (history length - new tokens), "
         "the position of the longest row only")

_LLAMA4 = ("mlx-lm's llama4 builds its chunk mask from one sequence's offset "
           "(mx.arange over cache.offset), so rows at different offsets cannot share a forward")

_MINIMAX = ("mlx-lm's minimax_m3_vl sparse layers place queries at (history width - new "
            "tokens) and cut key blocks over the history's slots, one width for all rows: "
            "a shorter row selects other key blocks (mlx-lm's own left-padded batch too, "
            "unless the padding is a multiple of the block size)")

_DEEPSEEK_V41 = ("mlx-lm's deepseek_v41 takes one start position (cache[0].offset as an int) "
                 "and one window width for the whole batch and masks no padding; its "
                 "LayerCache has no batched form in mlx-lm (no merge: 'does not yet support "
                 "batching')")

MLX_LM_LIMITS: dict[tuple[str, str], str] = {
    ("deepseek_v41", "batched_decode"): _DEEPSEEK_V41,
    ("deepseek_v41", "ragged_prefill"): _DEEPSEEK_V41,
    ("minimax_m3_vl", "batched_decode"): _MINIMAX,
    ("minimax_m3_vl", "ragged_prefill"): _MINIMAX,
    ("llama4", "batched_decode"): _LLAMA4,
    ("llama4", "ragged_prefill"): _LLAMA4,
    ("gemma2", "batched_decode"): _GEMMA2,
    ("gemma2", "ragged_prefill"): _GEMMA2,
    ("gpt_bigcode", "batched_decode"): _BIGCODE,
    ("gpt_bigcode", "ragged_prefill"): _BIGCODE,
    ("afm7", "batched_decode"): _AFM7,
    ("afm7", "ragged_prefill"): _AFM7,
    ("jamba", "ragged_prefill"): _SSM_PADDING.format("jamba", "its Mamba mixer takes no mask"),
    ("mamba", "ragged_prefill"): _SSM_PADDING.format(
        "mamba", "no mask at all: conv tail and state are taken at the padded end"),
    ("nemotron_h", "ragged_prefill"): _SSM_PADDING.format(
        "nemotron_h", "ssm_update is called without the rows' lengths"),
    ("olmo_hybrid", "ragged_prefill"): _SSM_PADDING.format(
        "olmo_hybrid", "its short-conv tails are taken at the padded end"),
    ("bailing_moe_linear", "ragged_prefill"): _SSM_PADDING.format(
        "bailing_moe_linear", "its recurrent_gla update takes no mask"),
}

#: Open project gaps on whole architectures (every check fails the same way).
PROJECT_GAPS: dict[str, str] = {
}


#: Open project gaps on single checks of an architecture.
PROJECT_CHECK_GAPS: dict[tuple[str, str], str] = {}


def expected_failure(name: str, check: str, model) -> str | None:
    """The listed reason `check` fails on architecture `name`, or None."""
    if name in PROJECT_GAPS:
        return PROJECT_GAPS[name]
    return PROJECT_CHECK_GAPS.get((name, check)) or MLX_LM_LIMITS.get((name, check))
