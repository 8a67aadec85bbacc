"""Models for calibration and real replay: a local mlx-lm model directory,
or an architecture preset with random weights (no download).

Presets carry the layer shapes of published checkpoints (`config.json`
values); `layers` cuts the depth, so a profile of a realistic layer shape
runs in minutes on a CPU. Random weights cost exactly what trained ones do.
Imports MLX (lazily, inside the functions), unlike the rest of the package.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from scheduler.simulator.layout import ModelLayout

#: Published configs (the fields mlx-lm's ModelArgs need).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Qwen3-0.6B's layer shape, every other layer a 512-token sliding window
    # (the layout of Gemma-style models), through mlx-lm's llama layers.
    "qwen3-0.6b-sliding": dict(
        model_type="llama", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=True, sliding_window=512,
        layer_types=["sliding_attention", "full_attention"] * 14,
    ),
    "lfm2-350m": dict(
        model_type="lfm2", vocab_size=65536, hidden_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128000,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=1024,
        block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        block_ff_dim=6656, rope_theta=1000000.0,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention",
                     "conv", "conv", "full_attention", "conv", "full_attention", "conv",
                     "full_attention", "conv", "full_attention", "conv"],
    ),
}


class ModelSpecError(ValueError):
    """A model cannot be built from the given description."""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """`path`: an mlx-lm model directory; else `preset` with overrides.

    layers: keep this many layers (None: all); a preset's `layer_types` is
    cut to match.
    shape: config fields that replace the preset's (e.g. a smaller
        `hidden_size` for tests).
    """

    path: str | None = None
    preset: str | None = None
    layers: int | None = None
    seed: int = 0
    shape: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict:
        out: dict[str, Any] = {"path": self.path} if self.path else {"preset": self.preset}
        if self.layers is not None:
            out["layers"] = self.layers
        if self.shape:
            out["shape"] = dict(self.shape)
        return out


def preset_config(spec: ModelSpec) -> dict[str, Any]:
    """The config dict a preset spec builds (layers cut)."""
    if spec.preset not in PRESETS:
        raise ModelSpecError(f"unknown model preset {spec.preset!r} (one of {', '.join(PRESETS)})")
    config = {**PRESETS[spec.preset], **spec.shape}
    if spec.layers is not None:
        if spec.layers < 1:
            raise ModelSpecError(f"layers must be >= 1, got {spec.layers}")
        config["num_hidden_layers"] = spec.layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][: spec.layers]
    return config


def load_model(spec: ModelSpec) -> tuple[Any, dict]:
    """(model, description with its config and parameter count)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if spec.path is not None:
        if spec.shape or spec.layers is not None:
            raise ModelSpecError("--shape and --layers apply to presets, not to a model directory")
        if not Path(spec.path).is_dir():
            raise ModelSpecError(f"model directory not found: {spec.path}")
        from mlx_lm import load

        model = load(spec.path)[0]
        config = json.loads((Path(spec.path) / "config.json").read_text())
    else:
        config = preset_config(spec)
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        mx.random.seed(spec.seed)
        try:
            model = module.Model(module.ModelArgs.from_dict(config))
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise ModelSpecError(f"cannot build {spec.preset} with {config['num_hidden_layers']} "
                                 f"layers: {type(exc).__name__}: {exc}") from None
    mx.eval(model.parameters())
    # without a destination, tree_flatten gives a list of (key, array) pairs
    leaves = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    num_params = sum(v.size for _, v in leaves)
    return model, {**spec.describe(), "config": config, "num_parameters": int(num_params)}


def vocab_size(description: dict) -> int:
    """Token ids the model accepts (its config's `vocab_size`)."""
    config = description["config"]
    if "vocab_size" not in config:  # multimodal configs nest it
        config = config.get("text_config", {})
    if "vocab_size" not in config:
        raise ModelSpecError("the model config names no vocab_size")
    return int(config["vocab_size"])


def model_layout(model: Any) -> ModelLayout:
    """The `ModelLayout` of `model`'s caches (`cache.layer_specs`): its full,
    sliding and recurrent layer counts, divided by their greatest common
    divisor (one repeating block), and its sliding window. The engine's
    store for `model` has exactly the layout's groups. Raises
    `ModelSpecError` for a model whose sliding layers use several windows
    (a layout has one). Cost: one `make_cache()` call."""
    from cache import LayerKind, layer_specs

    specs = layer_specs(model)
    counts = {kind: sum(1 for s in specs if s.kind is kind) for kind in LayerKind}
    windows = sorted({s.window for s in specs
                      if s.kind is LayerKind.SLIDING and s.window is not None})
    if len(windows) > 1:
        raise ModelSpecError(f"the model's sliding layers use several windows {windows}; "
                             "a simulated layout has one")
    block = math.gcd(*counts.values())
    return ModelLayout(full=counts[LayerKind.ATTENTION] // block,
                       sliding=counts[LayerKind.SLIDING] // block,
                       recurrent=counts[LayerKind.RECURRENT] // block,
                       window=windows[0] if windows else None)
