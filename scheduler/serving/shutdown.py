"""Graceful shutdown of `blockmgr serve`: every response ends cleanly.

uvicorn, on SIGTERM/SIGINT, stops accepting, waits for the in-flight
responses for its graceful timeout, then cancels their handlers: a whole
answer still waiting got a bare 500 and a stream was cut mid-chunk, and the
engine learnt of it only after. `GracefulServer` puts the engine first: at
the deadline (`deadline` seconds after the signal) it ends every live
request with `EngineStopped` (`AsyncEngine.abort_all`), so each handler
answers while its connection is still open (a whole answer: a 503 error
object; a stream: an error event, then `[DONE]`), and new requests are
refused (503). uvicorn's own timeout is `deadline + drain`: only a handler
that has not answered `drain` seconds after the abort is cancelled.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from scheduler.serving.async_engine import AsyncEngine, EngineStopped

#: Seconds the handlers get after the abort to send their last bytes.
DRAIN_SECONDS = 5.0

logger = logging.getLogger("uvicorn.error")


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown aborts the engine's requests at the
    deadline before any handler is cancelled (see the module doc)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, deadline: float,
                 drain: float = DRAIN_SECONDS) -> None:
        # uvicorn annotates this int | None, yet uses it as a timeout in seconds, where a
        # float works; rounding it to an int would change the shutdown deadline.
        config.timeout_graceful_shutdown = deadline + drain  # type: ignore[assignment]
        super().__init__(config)
        self.engine = engine
        self.deadline = deadline

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.deadline, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_in_flight(self) -> None:
        logger.info("blockmgr serve: shutdown deadline reached; ending the requests in flight")
        self.engine.abort_all(EngineStopped("the server is shutting down"))
