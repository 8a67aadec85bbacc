"""`length_buckets` against a brute force over every partition into groups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from blockmgr.errors import InvalidArgument
from cache.buckets import length_buckets


def work(lengths, groups):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def brute_force(lengths, k):
    """Least padded work over all assignments of rows to at most k groups."""
    best = None
    for labels in itertools.product(range(k), repeat=len(lengths)):
        groups = [[i for i, lab in enumerate(labels) if lab == g] for g in range(k)]
        w = work(lengths, [g for g in groups if g])
        best = w if best is None else min(best, w)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_buckets_are_optimal_partitions(seed, k):
    lengths = np.random.default_rng(seed).integers(1, 50, 6).tolist()
    groups = length_buckets(lengths, k)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) <= k
    assert work(lengths, groups) == brute_force(lengths, k)


def test_bucket_edge_cases():
    assert length_buckets([], 3) == []
    assert length_buckets([7], 3) == [[0]]
    with pytest.raises(InvalidArgument):
        length_buckets([1, 2], 0)
