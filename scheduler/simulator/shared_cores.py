"""`SharedCores`: a fleet's replicas running on one machine's cores.

The cost model prices a step as the time it takes with a core to itself
(a profile calibrated by the CPU clock with one BLAS thread). Replicas on
one machine take turns on its cores (processor sharing: what the OS's
scheduler gives runnable single-threaded processes of equal priority),
beside `background` threads of other work (other people's jobs, a
gateway, a load generator) that are runnable all along:
with n steps in flight, each runs at `min(1, cores / (n + background))`
of its own speed, and the other work uses `background` times that
(`background_seconds` sums it, to match a background to the CPU other
work was measured to use). So the end of every step in flight moves
whenever another replica's step begins or ends: a step's work is what
the cost model priced, its duration how long that work takes at the
rates the sharing gave it.

A step that never shared (in flight only while it ran at full speed)
keeps its priced duration exactly, so a fleet on as many cores as
replicas, with no background, runs as one without sharing.

Costs: `begin` and `end` O(steps in flight); `end_time` O(1).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from blockmgr.errors import InvalidArgument
from blockmgr.validation import check_number


@dataclass(slots=True)
class _Work:
    remaining: float  # seconds of work left, at a core's full speed
    shared: bool  # ran at less than full speed at some point


class SharedCores:
    """Steps in flight on `cores` cores beside `background` runnable threads
    of other work. Time only moves forward: every call's `now` is at least
    the previous one's. Bad calls raise `InvalidArgument` and change
    nothing."""

    def __init__(self, cores: float, background: float = 0.0) -> None:
        check_number("cores", cores, above=0.0)
        check_number("background", background, 0.0)
        self.cores = float(cores)
        self.background = float(background)
        self._work: dict[Hashable, _Work] = {}
        self._last = 0.0
        self._background_seconds = 0.0

    @property
    def rate(self) -> float:
        """The speed of each step in flight, as a share of a core's."""
        runnable = len(self._work) + self.background
        return min(1.0, self.cores / runnable) if runnable else 1.0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._work

    def in_flight(self) -> tuple[Hashable, ...]:
        """The steps in flight, in the order they began."""
        return tuple(self._work)

    def _advance(self, now: float) -> None:
        if now < self._last:
            raise InvalidArgument(f"time went back: {now!r} < {self._last!r}")
        rate = self.rate
        done = (now - self._last) * rate
        for work in self._work.values():
            work.remaining = max(0.0, work.remaining - done)
        self._background_seconds += (now - self._last) * self.background * rate
        self._last = now

    def background_seconds(self, now: float) -> float:
        """CPU seconds the background threads had from time 0 to `now`."""
        self._advance(now)
        return self._background_seconds

    def begin(self, key: Hashable, now: float, work: float) -> None:
        """Step `key` starts at `now` with `work` seconds of work."""
        if key in self._work:
            raise InvalidArgument(f"step {key!r} is in flight already")
        check_number("work", work, 0.0)
        self._advance(now)
        self._work[key] = _Work(work, False)
        self._mark_shared()

    def end(self, key: Hashable, now: float) -> None:
        """Step `key` ends at `now` (its `end_time`)."""
        if key not in self._work:
            raise InvalidArgument(f"step {key!r} is not in flight")
        self._advance(now)
        del self._work[key]
        self._mark_shared()

    def _mark_shared(self) -> None:
        if self.rate < 1.0:
            for work in self._work.values():
                work.shared = True

    def shared(self, key: Hashable) -> bool:
        """Has step `key` run slower than a core's full speed?"""
        return self._work[key].shared

    def end_time(self, key: Hashable) -> float:
        """When step `key` ends if nothing begins or ends before."""
        return self._last + self._work[key].remaining / self.rate
