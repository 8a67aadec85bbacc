"""`ForwardFaults`: what the engine does when a forward pass raises.

A forward that raises is rolled back (nothing of it counts as computed,
`PagedCache.step`) and its rows are scheduled again. Which row made it fail
is unknown when several shared the forward, so:

* rows of a failed batched forward run alone from then on (isolated), until
  a forward of theirs succeeds alone;
* a row whose forward fails alone `max_retries` times in a row is the fault:
  its request is aborted (FINISHED_ABORTED, the exception in
  `Request.error`); every other request goes on.

A transient fault (an out-of-memory error that passes, an interrupt of one
call) therefore costs a retry; a persistent one (a request the model cannot
run) costs that request only. O(rows of the failed forward) per failure.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class ForwardFaults:
    """Isolated requests and consecutive solo failures (see the module doc)."""

    __slots__ = ("max_retries", "_isolated", "_failures")

    def __init__(self, max_retries: int = 2) -> None:
        self.max_retries = max_retries
        self._isolated: set[Hashable] = set()
        self._failures: dict[Hashable, int] = {}

    def isolated(self, request_id: Hashable) -> bool:
        """Must this request's rows run alone? O(1)."""
        return request_id in self._isolated

    def failed(self, request_ids: list[Hashable]) -> list[Hashable]:
        """A forward over rows of `request_ids` raised. Returns the requests
        to abort: a lone row that failed `max_retries` times in a row."""
        if len(request_ids) > 1:
            self._isolated.update(request_ids)
            return []
        (request_id,) = request_ids
        self._isolated.add(request_id)
        count = self._failures.get(request_id, 0) + 1
        self._failures[request_id] = count
        return [request_id] if count >= self.max_retries else []

    def succeeded(self, request_ids: Iterable[Hashable]) -> None:
        """A forward over these requests' rows finished: they batch again."""
        for request_id in request_ids:
            self._isolated.discard(request_id)
            self._failures.pop(request_id, None)

    def forget(self, request_id: Hashable) -> None:
        """The request ended."""
        self._isolated.discard(request_id)
        self._failures.pop(request_id, None)
