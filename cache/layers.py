"""What kind of cache each layer of an mlx-lm model needs.

Read from `model.make_cache()` when the model has it (mlx-lm's own choice of
cache per layer), else one full-attention layer per `model.layers`.

A layer whose cache is an mlx-lm ``CacheList`` (several caches in one layer:
falcon_h1's attention + Mamba, longcat_flash's two attention blocks) counts
as several *cache positions*. `layer_specs` lists the positions flat, in
order; `cache_layout` says how they nest back into the model's layers.

Some model files keep in a generic cache something that is not what the
cache class suggests; `DECLARED` names those positions by mlx-lm module
(no probing of the cache objects): longcat_flash_ngram's ``ArraysCache``
holds the last n - 1 input ids, which the views serve from the token ids
the block manager already keeps (`LayerKind.TOKENS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from blockmgr.errors import InvalidArgument

#: One model layer's entry: a flat position, or the positions of a CacheList.
LayoutEntry = int | tuple[int, ...]


class LayerKind(Enum):
    ATTENTION = "attention"  # full causal attention: paged KV
    SLIDING = "sliding"  # sliding-window attention: paged KV, old pages released
    RECURRENT = "recurrent"  # conv / SSM state: a recurrent slot
    TOKENS = "tokens"  # the last `window` input ids (an n-gram context): no storage

    @property
    def paged(self) -> bool:
        """Whether the kind keeps K/V in pages (it then belongs to a layer group)."""
        return self in (LayerKind.ATTENTION, LayerKind.SLIDING)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's cache kind; `window` is the sliding window in tokens (else
    None), or for `TOKENS` how many of the last input ids the layer reads."""

    kind: LayerKind
    window: int | None = None


def layer_specs(model: Any) -> list[LayerSpec]:
    """The cache kind of every cache position of `model` (one per layer, or
    one per member of a layer's ``CacheList``). Cost: one `make_cache()` call.

    Raises `InvalidArgument` for caches that have no paged counterpart
    (quantized, nested `CacheList`, `RotatingKVCache` with `keep`, model-
    specific classes such as deepseek_v41's `LayerCache`).
    Positions the model's mlx-lm module is `DECLARED` for take that spec.
    """
    if hasattr(model, "make_cache"):
        leaves, _ = _flatten(model.make_cache())
        declared = _declared(model)
        return [declared.get(i) or _spec_of(c, i) for i, c in enumerate(leaves)]
    layers = getattr(model, "layers", None)
    if layers is None:
        raise InvalidArgument("model has neither make_cache() nor layers")
    return [LayerSpec(LayerKind.ATTENTION) for _ in layers]


def cache_layout(model: Any) -> list[LayoutEntry] | None:
    """How `layer_specs`' positions nest into the model's layers, or None
    when every layer has one cache (the identity)."""
    if not hasattr(model, "make_cache"):
        return None
    _, layout = _flatten(model.make_cache())
    return None if all(isinstance(e, int) for e in layout) else layout


def _ngram_context(model: Any) -> dict[int, LayerSpec]:
    """longcat_flash_ngram: position 0 (its ``ArraysCache(size=1)``) keeps the
    last ``emb_neighbor_num - 1`` input ids for the n-gram embedding."""
    return {0: LayerSpec(LayerKind.TOKENS, int(model.args.emb_neighbor_num) - 1)}


#: Cache positions whose meaning a model file declares, by mlx-lm module:
#: a function of the model giving {position: spec}.
DECLARED: dict[str, Callable[[Any], dict[int, LayerSpec]]] = {
    "mlx_lm.models.longcat_flash_ngram": _ngram_context,
}


def _declared(model: Any) -> dict[int, LayerSpec]:
    declare = DECLARED.get(type(model).__module__)
    return {} if declare is None else declare(model)


def _flatten(caches: list) -> tuple[list, list[LayoutEntry]]:
    leaves: list = []
    layout: list[LayoutEntry] = []
    for layer, cache in enumerate(caches):
        if type(cache).__name__ != "CacheList":
            layout.append(len(leaves))
            leaves.append(cache)
            continue
        members = list(cache.caches)
        if any(type(m).__name__ == "CacheList" for m in members):
            raise InvalidArgument(f"layer {layer}: nested CacheList")
        layout.append(tuple(range(len(leaves), len(leaves) + len(members))))
        leaves.extend(members)
    return leaves, layout


def _spec_of(cache: Any, index: int) -> LayerSpec:
    name = type(cache).__name__
    if name == "KVCache":
        return LayerSpec(LayerKind.ATTENTION)
    if name == "RotatingKVCache":
        if getattr(cache, "keep", 0):
            # Attention sinks (keep > 0) would pin the first pages; not supported.
            raise InvalidArgument(f"cache position {index}: RotatingKVCache with keep > 0")
        return LayerSpec(LayerKind.SLIDING, int(cache.max_size))
    if name == "ChunkedKVCache":
        # Keeps the last chunk_size keys before each step (maybe_trim_front),
        # i.e. the window of chunk_size + 1 keys of the step's first query;
        # the model builds its own chunk mask over that history.
        return LayerSpec(LayerKind.SLIDING, int(cache.chunk_size) + 1)
    if name == "ArraysCache" or hasattr(cache, "cache") and hasattr(cache, "advance"):
        return LayerSpec(LayerKind.RECURRENT)
    raise InvalidArgument(f"cache position {index}: no paged counterpart for {name}")
