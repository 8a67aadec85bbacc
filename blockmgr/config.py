"""Configuration of a `BlockManager`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BlockManagerConfig:
    """What the manager manages; validated on construction (`ValueError`).

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
    """

    num_blocks: int
    block_size: int = 16
    num_slots: int = 0
    enable_prefix_cache: bool = True
    watermark: float = 0.0
    sliding_window: int | None = None
    num_host_blocks: int = 0
    num_host_slots: int = 0

    def __post_init__(self) -> None:
        _require_int("num_blocks", self.num_blocks, minimum=1)
        _require_int("block_size", self.block_size, minimum=1)
        _require_int("num_slots", self.num_slots, minimum=0)
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(
                f"enable_prefix_cache must be a bool, got {self.enable_prefix_cache!r}"
            )
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)):
            raise ValueError(f"watermark must be a number, got {self.watermark!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.sliding_window is not None:
            _require_int("sliding_window", self.sliding_window, minimum=1)
        _require_int("num_host_blocks", self.num_host_blocks, minimum=0)
        _require_int("num_host_slots", self.num_host_slots, minimum=0)
        if self.num_host_slots and not self.num_slots:
            raise ValueError("num_host_slots needs num_slots > 0")

    @property
    def is_hybrid(self) -> bool:
        """True when sequences carry recurrent state (slots)."""
        return self.num_slots > 0

    @property
    def num_watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
