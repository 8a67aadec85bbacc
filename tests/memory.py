"""Peak memory growth over a call: the detector of copies of pool arrays."""

from __future__ import annotations

import gc
from collections.abc import Callable

import mlx.core as mx


def peak_growth(fn: Callable[[], object]) -> int:
    """Bytes allocated above what was live before `fn()`, at the peak.

    Garbage is collected first and the collector is off while `fn` runs: an
    earlier test's `PagedCache` with a `views()` step still in flight is
    freed only by the cyclic collector (that step's batch state and the cache
    refer to each other), and its pools freed inside the window would hide
    the copy a test looks for."""
    mx.eval(mx.zeros(1))
    gc.collect()
    gc.disable()
    try:
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        fn()
        return mx.get_peak_memory() - before
    finally:
        gc.enable()
