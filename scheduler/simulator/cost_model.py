"""Simulated step time: what a forward pass over a scheduled batch would cost.

The simulator runs no model; each scheduler step advances the simulated clock
by

    step_overhead
    + prefill_per_token  * prefill tokens
    + decode_per_token   * decode tokens (one per decoding sequence)
    + attention_per_context_token * sum over scheduled sequences of the
                                    context they attend to
    + copy_per_page      * CopyBlock ops  (+ copy_per_slot * CopySlot/ZeroSlot)
    + swap_per_page      * swap ops

All figures are seconds. The defaults describe a ~7B model on one accelerator
roughly (a few thousand prefill tokens/s, ~30 ms per decode step at small
batch); they make queueing, TTFT and throughput meaningful relative to each
other, not predictions for a given machine. Cost: O(1) per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(slots=True, frozen=True)
class CostModel:
    """Per-step time in simulated seconds; every field finite and >= 0."""

    step_overhead: float = 0.020
    prefill_per_token: float = 0.00025
    decode_per_token: float = 0.0008
    attention_per_context_token: float = 0.0000005
    copy_per_page: float = 0.00002
    copy_per_slot: float = 0.0002
    swap_per_page: float = 0.0001

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"cost {item.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost {item.name} must be finite and >= 0, got {value}")
        if self.step_overhead + self.prefill_per_token + self.decode_per_token <= 0:
            raise ValueError("a step must cost some time: step_overhead, prefill_per_token "
                             "and decode_per_token cannot all be 0")

    def step_time(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        context_tokens: int = 0,
        page_copies: int = 0,
        slot_copies: int = 0,
        swapped_pages: int = 0,
    ) -> float:
        """Seconds the step takes. O(1)."""
        return (
            self.step_overhead
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_token * decode_tokens
            + self.attention_per_context_token * context_tokens
            + self.copy_per_page * page_copies
            + self.copy_per_slot * slot_copies
            + self.swap_per_page * swapped_pages
        )

    def to_dict(self) -> dict:
        return {item.name: getattr(self, item.name) for item in fields(self)}
