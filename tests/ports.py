"""Free TCP ports for servers the tests start on fixed addresses (a broker that must come
back on the same ports after a kill, a config file naming its peers)."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and never one this process handed out before: the
    kernel may give again a port it has just given (2 alike in 5 of 20,000 triples of
    calls), and a broker given one port twice fails to bind the second."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
