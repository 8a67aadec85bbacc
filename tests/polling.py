"""Waiting for a condition another thread makes true (a server, a relay)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll `condition` every 10 ms until it holds; fail the test naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.01)
