"""Free loopback ports for tests that start a server process or socket."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks
    it; another process may take it before the caller binds, which is rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
