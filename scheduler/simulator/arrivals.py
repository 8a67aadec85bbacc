"""When the requests of a workload arrive: open-loop heads, closed-loop
clients and follow-ups, as one time-ordered queue.

A session head with an `arrival` time arrives then (open loop); one without
waits for a free client (closed loop, `concurrency` clients; the client is
busy until the session's last request finishes). A follow-up request
arrives `think_time` after the request it follows finishes.

One server's simulation and a fleet's router read the same queue, so a
fleet of one sees exactly the arrivals of one server. Each call costs
O(log queued) per request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from scheduler.simulator.workloads import RequestSpec

#: `add(when, session, index, closed)`: request `session[index]` arrived at
#: `when`; `closed` says it holds a closed-loop client.
AddFn = Callable[[float, list[RequestSpec], int, bool], None]


class Arrivals:
    """The queue of a run's arrivals over `sessions` (an iterator of
    sessions, open-loop heads in arrival order)."""

    def __init__(self, sessions: Iterator[list[RequestSpec]], concurrency: int) -> None:
        self._sessions = sessions
        self._heap: list = []
        self._order = itertools.count()
        self._next_head: list[RequestSpec] | None = None
        self._free_clients = concurrency

    def _pull_heads(self, now: float) -> None:
        """Move arrived open-loop heads, and closed-loop heads a client can
        take, into the event heap."""
        while True:
            if self._next_head is None:
                self._next_head = next(self._sessions, None)
                if self._next_head is None:
                    return
            head = self._next_head[0]
            if head.arrival is None:
                if self._free_clients == 0:
                    return
                self._free_clients -= 1
                self._push(now + head.think_time, self._next_head, 0, True)
            else:
                if head.arrival > now:
                    return
                self._push(head.arrival, self._next_head, 0, False)
            self._next_head = None

    def _push(self, when: float, session: list[RequestSpec], index: int, closed: bool) -> None:
        heapq.heappush(self._heap, (when, next(self._order), session, index, closed))

    def admit(self, now: float, add: AddFn) -> None:
        """Call `add` for every request arrived by `now`, in arrival order
        (ties in the order they were queued). `add` may queue follow-ups."""
        self._pull_heads(now)
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, session, index, closed = heapq.heappop(heap)
            add(when, session, index, closed)

    def next_time(self, now: float) -> float | None:
        """When the next request arrives (None: no request is left)."""
        times = []
        if self._heap:
            times.append(self._heap[0][0])
        if self._next_head is None:
            self._next_head = next(self._sessions, None)
        if self._next_head is not None:
            head = self._next_head[0]
            if head.arrival is not None:
                times.append(head.arrival)
            elif self._free_clients:
                times.append(now + head.think_time)
        return min(times) if times else None

    def follow(self, session: list[RequestSpec], index: int, closed: bool, now: float) -> None:
        """Request `session[index]` finished (or was aborted) at `now`:
        queue the session's next request, or free its client."""
        nxt = index + 1
        if nxt < len(session):
            self._push(now + session[nxt].think_time, session, nxt, closed)
        elif closed:
            self._free_clients += 1
