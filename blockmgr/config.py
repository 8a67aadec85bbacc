"""Configuration of a `BlockManager`."""

from __future__ import annotations

from dataclasses import dataclass

from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_bool, check_int, check_number


@dataclass(slots=True, frozen=True)
class BlockManagerConfig:
    """What the manager manages; validated on construction (`InvalidArgument`).

    num_blocks: KV pages in the pool.
    block_size: tokens per page.
    num_slots: recurrent-state slots (0 for attention-only models). When > 0,
        every sequence holds one slot and prefix-cache hits must end at a
        recurrent snapshot.
    enable_prefix_cache: keep finished and checkpointed prefixes in the trie.
    watermark: fraction of pages `can_allocate` keeps free for running
        sequences to grow into (admission control, as in vLLM).
    sliding_window: attention window W in tokens; pages wholly outside the
        last W tokens are released as a sequence grows.
    num_host_blocks / num_host_slots: host-memory pages and slots that
        preemption by swap copies sequences into (0: no swapping).
    num_host_cache_blocks / num_host_cache_slots: the prefix cache's host
        tier (pages, recurrent snapshots): evicted prefixes move there
        instead of being dropped (0: no host tier; design/tiers.md).
    num_disk_blocks / num_disk_slots: the prefix cache's disk tier, below
        the host tier (0: none).
    """

    num_blocks: int
    block_size: int = 16
    num_slots: int = 0
    enable_prefix_cache: bool = True
    watermark: float = 0.0
    sliding_window: int | None = None
    num_host_blocks: int = 0
    num_host_slots: int = 0
    num_host_cache_blocks: int = 0
    num_host_cache_slots: int = 0
    num_disk_blocks: int = 0
    num_disk_slots: int = 0

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, 1, strict=True)
        check_int("block_size", self.block_size, 1, strict=True)
        check_int("num_slots", self.num_slots, 0, strict=True)
        check_bool("enable_prefix_cache", self.enable_prefix_cache)
        check_number("watermark", self.watermark, 0.0, below=1.0)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1, strict=True)
        check_int("num_host_blocks", self.num_host_blocks, 0, strict=True)
        check_int("num_host_slots", self.num_host_slots, 0, strict=True)
        if self.num_host_slots and not self.num_slots:
            raise InvalidArgument("num_host_slots needs num_slots > 0")
        _check_tiers(self)

    @property
    def has_cache_tiers(self) -> bool:
        """The prefix cache has a host or disk tier."""
        return bool(self.num_host_cache_blocks or self.num_disk_blocks)

    @property
    def is_hybrid(self) -> bool:
        """True when sequences carry recurrent state (slots)."""
        return self.num_slots > 0

    @property
    def num_watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def group_configs(self) -> tuple[BlockManagerConfig, ...]:
        """The config of each page group a manager keeps: this one alone."""
        return (self,)


@dataclass(slots=True, frozen=True)
class GroupedStoreConfig:
    """The layer groups of one model; validated on construction (`InvalidArgument`).

    windows: one entry per layer group: None for full attention, else the
        sliding window W in tokens. Entries are distinct. Group 0 also keeps
        the recurrent slots (and the token ids every group shares).
    num_blocks: KV pages of each full-attention group.
    window_blocks: KV pages of each sliding-window group (None: num_blocks).
    block_size, num_slots, enable_prefix_cache, watermark, num_host_blocks,
    num_host_slots, num_host_cache_blocks, num_host_cache_slots,
    num_disk_blocks, num_disk_slots: as in `BlockManagerConfig` (pages per
    group).
    """

    num_blocks: int
    block_size: int = 16
    windows: tuple[int | None, ...] = (None,)
    num_slots: int = 0
    enable_prefix_cache: bool = True
    watermark: float = 0.0
    window_blocks: int | None = None
    num_host_blocks: int = 0
    num_host_slots: int = 0
    num_host_cache_blocks: int = 0
    num_host_cache_slots: int = 0
    num_disk_blocks: int = 0
    num_disk_slots: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.windows, tuple) or not self.windows:
            raise InvalidArgument(f"windows must be a non-empty tuple, got {self.windows!r}")
        for window in self.windows:
            if window is not None:
                check_int("a sliding window", window, 1, strict=True)
        if len(set(self.windows)) != len(self.windows):
            raise InvalidArgument(f"windows must be distinct, got {self.windows!r}")
        if self.window_blocks is not None:
            check_int("window_blocks", self.window_blocks, 1, strict=True)
        for index in range(len(self.windows)):
            self.group_config(index)  # validates every other field

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_cache_tiers(self) -> bool:
        """The prefix cache has a host or disk tier."""
        return bool(self.num_host_cache_blocks or self.num_disk_blocks)

    @property
    def is_hybrid(self) -> bool:
        return self.num_slots > 0

    def group_configs(self) -> tuple[BlockManagerConfig, ...]:
        """The config of each page group, in group order."""
        return tuple(self.group_config(index) for index in range(self.num_groups))

    def group_config(self, index: int) -> BlockManagerConfig:
        """The `BlockManagerConfig` of group `index`."""
        window = self.windows[index]
        first = index == 0
        num_blocks = self.num_blocks
        if window is not None and self.window_blocks is not None:
            num_blocks = self.window_blocks
        return BlockManagerConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_slots=self.num_slots if first else 0,
            enable_prefix_cache=self.enable_prefix_cache,
            watermark=self.watermark,
            sliding_window=window,
            num_host_blocks=self.num_host_blocks,
            num_host_slots=self.num_host_slots if first else 0,
            num_host_cache_blocks=self.num_host_cache_blocks,
            num_host_cache_slots=self.num_host_cache_slots if first else 0,
            num_disk_blocks=self.num_disk_blocks,
            num_disk_slots=self.num_disk_slots if first else 0,
        )


def _check_tiers(config: BlockManagerConfig) -> None:
    """The prefix cache's tiers: counts, only with a prefix cache, slots only
    for recurrent state."""
    for name, value in (
        ("num_host_cache_blocks", config.num_host_cache_blocks),
        ("num_host_cache_slots", config.num_host_cache_slots),
        ("num_disk_blocks", config.num_disk_blocks),
        ("num_disk_slots", config.num_disk_slots),
    ):
        check_int(name, value, 0, strict=True)
    if config.has_cache_tiers and not config.enable_prefix_cache:
        raise InvalidArgument("host and disk cache tiers need enable_prefix_cache")
    if (config.num_host_cache_slots or config.num_disk_slots) and not config.num_slots:
        raise InvalidArgument("cache tier slots need num_slots > 0")
    if config.num_host_cache_slots and not config.num_host_cache_blocks:
        raise InvalidArgument("num_host_cache_slots needs num_host_cache_blocks > 0")
    if config.num_disk_slots and not config.num_disk_blocks:
        raise InvalidArgument("num_disk_slots needs num_disk_blocks > 0")
