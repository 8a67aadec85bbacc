"""Free loopback ports for tests that start a server process or socket."""

from __future__ import annotations

import socket

#: Every port `free_port` handed out in this process.
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks
    it; another process may take it before the caller binds, which is rare),
    never one this process was given before: the OS hands a port it just
    gave out again when nothing bound it yet, and a fleet asks for several
    before its servers start (two replicas were once given the same port:
    the second could not bind, and the first answered the second's health
    check)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
