"""What kind of cache each layer of an mlx-lm model needs.

Read from `model.make_cache()` when the model has it (mlx-lm's own choice of
cache per layer), else one full-attention layer per `model.layers`.

A layer whose cache is an mlx-lm ``CacheList`` (several caches in one layer:
falcon_h1's attention + Mamba, longcat_flash's two attention blocks) counts
as several *cache positions*. `layer_specs` lists the positions flat, in
order; `cache_layout` says how they nest back into the model's layers.

Some model files keep in a cache something its class does not tell, or a
class of their own; `DECLARED` names those entries by mlx-lm module (no
probing of the cache objects): longcat_flash_ngram's ``ArraysCache`` holds
the last n - 1 input ids, which the views serve from the token ids the
block manager already keeps (`LayerKind.TOKENS`); deepseek_v41's own
``LayerCache`` becomes a `CompressedLayer` of up to three positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable, Mapping, cast

from blockmgr.errors import InvalidArgument


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
    None), or for `TOKENS` how many of the last input ids the layer reads.
    `num_arrays`: for a declared `RECURRENT` position (not an mlx-lm
    ``ArraysCache``), its number of state arrays, allocated on first write.
    `written`: whether every forward writes the position (a declared False:
    the model gives the cache to a layer that never uses it)."""

    kind: LayerKind
    window: int | None = None
    num_arrays: int | None = None  # a declared RECURRENT position's state arrays
    # False: a cache the model hands to a layer that ignores it (no forward
    # writes it), so a step is complete without its write (`views.BatchState`).
    written: bool = True


@dataclass(frozen=True, slots=True)
class CompressedLayer:
    """deepseek_v41's ``LayerCache`` as a layout entry (one model layer).

    mlx-lm keeps, per layer, a sliding `window` of the layer's KV rows, and
    for a layer that compresses (a kv source with `ratio` > 0) one entry per
    closed group of `ratio` tokens (its compressed KV, plus its index key
    when the layer `indexes`), and the projections of the still open
    group's tokens. Paged, that is up to three positions (`positions`):
    the window (`SLIDING`, window + 1 keys: the rows before a step's first
    token, then the step's), the entries (`ATTENTION`: entry g sits at the
    token that closes it, (g + 1) * ratio - 1; keys the compressed KV, values
    the index key), and the open group's rows (`RECURRENT`, 2 arrays of
    ratio - 1 rows: state after the computed tokens). See
    `cache.compressed_view`.
    """

    window: int
    ratio: int = 0
    compresses: bool = False
    indexes: bool = False
    positions: tuple[int, ...] = ()

    @property
    def has_open_group(self) -> bool:
        return self.compresses and self.ratio > 1

    def specs(self) -> list[LayerSpec]:
        """The specs of its positions, in `positions` order."""
        out = [LayerSpec(LayerKind.SLIDING, self.window + 1)]
        if self.compresses:
            out.append(LayerSpec(LayerKind.ATTENTION))
        if self.has_open_group:
            out.append(LayerSpec(LayerKind.RECURRENT, num_arrays=2))
        return out


#: One model layer's entry: a flat position, the positions of a CacheList,
#: or a declared composite.
LayoutEntry = int | tuple[int, ...] | CompressedLayer

#: What a module declares for one `make_cache()` entry.
Declared = LayerSpec | CompressedLayer


def layer_specs(model: Any) -> list[LayerSpec]:
    """The cache kind of every cache position of `model` (one per layer, or
    one per member of a layer's ``CacheList``, or those of a declared
    composite). Cost: one `make_cache()` call.

    Raises `InvalidArgument` for caches that have no paged counterpart
    (quantized, nested `CacheList`, `RotatingKVCache` with `keep`, model-
    specific classes a module does not declare). Entries the model's mlx-lm
    module is `DECLARED` for take that declaration.
    """
    if hasattr(model, "make_cache"):
        return _positions(model)[0]
    layers = getattr(model, "layers", None)
    if layers is None:
        raise InvalidArgument("model has neither make_cache() nor layers")
    return [LayerSpec(LayerKind.ATTENTION) for _ in layers]


def cache_layout(model: Any) -> list[LayoutEntry] | None:
    """How `layer_specs`' positions nest into the model's layers, or None
    when every layer has one cache (the identity)."""
    if not hasattr(model, "make_cache"):
        return None
    layout = _positions(model)[1]
    return None if all(isinstance(e, int) for e in layout) else layout


def _positions(model: Any) -> tuple[list[LayerSpec], list[LayoutEntry]]:
    """Specs and layout, declared entries expanded (one `make_cache()` call)."""
    leaves, leaf_layout = _flatten(model.make_cache())
    declare = DECLARED.get(type(model).__module__)
    declared = {} if declare is None else declare(model)
    specs: list[LayerSpec] = []
    at: dict[int, LayoutEntry] = {}  # leaf -> its layout entry
    for i, cache in enumerate(leaves):
        entry = declared.get(i)
        if isinstance(entry, CompressedLayer):
            members = entry.specs()
            at[i] = replace(entry, positions=tuple(range(len(specs), len(specs) + len(members))))
            specs.extend(members)
        else:
            at[i] = len(specs)
            specs.append(entry or _spec_of(cache, i))
    layout: list[LayoutEntry] = [at[e] if isinstance(e, int) else _members(at, e)
                                 for e in leaf_layout]
    return specs, layout


def _members(at: Mapping[int, LayoutEntry], leaves: LayoutEntry) -> tuple[int, ...]:
    """The positions of a composite cache's leaves (each a plain layer)."""
    if not isinstance(leaves, tuple):
        raise InvalidArgument(f"a composite cache entry is not a tuple: {leaves!r:.80}")
    members = tuple(at[i] for i in leaves)
    if not all(isinstance(m, int) for m in members):
        raise InvalidArgument("a declared compressed layer inside a composite cache")
    return cast(tuple[int, ...], members)


def _ngram_context(model: Any) -> dict[int, Declared]:
    """longcat_flash_ngram: entry 0 (its ``ArraysCache(size=1)``) keeps the
    last ``emb_neighbor_num - 1`` input ids for the n-gram embedding."""
    return {0: LayerSpec(LayerKind.TOKENS, int(model.args.emb_neighbor_num) - 1)}


def _compressed_layers(model: Any) -> dict[int, Declared]:
    """deepseek_v41: every entry is a `LayerCache` (see `CompressedLayer`),
    configured by the model's arguments the way its attention reads them."""
    args = model.args
    ratios = tuple(args.compress_ratios)
    kv_sources, index_sources = set(args.kv_source_layer_ids), set(args.index_source_layer_ids)
    out: dict[int, Declared] = {}
    for layer in range(len(model.layers)):
        ratio = int(ratios[layer]) if layer < len(ratios) else 0
        compresses = bool(ratio) and layer in kv_sources
        out[layer] = CompressedLayer(int(args.sliding_window), ratio, compresses,
                                     compresses and layer in index_sources)
    return out


def _linear_replaced_attention(model: Any) -> dict[int, Declared]:
    """nemotron-nas: `make_cache()` has a ``KVCache`` for every layer with an
    attention block, and a block "replaced with linear" ignores its cache."""
    out: dict[int, Declared] = {}
    entry = 0
    for layer in model.layers:
        if layer.self_attn is None:
            continue
        if layer.attention_config.replace_with_linear:
            out[entry] = LayerSpec(LayerKind.ATTENTION, written=False)
        entry += 1
    return out


#: `make_cache()` entries whose meaning a model file declares, by mlx-lm
#: module: a function of the model giving {entry: declaration}.
DECLARED: dict[str, Callable[[Any], dict[int, Declared]]] = {
    "mlx_lm.models.longcat_flash_ngram": _ngram_context,
    "mlx_lm.models.deepseek_v41": _compressed_layers,
    "mlx_lm.models.nemotron-nas": _linear_replaced_attention,
}


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
