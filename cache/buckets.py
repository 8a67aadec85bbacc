"""Length buckets: split a decode batch into forwards of similar lengths.

A batched view hands the model one dense K/V history per layer, padded to
the longest row, and the model's SDPA reads all of it: attention work is
``B * max(length)``. Paged views can serve any subset of sequences, so a
scheduler may instead run a few forwards over groups of similar lengths,
each padded only to its own longest row (measured in design/cache.md).
"""

from __future__ import annotations

from typing import Sequence

from blockmgr.errors import InvalidArgument


def length_buckets(lengths: Sequence[int], max_buckets: int) -> list[list[int]]:
    """Partition row indices into at most `max_buckets` groups of similar length.

    Minimises the padded work ``sum(len(group) * max length in group)``
    (exact, over groups of consecutive lengths in sorted order). Returns
    groups of indices into `lengths`, shortest first. O(max_buckets * n^2).
    """
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise InvalidArgument(f"max_buckets must be a positive int, got {max_buckets!r}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    if n == 0:
        return []
    srt = [lengths[i] for i in order]
    k = min(max_buckets, n)
    inf = float("inf")
    # best[j][e]: least padded work for the first e rows in j groups
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for e in range(1, n + 1):
            for s in range(j - 1, e):
                w = best[j - 1][s] + (e - s) * srt[e - 1]
                if w < best[j][e]:
                    best[j][e], cut[j][e] = w, s
    j = min(range(1, k + 1), key=lambda jj: best[jj][n])
    groups, e = [], n
    while j:
        s = cut[j][e]
        groups.append(order[s:e])
        e, j = s, j - 1
    return groups[::-1]
