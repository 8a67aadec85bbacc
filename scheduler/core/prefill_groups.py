"""Which prefill chunks of a step share one (right-padded) forward.

A forward over few tokens costs about one read of the layers' weights
whatever it holds (on a Qwen3-0.6B-shaped model a 12-token chunk costs as
much as 32 of them together: `benchmarks/prefill_wave.py`), so chunks that
arrive together should share it; but every row of a padded forward is as
long as its longest, and padding a short chunk to a long one computes the
difference for nothing (a 2000-token chunk beside seven 12-token ones would
compute 8 x 2000 positions for 2084 real ones).

`prefill_groups` therefore takes the chunks longest first and closes a
group when it holds `max_rows` chunks or when one more chunk would make its
padding (padded minus real positions) exceed both `PAD_FRACTION` of its
padded positions and `PAD_TOKENS` positions. Chunks of equal length always
group; a short chunk never waits behind a much longer one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

#: Padding a group may hold whatever its size: below this many positions a
#: forward is bound by reading the weights, so padding there is almost free.
PAD_TOKENS = 64
#: Padding a larger group may hold, as a fraction of its padded positions.
PAD_FRACTION = 0.25


class Chunk(Protocol):
    @property
    def num_tokens(self) -> int: ...


C = TypeVar("C", bound=Chunk)


def padding(lengths: Sequence[int]) -> int:
    """Padded minus real positions of one forward over rows of `lengths`."""
    return len(lengths) * max(lengths) - sum(lengths) if lengths else 0


def prefill_groups(chunks: Sequence[C], max_rows: int) -> list[list[C]]:
    """`chunks` split into forwards of at most `max_rows` rows with bounded
    padding (see the module docstring); longest first, a stable order among
    equal lengths. Cost: O(n log n) for n chunks."""
    groups: list[list[C]] = []
    group: list[C] = []
    real = 0
    for chunk in sorted(chunks, key=lambda c: -c.num_tokens):
        if group:
            width = group[0].num_tokens  # the longest: sorted
            padded = (len(group) + 1) * width
            waste = padded - real - chunk.num_tokens
            if len(group) == max_rows or (waste > PAD_TOKENS and waste > PAD_FRACTION * padded):
                groups.append(group)
                group, real = [], 0
        group.append(chunk)
        real += chunk.num_tokens
    if group:
        groups.append(group)
    return groups
