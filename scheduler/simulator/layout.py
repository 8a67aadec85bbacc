"""`ModelLayout`: which kinds of layers the simulated model has.

The simulator drives the very store the engine builds for a model: one
layer group per attention window (full attention and each sliding window)
plus recurrent slots (`blockmgr.GroupedStore`). A layout gives the layer
counts of one repeating block of the model (their ratio is what matters) and
the sliding window, and so the store's groups and how much context each
attention layer reads (the cost model's context term).

Presets (`LAYOUTS`): "full" (full attention only, the default), "sliding"
(every layer windowed), "gemma3" (5 sliding : 1 full), "gpt_oss" (1 : 1),
"qwen3_next" (3 recurrent : 1 full), "recurrent_gemma" (2 recurrent : 1
sliding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from blockmgr import BlockManagerConfig, GroupedStoreConfig
from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_int

#: Window of a preset's sliding layers when none is given (tokens).
DEFAULT_WINDOW = 1024


@dataclass(slots=True, frozen=True)
class ModelLayout:
    """Layer counts of one repeating block; validated (`ValueError`).

    full / sliding / recurrent: layers of each kind (>= 0, not all 0);
    window: the sliding layers' window in tokens (needed iff sliding > 0).
    """

    full: int = 1
    sliding: int = 0
    recurrent: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("full", "sliding", "recurrent"):
            check_int(f"layout.{name}", getattr(self, name), 0, strict=True)
        if self.full + self.sliding + self.recurrent == 0:
            raise InvalidArgument("a layout needs at least one layer")
        if self.sliding and self.window is None:
            raise InvalidArgument("a layout with sliding layers needs a window")
        if self.window is not None:
            check_int("layout.window", self.window, 1, strict=True)
            if not self.sliding:
                raise InvalidArgument("layout.window is set but the layout has no sliding layer")

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The store's layer groups, as `cache.paged_cache.layer_windows`
        builds them for a model of this layout: full attention first when
        there is any (or when nothing else could keep the tokens)."""
        if self.sliding and not self.full:
            return (self.window,)
        if self.sliding:
            return (None, self.window)
        return (None,)

    @property
    def reads_every_key(self) -> bool:
        """Whether every attention layer reads every key (`attended(end)` is
        `end`): full attention and no sliding layer."""
        return self.full > 0 and not self.sliding

    def attended(self, end: int) -> float:
        """Keys one query at position end - 1 reads, averaged over the
        attention layers (recurrent layers read none)."""
        num_attention = self.full + self.sliding
        if not num_attention:
            return 0.0
        # `window` is set exactly when there are sliding layers (checked on construction)
        windowed = min(end, self.window) if self.window is not None else 0
        return (self.full * end + self.sliding * windowed) / num_attention

    def store_config(self, bm: BlockManagerConfig) -> GroupedStoreConfig:
        """The grouped store for this layout with `bm`'s pages and slots."""
        if bm.sliding_window is not None:
            raise InvalidArgument("give the sliding window in the layout, not the block manager")
        if self.recurrent and bm.num_slots < 2:
            raise InvalidArgument("a layout with recurrent layers needs num_slots >= 2")
        return GroupedStoreConfig(
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            windows=self.windows,
            num_slots=bm.num_slots,
            enable_prefix_cache=bm.enable_prefix_cache,
            watermark=bm.watermark,
            num_host_blocks=bm.num_host_blocks,
            num_host_slots=bm.num_host_slots,
            num_host_cache_blocks=bm.num_host_cache_blocks,
            num_host_cache_slots=bm.num_host_cache_slots,
            num_disk_blocks=bm.num_disk_blocks,
            num_disk_slots=bm.num_disk_slots,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ModelLayout:
        if not isinstance(data, dict):
            raise InvalidArgument("layout must be a JSON object")
        unknown = sorted(set(data) - {"full", "sliding", "recurrent", "window"})
        if unknown:
            raise InvalidArgument(f"unknown layout settings: {', '.join(unknown)}")
        return cls(**data)


LAYOUTS: dict[str, ModelLayout] = {
    "full": ModelLayout(),
    "sliding": ModelLayout(full=0, sliding=1, window=DEFAULT_WINDOW),
    "gemma3": ModelLayout(full=1, sliding=5, window=DEFAULT_WINDOW),
    "gpt_oss": ModelLayout(full=1, sliding=1, window=128),
    "qwen3_next": ModelLayout(full=1, recurrent=3),
    "recurrent_gemma": ModelLayout(full=0, sliding=1, recurrent=2, window=2048),
}


def layout_named(name: str, window: int | None = None) -> ModelLayout:
    """A preset, with its sliding window replaced by `window` when given."""
    if name not in LAYOUTS:
        raise InvalidArgument(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    layout = LAYOUTS[name]
    if window is not None:
        if not layout.sliding:
            raise InvalidArgument(f"layout {name!r} has no sliding layer for a window")
        layout = replace(layout, window=window)
    return layout


def describe_layout(layout: ModelLayout) -> str:
    """The layout's preset name when it is one (whatever its window), its
    layer ratio and its store's groups, e.g. "gemma3 (1 full : 5 sliding,
    window 512; page groups: full attention, window 512)"."""
    name = next((n for n, preset in LAYOUTS.items()
                 if bool(preset.sliding) == bool(layout.sliding)  # a window needs sliding layers
                 and replace(preset, window=layout.window) == layout), None)
    kinds = [f"{count} {kind}" for kind, count in (("full", layout.full),
                                                   ("sliding", layout.sliding),
                                                   ("recurrent", layout.recurrent)) if count]
    ratio = " : ".join(kinds) + (f", window {layout.window}" if layout.window else "")
    groups = ", ".join("full attention" if w is None else f"window {w}" for w in layout.windows)
    return f"{name or 'custom'} ({ratio}; page groups: {groups})"
