"""`EngineConfig`: every setting of an `Engine`, each declared once.

An engine's settings come in three parts, as vLLM's `VllmConfig` holds its
`CacheConfig` and `SchedulerConfig`:

* `CacheConfig`: the storage (`cache.PagedCache.for_model`'s keywords):
  pool size, page size, recurrent slots, prefix cache, page format, swap
  space and the prefix cache's host and disk tiers;
* `SchedulerConfig` (`scheduler.core`): the scheduling limits and policies;
* the engine's own: prefill batching, the batch probe, forward retries,
  speculation depth, vocabulary override.

Each setting is declared once, with its default and its help (`setting`:
a dataclass field whose metadata holds the help (`scheduler.core.settings`;
`SchedulerConfig`'s fields are declared so in the scheduling core). The
command line's options are generated from these declarations
(`settings()`, `scheduler.cli`), under vLLM's names where vLLM has one;
an old spelling is listed in `old` and still accepted with a deprecation
line. Pure Python: no MLX (the CLI imports it to build its parser).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from blockmgr.errors import InvalidArgument, WrongArgumentType
from blockmgr.kv_format import BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, KVFormat
from blockmgr.validation import check_bool, check_int, check_number
from scheduler.core.config import SchedulerConfig
from scheduler.core.settings import setting


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The engine's storage (`PagedCache.for_model`); validated on
    construction (`InvalidArgument`, a `ValueError`). Sizes in bytes are
    ints or strings such as "4GiB"."""

    num_blocks: int = setting(1024, "KV pages in the pool", metavar="N", minimum=1)
    block_size: int = setting(16, "tokens per page", metavar="TOKENS", minimum=1)
    num_slots: int | None = setting(
        None, "recurrent slots of a hybrid model", metavar="N", minimum=0,
        none="2 per running sequence + 2, 3 per sequence + 2 with a draft model")
    enable_prefix_cache: bool = setting(True, "keep computed prefixes for reuse",
                                        option="--no-prefix-cache")
    watermark: float = setting(0.0, "fraction of pages kept free at admission", metavar="F",
                               minimum=0.0)
    num_host_blocks: int = setting(0, "host pages for preemption by swap", metavar="N",
                                   minimum=0)
    num_host_slots: int = setting(0, "host recurrent slots for swap", metavar="N", minimum=0)
    kv_bits: int | None = setting(
        None, "quantize cached keys and values to 4 or 8 bits, affine along the head "
              "dimension as mlx-lm's QuantizedKVCache", none="the model's dtype",
        metavar="BITS", choices=BITS)
    kv_group_size: int | None = setting(
        None, "elements per scale and bias of quantized pages: 32, 64 or 128",
        none=str(DEFAULT_GROUP_SIZE), more="the model's head size must be a multiple of it",
        metavar="N", choices=GROUP_SIZES)
    kv_format: KVFormat | None = setting(
        None, "the page format as a `KVFormat` (key and value bits apart), instead of "
              "kv_bits and kv_group_size")
    host_cache_size: int | str | None = setting(
        None, "host memory for evicted cached prefixes, e.g. 4GiB", none="none",
        metavar="SIZE")
    disk_cache: str | os.PathLike[str] | None = setting(
        None, "keep evicted cached prefixes in this directory, where they survive "
              "restarts (design/tiers.md)", none="none", metavar="DIR")
    disk_cache_size: int | str | None = setting(
        None, "disk budget of --disk-cache, e.g. 20GiB", none="20GiB", metavar="SIZE")

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, 1)
        check_int("block_size", self.block_size, 1)
        if self.num_slots is not None:
            check_int("num_slots", self.num_slots, 0)
        check_int("num_host_blocks", self.num_host_blocks, 0)
        check_int("num_host_slots", self.num_host_slots, 0)
        check_bool("enable_prefix_cache", self.enable_prefix_cache)
        check_number("watermark", self.watermark, 0.0, below=1.0)

    def storage_kwargs(self, num_slots: int, hybrid: bool) -> dict[str, Any]:
        """`PagedCache.for_model`'s keywords (after `model, num_blocks,
        block_size`) for a model with (`hybrid`) or without recurrent
        layers, with `num_slots` resolved. Tier and swap keywords only when
        set (for_model's own defaults otherwise)."""
        kwargs: dict[str, Any] = {
            "num_slots": num_slots, "enable_prefix_cache": self.enable_prefix_cache,
            "watermark": self.watermark, "kv_format": self.kv_format,
            "kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size}
        tiers = (self.host_cache_size, self.disk_cache, self.disk_cache_size)
        if any(value is not None for value in tiers):
            kwargs.update(host_cache_size=self.host_cache_size, disk_cache=self.disk_cache,
                          disk_cache_size=self.disk_cache_size)
        if self.num_host_blocks:  # host slots only matter for hybrid models
            kwargs.update(num_host_blocks=self.num_host_blocks,
                          num_host_slots=self.num_host_slots if hybrid else 0)
        return kwargs


#: `SchedulerConfig`'s settings (its fields live in the scheduling core,
#: which declares their defaults): help and CLI metadata, as `setting`'s.


def _default_cache() -> CacheConfig:
    return CacheConfig()


def _default_scheduler() -> SchedulerConfig:
    return SchedulerConfig()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """An `Engine`'s settings: `cache` (the storage), `scheduler`, and the
    engine's own; validated on construction (`InvalidArgument`; a part of
    the wrong type: `WrongArgumentType`).
    `Engine(model, config=EngineConfig(...))`; `EngineConfig.of(**keywords)`
    sorts the flat keywords `Engine` also accepts into the three parts.
    The engine never changes the config it is given (it resolves
    `scheduler.max_model_len` on a copy)."""

    cache: CacheConfig = field(default_factory=_default_cache)
    scheduler: SchedulerConfig = field(default_factory=_default_scheduler)
    prefill_batch: int = setting(
        1, "prefill chunks per forward, right-padded to the group's longest "
           "(design/serving.md)", metavar="N", minimum=1)
    batch_probe: bool = setting(
        True, "compare a few batched and single-row forwards at start; rows the model "
              "cannot batch run one by one")
    max_forward_retries: int = setting(
        2, "solo forward failures in a row after which a request is aborted", minimum=1)
    num_speculative_tokens: int = setting(
        4, "draft tokens per step with a draft model", metavar="K", minimum=1)
    vocab_size: int | None = setting(
        None, "token ids allowed in prompts", none="the model's vocabulary", minimum=1)

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise WrongArgumentType(f"cache must be a CacheConfig, got {self.cache!r:.80}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise WrongArgumentType(
                f"scheduler must be a SchedulerConfig, got {self.scheduler!r:.80}")
        check_int("prefill_batch", self.prefill_batch, 1)
        check_bool("batch_probe", self.batch_probe)
        check_int("max_forward_retries", self.max_forward_retries, 1)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.vocab_size is not None:
            check_int("vocab_size", self.vocab_size, 1)

    @classmethod
    def of(cls, scheduler_config: SchedulerConfig | None = None,
           **keywords: Any) -> EngineConfig:
        """The config of `Engine`'s flat keywords: each goes to the part
        that declares it (a `SchedulerConfig` field to the scheduler, unless
        a whole `scheduler_config` is given: then none may be).
        `ValueError` (`InvalidArgument`) for a bad
        value, `TypeError` for a keyword that is no setting."""
        parts: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "engine": {}}
        for name, value in keywords.items():
            parts[_part_of(name)][name] = value
        if scheduler_config is not None and parts["scheduler"]:
            raise InvalidArgument("give either scheduler_config or scheduler keywords, not both")
        scheduler = scheduler_config or SchedulerConfig(**parts["scheduler"])
        return cls(CacheConfig(**parts["cache"]), scheduler, **parts["engine"])


_CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheConfig))
_SCHEDULER_FIELDS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig))
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {
    "cache", "scheduler"}


def _part_of(name: str) -> str:
    if name in _CACHE_FIELDS:
        return "cache"
    if name in _SCHEDULER_FIELDS:
        return "scheduler"
    if name in _ENGINE_FIELDS:
        return "engine"
    raise TypeError(f"unexpected keyword argument {name!r} (not an engine setting)")


@dataclass(frozen=True, slots=True)
class Setting:
    """One declared setting as the command line shows it.

    part: "cache", "scheduler" or "engine" (the config that holds it);
    default: that config's default; help: what it is; none: what a
    default of None means; more: text after the default; option: its one
    CLI name; old: older spellings (hidden, with a deprecation line); the
    rest for parsing."""

    name: str
    part: str
    default: Any
    help: str
    option: str
    none: str | None = None
    more: str | None = None
    old: tuple[str, ...] = ()
    metavar: str | None = None
    minimum: int | float | None = None
    choices: tuple[Any, ...] | None = None

    def help_text(self, default: Any = None, default_text: str | None = None) -> str:
        """The option's help: "HELP (default X): MORE", X being `default`,
        or "(default: TEXT)" for `default_text` (or `none` for a default of
        None): a rule rather than a value."""
        if default_text is None and default is None:
            default_text = self.none
        if default_text is not None:  # a phrase
            text = f"{self.help} (default: {default_text})"
        else:
            value = f"{default:g}" if isinstance(default, float) else str(default)
            text = f"{self.help} (default {value})"
        return text if self.more is None else f"{text}: {self.more}"


def _setting(name: str, part: str, default: Any, meta: Mapping[str, Any]) -> Setting:
    option = meta.get("option") or "--" + name.replace("_", "-")
    return Setting(name, part, default, meta["help"], option, meta.get("none"),
                   meta.get("more"), tuple(meta.get("old") or ()), meta.get("metavar"),
                   meta.get("minimum"), meta.get("choices"))


def settings() -> dict[str, Setting]:
    """Every declared setting by field name (cache, scheduler, engine).
    Cost: O(fields)."""
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(CacheConfig):
        out[f.name] = _setting(f.name, "cache", f.default, f.metadata)
    for f in dataclasses.fields(SchedulerConfig):
        out[f.name] = _setting(f.name, "scheduler", f.default, f.metadata)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _ENGINE_FIELDS:
            out[f.name] = _setting(f.name, "engine", f.default, f.metadata)
    return out
