"""What kind of cache each layer of an mlx-lm model needs.

Read from `model.make_cache()` when the model has it (mlx-lm's own choice of
cache per layer), else one full-attention layer per `model.layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from blockmgr.errors import InvalidArgument


class LayerKind(Enum):
    ATTENTION = "attention"  # full causal attention: paged KV
    SLIDING = "sliding"  # sliding-window attention: paged KV, old pages released
    RECURRENT = "recurrent"  # conv / SSM state: a recurrent slot


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's cache kind; `window` is the sliding window in tokens (else None)."""

    kind: LayerKind
    window: int | None = None


def layer_specs(model: Any) -> list[LayerSpec]:
    """The cache kind of every layer of `model`. Cost: one `make_cache()` call.

    Raises `InvalidArgument` for caches that have no paged counterpart
    (quantized, chunked, nested `CacheList`, `RotatingKVCache` with `keep`).
    """
    if hasattr(model, "make_cache"):
        return [_spec_of(c, i) for i, c in enumerate(model.make_cache())]
    layers = getattr(model, "layers", None)
    if layers is None:
        raise InvalidArgument("model has neither make_cache() nor layers")
    return [LayerSpec(LayerKind.ATTENTION) for _ in layers]


def _spec_of(cache: Any, index: int) -> LayerSpec:
    name = type(cache).__name__
    if name == "KVCache":
        return LayerSpec(LayerKind.ATTENTION)
    if name == "RotatingKVCache":
        if getattr(cache, "keep", 0):
            # Attention sinks (keep > 0) would pin the first pages; not supported.
            raise InvalidArgument(f"layer {index}: RotatingKVCache with keep > 0")
        return LayerSpec(LayerKind.SLIDING, int(cache.max_size))
    if name == "ArraysCache" or hasattr(cache, "cache") and hasattr(cache, "advance"):
        return LayerSpec(LayerKind.RECURRENT)
    raise InvalidArgument(f"layer {index}: no paged counterpart for {name}")
